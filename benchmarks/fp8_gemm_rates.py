"""Float8 against bf16 GEMM rates at the shapes of the GPT presets' block linears, and
one compiled rowwise cast's time per operand shape. One GPU; one JSON.

The step model (``minipar/theory/rates.py``, ``float8_seconds``) prices what ``--fp8``
saves with one bf16 and one float8 rate for every GEMM; this measures how far the rates
of the real shapes are from those. For each preset (gpt2-350m, gpt-1.3b, gpt-6.7b,
gpt-13b) and micro-batch of 4,096, 8,192 and 16,384 tokens, each block linear (qkv,
proj, fc1, fc2: (in, out) features) and each of its three GEMMs (y = x W^T: tokens x in
x out; dx = dy W: tokens x out x in; dW = dy^T x: out x tokens x in), ``a @ b.t()`` in
bf16 against the engine's float8 GEMM (``Float8Matmul("rowwise").mm``: ``torch._scaled_mm``,
e4m3 x e4m3, per-row scales, bf16 out): median of 20 after 3 warm-ups, CUDA events
(``fp8_gpu._cuda_seconds``). The casts: the engine's ``Float8Matmul.quantize`` (amax per
row, a power-of-two scale, e4m3) compiled alone on each operand shape; called on its own
it includes the host's launch and guard time, which a compiled block does not pay per
cast.

    python benchmarks/fp8_gemm_rates.py --out $OUT/gemms.json      # ~1 min on one H100
"""

from __future__ import annotations

import argparse
import json

import torch
from fp8_gpu import _cuda_seconds

from minipar.parallel.fp8 import E4M3, Float8Matmul

ROWWISE = Float8Matmul("rowwise")
cast_rowwise = torch.compile(ROWWISE.quantize)
WIDTHS = {"gpt2-350m": 1024, "gpt-1.3b": 2048, "gpt-6.7b": 4096, "gpt-13b": 5120}
TOKENS = (4096, 8192, 16384)


def gemm_row(model: str, tokens: int, linear: str, gemm: str, m: int, k: int,
             n: int) -> dict:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a8 = ROWWISE.quantize(a, ("tokens", "in"), E4M3)
    b8 = ROWWISE.quantize(b, ("out", "in"), E4M3)
    flops = 2 * m * k * n
    bf16 = _cuda_seconds(lambda: a @ b.t(), iters=20)
    fp8 = _cuda_seconds(lambda: ROWWISE.mm(a8, b8, torch.bfloat16), iters=20)
    return dict(model=model, tokens=tokens, linear=linear, gemm=gemm, M=m, K=k, N=n,
                bf16_s=bf16, fp8_s=fp8, bf16_tflops=flops / bf16 / 1e12,
                fp8_tflops=flops / fp8 / 1e12)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON file to write")
    out = p.parse_args().out
    gemms, casts = [], []
    for model, d in WIDTHS.items():
        linears = {"qkv": (d, 3 * d), "proj": (d, d), "fc1": (d, 4 * d), "fc2": (4 * d, d)}
        for tokens in TOKENS:
            for name, (k, n) in linears.items():
                shapes = {"y": (tokens, k, n), "dx": (tokens, n, k), "dw": (n, tokens, k)}
                for gemm, (m, kk, nn) in shapes.items():
                    gemms.append(gemm_row(model, tokens, name, gemm, m, kk, nn))
            for features in sorted({f for pair in linears.values() for f in pair}):
                x = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16)
                t = _cuda_seconds(lambda x=x: cast_rowwise(x, ("tokens", "in"), E4M3),
                                  iters=20)
                casts.append(dict(tokens=tokens, features=features, seconds=t,
                                  gbps=tokens * features * 5 / t / 1e9))  # 2 + 2 + 1 B
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "gemms": gemms, "casts": casts}, f, indent=1)
    for r in gemms:
        if r["tokens"] == 8192:
            print(f"{r['model']:10} {r['linear']:5} {r['gemm']:3} {r['M']:6} {r['K']:6} "
                  f"{r['N']:6}  bf16 {r['bf16_tflops']:5.0f}  fp8 {r['fp8_tflops']:5.0f} TFLOP/s")


if __name__ == "__main__":
    main()
