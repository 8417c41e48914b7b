"""The parity check itself: it must fail on a wrong gradient, and say why.

A check that cannot fail is a defect. These tests inject the classic scaling bugs into
real multi-process runs (the mutation is applied in the parent before the ranks fork,
so every rank inherits it) and assert that ``minipar.parity.compare`` rejects the run
at the tolerances the engine tests use, and that ``audit`` names the factor:

* every micro-batch loss multiplied by dp (the 1/dp of the data-parallel mean forgotten);
* every micro-batch loss multiplied by m (the 1/m of gradient accumulation forgotten),
  on the pipeline path (pp = 2) where it is the best-known silent bug;
* the same bugs under AdamW with clipping, where the *losses* stay within tolerance for
  the first steps and only the gradient norm shows the error.

Plain SGD without clipping is the case where a scale error reaches the weights.
"""

from __future__ import annotations

import math

import pytest

from minipar.config import TrainConfig
from minipar.engine import train, train_reference
from minipar.parallel import pp as pp_module
from minipar.parity import TOLERANCES, audit, compare

FP32 = TOLERANCES["fp32"]  # the engine tests' tolerances


def _scaled_executor(monkeypatch, factor: float) -> None:
    """Mutation: every micro-batch loss scaled by ``factor`` more than it should be."""
    original = pp_module.PipelineExecutor.step

    def step(self, microbatches, loss_scale=None, **kwargs):
        scale = (1.0 / len(microbatches)) if loss_scale is None else loss_scale
        return original(self, microbatches, loss_scale=scale * factor, **kwargs)

    monkeypatch.setattr(pp_module.PipelineExecutor, "step", step)


SGD = dict(optimizer="sgd", grad_clip=0.0, lr=0.5, warmup=1)


@pytest.mark.parametrize("knobs", [SGD, {}], ids=["sgd-noclip", "adamw-clip"])
@pytest.mark.parametrize("layout,factor,word", [
    (dict(dp=2), 2, "dp"),
    (dict(pp=2, microbatches=4), 4, "microbatches"),
], ids=["x dp", "pipeline x m"])
def test_scale_error_fails_the_check(monkeypatch, layout, factor, word, knobs) -> None:
    cfg = TrainConfig(steps=3, timeout=240, **layout, **knobs)
    ref = train_reference(cfg)
    healthy = compare(train(cfg), ref)
    assert healthy.ok(FP32), healthy.describe()
    _scaled_executor(monkeypatch, factor)
    broken = compare(train(cfg), ref)
    assert not broken.ok(FP32), f"a {factor}x gradient passed: {broken}"
    assert broken.grad_ratios[0] == pytest.approx(factor, rel=1e-4)  # same weights at step 0
    line = audit(broken.grad_ratios, {"dp": cfg.dp, "microbatches": cfg.microbatches,
                                      "pp": cfg.pp, "tp": cfg.tp})
    assert line is not None and f"= {word}" in line, line


def test_sgd_scale_error_reaches_the_losses(monkeypatch) -> None:
    """Without AdamW's normalisation the weights move m times too far: losses differ."""
    cfg = TrainConfig(steps=3, timeout=240, microbatches=2, **SGD)
    ref = train_reference(cfg)
    _scaled_executor(monkeypatch, 2)
    assert compare(train(cfg), ref).loss_diff > 100 * FP32.loss


def _record(losses, norms) -> dict:
    return {"losses": losses, "ranks": [{"grad_norms": norms}]}


def test_compare_reports_each_difference() -> None:
    ref = {"losses": [4.0, 3.0], "grad_norms": [2.0, 1.0]}
    p = compare(_record([4.0, 3.001], [2.0, 1.1]), ref)
    assert p.loss_diff == pytest.approx(1e-3)
    assert p.grad_norm_rel == pytest.approx(0.1)
    assert not p.ok(1e-4, 1e-4) and p.ok(2e-3, 0.2)
    assert compare(_record([4.0], [2.0]), ref).loss_diff == math.inf  # a step missing


@pytest.mark.parametrize("ratio,layout,expected", [
    (4.0, {"dp": 1, "microbatches": 4, "pp": 2, "tp": 1},
     "gradients are 4x the reference: 4 = microbatches; is each micro-batch loss divided "
     "by m?"),
    (0.5, {"dp": 2, "microbatches": 1, "pp": 1, "tp": 1},
     "gradients are 0.5x the reference: 0.5 = 1/dp; is the loss (or the reduced gradient) "
     "divided by the data-parallel size?"),
    (8.0, {"dp": 2, "microbatches": 4, "pp": 1, "tp": 1}, "= (dp x microbatches)"),
    (1.0, {"dp": 2, "microbatches": 4, "pp": 1, "tp": 1}, None),  # agrees
    (3.0, {"dp": 2, "microbatches": 4, "pp": 1, "tp": 1}, None),  # no simple factor
])
def test_audit_names_the_factor(ratio, layout, expected) -> None:
    line = audit([ratio * (1 + 1e-4 * i) for i in range(3)], layout)
    if expected is None:
        assert line is None
    else:
        assert line is not None and expected in line, line


def test_audit_reads_the_first_step() -> None:
    """Later steps mix in the weights' divergence; the first is the scale error alone."""
    layout = {"dp": 2, "microbatches": 2, "pp": 1, "tp": 1}
    assert "= dp" in audit([2.0, 2.7, 3.9], layout)
    assert audit([1.0, 2.0, 4.0], layout) is None


def test_a_wrong_recomputation_fails_the_check(monkeypatch) -> None:
    """Cheap recomputation makes the layer norms' and GELU's outputs again in the
    backward; made 1% too large (the mutation), the weight gradients they feed are wrong
    and the check rejects the run, which it passes as written."""
    from minipar.parallel import recompute

    cfg = TrainConfig(steps=3, timeout=240, dp=2, recompute="cheap", **SGD)
    ref = train_reference(cfg)
    assert compare(train(cfg), ref).ok(FP32)
    hooks = recompute.recipe_hooks

    def one_percent_off(noted):
        pack, unpack = hooks(noted)
        return pack, lambda recipe: unpack(recipe) * 1.01
    monkeypatch.setattr(recompute, "recipe_hooks", one_percent_off)
    broken = compare(train(cfg), ref)
    assert not broken.ok(FP32), broken.describe()
