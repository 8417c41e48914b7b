"""Run a function on N ranks, from a script, from pytest or from a notebook cell.

``launch(fn, world_size)`` starts one process per rank, joins them into a
``torch.distributed`` job, calls ``fn(*args, **kwargs)`` on each and returns the list of
their results (rank order). What makes it safe for a room of laptops:

* **No fixed port.** The ranks meet through a ``FileStore`` in a fresh temporary file,
  so parallel launches can never collide (gloo's own connections bind ports the OS
  picks). A ``TCPStore`` on port 0 would do too, but its clients stall for 5 s on about
  one connection in ten on our machines, and its server thread, busy while the parent
  forks the later ranks, can leave a child deadlocked at birth. A file has neither.
* **Notebook functions work.** The default start method on Linux and macOS is ``fork``: a
  function defined in a notebook cell is inherited, not pickled. A forked child first
  calls ``torch.set_num_threads(1)``: a fork of a process whose OpenMP pool already ran
  hangs at its first parallel op otherwise. With ``start_method="spawn"`` (or CUDA
  already initialised, where fork is broken) ``fn`` must live in an importable ``.py``
  module; we check that before starting anything.
* **Failures come back, fast, with the rank.** An exception on any rank stops every
  rank and raises ``RankFailed`` with that rank's traceback. A rank that dies (a signal,
  ``os._exit``) raises ``RankDied`` with its exit code. A run past ``timeout`` raises
  ``RankTimeout`` naming, per rank, the last collective it entered (op, group, shape).
  Ctrl-C or a kernel interrupt stops the children too.
* **No orphans.** Children are terminated, then killed, on every exit path, and each
  asks the kernel to kill it if the parent dies (Linux ``PR_SET_PDEATHSIG``).
* **Quiet ranks.** A rank's stdout and stderr (warnings, gloo's C++ logs) go to a file,
  never to the notebook; ``capture_output=True`` returns them, and error reports end
  with their last lines.
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

# --- this process's rank status slot (set only inside a launched child) ------------
_STATUS_SLOT = None  # a shared char array the parent reads when a run times out
_PROGRESS_SLOT = None  # a shared char array the parent passes to ``on_progress``


def rank_status_reporter() -> Callable | None:
    """The hook comm.CommLog calls on entering an op; None outside a launched rank."""
    slot = _STATUS_SLOT
    if slot is None:
        return None

    def report(record) -> None:
        _set_status(slot, f"last entered {record.describe()}")

    return report


def report_progress(text: str) -> None:
    """Tell the launching process how this rank is doing (e.g. "step 3/50 loss 2.1").

    The parent hands it to ``launch(on_progress=...)``; a no-op outside a launched rank.
    """
    if _PROGRESS_SLOT is not None:
        _set_status(_PROGRESS_SLOT, text)


def _set_status(slot, text: str) -> None:
    data = text.encode()[: len(slot) - 1]
    slot[: len(data) + 1] = data + b"\0"


def _get_status(slot) -> str:
    return bytes(slot[:]).split(b"\0", 1)[0].decode(errors="replace")


class LaunchError(RuntimeError):
    """A launched run failed; ``rank`` says which rank, the message says what it did."""

    def __init__(self, message: str, rank: int | None = None, output: str = ""):
        super().__init__(message)
        self.rank = rank
        self.output = output


class RankFailed(LaunchError):
    """A rank raised an exception."""


class RankDied(LaunchError):
    """A rank's process ended without reporting (a signal, os._exit, out of memory).

    ``exitcode`` is the process's exit status: negative for a signal (-9: SIGKILL).
    """

    def __init__(self, message: str, rank: int | None = None, output: str = "",
                 exitcode: int | None = None):
        super().__init__(message, rank, output)
        self.exitcode = exitcode


class RankTimeout(LaunchError):
    """The run outlived its timeout; the message says where each rank was."""


class Results(list):
    """Per-rank return values (rank order), plus ``outputs`` when captured."""

    outputs: list[str]
    seconds: float


def default_start_method() -> str:
    """fork where it is safe (POSIX, CUDA not initialised in this process), else spawn."""
    if "fork" not in mp.get_all_start_methods():
        return "spawn"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "spawn"
    return "fork"


def _check_spawnable(fn: Callable) -> None:
    main = sys.modules.get("__main__")
    if fn.__module__ == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(
            f"{fn.__qualname__} is defined in a notebook or an interactive session, so "
            "spawned ranks cannot import it. Use start_method='fork' (the default on "
            "Linux/macOS), or move the function into a .py module and import it."
        )
    try:
        pickle.dumps(fn)
    except Exception as e:  # lambdas, closures, local functions
        raise ValueError(
            f"{getattr(fn, '__qualname__', fn)!r} cannot be pickled for spawn ({e}); "
            "define it at the top level of an importable module, or use start_method='fork'"
        ) from None


def _rendezvous_file() -> str:
    """A fresh empty file for this launch's ``FileStore`` (no port, nothing to collide)."""
    fd, path = tempfile.mkstemp(prefix="minipar-store-")
    os.close(fd)
    return path


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (no orphans)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _set_process_name(name: str) -> None:
    """Show ``minipar-rank3`` in ps, top and psutil, not a copy of the parent's name."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").prctl(15, name.encode()[:15])  # PR_SET_NAME
        except OSError:
            pass


def _child(rank, world_size, backend, store_path, fn, args, kwargs, conn, slot, progress,
           out_path, threads, timeout, parent_pid):
    global _STATUS_SLOT, _PROGRESS_SLOT
    _die_with_parent()
    _set_process_name(f"minipar-rank{rank}")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C for us
    out = os.open(out_path, os.O_WRONLY | os.O_APPEND)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out, 1)
    os.dup2(out, 2)
    # The Python-level streams too: in a notebook they are the kernel's (which forwards a
    # forked child's prints into the notebook, unordered), not file descriptors 1 and 2.
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    # An inherited faulthandler (pytest enables one) writes a crash's Python stack to the
    # parent's terminal; the death report's log tail (gloo's own message) says more.
    faulthandler.disable()
    warnings.simplefilter("ignore")
    _STATUS_SLOT, _PROGRESS_SLOT = slot, progress
    _set_status(slot, "starting")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        _set_status(slot, "joining the process group")
        device = None
        if backend == "nccl":  # named to NCCL too: it guesses (and warns of hangs) otherwise
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        # The parent's deadline must come first: its RankTimeout says where every rank
        # was, while gloo's own timeout would only name one rank's op.
        late = timedelta(seconds=timeout + 30)
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(late)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=late, device_id=device)
        _set_status(slot, "running (no collective entered yet)")
        result = fn(*args, **kwargs)
        payload = pickle.dumps(("ok", result))
        ok = True
        _set_status(slot, "finished")
    except BaseException as e:  # report everything, SystemExit included
        ok = False
        tb = traceback.format_exc()
        payload = pickle.dumps(("error", (type(e).__name__, str(e), tb,
                                          _get_status(slot), time.time())))
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send_bytes(payload)
    conn.close()
    try:
        import torch.distributed as dist

        if ok and dist.is_initialized():
            # Leave together: a rank that closes its sockets while a slower peer is still
            # in init_process_group makes that peer fail ("connectFullMesh failed ...
            # Connection closed by peer"), e.g. when fn returns without communicating.
            dist.barrier()
            dist.destroy_process_group()
    except Exception:
        pass


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    backend: str = "gloo",
    start_method: str | None = None,
    timeout: float = 120.0,
    capture_output: bool = False,
    threads: int = 1,
    on_progress: Callable[[int, str], None] | None = None,
) -> Results:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results.

    Inside ``fn``, ``torch.distributed`` is initialised (``dist.get_rank()`` says which
    rank this is). Results must be picklable. Raises ``RankFailed``, ``RankDied`` or
    ``RankTimeout`` (all ``LaunchError``) naming the rank; every child is gone when
    this returns or raises. ``on_progress(rank, text)`` is called in this process
    whenever a rank's ``report_progress`` text changes (drive a progress bar with it).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    method = start_method or default_start_method()
    if method == "spawn" or method == "forkserver":
        _check_spawnable(fn)
    ctx = mp.get_context(method)
    kwargs = kwargs or {}
    start = time.monotonic()
    store_path = _rendezvous_file()
    procs, conns, slots, paths, progress = [], [], [], [], []
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            slot = ctx.Array("c", 400, lock=False)
            progress.append(ctx.Array("c", 200, lock=False))
            fd, path = tempfile.mkstemp(prefix=f"minipar-rank{rank}-", suffix=".log")
            os.close(fd)
            p = ctx.Process(
                target=_child, name=f"minipar-rank{rank}", daemon=True,
                args=(rank, world_size, backend, store_path, fn, args, kwargs, send_end, slot,
                      progress[rank], path, threads, timeout, os.getpid()))
            p.start()
            send_end.close()
            procs.append(p)
            conns.append(recv_end)
            slots.append(slot)
            paths.append(path)
        watch = _ProgressWatch(progress, on_progress)
        results = _collect(procs, conns, slots, paths, timeout, start, watch)
        results.outputs = ([_tail(p, 10**9) for p in paths] if capture_output
                           else [""] * world_size)
        results.seconds = time.monotonic() - start
        return results
    finally:
        _stop(procs)
        for c in conns:
            c.close()
        for path in [*paths, store_path]:
            try:
                os.unlink(path)
            except OSError:
                pass


class _ProgressWatch:
    """Calls ``on_progress`` with each rank's progress text when it changes."""

    def __init__(self, slots, callback):
        self.slots, self.callback = slots, callback
        self.seen = [""] * len(slots)
        self.poll = 0.2 if callback else 1.0

    def __call__(self) -> None:
        if self.callback is None:
            return
        for rank, slot in enumerate(self.slots):
            text = _get_status(slot)
            if text != self.seen[rank]:
                self.seen[rank] = text
                self.callback(rank, text)


