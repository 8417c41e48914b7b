"""A rehearsal holds what the real rank holds: ``engine.rehearse`` against ``train``.

A rehearsed rank runs alone, its peers imagined (torch's "fake" process group). What it
is for is memory and compute on the machine a layout is meant for, tried on one device;
so what it holds must be what the same rank holds in the real job. Each case below runs
the layout for real (every rank, gloo) and rehearses its ranks one at a time, then
compares, rank by rank: the model states' bytes (params, gradients, optimizer), the
activations the meter saw at their peak, the pipeline's micro-batches in flight, the
bytes every collective would have put on the wire, and the actions of the step. They are
equal, to the byte: a rehearsal runs the same code on the same shapes, only the wire is
missing. The mutation case tells a pipeline's later stage the wrong boundary (the hidden
states without sequence parallelism's cut) and the comparison catches it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from minipar.config import TrainConfig
from minipar.engine import rehearse, stage_ranks, train
from minipar.step import stage_boundary

LAYOUTS = {
    "dp2-zero3": dict(dp=2, zero=3),
    "pp2-zb": dict(pp=2, schedule="zb", microbatches=4),
    "pp2-tp2-sp-interleaved": dict(pp=2, tp=2, sp=True, schedule="interleaved", virtual=2,
                                   microbatches=2, layers=4),
    "cp2-zero1": dict(cp=2, dp=2, zero=1, batch_size=8),
}


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(steps=2, measure_activations=True, **kw)


def _held(r: dict) -> dict:
    """What a rank held and moved: equal between a rehearsal and the real job."""
    return {"coords": r["coords"], "memory": r["memory"],
            "peak_in_flight": r["peak_in_flight"],
            "comm_bytes_per_step": r["comm_bytes_per_step"],
            "actions": [(e["kind"], e["mb"], e["chunk"]) for e in r["timeline"]]}


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_rehearsed_rank_holds_what_the_real_rank_holds(name):
    cfg = _cfg(**LAYOUTS[name])
    real = {r["rank"]: r for r in train(cfg)["ranks"]}
    ranks = sorted({0, cfg.world_size - 1, *stage_ranks(cfg)})
    record = rehearse(cfg, ranks)
    assert [r["rank"] for r in record["ranks"]] == ranks
    for r in record["ranks"]:
        assert _held(r) == _held(real[r["rank"]]), f"rank {r['rank']}"
        assert r["memory"]["activations"] > 0
        assert r["predicted"]["live"] > 0 and r["nccl_bytes"] == 0  # (the CPU: no NCCL)


def test_the_default_ranks_are_the_first_of_each_stage():
    cfg = _cfg(dp=2, pp=2, tp=2, microbatches=2)
    assert stage_ranks(cfg) == [0, 4]  # megatron order: tp fastest, then dp, then pp
    record = rehearse(cfg)
    assert [r["coords"]["pp"] for r in record["ranks"]] == [0, 1]
    assert all(r["coords"]["dp"] == r["coords"]["tp"] == 0 for r in record["ranks"])


def test_a_wrong_boundary_is_caught(monkeypatch):
    """Mutation: a middle stage told that twice the micro-batch arrives. It runs (no
    loss there to refuse the shape), and its activations differ from the real rank's.
    (Told the wrong width or dtype instead, the stage's first layer refuses to run.)"""
    cfg = _cfg(pp=3, microbatches=2, layers=3)
    real = train(cfg)["ranks"][1]
    assert _held(rehearse(cfg, [1])["ranks"][0]) == _held(real)

    def doubled(cfg, mcfg):
        told = stage_boundary(cfg, mcfg)
        return lambda key: told((2 * key[0], *key[1:]))

    monkeypatch.setattr("minipar.step.stage_boundary", doubled)
    wrong = rehearse(cfg, [1])["ranks"][0]
    assert wrong["memory"]["activations"] > real["memory"]["activations"]
    assert _held(wrong) != _held(real)


@pytest.mark.parametrize("argv, says", [
    (["--dp", "2", "--ranks", "2"], "has ranks 0 to 1, got 2"),
    (["--dp", "2", "--ranks", "0,x"], "--ranks must be comma-separated integers"),
    (["--save", "somewhere"], "a rehearsal writes no checkpoint"),
])
def test_bad_input_is_one_line(argv, says, tmp_path):
    out = subprocess.run([sys.executable, "-m", "minipar", "rehearse", *argv],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_the_command_prints_each_rank_against_the_model(tmp_path):
    out = subprocess.run([sys.executable, "-m", "minipar", "rehearse", "--pp", "2",
                          "--microbatches", "2", "--steps", "2", "--json",
                          str(tmp_path / "r.json")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "2 ranks: each rank below ran alone on the CPU" in lines[0]
    rows = [line.split() for line in lines if line.split()[:1] in (["0"], ["1"])]
    assert [row[:5] for row in rows] == [["0", "0", "0", "0", "0"], ["1", "0", "1", "0", "0"]]
    assert (tmp_path / "r.json").stat().st_size > 0


def test_a_rank_out_of_memory_is_a_result_not_a_failure(monkeypatch, capsys):
    """On a GPU a rehearsal is how one learns that a rank does not fit: the allocator's
    error becomes the rank's record (its first line), the other ranks still run, and the
    command prints it as a finding (exit 0). Here the step raises torch's own error."""
    import torch

    import minipar.engine as engine
    from minipar.__main__ import main

    def short_of_memory(cfg):
        if torch.distributed.get_rank() == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\n"
                                         "(GPU 0; 79.19 GiB total capacity)")
        return real_rank_main(cfg)

    real_rank_main = engine.rank_main
    monkeypatch.setattr(engine, "rank_main", short_of_memory)
    record = rehearse(_cfg(pp=2, microbatches=2))
    first, second = record["ranks"]
    assert "out_of_memory" not in first and len(first["step_seconds"]) == 2
    assert second["out_of_memory"] == "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert second["coords"]["pp"] == 1 and second["predicted"]["live"] > 0
    assert main(["rehearse", "--pp", "2", "--microbatches", "2", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank 1 ran out of memory: CUDA out of memory. Tried to allocate 2.00 GiB" in out
