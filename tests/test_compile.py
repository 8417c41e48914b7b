"""Compiled blocks (``parallel/compile.py``) and partial recomputation (``--recompute-layers``).

Compiled blocks train the same model: losses, per-step gradient norms and final
parameters against the single-device reference (``parity.TOLERANCES``), with ZeRO-3's
per-block gathers around the graphs, tensor parallelism's collectives inside them, the
pipeline's chunks, full recomputation around the graph (a checkpoint inside one would
leave the block eager: the fused linear breaks the graph, and dynamo takes a checkpoint
whole or not at all), and plain SGD without clipping.
On CPUs the graphs run through AOTAutograd without generated code (``aot_eager``; the
inductor's C++ build takes minutes here): measured, every run below matches the eager
one bit for bit. The weight-gradient-fusion linear inside a block must stay eager: traced
into the graph, its backward's products were lost (gradient norm 0.79 where 1.95 is right).
Partial recomputation: only the first N blocks of a chunk recompute; the memory model
and a run's measured activations agree on the order none > N of 8 > all.
"""

from __future__ import annotations

import tempfile

import pytest

from minipar.config import TrainConfig, use_compile, validate
from minipar.engine import train, train_reference
from minipar.model import GPT
from minipar.parallel.compile import CompiledBlock, apply_compile
from minipar.parallel.pp import build_stage
from minipar.parallel.recompute import RecomputedBlock, apply_recompute
from minipar.parity import TOLERANCES, compare, final_parameters
from minipar.theory.layout import Layout
from minipar.theory.memory import stage_activations

STEPS = 3
SGD = dict(optimizer="sgd", grad_clip=0.0, lr=0.5, warmup=1)
COMPILED = dict(compile=True, compile_backend="aot_eager")


def _parity(**layout) -> dict:
    knobs = {k: layout.pop(k) for k in list(layout) if k in SGD}
    with tempfile.TemporaryDirectory() as save:
        run = train(TrainConfig(steps=STEPS, timeout=240, save=save, **COMPILED, **layout,
                                **knobs))
        params = final_parameters(save)
    ref = train_reference(TrainConfig(steps=STEPS, **knobs))
    ref_params = {k: v.detach().float() for k, v in ref["model"].state_dict().items()}
    parity = compare(run, ref, params, ref_params)
    assert parity.ok(TOLERANCES["fp32"]), f"{layout}: {parity.describe()}"
    assert all(r["compile"]["blocks"] > 0 and r["compile"]["graphs"] > 0
               for r in run["ranks"])  # it did compile: graphs were captured
    return run


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_compiled_blocks_on_one_rank_match_the_reference(recompute: str) -> None:
    """The fused-weight-gradient linears inside the graph, with and without full
    recomputation (about 10 s each)."""
    _parity(recompute=recompute, **SGD)


@pytest.mark.slow  # 35-46 s each on a loaded 2-core machine: make test-full
@pytest.mark.parametrize("layout", [
    dict(dp=2, zero=3, recompute="full"),  # gathers and the checkpoint around the graph
    dict(tp=2, sp=True),  # collectives inside the graph (graph breaks)
    dict(pp=2, microbatches=2, **SGD),
], ids=lambda d: " ".join(f"{k}={v}" for k, v in d.items()))
def test_compiled_blocks_match_the_reference(layout: dict) -> None:
    _parity(**layout)


def test_compile_keeps_names_and_wraps_recomputed_blocks() -> None:
    model = GPT("tiny", device="meta")
    names = [n for n, _ in model.named_parameters()]
    stages = build_stage(model, 0, 1)
    apply_recompute(stages, "full")
    assert apply_compile(stages, "aot_eager") == model.cfg.n_layer
    blocks = list(stages[0].blocks.values())
    assert all(isinstance(b, CompiledBlock) for b in blocks)
    assert blocks[0].compiled_from == RecomputedBlock.__name__
    assert [n for n, _ in stages[0].named_parameters()] == names


