"""Shared pytest options: ``--full`` runs the exhaustive (slow) variants too."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", default=False,
                     help="also run tests marked slow (the full parity matrix)")
    parser.addoption("--impl", default="solutions", choices=("solutions", "exercises"),
                     help="the package tests/test_exercises.py checks (learners: exercises)")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="exhaustive variant: run with --full")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
