"""Data-parallel step time: minipar against PyTorch's own, in one run.

Three pairs train the same GPT (same seed, same batch per rank, AdamW, fp32) on gloo:

* minipar data parallelism (``ZeroOptimizer(stage=0)``, overlapped, 25 MiB buckets) vs
  ``DistributedDataParallel`` (also 25 MiB buckets, overlapped);
* minipar ZeRO-1 (``ZeroOptimizer(stage=1)``) vs ``ZeroRedundancyOptimizer`` on top of
  DDP (PyTorch's ZeRO-1 needs DDP for the gradient all-reduce);
* minipar ZeRO-3 (``Zero3``, a unit per block, fp32) vs FSDP2
  ``fully_shard`` (each block, then the root).

Every AdamW, minipar's and torch's, uses the kernel ``--kernel`` names: ``fused`` (the
engine's default: one pass over each tensor) or ``default`` (torch's per-tensor loop, about
eight passes and a temporary). minipar steps flat buffers (ZeRO's design), DDP one tensor
per parameter: on a CPU the loop's passes over a buffer larger than the cache stream from
memory, over a parameter they stay in cache, so under ``default`` minipar's step is slower
for the optimizer's sake, not the data parallelism's.

A step is forward, backward, gradient sync and optimizer step. The six configurations
take turns step by step, so that a busy machine slows them alike; we print the median
step time of each (the slowest rank's) and the ratio minipar / torch (targets: <= 1.05
vs DDP, <= 1.0 vs FSDP2), and the loss each reached (the same run, the same numbers).

    .venv/bin/python benchmarks/bench_dp.py                   # 2 and 4 ranks
    .venv/bin/python benchmarks/bench_dp.py --worlds 2 --json out.json
    .venv/bin/python benchmarks/bench_dp.py --worlds 2 --kernel default

On a small shared CPU absolute times mean little; compare within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from minipar import launch
from minipar.comm import Comm
from minipar.data import MarkovData, split_batch
from minipar.model import GPT, GPTConfig
from minipar.parallel.zero import Zero3, ZeroOptimizer

PAIRS = [("ddp", "minipar ZeRO-0 (DDP)", "torch DDP"),
         ("zero1", "minipar ZeRO-1", "torch ZeroRedundancyOptimizer"),
         ("zero3", "minipar ZeRO-3", "torch FSDP2 fully_shard")]
LR = 1e-3


def _build(kind: str, cfg: GPTConfig, adamw: dict):
    """(model, step function) for one configuration; the step returns the loss.
    ``adamw``: the AdamW keywords every configuration shares (the kernel)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = GPT(cfg)
    if kind == "minipar-ddp":
        opt = ZeroOptimizer(model, torch.optim.AdamW, stage=0, comm=Comm(), lr=LR,
                            mode="overlapped", bucket_mb=25, grad_dtype=None, **adamw)
        return _loop(model, opt)
    if kind == "torch-ddp":
        ddp = DDP(model, bucket_cap_mb=25)
        return _loop(ddp, torch.optim.AdamW(model.parameters(), lr=LR, **adamw))
    if kind == "minipar-zero1":
        opt = ZeroOptimizer(model, torch.optim.AdamW, stage=1, comm=Comm(), lr=LR, **adamw)
        return _loop(model, opt)
    if kind == "torch-zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = DDP(model, bucket_cap_mb=25)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                      lr=LR, **adamw)
        return _loop(ddp, opt)
    if kind == "minipar-zero3":
        sharded = Zero3(model, Comm())
        opt = torch.optim.AdamW(sharded.parameters(), lr=LR, **adamw)
        sharded.publish_after(opt)
        return _loop(sharded, opt)
    if kind == "torch-zero3":
        from peers import fsdp2  # benchmarks/peers.py: the PyTorch-native peers
        from torch.distributed.device_mesh import init_device_mesh

        model = fsdp2(model, init_device_mesh("cpu", (dist.get_world_size(),)))
        return _loop(model, torch.optim.AdamW(model.parameters(), lr=LR, **adamw))
    raise ValueError(kind)


def _loop(model, opt):
    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)
    return step


def bench(cfg: GPTConfig, batch: int, steps: int, warmup: int = 2,
          kernel: str = "fused") -> dict:
    """On every rank: ``warmup`` then ``steps`` timed steps of each configuration, the
    configurations taking turns step by step (a busy machine slows them alike)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    data = MarkovData(cfg.vocab_size, cfg.seq_len)
    kinds = [f"{side}-{pair}" for pair, _, _ in PAIRS for side in ("minipar", "torch")]
    adamw = {"fused": True} if kernel == "fused" else {}
    steppers = {k: _build(k, cfg, adamw) for k in kinds}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    losses: dict[str, float] = {}
    for s in range(warmup + steps):
        x, y = split_batch(*data.batch(s, batch * world), rank, world, 1)[0]
        for k in kinds:
            dist.barrier()
            t0 = time.perf_counter()
            losses[k] = steppers[k](x, y)
            if s >= warmup:
                times[k].append(time.perf_counter() - t0)
    out = torch.tensor([statistics.median(times[k]) for k in kinds], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
    return {"median_s": dict(zip(kinds, out.tolist())), "loss": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each")
    ap.add_argument("--kernel", choices=("fused", "default"), default="fused",
                    help="every AdamW's kernel (fused: the engine's default)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    cfg = GPTConfig(vocab_size=256, seq_len=a.seq, n_layer=a.layers, n_head=8,
                    d_model=a.d_model)
    n = sum(p.numel() for p in GPT(cfg, device="meta").parameters())
    print(f"GPT d_model={a.d_model} layers={a.layers} seq={a.seq}: {n / 1e6:.2f}M params; "
          f"{a.batch} sequences per rank; AdamW ({a.kernel} kernel) fp32; gloo; "
          f"torch {torch.__version__}")
    print(f"{'ranks':>5}  {'minipar':<22} {'s/step':>7}  {'torch':<30} {'s/step':>7}  "
          f"{'ratio':>5}  loss (minipar / torch)")
    results = []
    for world in a.worlds:
        res = launch(bench, world, args=(cfg, a.batch, a.steps, 2, a.kernel),
                     timeout=900)[0]
        for pair, ours, theirs in PAIRS:
            t_ours, t_theirs = (res["median_s"][f"{s}-{pair}"] for s in ("minipar", "torch"))
            l_ours, l_theirs = (res["loss"][f"{s}-{pair}"] for s in ("minipar", "torch"))
            ratio = t_ours / t_theirs
            print(f"{world:>5}  {ours:<22} {t_ours:>7.3f}  {theirs:<30} {t_theirs:>7.3f}  "
                  f"{ratio:>5.2f}  {l_ours:.4f} / {l_theirs:.4f}")
            results.append({"world": world, "pair": pair, "minipar_s": t_ours,
                            "torch_s": t_theirs, "ratio": ratio, "loss_minipar": l_ours,
                            "loss_torch": l_theirs})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a), "params": n, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