def test_compile_default_and_refusals() -> None:
    assert not use_compile(TrainConfig())  # CPU: eager unless asked
    assert use_compile(TrainConfig(compile=True))
    gpu = dict(backend="nccl")  # CUDA: compiled where it paid, data parallelism alone
    assert use_compile(TrainConfig(dp=4, zero=3, recompute="full", **gpu))
    for eager in (dict(pp=4, microbatches=8), dict(pp=2, schedule="interleaved", virtual=2,
                  microbatches=4), dict(tp=2), dict(cp=2), dict(dropout=0.1),
                  dict(schedule="zb"), dict(recompute="cheap")):
        assert not use_compile(TrainConfig(**gpu, **eager)), eager
    for bad, why in [(dict(pp=2, microbatches=2, schedule="zb"), "--schedule zb"),
                     (dict(dropout=0.1), "--dropout"),
                     (dict(recompute="cheap"), "--recompute cheap"),
                     (dict(compile_backend="tvm"), "--compile-backend must be one of")]:
        with pytest.raises(ValueError, match=why):
            validate(TrainConfig(**{"compile": True, **bad}))


def test_recompute_layers_replaces_the_first_blocks_of_each_chunk() -> None:
    stages = build_stage(GPT("tiny", device="meta"), 0, 2, virtual=2)  # 4 chunks, 2 here
    apply_recompute(stages, "full", layers=1)
    kinds = [[type(b) is RecomputedBlock for b in s.blocks.values()] for s in stages]
    assert kinds == [[True, False], [True, False]]
    with pytest.raises(ValueError, match="needs --recompute full, cheap or selective"):
        validate(TrainConfig(recompute_layers=2))


@pytest.mark.parametrize("layout, most", [
    ({}, 8), ({"pp": 2}, 4), ({"pp": 2, "virtual": 2}, 2), ({"pp": 3}, 3),
    ({"pp": 2, "head_layers": 2}, 5)])
def test_recompute_layers_beyond_the_largest_chunk_are_refused_alike(layout, most) -> None:
    """N past the blocks of the largest chunk a rank holds would recompute every block
    without a word: ``train`` refuses it before any process starts, and the memory model
    (and with it ``plan``) refuses it in the same line; N up to that count is a layout."""
    def run(n: int) -> TrainConfig:
        m = 4 if layout.get("virtual") else 1
        schedule = "interleaved" if layout.get("virtual") else "1f1b"
        return TrainConfig(recompute="full", recompute_layers=n, microbatches=m,
                           batch_size=4 * m, schedule=schedule, **layout)
    validate(run(most))
    stage_activations("tiny", run(most).layout())
    with pytest.raises(ValueError) as refused:
        validate(run(most + 1))
    assert str(refused.value).startswith(f"--recompute-layers {most + 1} is more than the "
                                         f"{most} blocks of the ")
    assert str(refused.value).endswith(f"give at most {most}, or leave it out to recompute "
                                       "every block")
    with pytest.raises(ValueError) as priced:
        stage_activations("tiny", run(most + 1).layout())
    assert str(priced.value) == str(refused.value)


def test_recompute_layers_in_the_memory_model_and_a_run() -> None:
    """Predicted: N of 8 blocks recomputed lies linearly between none and all. Measured
    (one rank, tiny): the activations a run holds fall in the same order."""
    def predicted(**kw) -> float:
        return stage_activations("tiny", Layout(microbatch_size=4, **kw), accounting="fused")
    none, full = predicted(), predicted(recompute="full")
    half = predicted(recompute="full", recompute_layers=4)
    assert predicted(recompute="full", recompute_layers=8) == full
    assert predicted(recompute="full", recompute_layers=0) == none
    assert half == pytest.approx((none + full) / 2)
    none, half, full = (train(TrainConfig(steps=1, batch_size=4, recompute=r,
                                          recompute_layers=n, measure_activations=True)
                              )["ranks"][0]["memory"]
                        ["activations"] for r, n in [("none", None), ("full", 4), ("full", None)])
    assert none > half > full > 0


def test_recompute_layers_keeps_the_rows_of_the_moe_blocks_it_does_not_recompute() -> None:
    """moe-tiny (MoE blocks 1, 3, 5, 7): with N = 0 every block keeps its activations, the
    experts' rows too; N = 2 recomputes one dense and one MoE block, N = 3 one more dense."""
    def predicted(**kw) -> float:
        return stage_activations("moe-tiny", Layout(microbatch_size=4, **kw),
                                 accounting="fused")
    none, full = predicted(), predicted(recompute="full")
    assert predicted(recompute="full", recompute_layers=0) == none
    assert predicted(recompute="full", recompute_layers=8) == full
    two, three = (predicted(recompute="full", recompute_layers=n) for n in (2, 3))
    dense = two - three  # what recomputing a dense block saves
    assert none - two > 2 * dense  # the MoE block saved its rows as well
    assert none > two > three > full
