"""One GPU: how fast does minipar's engine train a GPT, against a plain PyTorch loop?

For each GPT preset, in one process and on the same GPU, two training loops run the
same model (``minipar.model.GPT``, same initial weights) on the same tokens:

* **minipar**: ``minipar.engine.build`` + ``train_step`` at world size 1, exactly what
  every rank of a real run executes (pipeline executor, DataParallel hooks when dp > 1,
  mixed precision with fp32 masters, global-norm clipping on the device), inside a
  process group of one this script opens itself (``engine.train`` would add a
  launcher and a process).
* **plain**: the loop anyone would write: bf16 weights, fp32 master copies, fused
  AdamW on the masters, ``clip_grad_norm_``, copy back. The same arithmetic as
  minipar's ``MixedPrecision`` (Micikevicius et al. 2018), without the machinery.

Both use bf16, SDPA's flash attention (forced, so a silent fallback fails loudly) and
the fused AdamW kernel; ``--compile`` compiles every transformer block in both.

Reported per preset: tokens/s (median step), model FLOPs utilisation (MFU; Chowdhery
et al. 2022, App. B: ``minipar.theory.params.model_flops_per_token`` x tokens/s over the
peak) against the datasheet's dense bf16 peak and against the bf16 matmul rate this GPU
actually reaches (8192^3 products on random data, measured first), minipar's overhead
(step time over the plain loop's, target <= 3%), and the peak allocated memory against
``minipar.theory.memory.memory_breakdown`` for the same micro-batch (what
``python -m minipar memory`` prints; its default accounting assumes stored attention
scores, so the flash-attention accounting is shown too).

    python benchmarks/gpu.py --json gpu.json               # the three presets
    python benchmarks/gpu.py --runs gpt-1.3b:8 --compile
    python benchmarks/gpu.py --device cpu --runs tiny:8 --steps 3   # a dry run anywhere
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time

import torch
import torch.distributed as dist

from minipar.config import TrainConfig, learning_rate
from minipar.engine import build, train_step
from minipar.mesh import Mesh
from minipar.model import GPT, get_config
from minipar.theory.layout import Layout
from minipar.theory.memory import memory_breakdown
from minipar.theory.params import model_flops_per_token

DATASHEET_TFLOPS = 989.0  # H100/H200 SXM, dense bf16 (NVIDIA datasheets)
GiB = 2**30


class RandomTokens:
    """Uniform random tokens; row r of step s depends on (seed, s, r) only, like
    ``minipar.data.MarkovData`` (``rows`` builds only the rows a replica needs)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def rows(self, step: int, row_indices, split: str = "train"
             ) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for r in row_indices:  # one generator per row: a row is the same in any layout
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 65_537 + int(r))
            out.append(torch.randint(self.vocab_size, (self.seq_len + 1,), generator=g))
        t = torch.stack(out)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows(step, range(batch_size))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stream_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def matmul_tflops(device: torch.device, n: int = 8192, iters: int = 20) -> float:
    """Median bf16 rate of an n x n x n product on random data (CUDA events on a GPU)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = []
    for i in range(iters + 3):  # three warm-ups
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            a @ b
            seconds = time.perf_counter() - t0
        if i >= 3:
            times.append(seconds)
    return 2 * n**3 / statistics.median(times) / 1e12


def block_seconds(cfg, tokens: int, tp: int, device: torch.device, iters: int = 5) -> float:
    """Median seconds of one ``minipar.model.Block``'s forward + backward on ``tokens``
    tokens (sequences of ``cfg.seq_len``) with its linear layers cut to one tensor-parallel
    rank's share (hidden/tp columns: whole heads, as ``minipar.parallel.tp`` splits them;
    no collectives). bf16 with flash attention on a GPU, fp32 on the CPU. The planner
    divides a layer's FLOPs by this measured pace instead of guessing an efficiency."""
    from minipar.model import Block

    h, f = cfg.d_model, cfg.d_ff
    with torch.device(device):
        block = Block(cfg)
        if tp > 1:  # one rank's share of each matrix, as Megatron's split leaves it
            a, m = block.attn, block.mlp
            a.qkv, a.proj = torch.nn.Linear(h, 3 * h // tp), torch.nn.Linear(h // tp, h)
            m.fc, m.proj = torch.nn.Linear(h, f // tp), torch.nn.Linear(f // tp, h)
    return forward_backward_seconds(block, (max(1, tokens // cfg.seq_len), cfg.seq_len, h),
                                    device, iters)


def forward_backward_seconds(module: torch.nn.Module, shape: tuple, device: torch.device,
                             iters: int = 5) -> float:
    """Median wall seconds of ``module(x).backward()`` on a random ``x`` of ``shape``,
    each call synchronised (so a host-bound module shows its launch time too)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    module.to(dtype)
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn_like(x)
    times = []
    with _attention_context(device):
        for i in range(iters + 2):  # two warm-ups
            _sync(device)
            t0 = time.perf_counter()
            y = module(x)
            y.backward(grad if y.shape == x.shape else None)  # a loss: d loss / d loss = 1
            _sync(device)
            if i >= 2:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Head(torch.nn.Module):
    """The model's end as the last pipeline stage runs it: final layer norm, the head
    (one tensor-parallel rank's vocabulary rows) and ``minipar.model.CrossEntropy`` (fp32
    logits) against random targets of that shard."""

    def __init__(self, cfg, tokens: int, tp: int, device: torch.device) -> None:
        from minipar.model import CrossEntropy

        super().__init__()
        with torch.device(device):
            self.ln_f = torch.nn.LayerNorm(cfg.d_model)
            self.head = torch.nn.Linear(cfg.d_model, cfg.vocab_size // tp, bias=False)
        self.loss_fn = CrossEntropy()
        b = max(1, tokens // cfg.seq_len)
        self.targets = torch.randint(cfg.vocab_size // tp, (b, cfg.seq_len), device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.head(self.ln_f(x)), self.targets)


def head_seconds(cfg, tokens: int, tp: int, device: torch.device, iters: int = 5) -> float:
    """Median seconds of the head and loss's forward + backward on ``tokens`` tokens at
    one tensor-parallel rank's vocabulary share (the vocabulary-parallel loss's three
    small all-reduces left out: the tp traffic counts them). The block timings leave
    this out; its fp32 softmax over the vocabulary is memory-bound, slower than 6 V h
    FLOPs per token at the matmul rate says."""
    head = _Head(cfg, tokens, tp, device)
    shape = (head.targets.shape[0], cfg.seq_len, cfg.d_model)
    return forward_backward_seconds(head, shape, device, iters)


def optimizer_seconds(n: int, device: torch.device, pieces: int = 8,
                      iters: int = 5) -> dict:
    """Seconds per parameter of what a ZeRO shard's owner does each step beyond the
    blocks, on ``n`` parameters in ``pieces`` flats (like ``ZeroOptimizer``'s buckets):
    ``step``: the global-norm clip (``global_grad_norm``, one fused scale), AdamW on the
    fp32 masters (fused on a GPU, as ``train --fused`` and the benchmarks run it) and
    ``publish``'s cast of the new masters into the 16-bit weights; ``accumulate``: one
    micro-batch's 16-bit gradient added into the fp32 bucket (``ZeroOptimizer._on_grad``).
    All memory-bound, so linear in ``n``: 64 M parameters (about 1.3 GB of states) give
    the pace of 1.3 B."""
    from minipar.parallel.zero.shards import global_grad_norm

    cuda = device.type == "cuda"
    low = torch.bfloat16 if cuda else torch.float32
    size = -(-n // pieces)
    masters = [torch.zeros(size, device=device, requires_grad=True) for _ in range(pieces)]
    weights = [torch.zeros(size, dtype=low, device=device) for _ in range(pieces)]
    grads = [torch.randn(size, dtype=low, device=device) for _ in range(pieces)]
    for m in masters:
        m.grad = torch.zeros_like(m)
    opt = torch.optim.AdamW(masters, lr=1e-4, **({"fused": True} if cuda else {}))

    def step() -> None:
        norm = global_grad_norm(m.grad for m in masters)
        torch._foreach_mul_([m.grad for m in masters], (1.0 / (norm + 1e-6)).clamp(max=1.0))
        opt.step()
        with torch.no_grad():
            for m, w in zip(masters, weights):
                w.copy_(m.detach().to(low))

    def accumulate() -> None:
        for m, g in zip(masters, grads):
            m.grad.add_(g)

    out = {}
    for name, fn in (("step", step), ("accumulate", accumulate)):
        times = []
        for i in range(iters + 2):  # two warm-ups (the first step allocates the moments)
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) / (size * pieces)
    return out


def _attention_context(device: torch.device):
    """Force flash attention on a GPU: a fallback to another kernel must not pass."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def _compile_blocks(model: GPT) -> None:
    for block in model.blocks:
        block.compile()


def _timed(step_fn, steps: int, warmup: int, device: torch.device) -> tuple[list, list]:
    """Run warm-up then timed steps; every step ends on a loss read (a sync), as
    ``train_step`` does. Returns (losses, seconds per timed step).

    Each step is timed until the compute stream is idle, as a training loop's loss read
    waits: communication still in flight (ZeRO-1/2's weight gathers, which the next
    forward waits for) is paid by the step that needs it. Consecutive steps' windows
    tile the run, so their sum is its wall time. (A whole-device synchronize would
    charge every step its trailing transfers and hide what overlapping them saves.)"""
    losses, times = [], []
    with _attention_context(device):
        for step in range(warmup + steps):
            _stream_sync(device)
            t0 = time.perf_counter()
            losses.append(step_fn(step))
            _stream_sync(device)
            if step >= warmup:
                times.append(time.perf_counter() - t0)
    return losses, times


def run_minipar(cfg: TrainConfig, steps: int, warmup: int, compile_: bool) -> dict:
    """The engine's world-size-1 path: build + train_step, nothing else."""
    device = torch.device("cuda" if cfg.device == "cuda" else "cpu")
    rm = Mesh(1, 1, 1).connect()
    parts = build(cfg, rm)
    if compile_:
        _compile_blocks(parts.model)
    model_cfg = parts.model.cfg
    data = RandomTokens(model_cfg.vocab_size, model_cfg.seq_len, cfg.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = _timed(lambda s: train_step(cfg, rm, parts, data, s)["loss"],
                           steps, warmup, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    parts.data_parallel.remove()  # release the gradient hooks (and with them the model)
    parts.executor.close()
    return {"losses": losses, "times": times, "peak_bytes": peak}


def run_plain(cfg: TrainConfig, steps: int, warmup: int, compile_: bool) -> dict:
    """The hand-written loop: bf16 model, fp32 masters, fused AdamW, clip, copy back."""
    from minipar.config import lr_at

    device = torch.device("cuda" if cfg.device == "cuda" else "cpu")
    # the same initial weights as the engine's build (by name, from the seed)
    model = GPT(cfg.model_config(), seed=cfg.seed, device=device)
    masters = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    model.to(torch.bfloat16)
    params = list(model.parameters())
    if compile_:
        _compile_blocks(model)
    opt = torch.optim.AdamW(masters, lr=learning_rate(cfg), weight_decay=cfg.weight_decay,
                            fused=True)
    data = RandomTokens(model.cfg.vocab_size, model.cfg.seq_len, cfg.seed)

    def step_fn(step: int) -> float:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = (t.to(device, non_blocking=True) for t in data.batch(step, cfg.batch_size))
        loss = model(x, y)
        loss.backward()
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, cfg.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
        return loss.item()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = _timed(step_fn, steps, warmup, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"losses": losses, "times": times, "peak_bytes": peak}


def measure(preset: str, micro: int, args, ceiling: float) -> dict:
    """Both loops on one preset; the plain one second, on a freed GPU."""
    backend = "nccl" if args.device == "cuda" else "gloo"
    cfg = TrainConfig(model=preset, dtype="bf16", backend=backend, device=args.device,
                      batch_size=micro, microbatches=1, steps=args.warmup + args.steps,
                      warmup=args.warmup, lr=3e-4, fused=True, recompute=args.recompute,
                      seed=0)
    out = {}
    for name, fn in (("minipar", run_minipar), ("plain", run_plain)):
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        out[name] = fn(cfg, args.steps, args.warmup, args.compile)
        print(f"  {preset} {name}: median step "
              f"{1e3 * statistics.median(out[name]['times']):.1f} ms, losses "
              f"{out[name]['losses'][0]:.4f} -> {out[name]['losses'][-1]:.4f}", flush=True)
    model_cfg = get_config(preset)
    tokens = micro * model_cfg.seq_len
    flops = model_flops_per_token(model_cfg)
    row = {"preset": preset, "micro_batch": micro, "seq_len": model_cfg.seq_len,
           "tokens_per_step": tokens, "flops_per_token": flops, "compile": args.compile,
           "recompute": args.recompute}
    for name in ("minipar", "plain"):
        step = statistics.median(out[name]["times"])
        tps = tokens / step
        row[name] = {"step_ms": 1e3 * step, "tokens_per_s": tps,
                     "tflops": tps * flops / 1e12,
                     "mfu_datasheet": tps * flops / 1e12 / args.peak_tflops,
                     "mfu_measured": tps * flops / 1e12 / ceiling,
                     "peak_gib": out[name]["peak_bytes"] / GiB,
                     "losses": out[name]["losses"], "times": out[name]["times"]}
    row["overhead"] = row["minipar"]["step_ms"] / row["plain"]["step_ms"] - 1
    row["loss_diff_last"] = abs(out["minipar"]["losses"][-1] - out["plain"]["losses"][-1])
    for acc in ("korthikanti", "fused"):
        mem = memory_breakdown(preset, Layout(microbatch_size=micro, dtype="bf16",
                                              recompute=args.recompute), accounting=acc)
        row[f"predicted_gib_{acc}"] = mem["total"] / GiB
    return row


def table(rows: list[dict]) -> str:
    lines = ["| preset | tokens/step | loop | step ms | tokens/s | TFLOP/s | MFU (datasheet)"
             " | MFU (measured matmul) | overhead | peak GiB | predicted GiB "
             "(CLI / flash) | peak / predicted (flash) |", "|---" * 12 + "|"]
    for r in rows:
        for name in ("minipar", "plain"):
            m = r[name]
            extra = (f"{100 * r['overhead']:+.1f}%", f"{m['peak_gib']:.1f}",
                     f"{r['predicted_gib_korthikanti']:.1f} / {r['predicted_gib_fused']:.1f}",
                     f"{m['peak_gib'] / r['predicted_gib_fused']:.2f}")
            if name == "plain":
                extra = ("", f"{m['peak_gib']:.1f}", "",
                         f"{m['peak_gib'] / r['predicted_gib_fused']:.2f}")
            lines.append(f"| {r['preset']} (mb {r['micro_batch']}) | {r['tokens_per_step']} "
                         f"| {name} | {m['step_ms']:.1f} | {m['tokens_per_s']:,.0f} | "
                         f"{m['tflops']:.0f} | {100 * m['mfu_datasheet']:.1f}% | "
                         f"{100 * m['mfu_measured']:.1f}% | " + " | ".join(extra) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="gpt2-125m:16,gpt2-350m:16,gpt-1.3b:8",
                    help="preset:micro-batch, comma separated")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per loop")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="torch.compile every block")
    ap.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=("cuda", "cpu"))
    ap.add_argument("--peak-tflops", type=float, default=DATASHEET_TFLOPS)
    ap.add_argument("--json", help="write every figure (and each step's time) here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            store=dist.HashStore(), rank=0, world_size=1)
    try:
        ceiling = matmul_tflops(device, 8192 if device.type == "cuda" else 512)
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        print(f"{name}, torch {torch.__version__}: bf16 matmul {ceiling:.0f} TFLOP/s "
              f"measured, {args.peak_tflops:.0f} datasheet", flush=True)
        rows = []
        for spec in args.runs.split(","):
            preset, micro = spec.split(":")
            rows.append(measure(preset, int(micro), args, ceiling))
    finally:
        dist.destroy_process_group()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "matmul_tflops": ceiling,
                       "datasheet_tflops": args.peak_tflops, "args": vars(args),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
