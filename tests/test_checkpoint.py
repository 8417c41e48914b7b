"""Checkpoints: bitwise resume, resharding to other layouts, atomic writes."""

from __future__ import annotations

import os

import pytest
import torch

from minipar import checkpoint
from minipar.config import TrainConfig
from minipar.engine import train
from minipar.launch import RankDied, launch

STEPS, HALF = 6, 3


def run(**kw) -> list[float]:
    return train(TrainConfig(steps=STEPS, timeout=240, **kw))["losses"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list[float]]:
    """Train dp2 pp2 tp2 for HALF steps and save; also the uninterrupted losses."""
    d = str(tmp_path_factory.mktemp("ckpt"))
    layout = dict(dp=2, pp=2, tp=2, microbatches=2)
    full = run(**layout)
    first = run(**layout, save=d, stop_at=HALF)
    assert first == full[:HALF]
    return d, full


def test_resume_is_bitwise_identical(saved) -> None:
    d, full = saved
    resumed = run(dp=2, pp=2, tp=2, microbatches=2, resume=d)
    assert resumed == full[HALF:]  # bitwise: CPU, fp32, same layout


@pytest.mark.parametrize("layout", [dict(dp=4, tp=2), dict(pp=2, tp=4, microbatches=2),
                                    dict(dp=2, zero=1), dict(tp=2, pp=2, zero=3, dp=2,
                                                             microbatches=2)],
                         ids=["dp4 tp2", "pp2 tp4", "dp2 zero1", "dp2 pp2 tp2 zero3"])
def test_resume_at_another_layout(saved, layout: dict) -> None:
    d, full = saved
    resumed = run(resume=d, **layout)
    assert max(abs(a - b) for a, b in zip(resumed, full[HALF:])) < 1e-4


def test_tied_embeddings_reshard_from_one_stage_to_two(tmp_path) -> None:
    """At pp = 1 a tied weight is saved once (``tok_emb.weight``); resumed at pp = 2 the
    last stage's copy (``head.weight``) must start from it, optimizer state included."""
    tied = dict(overrides={"tie_embeddings": True})
    full = run(tp=2, **tied)
    run(tp=2, save=str(tmp_path), stop_at=HALF, **tied)
    resumed = run(pp=2, microbatches=2, resume=str(tmp_path), **tied)
    assert max(abs(a - b) for a, b in zip(resumed, full[HALF:])) < 1e-4


def test_checkpoint_is_loaded_without_code(saved) -> None:
    d, _ = saved
    path = checkpoint.resolve(d)
    files = [f for f in os.listdir(path) if f.endswith(".pt")]
    assert len(files) == 4  # dp replica 0 of a 2 x 2 x 2 mesh writes; the others do not
    blob = torch.load(os.path.join(path, files[0]), weights_only=True)
    assert set(blob) == {"weights", "states"}


def _crash_while_saving(directory: str) -> None:
    """Save once, then die half-way through a second save (after the shards)."""
    cfg = TrainConfig(steps=2, save=directory, stop_at=1)
    from minipar.engine import rank_main

    rank_main(cfg)
    real_replace = os.replace

    def dying_replace(src, dst):
        if src.endswith(".tmp") and "step-000002" in src:
            os._exit(9)  # killed between writing the shards and publishing them
        real_replace(src, dst)

    os.replace = dying_replace
    rank_main(TrainConfig(steps=2, save=directory, resume=directory))


def test_a_crash_while_saving_keeps_the_previous_checkpoint(tmp_path) -> None:
    d = str(tmp_path)
    with pytest.raises(RankDied):
        launch(_crash_while_saving, 1, args=(d,), timeout=120)
    assert checkpoint.resolve(d).endswith("step-000001")
    state, step = checkpoint.load(d)
    assert step == 1 and "tok_emb.weight" in state["model"]
    assert run(resume=d)[0] > 0  # and training resumes from it