def _collect(procs, conns, slots, paths, timeout, start, watch) -> Results:
    """Wait for every rank's result; raise for the first rank that failed.

    When one rank fails, its peers soon fail too ("Connection closed by peer" from
    gloo). On a busy machine the parent may see several failures at once, so it
    reports the root cause: a death first (a dead rank reports nothing, so its peers'
    errors can only be consequences), else the error raised earliest.
    """
    n = len(procs)
    results: list = [None] * n
    waiting = set(range(n))
    while waiting:
        remaining = start + timeout - time.monotonic()
        if remaining <= 0:
            raise RankTimeout(_timeout_report(procs, slots, waiting, timeout))
        handles = [conns[r] for r in waiting] + [procs[r].sentinel for r in waiting]
        ready = set(mp.connection.wait(handles, timeout=min(remaining, watch.poll)))
        watch()
        errors, dead = [], []
        # Every waiting rank, not only the ready ones: a child forked by another
        # thread's launch may hold our pipe ends open, hiding EOF and exit.
        for rank in sorted(waiting):
            conn = conns[rank]
            if conn.poll():
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except EOFError:  # exited without reporting; checked below
                    status, value = "eof", None
                if status == "ok":  # a rank that reported and then exited is not a death
                    results[rank] = value
                    waiting.discard(rank)
                    continue
                if status == "error":
                    errors.append((value[4], rank, value))
                    continue
            if procs[rank].sentinel in ready or not procs[rank].is_alive():
                procs[rank].join(1.0)  # a ready sentinel: it is exiting now
                if procs[rank].exitcode is not None:
                    dead.append(rank)
        if dead:
            rank = dead[0]
            code = procs[rank].exitcode
            raise RankDied(_death_report(rank, code, slots[rank], paths[rank]), rank,
                           _tail(paths[rank]), exitcode=code)
        if errors:
            _, rank, (name, msg, tb, where, _) = min(errors)
            raise RankFailed(
                f"rank {rank} raised {name}: {msg}\n  (rank {rank} was: {where})\n"
                f"--- traceback of rank {rank} ---\n{tb}", rank, _tail(paths[rank]))
    return Results(results)


def _death_report(rank, code, slot, path) -> str:
    if code is not None and code < 0:
        try:
            how = f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    msg = f"rank {rank} {how} without reporting a result (it was: {_get_status(slot)})"
    tail = _tail(path, 8).strip()
    return msg + (f"\n--- last output of rank {rank} ---\n{tail}" if tail else "")


def _timeout_report(procs, slots, waiting, timeout) -> str:
    lines = [f"timed out after {timeout:g} s; where each rank was:"]
    for r, slot in enumerate(slots):
        state = _get_status(slot) if r in waiting else "finished"
        lines.append(f"  rank {r}: {state}")
    lines.append("A rank that skipped a collective its group entered leaves the others "
                 "waiting; compare the ops above.")
    return "\n".join(lines)


def _stop(procs) -> None:
    """Terminate, then kill, every child still alive, and reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2.0)
