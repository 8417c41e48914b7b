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
