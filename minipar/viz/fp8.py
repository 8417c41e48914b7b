"""Float8 training as measured: the matmul alone, then whole training steps against bf16.

Left: one large matmul's rate (TFLOP/s) in bf16 and in float8, per scaling recipe. Right:
each run's training speed in float8 as a multiple of the same run in bf16 (tokens/s), one
bar per recipe; a run that did not complete shows no bar and its note (out of memory). The
dashed line at 1 is bf16. The numbers come from a benchmark's JSON
(``benchmarks/fp8_gpu.py``); this module only draws them.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

COLOURS = {"bf16": "#BAB0AC", "rowwise": "#4C78A8", "tensorwise": "#F58518"}


def fp8_speed_figure(kernel: dict[str, float], runs: Sequence[dict],
                     title: str = "float8 against bf16") -> go.Figure:
    """``kernel``: TFLOP/s by format ("bf16", "rowwise", "tensorwise"). ``runs``: dicts with
    ``run`` (the x label), ``recipe``, ``speedup`` (float8 tokens/s over bf16's, or None
    when the run did not complete) and ``note`` (shown where the bar is missing)."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.3, 0.7], horizontal_spacing=0.1,
                        subplot_titles=["one matmul: TFLOP/s", "training step: speed ÷ bf16's"])
    fig.add_trace(go.Bar(x=list(kernel), y=list(kernel.values()), showlegend=False,
                         text=[f"{v:,.0f}" for v in kernel.values()], textposition="outside",
                         marker={"color": [COLOURS.get(k, "#79706E") for k in kernel]}),
                  row=1, col=1)
    labels = list(dict.fromkeys(r["run"] for r in runs))
    for recipe in dict.fromkeys(r["recipe"] for r in runs):
        mine = {r["run"]: r for r in runs if r["recipe"] == recipe}
        y = [mine[x]["speedup"] if x in mine else None for x in labels]
        fig.add_trace(go.Bar(x=labels, y=y, name=recipe, marker={"color": COLOURS[recipe]},
                             text=[f"{v:.2f}x" if v is not None else "" for v in y],
                             textposition="outside"), row=1, col=2)
    for r in runs:
        if r["speedup"] is None:
            fig.add_annotation(x=r["run"], y=0.05, text=r.get("note", "no result"),
                               textangle=-90, showarrow=False, xanchor="center",
                               yanchor="bottom", row=1, col=2)
    fig.add_hline(y=1.0, line_dash="dash", annotation_text="bf16", row=1, col=2)
    top = max([r["speedup"] or 0 for r in runs] + [1.0])
    fig.update_yaxes(range=[0, 1.2 * top], row=1, col=2)
    fig.update_yaxes(range=[0, 1.2 * max(kernel.values())], row=1, col=1)
    fig.update_layout(barmode="group", title=title, height=420, uirevision="fp8",
                      margin={"l": 40, "r": 20, "t": 70, "b": 40})
    return fig


__all__ = ["fp8_speed_figure"]
