"""Peak bytes per rank of ZeRO 0-3 at dp 4 (the engine's memory record: weights,
gradients and optimizer states at their peak within a step; activations) and the host
RSS of rank 0 after training (the process's peak too: it includes the build, where every
rank still constructs the whole reference model first).

    PYTHONPATH=. python benchmarks/dp_memory.py small 1 fp32   # model, micro-batches, dtype
"""

import resource
import sys

import psutil

from minipar.config import TrainConfig
from minipar.engine import rank_main
from minipar.launch import launch


def ranked(cfg):
    rec = rank_main(cfg)
    return {"memory": rec["memory"], "rss": psutil.Process().memory_info().rss,
            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

model, m, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for zero in (0, 1, 2, 3):
    cfg = TrainConfig(model=model, dp=4, zero=zero, steps=2, microbatches=m, dtype=dtype)
    r = launch(ranked, 4, args=(cfg,), timeout=300)[0]
    mem = r["memory"]
    print(f"zero={zero} m={m} {dtype}: " + " ".join(f"{k}={v/2**10:.0f}K" for k, v in mem.items())
          + f" | state(p+g+o)={(mem['params']+mem['grads']+mem['optimizer'])/2**10:.0f}K"
          f" rss={r['rss']/2**20:.0f}M maxrss={r['maxrss']/2**20:.0f}M", flush=True)
