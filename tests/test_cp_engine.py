"""Context parallelism and ZeRO-Offload in the engine: parity on gradients.

Every layout with ``cp`` > 1 (each sequence split over cp ranks, ring attention) must
reproduce ``train_reference`` on losses, per-step gradient norms and final parameters
(``test_engine.assert_parity``, the same tolerances), alone, with dp, tp (and sp), pp,
ZeRO 1 and 3, dropout, and the 8-rank cp 2 x tp 2 x pp 2 of issue 20; plain SGD without
clipping included. The mutations show the check catches the two classic cp errors: the
loss scaled by 1/(dp * m) instead of 1/(dp * cp * m) (a shard's mean treated as the
batch's), and gradients not summed over cp (the data-parallel group left at dp).
``--offload`` (fp32 masters, states and step on the host) must match too.
"""

from __future__ import annotations

import pytest
from test_engine import BF16, FP32, SGD, assert_parity, full_only, reference

from minipar import mesh
from minipar import step as step_module
from minipar.config import TrainConfig
from minipar.engine import train
from minipar.parity import compare

CP_COVERING = [
    dict(cp=2),
    dict(cp=4),
    dict(cp=2, dp=2, microbatches=2),
    dict(cp=2, tp=2),
    dict(cp=2, tp=2, sp=True, dropout=0.1),
    dict(cp=2, pp=2, microbatches=2),
    dict(cp=2, tp=2, pp=2, microbatches=2),  # the done-criterion layout
    dict(cp=2, dp=2, zero=1),
    dict(cp=2, dp=2, zero=3, dropout=0.1),
    dict(cp=4, dp=2, zero=2, microbatches=2, order="pp-inside-dp"),
    dict(cp=2, pp=2, schedule="zb", microbatches=2, recompute="selective"),
]


def _id(d: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in d.items())


# make test-full only: cp 2 x tp 2 and cp 2 x pp 2 run inside cp 2 x tp 2 x pp 2 (and
# tp 2 + sp, zb pp 2) of the same list; cp 4 alone is cp 2's ring on 4 ranks. cp 2 x tp 2
# x pp 2 itself runs under plain SGD below and under AdamW with offload and ZeRO-1
# (test_offload_matches_single_device); cp x dp with micro-batches under plain SGD with
# ZeRO-2 below, cp x dp under AdamW with ZeRO-1 and 3 here. The 8-rank cp 4 x dp 2 ZeRO-2:
# cp 4's ring is at parity with one device, outputs and gradients, in test_cp.py and its
# bytes are counted in a cp 4 run below; ZeRO-2 with cp under plain SGD below; the
# pp-inside-dp groups with cp in test_mesh.py.
CP_FULL_ONLY = [dict(cp=2, tp=2), dict(cp=2, pp=2, microbatches=2), dict(cp=4),
                dict(cp=2, tp=2, pp=2, microbatches=2), dict(cp=2, dp=2, microbatches=2),
                dict(cp=4, dp=2, zero=2, microbatches=2, order="pp-inside-dp")]


@pytest.mark.parametrize("layout", full_only(CP_COVERING, CP_FULL_ONLY), ids=_id)
def test_cp_layout_matches_single_device(layout: dict) -> None:
    assert_parity(**layout)


@pytest.mark.parametrize("layout", [dict(cp=2), dict(cp=2, dp=2, zero=2, microbatches=2),
                                    dict(cp=2, tp=2, pp=2, microbatches=2)], ids=_id)
def test_cp_plain_sgd_without_clipping_matches(layout: dict) -> None:
    assert_parity(**layout, **SGD)


def test_cp_bf16_tracks_fp32() -> None:
    assert_parity(BF16, cp=2, dp=2, zero=1, dtype="bf16")


def test_cp_ring_bytes_are_counted_and_evaluation_sees_every_shard() -> None:
    run = assert_parity(cp=2, eval_every=5)
    for r in run["ranks"]:
        assert r["coords"]["cp"] in (0, 1) and r["comm"]["cp"]
        assert "dp_cp" in r["comm"]  # the gradient sum over the cp replicas
    from minipar.engine import train_reference

    ref = train_reference(TrainConfig(steps=5, eval_every=5))
    assert run["eval"][0]["loss"] == pytest.approx(ref["eval"][0]["loss"], abs=1e-5)


# --- mutations: the check must fail ---------------------------------------------------
def _broken(monkeypatch, mutation: str) -> None:
    if mutation == "loss over the local tokens":  # 1/(dp m): forgets the cp shards
        monkeypatch.setattr(step_module, "loss_scale",
                            lambda cfg: 1.0 / (cfg.dp * cfg.microbatches))
    else:  # the data-parallel layer sums over dp only: cp replicas drift apart
        monkeypatch.setattr(mesh.RankMesh, "dp_cp", property(lambda self: self.comms["dp"]))


