"""Several GPUs of one host: NCCL parity, speed against the PyTorch-native peers, data-
parallel scaling, the planner checked against real runs, and a trace; one command, one
JSON.

Run from the repository root with ``PYTHONPATH=.``; it starts its own ranks (one per
GPU, NCCL, through ``minipar.launch`` and ``minipar.engine.train``; spawned, so CUDA is
never initialised in this process). Sections (``--sections``, comma separated):

* ``calibrate``: this machine's bf16 matmul rate, the pace of the benchmarked presets'
  transformer block (forward + backward, per micro-batch size and tp share), and NCCL
  all-reduce / all-gather / reduce-scatter / send-recv times over 1 KB .. 1 GB, fitted
  to a latency and a bandwidth per op, written to ``calibration.json`` (``python -m minipar plan
  --calibrate FILE`` reads it). Cheap (about 30 s): run it in every call, so that every
  call's JSON carries its own machine's numbers.
* ``parity``: the covering matrix (dp with ZeRO 0-3, tp with and without sp, pp with
  every schedule, 2-D/3-D mixes, recomputation, tied embeddings across stages, plain SGD
  without clipping), fp32 and bf16, each run by ``engine.train`` on NCCL and compared
  with ``engine.train_reference`` (one process, fp32, CPU: the yardstick the tolerances
  were measured on) by ``minipar.parity.compare``: losses, per-step gradient norms and
  final parameters (from a ``--save`` checkpoint), against ``parity.TOLERANCES``. A
  layout ``config.validate`` refuses is recorded with its reason.
* ``speed`` (groups ``--speed dp,tp,pp,big``): gpt-1.3b, seq 2048, bf16, flash SDPA.
  minipar (``engine.build`` + ``train_step``: what every rank of ``python -m minipar
  train`` runs, minus the per-step activation meter) against DDP and FSDP2 at dp = N,
  DTensor TP at tp = N, ``torch.distributed.pipelining`` at pp = N, and gpt-13b in the
  planner's best layout that minipar accepts against FSDP2 with activation
  checkpointing. Per row: median step time (per step the slowest rank), tokens/s, MFU
  over the 989 TFLOP/s dense bf16 data sheet peak, peak allocated memory, and for the
  dp rows the exposed communication (step time minus a one-GPU step on the same
  per-GPU batch, where nothing is reduced); for pp rows the bubble measured from the
  executor's synchronised timeline against ``minipar.theory.bubble``. The pp rows run
  eager (the default), compiled, and compiled without weight-gradient fusion (one graph
  a block instead of one between each pair of linears: what a compiled block costs the
  host per call).
* ``scaling``: minipar ZeRO-1 tokens/s at 1, 2 and N GPUs, same batch per GPU.
* ``trace``: ``engine.train(trace=...)`` of a dp2 x pp2 run (and pp2 x tp2) under --out.

Whenever calibration and speed/scaling rows exist, ``predict`` puts the planner's
step time and peak memory (calibrated cluster, fused-attention accounting) beside each
measured row. One configuration failing records its error and the run goes on; the
JSON (``--out``/multigpu.json) is rewritten after every row; rows past ``--budget-s``
are recorded as skipped. ``--report A.json B.json ...`` merges the JSONs of several
calls (on any machine, no GPU needed) and recomputes predictions and the summary.

Commands for the lead (four calls, each estimated under 9 minutes on 4 x H100):

    export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
        NVSHMEM_DISABLE_NVLS=1
    # 1 (~7 min): the parity matrix
    python benchmarks/multigpu.py --sections calibrate,parity --out $OUT --budget-s 520
    # 2 (~7 min): data parallel against DDP / FSDP2, and scaling
    python benchmarks/multigpu.py --sections calibrate,speed,scaling --speed dp \
        --out $OUT --budget-s 520
    # 3 (~7.5 min): tensor and pipeline parallel against DTensor / pipelining
    python benchmarks/multigpu.py --sections calibrate,speed --speed tp,pp \
        --out $OUT --budget-s 520
    # 4 (~5 min): gpt-13b (planner's layout vs FSDP2 + checkpointing), traces
    python benchmarks/multigpu.py --sections calibrate,speed,trace --speed big \
        --out $OUT --budget-s 520
    # afterwards, anywhere (no GPU): one JSON and summary from the four
    python benchmarks/multigpu.py --report c1/multigpu.json c2/multigpu.json \
        c3/multigpu.json c4/multigpu.json --out merged

On 2 GPUs the same four calls apply (fewer parity layouts; the traces are pp2 only).
A dry run of every section at tiny sizes on CPU/gloo (2 or 4 ranks):

    python benchmarks/multigpu.py --device cpu --gpus 2 --out /tmp/mg --budget-s 600
"""

from __future__ import annotations

import os

# NVLink multicast off in this process and (inherited) in every rank it starts: it can
# take a shared host's GPUs out of service. Set before torch.distributed starts anything.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(MULTICAST_OFF)

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import torch  # noqa: E402
from gpu import (  # noqa: E402
    DATASHEET_TFLOPS,
    RandomTokens,
    _attention_context,
    _sync,
    _timed,
    block_seconds,
    forward_backward_seconds,
    head_seconds,
    matmul_tflops,
    optimizer_seconds,
)

from minipar.comm import wire_bytes  # noqa: E402
from minipar.config import TrainConfig, validate  # noqa: E402
from minipar.doctor import host_memory  # noqa: E402
from minipar.launch import launch  # noqa: E402
from minipar.model import get_config  # noqa: E402
from minipar.parallel.schedules import SPLIT_BACKWARD, VIRTUAL_STAGES  # noqa: E402
from minipar.theory.clusters import rising  # noqa: E402
from minipar.theory.params import (  # noqa: E402
    head_layers_for,
    layer_flops_per_token,
    model_flops_per_token,
)

GiB = 2**30
SECTIONS = ("calibrate", "parity", "speed", "scaling", "trace", "cp", "overlap")
SPEED_GROUPS = ("dp", "tp", "pp", "big", "big-layouts")
BIG_TRIES = 3  # planned layouts of the big model tried, best first, until one runs


# --- sizes: the real run, and the dry run's tiny twin -----------------------------------
@dataclass
class Sizes:
    speed_model: str = "gpt-1.3b"
    big_model: str = "gpt-13b"
    per_gpu_batch: int = 8  # sequences per GPU (dp rows, scaling)
    tp_batch: int = 8  # global batch of the tp rows
    pp_micro: int = 2  # micro-batch size of the pp rows (global batch = per_gpu * N)
    big_per_gpu: int = 4
    steps: int = 10
    warmup: int = 3
    parity_model: str = "tiny"
    parity_steps: int = 5
    calib_sizes: list = field(default_factory=lambda: [2**10 * 4**k for k in range(11)])
    matmul_n: int = 8192
    # the transformer block's pace (calibrate): sequences per micro-batch and tp shares
    block_batches: list = field(default_factory=lambda: [1, 2, 4, 8])
    block_tps: tuple = (1, 2, 4)
    optimizer_params: int = 2**30  # the optimizer step's pace (calibrate), memory-bound: at
    # 64 Mi parameters the kernels' fixed costs read 20% slow (one H100: 2.4e-11 s against
    # 2.0e-11 at 1 Gi, 20 GB of states)
    trace_model: str = "gpt2-125m"
    trace_overrides: dict = field(default_factory=lambda: {"vocab_size": 8192})
    cap_s: float = 300.0  # one configuration's time limit
    big_cap_s: float = 540.0


def dry_sizes() -> Sizes:
    return Sizes(speed_model="small", big_model="small", per_gpu_batch=2, tp_batch=4,
                 pp_micro=1, big_per_gpu=2, steps=2, warmup=1, parity_steps=3,
                 calib_sizes=[2**10 * 4**k for k in range(4)], matmul_n=256,
                 block_batches=[1, 2], block_tps=(1, 2), optimizer_params=2**18,
                 trace_model="tiny", trace_overrides={}, cap_s=120.0, big_cap_s=120.0)


