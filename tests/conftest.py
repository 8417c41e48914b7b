"""Shared pytest options: ``--full`` runs the exhaustive (slow) variants too; every test
keeps ``predict``'s record in its own temporary directory."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _predictions_in_tmp(tmp_path, monkeypatch) -> None:
    """``predict`` keeps a learner's guesses in a file; tests keep theirs in a temporary
    directory, never in the home directory."""
    monkeypatch.setenv("MINIPAR_PREDICTIONS", str(tmp_path / "predictions.json"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", default=False,
                     help="also run tests marked slow (the full parity matrix)")
    parser.addoption("--impl", default="solutions", choices=("solutions", "exercises"),
                     help="the package tests/test_exercises.py checks (learners: exercises)")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if config.getoption("--full"):
        return
    # Not skipped but deselected: the exhaustive variants are a separate, documented run
    # (make test-full), not checks that silently did not happen.
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]
