# Generated from solutions/check.py by tools/make_exercises.py: edit that file, not this one.
"""Check your exercises: ``check("ring_allreduce")``, or ``check()`` for all.

The checker and its cases live once, in ``solutions/check.py`` and ``solutions/checks/``;
these functions run them on your code in ``exercises/`` (``impl="solutions"`` checks the
reference instead).
"""

from solutions import check as _checker
from solutions.check import EXERCISES, CheckResult, Report  # noqa: F401


def load(name, impl="exercises"):
    return _checker.load(name, impl)


def run_one(name, impl="exercises", timeout=None, raise_errors=False):
    return _checker.run_one(name, impl, timeout, raise_errors)


def check(name=None, impl="exercises", timeout=None, raise_errors=False):
    return _checker.check(name, impl, timeout, raise_errors)


def overview(impl="exercises"):
    return _checker.overview(impl)
