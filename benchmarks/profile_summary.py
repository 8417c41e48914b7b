"""Where a step's GPU time goes: a few steps under ``torch.profiler``, summarised small.

``multigpu.py --profile REGEX`` runs this after a speed row's timed steps (so the
profiler never touches the timed ones) and keeps, per step: the wall time, the GPU's
compute (the union of every non-NCCL kernel's interval), NCCL's kernels, the part of
them no compute overlaps (exposed communication), the time the GPU ran nothing (host
launches, waits), and the kernels that took the most time. A JSON-sized answer to "why
is this row slower than that one", where a trace of a 1.3B step is hundreds of MB.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _overlap(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted disjoint span lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def profile_steps(step_fn: Callable[[int], object], first: int, steps: int,
                  device: torch.device, top: int = 15) -> dict:
    """Run ``step_fn(first) .. step_fn(first + steps - 1)`` under the profiler; the
    per-step summary (milliseconds) described in the module docstring."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for s in range(first, first + steps):
            step_fn(s)
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - t
    kernels = [e for e in prof.events()
               if str(getattr(e, "device_type", "")).endswith("CUDA")
               and e.time_range.end > e.time_range.start]
    nccl = _union([(e.time_range.start, e.time_range.end) for e in kernels
                   if "nccl" in e.name.lower()])
    compute = _union([(e.time_range.start, e.time_range.end) for e in kernels
                      if "nccl" not in e.name.lower()])
    every = _union(nccl + compute)
    per_name: dict[str, float] = defaultdict(float)
    for e in kernels:
        per_name[e.name[:90]] += e.time_range.end - e.time_range.start
    ms = 1e-3 / steps  # profiler times are microseconds
    span = (every[-1][1] - every[0][0]) if every else 0.0
    return {"steps": steps, "wall_ms": 1e3 * wall / steps,
            "gpu_span_ms": span * ms,
            "compute_ms": _length(compute) * ms, "nccl_ms": _length(nccl) * ms,
            "nccl_exposed_ms": (_length(nccl) - _overlap(nccl, compute)) * ms,
            "gpu_idle_ms": (span - _length(every)) * ms,
            "top_kernels_ms": [[name, round(t * ms, 3)] for name, t in
                               sorted(per_name.items(), key=lambda kv: -kv[1])[:top]]}
