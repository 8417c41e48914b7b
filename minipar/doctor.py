"""``python -m minipar doctor``: is this laptop ready for the course?

Each check prints OK or what to do. Nothing here changes the machine.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from minipar import checks
from minipar.launch import launch
from minipar.model import get_config
from minipar.theory.layout import Layout
from minipar.theory.memory import memory_breakdown


def _all_reduce_ones() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def _check_python() -> tuple[bool, str]:
    ok = sys.version_info >= (3, 10)
    return ok, (f"Python {platform.python_version()}" if ok else
                f"Python {platform.python_version()} is too old: install 3.10 or newer")


def _check_torch() -> tuple[bool, str]:
    cuda = f", CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" \
        if torch.cuda.is_available() else ", CPU only (fine for the course)"
    return True, f"torch {torch.__version__}{cuda}"


def _check_gloo() -> tuple[bool, str]:
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
    try:  # optional: what is checked is whether they are installed
        import jupyterlab
        import jupyterlab_widgets  # noqa: F401  (optional too: the widget manager)
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


# --- can this machine hold a model? --------------------------------------------------

def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory (Linux /proc/meminfo; else sysconf)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total


def fits_report(model: str, dp: int = 1, pp: int = 1, tp: int = 1, zero: int = 0,
                dtype: str = "fp32", microbatch_size: int = 1) -> dict:
    """Whether ``train --model MODEL`` at this layout fits here, before it is tried.

    Need per rank: ``minipar.theory.memory.memory_breakdown`` (AdamW; activations as
    minipar keeps them, one micro-batch of ``microbatch_size`` sequences). On a GPU
    machine each rank needs that on its device; on CPU every rank lives in host memory,
    so the host needs it times the number of ranks. Not counted: the CUDA context,
    allocator slack, temporary buffers: a fit with under 20% to spare is called tight.
    """
    cfg = get_config(model)
    checks.layout(cfg, dp, pp, tp)  # the layouts train refuses (more stages than layers)
    mem = memory_breakdown(cfg, Layout(dp=dp, pp=pp, tp=tp, zero=zero, dtype=dtype,
                                       optimizer="adamw", microbatch_size=microbatch_size),
                           accounting="fused")
    ranks = dp * pp * tp
    need = mem["total"]
    total, available = host_memory()
    verdicts = []

    def verdict(name: str, have: int, want: int, what: str) -> None:
        ok = want <= have
        tight = ok and want > 0.8 * have
        verdicts.append({"check": name, "ok": ok, "message":
                         f"{what}: needs {want / 2**30:.2f} GiB of {have / 2**30:.2f} GiB"
                         + (" (tight)" if tight else "" if ok else
                            ": does not fit; try more ranks, --zero, bf16 or a smaller model")})

    layout = f"{model} dp={dp} pp={pp} tp={tp} zero={zero} {dtype}"
    if torch.cuda.is_available():
        device = min(torch.cuda.mem_get_info(i)[1] for i in range(torch.cuda.device_count()))
        verdict("gpu memory", device, need, f"{layout}, per GPU")
        verdict("gpus", torch.cuda.device_count(), ranks, "ranks (one per GPU with nccl)")
        verdicts[-1]["message"] = (f"{ranks} rank(s), {torch.cuda.device_count()} GPU(s)")
    else:
        verdict("host memory", available, need * ranks,
                f"{layout}, {ranks} rank(s) in host memory (available)")
    return {"model": model, "per_rank": mem, "ranks": ranks, "host_total": total,
            "host_available": available, "checks": verdicts}
