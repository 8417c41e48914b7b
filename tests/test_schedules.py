"""Pipeline schedules as data: generator properties, the validator, and bubble theory.

No processes here: these check the action lists themselves, over many (pp, m, v) with
hypothesis, and the theoretical timeline against the papers' closed forms.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipar.parallel.schedules import (
    COMPUTE,
    SCHEDULES,
    SPLIT_BACKWARD,
    VIRTUAL_STAGES,
    Action,
    ScheduleError,
    check_schedule,
    make_schedule,
    validate,
)
from minipar.theory.bubble import (
    bubble_fraction_formula,
    bubble_ratio_formula,
    bubble_report,
    bubble_stats,
    peak_in_flight,
    simulate,
)


@st.composite
def layouts(draw, max_pp: int = 8, max_m: int = 16):
    """(name, pp, microbatches, virtual) that the schedule accepts."""
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    pp = draw(st.integers(1, max_pp))
    if name in VIRTUAL_STAGES:
        return name, pp, pp * draw(st.integers(1, max(1, max_m // pp))), draw(st.integers(1, 4))
    return name, pp, draw(st.integers(1, max_m)), 1


# --- generator properties ---------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(layouts())
def test_every_pass_exactly_once_on_its_rank(layout):
    name, pp, m, v = layout
    actions = make_schedule(name, pp, m, v)
    assert len(actions) == pp
    for kind in ("F", "B"):
        got = sorted((a.mb, a.chunk) for acts in actions for a in acts if a.kind == kind)
        assert got == sorted((mb, c) for mb in range(m) for c in range(pp * v)), kind
    ws = sorted((a.mb, a.chunk) for acts in actions for a in acts if a.kind == "W")
    assert ws == (sorted((mb, c) for mb in range(m) for c in range(pp * v))
                  if name in SPLIT_BACKWARD else [])
    for r, acts in enumerate(actions):
        assert all(a.chunk % pp == r for a in acts)
    validate(actions, m, v)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_simulated_timeline_respects_every_dependency(layout):
    """Read the dependencies off the model, not the validator: F of a chunk needs the
    chunk before; B needs its own F and the B of the chunk after; W needs its B."""
    name, pp, m, v = layout
    spans = {(s.kind, s.mb, s.chunk): s for row in simulate(make_schedule(name, pp, m, v))
             for s in row}
    last = pp * v - 1
    for (kind, mb, c), s in spans.items():
        needs = {"F": [("F", mb, c - 1)] if c else [],
                 "B": [("F", mb, c)] + ([("B", mb, c + 1)] if c < last else []),
                 "W": [("B", mb, c)]}[kind]
        for d in needs:
            assert spans[d].end <= s.start, f"{kind}{mb} chunk {c} starts before {d} ends"
    for row in simulate(make_schedule(name, pp, m, v)):  # a rank runs one thing at a time
        assert all(a.end <= b.start for a, b in zip(row, row[1:]))


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 8), st.integers(1, 16))
def test_peak_in_flight_gpipe_holds_m_1f1b_at_most_p(pp, m):
    assert peak_in_flight(make_schedule("gpipe", pp, m)) == [m] * pp
    assert peak_in_flight(make_schedule("1f1b", pp, m)) == [min(pp - r, m) for r in range(pp)]
    assert peak_in_flight(make_schedule("zb", pp, m)) == [min(pp, m)] * pp  # ZB-H1: as 1F1B


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 4))
def test_peak_in_flight_interleaved_is_warmup_plus_one(pp, groups, v):
    m = pp * groups
    want = [min(2 * (pp - r - 1) + (v - 1) * pp + 1, m * v) for r in range(pp)]
    assert peak_in_flight(make_schedule("interleaved", pp, m, v)) == want


def test_schedules_that_need_it_refuse_clearly():
    with pytest.raises(ValueError, match="divisible by pp"):
        make_schedule("interleaved", 4, 6, 2)
    for name in ("gpipe", "1f1b", "zb"):
        with pytest.raises(ValueError, match="virtual"):
            make_schedule(name, 2, 4, 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("dualpipe", 2, 4)
    with pytest.raises(ValueError, match="positive"):
        make_schedule("1f1b", 0, 4)


def test_one_rule_book_for_train_bubble_and_the_planner():
    """``check_schedule`` holds the rules: ``train`` refuses with its line, ``bubble``
    with the same, and the planner's rejection reason is that line (so the planner never
    ranks what ``train`` would refuse, whatever the rule becomes)."""
    from minipar.__main__ import build_parser, train_config
    from minipar.config import validate as validate_config
    from minipar.theory.planner import plan

    check_schedule("zb", 2, 4, zero=2, recompute="selective")  # runs: no error
    check_schedule("interleaved", 2, 4, 2, zero=3, recompute="full")
    rules = {("zb", 1, 2, 1, 3, "none"): "--zero 3 with --schedule zb",
             ("zb", 2, 4, 1, 0, "full"): "--recompute full with --schedule zb",
             ("1f1b", 2, 4, 2, 0, "none"): "--virtual 2 needs --schedule interleaved",
             ("interleaved", 4, 6, 2, 0, "none"): "divisible by --pp \\(6 % 4"}
    for (name, pp, m, v, zero, rc), line in rules.items():
        with pytest.raises(ValueError, match=line) as refused:
            check_schedule(name, pp, m, v, zero=zero, recompute=rc)
        words = (f"--model tiny --pp {pp} --dp 2 --microbatches {m} --batch-size {2 * m} "
                 f"--schedule {name} --virtual {v} --zero {zero} --recompute {rc}").split()
        with pytest.raises(ValueError) as trained:
            validate_config(train_config(build_parser().parse_args(["train", *words])))
        assert str(trained.value) == str(refused.value)
    found = plan("gpt-1.3b", "dgx-h100", 64, degrees={"pp": 2})
    reasons = set(found.rejected)
    for rc, zero in (("none", 3), ("full", 0)):
        with pytest.raises(ValueError) as refused:
            check_schedule("zb", 2, 4, zero=zero, recompute=rc)
        assert str(refused.value) in reasons


# --- bubble theory ------------------------------------------------------------------------
@settings(max_examples=120, deadline=None)
@given(layouts())
def test_simulation_matches_closed_forms(layout):
    name, pp, m, v = layout
    if name == "zb" and m < pp:  # the ZB-H1 closed form assumes a full steady state
        return
    stats = bubble_stats(simulate(make_schedule(name, pp, m, v)))
    assert stats["bubble_ratio"] == pytest.approx(bubble_ratio_formula(name, pp, m, v))
    assert stats["bubble_fraction"] == pytest.approx(bubble_fraction_formula(name, pp, m, v))


def test_closed_forms_are_the_papers():
    assert bubble_fraction_formula("1f1b", 4, 8) == pytest.approx(3 / 11)  # (p-1)/(m+p-1)
    assert bubble_ratio_formula("1f1b", 4, 8) == pytest.approx(3 / 8)  # (p-1)/m
    assert bubble_ratio_formula("interleaved", 4, 8, 2) == pytest.approx(3 / 16)  # /(v m)
    zb, one = bubble_stats(simulate(make_schedule("zb", 4, 8))), make_schedule("1f1b", 4, 8)
    idle_1f1b = bubble_stats(simulate(one))
    # ZB-H1 idles (p-1) units per rank against 1F1B's 3 (p-1): a third of the bubble
    assert (zb["step_time"] - zb["busy"] / 4) * 3 == pytest.approx(
        idle_1f1b["step_time"] - idle_1f1b["busy"] / 4)


def test_bubble_report_for_the_command_line():
    rep = bubble_report("interleaved", 2, 4, 2)
    for key in ("bubble_fraction", "bubble_ratio", "table", "peak_in_flight", "actions"):
        assert key in rep
    assert rep["table"].count("\n") == 1 and rep["table"].startswith("rank 0 |")
    assert rep["bubble_ratio"] == pytest.approx(1 / 8)
    assert rep["peak_in_flight"] == peak_in_flight(make_schedule("interleaved", 2, 4, 2))
    assert rep["actions"][0].split()[:2] == ["F0c0", "F1c0"]


# --- the validator ------------------------------------------------------------------------
def _edit(actions, rank, fn):
    out = [list(a) for a in actions]
    out[rank] = fn(out[rank])
    return out


def test_validator_names_missing_and_repeated_actions():
    s = make_schedule("1f1b", 2, 3)
    b0 = Action("B", 0, 1)
    with pytest.raises(ScheduleError, match=r"rank 1: B\(mb=0, chunk=1\) is missing"):
        validate(_edit(s, 1, lambda acts: [a for a in acts if a != b0]), 3)
    with pytest.raises(ScheduleError, match=r"rank 1: B\(mb=0, chunk=1\) appears twice"):
        validate(_edit(s, 1, lambda acts: acts + [b0]))
    with pytest.raises(ScheduleError, match=r"rank 0: .* lives on rank 1"):
        validate(_edit(s, 0, lambda acts: acts + [Action("W", 0, 1)]))
    with pytest.raises(ScheduleError, match=r"rank 0: F\(mb=3, chunk=0\) is missing"):
        validate(s, microbatches=4)  # a micro-batch that never runs
    with pytest.raises(ScheduleError, match="not an Action"):
        validate(_edit(s, 0, lambda acts: acts + [("F", 0, 0)]))


def test_validator_names_dependency_violations():
    s = make_schedule("gpipe", 2, 2)
    swap = lambda acts: [Action("B", 0, 0)] + [a for a in acts if a != Action("B", 0, 0)]  # noqa: E731
    with pytest.raises(ScheduleError, match=r"rank 0: B\(mb=0, chunk=0\) runs before F"):
        validate(_edit(s, 0, swap))
    late = lambda acts: [a for a in acts if a.kind != "RECV_F"] + [  # noqa: E731
        a for a in acts if a.kind == "RECV_F"]
    with pytest.raises(ScheduleError, match=r"rank 1: F\(mb=0, chunk=1\) runs before RECV_F"):
        validate(_edit(s, 1, late))


def test_validator_names_unmatched_messages():
    s = make_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match=r"rank 1: SEND_F\(mb=0, chunk=1\) has no partner"):
        validate(_edit(s, 1, lambda acts: acts + [Action("SEND_F", 0, 1)]))
    drop = lambda acts: [a for a in acts if a != Action("RECV_B", 1, 0)]  # noqa: E731
    with pytest.raises(ScheduleError, match=r"rank 0: RECV_B\(mb=1, chunk=0\) is missing"):
        validate(_edit(s, 0, drop))


def test_validator_finds_deadlocks_and_crossed_messages():
    ok = [[Action("F", 0, 0), Action("SEND_F", 0, 0), Action("RECV_B", 0, 0), Action("B", 0, 0)],
          [Action("RECV_F", 0, 1), Action("F", 0, 1), Action("B", 0, 1), Action("SEND_B", 0, 1)]]
    validate(ok)
    # rank 0 waits for a gradient before sending the activation that produces it
    cycle = [[ok[0][0], ok[0][2], ok[0][1], ok[0][3]], ok[1]]
    with pytest.raises(ScheduleError, match=r"would deadlock[\s\S]*rank 0 blocks at RECV_B"):
        validate(cycle)
    # rank 1 receives micro-batch 1 before 0, rank 0 sends 0 first
    s = make_schedule("gpipe", 2, 2)
    r0, r1 = Action("RECV_F", 0, 1), Action("RECV_F", 1, 1)
    crossed = _edit(s, 1, lambda acts: [r1, r0] + [a for a in acts if a not in (r0, r1)])
    with pytest.raises(ScheduleError, match="rank 1 blocks at RECV_F.*mb=1.*different orders"):
        validate(crossed)


def test_generated_lists_place_messages_next_to_their_compute():
    s = make_schedule("1f1b", 2, 2)
    kinds = [a.kind for a in s[0]]
    assert kinds[:2] == ["F", "SEND_F"]  # the activation leaves as soon as it exists
    assert all(a.kind in COMPUTE or a.kind.startswith(("SEND", "RECV")) for a in s[1])
