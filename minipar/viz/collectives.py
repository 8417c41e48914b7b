"""What each collective leaves where, drawn as tables of contributor bits.

Rank r holds a tensor whose entries are all 2**r, so any sum of them is a set of bits
that names the ranks that contributed (11 = 8 + 2 + 1: ranks 0, 1 and 3). A collective's
*state* is an N x N table, one row per rank and one column per chunk, each cell those
bits (0: the rank does not hold that chunk). ``contributor_states`` gives the states
before and after each collective from its definition; ``ring_states`` the states after
every step of the ring all-reduce (Patarasuk & Yuan 2009), which ``ring_allreduce_figure``
draws with a plotly slider (it works in a saved notebook: no widget).
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


def contributor_states(op: str, n: int) -> tuple[list[list[int]], list[list[int]]]:
    """(before, after) tables of contributor bits of ``op`` on ``n`` ranks, from its
    definition (broadcast from rank 0)."""
    everyone = 2 ** n - 1
    diagonal = [[2 ** r if c == r else 0 for c in range(n)] for r in range(n)]
    full_rows = [[2 ** r] * n for r in range(n)]
    if op == "all_reduce":
        return full_rows, [[everyone] * n for _ in range(n)]
    if op == "reduce_scatter":
        return full_rows, [[everyone if c == r else 0 for c in range(n)] for r in range(n)]
    if op == "all_gather":
        return diagonal, [[2 ** c for c in range(n)] for _ in range(n)]
    if op == "broadcast":
        return full_rows, [[1] * n for _ in range(n)]
    raise ValueError(f"no contributor table for {op!r}; one of {OPS}")


def contributors(bits: int) -> str:
    """The ranks in ``bits``, as "0+1+3"."""
    return "+".join(str(r) for r in range(bits.bit_length()) if bits >> r & 1)


def _heatmap(table: list[list[int]], n: int) -> go.Heatmap:
    return go.Heatmap(
        z=[[bin(b).count("1") if b else None for b in row] for row in table],
        text=[[contributors(b) for b in row] for row in table],
        texttemplate="%{text}", zmin=0, zmax=n, colorscale="Blues", showscale=False,
        hovertemplate="rank %{y}, chunk %{x}: %{text}<extra></extra>",
        x=[f"chunk {c}" for c in range(n)], y=[f"rank {r}" for r in range(n)])


def collectives_figure(n: int) -> go.Figure:
    """Before (left) and after (right) of each collective of ``OPS`` on ``n`` ranks."""
    fig = make_subplots(rows=len(OPS), cols=2, horizontal_spacing=0.08, vertical_spacing=0.07,
                        subplot_titles=[f"{op} · {side}" for op in OPS
                                        for side in ("before", "after")])
    for i, op in enumerate(OPS):
        for j, table in enumerate(contributor_states(op, n)):
            fig.add_trace(_heatmap(table, n), row=i + 1, col=j + 1)
            fig.update_yaxes(autorange="reversed", row=i + 1, col=j + 1)
    fig.update_layout(height=190 * len(OPS), width=720, margin=dict(t=40, l=10, r=10, b=10),
                      title="Which ranks' data each chunk holds (cell text: contributing ranks)")
    return fig


def ring_states(n: int) -> list[list[list[int]]]:
    """Contributor tables of the ring all-reduce on ``n`` ranks: at the start and after
    each of its 2 (n - 1) steps (reduce-scatter, then all-gather)."""
    state = [[2 ** r] * n for r in range(n)]
    history = [[row[:] for row in state]]
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            new = [row[:] for row in state]
            for r in range(n):
                left = (r - 1) % n
                # the chunk the left neighbour sends at this step
                c = (left - step) % n if phase == "reduce-scatter" else (left + 1 - step) % n
                new[r][c] = (state[r][c] | state[left][c] if phase == "reduce-scatter"
                             else state[left][c])
            state = new
            history.append([row[:] for row in state])
    return history


def ring_allreduce_figure(n: int) -> go.Figure:
    """The ring all-reduce on ``n`` ranks, one table per step under a slider."""
    history = ring_states(n)
    fig = go.Figure(_heatmap(history[0], n))
    labels = (["start"] + [f"reduce-scatter {s + 1}" for s in range(n - 1)]
              + [f"all-gather {s + 1}" for s in range(n - 1)])
    steps = []
    for label, table in zip(labels, history):
        frame = _heatmap(table, n)
        steps.append(dict(method="restyle", label=label,
                          args=[{"z": [frame.z], "text": [frame.text]}]))
    fig.update_layout(sliders=[dict(steps=steps, active=0, currentvalue=dict(prefix="after: "))],
                      yaxis=dict(autorange="reversed"), width=620, height=420,
                      title=f"Ring all-reduce on {n} ranks (cell text: contributing ranks)")
    return fig


def allreduce_seconds(algo: str, n: int, size: float, latency: float,
                      bandwidth: float) -> float:
    """Time of one all-reduce in the alpha-beta model: messages * latency + bytes / bandwidth.

    Ring: 2 (n-1) messages of size/n each; every link busy in parallel.
    Via rank 0: rank 0 receives n-1 tensors, then sends n-1 (one link, in sequence).
    """
    if n == 1:
        return 0.0
    if algo == "ring":
        return 2 * (n - 1) * latency + 2 * (n - 1) / n * size / bandwidth
    if algo == "via rank 0":
        return 2 * (n - 1) * latency + 2 * (n - 1) * size / bandwidth
    raise ValueError(algo)


COST_RANKS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def allreduce_cost_figure(size_mb: float = 1000.0, latency_us: float = 10.0,
                          bandwidth_gbs: float = 50.0) -> go.Figure:
    """Seconds per all-reduce against the rank count (``COST_RANKS``, log-log): the
    via-rank-0 design (trace 0) and the ring (trace 1), by ``allreduce_seconds``."""
    fig = go.Figure()
    ns = list(COST_RANKS)
    for algo in ("via rank 0", "ring"):
        ys = [allreduce_seconds(algo, n, size_mb * 1e6, latency_us * 1e-6,
                                bandwidth_gbs * 1e9) for n in ns]
        fig.add_trace(go.Scatter(x=ns, y=ys, mode="lines+markers", name=algo))
    fig.update_layout(xaxis=dict(type="log", title="ranks N"),
                      yaxis=dict(type="log", title="seconds per all-reduce"),
                      title=f"All-reduce of {size_mb:g} MB, {latency_us:g} µs per message, "
                            f"{bandwidth_gbs:g} GB/s links", width=720, height=380)
    return fig
