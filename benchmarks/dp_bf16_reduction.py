"""Drift of bf16 training against the fp32 reference: gradients accumulated and reduced in
fp32 (the default) vs in bf16 (the option), dp 4, m 4, 10 steps, tiny.

    PYTHONPATH=. python benchmarks/dp_bf16_reduction.py
"""

import torch

from minipar.config import TrainConfig
from minipar.engine import train, train_reference
from minipar.parallel.zero import Zero3, ZeroOptimizer
from minipar.parity import compare

knobs = dict(steps=10, dp=4, microbatches=4)
ref = train_reference(TrainConfig(steps=10))
for zero in (1, 3):
    for wire in ("fp32", "bf16"):
        if wire == "bf16":
            ZeroOptimizer.__init__.__kwdefaults__["grad_dtype"] = None  # the weights' bf16
            Zero3.__init__.__kwdefaults__["grad_dtype"] = torch.bfloat16
        run = train(TrainConfig(zero=zero, dtype="bf16", **knobs, timeout=600))
        p = compare(run, ref)
        print(f"zero={zero} accumulate+reduce in {wire}: {p.describe()}; bytes/step "
              f"{run['ranks'][0]['comm_bytes_per_step']/2**10:.0f} KiB", flush=True)
        ZeroOptimizer.__init__.__kwdefaults__["grad_dtype"] = torch.float32
        Zero3.__init__.__kwdefaults__["grad_dtype"] = torch.float32
