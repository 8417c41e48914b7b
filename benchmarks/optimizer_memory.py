"""What torch's optimizer step allocates beyond its states, per kernel (one JSON).

The memory model books, for the optimizer step, a temporary the size of the fp32
parameters it updates where the kernel makes one (``theory.memory.optimizer_step_bytes``).
This measures it: a few fp32 tensors (several million elements, the sizes of
``ZeroOptimizer``'s flat buckets) with gradients, one step to make the states, then the
peak of the bytes allocated during a second step beyond those before it, as a share of
the parameters' bytes. Kernels: ``foreach`` (multi-tensor, ``torch._foreach_*``: each
list op allocates its whole output list at once), ``fused`` (one kernel per list,
in place) and ``forloop`` (one tensor at a time: a temporary of one tensor), for AdamW,
SGD and SGD with momentum. On the CPU the peak comes from the profiler's memory events,
on CUDA from ``torch.cuda.max_memory_allocated``.

    PYTHONPATH=. python benchmarks/optimizer_memory.py --out $OUT/optimizer_memory.json
    PYTHONPATH=. python benchmarks/optimizer_memory.py --device cuda --out ...
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

SIZES = (4_000_000, 2_000_000, 1_000_000, 1_000)  # elements per tensor
OPTIMIZERS = {"adam": (torch.optim.AdamW, {"weight_decay": 0.01}),
              "sgd": (torch.optim.SGD, {}),
              "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9})}
KERNELS = {"foreach": {"foreach": True}, "fused": {"fused": True},
           "forloop": {"foreach": False}}


def _cpu_peak(step) -> int:
    """Peak bytes allocated during ``step()`` beyond those before it, on the CPU."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = top = 0
    for e in events:
        now += e.nbytes()
        top = max(top, now)
    return top


def _cuda_peak(step) -> int:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def step_peak(optimizer: str, kernel: str, device: str = "cpu",
              sizes: tuple[int, ...] = SIZES) -> dict:
    """One row: the step's peak beyond its states, in bytes and as a share of the fp32
    parameters' bytes (and of the largest tensor's)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(params, lr=1e-3, **kwargs, **KERNELS[kernel])
    opt.step()  # the states (moments, momentum buffers) are made here
    peak = (_cuda_peak if device == "cuda" else _cpu_peak)(opt.step)
    n = sum(sizes)
    return {"optimizer": optimizer, "kernel": kernel, "device": device, "elements": n,
            "peak_bytes": peak, "share_of_params": peak / (4 * n),
            "share_of_largest": peak / (4 * max(sizes))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    rows = [step_peak(o, k, args.device) for o in OPTIMIZERS for k in KERNELS]
    meta = {"argv": sys.argv, "torch": torch.__version__, "sizes": SIZES}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    for r in rows:
        print(f"{r['optimizer']:<13} {r['kernel']:<8} {r['peak_bytes'] / 2**20:8.1f} MiB "
              f"{r['share_of_params']:.3f} of the parameters, "
              f"{r['share_of_largest']:.3f} of the largest tensor")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
