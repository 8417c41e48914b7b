"""Gradient parity of the tensor / pipeline family through the whole engine.

Each run is compared with ``train_reference`` on losses and on the per-step global
gradient norm before clipping (``minipar.parity.compare``). Plain SGD without clipping
is the case where a wrong gradient scale cannot hide: AdamW would divide it away and
clipping would rescale it. Dropout at p = 0.1 must give the reference's numbers in every
layout (masks keyed by global sample and position, ``minipar.model.KeyedDropout``).

Tolerances: ``minipar.parity.TOLERANCES["fp32"]``, about 3x the worst drift measured
over the engine's covering set with dropout and tied embeddings (the worst of all is
dropout under tp 2: loss 7.2e-7, gradient norm 8.5e-6 relative, as AdamW amplifies
summation-order differences step after step; plain SGD: 2.1e-7).
"""

from __future__ import annotations

from functools import cache

import pytest
from test_engine import full_only

from minipar.config import TrainConfig
from minipar.engine import train, train_reference
from minipar.parallel.pp import PipelineExecutor
from minipar.parity import TOLERANCES, compare, run_grad_norms
from minipar.theory.comm_volume import comm_volume
from minipar.theory.layout import Layout

STEPS = 4
LOSS_TOL, GRAD_RTOL = TOLERANCES["fp32"].loss, TOLERANCES["fp32"].grad_rel
SGD = dict(optimizer="sgd", grad_clip=0.0, lr=0.5, warmup=1)
TIED = {"tie_embeddings": True}
# knobs that change what the single device computes (the rest is layout)
REFERENCE_KNOBS = ("optimizer", "grad_clip", "lr", "warmup", "dropout", "overrides")


@cache
def _reference(tied: bool, knobs: tuple) -> dict:
    cfg = TrainConfig(steps=STEPS, **dict(knobs), overrides=TIED if tied else {})
    ref = train_reference(cfg)
    return {"losses": ref["losses"], "grad_norms": ref["grad_norms"]}


def _ref_for(knobs: dict) -> dict:
    """The reference run for these knobs (cached; ``overrides`` here means tied)."""
    knobs = dict(knobs)
    tied = knobs.pop("overrides", None) is not None
    return _reference(tied, tuple(sorted(knobs.items())))


def _run(**layout) -> tuple[dict, dict, object]:
    ref = _ref_for({k: v for k, v in layout.items() if k in REFERENCE_KNOBS})
    run = train(TrainConfig(steps=STEPS, timeout=240, **layout))
    return run, ref, compare(run, ref)


def assert_parity(**layout) -> dict:
    run, ref, parity = _run(**layout)
    assert parity.ok(LOSS_TOL, GRAD_RTOL), (
        f"{layout}: {parity.describe()}; losses {run['losses']} vs {ref['losses']}; "
        f"grad norms {run_grad_norms(run)} vs {ref['grad_norms']}")
    assert run["losses"][-1] < run["losses"][0] - 0.05, "the loss must move"
    return run


SGD_LAYOUTS = [
    dict(tp=2),
    dict(tp=2, sp=True),
    dict(pp=2, schedule="gpipe", microbatches=2),
    dict(pp=2, schedule="1f1b", microbatches=4),
    dict(pp=2, schedule="interleaved", virtual=2, microbatches=2),
    dict(pp=2, schedule="zb", microbatches=2),
    dict(pp=2, tp=2, schedule="zb", microbatches=2, sp=True, overrides=TIED),
    dict(schedule="zb", microbatches=2, overrides=TIED),  # pp = 1: a tie in one chunk
]


# make test-full only: the same layout under the same plain SGD is in test_engine.py's
# SGD_COVERING (tp 2 + sp, 1F1B pp 2 m 4, zb pp 2 m 2; interleaved as its 3-D layout),
# which also compares the final parameters.
SGD_FULL_ONLY = [dict(tp=2, sp=True), dict(pp=2, schedule="1f1b", microbatches=4),
                 dict(pp=2, schedule="zb", microbatches=2),
                 dict(pp=2, schedule="interleaved", virtual=2, microbatches=2)]


