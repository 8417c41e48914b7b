"""Memory per rank as stacked bars: parameters, gradients, optimizer states, activations.

Each rank gets one bar per source: the theory (``minipar.theory.memory``) and, when
given, what the run measured (``minipar.meter``) right beside it, on a two-level axis
(rank, then source). Rows are dicts with the keys of ``memory_breakdown``; a missing
key counts as 0, an extra ``other`` key (buffers, a claim's asserted "working
memory") is drawn as its own layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

PARTS = ("params", "grads", "optimizer", "activations", "other")
LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states",
          "activations": "activations", "other": "other (buffers, asserted)"}
COLOURS = {"params": "#4C78A8", "grads": "#72B7B2", "optimizer": "#F58518",
           "activations": "#E45756", "other": "#BAB0AC"}
UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}


def memory_figure(theory: Sequence[dict], measured: Sequence[dict] | None = None,
                  labels: Sequence[str] | None = None, unit: str = "GB",
                  capacity: float | None = None, title: str = "memory per rank") -> go.Figure:
    """Stacked bars of each row's memory parts; ``measured`` (same length) beside it.

    ``labels`` name the bars (default ``rank i``, or the row's ``rank``); ``capacity``
    (bytes) draws the GPU's memory as a line.
    """
    scale = UNITS[unit]
    names = list(labels) if labels is not None else [
        f"rank {row.get('rank', i)}" for i, row in enumerate(theory)]
    sources = {"theory": list(theory)}
    if measured is not None:
        if len(measured) != len(theory):
            raise ValueError(f"{len(measured)} measured rows for {len(theory)} theory rows")
        sources["measured"] = list(measured)
    parts = [p for p in PARTS if any(row.get(p) for rows in sources.values() for row in rows)]
    x_outer = [n for n in names for _ in sources]
    x_inner = [s for _ in names for s in sources]
    fig = go.Figure()
    for part in parts:
        y = [sources[s][i].get(part, 0) / scale for i in range(len(names)) for s in sources]
        fig.add_trace(go.Bar(x=[x_outer, x_inner], y=y, name=LABELS[part],
                             marker={"color": COLOURS[part]},
                             hovertemplate="%{x}: %{y:.4g} " + unit + "<extra>" + LABELS[part]
                                           + "</extra>"))
    if capacity is not None:
        fig.add_hline(y=capacity / scale, line_dash="dash", line_color="black",
                      annotation_text=f"GPU memory {capacity / scale:.4g} {unit}")
    fig.update_layout(barmode="stack", title=title, yaxis_title=unit, uirevision="memory",
                      legend={"traceorder": "normal"})
    return fig
