"""``--full``: also run the tests marked ``slow`` (make test-full). Here, at the root, so
that tests/ and tests_browser/ share the option; without it those tests are deselected,
not skipped: they are a separate, documented run, not checks that silently did not happen.
And OpenMP's idle threads sleep in every test process (below).
"""

from __future__ import annotations

import os

import pytest

# Idle OpenMP threads sleep instead of spinning (set before anything imports torch, whose
# OpenMP runtime reads it once; pytest-xdist's workers and every rank inherit it). A test
# process keeps torch's two threads, so a fork after its pool ran is still what the ranks
# meet; but beside the other worker and its ranks on 2 cores a spinning thread waits out
# the scheduler at every parallel region: ``train_reference`` of ``tiny`` for 3 steps took
# 9-11 s at a load of 4, 0.2 s with sleeping threads (2026-12-06).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", default=False,
                     help="also run tests marked slow (make test-full)")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if config.getoption("--full"):
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]
