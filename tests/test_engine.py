"""Parity of the 3-D engine with the plain single-device loop, on gradients.

Every layout must reproduce ``train_reference`` (same model, same data, same optimizer,
one process, no minipar machinery): the loss of every step, the global gradient norm
before clipping of every step, and every final parameter (gathered through a
checkpoint). Tolerances: ``minipar.parity.TOLERANCES``, about 3x the worst drift
measured over these layouts with dropout and tied embeddings (fp32: loss 7.2e-7, grad
8.5e-6 relative, parameters 2.7e-5; bf16: 2.0e-3, 2.0e-2, 5.4e-3;
``benchmarks/parity_drift.py``). The covering
set includes plain SGD without clipping, where a gradient-scale error reaches the
weights; ``tests/test_parity.py`` proves the check fails on such errors. CI runs the
covering subset below; ``--full`` runs every dp x pp x tp factorization of 1, 2, 4
and 8 ranks with every ZeRO stage and schedule.
"""

from __future__ import annotations

import itertools
import tempfile
from functools import cache

import pytest

from minipar.config import TrainConfig
from minipar.engine import train, train_reference
from minipar.parity import (
    TOLERANCES,
    Tolerance,
    compare,
    final_parameters,
    run_grad_norms,
)

STEPS = 5
FP32, BF16 = TOLERANCES["fp32"], TOLERANCES["bf16"]  # measured drift x ~3 (see there)
# what the reference run must share with the layout (the rest is layout)
REFERENCE_KNOBS = ("optimizer", "grad_clip", "lr", "warmup", "dropout", "weight_decay",
                   "overrides", "batch_size")
LOSS_DROP = {"adamw": 0.3, "sgd": 0.02}  # the loss must visibly fall in 5 steps
# Plain SGD, no clipping, no warm-up: nothing normalises a gradient's scale away.
SGD = dict(optimizer="sgd", grad_clip=0.0, lr=0.5, warmup=1)


@cache
def _reference(knobs: tuple) -> dict:
    cfg = TrainConfig(steps=STEPS, **{k: dict(v) if k == "overrides" else v for k, v in knobs})
    ref = train_reference(cfg)
    return {"losses": ref["losses"], "grad_norms": ref["grad_norms"],
            "params": {k: v.detach().float() for k, v in ref["model"].state_dict().items()}}


def reference(**knobs) -> dict:
    """The single-device run with the same model, data and optimizer knobs (cached)."""
    return _reference(tuple(sorted((k, tuple(sorted(v.items())) if k == "overrides" else v)
                                   for k, v in knobs.items())))


def assert_parity(tol: Tolerance = FP32, **layout) -> dict:
    """Train ``layout`` and require the reference's losses, gradient norms and weights."""
    knobs = {k: layout.pop(k) for k in list(layout) if k in REFERENCE_KNOBS}
    with tempfile.TemporaryDirectory() as save:
        cfg = TrainConfig(steps=STEPS, timeout=240, save=save, **layout, **knobs)
        run = train(cfg)
        params = final_parameters(save)
    ref = reference(**knobs)
    assert len(run["losses"]) == STEPS
    parity = compare(run, ref, params, ref["params"])
    assert parity.ok(tol), (
        f"{layout}: {parity.describe()}; losses {run['losses']} vs {ref['losses']}; "
        f"grad norms {run_grad_norms(run)} vs {ref['grad_norms']}")
    assert run["losses"][-1] < run["losses"][0] - LOSS_DROP[knobs.get("optimizer", "adamw")]
    run["parity"] = parity
    return run


