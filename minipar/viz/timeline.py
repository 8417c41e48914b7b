"""Pipeline timelines: one row per rank, a bar per forward / backward / weight pass.

Input is per rank a list of records with ``start`` and ``end`` and the action: dicts
``{action, microbatch, chunk, start, end}`` (or ``kind`` / ``mb``, as the simulator's
``Span`` and the executor's ``ActionRecord`` name them; namedtuples work too). Only
compute actions (F, B, W) are drawn; the time a rank spends idle between the start
of the step and the end of its last action is shaded: that is the bubble. Times are
shifted so each timeline starts at 0.

``timeline_figure`` stacks several timelines (theory above, measurement below) on one
figure; ``schedule_timeline`` gives the theoretical one of a schedule from
``minipar.theory.bubble.simulate``.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

COLOURS = {"F": "#4C78A8", "B": "#F58518", "W": "#54A24B", "idle": "#D9D9D9"}
NAMES = {"F": "forward", "B": "backward", "W": "weight gradient", "idle": "idle (bubble)"}
_ALIASES = {"forward": "F", "backward": "B", "weight": "W"}


def _get(rec, *names, default=None):
    for n in names:
        if isinstance(rec, dict) and n in rec:
            return rec[n]
        if hasattr(rec, n):
            return getattr(rec, n)
    return default


def normalise(timeline: Sequence[Sequence]) -> list[list[dict]]:
    """Per rank, the compute records as ``{action, microbatch, chunk, start, end}``
    dicts, times relative to the earliest start; other actions dropped."""
    rows = [[{"action": _ALIASES.get(a, a), "microbatch": _get(r, "microbatch", "mb"),
              "chunk": _get(r, "chunk", default=0), "start": _get(r, "start"),
              "end": _get(r, "end")}
             for r in recs for a in [str(_get(r, "action", "kind"))]]
            for recs in timeline]
    rows = [[r for r in recs if r["action"] in ("F", "B", "W")] for recs in rows]
    t0 = min((r["start"] for recs in rows for r in recs), default=0.0)
    return [[{**r, "start": r["start"] - t0, "end": r["end"] - t0} for r in recs]
            for recs in rows]


def idle_spans(records: Sequence[dict], step: float) -> list[tuple[float, float]]:
    """Gaps in [0, step] not covered by any record of one rank."""
    gaps, t = [], 0.0
    for r in sorted(records, key=lambda r: r["start"]):
        if r["start"] > t:
            gaps.append((t, r["start"]))
        t = max(t, r["end"])
    if step > t:
        gaps.append((t, step))
    return gaps


def timeline_traces(timeline: Sequence[Sequence], virtual: int = 1, row: int = 1,
                    legend: bool | set = True) -> list[go.Bar]:
    """Horizontal bars, one trace per action kind plus one for the idle time.

    ``legend``: True (every kind drawn gets a legend entry), False, or the set of kinds
    already in the legend (updated: a stacked figure lists each kind once, W included
    even when only a lower timeline has W blocks)."""
    rows = normalise(timeline)
    step = max((r["end"] for recs in rows for r in recs), default=0.0)
    traces = []
    for kind in ("F", "B", "W", "idle"):
        y, base, width, text = [], [], [], []
        for rank, recs in enumerate(rows):
            if kind == "idle":
                spans = [(a, b, "") for a, b in idle_spans(recs, step)]
            else:
                spans = [(r["start"], r["end"], str(r["microbatch"]) + (
                    f"c{r['chunk']}" if virtual > 1 else "")) for r in recs
                    if r["action"] == kind]
            for a, b, label in spans:
                y.append(f"rank {rank}")
                base.append(a)
                width.append(b - a)
                text.append(label)
        if not y and kind == "W":
            continue
        show = legend if isinstance(legend, bool) else kind not in legend
        if isinstance(legend, set):
            legend.add(kind)
        traces.append(go.Bar(
            y=y, x=width, base=base, orientation="h", text=text, textposition="inside",
            insidetextanchor="middle", name=NAMES[kind], legendgroup=kind,
            showlegend=show, marker={"color": COLOURS[kind],
                                       "line": {"color": "white", "width": 1}},
            hovertemplate="%{y}: %{base:.3g} to %{customdata:.3g}<extra>" + NAMES[kind]
                          + " %{text}</extra>",
            customdata=[a + w for a, w in zip(base, width)],
            xaxis=f"x{row}" if row > 1 else "x", yaxis=f"y{row}" if row > 1 else "y"))
    return traces


def timeline_figure(timelines: Sequence | dict, virtual: int = 1,
                    unit: str = "time", shared: bool = True) -> go.Figure:
    """A timeline (per rank, a list of records), or several stacked one above the other
    given as a dict ``{title: timeline}`` (e.g. ``{"theory": t1, "measured": t2}``).

    Stacked timelines share one time axis (``shared=True``), so equal lengths mean equal
    times: give them all in one unit (``schedule_timeline`` measures every schedule in
    forwards of a whole stage). Pass ``shared=False`` for timelines in different units
    (theory in unit times above a measurement in seconds)."""
    named = dict(timelines) if isinstance(timelines, dict) else {"": timelines}
    fig = make_subplots(rows=len(named), cols=1, subplot_titles=list(named),
                        vertical_spacing=0.12, shared_xaxes=shared)
    shown: set = set()
    for i, tl in enumerate(named.values(), 1):
        for trace in timeline_traces(tl, virtual, i, legend=shown):
            fig.add_trace(trace, row=i, col=1)
        ranks = [f"rank {r}" for r in range(len(tl))]
        fig.update_yaxes(categoryorder="array", categoryarray=ranks[::-1], row=i, col=1)
        fig.update_xaxes(title_text=unit, row=i, col=1)
    fig.update_layout(barmode="overlay", height=140 + 40 * sum(len(t) for t in named.values()),
                      margin={"l": 60, "r": 20, "t": 50, "b": 40}, uirevision="timeline",
                      legend={"orientation": "h", "y": -0.15})
    return fig


def schedule_timeline(schedule: str, pp: int, microbatches: int,
                      virtual: int = 1) -> list[list]:
    """The theoretical timeline of a schedule in one unit for every schedule: the
    forward of a whole stage takes 1, its backward 2 (split: B 1 + W 1). A chunk of an
    interleaved schedule is 1/v of a stage, so its actions take 1/v of those times:
    interleaving shortens the step instead of seeming to stretch it."""
    from minipar.parallel.schedules import make_schedule
    from minipar.theory.bubble import UNIT_COST, simulate

    v = virtual if schedule == "interleaved" else 1
    cost = {k: c / v for k, c in UNIT_COST.items()}
    return simulate(make_schedule(schedule, pp, microbatches, v), cost)


def bubble_curve_figure(pp: int = 4, max_microbatches: int = 32,
                        schedules: Sequence[str] = ("1f1b", "interleaved", "zb"),
                        virtual: int = 2) -> go.Figure:
    """Bubble fraction (idle share of the step) against the number of micro-batches,
    from the closed forms, one line per schedule."""
    from minipar.theory.bubble import bubble_fraction_formula

    fig = go.Figure()
    ms = list(range(1, max_microbatches + 1))
    for s in schedules:
        v = virtual if s == "interleaved" else 1
        fig.add_trace(go.Scatter(x=ms, y=[bubble_fraction_formula(s, pp, m, v) for m in ms],
                                 mode="lines+markers", name=s + (f" v={v}" if v > 1 else "")))
    fig.update_layout(xaxis_title="micro-batches m", yaxis_title="bubble fraction",
                      yaxis_tickformat=".0%", title=f"pipeline bubble, p={pp}",
                      uirevision="bubble")
    return fig
