"""minipar: a compact reference engine for data, tensor and pipeline parallelism.

The names below load when first used (PEP 562), not with the package: ``python -m
minipar`` starts by importing this file, and torch takes seconds to import; loaded here,
a Ctrl-C meanwhile would end in a traceback before the command line could say
"interrupted" (``minipar/__main__.py``)."""

import importlib

# each public name, and the module that defines it
_HOMES = {
    "GPT": "minipar.model", "GPTConfig": "minipar.model", "PRESETS": "minipar.model",
    "Comm": "minipar.comm", "CommLog": "minipar.comm",
    "Mesh": "minipar.mesh", "RankMesh": "minipar.mesh",
    "launch": "minipar.launch", "LaunchError": "minipar.launch",
    "RankFailed": "minipar.launch", "RankDied": "minipar.launch",
    "RankTimeout": "minipar.launch",
}
__all__ = list(_HOMES)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'minipar' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
