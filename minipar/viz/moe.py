"""Mixture-of-experts figures: where a router sends tokens, and who sends what to whom.

``router_figure`` shows tokens as points coloured by the expert their router picked,
beside the load per expert (share of the tokens) against the balanced share 1/E.
``traffic_figure`` is the all-to-all's matrix of an expert-parallel run: the bytes each
rank sent to each rank, read off ``Comm``'s log (``summary()[dim]["all_to_all"]
["sent_to"]``, one row per rank). Pure functions returning ``go.Figure``.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

EXPERT_COLOURS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2",
                  "#EECA3B", "#9D755D", "#FF9DA6", "#BAB0AC"]


def router_figure(points: list[list[float]], experts: list[int], n_expert: int,
                  title: str = "") -> go.Figure:
    """Tokens (2-D ``points``) coloured by their ``experts``, and each expert's load
    (its share of the tokens) as bars, with the balanced share 1/E dashed."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45],
                        subplot_titles=["tokens, coloured by their expert",
                                        "load per expert (share of the tokens)"])
    loads = [experts.count(e) / max(1, len(experts)) for e in range(n_expert)]
    for e in range(n_expert):
        mine = [p for p, x in zip(points, experts) if x == e]
        colour = EXPERT_COLOURS[e % len(EXPERT_COLOURS)]
        fig.add_trace(go.Scatter(x=[round(p[0], 4) for p in mine],
                                 y=[round(p[1], 4) for p in mine], mode="markers",
                                 marker={"size": 5, "color": colour}, name=f"expert {e}",
                                 legendgroup=str(e)), row=1, col=1)
        fig.add_trace(go.Bar(x=[e], y=[round(loads[e], 4)], marker={"color": colour},
                             showlegend=False, legendgroup=str(e)), row=1, col=2)
    fig.add_hline(y=1 / n_expert, line_dash="dash", row=1, col=2)
    fig.update_xaxes(title_text="expert", dtick=1, row=1, col=2)
    fig.update_yaxes(range=[0, max(0.5, max(loads) * 1.1)], row=1, col=2)
    fig.update_layout(height=380, title=title, margin={"l": 20, "r": 20, "t": 70, "b": 40})
    return fig


def traffic_figure(sent: list[list[int]], title: str = "") -> go.Figure:
    """Heatmap of ``sent[i][j]``: bytes rank i sent to rank j by all-to-all (the
    diagonal stays on the rank: it never crosses a link)."""
    n = len(sent)
    labels = [f"rank {j}" for j in range(n)]
    fig = go.Figure(go.Heatmap(
        z=sent, x=labels, y=labels, colorscale="Blues", colorbar={"title": "bytes"},
        text=[[f"{v / 1e3:.0f} kB" for v in row] for row in sent],
        texttemplate="%{text}", hovertemplate="%{y} to %{x}: %{z:,} bytes<extra></extra>"))
    fig.update_yaxes(autorange="reversed", title_text="sent by")
    fig.update_xaxes(title_text="sent to", side="top")
    fig.update_layout(height=360, width=480, title=title,
                      margin={"l": 20, "r": 20, "t": 90, "b": 20})
    return fig
