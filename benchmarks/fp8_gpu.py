"""Float8 training on GPUs (``minipar/parallel/fp8.py``): kernels, speed against bf16 in
the same job, the loss on real text, and torchao's ``Float8Linear`` as the peer.

Run from the repository root with ``PYTHONPATH=.``; one JSON (``--out FILE``), rewritten
after every row; one row failing records its error and the run goes on; rows past
``--budget-s`` are recorded as skipped. Ranks are started by ``minipar.launch`` or
``engine.train`` (one per GPU, NCCL, spawned). Sections (``--sections``), in order:

* ``kernel`` (one GPU, ~30 s): 8192^3 bf16 matmul against ``torch._scaled_mm``
  tensorwise and rowwise (e4m3 x e4m3, and e5m2 x e4m3: the gradient GEMMs); minipar's
  float8 linear with the real kernels against its fp32 emulation (the CPU tests' path)
  on the same operands; one linear of gpt-13b's MLP (8192 tokens, 5120 -> 20480),
  forward + backward, bf16 against each recipe: where the casts' time goes.
* ``speed`` (N GPUs, ~4.5 min): tokens/s of ``engine.build`` + ``train_step`` (what every
  rank of ``python -m minipar train`` runs), bf16 against ``--fp8 rowwise`` and
  ``--fp8 tensorwise``: gpt-13b dp N ZeRO-3 full recompute (4 sequences per GPU), then
  gpt-1.3b dp N ZeRO-3 (8 per GPU); median of 6 steps after 2 warm-ups, per step the
  slowest rank. ``mfu`` is over the dense bf16 peak for every row (989 TFLOP/s).
* ``fit`` (N GPUs, ~4 min): gpt-13b as a user on 80 GB cards would run each recipe: dp N
  ZeRO-3, 4 sequences a GPU, recomputing the fewest blocks that fit (``fitted_layout``:
  bf16 10 of 40 in full and the rest cheaply, as the planner; float8 9 in full, its
  compiled blocks keeping less), tokens/s against bf16's in the same job.
* ``loss`` (N GPUs, ~2 min): 300 steps of gpt2-125m on Python's own sources
  (``--data pystdlib``, bytes) at dp N ZeRO-1, bf16 against both recipes: the losses,
  and the ratio of the last 20 steps' mean loss to bf16's (target: within 1%); with
  ``--seeds 0,1,2`` once per seed (the data order and the initialisation), which says
  how far two bf16 runs land apart.
* ``peer`` (one GPU, ~1.2 min): torchao's ``convert_to_float8_training`` (blocks only,
  as minipar) on the same GPT (gpt-1.3b, 8 sequences in 2 micro-batches) in bf16 with
  fused AdamW, bf16 against both recipes, eager (torchao is built for ``torch.compile``:
  ``--peer-compile`` compiles the model). Skipped when ``import torchao`` fails: install
  the carried wheel first (``pip install --no-deps .whl/torchao-0.18.0-*.whl``; 0.18.0
  is the release built for torch 2.11).
* ``speed1`` (one GPU, ~1.2 min): minipar at the peer's size, bf16 and both recipes.
  ``--one-model gpt-13b --one-layers 6`` makes both sections a slice of a bigger model:
  its first 6 blocks at full width, with its head and embeddings.

The default run stops starting rows after ``--budget-s`` 420 s (about 7.5 min in all on
4 x H100): the last section may be skipped; ``--sections peer,speed1`` runs it alone.
With ``--fp8 tensorwise`` ZeRO-3 gathers the blocks' linear weights as float8 bytes
(``minipar/parallel/zero/gather.py``; rowwise ones in bf16, as torchao does): each speed
row has the counted ``comm_wire_bytes_per_step`` and ``theory.comm_volume``'s
``predicted_all_gather_wire_bytes_per_step``; each float8 row ``wire_bytes_saved_vs_bf16``
(counted) beside ``predicted_wire_bytes_saved_vs_bf16`` (the all-gathers' float8 bytes
less the amax all-reduce): they agree for tensorwise, and are 0 for rowwise.

    export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        NVSHMEM_DISABLE_NVLS=1
    pip install --no-deps .whl/torchao-0.18.0-*.whl          # the peer (optional)
    python benchmarks/fp8_gpu.py --out $OUT/fp8.json        # ~7.5 min on 4 x H100
    python benchmarks/fp8_gpu.py --sections peer,speed1 --out $OUT/fp8_1gpu.json
    python benchmarks/fp8_gpu.py --device cpu --gpus 2 --out /tmp/fp8.json   # dry run
"""

