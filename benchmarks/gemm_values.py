"""Does a GPU's matmul take longer on some values than on others? (It does.)

A rehearsed rank (``python -m minipar rehearse``) computes without its peers: under
torch's fake process group nothing arrives, so what a collective would have written
stays as it was, zeros in a fresh buffer. This measures why that matters: one bf16
product of gpt-13b's MLP shape (8,192 tokens x 5,120 -> 20,480) on values drawn from
N(0, 1) (weights scaled as initialised), on zeros, and with either operand mostly zero.
A chip multiplying zeros toggles fewer bits, draws less power and keeps its clock
higher; so ``minipar.comm`` has an imagined peer write a stand-in, never leave zeros.

    python benchmarks/gemm_values.py --out $OUT/gemm_values.json
"""

from __future__ import annotations

import argparse
import json

import torch


def time_product(a: torch.Tensor, b: torch.Tensor, calls: int = 100) -> float:
    """Milliseconds of one ``a @ b`` (the mean of ``calls``, after 10 to warm up). Back
    to back under one pair of events, not each call timed apart (``fp8_gpu._cuda_seconds``
    waits after every call): the clock a chip holds under sustained load is the point."""
    for _ in range(10):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="8192,5120,20480", help="m,k,n")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    m, k, n = map(int, args.shape.split(","))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * 0.02
    cases = {
        "N(0, 1)": (x, w),
        "zeros": (torch.zeros_like(x), torch.zeros_like(w)),
        "weights 3/4 zero": (x, torch.cat([w[: k // 4], torch.zeros_like(w[k // 4:])])),
        "inputs zero": (torch.zeros_like(x), w),
    }
    rows = []
    for repeat in range(args.repeats):
        for name, (a, b) in cases.items():
            ms = time_product(a, b)
            rows.append({"case": name, "repeat": repeat, "ms": ms,
                         "tflops": 2 * m * k * n / ms / 1e9})
            print(f"{name:>18} #{repeat}: {ms:.3f} ms, {rows[-1]['tflops']:.0f} TFLOP/s")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "shape": [m, k, n], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
