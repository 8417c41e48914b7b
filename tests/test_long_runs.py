"""Long runs stay flat: per-step records are bounded, old checkpoints are pruned."""

from __future__ import annotations

import os
import tracemalloc

import torch

from minipar import checkpoint
from minipar.comm import CommLog


def _one_step(log: CommLog, step: int) -> None:
    t = torch.zeros(256)  # 1 KiB
    for op in ("all_reduce", "all_reduce", "send"):
        rec = log.enter(op, "dp", t, 2)
        rec.end = rec.start + 0.001


def test_comm_log_keeps_summaries_not_records() -> None:
    """10,000 steps of 3 calls: the records of one step stay, the totals are exact and
    the memory held does not grow with the steps (16 bytes a step for the per-step
    lines; a record is ~1 KB with its dataclass and tuple)."""
    log = CommLog(on_enter=lambda rec: None)
    for step in range(100):
        _one_step(log, step)
        log.end_step()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for step in range(100, 10_000):
        _one_step(log, step)
        log.end_step()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(log.records) == 3 and len(log.to_dicts()) == 3  # the last step's detail
    assert len(log.step_wire_bytes) == 10_000
    assert grown < 400_000, grown  # 9,900 steps; keeping records would be ~30 MB
    summary = log.summary()["dp"]
    assert summary["all_reduce"]["calls"] == 20_000 and summary["send"]["calls"] == 10_000
    assert summary["send"]["bytes"] == 10_000 * 1024
    assert abs(summary["send"]["seconds"] - 10.0) < 0.05  # end - start at 1.7e9 s: ~1e-7
    assert log.total("nbytes", op="send") == 10_000 * 1024
    assert log.total() == 10_000 * (2 * 1024 + 1024)  # all-reduce over 2: 1 KiB each
    assert log.step_wire_bytes[-1] == 3 * 1024


def test_comm_log_keeps_everything_for_a_trace() -> None:
    log = CommLog(on_enter=lambda rec: None)
    for step in range(50):
        _one_step(log, step)
        log.end_step(keep=True)
    _one_step(log, 50)  # not yet folded: still counted once
    assert len(log.records) == 153
    assert log.summary()["dp"]["all_reduce"]["calls"] == 102
    assert log.total("nbytes") == 153 * 1024


def test_engine_keeps_the_last_steps_timeline_and_a_flat_comm_log() -> None:
    from minipar.config import TrainConfig
    from minipar.engine import train

    run = train(TrainConfig(dp=2, steps=6, timeout=240))
    for r in run["ranks"]:
        assert {e["step"] for e in r["timeline"]} == {5}
        assert r["comm"]["dp"]["all_reduce"]["calls"] >= 6  # every step counted
        assert r["comm_bytes_per_step"] > 0


def test_prune_keeps_the_last_k_and_never_latest(tmp_path) -> None:
    for step in (10, 20, 30, 40, 50):
        os.makedirs(tmp_path / f"step-{step:06d}")
        (tmp_path / f"step-{step:06d}" / "meta.json").write_text(f'{{"step": {step}}}')
    os.rename(tmp_path / "step-000050", tmp_path / "step-000050.tmp")  # a save under way
    os.makedirs(tmp_path / "step-000001.keepme")  # a user's: no checkpoint's name
    os.makedirs(tmp_path / "step-000002")  # no meta.json: not a checkpoint
    (tmp_path / "latest").write_text("step-000020")  # e.g. a later save failed
    gone = checkpoint.prune(str(tmp_path), keep=2)
    left = sorted(os.listdir(tmp_path))
    assert left == ["latest", "step-000001.keepme", "step-000002", "step-000020",
                    "step-000030", "step-000040", "step-000050.tmp"]
    assert [os.path.basename(g) for g in gone] == ["step-000010"]
