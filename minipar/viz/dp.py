"""Data parallelism and ZeRO, drawn: the bytes a rank sends per step, gradient buckets
overlapping the backward, the model states per ZeRO stage, and ZeRO-3's prefetch.

Each picture comes from a small model (the ring formula of ``minipar.comm``; the
alpha-beta cost of lesson 00; ``minipar.theory.memory.model_states``) that a lesson
asserts on beside the figure; the engine's own measurements stay in the lessons.
"""

from __future__ import annotations

import plotly.graph_objects as go

from minipar.comm import wire_bytes
from minipar.theory.memory import model_states
from minipar.viz.timeline import lanes_figure

DP_RANKS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def dp_traffic_figure(billions: float = 1.3, grad_bytes: int = 2) -> go.Figure:
    """Bytes each rank sends per step to all-reduce the gradients of a model, against the
    data-parallel rank count (``DP_RANKS``), with the 2 S limit dotted."""
    size = billions * 1e9 * grad_bytes
    ns = list(DP_RANKS)
    ys = [wire_bytes("all_reduce", int(size), n) / 1e9 for n in ns]
    fig = go.Figure(go.Scatter(x=ns, y=ys, mode="lines+markers", name="ring all-reduce"))
    fig.add_hline(y=2 * size / 1e9, line_dash="dot", annotation_text="2 S (the limit)")
    fig.update_layout(xaxis=dict(type="log", title="data-parallel ranks N"),
                      yaxis_title="GB sent per rank per step", width=640, height=340,
                      title=f"{billions:g}B parameters, {grad_bytes}-byte gradients")
    return fig


def overlap_timeline(params_m: float = 1300.0, bucket_mb: float = 25.0, n_ranks: int = 8,
                     backward_s: float = 0.6, latency_us: float = 5.0,
                     bandwidth_gbs: float = 25.0) -> dict:
    """Backward and bucket all-reduces in time (bf16 gradients, ring all-reduce): the
    backward takes time in proportion to the parameters it has processed, and a bucket's
    all-reduce starts when its gradients are ready and the previous bucket has gone (one
    link). Returns the bucket count, the spans, and the step's end overlapped and not."""
    total = params_m * 1e6 * 2
    n_buckets = max(1, round(total / (bucket_mb * 1e6)))
    size = total / n_buckets
    comm_s = 2 * (n_ranks - 1) * latency_us * 1e-6 \
        + wire_bytes("all_reduce", int(size), n_ranks) / (bandwidth_gbs * 1e9)
    ready = [backward_s * (i + 1) / n_buckets for i in range(n_buckets)]
    spans, link_free = [], 0.0
    for r in ready:
        start = max(r, link_free)
        spans.append((start, start + comm_s))
        link_free = start + comm_s
    return {"buckets": n_buckets, "spans": spans, "backward": backward_s,
            "overlapped": max(backward_s, link_free),
            "after": backward_s + n_buckets * comm_s}


