"""``python -m minipar doctor``: is this laptop ready for the course?

Each check prints OK or what to do. Nothing here changes the machine.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
from collections.abc import Callable


def _all_reduce_ones() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def _check_python() -> tuple[bool, str]:
    ok = sys.version_info >= (3, 10)
    return ok, (f"Python {platform.python_version()}" if ok else
                f"Python {platform.python_version()} is too old: install 3.10 or newer")


def _check_torch() -> tuple[bool, str]:
    import torch

    cuda = f", CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" \
        if torch.cuda.is_available() else ", CPU only (fine for the course)"
    return True, f"torch {torch.__version__}{cuda}"


def _check_gloo() -> tuple[bool, str]:
    from minipar.launch import launch

    try:
        sums = launch(_all_reduce_ones, 2, timeout=60)
    except Exception as e:  # report, never crash the doctor
        return False, f"gloo across 2 processes failed: {e}. Check that localhost resolves."
    ok = sums == [2.0, 2.0]
    return ok, ("gloo all-reduce across 2 processes" if ok else
                f"gloo all-reduce gave {sums}, expected [2.0, 2.0]")


def _check_module(name: str, minimum: str) -> Callable[[], tuple[bool, str]]:
    def check() -> tuple[bool, str]:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            return False, f"{name} is missing: run `make lab` (or pip install {name})"
        version = getattr(mod, "__version__", "?")
        major = int(str(version).split(".")[0]) if str(version)[0].isdigit() else 0
        ok = major >= int(minimum.split(".")[0])
        return ok, (f"{name} {version}" if ok else
                    f"{name} {version} is older than {minimum}: upgrade it")
    return check


def _check_lab_widgets() -> tuple[bool, str]:
    try:
        import jupyterlab
        import jupyterlab_widgets  # noqa: F401  (the widget manager JupyterLab loads)
    except ImportError:
        return False, "JupyterLab or its widget extension is missing: run `make lab`"
    return True, f"JupyterLab {jupyterlab.__version__} with the ipywidgets extension"


def _check_cores() -> tuple[bool, str]:
    cores = os.cpu_count() or 1
    return True, (f"{cores} CPU cores: runs of up to 8 ranks work; with fewer than 8 cores "
                  "they share them, so times are only comparable as ratios")


CHECKS: list[tuple[str, Callable[[], tuple[bool, str]]]] = [
    ("python", _check_python),
    ("torch", _check_torch),
    ("gloo", _check_gloo),
    ("plotly", _check_module("plotly", "5")),
    ("ipywidgets", _check_module("ipywidgets", "8")),
    ("jupyterlab", _check_lab_widgets),
    ("cores", _check_cores),
]


def run_doctor() -> list[dict]:
    """Run every check; return one dict per check (name, ok, message)."""
    results = []
    for name, check in CHECKS:
        try:
            ok, message = check()
        except Exception as e:
            ok, message = False, f"check failed unexpectedly: {e}"
        results.append({"check": name, "ok": ok, "message": message})
    return results
