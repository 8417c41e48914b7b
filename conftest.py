"""``--full``: also run the tests marked ``slow`` (make test-full). Here, at the root, so
that tests/ and tests_browser/ share the option; without it those tests are deselected,
not skipped: they are a separate, documented run, not checks that silently did not happen.
"""

from __future__ import annotations

import pytest


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
