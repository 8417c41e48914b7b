"""The memory model held to the card: every row measured on 4 x H100 80GB
(``benchmarks/card_memory.py``, docs/benchmarks.md) re-predicted by the planner's own
functions. A change that moves a prediction away from what the card held fails here.

Bounds, from the recorded rows (2026-11-27, h1-h3): the predicted reserve is within 12%
of the measured peak reserve on every row that ran (worst -11.6%, gpt-6.7b ZeRO-1 near
the card's capacity; 21 of 29 within 5%, hence the 5% median bound), every layout that
ran out of memory is predicted not to fit with the planner's margin, and every layout the
planner lets through with the margin ran.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from minipar.theory.clusters import cluster
from minipar.theory.memory import MEMORY_MARGIN
from minipar.theory.planner import evaluate

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
H100 = cluster(4, "H100-80GB", 4)


def _flags(command: str) -> dict:
    words, out, i = command.split()[3:], {}, 0
    while i < len(words):
        key = words[i][2:]
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            out[key], i = words[i + 1], i + 2
        else:
            out[key], i = True, i + 1
    return out


def _rows() -> list[tuple[dict, dict]]:
    rows, seen = [], set()
    for path in sorted(RESULTS.glob("card-memory-4xH100-*.json")):
        for row in json.loads(path.read_text())["rows"]:
            if "command" not in row or row["command"] in seen:
                continue
            seen.add(row["command"])
            f = _flags(row["command"])
            dp, pp, tp, cp = (int(f.get(k, 1)) for k in ("dp", "pp", "tp", "cp"))
            m, batch = int(f["microbatches"]), int(f["batch-size"])
            lay = evaluate(f["model"], H100, tp, pp, dp, int(f["zero"]), batch // (dp * m),
                           batch, f.get("schedule", "1f1b"), int(f.get("virtual", 1)),
                           bool(f.get("sp")), f.get("recompute", "none"), cp=cp,
                           offload=bool(f.get("offload")),
                           head_layers=int(f.get("head-layers", 0)))
            rows.append((row, lay.memory))
    return rows


def test_the_recorded_rows_are_there() -> None:
    rows = _rows()
    assert sum(r["status"] == "ok" for r, _ in rows) >= 25
    assert sum(r.get("oom", False) for r, _ in rows) >= 10


def test_the_reserve_is_predicted_within_the_measured_bounds() -> None:
    errors = []
    for row, memory in _rows():
        if row["status"] != "ok":
            continue
        reserved = max(r["device_memory"]["peak_reserved"] for r in row["ranks"])
        errors.append(memory["reserved"] / reserved - 1)
        assert abs(errors[-1]) < 0.12, (row["label"], errors[-1])
    assert statistics.median(abs(e) for e in errors) < 0.05


def test_what_ran_out_of_memory_does_not_fit_and_what_fits_ran() -> None:
    budget = (1 - MEMORY_MARGIN) * H100.gpu_memory
    for row, memory in _rows():
        if row.get("oom"):
            assert memory["process"] > budget, row["label"]
        elif memory["process"] <= budget:
            assert row["status"] == "ok", row["label"]
