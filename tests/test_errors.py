"""Every invalid combination of docs/errors.md fails fast, with its documented line."""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import psutil
import pytest
import torch

from minipar.__main__ import main
from minipar.config import TrainConfig, validate

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
ROW = re.compile(r"^\| (?P<what>[^|]+) \| `(?P<flags>[^`]+)` \| `(?P<message>[^`]+)` \|$")
CASES = [m.groupdict() for line in DOC.read_text().splitlines() if (m := ROW.match(line))]
NEEDS_NO_GPU = ("--backend nccl", "--device cuda")


def test_the_document_lists_the_cases() -> None:
    assert len(CASES) >= 15


@pytest.mark.parametrize("case", CASES, ids=[c["what"] for c in CASES])
def test_documented_error(case: dict, capsys: pytest.CaptureFixture) -> None:
    if case["flags"] in NEEDS_NO_GPU and torch.cuda.is_available():
        validate(TrainConfig(backend="nccl" if "nccl" in case["flags"] else "gloo",
                             device="cuda"))  # valid here: a GPU is present
        return
    children = len(psutil.Process().children(recursive=True))
    start = time.monotonic()
    code = main(["train", *shlex.split(case["flags"])])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == case["message"]
    assert "\n" not in err
    assert time.monotonic() - start < 5
    assert len(psutil.Process().children(recursive=True)) == children


def test_torchrun_world_size_must_match_the_layout() -> None:
    with pytest.raises(ValueError, match="does not match the job's world size 8"):
        validate(TrainConfig(dp=2, tp=2), world_size=8)


FIT_EXAMPLE = ("this run does not fit: gpt2-125m dp=2 pp=1 tp=1 zero=0 fp32 needs 10.8 GiB "
               "per rank x 2 ranks = 21.7 GiB of host memory, which has 16.0 GiB; --dp 2 "
               "--pp 1 --tp 1 --zero 0 --microbatches 2 would need 6.7 GiB per rank")


def test_a_run_that_cannot_fit_is_refused_with_a_layout_that_does(monkeypatch, capsys) -> None:
    """The prediction (theory.memory + 300 MiB a rank) against the whole host: the small
    presets fit a 24 GiB laptop; on 16 GiB the documented line names a layout that fits
    (checked to fit in turn); nothing fits a 1T model on 2 ranks."""
    import minipar.doctor

    assert FIT_EXAMPLE in DOC.read_text().replace("\n", " ")
    monkeypatch.setattr(minipar.doctor, "host_memory", lambda: (24 * 2**30, 20 * 2**30))
    validate(TrainConfig(model="gpt2-125m", dp=2))
    validate(TrainConfig(model="gpt2-350m", dp=2, microbatches=4))
    monkeypatch.setattr(minipar.doctor, "host_memory", lambda: (16 * 2**30, 16 * 2**30))
    assert main(["train", "--model", "gpt2-125m", "--dp", "2"]) == 2
    assert capsys.readouterr().err.strip() == f"minipar train: error: {FIT_EXAMPLE}"
    validate(TrainConfig(model="gpt2-125m", dp=2, microbatches=2))  # the suggestion fits
    with pytest.raises(ValueError, match="no layout of 2 ranks fits"):
        validate(TrainConfig(model="gpt-1t", dp=2))


def test_per_gpu_memory_decides_under_cuda(monkeypatch) -> None:
    """On GPUs each rank has its own device: gpt-13b on 4 x 80 GiB fits with tp 4, sp and
    full recompute in bf16 (the GPU benchmark's run), not with dp 4 ZeRO-0; the refusal
    names the planner's first choice for the card, with its flags."""
    import minipar.config as config

    monkeypatch.setattr(config, "machine_memory", lambda cfg: ("memory per GPU", 80 * 2**30, 1))
    big = dict(model="gpt-13b", dtype="bf16", batch_size=8)
    ok = TrainConfig(tp=4, sp=True, recompute="full", **big)
    config.check_fits(ok, ok.model_config())
    bad = TrainConfig(dp=4, **big)
    first = TrainConfig(dp=4, zero=3, recompute="cheap", **big)  # the planner's answer
    need, fits = (config.predicted_bytes(c, c.model_config(), device="cuda") / 2**30
                  for c in (bad, first))
    with pytest.raises(ValueError, match=rf"needs {need:.1f} GiB per rank of memory per "
                                         r"GPU, which has 80.0 GiB; --dp 4 --pp 1 --tp 1 "
                                         r"--zero 3 --microbatches 1 --batch-size 8 --recompute "
                                         rf"cheap --dtype bf16 would need {fits:.1f} GiB"):
        config.check_fits(bad, bad.model_config())


def test_offload_is_checked_against_the_host(monkeypatch) -> None:
    """``--offload`` on GPUs keeps each rank's fp32 states on the host: gpt-6.7b on one
    80 GiB GPU fits the card with offload (48 GiB), and its 112 GiB of host states fit a
    128 GiB host but not a 100 GiB one, which is refused in one line with the numbers."""
    import minipar.config as config
    import minipar.doctor

    monkeypatch.setattr(config, "machine_memory", lambda cfg: ("memory per GPU", 80 * 2**30, 1))
    run = TrainConfig(model="gpt-6.7b", dtype="bf16", batch_size=8, recompute="full",
                      offload=True)
    monkeypatch.setattr(minipar.doctor, "host_memory", lambda: (128 * 2**30, 120 * 2**30))
    config.check_fits(run, run.model_config())
    monkeypatch.setattr(minipar.doctor, "host_memory", lambda: (100 * 2**30, 90 * 2**30))
    with pytest.raises(ValueError, match=r"^this run does not fit the host: --offload keeps "
                                         r"111\.6 GiB per rank on the host .*, and the host "
                                         r"has 100\.0 GiB; shard them"):
        config.check_fits(run, run.model_config())
