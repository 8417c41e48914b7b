"""Chrome trace-event JSON from a run: one track per rank, open it in Perfetto.

Each rank becomes a process in the trace (named by its mesh coordinates) with two
threads: ``compute`` (pipeline actions, or whole steps) and ``comm`` (every counted
collective and send/recv). Times are microseconds from the earliest event of the run,
so ranks line up: all ranks of a local run share one clock.
Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

import json
from collections.abc import Iterable


def _events(rank: int, label: str, compute: Iterable[dict], comm: Iterable[dict], t0: float):
    yield {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": label}}
    yield {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}
    for tid, name in ((0, "compute"), (1, "comm")):
        yield {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}}
    for ev in compute:
        yield {"ph": "X", "pid": rank, "tid": 0, "name": ev["name"],
               "ts": (ev["start"] - t0) * 1e6, "dur": max(0.0, ev["end"] - ev["start"]) * 1e6,
               "args": {k: v for k, v in ev.items() if k not in ("name", "start", "end")}}
    for rec in comm:
        if rec["end"] != rec["end"]:  # NaN: never finished (run aborted)
            continue
        yield {"ph": "X", "pid": rank, "tid": 1, "name": f"{rec['op']} {rec['dim']}",
               "ts": (rec["start"] - t0) * 1e6, "dur": max(0.0, rec["end"] - rec["start"]) * 1e6,
               "args": {"bytes": rec["nbytes"], "shape": list(rec["shape"]),
                        "peer": rec.get("peer")}}


def chrome_trace(ranks: list[dict]) -> dict:
    """Build the trace from per-rank records with ``rank``, ``coords``, ``timeline``
    (dicts with name, start, end) and ``comm_records`` (CommRecord dicts)."""
    starts = [e["start"] for r in ranks for e in r.get("timeline", [])]
    starts += [c["start"] for r in ranks for c in r.get("comm_records", [])]
    t0 = min(starts) if starts else 0.0
    events = []
    with_cp = any(r.get("coords", {}).get("cp") for r in ranks)  # a run with cp > 1
    for r in ranks:
        c = r.get("coords", {})
        cp = f" cp{c.get('cp', 0)}" if with_cp else ""
        label = f"rank {r['rank']} (dp{c.get('dp', 0)} pp{c.get('pp', 0)} tp{c.get('tp', 0)}{cp})"
        events.extend(_events(r["rank"], label, r.get("timeline", []),
                              r.get("comm_records", []), t0))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, ranks: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(ranks), f)