COVERING = [
    dict(dp=2),
    dict(dp=2, ddp="naive", microbatches=2),
    dict(dp=4, ddp="bucketed"),
    dict(dp=2, zero=1),
    dict(dp=2, zero=2, microbatches=2),
    dict(dp=4, zero=3),
    dict(tp=2),
    dict(tp=4, sp=True),
    dict(tp=8),
    dict(pp=2, schedule="gpipe", microbatches=4),
    dict(pp=4, schedule="1f1b", microbatches=4),
    dict(pp=2, schedule="interleaved", virtual=2, microbatches=4),
    dict(pp=4, schedule="zb", microbatches=2),
    dict(dp=2, pp=2, tp=2, microbatches=2, zero=1),
    dict(dp=2, pp=2, tp=2, microbatches=2, zero=2, sp=True, schedule="zb"),
    dict(dp=2, pp=2, tp=2, microbatches=4, zero=3, schedule="interleaved", virtual=2),
    # ZeRO-3 with both kinds of shared weights: sp's norms (summed over tp) and the tied
    # embedding's two copies (over the embedding group), each kind a flat of its own
    dict(dp=2, pp=2, tp=2, microbatches=2, zero=3, sp=True, overrides={"tie_embeddings": True}),
    dict(dp=2, pp=2, tp=2, microbatches=2, order="pp-inside-dp", recompute="full"),
    dict(tp=2, pp=2, microbatches=2, recompute="selective"),
    # cheap recomputation: ZeRO-3 gathers each unit around its backward, where the layer
    # norms are made again (here the blocks past the first, which recomputes fully); sp's
    # linears save their sequence shard, a layer norm's output
    dict(dp=2, zero=3, microbatches=2, recompute="full", recompute_layers=1,
         recompute_rest="cheap"),
    dict(tp=2, sp=True, pp=2, microbatches=2, recompute="cheap", recompute_layers=1),
    # W runs each module on its own graph and reads inputs a cheap recipe makes again
    dict(pp=2, schedule="zb", microbatches=2, recompute="cheap"),
    # the weight passes deferred on interleaved chunks, ZeRO-1 over their replicas
    dict(dp=2, pp=2, microbatches=4, zero=1, schedule="interleaved-zb", virtual=2,
         recompute="cheap"),
]


# make test-full only, each proved in make test by another case on the same code path:
# ZeRO-1/2 at dp 2 under AdamW (the 3-D ZeRO-1 and ZeRO-2 layouts above; the same
# layouts under plain SGD below), ZeRO-3 at dp 4 (the 3-D ZeRO-3 layout; dp 4 in
# test_zero.py), tp 2 (test_tp.py; plain SGD in test_parity_tp_pp.py), tp 8 (tp 4's
# sharding on 8 ranks), 1F1B at pp 4 (test_pp.py runs every schedule at pp 4; zb here).
COVERING_FULL_ONLY = [dict(dp=2, zero=1), dict(dp=2, zero=2, microbatches=2),
                      dict(dp=4, zero=3), dict(tp=2), dict(tp=8),
                      dict(pp=4, schedule="1f1b", microbatches=4)]


def full_only(layouts: list[dict], slow: list[dict]) -> list:
    """``layouts`` for parametrize, those in ``slow`` marked for make test-full."""
    return [pytest.param(d, marks=pytest.mark.slow) if d in slow else d for d in layouts]


@pytest.mark.parametrize("layout", full_only(COVERING, COVERING_FULL_ONLY),
                         ids=lambda d: " ".join(f"{k}={v}" for k, v in d.items()))
def test_layout_matches_single_device(layout: dict) -> None:
    assert_parity(**layout)


SGD_COVERING = [
    dict(dp=2, microbatches=2),
    dict(pp=2, schedule="interleaved", virtual=2, microbatches=4, recompute="cheap"),
    dict(dp=2, zero=1),
    dict(dp=2, zero=2, microbatches=2),
    dict(dp=2, zero=3, microbatches=2),
    # the reduce-scatters on a communicator of their own, beside the all-gathers
    dict(dp=2, zero=3, microbatches=2, separate_reduce_group=True),
    dict(tp=2, sp=True),
    dict(pp=2, schedule="1f1b", microbatches=4),
    dict(pp=2, schedule="zb", microbatches=2),
    dict(pp=2, schedule="interleaved-zb", virtual=2, microbatches=4, head_layers=1),
    dict(pp=2, microbatches=4, head_layers=1),  # balanced stages: the last one shorter
    dict(dp=2, pp=2, tp=2, microbatches=2, zero=1, schedule="interleaved", virtual=2),
]


# make test-full only: data parallelism alone at dp 2 under plain SGD, ZeRO 0-3 with two
# micro-batches, is test_dp_engine.py's test_plain_sgd_parity_every_zero_stage (the same
# runs and comparisons, with tighter tolerances).
SGD_FULL_ONLY = [dict(dp=2, microbatches=2), dict(dp=2, zero=1),
                 dict(dp=2, zero=2, microbatches=2), dict(dp=2, zero=3, microbatches=2)]


