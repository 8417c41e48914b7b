"""Checks on arguments alone, made before anything runs: sizes, output paths, theory inputs.

Each raises ``ValueError`` with one line a learner can act on; the command line prints
it as ``minipar <command>: error: ...`` (exit 2), the Python API raises it. The training
checks are in ``minipar.config.validate``, which calls these; ``docs/errors.md`` lists
every message and ``tests/test_cli_errors.py`` tries them.

Output paths are checked *before* a run because a run can take an hour: a typo in
``--json`` must not cost the losses it was meant to keep.
"""

from __future__ import annotations

import importlib
import math
import os
import tempfile
from collections.abc import Collection

from minipar.model import did_you_mean
from minipar.parallel.schedules import check_schedule

SEED_MAX = 2**32 - 1  # seeds mix into torch generators as seed * 1_000_003 + step
GPUS_MAX = 2**18  # plan's clusters: the largest built are about 10^5 GPUs
BUBBLE_TABLE_CELLS = 20_000  # pipeline actions simulated for the table; beyond: formulas


def positive(flag: str, value) -> None:
    """``--flag`` must be an integer of at least 1 (``None``: not given, fine)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise ValueError(f"--{flag} must be a positive integer, got {value!r}")


def seed(value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SEED_MAX:
        raise ValueError(f"--seed must be an integer from 0 to {SEED_MAX}, got {value!r}")


def _writable(directory: str) -> bool:
    """Whether a file can be created in ``directory``: tried, since ``os.access`` says
    yes to root even on a read-only mount."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def output_file(flag: str, path: str | None, new: bool = False) -> None:
    """``--json`` / ``--trace``: a file whose directory exists and takes new files
    (``new``: and that does not exist yet, e.g. ``export --out``)."""
    if path is None:
        return
    if new and os.path.isfile(path):
        raise ValueError(f"--{flag} {path} already exists; remove it, or choose another name")
    if path == "":
        raise ValueError(f"--{flag} needs a file name, got ''")
    if os.path.isdir(path):
        raise ValueError(f"--{flag} {path} is a directory; give a file name")
    _parent_takes_files(flag, path)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"--{flag} {path}: cannot write there (read-only)")


def new_output_dir(flag: str, path: str) -> None:
    """``export --format hf --out``: a directory to create (or an empty one) under one
    that exists and takes new files; one holding files already is never written into."""
    if path == "":
        raise ValueError(f"--{flag} needs a directory name, got ''")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--{flag} {path} is a file; give a directory name")
    if os.path.isdir(path) and os.listdir(path):
        raise ValueError(f"--{flag} {path} already holds files; remove them, or choose "
                         "another name")
    _parent_takes_files(flag, os.path.normpath(path))


def _parent_takes_files(flag: str, path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"--{flag} {path}: directory {parent} does not exist")
    if not _writable(parent):
        raise ValueError(f"--{flag} {path}: cannot write there (read-only)")


def distinct(outputs: dict[str, str | None], inputs: dict[str, str | None]) -> None:
    """No output may be an input or another output (``--json`` onto the ``--data``
    file would overwrite the corpus; ``--json`` equal to ``--trace`` loses the trace);
    paths are compared as the file system resolves them. ``--save`` into its own
    ``--resume`` directory is a run continuing there, not a collision."""
    seen: dict[str, str] = {}
    for flag, path in [*inputs.items(), *outputs.items()]:
        if not path:
            continue
        real = os.path.realpath(path)
        if real in seen and {flag, seen[real]} != {"save", "resume"}:
            why = ("an output must not overwrite an input" if seen[real] in inputs
                   else "two outputs cannot share one path")
            raise ValueError(f"--{flag} {path} is the same path as --{seen[real]}: {why}")
        if flag in outputs or os.path.exists(path):
            seen[real] = flag


def not_inside(files: dict[str, str | None], flag: str, directory: str | None,
               names: tuple[str, ...] | None = None) -> None:
    """No output file may land where the output directory ``--flag`` writes: anywhere
    inside it, or (``names``) on one of its own names (``--json D/run.json`` would
    replace the run card of ``--save D``); prefixes ending in ``-`` match ``step-*``."""
    if not directory:
        return
    home = os.path.realpath(directory)
    for other, path in files.items():
        if not path:
            continue
        real = os.path.realpath(path)
        if os.path.dirname(real) != home and not (names is None and
                                                 real.startswith(home + os.sep)):
            continue
        base = os.path.basename(real)
        if names is None or any(base == n or (n.endswith("-") and base.startswith(n))
                                for n in names):
            raise ValueError(f"--{other} {path} is inside --{flag} {directory}, where "
                             f"{'it' if names is None else 'the checkpoint'} writes "
                             f"{'its files' if names is None else base}: choose another "
                             "path")


