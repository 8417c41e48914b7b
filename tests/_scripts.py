"""Load one of the repository's scripts (tools/, benchmarks/) as a module, by its path:
they are run as files, not installed as a package."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str | None = None) -> ModuleType:
    """``relative`` (e.g. ``"tools/lesson_times.py"``) under the repository, imported."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
