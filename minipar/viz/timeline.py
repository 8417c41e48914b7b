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

from minipar.parallel.schedules import VIRTUAL_STAGES, make_schedule
from minipar.theory.bubble import UNIT_COST, bubble_fraction_formula, simulate

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
    v = virtual if schedule in VIRTUAL_STAGES else 1
    cost = {k: c / v for k, c in UNIT_COST.items()}
    return simulate(make_schedule(schedule, pp, microbatches, v), cost)


def bubble_curve_figure(pp: int = 4, max_microbatches: int = 32,
                        schedules: Sequence[str] = ("1f1b", "interleaved", "zb"),
                        virtual: int = 2) -> go.Figure:
    """Bubble fraction (idle share of the step) against the number of micro-batches,
    from the closed forms, one line per schedule."""
    fig = go.Figure()
    ms = list(range(1, max_microbatches + 1))
    for s in schedules:
        v = virtual if s in VIRTUAL_STAGES else 1
        fig.add_trace(go.Scatter(x=ms, y=[bubble_fraction_formula(s, pp, m, v) for m in ms],
                                 mode="lines+markers", name=s + (f" v={v}" if v > 1 else "")))
    fig.update_layout(xaxis_title="micro-batches m", yaxis_title="bubble fraction",
                      yaxis_tickformat=".0%", title=f"pipeline bubble, p={pp}",
                      uirevision="bubble")
    return fig


# --- lanes: any intervals, e.g. a Chrome trace written by ``minipar.trace`` -----------------
LANE_COLOURS = {**COLOURS, "send/recv": "#9D755D", "all-gather": "#72B7B2",
                "reduce-scatter": "#E45756", "all-reduce": "#B279A2", "broadcast": "#EECA3B",
                "optimizer": "#54A24B", "comm": "#BAB0AC",
                "forward": COLOURS["F"], "backward": COLOURS["B"]}
LANE_NAMES = {**NAMES, "send/recv": "send / recv (pp)", "all-gather": "all-gather",
              "reduce-scatter": "reduce-scatter", "all-reduce": "all-reduce",
              "broadcast": "broadcast", "optimizer": "optimizer step", "comm": "other comm",
              "forward": "forward", "backward": "backward"}


def event_kind(event: dict) -> str:
    """The colour class of a ``minipar.trace`` event: the action (F, B, W; a pipeline
    SEND_* / RECV_* is "send/recv") on the compute track, the collective on the comm
    track ("all_gather tp" -> "all-gather")."""
    kind = str(event.get("args", {}).get("kind", ""))
    if event.get("tid", 0) == 0 and kind:
        return "send/recv" if kind.startswith(("SEND", "RECV")) else kind
    op = str(event.get("name", "")).split(" ")[0].replace("_", "-")
    return "send/recv" if op in ("send", "recv") else op if op in LANE_COLOURS else "comm"


def chrome_trace_lanes(trace: dict) -> dict[str, list[tuple[float, float, str, str]]]:
    """Per track of a Chrome trace (``minipar.trace.chrome_trace``: a process per rank,
    threads compute and comm), ``(start_ms, end_ms, kind, name)`` of its complete
    ('X') events, times from the earliest event. Lanes are named "rank R compute" /
    "rank R comm" and ordered by rank, compute first."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    t0 = min((e["ts"] for e in events), default=0.0)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    lanes: dict[tuple, list] = {}
    for e in sorted(events, key=lambda e: (e["pid"], e["tid"], e["ts"])):
        start = (e["ts"] - t0) / 1e3
        lanes.setdefault((e["pid"], e["tid"]), []).append(
            (start, start + e["dur"] / 1e3, event_kind(e), e["name"]))
    return {f"rank {pid} {threads.get((pid, tid), f'thread {tid}')}": spans
            for (pid, tid), spans in sorted(lanes.items())}


def step_lanes(trace: dict, step: int | None = None) -> dict[str, list[tuple]]:
    """``chrome_trace_lanes`` of one training step (default: the last one traced): the
    compute events of that step, and the communication clipped to the step's window
    (from its first compute on any rank to its last), times in ms from the window's
    start. A send posted early and waited for late shows as a long span: it is in
    flight, not busy."""
    xs = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = [e["args"].get("step") for e in xs if e["tid"] == 0]
    step = max(s for s in steps if s is not None) if step is None else step
    comp = [e for e in xs if e["tid"] == 0 and e["args"].get("step") == step]
    t0 = min(e["ts"] for e in comp) / 1e3
    t1 = max(e["ts"] + e["dur"] for e in comp) / 1e3
    lanes = {}
    for lane, spans in chrome_trace_lanes(trace).items():
        base = min(e["ts"] for e in xs) / 1e3  # chrome_trace_lanes' zero
        kept = []
        for a, b, kind, name in spans:
            a, b = a + base, b + base
            if lane.endswith("compute") and not t0 <= a < t1:
                continue
            a, b = max(a, t0), min(b, t1)
            if b > a:
                kept.append((a - t0, b - t0, kind, name))
        lanes[lane] = kept
    return lanes


def lanes_figure(lanes: dict[str, Sequence[Sequence]], unit: str = "ms",
                 title: str | None = None, label_kinds: Sequence[str] = ("F", "B", "W"),
                 height: int | None = None) -> go.Figure:
    """Horizontal bars, one lane (row) per key of ``lanes``, top to bottom in the dict's
    order; each span is ``(start, end, kind[, name])``, one trace (legend entry and
    colour, ``LANE_COLOURS``) per kind. Spans of ``label_kinds`` show the digits of their
    name (the micro-batch of "F3") inside the bar."""
    kinds: dict[str, list] = {}
    for lane, spans in lanes.items():
        for span in spans:
            a, b, kind = span[0], span[1], span[2]
            name = span[3] if len(span) > 3 else kind
            kinds.setdefault(kind, []).append((lane, a, b, name))
    order = [k for k in LANE_COLOURS if k in kinds] + sorted(set(kinds) - set(LANE_COLOURS))
    fig = go.Figure()
    for kind in order:
        rows = kinds[kind]
        text = ["".join(c for c in n if c.isdigit()) if kind in label_kinds else ""
                for *_, n in rows]
        fig.add_trace(go.Bar(
            y=[r[0] for r in rows], x=[r[2] - r[1] for r in rows], base=[r[1] for r in rows],
            orientation="h", name=LANE_NAMES.get(kind, kind), text=text,
            textposition="inside", insidetextanchor="middle",
            marker={"color": LANE_COLOURS.get(kind, "#BAB0AC"), "line": {"width": 0}},
            customdata=[[r[3], r[2]] for r in rows],
            hovertemplate="%{y}: %{customdata[0]}, %{base:.3f} to %{customdata[1]:.3f} "
                          + unit + "<extra></extra>"))
    fig.update_yaxes(categoryorder="array", categoryarray=list(lanes)[::-1])
    fig.update_layout(barmode="overlay", bargap=0.25, title=title, xaxis_title=unit,
                      height=height or 120 + 45 * len(lanes), uirevision="lanes",
                      margin={"l": 110, "r": 20, "t": 50 if title else 20, "b": 40},
                      legend={"orientation": "h", "y": -0.2})
    return fig
