"""Pipeline step time: minipar's executor against torch.distributed.pipelining, in one run.

For GPipe, 1F1B and interleaved 1F1B, both engines train the same GPT (same seed, same
batch, same stage split) on gloo; we report the median step time of each, their ratio
(minipar / torch, target <= 1.0), whether the losses agree, and minipar's measured
bubble (from its own timeline records) beside the theoretical one (the schedule's
lists simulated with forward 1, backward 2).

    .venv/bin/python benchmarks/bench_pp.py --pp 2 --microbatches 8
    .venv/bin/python benchmarks/bench_pp.py --pp 4 --microbatches 8 --json out.json

On a small shared CPU absolute times mean little; compare within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from minipar import GPT, Comm, launch
from minipar.data import MarkovData, split_batch
from minipar.model import embed_tokens, get_config
from minipar.parallel.pp import PipelineExecutor, build_stage
from minipar.parallel.schedules import make_schedule
from minipar.theory.bubble import bubble_stats, simulate

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved": "ScheduleInterleaved1F1B"}


class _UpToLogits(nn.Module):
    """A minipar chunk that stops at the logits: torch's schedules apply the loss."""

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.chunk
        h = embed_tokens(c.tok_emb, c.pos_emb, c.drop, x) if c.is_first else x
        for block in c.blocks.values():
            h = block(h)
        return c.head(c.ln_f(h)) if c.is_last else h


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _ours(model_name: str, name: str, m: int, v: int, x, y):
    """minipar's executor; returns (one step, close)."""
    comm = Comm()
    torch.manual_seed(0)
    model = GPT(model_name)
    chunks = build_stage(model, comm.rank, comm.size, v)
    ex = PipelineExecutor(chunks, comm, make_schedule(name, comm.size, m, v))
    mbs = split_batch(x, y, 0, 1, m)

    def step() -> tuple[float | None, list]:
        model.zero_grad(set_to_none=True)
        res = ex.step(mbs)
        return res.loss, res.timeline

    return step, ex.close


def _theirs(model_name: str, name: str, m: int, v: int, x, y):
    """torch.distributed.pipelining on the same stage split; returns one step."""
    from torch.distributed import pipelining

    comm = Comm()
    torch.manual_seed(0)
    model = GPT(model_name)
    chunks = build_stage(model, comm.rank, comm.size, v)
    n = comm.size * v
    stages = [pipelining.PipelineStage(_UpToLogits(c), c.index, n, torch.device("cpu"))
              for c in chunks]
    cls = getattr(pipelining, TORCH_SCHEDULES[name])
    sched = cls(stages if name == "interleaved" else stages[0], n_microbatches=m,
                loss_fn=_loss)
    first = any(c.is_first for c in chunks)
    last = any(c.is_last for c in chunks)

    def step() -> tuple[float | None, list]:
        model.zero_grad(set_to_none=True)
        losses: list = []
        sched.step(*((x,) if first else ()), target=y if last else None,
                   losses=losses if last else None)
        return (float(torch.stack(losses).mean()) if last else None), []

    return step


def _timed(step, comm: Comm) -> tuple[float, tuple]:
    comm.barrier()
    t = time.perf_counter()
    out = step()
    comm.barrier()
    return time.perf_counter() - t, out


def _rank(model_name: str, schedules: list[tuple[str, int]], m: int, batch: int,
          steps: int) -> list[dict]:
    torch.manual_seed(0)
    cfg = get_config(model_name)
    x, y = MarkovData(cfg.vocab_size, cfg.seq_len).batch(0, batch)
    comm = Comm()
    rows = []
    for name, v in schedules:
        ours, close = _ours(model_name, name, m, v, x, y)
        theirs = _theirs(model_name, name, m, v, x, y)
        mine, their = [], []
        for i in range(2 + steps):  # alternate, so both see the same machine load
            t_ours, (loss, timeline) = _timed(ours, comm)
            t_theirs, (their_loss, _) = _timed(theirs, comm)
            if i >= 2:  # the first steps exchange shapes
                mine.append(t_ours)
                their.append(t_theirs)
        close()
        rows.append({"schedule": name, "virtual": v, "ours_s": statistics.median(mine),
                     "torch_s": statistics.median(their), "loss": loss,
                     "torch_loss": their_loss, "timeline": timeline})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--virtual", type=int, default=2, help="chunks per rank (interleaved)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    schedules = [("gpipe", 1), ("1f1b", 1), ("interleaved", args.virtual)]
    results = launch(_rank, args.pp, args=(args.model, schedules, args.microbatches,
                                          args.batch, args.steps), timeout=600)
    print(f"pp={args.pp} m={args.microbatches} batch={args.batch} model={args.model} "
          f"steps={args.steps} (median), gloo, 1 thread per rank")
    print(f"{'schedule':<14}{'minipar ms':>11}{'torch ms':>10}{'ratio':>7}"
          f"{'loss equal':>11}{'bubble meas.':>13}{'theory':>8}")
    summary = []
    for i, (name, v) in enumerate(schedules):
        row = results[-1][i]  # the last rank holds the loss
        timeline = [results[r][i]["timeline"] for r in range(args.pp)]
        measured = bubble_stats(timeline)["bubble_fraction"]
        theory = bubble_stats(simulate(make_schedule(name, args.pp, args.microbatches, v)))
        ratio = row["ours_s"] / row["torch_s"]
        same = abs(row["loss"] - row["torch_loss"]) < 1e-5
        label = name + (f" v={v}" if name == "interleaved" else "")
        print(f"{label:<14}{row['ours_s'] * 1e3:>11.1f}{row['torch_s'] * 1e3:>10.1f}"
              f"{ratio:>7.2f}{str(same):>11}{measured:>13.3f}{theory['bubble_fraction']:>8.3f}")
        summary.append({"schedule": name, "virtual": v, "minipar_ms": row["ours_s"] * 1e3,
                        "torch_ms": row["torch_s"] * 1e3, "ratio": ratio, "loss_equal": same,
                        "bubble_measured": measured,
                        "bubble_theory": theory["bubble_fraction"]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": summary}, f, indent=1)


if __name__ == "__main__":
    main()