# --- the run: rows, budget, JSON after every row ----------------------------------------
class Run:
    def __init__(self, args, n: int, sizes: Sizes) -> None:
        self.args, self.n, self.sizes = args, n, sizes
        self.cuda = args.device == "cuda"
        self.backend = "nccl" if self.cuda else "gloo"
        self.t0 = time.monotonic()
        self.only = re.compile(args.only) if args.only else None
        os.makedirs(args.out, exist_ok=True)
        self.path = os.path.join(args.out, "multigpu.json")
        self.report = {"meta": _meta(args, n), "sections": {}}
        self.calibration: dict | None = None
        if args.calibration:
            with open(args.calibration) as f:
                self.calibration = json.load(f)

    @classmethod
    def for_script(cls, args, benchmark: str) -> Run:
        """A run for a benchmark script of its own that writes ``args.out`` (one JSON):
        ``args.gpus`` ranks (default: every GPU; 2 on the CPU), 6 timed steps after 2 on
        a GPU (2 after 1 on the CPU), no calibration."""
        n = args.gpus or (torch.cuda.device_count() if args.device == "cuda" else 2)
        out = os.path.abspath(args.out)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        ns = types.SimpleNamespace(**{**vars(args), "out": os.path.dirname(out),
                                      "calibration": None, "start_method": None})
        sizes = Sizes(steps=6, warmup=2) if args.device == "cuda" else Sizes(steps=2, warmup=1)
        run = cls(ns, n, sizes)
        run.path = out
        run.report["meta"].update(args=vars(args), benchmark=benchmark)
        return run

    def remaining(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def timeout(self, cap: float) -> float:
        return max(20.0, min(cap, self.remaining()))

    def section(self, name: str) -> dict:
        return self.report["sections"].setdefault(name, {"rows": []})

    def wanted(self, section: str, name: str) -> bool:
        return self.only is None or bool(self.only.search(f"{section} {name}"))

    def row(self, section: str, name: str, fn, **fields) -> dict | None:
        """Run ``fn() -> dict`` as one row: errors and the budget are recorded, never
        raised; the JSON is rewritten after it."""
        if not self.wanted(section, name):
            return None
        rec = {"name": name, **fields}
        start = time.monotonic()
        if self.remaining() < 15:
            rec.update(status="skipped", reason=f"--budget-s {self.args.budget_s} spent")
        else:
            try:
                rec.update(fn())
                rec.setdefault("status", "ok")
            except Exception as e:  # one bad row must never lose the others
                rec.update(status="error", error=_error_text(e))
        rec["seconds"] = round(time.monotonic() - start, 2)
        self.section(section)["rows"].append(rec)
        self.save()
        extra = rec.get("error") or rec.get("reason") or rec.get("brief", "")
        print(f"[{time.monotonic() - self.t0:6.0f} s] {section:<9} {name:<40} "
              f"{rec['status']:<8} {str(extra).splitlines()[0][:110] if extra else ''}",
              flush=True)
        return rec

    def save(self) -> None:
        self.report["meta"]["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        _write_json(self.path, self.report)

    def launch(self, fn, world: int, *args, cap: float):
        """``fn(*args)`` on ``world`` ranks, one per GPU (spawned on CUDA)."""
        method = self.args.start_method or ("spawn" if self.cuda else "fork")
        # a spawned rank may use several threads (building a 13B model on the host); a
        # forked one must keep one: the parent's OpenMP pool would hang it
        threads = max(1, (os.cpu_count() or 2) // world) if method == "spawn" else 1
        return launch(fn, world, args=args, backend=self.backend, timeout=self.timeout(cap),
                      start_method=method, threads=threads)


def _driver_gpu_name() -> str | None:
    """The first GPU's name from ``nvidia-smi`` (None where it does not answer)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = out.stdout.strip().splitlines()
    return names[0].strip() if out.returncode == 0 and names else None


def _meta(args, n: int) -> dict:
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": n,
            "device": args.device, "args": vars(args),
            # (the parent asks the driver only for the name: CUDA stays uninitialised here,
            # as spawned ranks need; a section whose rows never report one keeps it)
            "device_name": _driver_gpu_name() if args.device == "cuda" else None,
            "datasheet_tflops": DATASHEET_TFLOPS, "multicast_off": MULTICAST_OFF,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        meta["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if args.device == \
            "cuda" else None
    except Exception:
        meta["nccl"] = None
    return meta


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    lines = text.splitlines()
    if len(lines) > 24:
        lines = lines[:4] + ["..."] + lines[-18:]
    return "\n".join(lines)[:4000]


def _write_json(path: str, payload: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)


def _local_device() -> torch.device:
    if torch.cuda.is_available() and dist_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dist_backend() -> str:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_initialized() else "gloo"


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# --- calibrate -------------------------------------------------------------------------
CALIB_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send")
# timed windows per op and size, of which the median is kept: one window of a few
# iterations caught a stall on 4 x H200 (all_reduce at 67 MB: 49 GB/s between 258 and
# 326) and priced every tp 4 all-reduce 5x too slow. The median drops up to two such
# windows yet stays a typical time, which a training step meets; the minimum would be
# the best case, and the planner already prices steps on the fast side.
CALIB_REPEATS = 5


def _calibrate_rank(sizes: list[int], matmul_n: int, blocks: list[tuple],
                    tp_blocks: list[tuple] = (), heads: list[tuple] = (),
                    optimizer_params: int = 0) -> dict:
    """On every rank: the matmul rate, the block's pace at each (model, tokens, tp) of
    ``blocks``, the real tensor-parallel block at each (model, tokens, tp, sp) of
    ``tp_blocks``, the head and loss at each (model, tokens, tp) of ``heads``, the
    optimizer step and gradient accumulation per parameter (on ``optimizer_params``),
    then each op at each size (seconds per call: the slowest rank's in each of
    ``CALIB_REPEATS`` windows, the median window; with the slowest window over the
    fastest, to show how noisy each size was)
    Through ``minipar.comm.Comm``: the cost minipar itself pays."""
    import torch.distributed as dist

    from minipar.comm import Comm

    device = _local_device()
    comm = Comm()
    out = {"device_name": _device_name(device), "matmul_tflops": matmul_tflops(
        device, matmul_n), "times": {op: [] for op in CALIB_OPS},
        "spread": {op: [] for op in CALIB_OPS},
        "memory_bytes": (torch.cuda.get_device_properties(device).total_memory
                         if device.type == "cuda" else 0),
        "block_seconds": [block_seconds(get_config(m), tokens, tp, device)
                          for m, tokens, tp in blocks]}
    out["tp_block_seconds"] = _tp_block_seconds(tp_blocks, device)
    out["head_seconds"] = [head_seconds(get_config(m), tokens, tp, device)
                           for m, tokens, tp in heads]
    if optimizer_params:
        out["optimizer"] = optimizer_seconds(optimizer_params, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the blocks' memory back before the large buffers
    n, rank = comm.size, comm.rank
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    item = torch.finfo(dtype).bits // 8
    out["bytes"] = [max(n, size // item // n * n) * item for size in sizes]
    for nbytes in out["bytes"]:
        full = torch.zeros(nbytes // item, dtype=dtype, device=device)
        shard = torch.zeros(nbytes // item // n, dtype=dtype, device=device)
        size = nbytes
        iters = max(3, min(50, int(4e8 // size)))
        for op in CALIB_OPS:
            if op == "send" and n < 2:
                continue
            peer = rank ^ 1  # pairs 0-1, 2-3: even ranks send, odd ones receive

            def once(op=op, full=full, shard=shard, peer=peer) -> None:
                _collective(comm, op, full, shard, peer)

            for _ in range(2):
                once()
            windows = []
            for _ in range(CALIB_REPEATS):
                _sync(device)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    once()
                _sync(device)
                windows.append((time.perf_counter() - t0) / iters)
            t = torch.tensor(windows, dtype=torch.float64,
                             device=device)  # NCCL reduces device tensors only
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # each window's slowest rank
            slowest = t.tolist()
            out["times"][op].append(statistics.median(slowest))
            out["spread"][op].append(max(slowest) / min(slowest))
        comm.log.clear()
    return out


def _tp_block_seconds(tp_blocks: list[tuple], device: torch.device) -> list[float]:
    """Each (model, tokens, tp, sp) of ``tp_blocks``: one block split by minipar's own
    tensor-parallel plan over groups of ``tp`` neighbouring ranks, forward + backward,
    its collectives included. Beside ``block_seconds`` (the same share without them) it
    shows what the collectives and, with sp, the extra launches cost."""
    import torch.distributed as dist

    from minipar.comm import Comm
    from minipar.model import Block
    from minipar.parallel.tp import parallelize_module, tensor_parallel_plan

    n, rank, comms = dist.get_world_size(), dist.get_rank(), {}
    for tp in sorted({b[2] for b in tp_blocks}):
        for first in range(0, n, tp):  # every rank creates every group, in one order
            ranks = list(range(first, first + tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                comms[tp] = Comm(group, dim="tp", ranks=ranks)
    out = []
    for name, tokens, tp, sp in tp_blocks:
        cfg = get_config(name)
        holder = torch.nn.Module()
        with torch.device(device):
            holder.blocks = torch.nn.ModuleList([Block(cfg)])
        plan = {k: v for k, v in tensor_parallel_plan(sp).items() if k.startswith("blocks")}
        parallelize_module(holder, comms[tp], plan)
        seq = cfg.seq_len // tp if sp else cfg.seq_len  # sp: this rank's sequence shard
        out.append(forward_backward_seconds(
            holder.blocks[0], (max(1, tokens // cfg.seq_len), seq, cfg.d_model), device))
        comms[tp].log.clear()
    return out


def _collective(comm, op: str, full: torch.Tensor, shard: torch.Tensor, peer: int) -> None:
    if op == "all_reduce":
        comm.all_reduce(full)
    elif op == "all_gather":
        comm.all_gather_into(full, shard)
    elif op == "reduce_scatter":
        comm.reduce_scatter_into(shard, full)
    elif peer < comm.size:  # send-recv: even ranks send, odd ones receive
        if comm.rank % 2 == 0:
            comm.send(full, peer)
        else:
            comm.recv(full, peer)


def block_list(sizes: Sizes, n: int) -> list[tuple[str, int, int]]:
    """(model, tokens per micro-batch, tp) of the blocks calibrate times: the presets the
    benchmarks train, at each micro-batch size and each tp share that splits them."""
    out = []
    for name in dict.fromkeys((sizes.speed_model, sizes.big_model)):
        cfg = get_config(name)
        out += [(name, b * cfg.seq_len, tp) for tp in sizes.block_tps for b in
                sizes.block_batches if tp <= n and cfg.n_head % tp == 0]
    return out


def head_list(sizes: Sizes, n: int) -> list[tuple[str, int, int]]:
    """(model, tokens, tp) of ``block_list`` at its smallest and largest micro-batch:
    where calibrate times the head and loss (and, with tp > 1, the real tp block)."""
    return [(m, t, tp) for m, t, tp in block_list(sizes, n)
            if t // get_config(m).seq_len in (sizes.block_batches[0],
                                              sizes.block_batches[-1])]


def tp_block_list(sizes: Sizes, n: int) -> list[tuple[str, int, int, bool]]:
    """(model, tokens, tp, sp) of the real tensor-parallel blocks calibrate times: the
    smallest and largest micro-batch of ``block_list``, with and without sp."""
    return [(m, t, tp, sp) for m, t, tp in head_list(sizes, n) if tp > 1
            for sp in (False, True)]


def calibration_from(results: list[dict], sizes: list[int], n: int,
                     blocks: list[tuple] = (), tp_blocks: list[tuple] = (),
                     heads: list[tuple] = (), optimizer_params: int = 0) -> dict:
    """Fit the alpha-beta model per op: latency (the smallest sizes' time) and bandwidth
    (wire bytes per second, the slope over the larger sizes), in ``load_calibration``'s
    shape; keep the per-size times, and the blocks' pace (``block_rates``: the median
    rank's seconds and the TFLOP/s of a tp rank's share of the layer's FLOPs); the
    head and loss's likewise (``head_rates``, over 6 V h / tp FLOPs per token), and the
    median rank's optimizer step and gradient accumulation per parameter."""
    r0 = results[0]
    calib = {"device": r0["device_name"], "gpus": n, "torch": torch.__version__,
             "memory_bytes": r0["memory_bytes"], "host_memory_bytes": host_memory()[0],
             "matmul_tflops": statistics.median(r["matmul_tflops"] for r in results),
             "matmul_tflops_per_rank": [r["matmul_tflops"] for r in results],
             "collectives": {}, "block_rates": [], "head_rates": []}
    for i, (name, tokens, tp) in enumerate(blocks):
        cfg = get_config(name)
        sec = statistics.median(r["block_seconds"][i] for r in results)
        calib["block_rates"].append({
            "model": name, "hidden": cfg.d_model, "heads": cfg.n_head, "d_ff": cfg.d_ff,
            "seq_len": cfg.seq_len, "tokens": tokens, "tp": tp, "seconds": sec,
            "tflops": layer_flops_per_token(cfg) * tokens / tp / sec / 1e12})
    for i, (name, tokens, tp) in enumerate(heads):
        cfg = get_config(name)
        sec = statistics.median(r["head_seconds"][i] for r in results)
        calib["head_rates"].append({
            "model": name, "hidden": cfg.d_model, "vocab": cfg.vocab_size,
            "tokens": tokens, "tp": tp, "seconds": sec, "seconds_per_token": sec / tokens,
            "tflops": 6 * cfg.vocab_size * cfg.d_model * tokens / tp / sec / 1e12})
    if optimizer_params:
        for key, part in (("optimizer_step", "step"), ("grad_accumulate", "accumulate")):
            calib[key] = {"params": optimizer_params, "seconds_per_param": statistics.median(
                r["optimizer"][part] for r in results)}
    # the slowest rank's: a tensor-parallel group moves at its pace
    calib["tp_blocks"] = [
        {"model": name, "hidden": get_config(name).d_model, "tokens": tokens, "tp": tp,
         "sp": sp, "seconds": max(r["tp_block_seconds"][i] for r in results)}
        for i, (name, tokens, tp, sp) in enumerate(tp_blocks)]
    nbytes = r0["bytes"]
    for op, times in r0["times"].items():
        if not times:
            continue
        group = 2 if op == "send" else n
        wires = [wire_bytes(op, b, group) for b in nbytes]
        latency = min(times[:2])
        per_size = [w / t for w, t in zip(wires, times)]
        # bandwidth: least-squares slope of time over wire bytes on the larger half of
        # the sizes (where latency no longer dominates), of the times the planner reads
        # (``rising``: one slow size would tilt the line); else the largest size's rate
        half = len(times) // 2
        xs = wires[half:]
        ys = [w / bw for w, bw in zip(xs, rising(per_size)[half:])]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
        bandwidth = 1 / slope if slope > 0 else wires[-1] / ys[-1]
        calib["collectives"][op] = {
            "latency_s": latency, "bus_bandwidth": bandwidth,
            "bytes": nbytes, "seconds": times, "spread": r0.get("spread", {}).get(op, []),
            "bus_bandwidth_per_size": per_size}
    return calib


def blocks_brief(rates: list[dict]) -> str:
    """The blocks' TFLOP/s, lowest to highest, per model (tp 1)."""
    by: dict = {}
    for r in rates:
        if r["tp"] == 1:
            by.setdefault(r["model"], []).append(r["tflops"])
    return ", ".join(f"{m} {min(v):.0f}-{max(v):.0f} TFLOP/s" for m, v in by.items())


def section_calibrate(run: Run) -> None:
    s = run.sizes

    def go() -> dict:
        blocks, tp_blocks = block_list(s, run.n), tp_block_list(s, run.n)
        heads, n_opt = head_list(s, run.n), s.optimizer_params
        res = run.launch(_calibrate_rank, run.n, s.calib_sizes, s.matmul_n, blocks,
                         tp_blocks, heads, n_opt, cap=240)
        calib = calibration_from(list(res), s.calib_sizes, run.n, blocks, tp_blocks,
                                 heads, n_opt)
        run.calibration = calib
        run.report["meta"]["device_name"] = calib["device"]
        _write_json(os.path.join(run.args.out, "calibration.json"), calib)
        ops = ", ".join(f"{op} {c['bus_bandwidth'] / 1e9:.0f} GB/s + "
                        f"{c['latency_s'] * 1e6:.0f} us" for op, c in calib["collectives"].items())
        return {"calibration": calib, "file": "calibration.json",
                "brief": f"matmul {calib['matmul_tflops']:.0f} TFLOP/s; block "
                         f"{blocks_brief(calib['block_rates'])}; head "
                         f"{blocks_brief(calib['head_rates'])}; optimizer step "
                         f"{calib['optimizer_step']['seconds_per_param'] * 1e9:.1f} "
                         f"ns/param; {ops}"}

    run.row("calibrate", f"{run.n} ranks", go)


# --- parity ------------------------------------------------------------------------------
SGD = dict(optimizer="sgd", grad_clip=0.0, lr=0.5, warmup=1)


def parity_layouts(n: int) -> list[tuple[str, dict, tuple]]:
    """(name, TrainConfig fields, dtypes) of the covering matrix at n ranks."""
    m2 = 2 * n
    both, fp32 = ("fp32", "bf16"), ("fp32",)
    rows = [(f"dp{n} zero{z}", dict(dp=n, zero=z, microbatches=2 if z in (0, 2) else 1),
             both) for z in range(4)]
    rows += [(f"tp{n}", dict(tp=n), both), (f"tp{n} sp", dict(tp=n, sp=True), both)]
    rows += [(f"pp{n} {s}", dict(pp=n, schedule=s, microbatches=m2), both)
             for s in ("gpipe", "1f1b", "zb")]
    rows += [(f"pp{n} interleaved v2", dict(pp=n, schedule="interleaved", virtual=2,
                                           microbatches=m2), both),
             (f"dp{n} recompute full", dict(dp=n, recompute="full"), both),
             (f"tp{n} sp recompute selective", dict(tp=n, sp=True, recompute="selective"),
              both),
             (f"pp{n} 1f1b tied embeddings", dict(pp=n, microbatches=m2,
                                                  overrides={"tie_embeddings": True}), both),
             (f"cp{n}", dict(cp=n), both),
             (f"pp{n} 1f1b head-layers 1", dict(pp=n, microbatches=m2, head_layers=1), both),
             (f"pp{n} 1f1b grad-bf16", dict(pp=n, microbatches=m2, grad_dtype="bf16"),
              ("bf16",)),
             (f"dp{n} zero1 grad-bf16", dict(dp=n, zero=1, microbatches=2,
                                             grad_dtype="bf16"), ("bf16",)),
             (f"pp{n} 1f1b unfused", dict(pp=n, microbatches=m2, wgrad_fusion=False), both),
             (f"dp{n} zero2 unfused", dict(dp=n, zero=2, microbatches=2,
                                           wgrad_fusion=False), both),
             (f"dp{n} zero3 separate reduce group", dict(dp=n, zero=3, microbatches=2,
                                                         separate_reduce_group=True), both)]
    if n >= 4:
        rows += [("dp2 tp2 zero1", dict(dp=2, tp=2, zero=1), both),
                 ("dp2 pp2 zero2", dict(dp=2, pp=2, zero=2, microbatches=2), both),
                 ("pp2 tp2 sp zb", dict(pp=2, tp=2, sp=True, schedule="zb",
                                        microbatches=2), both),
                 ("dp2 pp2 zero3 interleaved v2", dict(dp=2, pp=2, zero=3, virtual=2,
                                                       schedule="interleaved",
                                                       microbatches=4), both),
                 ("dp2 pp2 pp-inside-dp recompute full", dict(
                     dp=2, pp=2, microbatches=2, order="pp-inside-dp", recompute="full"),
                  both),
                 ("dp2 pp2 tp1 zero1 sgd", dict(dp=2, pp=2, zero=1, microbatches=2, **SGD),
                  fp32),
                 ("cp2 tp2 sp", dict(cp=2, tp=2, sp=True), both),
                 ("dp2 cp2 zero3", dict(dp=2, cp=2, zero=3), fp32),
                 ("dp2 cp2 zero3 separate reduce group", dict(dp=2, cp=2, zero=3,
                                                              separate_reduce_group=True), fp32),
                 ("cp2 pp2 zb", dict(cp=2, pp=2, schedule="zb", microbatches=2), fp32)]
    rows += [(f"dp{n} sgd", dict(dp=n, microbatches=2, **SGD), fp32),
             (f"dp{n} zero3 sgd", dict(dp=n, zero=3, microbatches=2, **SGD), fp32),
             (f"tp{n} sp sgd", dict(tp=n, sp=True, **SGD), fp32),
             (f"pp{n} 1f1b sgd", dict(pp=n, microbatches=m2, **SGD), fp32),
             (f"pp{n} zb sgd", dict(pp=n, schedule="zb", microbatches=m2, **SGD), fp32)]
    return rows


def section_parity(run: Run) -> None:
    from minipar.parity import parity_row, reference_record

    s = run.sizes
    run.section("parity")["reference"] = ("engine.train_reference: one process, fp32, "
                                          "CPU; tolerances: minipar.parity.TOLERANCES")
    references: dict = {}

    def reference(fields: dict) -> dict:
        knobs = {k: fields[k] for k in ("optimizer", "grad_clip", "lr", "warmup",
                                        "overrides") if k in fields}
        key = json.dumps(knobs, sort_keys=True)
        if key not in references:
            references[key] = reference_record(TrainConfig(
                model=s.parity_model, steps=s.parity_steps, batch_size=16, **knobs))
        return references[key]

    for name, fields, dtypes in parity_layouts(run.n):
        for dtype in dtypes:
            def go(fields=fields, dtype=dtype) -> dict:
                cfg = TrainConfig(model=s.parity_model, steps=s.parity_steps, batch_size=16,
                                  dtype=dtype, backend=run.backend, timeout=run.timeout(180),
                                  **fields)
                return parity_row(cfg, lambda: reference(fields))[0]

            run.row("parity", f"{name} {dtype}", go, layout=fields, dtype=dtype)


# --- speed: one configuration per launch -------------------------------------------------
def _speed_build(spec: dict) -> types.SimpleNamespace:
    """One configuration built on this rank: ``step_fn(step) -> loss`` and the pieces
    (device, impl; cfg, rm, parts and data for minipar). ``_speed_rank`` times it;
    ``mg_overlap`` profiles it."""
    import torch.distributed as dist

    from minipar.data import split_batch
    from minipar.model import GPT

    device = _local_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    mc = get_config(spec["model"]).with_(**spec.get("overrides", {}))
    data = RandomTokens(mc.vocab_size, mc.seq_len, 0)
    batch = spec["batch"]
    impl, cfg, rm, parts = spec["impl"], None, None, None
    cuda = device.type == "cuda"

    def local(s: int):  # this rank's slice of the global batch (data parallel peers)
        x, y = split_batch(*data.batch(s, batch), rank, world, 1)[0]
        return x.to(device), y.to(device)

    if impl == "minipar":
        from minipar.engine import build, train_step
        from minipar.mesh import Mesh

        cfg = TrainConfig(**spec["cfg"])
        rm = Mesh(cfg.dp, cfg.pp, cfg.tp, cfg.order, cp=cfg.cp).connect()
        parts = build(cfg, rm)

        def step_fn(s: int):
            return train_step(cfg, rm, parts, data, s)["loss"]
    elif impl == "torch-cp":
        from peers import context_parallel_peer, cp_train_step

        torch.manual_seed(0)
        ddp, masters, mesh = context_parallel_peer(GPT(mc, device=device), device,
                                                   spec.get("rotate", "allgather"))

        def step_fn(s: int):
            x, y = (t.to(device) for t in data.batch(s, batch))
            return cp_train_step(ddp, masters, mesh, x, y)
    elif impl == "ddp":
        from peers import MasterWeights
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        model = GPT(mc, device=device)
        masters = MasterWeights(model.parameters(), fused=cuda)
        model.to(torch.bfloat16)
        ddp = DDP(model, device_ids=[device.index] if cuda else None, bucket_cap_mb=25)

        def step_fn(s: int):
            loss = ddp(*local(s))
            loss.backward()
            masters.step()
            return loss.item()
    elif impl == "fsdp2":
        from peers import fsdp2
        from torch.distributed.device_mesh import init_device_mesh

        model = GPT(mc, device="meta")  # FSDP2 materialises its shards
        model = fsdp2(model, init_device_mesh(device.type, (world,)), bf16=True,
                      recompute=spec.get("recompute", False), meta=True, device=device,
                      separate_reduce_group=spec.get("separate_reduce_group", False))
        # torch's default kernel (multi-tensor), or ``fused`` as minipar steps on CUDA
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4,
                                fused=(spec.get("fused", False) and cuda) or None)

        def step_fn(s: int):
            loss = model(*local(s))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
    elif impl == "dtensor":
        from peers import clip_mixed, dtensor_tp
        from torch.distributed.tensor.parallel import loss_parallel

        torch.manual_seed(0)
        model = dtensor_tp(GPT(mc, device=device), world, spec["sp"], device.type)
        # DTensors and plain tensors (replicated norms without sp) in separate groups:
        # a foreach step refuses a mix of the two
        params = list(model.parameters())
        groups = [[p for p in params if hasattr(p, "full_tensor") == d] for d in (True, False)]
        opt = torch.optim.AdamW([{"params": g} for g in groups if g], lr=3e-4)

        def step_fn(s: int):
            x, y = (t.to(device) for t in data.batch(s, batch))
            with loss_parallel():
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(x, y)
                loss.backward()
            clip_mixed(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
    elif impl == "torch-pp":
        from peers import TORCH_SCHEDULES, MasterWeights, torch_pipeline

        from minipar.parallel.pp import build_stage

        torch.manual_seed(0)
        model = GPT(mc)
        v = TORCH_SCHEDULES[spec["schedule"]][1]
        chunks = build_stage(model, rank, world, v, spec.get("head_layers", 0))
        model.to(device)
        masters = MasterWeights(model.parameters(), fused=cuda, group=dist.group.WORLD)
        model.to(torch.bfloat16)
        sched = torch_pipeline(chunks, world * v, spec["schedule"], spec["microbatches"],
                               device)
        first, last = any(c.is_first for c in chunks), any(c.is_last for c in chunks)

        def step_fn(s: int):
            x, y = (t.to(device) for t in data.batch(s, batch))
            losses: list = []
            sched.step(*((x,) if first else ()), target=y if last else None,
                       losses=losses if last else None)
            masters.step()
            return float(torch.stack(losses).float().mean()) if last else None
    else:
        raise ValueError(f"unknown impl {impl!r}")
    return types.SimpleNamespace(step_fn=step_fn, device=device, impl=impl, cfg=cfg, rm=rm,
                                 parts=parts, data=data)


def _speed_rank(spec: dict) -> dict:
    """One configuration on this rank: build, warm up, time; returns times, losses and
    the peak allocated memory (plus, for minipar's pipelines, a synchronised timeline)."""
    b = _speed_build(spec)
    step_fn, device, impl, cfg, rm, parts, data = (b.step_fn, b.device, b.impl, b.cfg, b.rm,
                                                   b.parts, b.data)
    steps, warmup, cuda, extra = spec["steps"], spec["warmup"], device.type == "cuda", {}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = _timed(step_fn, steps, warmup, device)
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    if impl == "minipar" and cfg.pp > 1:  # two more steps, every action synchronised
        from minipar.engine import train_step

        parts.executor.synchronize = cuda
        with _attention_context(device):
            for s in range(2):
                out = train_step(cfg, rm, parts, data, warmup + steps + s)
        extra["timeline"] = [{"kind": r.kind, "mb": r.mb, "chunk": r.chunk,
                              "start": r.start, "end": r.end, "wait": r.wait}
                             for r in out["timeline"]]
    if impl == "minipar":
        extra["comm_wire_bytes_per_step"] = rm.log.total("wire_bytes") / (
            warmup + steps + (2 if cfg.pp > 1 else 0))
    return {"times": times, "losses": losses, "peak_bytes": peak,
            "device_name": _device_name(device), **extra}


def _measure(run: Run, spec: dict, cap: float) -> dict:
    """Launch one configuration and reduce its ranks' records to one row."""
    res = list(run.launch(_speed_rank, spec["world"], spec, cap=cap))
    per_step = [max(r["times"][i] for r in res) for i in range(len(res[0]["times"]))]
    step = statistics.median(per_step)
    mc = get_config(spec["model"]).with_(**spec.get("overrides", {}))
    tokens = spec["batch"] * mc.seq_len
    flops = model_flops_per_token(mc)
    losses = next((r["losses"] for r in res if r["losses"][-1] is not None), [None])
    row = {"step_s": step, "step_s_all": per_step, "tokens_per_step": tokens,
           "tokens_per_s": tokens / step,
           "mfu": tokens / step * flops / (spec["world"] * DATASHEET_TFLOPS * 1e12),
           "peak_gib": max(r["peak_bytes"] for r in res) / GiB,
           "peak_gib_per_rank": [r["peak_bytes"] / GiB for r in res],
           "loss_first": losses[0], "loss_last": losses[-1],
           "device_name": res[0]["device_name"]}
    if run.report["meta"]["device_name"] is None:
        run.report["meta"]["device_name"] = res[0]["device_name"]
    if "comm_wire_bytes_per_step" in res[0]:
        row["comm_wire_bytes_per_step"] = max(r["comm_wire_bytes_per_step"] for r in res)
    if "timeline" in res[0]:
        from minipar.parallel.schedules import COMPUTE
        from minipar.theory.bubble import (
            bubble_fraction_formula,
            bubble_stats,
            chunk_weights,
            measured_cost_bubble,
            stage_cost_bubble,
        )

        tl = [[types.SimpleNamespace(**e) for e in r["timeline"]] for r in res]
        c = spec["cfg"]
        # the pipeline group is the whole world in these rows (pp = N)
        row["bubble_measured"] = bubble_stats(tl)["bubble_fraction"]
        # The timeline's steps synchronise after every action, so the host's time between
        # actions (posting sends and receives) idles the GPU there, not in the timed steps:
        # the idle share of the timed step, with each action's synchronised duration
        # (GPUs only: on the CPU a rank's actions take as long either way)
        if run.cuda:
            busy = sum(e.end - e.start for rank in tl for e in rank if e.kind in COMPUTE)
            row["bubble_measured_timed_step"] = 1 - busy / (len(tl) * step)
        shape = (c["schedule"], c["pp"], c["microbatches"], c["virtual"])
        row["bubble_theory"] = stage_cost_bubble(*shape)  # equal stages: unit costs
        row["bubble_formula"] = bubble_fraction_formula(c["schedule"], c["pp"],
                                                        c["microbatches"], c["virtual"])
        # the same schedule with each chunk's real FLOPs: the last one runs the head too
        weights = chunk_weights(mc, c["pp"], c["virtual"], c.get("recompute") or "none",
                                c.get("head_layers", 0))
        row["bubble_theory_stage_costs"] = stage_cost_bubble(*shape, weights)
        # ... and with each action's measured time and the calibrated send of one
        # micro-batch's activations: what these costs imply, the rest is waiting
        p2p = _send_seconds(run, mc, spec["batch"] // c["microbatches"])
        row["bubble_p2p_s"] = p2p
        row["bubble_theory_measured_costs"] = measured_cost_bubble(*shape, tl, p2p)
        t0 = min(e.start for rank in tl for e in rank)  # one step's actions, ms from its start
        row["timeline_ms"] = [[[e.kind, e.mb, e.chunk, round(1e3 * (e.start - t0), 3),
                                round(1e3 * (e.end - t0), 3), round(1e3 * e.wait, 3)]
                               for e in rank] for rank in tl]
    row["brief"] = (f"{1e3 * step:.1f} ms, {row['tokens_per_s']:,.0f} tok/s, MFU "
                    f"{100 * row['mfu']:.1f}%, peak {row['peak_gib']:.1f} GiB")
    return row


def _send_seconds(run: Run, mc, microbatch_size: int) -> float:
    """The calibrated seconds of one pipeline send of a micro-batch's bf16 activations
    (0 without a calibration in this run or a file)."""
    from minipar.theory.rates import call_seconds

    payload = 2 * microbatch_size * mc.seq_len * mc.d_model
    return call_seconds(_cluster(run, 2).curves, "send", payload, 2) or 0.0


def minipar_spec(run: Run, model: str, world: int, batch: int, overrides: dict | None = None,
                 **layout) -> dict:
    s = run.sizes
    cfg = dict(model=model, dtype="bf16", backend=run.backend, batch_size=batch,
               steps=s.warmup + s.steps + 2, warmup=s.warmup, lr=3e-4, fused=run.cuda,
               seed=0, overrides=dict(overrides or {}), **layout)
    return {"impl": "minipar", "model": model, "overrides": dict(overrides or {}),
            "world": world, "batch": batch, "steps": s.steps, "warmup": s.warmup,
            "cfg": cfg}


def peer_spec(run: Run, impl: str, model: str, world: int, batch: int,
              overrides: dict | None = None, **extra) -> dict:
    s = run.sizes
    return {"impl": impl, "model": model, "overrides": dict(overrides or {}), "world": world,
            "batch": batch, "steps": s.steps, "warmup": s.warmup, **extra}


def refused_or(spec: dict, measure) -> dict:
    """``measure()``, unless ``config.validate`` refuses a minipar spec: then a refused
    row with the reason (what ``python -m minipar train`` would say before launch)."""
    if spec["impl"] == "minipar":
        try:
            validate(TrainConfig(**spec["cfg"]))
        except ValueError as e:
            return {"status": "refused", "reason": str(e)}
    return measure()


def speed_row(run: Run, section: str, name: str, spec: dict, group: str,
              cap: float | None = None) -> dict | None:
    def go() -> dict:
        return refused_or(spec, lambda: _measure(run, spec, cap or run.sizes.cap_s))

    layout = {k: v for k, v in spec.get("cfg", spec).items()
              if k in ("dp", "pp", "tp", "zero", "schedule", "virtual", "microbatches", "sp",
                       "recompute", "batch_size", "overrides", "grad_dtype",
                       "head_layers", "wgrad_fusion", "overlap_param_gather")}
    return run.row(section, name, go, group=group, impl=spec["impl"], world=spec["world"],
                   model=spec["model"], batch=spec["batch"], layout=layout,
                   spec={k: v for k, v in spec.items() if k != "cfg"})


def _untied_if_needed(run: Run, model: str, **layout) -> dict:
    """Overrides for a pp layout of a preset with tied embeddings, if minipar refuses it."""
    try:
        validate(TrainConfig(model=model, backend="gloo", batch_size=64, **layout))
        return {}
    except ValueError as e:
        return {"tie_embeddings": False} if "tie" in str(e) else {}


def speed_dp(run: Run) -> None:
    s, n, model = run.sizes, run.n, run.sizes.speed_model
    b = s.per_gpu_batch
    speed_row(run, "speed", f"minipar 1 GPU b{b} (no reduction)",
              minipar_spec(run, model, 1, b), "dp")
    for z in range(4):
        speed_row(run, "speed", f"minipar dp{n} zero{z}",
                  minipar_spec(run, model, n, b * n, dp=n, zero=z), "dp")
    for z in (1, 2):  # the weights' gather waited for in the step, not the next forward
        speed_row(run, "speed", f"minipar dp{n} zero{z} gather in step",
                  minipar_spec(run, model, n, b * n, dp=n, zero=z,
                               overlap_param_gather=False), "dp")
    speed_row(run, "speed", f"torch DDP dp{n}", peer_spec(run, "ddp", model, n, b * n), "dp")
    speed_row(run, "speed", f"torch FSDP2 dp{n}", peer_spec(run, "fsdp2", model, n, b * n),
              "dp")


def speed_tp(run: Run) -> None:
    s, n, model = run.sizes, run.n, run.sizes.speed_model
    b = s.tp_batch
    for sp in (True, False):
        tag = " sp" if sp else ""
        speed_row(run, "speed", f"minipar tp{n}{tag}",
                  minipar_spec(run, model, n, b, tp=n, sp=sp), "tp")
        speed_row(run, "speed", f"torch DTensor tp{n}{tag}",
                  peer_spec(run, "dtensor", model, n, b, sp=sp), "tp")


def speed_pp(run: Run) -> None:
    s, n, model = run.sizes, run.n, run.sizes.speed_model
    b = s.per_gpu_batch * n
    m = b // s.pp_micro
    for sched in ("1f1b", "interleaved", "zb", "interleaved-zb"):
        v = 2 if sched in VIRTUAL_STAGES else 1
        ov = _untied_if_needed(run, model, pp=n, microbatches=m, schedule=sched, virtual=v)
        speed_row(run, "speed", f"minipar pp{n} {sched}" + (" v2" if v > 1 else ""),
                  minipar_spec(run, model, n, b, ov, pp=n, microbatches=m,
                               schedule=sched, virtual=v), "pp")
        if sched not in SPLIT_BACKWARD:  # eager by default (``config.use_compile``):
            # compiled blocks, and compiled without the fused weight gradient, whose breaks
            # split a block into several graphs (one graph a block: the host's cost per
            # call is less)
            for tag, extra in ((" compiled", {}),
                               (" compiled no-wgrad-fusion", {"wgrad_fusion": False})):
                speed_row(run, "speed", f"minipar pp{n} {sched}" + (" v2" if v > 1 else "")
                          + tag, minipar_spec(run, model, n, b, ov, pp=n, microbatches=m,
                                              schedule=sched, virtual=v, compile=True,
                                              **extra), "pp")
        speed_row(run, "speed", f"torch pipelining pp{n} {sched}",
                  peer_spec(run, "torch-pp", model, n, b, ov, schedule=sched,
                            microbatches=m), "pp")
        if v == 1:  # the peer's numerics: micro-batch gradients summed in bf16
            speed_row(run, "speed", f"minipar pp{n} {sched} grad-bf16",
                      minipar_spec(run, model, n, b, ov, pp=n, microbatches=m,
                                   schedule=sched, virtual=1, grad_dtype="bf16"), "pp")
        if sched == "1f1b":  # fp32 sums without the fused weight-gradient GEMM
            speed_row(run, "speed", f"minipar pp{n} {sched} unfused",
                      minipar_spec(run, model, n, b, ov, pp=n, microbatches=m,
                                   schedule=sched, virtual=1, wgrad_fusion=False), "pp")
    # balanced stages: the last holds k layers fewer (its head and loss cost ~k), both;
    # each named as the row above it plus " head-layers k" (one --only selects both)
    k = head_layers_for(model)
    for sched in ("1f1b", "zb", "interleaved-zb"):
        v = 2 if sched in VIRTUAL_STAGES else 1
        ov = _untied_if_needed(run, model, pp=n, microbatches=m, schedule=sched, virtual=v)
        speed_row(run, "speed", f"minipar pp{n} {sched}" + (" v2" if v > 1 else "")
                  + f" head-layers {k}",
                  minipar_spec(run, model, n, b, ov, pp=n, microbatches=m, schedule=sched,
                               virtual=v, head_layers=k), "pp")
        speed_row(run, "speed", f"torch pipelining pp{n} {sched} head-layers {k}",
                  peer_spec(run, "torch-pp", model, n, b, ov, schedule=sched,
                            microbatches=m, head_layers=k), "pp")


def section_speed(run: Run, groups: list[str]) -> None:
    """The speed groups, in the order given (the most wanted first under a budget)."""
    runners = {"dp": speed_dp, "tp": speed_tp, "pp": speed_pp, "big": section_big,
               "big-layouts": big_layouts}
    for g in groups:
        runners[g](run)


def _cluster(run: Run, world: int):
    """This machine as the planner sees it: the preset of its GPU, one node, calibrated
    with this run's measurements when there are some."""
    from minipar.theory.clusters import calibrated, cluster, gpu_for_device

    name = (run.calibration or {}).get("device") or run.report["meta"].get("device_name") \
        or "H100"
    where = cluster(world, gpu_for_device(name), gpus_per_node=world)
    return calibrated(where, run.calibration) if run.calibration else where


def section_big(run: Run) -> None:
    """The model that does not fit one GPU: the planner's best layout minipar accepts,
    beside FSDP2 with activation checkpointing, at the same global batch."""
    from minipar.theory.planner import plan

    s, n, model = run.sizes, run.n, run.sizes.big_model
    batch = s.big_per_gpu * n
    accepted, refused = [], []
    if run.wanted("speed", f"minipar {model} planner"):
        for est in plan(model, _cluster(run, n), batch, max_microbatch_size=8,
                        accounting="fused").layouts:
            lay = est.layout
            layout = dict(dp=lay.dp, pp=lay.pp, tp=lay.tp, zero=lay.zero, sp=lay.sp,
                          microbatches=lay.microbatches, recompute=lay.recompute,
                          schedule=lay.schedule if lay.pp > 1 else "1f1b",
                          virtual=lay.virtual, head_layers=lay.head_layers)
            try:
                validate(TrainConfig(model=model, backend=run.backend, batch_size=batch,
                                     dtype="bf16", **layout))  # as the rows run it
            except ValueError as e:
                refused.append({"layout": lay.label(), "reason": str(e)})
                continue
            if any({**a, "zero": 0} == {**layout, "zero": 0} for _, a in accepted):
                continue  # another ZeRO stage of a layout tried: it fails the same way
            accepted.append((est, layout))
            if len(accepted) == BIG_TRIES:
                break
    big_rows: list = []
    for rank_in_plan, (est, layout) in enumerate(accepted):
        # the planner's best layout minipar accepts; if it fails on the machine (out of
        # memory, say), the next one, so that one 13B figure comes back
        spec = minipar_spec(run, model, n, batch, **layout)
        rec = speed_row(run, "speed", f"minipar {model} planner #{rank_in_plan + 1} "
                        f"({est.layout.label()})", spec, "big", cap=s.big_cap_s)
        big_rows.append(rec)
        if rec is not None:
            rec["planner_refused_before"] = refused[:10]
            rec["planner_predicted_step_s"] = est.step_time
        if rec is None or rec["status"] == "ok":
            break
    if not accepted and refused:
        run.row("speed", f"minipar {model} planner", lambda: {
            "status": "refused", "reason": "no planned layout passes validate",
            "refused": refused[:10]}, group="big")
    ran = next((layout for (_, layout), r in zip(accepted, big_rows) if r and
                r.get("status") == "ok"), None)
    tp_only = dict(tp=n, sp=True, recompute="full")  # the layout the build target names
    for layout in [ran or tp_only] + ([tp_only] if ran and ran != tp_only else []):
        cli_row(run, model, batch, layout)
    speed_row(run, "speed", f"torch FSDP2 {model} dp{n} activation checkpointing",
              peer_spec(run, "fsdp2", model, n, batch, recompute=True), "big",
              cap=s.big_cap_s)


def big_layouts(run: Run) -> None:
    """The big model in layouts beside the planner's, by hand: each fits; which is the
    fastest is what the planner's first choice is checked against."""
    n, model = run.n, run.sizes.big_model
    batch = run.sizes.big_per_gpu * n
    for name, layout in ((f"dp{n} zero3 recompute full", dict(dp=n, zero=3, recompute="full")),
                         (f"dp{n} zero3 recompute selective m2",
                          dict(dp=n, zero=3, recompute="selective", microbatches=2)),
                         (f"dp{n} zero3 recompute full m2",
                          dict(dp=n, zero=3, recompute="full", microbatches=2)),
                         (f"dp{n} zero3 m2", dict(dp=n, zero=3, microbatches=2))):
        speed_row(run, "speed", f"minipar {model} {name}",
                  minipar_spec(run, model, n, batch, **layout), "big", cap=run.sizes.big_cap_s)


def cli_flags(layout: dict) -> list[str]:
    """``python -m minipar train`` flags for a layout dict (defaults left out)."""
    flags: list[str] = []
    for key, value in layout.items():
        if value in (None, False) or (key in ("dp", "pp", "tp", "virtual", "microbatches")
                                      and value == 1) or (key, value) in (
                ("zero", 0), ("recompute", "none"), ("schedule", "1f1b")):
            continue
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def train_json(run: Run, cmd: list[str], path: str, cap: float, mc, batch: int,
               env: dict[str, str] | None = None) -> dict:
    """Run ``cmd`` (``python -m minipar train ... --json path``; ``env``: variables set for
    it alone) and read its record: the per-step time of the slowest rank
    (``step_s_all``), the median after the warm-up (``step_s``), tokens a step and MFU
    over the data sheet's dense bf16 peak (``mc``: the model as it ran); or
    ``{"status": "error", "error": ...}``."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=cap,
                          env={**os.environ, **env} if env else None)
    if done.returncode != 0:
        return {"status": "error", "error": (done.stderr or done.stdout)[-2000:]}
    with open(path) as f:
        rec = json.load(f)
    ranks = rec["ranks"]
    per_step = [max(r["step_seconds"][i] for r in ranks)
                for i in range(len(ranks[0]["step_seconds"]))]
    step = statistics.median(per_step[run.sizes.warmup:])
    tokens = batch * mc.seq_len
    mfu = tokens / step * model_flops_per_token(mc) / (run.n * DATASHEET_TFLOPS * 1e12)
    return {"record": rec, "ranks": ranks, "step_s_all": per_step, "step_s": step,
            "tokens": tokens, "mfu": mfu}


def cli_row(run: Run, model: str, batch: int, layout: dict) -> dict | None:
    """The big model trained by the command line itself (what an engineer types): its
    JSON's per-rank build seconds, host and device peaks, step times and losses."""
    s = run.sizes
    path = os.path.join(run.args.out, f"train_{model}_{'_'.join(cli_flags(layout))}.json"
                        .replace("-", ""))
    cap = run.timeout(s.big_cap_s)
    cmd = [sys.executable, "-m", "minipar", "train", "--model", model, "--backend",
           run.backend, "--dtype", "bf16", "--batch-size", str(batch), "--steps",
           str(s.warmup + 5), "--json", path, "--quiet", "--timeout",
           str(int(cap - 10))] + cli_flags(layout) + (["--fused"] if run.cuda else [])

    def go() -> dict:
        done = train_json(run, cmd, path, cap, get_config(model), batch)
        if "error" in done:
            return done
        rec, ranks, step, mfu, tokens = (done[k] for k in ("record", "ranks", "step_s",
                                                             "mfu", "tokens"))
        per_step = done["step_s_all"][s.warmup:]
        peaks = [r.get("device_peak_bytes") or 0 for r in ranks]
        return {"command": " ".join(["python"] + cmd[1:]), "step_s": step,
                "step_s_all": per_step, "tokens_per_step": tokens,
                "tokens_per_s": tokens / step, "mfu": mfu,
                "build_seconds": [r["build_seconds"] for r in ranks],
                "host_peak_gib": [r["host_peak_bytes"] / GiB for r in ranks],
                "peak_gib": max(peaks) / GiB, "peak_gib_per_rank": [p / GiB for p in peaks],
                "loss_first": rec["losses"][0], "loss_last": rec["losses"][-1],
                "wall_s": rec["seconds"],
                "brief": f"{1e3 * step:.0f} ms, MFU {100 * mfu:.1f}%, build "
                         f"{max(r['build_seconds'] for r in ranks):.1f} s, peak "
                         f"{max(peaks) / GiB:.1f} GiB"}

    return run.row("speed", f"python -m minipar train {model} ({' '.join(cli_flags(layout))})",
                   go, group="big", impl="minipar-cli", world=run.n, model=model, batch=batch,
                   layout=layout)


def section_scaling(run: Run) -> None:
    s = run.sizes
    for world in sorted({1, 2, run.n}):
        b, zero = s.per_gpu_batch, 1 if world > 1 else 0  # one GPU: nothing to shard
        speed_row(run, "scaling", f"minipar dp{world} zero{zero}",
                  minipar_spec(run, s.speed_model, world, b * world, dp=world, zero=zero),
                  "scaling")


def section_trace(run: Run) -> None:
    from minipar.engine import train

    s, n = run.sizes, run.n
    layouts = [("dp2 pp2 zero1", dict(dp=2, pp=2, zero=1))] if n >= 4 else []
    layouts += [("pp2 tp2 sp", dict(pp=2, tp=2, sp=True))] if n >= 4 else \
        [("pp2", dict(pp=2))]
    for name, layout in layouts:
        path = os.path.join(run.args.out, "trace_" + name.replace(" ", "_") + ".json")

        def go(layout=layout, path=path) -> dict:
            cfg = TrainConfig(model=s.trace_model, backend=run.backend, dtype="bf16",
                              batch_size=16, microbatches=4, steps=3, warmup=1,
                              fused=run.cuda, trace=path, timeout=run.timeout(240),
                              overrides={**s.trace_overrides, "tie_embeddings": False},
                              **layout)
            validate(cfg)
            rec = train(cfg)
            return {"file": os.path.basename(path), "losses": rec["losses"],
                    "brief": f"{os.path.getsize(path) / 1e6:.1f} MB"}

        run.row("trace", name, go, layout=layout)


# --- the planner against the measurements ------------------------------------------------
ABLATIONS = ("wgrad_fusion", "overlap_param_gather")  # engine defaults a row turns off
PEER_AS = {"ddp": dict(zero=0), "fsdp2": dict(zero=3), "dtensor": {}, "torch-pp": {}}


def _iqr(xs: list[float]) -> float:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [0.0, 0.0, 0.0]
    return q[2] - q[0]


def predict(run: Run) -> None:
    """The calibrated planner's step time and memory beside every measured row."""
    from minipar.theory.layout import Layout
    from minipar.theory.planner import evaluate, plan

    if run.calibration is None:
        return
    rows = [r for sec in ("speed", "scaling") for r in run.report["sections"].get(sec, {})
            .get("rows", []) if r.get("status") == "ok"]
    out = []
    for r in rows:
        lay = dict(r["layout"])
        world, batch = r["world"], r["batch"]
        if r["impl"] in ("minipar", "minipar-cli"):
            dp, pp, tp = lay.get("dp", 1), lay.get("pp", 1), lay.get("tp", 1)
            m = lay.get("microbatches", 1)
            knobs = dict(zero=lay.get("zero", 0), schedule=lay.get("schedule", "1f1b"),
                         virtual=lay.get("virtual", 1), sp=lay.get("sp", False),
                         recompute=lay.get("recompute", "none"),
                         head_layers=lay.get("head_layers", 0))
        else:
            spec = r["spec"]
            dp = world if r["impl"] in ("ddp", "fsdp2") else 1
            tp = world if r["impl"] == "dtensor" else 1
            pp = world if r["impl"] == "torch-pp" else 1
            m = spec.get("microbatches", 1)
            knobs = dict(zero=PEER_AS[r["impl"]].get("zero", 0), sp=spec.get("sp", False),
                         schedule=spec.get("schedule", "1f1b") if pp > 1 else "1f1b",
                         # torch's zero-bubble peer loops 2 chunks; predicted as ZB-H1
                         virtual=2 if spec.get("schedule") == "interleaved" else 1,
                         recompute="full" if spec.get("recompute") else "none",
                         head_layers=spec.get("head_layers", 0))
        mc = get_config(r["model"]).with_(**r.get("spec", {}).get("overrides", {}))
        try:
            layout = Layout(tp=tp, pp=pp, dp=dp, microbatch_size=batch // (dp * m), **knobs)
            est = evaluate(mc, _cluster(run, world), layout.with_batch(batch),
                           accounting="fused")
        except ValueError as e:
            out.append({"name": r["name"], "error": str(e)})
            continue
        pred_mem = est.memory["total"] / GiB
        out.append({"name": r["name"], "impl": r["impl"], "model": r["model"],
                    "world": world, "layout": est.layout.label(),
                    "predicted_step_s": est.step_time, "measured_step_s": r["step_s"],
                    "step_error": est.step_time / r["step_s"] - 1,
                    "predicted_time": est.time, "predicted_gib": pred_mem,
                    "measured_gib": r["peak_gib"],
                    "memory_error": pred_mem / r["peak_gib"] - 1 if r["peak_gib"] else None,
                    "predicted_tokens_per_s": r["tokens_per_step"] / est.step_time,
                    "measured_tokens_per_s": r["tokens_per_s"], "fits": est.fits,
                    "predicted_traffic": sum(est.traffic.values()),
                    "ablation": any(lay.get(k) is False for k in ABLATIONS)
                    or lay.get("grad_dtype") == "bf16"})
    sec = {"cluster": _cluster(run, run.n).to_dict(), "rows": out}
    # the planner's first choice against the measured fastest, among minipar's own rows
    # of the speed model on all N GPUs (tokens/s, since their global batches differ)
    # (not the ablations: a default switched off is no layout the planner offers)
    mine = [p for p in out if p.get("impl") == "minipar" and p.get("world") == run.n
            and p.get("model") == run.sizes.speed_model and not p.get("ablation")]
    if mine:  # the planner's order: time, then fewer bytes moved, then less memory
        first = min(mine, key=lambda p: (-round(p["predicted_tokens_per_s"]),
                                         p["predicted_traffic"], p["predicted_gib"]))
        fastest = max(mine, key=lambda p: p["measured_tokens_per_s"])
        sec["first_choice_among_measured"] = first["name"]
        sec["measured_fastest"] = fastest["name"]
        sec["first_choice_is_fastest"] = first["name"] == fastest["name"]
        # ... or as fast as the step-to-step spread can tell: the first choice's median
        # step within the wider interquartile range of the two rows of the fastest's
        spread = {r["name"]: _iqr(r["step_s_all"]) for r in rows if r.get("step_s_all")}
        gap = first["measured_step_s"] - fastest["measured_step_s"]
        sec["first_choice_gap_s"] = gap
        sec["first_choice_within_spread"] = gap <= max(spread.get(first["name"], 0.0),
                                                       spread.get(fastest["name"], 0.0))
        try:
            best = plan(run.sizes.speed_model, _cluster(run, run.n),
                        run.sizes.per_gpu_batch * run.n, accounting="fused").best
            sec["planner_best_overall"] = best.layout.label() if best else None
        except ValueError as e:
            sec["planner_best_overall"] = f"error: {e}"
    run.report["sections"]["predict"] = sec
    run.save()


# --- summary -----------------------------------------------------------------------------
def _find(rows: list[dict], name: str) -> dict | None:
    return next((r for r in rows if r["name"] == name and r.get("status") == "ok"), None)


def derived(report: dict) -> dict:
    """Ratios measured in the same job: minipar over its peer, memory, exposed comm,
    scaling efficiency; the memory theory against the cp section's rows (no calibration
    needed)."""
    from mg_cp import memory_predictions

    n = report["meta"]["gpus"]
    speed = report["sections"].get("speed", {}).get("rows", [])
    out: dict = {"ratios": [], "exposed_dp": [], "scaling": [],
                 "cp_memory": memory_predictions(report)}

    def ratio(a: str, b: str, what: str = "step") -> None:
        ra, rb = _find(speed, a), _find(speed, b)
        if ra and rb:
            out["ratios"].append({"minipar": a, "peer": b,
                                  "step_ratio": ra["step_s"] / rb["step_s"],
                                  "memory_ratio": ra["peak_gib"] / rb["peak_gib"]
                                  if rb["peak_gib"] else None})

    for z in range(4):
        ratio(f"minipar dp{n} zero{z}", f"torch FSDP2 dp{n}")
    ratio(f"minipar dp{n} zero0", f"torch DDP dp{n}")
    for tag in (" sp", ""):
        ratio(f"minipar tp{n}{tag}", f"torch DTensor tp{n}{tag}")
    for sched, v in (("1f1b", ""), ("interleaved", " v2"), ("zb", ""),
                     ("interleaved-zb", " v2")):
        ratio(f"minipar pp{n} {sched}{v}", f"torch pipelining pp{n} {sched}")
        if not v:  # like for like: both sum micro-batch gradients in bf16
            ratio(f"minipar pp{n} {sched} grad-bf16", f"torch pipelining pp{n} {sched}")
    for r in speed:  # balanced stages, the same split on both sides (the peer's name
        # has no " v2": its schedule sets the chunks)
        if r["name"].startswith(f"minipar pp{n} ") and " head-layers " in r["name"]:
            ratio(r["name"], r["name"].replace("minipar", "torch pipelining")
                  .replace(" v2", ""))
    big = [r for r in speed if r.get("group") == "big" and r.get("status") == "ok"]
    peer = [r for r in big if r["impl"] == "fsdp2"]
    for impl in ("minipar", "minipar-cli"):  # engine rows, then the command line's
        mine = [r for r in big if r["impl"] == impl]
        if mine and peer:
            ratio(mine[0]["name"], peer[0]["name"])
    base = next((r for r in speed if r["name"].startswith("minipar 1 GPU")
                 and r.get("status") == "ok"), None)
    if base:
        for r in speed:
            if r.get("group") == "dp" and r["world"] > 1 and r.get("status") == "ok":
                exposed = r["step_s"] - base["step_s"]
                out["exposed_dp"].append({"name": r["name"], "exposed_s": exposed,
                                          "exposed_share": exposed / r["step_s"]})
    scaling = report["sections"].get("scaling", {}).get("rows", [])
    one = next((r for r in scaling if r["world"] == 1 and r.get("status") == "ok"), None)
    for r in scaling:
        if one and r.get("status") == "ok":
            out["scaling"].append({"world": r["world"], "tokens_per_s": r["tokens_per_s"],
                                   "efficiency": r["tokens_per_s"] /
                                   (r["world"] * one["tokens_per_s"])})
    return out


def summary(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# multigpu: {meta['gpus']} x {meta.get('device_name')}, torch {meta['torch']}"
             f", NCCL {meta.get('nccl')}", ""]
    secs = report["sections"]
    if "calibrate" in secs:
        for r in secs["calibrate"]["rows"]:
            lines += [f"calibrate: {r.get('brief') or r.get('error') or r['status']}", ""]
    if "parity" in secs:
        lines += ["| parity layout | status | loss diff | grad-norm rel | param diff |",
                  "|---|---|---|---|---|"]
        for r in secs["parity"]["rows"]:
            f = [f"{r[k]:.1e}" if isinstance(r.get(k), float) else "-"
                 for k in ("loss_diff", "grad_norm_rel", "param_diff")]
            why = r.get("reason") or (r.get("error") or "").splitlines()[:1]
            lines.append(f"| {r['name']} | {r['status']} {why or ''} | " + " | ".join(f) + " |")
        lines.append("")
    for sec in ("speed", "scaling"):
        if sec not in secs:
            continue
        lines += [f"| {sec} | step ms | tokens/s | MFU | peak GiB | bubble meas. (synchronised "
                  "/ timed step) / theory (equal stages) / (FLOPs' stage costs) / (measured "
                  "action costs) |",
                  "|---|---|---|---|---|---|"]
        for r in secs[sec]["rows"]:
            if r.get("status") != "ok":
                why = r.get("reason") or (r.get("error") or "").splitlines()[:1]
                lines.append(f"| {r['name']} | {r['status']}: {why} | | | | |")
                continue
            bub = (f"{r['bubble_measured']:.3f}" if "bubble_measured" in r else "")
            if "bubble_measured_timed_step" in r:
                bub += f" / {r['bubble_measured_timed_step']:.3f}"
            bub += f" / {r['bubble_theory']:.3f}" if "bubble_measured" in r else ""
            if "bubble_theory_stage_costs" in r:  # rows from before it have no such key
                bub += f" / {r['bubble_theory_stage_costs']:.3f}"
            if "bubble_theory_measured_costs" in r:
                bub += f" / {r['bubble_theory_measured_costs']:.3f}"
            lines.append(f"| {r['name']} | {1e3 * r['step_s']:.1f} | {r['tokens_per_s']:,.0f}"
                         f" | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} | {bub} |")
        lines.append("")
    d = derived(report)
    for r in d["ratios"]:
        mem = f", memory {r['memory_ratio']:.2f}" if r["memory_ratio"] else ""
        lines.append(f"ratio {r['minipar']} / {r['peer']}: step {r['step_ratio']:.3f}{mem}")
    for r in d["exposed_dp"]:
        lines.append(f"exposed dp communication, {r['name']}: {1e3 * r['exposed_s']:.1f} ms "
                     f"({100 * r['exposed_share']:.1f}% of the step)")
    for r in d["scaling"]:
        lines.append(f"scaling: {r['world']} GPU(s) {r['tokens_per_s']:,.0f} tok/s, "
                     f"efficiency {100 * r['efficiency']:.1f}%")
    if "predict" in secs:
        p = secs["predict"]
        lines += ["", "| row | predicted / measured step | error | predicted / measured "
                  "GiB | error |", "|---|---|---|---|---|"]
        for r in p["rows"]:
            if "error" in r:
                lines.append(f"| {r['name']} | {r['error']} | | | |")
                continue
            me = f"{100 * r['memory_error']:+.0f}%" if r["memory_error"] is not None else "-"
            lines.append(f"| {r['name']} | {r['predicted_step_s']:.3f} / "
                         f"{r['measured_step_s']:.3f} s | {100 * r['step_error']:+.0f}% | "
                         f"{r['predicted_gib']:.1f} / {r['measured_gib']:.1f} | {me} |")
        if "measured_fastest" in p:
            within = p.get("first_choice_within_spread")
            note = "" if p["first_choice_is_fastest"] or within is None else (
                f" ({1e3 * p['first_choice_gap_s']:.1f} ms slower: "
                + ("within" if within else "beyond") + " the steps' spread)")
            lines.append(f"planner's first choice among the measured: "
                         f"{p['first_choice_among_measured']}; measured fastest: "
                         f"{p['measured_fastest']}{note}; overall plan best: "
                         f"{p.get('planner_best_overall')}")
    if d.get("cp_memory"):
        lines += ["", "| cp section row | predicted / measured GiB | error | "
                  "saved by offload, predicted / measured GiB |", "|---|---|---|---|"]
        lines += [f"| {r['name']} | {r['predicted_gib']:.1f} / {r['measured_gib']:.1f} | "
                  f"{100 * r['memory_error']:+.0f}% | "
                  + ("{:.2f} / {:.2f} |".format(*r["saved_gib"]) if "saved_gib" in r
                     else " |") for r in d["cp_memory"]]
    if "trace" in secs:
        for r in secs["trace"]["rows"]:
            lines.append(f"trace {r['name']}: {r.get('file') or r.get('error')}")
    return "\n".join(lines)


def finish(run: Run) -> None:
    predict(run)
    run.report["derived"] = derived(run.report)
    run.save()
    text = summary(run.report)
    with open(os.path.join(run.args.out, "summary.md"), "w") as f:
        f.write(text + "\n")
    print("\n" + text, flush=True)


def merge(args) -> int:
    """``--report``: one JSON and summary from several calls' JSONs (rows of a section
    concatenated in file order; the first calibration found is used for predictions)."""
    merged: dict = {"meta": None, "sections": {}, "merged_from": args.report}
    calib = None
    for path in args.report:
        with open(path) as f:
            rep = json.load(f)
        merged["meta"] = merged["meta"] or rep["meta"]
        merged.setdefault("sources", []).append(
            {"file": path, "device_name": rep["meta"].get("device_name"),
             "gpus": rep["meta"]["gpus"], "torch": rep["meta"]["torch"],
             "started": rep["meta"].get("started")})
        for name, sec in rep["sections"].items():
            if name == "predict":
                continue
            dst = merged["sections"].setdefault(name, {"rows": []})
            dst["rows"] += sec.get("rows", [])
            for row in sec.get("rows", []):
                if calib is None and "calibration" in row:
                    calib = row["calibration"]
    names = {src["device_name"] for src in merged["sources"]}
    if len(names) > 1:  # ratios stay within one call; compare across calls with care
        print(f"note: the calls ran on different cards: {sorted(map(str, names))}; "
              "predictions use the first calibration found", flush=True)
    n = merged["meta"]["gpus"]
    run = Run(args, n, dry_sizes() if merged["meta"]["device"] == "cpu" else Sizes())
    run.report = merged
    run.calibration = run.calibration or calib
    finish(run)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma separated, from {', '.join(SECTIONS)}")
    ap.add_argument("--speed", default=",".join(SPEED_GROUPS),
                    help=f"speed groups, from {', '.join(SPEED_GROUPS)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=("cuda", "cpu"), help="cpu: a dry run at tiny sizes on gloo")
    ap.add_argument("--gpus", type=int, help="ranks (default: every GPU; 2 on cpu)")
    ap.add_argument("--out", default="multigpu-out", help="folder for the (<= 5) files")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="wall-clock limit; rows past it are recorded as skipped")
    ap.add_argument("--only", help="regular expression on 'section row-name'")
    ap.add_argument("--steps", type=int, help="timed steps per speed row")
    ap.add_argument("--calibration", help="a calibration.json for predictions (else this "
                    "run's calibrate section)")
    ap.add_argument("--start-method", choices=("fork", "spawn"),
                    help="how this script starts ranks (default: spawn on CUDA, else fork)")
    ap.add_argument("--cp-tokens", type=int,
                    help="tokens per rank of the cp rows (default 8192 on CUDA)")
    ap.add_argument("--report", nargs="+", metavar="JSON",
                    help="merge these multigpu.json files and summarise; runs nothing")
    args = ap.parse_args()
    if args.report:
        return merge(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU here; use --device cpu for a dry run")
    n = args.gpus or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if args.device == "cuda" and n > torch.cuda.device_count():
        ap.error(f"--gpus {n}: this machine has {torch.cuda.device_count()} GPU(s)")
    sizes = Sizes() if args.device == "cuda" else dry_sizes()
    if args.steps:
        sizes.steps = args.steps
    sections = [s for s in args.sections.split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {bad}; choose from {SECTIONS}")
    run = Run(args, n, sizes)
    print(f"multigpu: {n} ranks on {args.device} ({run.backend}), torch {torch.__version__},"
          f" sections {sections}, budget {args.budget_s:.0f} s, out {args.out}", flush=True)
    try:
        # calibrate first (the predictions need it), then in the order given
        for name in sorted(sections, key=lambda x: x != "calibrate"):
            if name == "calibrate":
                section_calibrate(run)
            elif name == "parity":
                section_parity(run)
            elif name == "speed":
                section_speed(run, [g for g in args.speed.split(",") if g])
            elif name == "scaling":
                section_scaling(run)
            elif name == "trace":
                section_trace(run)
            elif name == "cp":  # context parallelism and offload: benchmarks/mg_cp.py
                from mg_cp import section_cp
                section_cp(run)
            elif name == "overlap":  # profiler-measured overlap: benchmarks/mg_overlap.py
                from mg_overlap import section_overlap
                section_overlap(run)
            run.save()
    finally:
        finish(run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
