"""The tensor-parallel MLP drawn shard by shard, with the f and g operators.

One row per rank. Each weight is drawn whole, as a grid of t slices, with the rank's own
slice coloured: fc (column parallel) is cut along its outputs, proj (row parallel) along
its inputs. Between them the activation is the rank's slice of 4h features; around them
f (identity forward, all-reduce backward) and g (all-reduce forward, identity backward).
"""

from __future__ import annotations

import plotly.graph_objects as go

PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6",
           "#9D755D"]
GREY = "#D9D9D9"


def tp_shard_figure(t: int = 2) -> go.Figure:
    """Column-parallel fc, GELU, row-parallel proj on ``t`` ranks, with f and g."""
    if not 1 <= t <= len(PALETTE):
        raise ValueError(f"t must be between 1 and {len(PALETTE)}")
    fig = go.Figure()
    shapes, notes = [], []
    row_h = 1.0

    def box(x0, x1, y0, y1, colour, text="", line="white"):
        shapes.append(dict(type="rect", x0=x0, x1=x1, y0=y0, y1=y1, fillcolor=colour,
                           line=dict(color=line, width=1)))
        if text:
            notes.append(dict(x=(x0 + x1) / 2, y=(y0 + y1) / 2, text=text, showarrow=False,
                              font=dict(size=10)))

    for r in range(t):
        y0 = (t - 1 - r) * (row_h + 0.4)
        y1 = y0 + row_h
        c = PALETTE[r]
        notes.append(dict(x=-0.3, y=(y0 + y1) / 2, text=f"rank {r}", showarrow=False,
                          xanchor="right"))
        box(0.0, 0.8, y0, y1, GREY, "x<br>[b,s,h]")
        box(0.95, 1.45, y0, y1, "white", "f", line="black")
        for k in range(t):  # fc weight [4h, h], cut along its rows (outputs)
            box(1.6, 2.6, y0 + k * row_h / t, y0 + (k + 1) * row_h / t,
                c if t - 1 - k == r else GREY)
        notes.append(dict(x=2.1, y=y1 + 0.08, text="fc: rows", showarrow=False,
                          font=dict(size=9)))
        box(2.75, 3.55, y0, y1, c, f"GELU<br>[b,s,4h/{t}]")
        for k in range(t):  # proj weight [h, 4h], cut along its columns (inputs)
            box(3.7 + k / t, 3.7 + (k + 1) / t, y0, y1, c if k == r else GREY)
        notes.append(dict(x=4.2, y=y1 + 0.08, text="proj: columns", showarrow=False,
                          font=dict(size=9)))
        box(4.85, 5.65, y0, y1, c, "partial y<br>[b,s,h]")
        box(5.8, 6.3, y0, y1, "white", "g", line="black")
        box(6.45, 7.25, y0, y1, GREY, "y + b<br>[b,s,h]")
    top = t * (row_h + 0.4)
    notes += [dict(x=1.2, y=top + 0.05, text="f: forward identity,<br>backward all-reduce",
                   showarrow=False, font=dict(size=10)),
              dict(x=6.05, y=top + 0.05, text="g: forward all-reduce,<br>backward identity",
                   showarrow=False, font=dict(size=10))]
    # an invisible trace so the axes span the drawing (and the JSON is deterministic)
    fig.add_trace(go.Scatter(x=[-0.9, 7.4], y=[-0.2, top + 0.5], mode="markers",
                             marker=dict(opacity=0), showlegend=False, hoverinfo="skip"))
    fig.update_layout(shapes=shapes, annotations=notes, width=760, height=130 + 95 * t,
                      xaxis=dict(visible=False), yaxis=dict(visible=False),
                      margin=dict(l=10, r=10, t=50, b=10), plot_bgcolor="white",
                      title=f"Tensor-parallel MLP on {t} ranks: coloured = this rank's shard")
    return fig
