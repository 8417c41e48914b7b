"""Context parallelism drawn: the ring step by step, and the causal work per rank.

``ring_figure`` draws the causal attention matrix of one sequence cut into 2C chunks
(query chunk down, key chunk across). A slider walks the C ring steps: at step s each
rank computes the blocks ``minipar.parallel.cp.block_plan`` lists for it, against the
keys and values it holds then (those of rank (r - s) mod C). A block is *full* (every
key precedes every query), *diagonal* (the causal triangle of a chunk against itself,
step 0 only) or skipped (every key lies in the future; the upper triangle, never
computed). Blocks computed at earlier steps stay, faded. The figure carries its slider
in its layout, so it works in a saved notebook without a kernel.

``balance_figure`` sets the (query, key) pairs each rank computes under the zig-zag and
the contiguous split side by side (``minipar.theory.context``).
"""

from __future__ import annotations

import plotly.graph_objects as go

from minipar.parallel.cp import LAYOUTS, block_plan, chunk_ids
from minipar.theory.context import causal_pairs_per_rank

PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6",
           "#9D755D"]
GREY = "#D9D9D9"


def ring_blocks(cp: int, layout: str = "zigzag") -> list[list[dict]]:
    """Per ring step, every block computed: ``{rank, q, k, kind, holds}`` in global chunks.

    ``q`` and ``k`` are chunk numbers of the 2C-chunk cut; ``holds`` is the rank whose
    keys and values the computing rank holds at that step.
    """
    steps: list[list[dict]] = [[] for _ in range(cp)]
    for r in range(cp):
        mine = chunk_ids(r, cp, layout)
        for s, blocks in enumerate(block_plan(r, cp, layout)):
            owner = (r - s) % cp
            theirs = chunk_ids(owner, cp, layout)
            for qi, kj, kind in blocks:
                steps[s].append({"rank": r, "q": mine[qi], "k": theirs[kj], "kind": kind,
                                 "holds": owner})
    return steps


def _cells(blocks: list[dict], opacity: float, name: str, cp: int,
           visible: bool) -> list[go.Scatter]:
    traces = []
    for kind, symbol in (("full", "square"), ("causal", "triangle-sw")):
        chosen = [b for b in blocks if b["kind"] == kind]
        traces.append(go.Scatter(
            x=[b["k"] for b in chosen], y=[b["q"] for b in chosen], mode="markers+text",
            marker=dict(symbol=symbol, size=max(12, 140 // cp), opacity=opacity,
                        color=[PALETTE[b["rank"] % len(PALETTE)] for b in chosen],
                        line=dict(width=0)),
            text=[f"r{b['rank']}" for b in chosen], textfont=dict(size=10),
            hovertext=[f"rank {b['rank']}: queries of chunk {b['q']} x keys of chunk "
                       f"{b['k']} ({'diagonal' if kind == 'causal' else 'full'}), "
                       f"k/v from rank {b['holds']}" for b in chosen],
            hoverinfo="text", name=f"{name} {('diagonal' if kind == 'causal' else 'full')}",
            showlegend=False, visible=visible))
    return traces


def ring_figure(cp: int = 4, layout: str = "zigzag") -> go.Figure:
    """The causal chunk matrix, with a slider over the ``cp`` ring steps."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")
    if not 1 <= cp <= len(PALETTE):
        raise ValueError(f"cp must be between 1 and {len(PALETTE)}")
    n = 2 * cp
    steps = ring_blocks(cp, layout)
    skipped = [(q, k) for q in range(n) for k in range(n) if k > q]
    fig = go.Figure()
    fig.add_trace(go.Scatter(  # the future: never computed
        x=[k for _, k in skipped], y=[q for q, _ in skipped], mode="markers",
        marker=dict(symbol="square", size=max(12, 140 // cp), color=GREY),
        hovertext=["skipped: every key is in the future" for _ in skipped],
        hoverinfo="text", name="skipped", showlegend=False))
    per_step = 4  # traces per slider position: earlier (full, diag), now (full, diag)
    for s in range(cp):
        earlier = [b for t in steps[:s] for b in t]
        fig.add_traces(_cells(earlier, 0.3, "earlier", cp, s == 0)
                       + _cells(steps[s], 1.0, "now", cp, s == 0))

    def title(s: int) -> str:
        pairs = ", ".join(f"r{r} ← r{(r - s) % cp}" for r in range(cp))
        return (f"{layout} split, cp={cp}: ring step {s} of {cp - 1}"
                f"<br><sup>keys and values held: {pairs}</sup>")

    positions = []
    for s in range(cp):
        visible = [True] + [i // per_step == s for i in range(per_step * cp)]
        positions.append(dict(method="update", label=str(s),
                              args=[{"visible": visible}, {"title.text": title(s)}]))
    owner = {c: r for r in range(cp) for c in chunk_ids(r, cp, layout)}
    labels = [f"{c} (r{owner[c]})" for c in range(n)]
    fig.update_layout(
        title=title(0), height=540, width=620, plot_bgcolor="white",
        xaxis=dict(title="key chunk (its owner)", tickvals=list(range(n)), ticktext=labels,
                   range=[-0.6, n - 0.4], showgrid=False, zeroline=False),
        yaxis=dict(title="query chunk (its owner)", tickvals=list(range(n)),
                   ticktext=labels, range=[n - 0.4, -0.6], showgrid=False, zeroline=False,
                   scaleanchor="x"),
        sliders=[dict(active=0, currentvalue=dict(prefix="ring step "), pad=dict(t=40),
                      steps=positions)],
        margin=dict(l=90, r=20, t=60, b=40))
    return fig


def balance_figure(seq_len: int = 4096, cp: int = 4) -> go.Figure:
    """Causal (query, key) pairs per rank, zig-zag beside contiguous."""
    fig = go.Figure()
    for layout, colour in (("contiguous", "#E45756"), ("zigzag", "#4C78A8")):
        pairs = causal_pairs_per_rank(seq_len, cp, layout)
        fig.add_trace(go.Bar(x=[f"rank {r}" for r in range(cp)], y=pairs, name=layout,
                             marker_color=colour))
    fig.update_layout(barmode="group", height=360, plot_bgcolor="white",
                      title=f"causal attention work per rank, s={seq_len}, cp={cp}",
                      yaxis_title="(query, key) pairs computed")
    return fig
