"""The planner's ranking as a picture: where each layout's step time goes, and its memory.

Left: for the ``top`` layouts (fastest at the top), the estimated step time split into
compute, bubble and the exposed communication of each dimension. Right: the memory per
GPU of the same layouts against the GPU's capacity. Both come straight from the
``Estimate`` objects of ``minipar.theory.planner.plan``.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minipar.theory.planner import Plan

COLOURS = {"compute": "#4C78A8", "bubble": "#BAB0AC", "tp": "#F58518", "ep": "#FF9DA6",
           "cp": "#B279A2",
           "pp": "#54A24B", "dp": "#E45756", "offload": "#9D755D", "update": "#EECA3B",
           "host": "#79706E"}
MEMORY = {"params": "#9ECAE9", "grads": "#72B7B2", "optimizer": "#FFBF79",
          "activations": "#FF9D98", "card": "#BAB0AC"}


def plan_figure(result: Plan, top: int = 12) -> go.Figure:
    """Stacked step-time bars and memory bars of the ``top`` layouts of a plan."""
    lays = result.layouts[:top]
    labels = [f"{i}. {lay.layout.label()}" for i, lay in enumerate(lays, 1)]
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, column_widths=[0.62, 0.38],
                        horizontal_spacing=0.02,
                        subplot_titles=["estimated step time (s)", "memory per GPU (GB)"])
    for k in result.time_keys:
        fig.add_trace(go.Bar(y=labels, x=[lay.time[k] for lay in lays], orientation="h",
                             name=k, marker={"color": COLOURS[k]}, legendgroup="time"),
                      row=1, col=1)
    for k, colour in MEMORY.items():  # the rest of the card: what the live peak adds
        # beyond these (the loss workspace or the optimizer's temporary), the reserve, the
        # runtime; the bars add up to ``memory["process"]``
        x = [(lay.memory["process"] - sum(lay.memory[j] for j in MEMORY if j != "card")
              if k == "card" else lay.memory[k]) / 1e9 for lay in lays]
        fig.add_trace(go.Bar(y=labels, x=x, orientation="h", name=k,
                             marker={"color": colour}, legendgroup="memory"), row=1, col=2)
    fig.add_vline(x=result.cluster.gpu_memory / 1e9, line_dash="dash", row=1, col=2)
    fig.update_yaxes(categoryorder="array", categoryarray=labels[::-1], row=1, col=1)
    fig.update_layout(barmode="stack", height=180 + 32 * len(lays), uirevision="plan",
                      title=f"{len(result)} layouts fit on {result.cluster.name}; top {len(lays)}",
                      margin={"l": 20, "r": 20, "t": 70, "b": 40})
    return fig
