"""What one ``launch`` costs: N ranks that do a single all-reduce, with fork and with spawn.

A notebook cell that moves a slider re-launches its ranks, so this overhead is what a
learner waits for on every interaction. ``fork`` inherits the parent's imported torch;
``spawn`` starts a fresh interpreter per rank that imports torch again, which is why
it costs seconds instead of a fraction of one.

    .venv/bin/python benchmarks/launch_overhead.py
    .venv/bin/python benchmarks/launch_overhead.py --ranks 4 --runs 7

Prints the median wall time per launch of each start method and their ratio. On a
small shared CPU absolute times mean little; compare within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from minipar.launch import launch


def one_all_reduce() -> float:
    """The smallest real job: one all-reduce of one number (importable, so spawn works)."""
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def median_launch_seconds(ranks: int, method: str, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        results = launch(one_all_reduce, ranks, start_method=method, timeout=300)
        times.append(time.perf_counter() - start)
        assert results == [float(ranks)] * ranks
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5, help="launches per start method")
    args = parser.parse_args()
    fork = median_launch_seconds(args.ranks, "fork", args.runs)
    spawn = median_launch_seconds(args.ranks, "spawn", args.runs)
    print(f"launch overhead, {args.ranks} ranks, one all_reduce, median of {args.runs}:")
    print(f"  fork : {fork:7.3f} s")
    print(f"  spawn: {spawn:7.3f} s   ({spawn / fork:.0f}x fork)")


if __name__ == "__main__":
    main()
