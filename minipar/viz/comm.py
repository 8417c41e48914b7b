"""Communication per rank: bytes by mesh dimension and op, measured beside predicted.

Input is what ``CommLog.summary()`` returns (``{dim: {op: {"calls", "bytes",
"wire_bytes", ...}}}``), one per rank, and optionally the same shape from
``minipar.theory.comm_volume.comm_volume`` (one per rank, or one for all). The x axis
has two levels: "dim op", then the rank; each position has a bar per source.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

COLOURS = {"measured": "#4C78A8", "theory": "#F58518"}


def _as_list(summaries, n: int | None = None) -> list[dict]:
    if isinstance(summaries, dict) and summaries and all(isinstance(k, int) for k in summaries):
        return [summaries[k] for k in sorted(summaries)]  # {rank: summary}
    if isinstance(summaries, dict):
        return [summaries] * (n or 1)  # one summary for every rank
    return list(summaries)


def comm_figure(measured: Sequence[dict] | dict, theory: Sequence[dict] | dict | None = None,
                key: str = "wire_bytes", unit: str = "MB",
                title: str = "communication per rank") -> go.Figure:
    """Grouped bars of ``key`` (``wire_bytes``, ``bytes`` or ``calls``) per (dim op, rank)."""
    scale = 1 if key == "calls" else {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
    sources = {"measured": _as_list(measured)}
    if theory is not None:
        sources["theory"] = _as_list(theory, len(sources["measured"]))
        if len(sources["theory"]) != len(sources["measured"]):
            raise ValueError("theory and measurement need one summary per rank each")
    cats = sorted({(d, op) for rows in sources.values() for s in rows
                   for d, ops in s.items() for op in ops})
    n = len(sources["measured"])
    outer = [f"{d} {op}" for d, op in cats for _ in range(n)]
    inner = [f"rank {r}" for _ in cats for r in range(n)]
    fig = go.Figure()
    for name, rows in sources.items():
        y = [rows[r].get(d, {}).get(op, {}).get(key, 0) / scale for d, op in cats
             for r in range(n)]
        fig.add_trace(go.Bar(x=[outer, inner], y=y, name=name,
                             marker={"color": COLOURS[name]}))
    label = "calls" if key == "calls" else f"{key.replace('_', ' ')} ({unit})"
    fig.update_layout(barmode="group", title=title, yaxis_title=label, uirevision="comm")
    return fig
