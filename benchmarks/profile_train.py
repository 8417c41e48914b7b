"""Where a step's time goes on the GPU: `python -m minipar train` under torch.profiler.

Run under torchrun, one process per GPU, with the train command's flags after ``--``:

    torchrun --nproc-per-node 4 benchmarks/profile_train.py --out $OUT/tp4.json -- \\
        --model gpt-1.3b --tp 4 --batch-size 32 --microbatches 8 --steps 4 --backend nccl

Each rank profiles its steps 3 and 4 (CPU and CUDA activity; the first two warm up) and
each rank writes ``OUT-rankR.json``: the window's wall time, the GPU's busy time (the union
of its kernels' intervals), the time only communication kernels ran (NCCL exposed: no
compute kernel beside them), the idle time, the kernel time by kind (gemm, attention,
nccl, other), NCCL's time and exposed time per collective (all-to-all runs as SendRecv),
the 15 costliest kernels, the caching allocator's retries, and the host's
costliest operators. With ``--trace-dir`` every rank's Chrome trace is kept (Perfetto).

``--rehearse R``: no torchrun, one GPU: rank R of the layout alone in this process, its
peers imagined (``engine.rehearse``'s fake process group, whose ops write stand-ins for
what the peers would send: ``minipar.comm``), profiled the same way. What one rank of a
four-GPU layout computes, kernel by kernel, on one GPU:

    python benchmarks/profile_train.py --rehearse 0 --out $OUT/13b.json -- \
        --model gpt-13b --dp 4 --zero 3 --batch-size 16 --recompute full \
        --recompute-layers 22 --dtype bf16 --backend nccl --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

import minipar.engine as engine
from minipar.__main__ import build_parser, train_config
from minipar.__main__ import main as minipar_main

KINDS = (("nccl", ("nccl",)), ("gemm", ("gemm", "cutlass", "sm90_xmma", "matmul", "s16816")),
         ("attention", ("flash", "fmha", "attention", "sdpa")))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, words in KINDS if any(w in low for w in words)), "other")


def collective_of(name: str) -> str:
    """NCCL's kernel names carry the collective: ``ncclDevKernel_AllGather_RING_LL`` ->
    ``AllGather``; all-to-all and pipeline sends run as ``SendRecv``."""
    tail = name.split("Kernel_", 1)[-1]
    return tail.split("_", 1)[0].split("(", 1)[0]


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def minus(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of ``spans`` (merged) not covered by ``cover`` (merged)."""
    total, j = 0.0, 0
    for a, b in spans:
        t = a
        while j < len(cover) and cover[j][1] <= t:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < b:
            if cover[k][0] > t:
                total += cover[k][0] - t
            t = max(t, cover[k][1])
            k += 1
        total += max(0.0, b - t)
    return total


def summarise(trace: dict) -> dict:
    kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {"kernels": 0}
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    start, end = min(a for a, _ in spans), max(b for _, b in spans)
    comm = union([s for s, e in zip(spans, kernels) if kind_of(e["name"]) == "nccl"])
    work = union([s for s, e in zip(spans, kernels) if kind_of(e["name"]) != "nccl"])
    busy = union(spans)
    by_collective: dict[str, list] = {}
    for s, e in zip(spans, kernels):
        if kind_of(e["name"]) == "nccl":
            by_collective.setdefault(collective_of(e["name"]), []).append(s)
    exposed_by_collective = {c: (length(union(v)) * 1e-3, minus(union(v), work) * 1e-3)
                             for c, v in sorted(by_collective.items())}
    by_kind: dict[str, float] = {}
    by_name: dict[str, list] = {}
    for e in kernels:
        by_kind[kind_of(e["name"])] = by_kind.get(kind_of(e["name"]), 0.0) + e["dur"]
        n = by_name.setdefault(e["name"][:90], [0.0, 0])
        n[0] += e["dur"]
        n[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:15]
    ms = 1e-3
    return {"window_ms": (end - start) * ms, "busy_ms": length(busy) * ms,
            "compute_ms": length(work) * ms, "nccl_ms": length(comm) * ms,
            "nccl_exposed_ms": minus(comm, work) * ms,
            "nccl_by_collective_ms": {c: {"ms": t, "exposed_ms": x}
                                      for c, (t, x) in exposed_by_collective.items()},
            "idle_ms": (end - start - length(busy)) * ms, "kernels": len(kernels),
            "by_kind_ms": {k: v * ms for k, v in by_kind.items()},
            "top_kernels": [{"name": k, "ms": v[0] * ms, "calls": v[1]} for k, v in top]}


def main() -> int:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--trace-dir")
    ap.add_argument("--rehearse", type=int, metavar="RANK",
                    help="this rank alone on this GPU, its peers imagined (no torchrun)")
    args, train_flags = ap.parse_args(argv[:cut]), argv[cut + 1:]
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=1, warmup=1, active=2, repeat=1))
    inner = engine.train_step

    def train_step_profiled(*a, **k):  # one profiler step per training step
        out = inner(*a, **k)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.step()
        return out

    engine.train_step = train_step_profiled
    if args.rehearse is not None:
        cfg = train_config(build_parser().parse_args(["train", *train_flags]))
        engine.imagine_peers(args.rehearse, cfg.world_size)
        with prof:
            record = engine.rank_main(cfg)
        dist.destroy_process_group()
        code, rank = 0, args.rehearse
    else:
        with prof:
            code = minipar_main(["train", *train_flags, "--json",
                                 os.path.join(tempfile.mkdtemp(), "record.json")])
        rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(args.trace_dir or tempfile.mkdtemp(), f"rank{rank}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    prof.export_chrome_trace(path)
    with open(path) as f:
        mine = summarise(json.load(f))
    if not args.trace_dir:
        os.remove(path)
    mine["rank"], mine["exit"] = rank, code
    if args.rehearse is not None:  # the steps, and the stand-ins' share of each
        mine["step_seconds"] = record["step_seconds"]
        mine["stand_in_seconds"] = record.get("stand_in_seconds")
    if torch.cuda.is_available():
        mine["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    mine["host_top"] = [
        {"name": e.key[:80], "cpu_ms": e.cpu_time_total / 1e3, "calls": e.count}
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]]
    out = args.out.removesuffix(".json") + f"-rank{rank}.json"  # (the group is gone)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"flags": train_flags, **mine}, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