def overlap_figure(bucket_mb: float = 25.0, **kw) -> go.Figure:
    """``overlap_timeline`` as two lanes, backward and all-reduce (at most 400 buckets
    drawn)."""
    t = overlap_timeline(bucket_mb=bucket_mb, **kw)
    shown = t["spans"] if len(t["spans"]) <= 400 else t["spans"][:: len(t["spans"]) // 400]
    lanes = {"backward": [(0.0, t["backward"], "backward")],
             "all-reduce": [(s, e, "all-reduce", "a bucket") for s, e in shown]}
    return lanes_figure(lanes, unit="seconds", height=260,
                        title=f"{t['buckets']} buckets of {bucket_mb:g} MB: step ends at "
                              f"{t['overlapped']:.2f} s overlapped, "
                              f"{t['after']:.2f} s if sent after backward")


def zero_states_figure(billions: float = 7.5, n: int = 64) -> go.Figure:
    """Model states per rank (GB) for ZeRO stages 0-3, bf16 + Adam, stacked by part
    (params, grads, optimizer: traces 0, 1, 2)."""
    fig = go.Figure()
    rows = [model_states(int(billions * 1e9), n, s, "bf16") for s in range(4)]
    for part in ("params", "grads", "optimizer"):
        fig.add_trace(go.Bar(x=[f"ZeRO-{s}" for s in range(4)],
                             y=[r[part] / 1e9 for r in rows], name=part))
    fig.update_layout(barmode="stack", yaxis_title="GB per rank", width=560, height=340,
                      title=f"{billions:g}B parameters, bf16 + Adam, {n} data-parallel ranks")
    return fig


def zero3_prefetch(blocks: int = 4, gather: float = 0.6, compute: float = 1.0) -> dict:
    """Forward of a ZeRO-3 model, block by block: each block's weights are all-gathered,
    then it computes. Without prefetch the two alternate; with prefetch the gather of
    block i + 1 starts when block i starts computing (one link: gathers stay in order).
    Per mode: (gather spans, compute spans, end of the forward)."""
    rows = {}
    for mode in ("no prefetch", "prefetch"):
        link, clock, g_spans, c_spans = 0.0, 0.0, [], []
        for i in range(blocks):
            start = link if mode == "prefetch" else clock
            g_spans.append((start, start + gather))
            link = start + gather
            begin = max(clock, link)
            c_spans.append((begin, begin + compute))
            clock = begin + compute
            if mode == "prefetch" and i + 1 < blocks:
                link = max(link, begin)  # next gather starts once block i starts computing
        rows[mode] = (g_spans, c_spans, clock)
    return rows


def zero3_prefetch_figure(blocks: int = 4, gather: float = 0.6,
                          compute: float = 1.0) -> go.Figure:
    """``zero3_prefetch`` as lanes: for each mode, the link's gathers and the compute."""
    rows = zero3_prefetch(blocks, gather, compute)
    ends = {mode: r[2] for mode, r in rows.items()}
    lanes = {f"{mode}: {lane}": [(a, b, kind, f"block {i}") for i, (a, b) in enumerate(r[k])]
             for mode, r in rows.items()
             for k, lane, kind in ((0, "link", "all-gather"), (1, "compute", "forward"))}
    return lanes_figure(lanes, unit="time", label_kinds=("all-gather", "forward"), height=300,
                        title=f"ZeRO-3 forward of {blocks} blocks: step ends at "
                              f"{ends['no prefetch']:.1f} without prefetch, "
                              f"{ends['prefetch']:.1f} with it")


def training_curve_figure(losses, evals, target: float | None = None,
                          title: str = "") -> go.Figure:
    """A whole run: the training loss per step (a line), the validation loss where it was
    measured (``evals``: ``{step, loss}`` dicts, markers), and a ``target`` (dashed)."""
    fig = go.Figure([go.Scatter(y=list(losses), name="training loss", mode="lines"),
                     go.Scatter(x=[e["step"] for e in evals], y=[e["loss"] for e in evals],
                                name="validation loss", mode="markers+lines",
                                marker=dict(size=8))])
    if target is not None:
        fig.add_hline(y=target, line_dash="dash", annotation_text="target")
    fig.update_layout(xaxis_title="step", yaxis_title="loss (nats per byte)", width=620,
                      height=340, title=title)
    return fig


def loss_curves_figure(reference, run, run_name: str, title: str) -> go.Figure:
    """One process's losses (a line) and a parallel run's (crosses) per step: on top of
    each other when the run is at parity."""
    fig = go.Figure([go.Scatter(y=list(reference), name="one process, whole batch",
                                mode="lines"),
                     go.Scatter(y=list(run), name=run_name, mode="markers",
                                marker=dict(size=9, symbol="x"))])
    fig.update_layout(xaxis_title="step", yaxis_title="loss", width=620, height=340,
                      title=title)
    return fig
