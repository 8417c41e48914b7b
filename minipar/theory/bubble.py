"""The pipeline bubble: closed forms, and the timeline a schedule implies.

A pipeline step is over when the last rank finishes; until then a rank that waits for
its neighbour idles. That idle time is the *bubble*. Two ways to quote it:

* ``bubble_fraction``: idle share of the step, idle / (p * step time).
  For GPipe and 1F1B with t_B = 2 t_F: (p-1)/(m+p-1) (Huang et al., arXiv 1811.06965).
* ``bubble_ratio``: idle over useful work, the form Megatron-LM quotes:
  (p-1)/m for 1F1B, (p-1)/(v m) for interleaved 1F1B with v chunks per rank
  (Narayanan et al., arXiv 2104.04473, section 2.2), and (p-1)/(3m) for ZB-H1 with
  t_F = t_B = t_W (Qi et al., arXiv 2401.10241, section 3: (p-1)(t_F + t_B - t_W)),
  (p-1)/(3vm) for interleaved zero bubble (the same on chunks v times smaller).

The closed forms assume a clean pipeline; ``simulate`` makes no assumption: it runs the
schedule's own action lists (``minipar.parallel.schedules``) on unit times (forward 1,
backward 2, or input-gradient 1 + weight-gradient 1 when the backward is split), each
action starting when its rank is free and its inputs have arrived. The lessons plot
that timeline beside the one the executor measures; the tests check both against the
closed forms. Everything here is a pure function.

Unit times assume equal stages; a real split is not: the last chunk also runs the final
norm, head and loss (for gpt-1.3b about 1.8 layers' FLOPs), so every other rank waits
for it. ``chunk_weights`` gives each chunk's share of the FLOPs from the model config and
``simulate(..., chunk_weight=...)`` scales every action by its chunk's weight. The closed
forms, like Narayanan et al. (arXiv 2104.04473, section 2.2), assume balanced stages; the
planner prices a step with ``pipeline_seconds``: the schedule simulated on each chunk's
seconds (``theory.rates.chunk_seconds``). FLOPs still miss what is memory-bound (the
loss's softmax), that B outlasts W, and the sends; ``measured_cost_bubble`` replays a
schedule at the times its actions took on a real run: the bubble the schedule itself
implies for those costs, against which the measured one shows only the waiting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import NamedTuple

from minipar.model import GPTConfig
from minipar.parallel.schedules import (  # UNIT_COST, action_cost: re-exported
    COMPUTE,
    UNIT_COST,
    Action,
    Schedule,
    action_cost,
    data_deps,
    make_schedule,
    partner,
    rank_of,
    schedule_shape,
)
from minipar.theory.models import get_model
from minipar.theory.params import (
    head_flops_per_token,
    layer_flops_per_token,
    partition_layers,
)


class Span(NamedTuple):
    """One compute action on one rank, from ``start`` to ``end`` (any time unit)."""

    rank: int
    kind: str
    mb: int
    chunk: int
    start: float
    end: float


def split_backwards(actions: Schedule) -> set[tuple[int, int]]:
    """(mb, chunk) pairs whose weight gradient is a separate W action."""
    return {(a.mb, a.chunk) for acts in actions for a in acts if a.kind == "W"}


def simulate(actions: Schedule, cost: Mapping[str, float] = UNIT_COST,
             p2p: float = 0.0, chunk_weight: Sequence[float] | None = None,
             durations: Mapping[tuple[str, int, int], float] | None = None
             ) -> list[list[Span]]:
    """The timeline of ``actions``: per rank, the spans of its compute actions.

    Ranks run their lists in order. A compute starts when the rank is free and its
    inputs exist: a local result, or a message, which arrives ``p2p`` after the
    sender reaches its ``SEND`` (sends never hold the sender up; receives cost nothing
    by themselves). ``chunk_weight`` (one multiplier per global chunk, e.g.
    ``chunk_weights``) scales every action of a chunk; None keeps all chunks equal.
    ``durations``: each action's own time by ``(kind, mb, chunk)`` (e.g. as a measured
    timeline took them: ``measured_cost_bubble``), instead of ``cost`` and the weights.
    Raises ``ValueError`` if the lists cannot finish (validate them).
    """
    pp, _, v = schedule_shape(actions)
    n_chunks = pp * v
    weight = [1.0] * n_chunks if chunk_weight is None else list(chunk_weight)
    if len(weight) != n_chunks:
        raise ValueError(f"chunk_weight has {len(weight)} entries for {n_chunks} chunks")
    split = split_backwards(actions)
    clock = [0.0] * pp
    pos = [0] * pp
    end: dict[Action, float] = {}  # finish time of compute actions
    sent: dict[Action, float] = {}  # arrival time of messages, keyed by their RECV
    spans: list[list[Span]] = [[] for _ in range(pp)]

    def ready(a: Action) -> float | None:
        times = []
        for d in data_deps(a, n_chunks):
            if rank_of(d.chunk, pp) == rank_of(a.chunk, pp):
                times.append(end[d])
            else:
                recv = Action("RECV_F" if d.kind == "F" else "RECV_B", a.mb, a.chunk)
                if recv not in sent:
                    return None
                times.append(sent[recv])
        return max(times, default=0.0)

    progressed = True
    while progressed:
        progressed = False
        for r in range(pp):
            while pos[r] < len(actions[r]):
                a = actions[r][pos[r]]
                if a.kind in COMPUTE:
                    t = ready(a)
                    if t is None:
                        break
                    start = max(clock[r], t)
                    clock[r] = start + (
                        durations[(a.kind, a.mb, a.chunk)] if durations is not None else
                        action_cost(a.kind, (a.mb, a.chunk) in split, cost) * weight[a.chunk])
                    end[a] = clock[r]
                    spans[r].append(Span(r, a.kind, a.mb, a.chunk, start, clock[r]))
                elif a.kind.startswith("SEND"):
                    sent[partner(a)] = clock[r] + p2p
                pos[r] += 1
                progressed = True
    if any(pos[r] < len(actions[r]) for r in range(pp)):
        stuck = [f"rank {r} at {actions[r][pos[r]]}" for r in range(pp)
                 if pos[r] < len(actions[r])]
        raise ValueError("schedule cannot finish: " + ", ".join(stuck))
    return spans


# --- bubble figures from any timeline (simulated or measured) -------------------------
def bubble_stats(timeline: Sequence[Sequence]) -> dict[str, float]:
    """Step time, busy time, bubble fraction and ratio of per-rank compute spans.

    Anything with ``.kind``, ``.start`` and ``.end`` works, so the executor's measured
    records go through the same function as the simulated spans. The step runs from
    the earliest start to the latest end over all ranks.
    """
    spans = [s for row in timeline for s in row if s.kind in COMPUTE]
    if not spans:
        return {"step_time": 0.0, "busy": 0.0, "bubble_fraction": 0.0, "bubble_ratio": 0.0}
    step = max(s.end for s in spans) - min(s.start for s in spans)
    busy = sum(s.end - s.start for s in spans)
    idle = len(timeline) * step - busy
    return {"step_time": step, "busy": busy,
            "bubble_fraction": idle / (len(timeline) * step) if step > 0 else 0.0,
            "bubble_ratio": idle / busy if busy > 0 else 0.0}


def bubble_ratio_formula(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """Idle over ideal time in closed form, for unit costs F=1, B=2 (ZB: B=W=1)."""
    p, m, v = pp, microbatches, virtual
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved":
        return (p - 1) / (v * m)
    if schedule == "zb":
        return (p - 1) / (3 * m)
    if schedule == "interleaved-zb":  # ZB-H1's third, on chunks v times smaller
        return (p - 1) / (3 * v * m)
    raise ValueError(f"no closed form for schedule {schedule!r}")


def bubble_fraction_formula(schedule: str, pp: int, microbatches: int,
                            virtual: int = 1) -> float:
    """Idle share of the step in closed form: ratio / (1 + ratio)."""
    ratio = bubble_ratio_formula(schedule, pp, microbatches, virtual)
    return ratio / (1 + ratio)


# --- unequal stages: what each chunk of a real model costs -----------------------------
def chunk_flops(cfg: GPTConfig | str, pp: int, virtual: int = 1,
                recompute: str = "none", head_layers: int = 0) -> list[float]:
    """Training FLOPs per token (forward + backward) of each global chunk.

    Chunk ``c`` runs its layers of ``partition_layers`` (the pipeline's own split); the
    last chunk adds the head (``head_flops_per_token``; norm and loss add no matmul
    FLOPs). The first chunk's embedding is a lookup, no matmul: 0 FLOPs, as in
    ``hardware_flops_per_token``, so the chunks sum to that figure. FLOPs only: the
    loss's fp32 softmax over the vocabulary is memory-bound and takes longer than its
    FLOPs say (``benchmarks/multigpu.py`` calibrates ``head_rates`` for that), so these
    figures understate the last chunk's time somewhat.
    """
    cfg = get_model(cfg)
    return chunk_costs(cfg.n_layer, pp * virtual, layer_flops_per_token(cfg, recompute),
                       head_flops_per_token(cfg), head_layers)


def chunk_costs(n_layer: int, n_chunks: int, layer: float, head: float,
                head_layers: int = 0) -> list[float]:
    """Each chunk's cost (FLOPs, seconds, ...): its layers of ``partition_layers`` at
    ``layer`` each, and ``head`` on the last chunk."""
    costs = [len(r) * layer for r in partition_layers(n_layer, n_chunks, head_layers)]
    costs[-1] += head
    return costs


def chunk_weights(cfg: GPTConfig | str, pp: int, virtual: int = 1,
                  recompute: str = "none", head_layers: int = 0) -> list[float]:
    """``chunk_flops`` over their mean: weights for ``simulate(..., chunk_weight=...)``.

    Normalised to mean 1, so a step's total work is the unit simulation's and only its
    spread over the ranks changes. One weight scales F, B and W alike: the head, like a
    layer, does 2 V h FLOPs forward and 4 V h backward, half input gradient and half
    weight gradient, which is the 1 : 2 (ZB: 1 : 1 : 1) of the unit costs. (A layer's
    attention products have no weight gradient, so its real B is a bit over half its
    backward; the unit costs ignore that for every chunk alike.)
    """
    flops = chunk_flops(cfg, pp, virtual, recompute, head_layers)
    mean = sum(flops) / len(flops)
    return [f / mean for f in flops]


def stage_cost_bubble(schedule: str, pp: int, microbatches: int, virtual: int = 1,
                      weights: Sequence[float] | None = None, p2p: float = 0.0) -> float:
    """Bubble fraction of ``schedule`` simulated with per-chunk ``weights`` (None: equal
    stages, the unit-cost figure; ``p2p`` in units of a mean chunk's forward)."""
    actions = make_schedule(schedule, pp, microbatches, virtual)
    return bubble_stats(simulate(actions, p2p=p2p, chunk_weight=weights))["bubble_fraction"]


def measured_cost_bubble(schedule: str, pp: int, microbatches: int, virtual: int,
                         timeline: Sequence[Sequence], p2p: float = 0.0) -> float:
    """Bubble fraction of ``schedule`` simulated with every action taking the time it took
    in a measured ``timeline`` (the executor's records: ``.kind .mb .chunk .start
    .end``) and each message ``p2p`` seconds: the idle time the schedule's dependencies
    imply for these very costs (uneven stages, B longer than W, a slow loss). What the
    measured bubble has beyond it is waiting the schedule does not explain: launches,
    synchronisation, transfers slower than ``p2p``."""
    took = {(s.kind, s.mb, s.chunk): s.end - s.start for row in timeline for s in row
            if s.kind in COMPUTE}
    actions = make_schedule(schedule, pp, microbatches, virtual)
    return bubble_stats(simulate(actions, p2p=p2p, durations=took))["bubble_fraction"]


def pipeline_seconds(schedule: str, pp: int, microbatches: int, virtual: int,
                     seconds: Sequence[float]) -> tuple[float, float]:
    """(compute, step) of a pipeline whose global chunks take ``seconds`` per micro-batch
    (forward + backward, e.g. ``rates.chunk_seconds``): the busiest rank's compute and
    the makespan of the schedule's timeline, so step - compute is that rank's bubble.

    The simulation runs the schedule itself, so an uneven split (the head on the last
    chunk) is counted once: the slowest stage paces the steady state and the others'
    warm-up and cool-down add what the timeline says, not a closed form's (p-1)/m of
    the slowest stage. Without a pipeline the micro-batches just run one after another.
    """
    busy = microbatches * max(sum(seconds[r::pp]) for r in range(pp))  # chunk c: rank c % pp
    if pp == 1:
        return busy, busy
    top = max(seconds)
    if pp > SIMULATED_PP:  # the closed form: exact when the busiest rank runs the head
        per_rank = [sum(seconds[r::pp]) for r in range(pp)]
        idle = (sum(per_rank) - max(per_rank)) * IDLE_SHARE[schedule] / virtual
        return busy, busy + idle
    # The idle time is the warm-up's and the cool-down's: past 4 pp micro-batches it no
    # longer grows (tests/test_planner.py checks), so longer pipelines are simulated at
    # 4 pp. The timeline scales with the seconds: simulated over their largest, rounded
    # to a hundredth of it (an idle time off by well under a percent of the step), one
    # run serves the planner's many layouts of one shape.
    weights = tuple(round(x / top, 2) for x in seconds)
    return busy, busy + top * _idle(schedule, pp, min(microbatches, 4 * pp), virtual, weights)


# Past this many stages a simulation costs seconds (its actions grow as pp^2) and the
# closed form takes over: the busiest rank waits while the warm-up and the cool-down cross
# every other rank once, all of their F + B under 1F1B and GPipe, a 1/v of it interleaved
# (chunks v times smaller), a third under ZB-H1 (only the F's; B and W fill the rest).
# Against the simulation at pp 8 and 16 (tests/test_planner.py): equal when the last
# stage, which runs the head, is the busiest; up to 6% above it when a lighter last stage
# lets the others overlap their cool-downs.
SIMULATED_PP = 8
IDLE_SHARE = {"gpipe": 1.0, "1f1b": 1.0, "interleaved": 1.0, "zb": 1 / 3,
              "interleaved-zb": 1 / 3}


schedule_actions = lru_cache(maxsize=256)(make_schedule)  # read only: one list per shape


@lru_cache(maxsize=4096)
def _idle(schedule: str, pp: int, microbatches: int, virtual: int,
          weights: tuple[float, ...]) -> float:
    """The busiest rank's idle time in the simulated timeline, chunks at ``weights``
    (a chunk's F + B, or F + B + W, in the units of the weights)."""
    per_unit = UNIT_COST["F"] + UNIT_COST["B"]  # a chunk's F + B in unit costs
    timeline = simulate(schedule_actions(schedule, pp, microbatches, virtual),
                        chunk_weight=[w / per_unit for w in weights])
    busy = max(sum(s.end - s.start for s in row) for row in timeline)
    return bubble_stats(timeline)["step_time"] - busy


# --- activation memory ---------------------------------------------------------------
def peak_in_flight(actions: Schedule) -> list[int]:
    """Per rank, the most (micro-batch, chunk) activations held at once.

    An activation is held from its F until its backward is over: the B, or the W when
    the weight gradient is split off (W still needs the layer inputs). With one chunk
    per rank this counts micro-batches: GPipe holds ``m``, 1F1B at most ``p - r``.
    With v chunks each activation is 1/v of a stage's.
    """
    split = split_backwards(actions)
    peaks = []
    for acts in actions:
        held = peak = 0
        for a in acts:
            if a.kind == "F":
                held += 1
            elif (a.kind == "B" and (a.mb, a.chunk) not in split) or a.kind == "W":
                held -= 1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


# --- text for the command line ---------------------------------------------------------
def timeline_table(timeline: Sequence[Sequence[Span]], virtual: int = 1,
                   unit: float = 1.0) -> str:
    """A text Gantt chart: one row per rank, one cell per time unit, ``.`` for idle."""
    width = 4 if virtual == 1 else 6
    step = max((s.end for row in timeline for s in row), default=0.0)
    cols = int(round(step / unit))
    lines = []
    for r, row in enumerate(timeline):
        cells = ["."] * cols
        for s in row:
            label = Action(s.kind, s.mb, s.chunk).short(virtual)
            for c in range(int(round(s.start / unit)), int(round(s.end / unit))):
                cells[c] = label
        lines.append(f"rank {r} | " + "".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(lines)


def bubble_report(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> dict:
    """What ``python -m minipar bubble`` prints: figures, table and memory of a schedule.

    Keys: schedule, pp, microbatches, virtual, bubble_fraction, bubble_ratio (from the
    simulated timeline), the closed forms (``*_formula``), step_time and ideal_time in
    units of one chunk forward, peak_in_flight (per rank), table (text Gantt chart),
    actions (per rank, the compute order as text) and timeline (spans as dicts).
    """
    actions = make_schedule(schedule, pp, microbatches, virtual)
    timeline = simulate(actions)
    stats = bubble_stats(timeline)
    return {
        "schedule": schedule, "pp": pp, "microbatches": microbatches, "virtual": virtual,
        "bubble_fraction": stats["bubble_fraction"],
        "bubble_ratio": stats["bubble_ratio"],
        "bubble_fraction_formula": bubble_fraction_formula(schedule, pp, microbatches,
                                                           virtual),
        "bubble_ratio_formula": bubble_ratio_formula(schedule, pp, microbatches, virtual),
        "step_time": stats["step_time"],
        "ideal_time": stats["busy"] / pp,
        "peak_in_flight": peak_in_flight(actions),
        "table": timeline_table(timeline, virtual),
        "actions": [" ".join(a.short(virtual) for a in acts if a.kind in COMPUTE)
                    for acts in actions],
        "timeline": [s._asdict() for row in timeline for s in row],
    }