@pytest.mark.parametrize("layout", full_only(SGD_COVERING, SGD_FULL_ONLY), ids=lambda d: " ".join(
    f"{k}={v}" for k, v in d.items()))
def test_plain_sgd_without_clipping_matches(layout: dict) -> None:
    assert_parity(**layout, **SGD)


@pytest.mark.parametrize("layout", [dict(dp=2, tp=2, zero=1), dict(pp=2, microbatches=2),
                                    dict(dp=2, zero=3),
                                    # the fused weight-gradient linears save a recipe
                                    dict(dp=2, zero=1, recompute="cheap")],
                         ids=lambda d: " ".join(f"{k}={v}" for k, v in d.items()))
def test_bf16_mixed_precision_tracks_fp32(layout: dict) -> None:
    assert_parity(BF16, dtype="bf16", **layout)


@pytest.mark.parametrize("layout", [dict(pp=2, microbatches=4), dict(dp=2, zero=1,
                                    microbatches=2), dict(dp=2, zero=3, microbatches=2)],
                         ids=lambda d: " ".join(f"{k}={v}" for k, v in d.items()))
def test_bf16_gradient_sums_track_fp32(layout: dict) -> None:
    """``--grad-dtype bf16`` (micro-batch gradients summed and reduced in bf16, as
    torch's peers do) stays within the bf16 tolerance. Measured here: loss 7.6e-4 /
    4.8e-4 / 5.9e-4, grad 2.7e-3 / 6.5e-3 / 6.0e-3 (fp32 sums: 5.6e-4, 6.5e-3)."""
    assert_parity(BF16, dtype="bf16", grad_dtype="bf16", **layout)


def test_bf16_gradient_sums_hold_half_the_buffer() -> None:
    """ZeRO-1 at dp 2 keeps the full gradient buffer (bf16: 2 bytes a parameter, not 4)
    beside the fp32 master gradient shard (4 / dp): (2 + 2) / (4 + 2) of the fp32 run."""
    held = {g: train(TrainConfig(dp=2, zero=1, dtype="bf16", grad_dtype=g, steps=2,
                                 timeout=240))["ranks"][0]["memory"]["grads"]
            for g in ("fp32", "bf16")}
    assert held["bf16"] == pytest.approx(held["fp32"] * 4 / 6, rel=0.01), held


def test_run_reports_memory_comm_and_timeline() -> None:
    run = assert_parity(dp=2, pp=2, microbatches=2, measure_activations=True)
    assert [r["rank"] for r in run["ranks"]] == [0, 1, 2, 3]
    for r in run["ranks"]:
        assert r["memory"]["params"] > 0 and r["memory"]["optimizer"] > 0
        assert r["memory"]["activations"] > 0
        assert "dp" in r["comm"] and "pp" in r["comm"]
        kinds = [e["kind"] for e in r["timeline"]]
        assert kinds.count("F") == 2 and kinds.count("B") == 2


def test_zero3_gathers_a_units_shared_weights_in_one_call() -> None:
    """Under sp a block's norms are summed over tp after the dp reduction: ZeRO-3 keeps
    them in a flat of their own, one per unit (not one per weight: 61 gathers a pass on
    this model, against 20), so each unit costs two gathers and one reduction a pass."""
    cfg = TrainConfig(tp=2, dp=2, zero=3, sp=True, steps=2, microbatches=2, batch_size=4)
    comm = train(cfg)["ranks"][0]["comm"]["dp"]
    passes = cfg.steps * cfg.microbatches
    units = 2 * cfg.model_config().n_layer + 4  # a block: its weights, its norms; + 4 outside
    assert comm["all_gather"]["calls"] == 2 * units * passes
    assert comm["reduce_scatter"]["calls"] == units * passes


