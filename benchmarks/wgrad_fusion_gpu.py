"""One GPU: the fused weight-gradient GEMM against autograd's matmul + hook add, in the
engine (gpt-1.3b, bf16, fp32 gradient sums, m micro-batches), and its parity on CUDA.

    python benchmarks/wgrad_fusion_gpu.py --out DIR     # writes DIR/wgrad_fusion.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from minipar.config import TrainConfig
from minipar.engine import train, train_reference
from minipar.parity import compare


def step_ms(run: dict, skip: int) -> float:
    return 1e3 * statistics.median(run["ranks"][0]["step_seconds"][skip:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model", default="gpt-1.3b")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--zero", type=int, default=0, help="ZeRO stage (one GPU: dp 1)")
    ap.add_argument("--grads", default="fp32,bf16", help="gradient sum dtypes to time")
    ap.add_argument("--order", default="1,0,1", help="fused (1) / plain (0) runs, in order")
    args = ap.parse_args()
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "speed": {},
           "parity": {}}
    base = dict(model=args.model, dtype="bf16", backend="nccl", device="cuda", fused=True,
                batch_size=2 * args.microbatches, microbatches=args.microbatches,
                steps=args.steps, warmup=2, lr=3e-4, timeout=500, zero=args.zero)
    for fused in (bool(int(f)) for f in args.order.split(",")):  # (the first run also
        for grad in args.grads.split(","):  # pays the machine's warm-up)
            run = train(TrainConfig(**base, grad_dtype=grad, wgrad_fusion=fused))
            out["speed"].setdefault(f"grad {grad} fused {fused}", []).append(
                round(step_ms(run, 3), 2))
    small = dict(model="tiny", backend="nccl", device="cuda", steps=4, microbatches=2,
                 batch_size=8, timeout=300, zero=args.zero)
    for dtype in ("fp32", "bf16"):
        for layout in (dict(), dict(microbatches=4)):
            cfg = TrainConfig(**(small | layout), dtype=dtype)
            p = compare(train(cfg), train_reference(TrainConfig(**(small | layout | {"zero": 0}))))
            out["parity"][f"{dtype} m{cfg.microbatches}"] = {
                "loss": p.loss_diff, "grad": p.grad_norm_rel}
    print(json.dumps(out, indent=1))
    with open(os.path.join(args.out, "wgrad_fusion.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
