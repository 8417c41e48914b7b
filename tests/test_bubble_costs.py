"""Pipeline bubbles with unequal stages: per-chunk FLOP weights in the simulated timeline.

The unit-cost simulation assumes every chunk costs the same; a real GPT's last chunk also
runs the head (2 V h FLOPs a token forward, 4 V h backward), so the other ranks wait for
it. These tests pin the weights to the FLOP formulas of ``minipar.theory.params`` and the
weighted timeline to a case small enough to draw by hand.
"""

from __future__ import annotations

import pytest

from minipar.model import get_config
from minipar.parallel.pp import partition_layers
from minipar.parallel.schedules import make_schedule
from minipar.theory.bubble import (
    bubble_stats,
    chunk_flops,
    chunk_weights,
    measured_cost_bubble,
    simulate,
    stage_cost_bubble,
)
from minipar.theory.params import (
    hardware_flops_per_token,
    head_flops_per_token,
    layer_flops_per_token,
)

LAYOUTS = [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2),
           ("interleaved", 4, 8, 2), ("zb", 4, 8, 1)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: "-".join(map(str, t)))
def test_unit_weights_reproduce_the_unit_simulation(layout):
    name, pp, m, v = layout
    actions = make_schedule(name, pp, m, v)
    assert simulate(actions, chunk_weight=[1.0] * (pp * v)) == simulate(actions)
    assert stage_cost_bubble(name, pp, m, v) == bubble_stats(simulate(actions))[
        "bubble_fraction"]


def test_heavier_last_stage_by_hand():
    """pp 2, m 2, 1F1B, chunk weights [1, 2]: rank 1 runs F = 2, B = 4.

    rank 0: F0 0-1, F1 1-2, (waits for rank 1's B0) B0 7-9, (waits) B1 13-15
    rank 1: F0 1-3, B0 3-7, F1 7-9, B1 9-13
    Step 15, busy 6 + 12 = 18, idle 2 * 15 - 18 = 12: bubble 12 / 30 = 0.4, against
    (p - 1) / (m + p - 1) = 1/3 with equal stages (step 9). In general, when the last
    stage is the slowest, 1F1B's step is its m (F + B) plus one F and one B of every
    other stage: 3 (m w_last + sum of the other weights).
    """
    timeline = simulate(make_schedule("1f1b", 2, 2), chunk_weight=[1.0, 2.0])
    stats = bubble_stats(timeline)
    assert stats["step_time"] == pytest.approx(15.0)
    assert stats["busy"] == pytest.approx(18.0)
    assert stats["bubble_fraction"] == pytest.approx(0.4)
    assert stage_cost_bubble("1f1b", 2, 2) == pytest.approx(1 / 3)
    assert [(s.kind, s.mb, s.start, s.end) for s in timeline[0]] == [
        ("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 7, 9), ("B", 1, 13, 15)]


def test_wrong_number_of_weights_is_refused():
    with pytest.raises(ValueError, match="chunk_weight"):
        simulate(make_schedule("1f1b", 2, 2), chunk_weight=[1.0])


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("pp,virtual", [(1, 1), (2, 1), (4, 1), (4, 2), (3, 1)])
@pytest.mark.parametrize("n_layer", [24, 26])
def test_chunk_flops_sum_to_the_model(pp, virtual, recompute, n_layer):
    cfg = get_config("gpt-1.3b").with_(n_layer=n_layer)
    flops = chunk_flops(cfg, pp, virtual, recompute)
    assert sum(flops) == pytest.approx(hardware_flops_per_token(cfg, recompute))
    weights = chunk_weights(cfg, pp, virtual, recompute)
    mean = sum(flops) / len(flops)
    assert sum(weights) / len(weights) == pytest.approx(1.0)
    assert [w * mean for w in weights] == pytest.approx(flops)
    # uneven splits (26 layers over 4 chunks: 7 7 6 6) follow the pipeline's own partition
    layer = layer_flops_per_token(cfg, recompute)
    sizes = [len(r) for r in partition_layers(cfg.n_layer, pp * virtual)]
    assert flops[:-1] == pytest.approx([n * layer for n in sizes[:-1]])


def test_gpt_1_3b_last_chunk_carries_the_head():
    cfg = get_config("gpt-1.3b")
    flops = chunk_flops(cfg, 4)
    weights = chunk_weights(cfg, 4)
    head_in_layers = head_flops_per_token(cfg) / layer_flops_per_token(cfg)
    assert 1.7 < head_in_layers < 1.8  # 6 V h against 72 h^2 + 12 s h a token
    assert flops[-1] - flops[1] == pytest.approx(head_flops_per_token(cfg))
    assert weights[-1] / weights[1] == pytest.approx(1 + head_in_layers / 6)  # 6 layers
    assert weights[0] == weights[1] == weights[2] < weights[3]


def test_stage_costs_widen_every_schedules_bubble():
    cfg = get_config("gpt-1.3b")
    for name, pp, m, v in [("1f1b", 4, 16, 1), ("zb", 4, 16, 1), ("interleaved", 4, 16, 2),
                           ("1f1b", 2, 8, 1), ("zb", 2, 8, 1)]:
        weighted = stage_cost_bubble(name, pp, m, v, chunk_weights(cfg, pp, v))
        assert weighted > stage_cost_bubble(name, pp, m, v) + 0.04
    # the 1F1B step with the last stage slowest, as in the hand-drawn case above
    w = chunk_weights(cfg, 4)
    step = bubble_stats(simulate(make_schedule("1f1b", 4, 16), chunk_weight=w))["step_time"]
    assert step == pytest.approx(3 * (16 * w[-1] + sum(w[:-1])))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: "-".join(map(str, t)))
def test_a_timeline_replayed_with_its_own_costs_gives_its_own_bubble(layout):
    """``measured_cost_bubble`` re-simulates a schedule with every action at the time it
    took: fed a simulated (idle only where the schedule waits) weighted timeline, it
    returns that timeline's bubble; a send that takes time can only add to it."""
    name, pp, m, v = layout
    weights = [1.0 + 0.3 * c for c in range(pp * v)]
    timeline = simulate(make_schedule(name, pp, m, v), chunk_weight=weights)
    own = bubble_stats(timeline)["bubble_fraction"]
    assert measured_cost_bubble(name, pp, m, v, timeline) == pytest.approx(own)
    assert measured_cost_bubble(name, pp, m, v, timeline, p2p=0.2) > own


def test_waiting_the_schedule_does_not_explain_is_left_out():
    """A measured rank that idles before every action (a launch gap, say) has a larger
    bubble than its actions' costs imply: the replay drops the gaps."""
    timeline = simulate(make_schedule("1f1b", 2, 4))
    gapped = [[s._replace(start=s.start + 0.5 * i, end=s.end + 0.5 * i)
               for i, s in enumerate(row)] for row in timeline]
    assert bubble_stats(gapped)["bubble_fraction"] > bubble_stats(timeline)[
        "bubble_fraction"] + 0.05
    assert measured_cost_bubble("1f1b", 2, 4, 1, gapped) == pytest.approx(
        bubble_stats(timeline)["bubble_fraction"])