@pytest.mark.parametrize("layout", full_only(SGD_LAYOUTS, SGD_FULL_ONLY), ids=lambda d: " ".join(
    f"{k}={v}" for k, v in d.items() if k != "overrides") + (" tied" if "overrides" in d
                                                            else ""))
def test_plain_sgd_no_clipping(layout: dict) -> None:
    assert_parity(**SGD, **layout)


DROPOUT_LAYOUTS = [dict(dp=2), dict(microbatches=2), dict(pp=2, microbatches=2),
                   dict(tp=2), dict(tp=2, sp=True)]


# make test-full only: micro-batches offset the sample index as dp and pp 2 m 2 do.
DROPOUT_FULL_ONLY = [dict(microbatches=2)]


@pytest.mark.parametrize("layout", full_only(DROPOUT_LAYOUTS, DROPOUT_FULL_ONLY),
                         ids=lambda d: " ".join(f"{k}={v}" for k, v in d.items()))
def test_dropout_draws_the_reference_masks(layout: dict) -> None:
    assert_parity(dropout=0.1, **layout)


def test_dropout_really_drops() -> None:
    """Else the dropout parity above would test nothing."""
    with_drop, without = _ref_for({"dropout": 0.1}), _ref_for({})
    assert abs(with_drop["losses"][-1] - without["losses"][-1]) > 1e-2  # seen 3.4e-2
    assert abs(with_drop["grad_norms"][0] / without["grad_norms"][0] - 1) > 1e-2  # 6.5e-2


def test_tied_embeddings_across_stages_with_tp_and_recompute() -> None:
    run = assert_parity(pp=2, tp=2, schedule="interleaved", virtual=2, microbatches=2,
                        recompute="full", overrides=TIED)
    predicted = comm_volume(TrainConfig(overrides=TIED).model_config(),
                            Layout(pp=2, tp=2, microbatches=2, virtual=2, dtype="fp32"),
                            stage=0)["embed"]
    for r in run["ranks"]:  # pp = 2: every rank is on the first or the last stage
        measured = r["comm"]["embed"]["all_reduce"]
        assert measured["calls"] == STEPS * predicted["all_reduce"]["calls"]
        assert measured["bytes"] == STEPS * predicted["all_reduce"]["bytes"]


def test_zero_bubble_moves_the_tp_bytes_of_1f1b() -> None:
    """The W pass computes weight gradients only: no all-gather or reduce-scatter of
    sequence parallelism runs twice (before: 3.28 -> 5.37 MB on tp2 pp2 m2)."""
    runs = {s: train(TrainConfig(steps=1, pp=2, tp=2, sp=True, microbatches=2, schedule=s,
                                 timeout=240)) for s in ("1f1b", "zb")}
    for a, b in zip(runs["1f1b"]["ranks"], runs["zb"]["ranks"]):
        assert a["comm"]["tp"] == {op: {**v, "seconds": a["comm"]["tp"][op]["seconds"]}
                                   for op, v in b["comm"]["tp"].items()}


def _missing_one_over_m(original):
    def step(self, microbatches, loss_scale=None, *args, **kwargs):
        return original(self, microbatches, loss_scale * len(microbatches), *args, **kwargs)
    return step


def test_the_check_fails_on_a_missing_one_over_m(monkeypatch) -> None:
    """Mutation: each micro-batch loss not divided by m (picotron's bug). The ranks are
    forked, so they inherit the patched executor; the parity check must say no."""
    monkeypatch.setattr(PipelineExecutor, "step", _missing_one_over_m(PipelineExecutor.step))
    run, ref, parity = _run(pp=2, schedule="1f1b", microbatches=4, **SGD)
    assert not parity.ok(LOSS_TOL, GRAD_RTOL)
    assert parity.grad_ratios[0] == pytest.approx(4.0, rel=1e-4)  # m x the gradient
