"""What a micro-batch's gradient accumulation costs on one GPU, by kernel (issue 17).

minipar adds each micro-batch's bf16 weight gradient into an fp32 buffer
(``FlatParams.add_grad``: ``slot.add_(g)``, a mixed-dtype TensorIterator kernel); torch's
pipelining peer adds into bf16 ``.grad``. On 4 x H200 the fp32 sums cost minipar's pp 4
1F1B step ~27 ms against ``--grad-dtype bf16``. This times the candidate kernels on
buffers of a pipeline stage's size, so the next change is chosen from numbers:

    python benchmarks/grad_accumulate.py --out result.json

Rows: seconds per call and effective GB/s (bytes read + written) for ``fp32 += bf16``
(mixed), ``fp32 += bf16.float()`` (a cast, then a same-dtype add), ``bf16 += bf16`` (the
peer's), ``fp32.copy_(bf16)`` (a step's first micro-batch), ``fp32 += fp32``.
"""

from __future__ import annotations

import argparse
import json

import torch


def timed(fn, reps: int = 20) -> float:
    """Median seconds of ``fn()`` on the current CUDA stream (after two warm-up calls)."""
    fn(), fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def cases(n: int) -> dict:
    """name -> (kernel on buffers of n elements, bytes it reads and writes an element)."""
    g16 = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    g32 = torch.randn(n, device="cuda", dtype=torch.float32)
    acc16 = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    acc32 = torch.zeros(n, device="cuda", dtype=torch.float32)
    return {"fp32 += bf16 (mixed kernel)": (lambda: acc32.add_(g16), 2 + 4 + 4),
            "fp32 += bf16.float()": (lambda: acc32.add_(g16.float()), 2 + 4 + 4 + 4 + 4),
            "bf16 += bf16": (lambda: acc16.add_(g16), 2 + 2 + 2),
            "fp32.copy_(bf16)": (lambda: acc32.copy_(g16), 2 + 4),
            "fp32 += fp32": (lambda: acc32.add_(g32), 4 + 4 + 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="grad_accumulate.json")
    ap.add_argument("--sizes", default="50e6,350e6", help="elements per buffer")
    args = ap.parse_args()
    rows = []
    for n in (int(float(x)) for x in args.sizes.split(",")):
        for name, (fn, per) in cases(n).items():
            s = timed(fn)
            rows.append({"elements": n, "case": name, "seconds": s,
                         "bytes_per_element": per, "GB_per_s": n * per / s / 1e9})
            print(f"{n:>11,} {name:<28} {1e3 * s:8.3f} ms {n * per / s / 1e9:8.0f} GB/s")
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