def _all_layouts():
    """Every dp x pp x tp of 1-8 ranks x ZeRO 0-3 x every schedule (at pp = 1 too), then
    tied embeddings, dropout and plain SGD on the 3-D layouts. Only what ``validate``
    refuses before launch is left out (each refusal is tried in tests/test_errors.py)."""
    from minipar.config import validate

    def accepted(layout: dict) -> bool:
        try:
            validate(TrainConfig(**layout))
        except ValueError:
            return False
        return True

    base = []
    for world in (1, 2, 4, 8):
        for tp, pp in itertools.product((1, 2, 4, 8), repeat=2):
            if world % (tp * pp):
                continue
            for zero in (0, 1, 2, 3):
                for sched in ("gpipe", "1f1b", "interleaved", "zb"):
                    virtual = 2 if sched == "interleaved" and pp > 1 else 1
                    base.append(dict(dp=world // (tp * pp), pp=pp, tp=tp, zero=zero,
                                     schedule=sched, virtual=virtual,
                                     microbatches=2 * pp if pp > 1 else 2))
    extras = [dict(overrides={"tie_embeddings": True}), dict(overrides={"dropout": 0.1}), SGD]
    for layout in base:
        if accepted(layout):
            yield layout
    for layout, extra in itertools.product(base, extras):
        if layout["dp"] * layout["pp"] * layout["tp"] == 8 or layout["pp"] == 2:
            if accepted({**layout, **extra}):
                yield {**layout, **extra}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(_all_layouts()),
                         ids=lambda d: " ".join(f"{k}={v}" for k, v in d.items()))
def test_full_parity_matrix(layout: dict) -> None:
    assert_parity(**layout)


def activation_drop(keeping: dict, cheap: dict) -> tuple[int, int]:
    """The stored activations one step's meter no longer sees going from ``keeping`` to
    ``cheap`` (two layouts), and what the memory model says of the same two."""
    from minipar.theory.memory import memory_per_stage

    measured, modelled = [], []
    for layout in (keeping, cheap):
        cfg = TrainConfig(steps=1, measure_activations=True, timeout=240, **layout)
        measured.append(train(cfg)["ranks"][0]["memory"]["activations"])
        modelled.append(memory_per_stage(cfg.model_config(), cfg.layout(),
                                         accounting="fused")[0]["activations"])
    return measured[0] - measured[1], modelled[0] - modelled[1]


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, sp=True), dict(cp=2),
                                    dict(dtype="bf16")],
                         ids=lambda d: " ".join(f"{k}={v}" for k, v in d.items()))
def test_cheap_recomputation_drops_what_the_memory_model_drops(layout: dict) -> None:
    """Under tp (the layer norms' outputs whole on every rank, or a sequence shard with
    sp), cp and bf16 (the fused weight-gradient linears): the bytes the meter stops
    seeing are the memory model's, exactly (measured: 3.0 to 4.0 MiB of 8.3 to 10.5).
    Not under zb: its split runs each module on a detached input, a leaf of the
    module's graph that holds it till W whatever is saved; what a rank holds there is
    rehearsed (``test_rehearse``)."""
    measured, modelled = activation_drop(layout, {**layout, "recompute": "cheap"})
    assert measured == modelled > 0


def test_the_rest_recomputes_cheaply() -> None:
    """``--recompute full --recompute-layers 1 --recompute-rest cheap``: the first block of
    each chunk recomputes everything, the others their layer norms' and GELU's outputs;
    the meter's bytes against the same without the rest, as the memory model says."""
    partial = dict(recompute="full", recompute_layers=1)
    measured, modelled = activation_drop(partial, {**partial, "recompute_rest": "cheap"})
    assert measured == modelled > 0


def test_recomputation_saves_measured_activation_memory() -> None:
    """Full recomputation keeps only each block's input (Chen et al. 2016); with fused
    attention selective recomputation saves little (no s x s scores are stored anyway);
    cheap recomputation keeps neither layer norm's output nor GELU's: the meter (which
    sees what the block hands on to it) measures exactly the bytes the memory model
    drops, ``CHEAP_TO_RECOMPUTE`` of every block."""
    from minipar.theory.memory import CHEAP_TO_RECOMPUTE, layer_activations

    peak = {mode: assert_parity(recompute=mode, measure_activations=True
                                )["ranks"][0]["memory"]["activations"]
            for mode in ("none", "selective", "cheap", "full")}
    assert peak["full"] < 0.25 * peak["none"]
    assert peak["full"] < peak["selective"] <= peak["none"]
    cfg = TrainConfig().model_config()
    dropped = layer_activations(cfg, TrainConfig().batch_size, dtype="fp32",
                                accounting="fused")
    assert peak["none"] - peak["cheap"] == cfg.n_layer * sum(
        dropped[item] for item in CHEAP_TO_RECOMPUTE)