from __future__ import annotations

import os

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"})  # NVLink multicast off, in every rank

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import multigpu  # noqa: E402
import torch  # noqa: E402
from gpu import DATASHEET_TFLOPS, RandomTokens, _timed  # noqa: E402

from minipar.model import get_config  # noqa: E402
from minipar.theory import clusters  # noqa: E402
from minipar.theory.comm_volume import comm_volume  # noqa: E402
from minipar.theory.layout import Layout  # noqa: E402
from minipar.theory.params import model_flops_per_token  # noqa: E402
from minipar.theory.planner import card_fit, fewest_recomputed  # noqa: E402

SECTIONS = ("kernel", "speed", "fit", "loss", "peer", "speed1")
RECIPES = (None, "rowwise", "tensorwise")  # None: bf16
GiB = 2**30


# --- kernel: one GPU -----------------------------------------------------------------------
def _cuda_seconds(fn, iters: int = 10) -> float:
    """Median seconds of ``fn()`` (CUDA events; wall clock on a CPU)."""
    times = []
    for i in range(iters + 3):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            t = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
        if i >= 3:
            times.append(t)
    return statistics.median(times)


def _kernel_rank(n: int, tokens: int, d_in: int, d_out: int) -> dict:
    """The matmul rates, the kernel path against the emulation, one linear's time."""
    from minipar.parallel.fp8 import Float8Matmul

    device = multigpu._local_device()
    cuda = device.type == "cuda"
    out: dict = {"device_name": multigpu._device_name(device), "n": n}
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    flops = 2 * n**3
    out["bf16_tflops"] = flops / _cuda_seconds(lambda: a @ b) / 1e12
    for recipe in ("tensorwise", "rowwise"):
        f8 = Float8Matmul(recipe, emulate=not cuda)
        for fmt_a in ("e4m3", "e5m2"):
            qa = f8.quantize(a, ("tokens", "in"), getattr(torch, {
                "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}[fmt_a]))
            qb = f8.quantize(b, ("out", "in"), torch.float8_e4m3fn)
            key = f"{recipe}_{fmt_a}xe4m3"
            try:
                for fast in (False, True):
                    s = _cuda_seconds(lambda f=fast, f8=f8, qa=qa, qb=qb:
                                      f8.mm(qa, qb, torch.bfloat16, f))
                    out[f"{key}{'_fast_accum' if fast else ''}_tflops"] = flops / s / 1e12
            except Exception as e:  # a kernel this torch lacks: recorded, not fatal
                out[f"{key}_error"] = multigpu._error_text(e)
    a = b = None  # (freed)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, d_in, device=device, generator=g).bfloat16()
    w = (torch.randn(d_out, d_in, device=device, generator=g) / d_in**0.5).bfloat16()
    dy = torch.randn(tokens, d_out, device=device, generator=g).bfloat16()

    def fwd_bwd(linear):
        xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = linear(xs, ws)
        y.backward(dy.to(y.dtype))
        return y.detach(), xs.grad, ws.grad

    exact = fwd_bwd(lambda xs, ws: (xs.float() @ ws.float().t()))
    out["linear_shape"] = [tokens, d_in, d_out]
    out["linear_bf16_ms"] = 1e3 * _cuda_seconds(lambda: fwd_bwd(torch.nn.functional.linear))
    for recipe in ("rowwise", "tensorwise"):
        try:
            real = fwd_bwd(Float8Matmul(recipe, emulate=not cuda))
            emulated = fwd_bwd(Float8Matmul(recipe, emulate=True))
            rel = {k: float((r.float() - e.float()).norm() / e.float().norm())
                   for k, r, e in zip(("y", "dx", "dw"), real, emulated)}
            err = {k: float((r.float() - e.float()).norm() / e.float().norm())
                   for k, r, e in zip(("y", "dx", "dw"), real, exact)}
            out[f"{recipe}_kernel_vs_emulated"] = rel
            out[f"{recipe}_vs_fp32"] = err
            out[f"linear_{recipe}_ms"] = 1e3 * _cuda_seconds(
                lambda r=recipe: fwd_bwd(Float8Matmul(r, emulate=not cuda)))
        except Exception as e:
            out[f"linear_{recipe}_error"] = multigpu._error_text(e)
    return out


def section_kernel(run: multigpu.Run, state: dict) -> None:
    n, shape = (8192, (8192, 5120, 20480)) if run.cuda else (256, (256, 64, 256))

    def go() -> dict:
        rec = next(iter(run.launch(_kernel_rank, 1, n, *shape, cap=120)))
        state["grad_e4m3"] = "rowwise_e5m2xe4m3_error" in rec  # this torch's rowwise kernel
        bf16 = rec["bf16_tflops"]
        rec["brief"] = (f"bf16 {bf16:.0f} TFLOP/s; rowwise "
                        f"{rec.get('rowwise_e4m3xe4m3_fast_accum_tflops', 0):.0f}, tensorwise "
                        f"{rec.get('tensorwise_e4m3xe4m3_fast_accum_tflops', 0):.0f}; linear "
                        f"bf16 {rec['linear_bf16_ms']:.2f} ms, rowwise "
                        f"{rec.get('linear_rowwise_ms', 0):.2f}, tensorwise "
                        f"{rec.get('linear_tensorwise_ms', 0):.2f}")
        return rec

    run.row("kernel", "matmul and linear", go)


# --- speed: engine.build + train_step, bf16 against float8 ------------------------------------
def _speed_rank(spec: dict) -> dict:
    """``multigpu._speed_rank`` (build, warm up, time); with ``grad_e4m3`` the gradient
    operand is cast to e4m3 (a torch whose rowwise kernel takes no e5m2 operand)."""
    if spec.get("grad_e4m3"):
        from minipar.parallel import fp8

        fp8.E5M2 = torch.float8_e4m3fn
    return multigpu._speed_rank(spec)


def _measure(run: multigpu.Run, spec: dict, cap: float) -> dict:
    res = list(run.launch(_speed_rank, spec["world"], spec, cap=cap))
    per_step = [max(r["times"][i] for r in res) for i in range(len(res[0]["times"]))]
    step = statistics.median(per_step)
    mc = get_config(spec["model"]).with_(**spec.get("overrides", {}))
    tokens = spec["batch"] * mc.seq_len
    row = {"step_s": step, "step_s_all": per_step, "tokens_per_s": tokens / step,
           "mfu": tokens / step * model_flops_per_token(mc)
           / (spec["world"] * DATASHEET_TFLOPS * 1e12),
           "peak_gib": max(r["peak_bytes"] for r in res) / GiB,
           "losses": next(r["losses"] for r in res if r["losses"][-1] is not None),
           "comm_wire_bytes_per_step": max(r.get("comm_wire_bytes_per_step", 0) for r in res),
           "device_name": res[0]["device_name"]}
    row["brief"] = (f"{1e3 * step:.0f} ms, {row['tokens_per_s']:,.0f} tok/s, MFU "
                    f"{100 * row['mfu']:.1f}%, peak {row['peak_gib']:.1f} GiB")
    return row


def _predicted_dp(model: str, recipe: str | None, layout: dict) -> tuple[int, int]:
    """theory.comm_volume's wire bytes per step under dp: (all-gathers, all-reduces)."""
    vol = comm_volume(model, Layout(dp=layout.get("dp", 1), zero=layout.get("zero", 0),
                                    dtype="bf16", microbatches=layout.get("microbatches", 1),
                                    fp8=recipe)).get("dp", {})
    return tuple(vol.get(op, {}).get("wire_bytes", 0) for op in ("all_gather", "all_reduce"))


def _speed_rows(run: multigpu.Run, state: dict, section: str, model: str, world: int,
                batch: int, overrides: dict | None = None, layout_of=None,
                **layout) -> None:
    """bf16, then each float8 recipe, in ``layout`` (``layout_of(recipe)``: each its own),
    every float8 row beside the bf16 one."""
    base = None
    overrides = overrides or {}
    base_gather = _predicted_dp(model, None, layout_of(None) if layout_of else layout)[0]
    for recipe in RECIPES:
        layout = layout_of(recipe) if layout_of else layout
        gather, amax = _predicted_dp(model, recipe, layout)
        spec = multigpu.minipar_spec(run, model, world, batch, overrides, fp8=recipe, **layout,
                                     fp8_emulate=recipe is not None and not run.cuda)
        spec["grad_e4m3"] = recipe == "rowwise" and state.get("grad_e4m3", False)
        name = f"{model}{_slice(overrides)} {'bf16' if recipe is None else recipe} " + " ".join(
            f"{k}={v}" for k, v in layout.items())
        cap = 300 if "13b" in model else 180

        def go(spec=spec, base=base, cap=cap, gather=gather, amax=amax) -> dict:
            row = _measure(run, spec, cap)
            row["predicted_all_gather_wire_bytes_per_step"] = gather
            row["brief"] += f", dp wire {row['comm_wire_bytes_per_step'] / 1e9:.3g} GB/step"
            if base is not None:
                row["speedup_vs_bf16"] = row["tokens_per_s"] / base["tokens_per_s"]
                row["wire_bytes_saved_vs_bf16"] = (base["comm_wire_bytes_per_step"]
                                                   - row["comm_wire_bytes_per_step"])
                row["predicted_wire_bytes_saved_vs_bf16"] = base_gather - gather - amax
                saved, want = (row[k] / 1e9 for k in ("wire_bytes_saved_vs_bf16",
                                                       "predicted_wire_bytes_saved_vs_bf16"))
                row["brief"] += (f" ({saved:.3g} GB less, predicted {want:.3g}), "
                                 f"{row['speedup_vs_bf16']:.2f}x bf16")
            return row

        rec = run.row(section, name, go, fp8=recipe, grad_e4m3=spec["grad_e4m3"],
                      command=_command(model, world, batch, recipe,
                                       {**layout, **_layer_flag(overrides)}))
        if recipe is None and rec is not None and rec.get("status") == "ok":
            base = rec


def _command(model: str, world: int, batch: int, recipe: str | None, layout: dict) -> str:
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in layout.items())
    fp8 = f" --fp8 {recipe}" if recipe else ""
    return (f"python -m minipar train --model {model} --batch-size {batch} {flags} "
            f"--dtype bf16 --backend nccl --fused{fp8}")


def section_speed(run: multigpu.Run, state: dict) -> None:
    n = run.n
    big, small = ("gpt-13b", "gpt-1.3b") if run.cuda else ("small", "tiny")
    _speed_rows(run, state, "speed", big, n, 4 * n, dp=n, zero=3, recompute="full")
    _speed_rows(run, state, "speed", small, n, 8 * n, dp=n, zero=3)


def fitted_layout(model: str, world: int, recipe: str | None) -> dict:
    """dp ``world`` ZeRO-3, 4 sequences a GPU, recomputing the fewest blocks (the first
    N) that fit an 80 GB H100, as the planner finds them (``planner.fewest_recomputed``):
    bf16 as the planner puts it first, the other blocks recomputed cheaply (eager: a
    compiled block cannot recompute cheaply); float8 with its compiled blocks, which keep
    less (``theory.memory``), the others kept. None recomputed where all fit."""
    cfg = get_config(model)
    rest = {} if recipe else {"recompute_rest": "cheap"}
    layout = Layout(dp=world, zero=3, microbatch_size=4, recompute="full", dtype="bf16",
                    optimizer_kernel="fused", fp8=recipe, compiled=recipe is not None, **rest)
    h100 = clusters.cluster(world, "H100-80GB", world)
    if card_fit(cfg, h100, layout.with_(recompute="none", recompute_rest="none"))[1]:
        return dict(dp=world, zero=3)
    n = fewest_recomputed(cfg, h100, layout, {})
    return dict(dp=world, zero=3, recompute="full",
                **({"recompute_layers": n} if n is not None else {}), **rest)


def section_fit(run: multigpu.Run, state: dict) -> None:
    n = run.n
    big = "gpt-13b" if run.cuda else "small"
    _speed_rows(run, state, "fit", big, n, 4 * n,
                layout_of=lambda recipe: fitted_layout(big, n, recipe))


def _slice(overrides: dict) -> str:
    """A row name's mark for a model cut to fewer blocks: " x6" for 6."""
    return f" x{overrides['n_layer']}" if "n_layer" in overrides else ""


def _layer_flag(overrides: dict) -> dict:
    return {"layers": overrides["n_layer"]} if "n_layer" in overrides else {}


def _one_gpu_model(run: multigpu.Run) -> tuple[str, dict]:
    """The model of the one-GPU sections (``--one-model``, ``--one-layers``)."""
    layers = run.args.one_layers
    return run.args.one_model if run.cuda else "tiny", ({"n_layer": layers} if layers else {})


def section_speed1(run: multigpu.Run, state: dict) -> None:
    model, overrides = _one_gpu_model(run)
    _speed_rows(run, state, "speed1", model, 1, 8, overrides, microbatches=2)


# --- loss on real text ------------------------------------------------------------------------
def section_loss(run: multigpu.Run, state: dict) -> None:
    n, steps = run.n, run.args.loss_steps
    for seed in (int(x) for x in run.args.seeds.split(",")):
        _loss_rows(run, n, steps, seed)


def _loss_rows(run: multigpu.Run, n: int, steps: int, seed: int) -> None:
    from minipar.config import TrainConfig
    from minipar.engine import train

    base = None
    for recipe in RECIPES:
        cfg = TrainConfig(model="gpt2-125m" if run.cuda else "tiny", data="pystdlib",
                          dp=n, zero=1, batch_size=8 * n, dtype="bf16", steps=steps,
                          warmup=min(30, steps // 10), lr=6e-4, fp8=recipe, seed=seed,
                          fp8_emulate=recipe is not None and not run.cuda,
                          backend=run.backend, fused=run.cuda, log_every=steps,
                          timeout=run.timeout(240))

        def go(cfg=cfg, base=base) -> dict:
            losses = train(cfg)["losses"]
            tail = statistics.fmean(losses[-20:])
            row = {"losses": losses, "final_loss": tail,
                   "brief": f"last 20 steps' mean loss {tail:.4f}"}
            if base is not None:
                row["final_loss_ratio_vs_bf16"] = tail / base["final_loss"]
                row["brief"] += f", {row['final_loss_ratio_vs_bf16']:.4f} x bf16's"
            return row

        rec = run.row("loss", f"{cfg.model} pystdlib {recipe or 'bf16'}"
                      + (f" seed {seed}" if seed else ""), go, fp8=recipe, steps=steps,
                      seed=seed)
        if recipe is None and rec is not None and rec.get("status") == "ok":
            base = rec


# --- the peer: torchao's Float8Linear ---------------------------------------------------------
def _peer_rank(model: str, batch: int, micro: int, recipe: str | None, steps: int,
               warmup: int, compile_: bool, overrides: dict | None = None) -> dict:
    import torchao
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from minipar.model import GPT

    device = multigpu._local_device()
    mc = get_config(model).with_(**(overrides or {}))
    net = GPT(mc, seed=0, device=device).to(torch.bfloat16)
    if recipe is not None:
        convert_to_float8_training(net, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=lambda m, fqn: fqn.startswith("blocks."))
    if compile_:
        net = torch.compile(net)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4, fused=device.type == "cuda")
    data = RandomTokens(mc.vocab_size, mc.seq_len, 0)

    def step_fn(s: int) -> float:
        x, y = (t.to(device) for t in data.batch(s, batch))
        total = 0.0
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            loss = net(xm, ym) / micro
            loss.backward()
            total = total + loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = _timed(step_fn, steps, warmup, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"times": times, "losses": losses, "peak_bytes": peak,
            "torchao": torchao.__version__, "device_name": multigpu._device_name(device)}


def section_peer(run: multigpu.Run, state: dict) -> None:
    try:
        import torchao
    except ImportError as e:
        run.section("peer")["rows"].append({"name": "torchao", "status": "skipped",
                                            "reason": f"import torchao failed: {e}"})
        return print(f"peer: skipped (import torchao failed: {e})", flush=True)
    (model, overrides), batch = _one_gpu_model(run), 8
    base = None
    for recipe in RECIPES:
        def go(recipe=recipe, base=base) -> dict:
            s = run.sizes
            res = next(iter(run.launch(_peer_rank, 1, model, batch, 2, recipe, s.steps,
                                       s.warmup, run.args.peer_compile, overrides,
                                       cap=240)))
            step = statistics.median(res["times"])
            tps = batch * get_config(model).seq_len / step
            row = {"step_s": step, "tokens_per_s": tps, "peak_gib": res["peak_bytes"] / GiB,
                   "losses": res["losses"], "torchao": res["torchao"],
                   "brief": f"{1e3 * step:.0f} ms, {tps:,.0f} tok/s"}
            if base is not None:
                row["speedup_vs_bf16"] = tps / base["tokens_per_s"]
                row["brief"] += f", {row['speedup_vs_bf16']:.2f}x bf16"
            return row

        rec = run.row("peer", f"torchao {model}{_slice(overrides)} {recipe or 'bf16'}"
                      + (" compiled" if run.args.peer_compile else ""), go, fp8=recipe,
                      torchao=torchao.__version__)
        if recipe is None and rec is not None and rec.get("status") == "ok":
            base = rec


# --- main ---------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--gpus", type=int, default=None, help="ranks (default: every GPU)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="rows starting after this many seconds are recorded as skipped")
    p.add_argument("--loss-steps", type=int, default=300)
    p.add_argument("--peer-compile", action="store_true")
    p.add_argument("--seeds", default="0", help="loss: one bf16 and float8 run per seed")
    p.add_argument("--one-model", default="gpt-1.3b", help="peer, speed1: the model")
    p.add_argument("--one-layers", type=int, default=None,
                   help="peer, speed1: that model's width with this many blocks")
    p.add_argument("--only", help="regular expression: run only matching rows")
    args = p.parse_args()
    sections = args.sections.split(",")
    for s in sections:
        if s not in SECTIONS:
            p.error(f"unknown section {s!r}; choose from {', '.join(SECTIONS)}")
    if args.device == "cpu":
        args.loss_steps = min(args.loss_steps, 20)
    run = multigpu.Run.for_script(args, "fp8_gpu")
    state: dict = {}
    for name in SECTIONS:
        if name in sections:
            globals()[f"section_{name}"](run, state)
    run.save()
    print(f"wrote {run.path} in {time.monotonic() - run.t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
