"""The host side of one ZeRO-Offload step (``zero.offload.OnHost``), phase by phase, on
the CPU: where the time goes once the copies are hidden (issue 20).

A real ``ZeroOptimizer(place=OnHost())`` (one process, stage 1, bf16 weights) over a
stack of square linear layers; the "device" is the CPU too, so each phase is the host's
work alone:

* land: each flat's reduced fp32 shard lands ``--landings`` times a step and is put in
  (then added to) the host gradient: the engine lands once a step at every stage; a
  ``Zero3`` not told its ``backwards_per_step`` lands once per micro-batch;
* norm: the global gradient norm over the host shards (``zero.shards.global_grad_norm``);
* clip: the clip scale applied to the host shards (``--no-clip``: a norm under the limit);
* step: the host optimizer over the fp32 masters (AdamW; ``--fused``: torch's fused one);
* publish: each master cast to bf16 into its upload buffer and copied into ``full``;
* zero: ``zero_grad``.

    PYTHONPATH=. python benchmarks/offload_host.py --layers 4 --width 4096   # 67 M params
    PYTHONPATH=. python benchmarks/offload_host.py --fused --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from minipar.comm import Comm
from minipar.parallel.zero import OnHost, ZeroOptimizer
from minipar.parallel.zero.shards import global_grad_norm


def build(layers: int, width: int, fused: bool) -> tuple[ZeroOptimizer, list[torch.Tensor]]:
    """The optimizer over ``layers`` bf16 ``width``-square weights, one bucket each, and
    one reduced fp32 "device" shard per flat to land."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    model.to(torch.bfloat16)
    kwargs = {"fused": True} if fused else {}
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=1, comm=Comm(), bucket_mb=0,
                        lr=1e-4, weight_decay=0.1, place=OnHost(), **kwargs)
    shards = [torch.randn(f.hi - f.lo) * 1e-3 for f in opt.flats]
    return opt, shards


def one_step(opt: ZeroOptimizer, shards: list[torch.Tensor], landings: int,
             clip: bool) -> dict[str, float]:
    """Seconds of each phase of one step."""
    host, times = opt.place, {}

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        times[name] = time.perf_counter() - t0
        return out

    def land():
        for _ in range(landings):
            for i, (f, s) in enumerate(zip(opt.flats, shards)):
                host.grad_in(i, s, f.master)
            host.land_all()

    timed("land", land)
    device = opt.flats[0].full.device
    norm = timed("norm", lambda: global_grad_norm((g for _, g in opt.grad_shards()),
                                                  [opt.comm], device=device))
    limit = float(norm) / 2 if clip else float(norm) * 2
    timed("clip", lambda: opt.scale_grads((limit / (norm + 1e-6)).clamp(max=1.0)))
    timed("step", opt.inner.step)
    timed("publish", lambda: host.publish([f.master for f in opt.flats],
                                         [f.full[f.lo:f.hi] for f in opt.flats]))
    timed("zero", opt.zero_grad)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--landings", type=int, default=1, help="per step (ZeRO-3: micro-batches)")
    ap.add_argument("--steps", type=int, default=5, help="timed, after one warm-up step")
    ap.add_argument("--fused", action="store_true", help="AdamW(fused=True) on the host")
    ap.add_argument("--no-clip", action="store_true", help="the norm is under the limit")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    opt, shards = build(a.layers, a.width, a.fused)
    n = sum(f.master.numel() for f in opt.flats)
    runs = [one_step(opt, shards, a.landings, not a.no_clip) for _ in range(a.steps + 1)][1:]
    ms = {k: 1e3 * statistics.median(r[k] for r in runs) for k in runs[0]}
    total = sum(ms.values())
    per_step = [1e3 * sum(r.values()) for r in runs]
    print(f"{n / 1e6:.1f} M params on the host, {a.landings} landing(s) a step, "
          f"{'fused' if a.fused else 'default'} AdamW, {torch.get_num_threads()} threads")
    for k, v in ms.items():
        print(f"  {k:8s} {v:8.1f} ms  {n / v / 1e6:6.2f} G params/s")
    print(f"  {'total':8s} {total:8.1f} ms  {n / total / 1e6:6.2f} G params/s "
          f"(steps: {', '.join(f'{t:.0f}' for t in per_step)} ms)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"params": n, "landings": a.landings, "fused": a.fused,
                       "clip": not a.no_clip, "threads": torch.get_num_threads(),
                       "torch": torch.__version__, "ms": ms, "total_ms": total,
                       "step_ms": per_step}, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
