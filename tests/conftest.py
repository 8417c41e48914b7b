"""Shared pytest options (``--full`` is the root conftest.py's); every test keeps
``predict``'s record in its own temporary directory."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _predictions_in_tmp(tmp_path, monkeypatch) -> None:
    """``predict`` keeps a learner's guesses in a file; tests keep theirs in a temporary
    directory, never in the home directory."""
    monkeypatch.setenv("MINIPAR_PREDICTIONS", str(tmp_path / "predictions.json"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--impl", default="solutions", choices=("solutions", "exercises"),
                     help="the package tests/test_exercises.py checks (learners: exercises)")