def output_dir(flag: str, path: str | None) -> None:
    """``--save``: a directory, or a path under a writable directory (created at launch)."""
    if path is None:
        return
    if path == "":
        raise ValueError(f"--{flag} needs a directory name, got ''")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--{flag} {path} is a file, not a directory")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"--{flag} {path}: {existing} is a file, not a directory")
    if not _writable(existing):
        raise ValueError(f"--{flag} {path}: cannot write in {existing} (read-only)")


def model_sizes(**sizes) -> None:
    """``--layers --hidden --heads --vocab --seq-len`` when given: positive integers."""
    for flag, value in sizes.items():
        positive(flag.replace("_", "-"), value)


def layout(cfg, dp: int, pp: int, tp: int, virtual: int = 1, sp: bool = False) -> None:
    """A layout the model can take: positive sizes, enough layers for the pipeline's
    chunks, sequence parallelism only with tp (whether tp divides the model: the theory's
    ``check_divisible`` and ``parallel.tp.check_tp``)."""
    for flag, value in (("dp", dp), ("pp", pp), ("tp", tp), ("virtual", virtual)):
        positive(flag, value)
    if sp and tp == 1:
        raise ValueError("--sp (sequence parallelism) splits along tp: it needs --tp > 1")
    if cfg is None:
        return
    if cfg.n_layer < pp * virtual:
        raise ValueError(f"{cfg.n_layer} layers cannot fill pp={pp} x virtual={virtual} "
                         f"= {pp * virtual} pipeline chunks")


def bubble(schedule: str, pp: int, microbatches: int, virtual: int) -> bool:
    """Check ``bubble``'s sizes; True when the schedule is small enough to simulate and
    draw (beyond ``BUBBLE_TABLE_CELLS`` actions only the closed forms are printed, so
    the schedule is never built: its rules are checked here instead)."""
    for flag, value in (("pp", pp), ("microbatches", microbatches), ("virtual", virtual)):
        positive(flag, value)
    check_schedule(schedule, pp, microbatches, virtual)
    return pp * microbatches * virtual <= BUBBLE_TABLE_CELLS


def cluster(gpus: int | None, gpu: str, gpus_per_node: int, batch: int | None,
            top: int, memory_margin: float, known_gpus: Collection[str],
            host_memory_gib: float | None = None) -> None:
    """``plan``'s cluster flags: a GPU of ``known_gpus`` (``theory.clusters.GPUS``),
    positive counts, a share of memory to leave free in [0, 1), a positive host memory."""
    for flag, value in (("gpus", gpus), ("gpus-per-node", gpus_per_node), ("batch", batch),
                        ("top", top)):
        positive(flag, value)
    if gpus is not None and gpus > GPUS_MAX:
        raise ValueError(f"--gpus {gpus} is beyond the largest cluster plan considers "
                         f"({GPUS_MAX:,} GPUs)")
    if gpu not in known_gpus:
        raise ValueError(f"unknown --gpu {gpu!r}{did_you_mean(gpu, known_gpus)}; choose one "
                         f"of {sorted(known_gpus)}")
    if not 0 <= memory_margin < 1:
        raise ValueError(f"--memory-margin must be in [0, 1) (a share of each GPU's memory "
                         f"left free), got {memory_margin!r}")
    if host_memory_gib is not None and not 0 < host_memory_gib < math.inf:
        raise ValueError(f"--host-memory must be a positive number of GiB (a node's host "
                         f"memory), got {host_memory_gib!r}")


def choices(flag: str, values: tuple[str, ...], allowed: Collection[str]) -> None:
    """A comma-separated flag: each value one of ``allowed``."""
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ValueError(f"--{flag} takes a comma-separated list of {', '.join(allowed)}; "
                         f"got {bad[0]!r}")


def oversubscription(world_size: int) -> str | None:
    """A note when ranks outnumber the cores (the course promises laptops up to 8 ranks):
    each rank then gets a slice of a core, and a run takes that many times longer."""
    cores = os.cpu_count() or 1
    if world_size <= 8:
        return None
    share = max(1.0, world_size / cores)
    return (f"{world_size} ranks on {cores} cores: the cores are oversubscribed, so expect "
            f"each step to take about {share:.0f}x as long as one rank per core would "
            "(raise --timeout if the run needs longer than its default 600 s)")


def require(module: str, purpose: str):
    """Import an optional dependency, or one clear line saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{purpose} needs the optional package {module}: "
                         "pip install 'minipar[hf]'") from None
