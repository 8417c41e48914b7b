"""Host cost of a pipeline step, 1F1B against zero-bubble, in one process (pp = 1).

With pp = 1 every action of the step runs on this process and nothing waits on a peer,
so the time per action is the host's (on a GPU: the time to queue the kernels, unless
``--sync``). Also counted per step: top-level autograd engine calls and device copies
(``aten::clone`` + ``aten::copy_``, from the torch profiler). The zero-bubble split
(B then W) should cost about what 1F1B's single backward does; it used to cost one
engine call per parameter-owning module per W, each walking the graph upstream of its
module (quadratic in the layers), plus a ``.grad`` copy of every module's output
gradient.

    .venv/bin/python benchmarks/pp_host.py --model tiny --layers 8 24
    .venv/bin/python benchmarks/pp_host.py --model gpt-1.3b --layers 12 --batch 2 \\
        --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.profiler import profile

from minipar import GPT, Comm
from minipar.data import MarkovData, split_batch
from minipar.model import get_config
from minipar.parallel.pp import PipelineExecutor, build_stage
from minipar.parallel.schedules import make_schedule


def measure(cfg, schedule: str, m: int, batch: int, steps: int, device: str,
            dtype: torch.dtype, sync: bool) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg).to(device=device, dtype=dtype)
    ex = PipelineExecutor(build_stage(model, 0, 1), Comm(), make_schedule(schedule, 1, m),
                          synchronize=sync)
    x, y = MarkovData(cfg.vocab_size, cfg.seq_len).batch(0, batch * m)
    mbs = split_batch(x.to(device), y.to(device), 0, 1, m)
    calls, backward = [0], torch.autograd.backward

    def counted(*args, **kwargs):
        calls[0] += 1
        return backward(*args, **kwargs)

    torch.autograd.backward = counted
    try:
        ex.step(mbs)  # warm-up
        times, per_kind, calls[0] = [], Counter(), 0
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            res = ex.step(mbs)
            times.append(time.perf_counter() - t)
            for r in res.timeline:
                per_kind[r.kind] += (r.end - r.start) / steps
        engine_calls = calls[0] / steps
        with profile() as prof:
            ex.step(mbs)
    finally:
        torch.autograd.backward = backward
        ex.close()
    copies = sum(e.name in ("aten::clone", "aten::copy_") for e in prof.events())
    return {"step_ms": statistics.median(times) * 1e3, "engine_calls": engine_calls,
            "copies": copies, **{f"{k}_ms": v * 1e3 for k, v in per_kind.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 24])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1, help="sequences per micro-batch")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sync", action="store_true", help="wait for the GPU per action")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    print(f"{'layers':>6} {'schedule':>8} {'step ms':>8} {'F ms':>7} {'B ms':>7} "
          f"{'W ms':>7} {'engine calls':>12} {'copies':>6}")
    for layers in args.layers:
        cfg = get_config(args.model).with_(n_layer=layers)
        for name in ("1f1b", "zb"):
            r = measure(cfg, name, args.microbatches, args.batch, args.steps, args.device,
                        getattr(torch, args.dtype), args.sync)
            print(f"{layers:>6} {name:>8} {r['step_ms']:>8.1f} {r['F_ms']:>7.1f} "
                  f"{r['B_ms']:>7.1f} {r.get('W_ms', 0.0):>7.1f} {r['engine_calls']:>12.0f} "
                  f"{r['copies']:>6}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