@pytest.mark.parametrize("mutation", ["loss over the local tokens", "no sum over cp"])
def test_cp_mutations_fail_the_check(monkeypatch, mutation: str) -> None:
    cfg = TrainConfig(steps=3, timeout=240, cp=2, **SGD)
    ref = reference(**SGD)
    ref = {k: v[:3] for k, v in ref.items() if k in ("losses", "grad_norms")}
    assert compare(train(cfg), ref).ok(FP32)
    _broken(monkeypatch, mutation)
    broken = compare(train(cfg), ref)
    assert not broken.ok(FP32), f"{mutation} passed the check: {broken.describe()}"


# --- ZeRO-Offload -----------------------------------------------------------------------
OFFLOAD = [
    dict(offload=True),
    dict(offload=True, dp=2, microbatches=2),
    dict(offload=True, dp=2, zero=1),
    dict(offload=True, dp=2, zero=2, microbatches=2),
    dict(offload=True, cp=2, tp=2, pp=2, microbatches=2, zero=1),
]


@pytest.mark.parametrize("layout", OFFLOAD, ids=_id)
def test_offload_matches_single_device(layout: dict) -> None:
    run = assert_parity(**layout)
    for r in run["ranks"]:  # the states live on the host, not in the device's count
        assert r["memory"]["host_optimizer"] > 0
        if layout.get("zero", 0) == 0:  # fp32, stage 0: the master is the weights
            assert r["memory"]["optimizer"] == 0


@pytest.mark.parametrize("layout", [dict(offload=True, dp=2, zero=1),
                                    dict(offload=True, dp=2, zero=2)], ids=_id)
def test_offload_plain_sgd_and_bf16(layout: dict) -> None:
    assert_parity(**layout, **SGD)
    assert_parity(BF16, dtype="bf16", **layout)


def test_offload_mutation_fails_the_check(monkeypatch) -> None:
    """Host gradients never zeroed: each step adds the previous ones (a classic offload
    bug: the host accumulator outlives the device's zero_grad)."""
    from minipar.parallel.zero.offload import OnHost

    cfg = TrainConfig(steps=3, timeout=240, offload=True, dp=2, zero=1, **SGD)
    ref = {k: v[:3] for k, v in reference(**SGD).items() if k in ("losses", "grad_norms")}
    kept: dict = {}
    land = OnHost.land

    def land_never_zeroed(self, i):  # the step's gradient adds to all earlier ones
        master = self._in_flight[i][1] if i in self._in_flight else None
        land(self, i)
        if master is not None:  # (zero=1: one landing per flat and step)
            kept[i] = kept.get(i, 0) + master.grad
            master.grad.copy_(kept[i])

    monkeypatch.setattr(OnHost, "land", land_never_zeroed)
    broken = compare(train(cfg), ref)
    assert not broken.ok(FP32), broken.describe()


@pytest.mark.parametrize("layout", [dict(cp=2, tp=2, microbatches=2),
                                    dict(cp=4, recompute="selective"),
                                    dict(cp=2, recompute="cheap")], ids=_id)
def test_counted_ring_bytes_equal_the_theory(layout: dict) -> None:
    """Every ring message of a real run, counted under ``cp``, equals
    ``theory.comm_volume``'s prediction (the per-layer ``theory.context.ring_bytes``;
    a selectively recomputed block runs its forward ring again, a cheaply recomputed one
    does not)."""
    from minipar.theory.comm_volume import comm_volume

    steps = 2
    cfg = TrainConfig(steps=steps, timeout=240, **layout)
    run = train(cfg)
    predicted = comm_volume(cfg.model_config(), cfg.layout())["cp"]
    for r in run["ranks"]:
        measured = {op: {k: x[k] // steps for k in ("calls", "bytes", "wire_bytes")}
                    for op, x in r["comm"]["cp"].items()}
        assert measured == predicted


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_offload_traffic_equals_the_theory(zero: int) -> None:
    """The host <-> device bytes a step moves (the engine's ``offload_bytes``) are
    ``theory.offload.zero_offload_traffic`` of the parameters this rank holds (up to
    the flat buffers' padding, a few elements per bucket): the fp32 gradient shard down,
    the updated shard up in the compute dtype (fp32 here)."""
    from minipar.model import GPT
    from minipar.theory.offload import zero_offload_traffic

    cfg = TrainConfig(steps=1, timeout=240, offload=True, dp=2, zero=zero)
    run = train(cfg)
    n = GPT(cfg.model_config()).num_params()
    want = zero_offload_traffic(n, dp=2, zero=zero, param_bytes=4)
    for r in run["ranks"]:
        got = r["offload_bytes"]
        for k in ("to_host", "to_device"):
            assert got[k] == pytest.approx(want[k], rel=2e-3)
