"""How much the data costs: building the Markov chain, a rank's rows per step, tokenising
the built-in corpus once (and finding it cached the second time), memory-mapped reads.

    PYTHONPATH=. python benchmarks/bench_data.py [--model gpt-1.3b] [--batch 8] [--dp 1]
        [--run-json RUN.json]

``--run-json``: the record of ``python -m minipar train --json`` for the same model and
batch; the data time per step is then shown as a share of that run's median step.
Results: docs/benchmarks.md ("Data").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import tracemalloc

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minipar import corpus  # noqa: E402
from minipar.data import MarkovData, local_batches  # noqa: E402
from minipar.model import get_config  # noqa: E402


def timed(fn, repeat: int = 20) -> float:
    """Median seconds of ``fn()`` over ``repeat`` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-1.3b")
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--run-json", help="a train --json record to compare the step with")
    args = ap.parse_args()
    cfg = get_config(args.model)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out: dict = {"model": args.model, "vocab": cfg.vocab_size, "seq_len": cfg.seq_len,
                 "batch": args.batch, "dp": args.dp, "device": str(device)}

    tracemalloc.start()
    t0 = time.perf_counter()
    markov = MarkovData(cfg.vocab_size, cfg.seq_len, seed=0)
    out["markov_build_s"] = time.perf_counter() - t0
    out["markov_build_peak_mb"] = tracemalloc.get_traced_memory()[1] / 1e6
    tracemalloc.stop()

    steps = iter(range(10**9))

    def rank_step(data):  # what one rank does per step: its rows, to the device
        for x, y in local_batches(data, next(steps), args.batch, 0, args.dp,
                                  args.microbatches):
            x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    out["markov_rows_per_step_s"] = timed(lambda: rank_step(markov))

    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        path = corpus.prepare("pystdlib", "byte", 256, cache)
        out["pystdlib_tokenise_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        corpus.prepare("pystdlib", "byte", 256, cache)
        out["pystdlib_cached_s"] = time.perf_counter() - t0
        out["pystdlib_tokens"] = int(os.path.getsize(path) // 2)
        try:
            import tokenizers  # noqa: F401  (absent on the GPU machines)

            t0 = time.perf_counter()
            corpus.prepare("pystdlib", "bpe", 8192, cache)
            out["pystdlib_bpe8192_tokenise_s"] = time.perf_counter() - t0
        except ImportError:
            pass
        text = corpus.TokenData.open(path, 256, cfg.seq_len, seed=0)
        out["memmap_rows_per_step_s"] = timed(lambda: rank_step(text))

    if args.run_json:
        with open(args.run_json) as f:
            run = json.load(f)
        steps = run["ranks"][0]["step_seconds"][1:] or run["ranks"][0]["step_seconds"]
        out["step_s"] = statistics.median(steps)
        out["markov_share_of_step"] = out["markov_rows_per_step_s"] / out["step_s"]
        out["memmap_share_of_step"] = out["memmap_rows_per_step_s"] / out["step_s"]
    for k, v in out.items():
        print(f"{k:<30} {v:.4g}" if isinstance(v, float) else f"{k:<30} {v}")


if __name__ == "__main__":
    main()
