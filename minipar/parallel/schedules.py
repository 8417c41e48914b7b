"""Pipeline schedules as data: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and interleaved zero
bubble, plus a validator.

A pipeline cuts the model into ``pp * virtual`` chunks of consecutive layers; rank ``r``
holds chunks ``r, r + pp, ...`` (Megatron's virtual stages). A *schedule* is, for every
rank, the list of ``Action`` s it runs, in order:

    make_schedule("1f1b", pp=2, microbatches=3), micro-batch numbers only:
      rank 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 F2 RECV_B1 SEND_F2 B1 RECV_B2 B2
      rank 1: RECV_F0 F0 RECV_F1 B0 SEND_B0 F1 B1 SEND_B1 RECV_F2 F2 B2 SEND_B2

The same lists drive the executor (``minipar.parallel.pp``), the theoretical timeline,
the bubble figures (``minipar.theory.bubble``) and the lessons' pictures. Papers: GPipe
(arXiv 1811.06965); 1F1B (PipeDream-Flush, arXiv 2006.09503); interleaved 1F1B (arXiv
2104.04473, section 2.2); ZB-H1 (Qi et al., arXiv 2401.10241, section 3).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import NamedTuple

COMPUTE = ("F", "B", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE + COMM


UNIT_COST: dict[str, float] = {"F": 1.0, "B": 2.0, "W": 1.0}  # B = input + weight part


class ScheduleError(ValueError):
    """A schedule that cannot run; the message names the rank, the action and why."""


def action_cost(kind: str, split: bool, cost: Mapping[str, float] = UNIT_COST) -> float:
    """Time of a compute action (costs as in arXiv 2401.10241). A B whose W runs
    separately does only its input part."""
    return cost["B"] - cost["W"] if kind == "B" and split else cost[kind]


class Action(NamedTuple):
    """One step of one rank: ``kind`` of micro-batch ``mb`` on global chunk ``chunk``.

    * ``F``  forward of ``chunk`` on micro-batch ``mb``;
    * ``B``  backward: the gradient with respect to the chunk's input. It also computes
      the weight gradients, *unless* the same rank's list holds a ``W`` for that
      (mb, chunk);
    * ``W``  the weight gradients alone (zero-bubble schedules split the backward in two);
    * ``SEND_F`` / ``RECV_F``  the activation leaving ``chunk`` / entering ``chunk``;
    * ``SEND_B`` / ``RECV_B``  the gradient leaving ``chunk`` (to the chunk before) /
      arriving for ``chunk``'s output (from the chunk after).
    """

    kind: str
    mb: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind}(mb={self.mb}, chunk={self.chunk})"

    def short(self, virtual: int = 1) -> str:
        """``F3`` (or ``F3c1`` when a rank holds several chunks) for tables."""
        return f"{self.kind}{self.mb}" + (f"c{self.chunk}" if virtual > 1 else "")


Schedule = list[list[Action]]  # one list of actions per pipeline rank


def rank_of(chunk: int, pp: int) -> int:
    """The rank holding ``chunk``: chunks are dealt round-robin (Megatron's layout)."""
    return chunk % pp


# --- what depends on what ---------------------------------------------------------
def data_deps(a: Action, n_chunks: int) -> list[Action]:
    """Compute actions whose results ``a`` consumes (on whatever rank they run)."""
    if a.kind == "F":
        return [Action("F", a.mb, a.chunk - 1)] if a.chunk > 0 else []
    if a.kind == "B":
        later = [Action("B", a.mb, a.chunk + 1)] if a.chunk < n_chunks - 1 else []
        return [Action("F", a.mb, a.chunk), *later]
    if a.kind == "W":
        return [Action("B", a.mb, a.chunk)]
    return []


def local_deps(a: Action, pp: int, n_chunks: int) -> list[Action]:
    """Actions that must come *earlier in the same rank's list* than ``a``.

    Data made on another rank is represented by the ``RECV`` that brings it in.
    """
    if a.kind == "SEND_F":
        return [Action("F", a.mb, a.chunk)]
    if a.kind == "SEND_B":
        return [Action("B", a.mb, a.chunk)]
    here = rank_of(a.chunk, pp)
    out = []
    for d in data_deps(a, n_chunks):
        if rank_of(d.chunk, pp) == here:
            out.append(d)
        else:  # produced elsewhere: the local evidence is its receive
            out.append(Action("RECV_F" if d.kind == "F" else "RECV_B", a.mb, a.chunk))
    return out


def messages(a: Action, pp: int, n_chunks: int) -> list[tuple[Action, Action]]:
    """(send on this rank, matching receive on the peer) that compute ``a`` triggers."""
    here = rank_of(a.chunk, pp)
    if a.kind == "F" and a.chunk < n_chunks - 1 and rank_of(a.chunk + 1, pp) != here:
        return [(Action("SEND_F", a.mb, a.chunk), Action("RECV_F", a.mb, a.chunk + 1))]
    if a.kind == "B" and a.chunk > 0 and rank_of(a.chunk - 1, pp) != here:
        return [(Action("SEND_B", a.mb, a.chunk), Action("RECV_B", a.mb, a.chunk - 1))]
    return []


def partner(a: Action) -> Action:
    """The action on the neighbouring rank that a send or receive pairs with."""
    step = {"SEND_F": ("RECV_F", 1), "RECV_F": ("SEND_F", -1),
            "SEND_B": ("RECV_B", -1), "RECV_B": ("SEND_B", 1)}
    kind, delta = step[a.kind]
    return Action(kind, a.mb, a.chunk + delta)


# --- from compute order to a runnable list ------------------------------------------
def with_communication(compute: Schedule) -> Schedule:
    """Insert the sends and receives into per-rank compute orders.

    Simulate in rounds (every compute takes one round; a rank runs its next action as
    soon as everything it needs ran in an earlier round). A message produced in round
    ``t`` is sent right after its producer and received by the peer right after the
    peer's own round ``t``; inside a round, messages are sorted by one global key.
    Every rank therefore meets its messages in the same global order, so blocking
    sends and receives can never wait on each other in a cycle.
    """
    pp = len(compute)
    n_chunks = 1 + max((a.chunk for acts in compute for a in acts), default=0)
    n_chunks = -(-n_chunks // pp) * pp
    finished: dict[Action, int] = {}
    pos = [0] * pp
    out: Schedule = [[] for _ in range(pp)]
    t = 0
    while any(pos[r] < len(compute[r]) for r in range(pp)):
        ran = []
        for r in range(pp):
            if pos[r] < len(compute[r]):
                a = compute[r][pos[r]]
                if all(finished.get(d, t) < t for d in data_deps(a, n_chunks)):
                    ran.append((r, a))
        if not ran:
            stuck = [f"rank {r}: {compute[r][pos[r]]}" for r in range(pp)
                     if pos[r] < len(compute[r])]
            raise ScheduleError("compute order violates dependencies, no rank can proceed: "
                                + "; ".join(stuck))
        slot: dict[int, list] = defaultdict(list)
        for r, a in ran:
            finished[a] = t
            pos[r] += 1
            out[r].append(a)
            for send, recv in messages(a, pp, n_chunks):
                key = (send.kind, send.chunk, send.mb)
                slot[r].append((key, send))
                slot[rank_of(recv.chunk, pp)].append((key, recv))
        for r, items in slot.items():
            out[r].extend(action for _, action in sorted(items))
        t += 1
    return out


# --- the schedules -------------------------------------------------------------------
def _check(name: str, pp: int, microbatches: int, virtual: int, virtual_ok: bool) -> None:
    for label, v in (("pp", pp), ("microbatches", microbatches), ("virtual", virtual)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: {label} must be a positive integer, got {v!r}")
    if virtual != 1 and not virtual_ok:
        raise ValueError(f"{name} runs one chunk per rank (virtual=1), got virtual={virtual}; "
                         f"use one of {list(VIRTUAL_STAGES)} for virtual stages")


def _whole_groups(name: str, pp: int, microbatches: int) -> None:
    if microbatches % pp:
        raise ValueError(f"{name} needs microbatches divisible by pp (Megatron's rule): got "
                         f"microbatches={microbatches}, pp={pp}")


def gpipe(pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """GPipe: every forward, then every backward (Huang et al. 2019).

    Simple, but each rank holds the activations of all ``m`` micro-batches at once.
    Bubble: (p-1)/(m+p-1) of the step.
    """
    _check("gpipe", pp, microbatches, virtual, False)
    m = range(microbatches)
    return with_communication([[Action("F", i, r) for i in m] + [Action("B", i, r) for i in m]
                               for r in range(pp)])


def one_f_one_b(pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """1F1B (PipeDream-Flush): a short warm-up of forwards, then alternate F and B.

    Rank ``r`` runs ``p - r - 1`` warm-up forwards, so it never holds more than
    ``p - r`` micro-batches (GPipe holds ``m``). Same bubble as GPipe, far less memory.
    """
    _check("1f1b", pp, microbatches, virtual, False)
    out = []
    for r in range(pp):
        warm = min(pp - r - 1, microbatches)
        acts = [Action("F", i, r) for i in range(warm)]
        for i in range(microbatches - warm):
            acts += [Action("F", warm + i, r), Action("B", i, r)]
        acts += [Action("B", i, r) for i in range(microbatches - warm, microbatches)]
        out.append(acts)
    return with_communication(out)


def interleaved_1f1b(pp: int, microbatches: int, virtual: int = 2) -> Schedule:
    """Interleaved 1F1B with ``virtual`` chunks per rank (Narayanan et al. 2021, sec. 2.2).

    Each rank runs its chunks in turn, ``pp`` micro-batches at a time. A micro-batch
    then crosses a rank in 1/v of the time, so the fill and drain shrink v-fold:
    bubble ratio (p-1)/(v m), at the price of v times more point-to-point messages.
    As in Megatron-LM, micro-batches must come in whole groups of ``pp``.
    """
    _check("interleaved", pp, microbatches, virtual, True)
    _whole_groups("interleaved", pp, microbatches)
    total = microbatches * virtual  # forward (and backward) actions per rank

    def action(kind: str, k: int, r: int) -> Action:
        group, within = divmod(k, pp * virtual)
        local = within // pp if kind == "F" else virtual - 1 - within // pp
        return Action(kind, group * pp + within % pp, local * pp + r)

    out = []
    for r in range(pp):
        warm = min(2 * (pp - r - 1) + (virtual - 1) * pp, total)
        acts = [action("F", k, r) for k in range(warm)]
        for k in range(total - warm):
            acts += [action("F", warm + k, r), action("B", k, r)]
        acts += [action("B", k, r) for k in range(total - warm, total)]
        out.append(acts)
    return with_communication(out)


def zb_h1(pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2024): 1F1B with the backward split into B (input grad) and W.

    B is on the critical path (the rank before waits for it); W (weight gradients) is
    not, so it can fill the holes. Rank ``r`` keeps 1F1B's order of F and B, skips W
    in its first ``r`` steady rounds and runs those W at the end, where 1F1B idles.
    With F = B = W the bubble drops to about a third of 1F1B's; peak activations stay
    at ``p`` micro-batches.
    """
    _check("zb", pp, microbatches, virtual, False)
    out = []
    for r in range(pp):
        warm = min(pp - r - 1, microbatches)
        acts = [Action("F", i, r) for i in range(warm)]
        w_next = 0  # next micro-batch whose W is due
        for i in range(microbatches):
            if warm + i < microbatches:
                acts.append(Action("F", warm + i, r))
            acts.append(Action("B", i, r))
            if i >= r:  # the first r weight passes are deferred to the drain
                acts.append(Action("W", w_next, r))
                w_next += 1
        acts += [Action("W", i, r) for i in range(w_next, microbatches)]
        out.append(acts)
    return with_communication(out)


def defer_weight_passes(compute: Schedule) -> Schedule:
    """Split every backward of a schedule in B and W and move the W into the holes: the
    zero-bubble idea (Qi et al. 2024, section 3) applied to any order of F and B.

    Each rank keeps its order of F and B. Rank ``r`` defers at most ``r`` weight passes:
    a deferred W runs where the rank would otherwise wait for a neighbour, or as soon as
    more than ``r`` wait, and the rest at the end. Where to wait is read off a simulation at
    equal unit costs (F = B = W, the paper's), the earliest start first. Rank 0, whose
    neighbours wait on it the longest, runs each W right after its B; a later rank idles
    more in 1F1B, has more holes and defers more. So every rank holds at most rank 0's
    peak of activations (a micro-batch's are held until its W), as ZB-H1 does by hand for
    1F1B (``zb_h1``; this function, given 1F1B, finds a step of the same length).
    """
    pp = len(compute)
    order = [[a for a in acts if a.kind in ("F", "B")] for acts in compute]
    n_chunks = pp * schedule_shape(compute)[2]
    finish: dict[Action, int] = {}
    clock, pos = [0] * pp, [0] * pp
    deferred: list[list[Action]] = [[] for _ in range(pp)]
    out: Schedule = [[] for _ in range(pp)]

    def inputs_at(a: Action) -> int | None:
        times = [finish.get(d) for d in data_deps(a, n_chunks)]
        return None if None in times else max(times, default=0)

    while any(pos[r] < len(order[r]) or deferred[r] for r in range(pp)):
        moves = []  # (start, rank, action; None: the oldest deferred W)
        for r in range(pp):
            nxt = order[r][pos[r]] if pos[r] < len(order[r]) else None
            t = None if nxt is None else inputs_at(nxt)
            if t is not None and len(deferred[r]) <= r and (t <= clock[r] or not deferred[r]):
                moves.append((max(clock[r], t), r, nxt))
            elif deferred[r]:  # it would wait, or defers too many: a W first
                moves.append((clock[r], r, None))
        if not moves:
            raise ScheduleError("compute order violates dependencies, no rank can proceed")
        start, r, a = min(moves, key=lambda move: move[:2])
        if a is None:
            a = deferred[r].pop(0)
        else:
            pos[r] += 1
            if a.kind == "B":
                deferred[r].append(Action("W", a.mb, a.chunk))
        out[r].append(a)
        clock[r] = finish[a] = start + 1
    return with_communication(out)


def interleaved_zero_bubble(pp: int, microbatches: int, virtual: int = 2) -> Schedule:
    """Interleaved 1F1B with its weight passes deferred into the holes
    (``defer_weight_passes``): ZB-H1's third of the bubble on chunks v times smaller,
    (p-1)/(3 v m) of the work at F = B = W. torch.distributed.pipelining's
    ``ScheduleInterleavedZeroBubble`` builds the same kind of step."""
    _check("interleaved-zb", pp, microbatches, virtual, True)
    _whole_groups("interleaved-zb", pp, microbatches)
    return defer_weight_passes(interleaved_1f1b(pp, microbatches, virtual))


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zb": zb_h1,
    "interleaved-zb": interleaved_zero_bubble,
}
# the schedules that run several chunks per rank (--virtual), and those whose backward is
# split in B and W (W runs later, on the weights and inputs the layer kept)
VIRTUAL_STAGES = ("interleaved", "interleaved-zb")
SPLIT_BACKWARD = ("zb", "interleaved-zb")


def check_schedule(name: str, pp: int, microbatches: int, virtual: int = 1, *,
                   zero: int = 0, recompute: str = "none") -> None:
    """Refuse, in one line, what a run cannot use a schedule with (``config.validate``,
    ``bubble`` and the planner ask here; the generators above check only what they need
    to build a list, and build an interleaved one of one chunk a rank, 1F1B's order, which
    a run is refused as pointless). Virtual stages are interleaved schedules' alone, which
    need two or more beyond one stage, and their micro-batches come in whole groups of pp
    (Megatron's rule). A zero-bubble W pass runs after B, on the
    layer's weights and the inputs its products saved: ZeRO-3 frees the weights between
    the two, and full recomputation frees the inputs (each module's split backward would
    run the block again)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {list(SCHEDULES)}")
    if virtual != 1 and name not in VIRTUAL_STAGES:
        raise ValueError(f"--virtual {virtual} needs --schedule interleaved or "
                         f"interleaved-zb (got {name})")
    if name in VIRTUAL_STAGES and pp > 1 and virtual < 2:  # (one chunk a rank: 1F1B's)
        raise ValueError(f"--schedule {name} needs --virtual 2 or more (chunks per rank)")
    if name in VIRTUAL_STAGES and microbatches % pp:
        raise ValueError(f"--schedule {name} needs --microbatches divisible by --pp "
                         f"({microbatches} % {pp} != 0)")
    if name in SPLIT_BACKWARD and zero == 3:  # at every pp: W runs at pp = 1 too
        raise ValueError(f"--zero 3 with --schedule {name} is not supported: the split "
                         "weight gradient (W) runs after ZeRO-3 has freed the layer's weights")
    if name in SPLIT_BACKWARD and recompute == "full":
        raise ValueError(f"--recompute full with --schedule {name} is not supported: W needs "
                         "the inputs recomputation frees, and each module's split backward "
                         "would run the block again (try --recompute selective or cheap)")


def make_schedule(name: str, pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The per-rank action lists of the schedule called ``name`` (see ``SCHEDULES``)."""
    try:
        fn = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {list(SCHEDULES)}") from None
    return fn(pp, microbatches, virtual)


def schedule_shape(actions: Schedule) -> tuple[int, int, int]:
    """(pp, microbatches, virtual) read off a list of lists."""
    pp = len(actions)
    every = [a for acts in actions for a in acts]
    m = 1 + max((a.mb for a in every), default=-1)
    v = -(-(1 + max((a.chunk for a in every), default=-1)) // max(pp, 1))
    return pp, m, v


# --- the validator -------------------------------------------------------------------
def validate(actions: Schedule, microbatches: int | None = None,
             virtual: int | None = None) -> None:
    """Raise ``ScheduleError`` unless ``actions`` can run to completion.

    The communication model: every send and receive blocks until its partner reaches
    the matching action (MPI's synchronous mode; what an NCCL send does on a GPU
    stream). A list that runs under this strictest model runs under any gentler one
    (gloo's asynchronous isend/irecv). The generators place messages by a round-by-round
    simulation so that all ranks meet their messages in one global order, which can
    never deadlock; this checks any list, handwritten ones included, against the same
    model.

    Checks, in order: every action is well formed and sits on the rank that holds its
    chunk; every F and B of every (micro-batch, chunk) appears exactly once (W at most
    once) and every needed send/receive exactly once (and no other); every action comes
    after what it needs on its rank; and a simulation with blocking sends and receives
    finishes (no cycle of ranks waiting on each other, no messages paired out of order).
    """
    if len(actions) < 1:
        raise ScheduleError("a schedule needs at least one rank")
    for r, acts in enumerate(actions):
        for a in acts:
            if not isinstance(a, Action) or a.kind not in KINDS:
                raise ScheduleError(f"rank {r}: {a!r} is not an Action with kind in {KINDS}")
    pp, m_seen, v_seen = schedule_shape(actions)
    m = m_seen if microbatches is None else microbatches
    v = v_seen if virtual is None else virtual
    n_chunks = pp * v

    seen: list[set[Action]] = [set() for _ in range(pp)]
    for r, acts in enumerate(actions):
        for a in acts:
            if not (0 <= a.mb < m and 0 <= a.chunk < n_chunks):
                raise ScheduleError(f"rank {r}: {a} is out of range (microbatches={m}, "
                                    f"chunks={n_chunks})")
            if rank_of(a.chunk, pp) != r:
                raise ScheduleError(f"rank {r}: {a} concerns chunk {a.chunk}, which lives "
                                    f"on rank {rank_of(a.chunk, pp)}")
            if a in seen[r]:
                raise ScheduleError(f"rank {r}: {a} appears twice")
            seen[r].add(a)

    for mb in range(m):
        for c in range(n_chunks):
            r = rank_of(c, pp)
            for kind in ("F", "B"):
                a = Action(kind, mb, c)
                if a not in seen[r]:
                    raise ScheduleError(f"rank {r}: {a} is missing")
                for send, recv in messages(a, pp, n_chunks):
                    for x in (send, recv):
                        if x not in seen[rank_of(x.chunk, pp)]:
                            raise ScheduleError(f"rank {rank_of(x.chunk, pp)}: {x} is missing "
                                                f"(the data of {a} must cross ranks)")
    for r in range(pp):
        for a in seen[r]:
            if a.kind in COMM:
                other = partner(a)
                if not (0 <= other.chunk < n_chunks) or rank_of(other.chunk, pp) == r:
                    raise ScheduleError(f"rank {r}: {a} has no partner (no chunk on another "
                                        "rank needs it)")

    for r, acts in enumerate(actions):
        done: set[Action] = set()
        for a in acts:
            for d in local_deps(a, pp, n_chunks):
                if d not in done:
                    raise ScheduleError(f"rank {r}: {a} runs before {d}, which it needs")
            done.add(a)
    _check_no_deadlock(actions)


def _check_no_deadlock(actions: Schedule) -> None:
    """Run the lists with blocking sends/receives; explain who waits on whom if stuck."""
    pp = len(actions)
    pos = [0] * pp

    def current(r: int) -> Action | None:
        return actions[r][pos[r]] if pos[r] < len(actions[r]) else None

    while True:
        progressed = False
        for r in range(pp):
            while (a := current(r)) is not None:
                if a.kind in COMPUTE:  # its inputs were checked to come earlier
                    pos[r] += 1
                    progressed = True
                    continue
                peer = rank_of(partner(a).chunk, pp)
                if current(peer) != partner(a):
                    break
                pos[r] += 1
                pos[peer] += 1
                progressed = True
        if all(current(r) is None for r in range(pp)):
            return
        if not progressed:
            break
    lines = []
    for r in range(pp):
        a = current(r)
        if a is None:
            continue
        peer = rank_of(partner(a).chunk, pp)
        there = current(peer)
        why = f"rank {peer} has finished" if there is None else f"rank {peer} is at {there}"
        if there is not None and there.kind in COMM and there.kind[:4] != a.kind[:4] \
                and rank_of(partner(there).chunk, pp) == r:
            why += " (the two ranks pair their messages in different orders)"
        lines.append(f"rank {r} blocks at {a}, waiting for {partner(a)} on rank {peer}; {why}")
    raise ScheduleError("would deadlock with blocking sends/receives:\n  " + "\n  ".join(lines))
