"""Parity on real text: a dp x pp x tp run reads the reference's tokens and trains the
reference's model, and ``sample`` works from its (sharded) checkpoint.

Plain SGD without clipping, so a gradient off by a factor (dp, micro-batches, tp) moves
the weights by that factor and cannot hide. Measured on this corpus (tiny model, byte
tokens, dp2 pp2 tp2, 2 micro-batches, 3 steps): loss diff 7.2e-7, grad-norm rel diff
3.1e-7, validation loss diff 8.9e-8, parameter diff 6.7e-8. Tolerances, about 3x that:
2e-6 (loss), 1e-6 relative (grad norms), 3e-7 (validation), 2e-7 (parameters); a
factor of 2 anywhere would be off by 0.3 or more.
"""

from __future__ import annotations

import pytest
import torch
from test_data import write_corpus

from minipar import checkpoint
from minipar.config import TrainConfig
from minipar.engine import train, train_reference
from minipar.parity import compare
from minipar.sample import load_model, sample


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    src = write_corpus(root / "corpus")
    knobs = dict(data=src, data_cache=str(root / "cache"), steps=3, eval_every=3,
                 optimizer="sgd", grad_clip=0.0, lr=0.5, warmup=0, microbatches=2)
    cfg = TrainConfig(dp=2, pp=2, tp=2, save=str(root / "ckpt"), timeout=400, **knobs)
    run = train(cfg)
    ref = train_reference(TrainConfig(**knobs))
    return cfg, run, ref


def test_layout_matches_the_reference_on_real_text(text_run) -> None:
    cfg, run, ref = text_run
    state, step = checkpoint.load(cfg.save)
    params = {k: v for k, v in state["model"].items() if k != "head.weight"
              or not ref["model"].cfg.tie_embeddings}
    ref_params = {k: v.detach() for k, v in ref["model"].state_dict().items() if k in params}
    parity = compare(run, ref, params, ref_params)
    assert step == 3 and ref["model"].cfg.vocab_size == 256  # the byte tokenizer's
    assert parity.ok(2e-6, 1e-6, 2e-7), parity.describe()
    assert [e["step"] for e in run["eval"]] == [3] == [e["step"] for e in ref["eval"]]
    assert abs(run["eval"][0]["loss"] - ref["eval"][0]["loss"]) < 3e-7
    assert run["losses"][-1] < run["losses"][0]  # it learns (0.5 lr SGD, 3 steps)


def test_sample_from_a_sharded_checkpoint(text_run) -> None:
    cfg, _, ref = text_run
    model, tok = load_model(cfg.save)
    assert tok is not None and tok.vocab_size == 256
    for name, p in ref["model"].state_dict().items():
        assert torch.allclose(model.state_dict()[name], p, atol=1e-6), name
    text = sample(cfg.save, "the model ", tokens=20, temperature=0.8, seed=1)
    assert text.startswith("the model ") and len(text) > len("the model ")
    assert text == sample(cfg.save, "the model ", tokens=20, temperature=0.8, seed=1)
    greedy = sample(cfg.save, "the model ", tokens=5, temperature=0)
    assert greedy.startswith("the model ")
