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
  hangs at its first parallel op otherwise, which is why ``threads > 1`` needs spawn.
  With ``start_method="spawn"`` (Windows, or CUDA already initialised, where fork is
  broken) a function spawn's pickle cannot import by name (a notebook cell's, a
  closure) travels by value (``cloudpickle``, as Ray and Dask send functions).
  ``MINIPAR_START_METHOD=spawn`` forces it where fork exists (CI runs lessons so).
* **Failures come back, fast, with the rank.** An exception on any rank stops every
  rank and raises ``RankFailed`` with that rank's traceback. A rank that dies (a signal,
  ``os._exit``) raises ``RankDied`` with its exit code. A rank that makes no progress
  for ``timeout`` seconds (no heartbeat: no collective finished, no step done;
  ``rank.heartbeat``) raises ``RankTimeout`` saying, per rank, which counted collective
  it is inside (op, group, shape), or which it finished last: a slow run that keeps
  moving is never stopped. Start-up (a rank's start, joining, whatever ``fn`` does
  before its first progress) is no step: until every rank has made progress once the
  run has ``startup`` seconds instead, and ``timeout`` counts from there. Ctrl-C or a
  kernel interrupt stops the children.
* **No orphans, no litter.** Each rank leads a process group; on every exit path the
  groups are terminated, then killed, so a rank's own children go with it. On Linux a
  process that left its rank's group (``setsid``) goes too: each rank adopts the
  orphans below it, and whatever left the group is killed as the rank's ``fn`` ends,
  or, for a rank still running, before its group is stopped (``rank.kill_strays``).
  The store, the rank logs and their progress files live in one temporary directory,
  removed on every exit path (a SIGTERM or SIGHUP included).
  Even ``kill -9`` of the launcher leaves no process and no file: each rank watches its
  parent and, once the launcher is gone, kills what left its group, then its group and
  itself (``rank._die_with_parent``); a *keeper*, a tiny process started first with
  ``setsid``, waits on a pipe from the launcher: when the pipe closes without a "done",
  it kills whatever is left of the ranks it was told of and removes the directory.
  (Outside Linux, a rank's orphan that left its group is beyond reach.)
* **Quiet ranks.** A rank's stdout and stderr (warnings, gloo's C++ logs) go to a file,
  never to the notebook; ``capture_output=True`` returns them, and error reports end
  with their last lines (read from the end of the file, however long it grew).

The rank's side of all this is ``minipar/rank.py``.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import cloudpickle

from minipar.rank import START_SIGNALS, child, get_status, kill_strays, rank_status_reporter
from minipar.rank import heartbeat as heartbeat
from minipar.rank import report_progress as report_progress

__all__ = ["launch", "LaunchError", "RankFailed", "RankDied", "RankTimeout", "Results",
           "default_start_method", "rank_status_reporter", "report_progress", "heartbeat",
           "check_timeout", "TIMEOUT_MAX"]

# gloo and NCCL hold a timeout as a deadline in int64 nanoseconds from now (about 292
# years); a process group is given ``timeout + 30`` s. A week is far beyond any step.
TIMEOUT_MAX = 7 * 24 * 3600.0
# How long the parent waits, after a rank reports an error, for a peer's death or an
# earlier error to arrive (a failing rank's exit can reach it after its peers' reports).
ROOT_CAUSE_WAIT_S = 2.0


def check_timeout(timeout, flag: str = "--timeout") -> None:
    """``timeout``: seconds without progress before a run counts as hung; one line
    unless it is a positive number the backends accept (at most ``TIMEOUT_MAX``)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not 0 < timeout <= TIMEOUT_MAX:
        raise ValueError(f"{flag} must be a positive number of seconds up to "
                         f"{TIMEOUT_MAX:.0f} (a week), got {timeout!r}")

class LaunchError(RuntimeError):
    """A launched run failed; ``rank`` says which rank, the message says what it did.
    ``record``: what the run did before it failed, where its caller keeps that
    (``engine.train``: every step's loss), else None."""

    record: dict | None = None

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
    """``MINIPAR_START_METHOD`` when set (to try Windows' spawn on Linux), else fork where
    it is safe (POSIX, CUDA not initialised in this process), else spawn."""
    forced = os.environ.get("MINIPAR_START_METHOD")
    if forced:
        if forced not in mp.get_all_start_methods():
            raise ValueError(f"MINIPAR_START_METHOD={forced!r}: this system starts "
                             f"processes by {', '.join(mp.get_all_start_methods())}")
        return forced
    if "fork" not in mp.get_all_start_methods():
        return "spawn"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "spawn"
    return "fork"


class ByValue:
    """A function sent to spawned ranks by value: ``cloudpickle`` carries its code and the
    globals it reads, where pickle would send only a name the child cannot import (a
    function of a notebook cell, a closure)."""

    def __init__(self, fn: Callable) -> None:
        self.payload = cloudpickle.dumps(fn)
        self.__qualname__ = getattr(fn, "__qualname__", repr(fn))

    def __call__(self, *args, **kwargs):
        return cloudpickle.loads(self.payload)(*args, **kwargs)


def spawnable(fn: Callable) -> Callable:
    """``fn`` itself if spawned ranks can import it by name, else ``ByValue(fn)``."""
    main = sys.modules.get("__main__")
    if not (fn.__module__ == "__main__" and not getattr(main, "__file__", None)):
        try:
            pickle.dumps(fn)
            return fn
        except Exception:  # lambdas, closures, local functions: by value
            pass
    try:
        return ByValue(fn)
    except Exception as e:
        raise ValueError(f"{getattr(fn, '__qualname__', fn)!r} cannot be sent to spawned "
                         f"ranks ({type(e).__name__}: {e}); define it at the top level of "
                         "an importable module, or use start_method='fork'") from None


# The keeper: makes this launch's temporary directory, prints its path, then waits. A
# "done" line from the launcher ends it; the pipe closing without one means the launcher
# died (kill -9). Each rank then ends itself and what it started (``rank._die_with_parent``:
# it alone can still find what left its group); the keeper gives the ranks it was told of
# ``KEEPER_GRACE_S`` for that, kills what is left of each (its group, and the rank itself:
# a spawned rank still importing leads no group yet), and removes the directory. Run as
# ``python -I -S`` (no site, no environment): a few milliseconds.
KEEPER_GRACE_S = 2.0
_KEEPER = """# minipar-keeper
import os, shutil, signal, sys, tempfile, time
path = tempfile.mkdtemp(prefix="minipar-run-", dir=sys.argv[1])
print(path, flush=True)
ranks = []
for line in sys.stdin:
    if line == "done\\n":
        sys.exit()
    ranks.append(int(line))
def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False
deadline = time.monotonic() + float(sys.argv[2])
while any(alive(rank) for rank in ranks) and time.monotonic() < deadline:
    time.sleep(0.02)
for rank in ranks:
    for kill in (os.killpg, os.kill):
        try:
            kill(rank, signal.SIGKILL)
        except OSError:
            pass
shutil.rmtree(path, ignore_errors=True)
"""


class _Scratch:
    """This launch's temporary directory (the store file, the rank logs) and its keeper,
    which removes it, and stops the ranks, should this process die without cleaning up."""

    def __init__(self) -> None:
        base = tempfile.gettempdir()
        try:
            self.keeper = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _KEEPER, base, str(KEEPER_GRACE_S)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, start_new_session=True)  # (no traceback of its own reaches a user)
            self.path = self.keeper.stdout.readline().strip()
            self.keeper.stdout.close()
        except OSError:  # no interpreter to start (an embedded Python): no keeper
            self.keeper, self.path = None, ""
        if not self.path:
            self.path = tempfile.mkdtemp(prefix="minipar-run-", dir=base)

    @property
    def fd(self) -> int | None:
        """The launcher's end of the keeper's pipe (a forked rank must close its copy)."""
        return self.keeper.stdin.fileno() if self.keeper else None

    def file(self, name: str) -> str:
        path = os.path.join(self.path, name)
        open(path, "wb").close()
        return path

    def watch(self, pid: int) -> None:
        """Tell the keeper of a rank (the leader of its process group)."""
        self._tell(f"{pid}\n")

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self.keeper:
            self._tell("done\n")
            try:
                self.keeper.stdin.close()
            except OSError:
                pass
            try:
                self.keeper.wait(5)
            except subprocess.TimeoutExpired:  # stopped, or slow: it exits on its own
                pass

    def _tell(self, line: str) -> None:
        if self.keeper:
            try:
                self.keeper.stdin.write(line)
                self.keeper.stdin.flush()
            except OSError:  # the keeper is gone (killed by hand): the launcher still cleans
                pass


def _tail(path: str, lines: int = 15, limit: int = 64 * 1024) -> str:
    """The last ``lines`` lines of a rank's log, reading at most its last ``limit`` bytes
    (a rank may have printed gigabytes)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - limit))
            text = f.read(limit).decode(errors="replace")
    except OSError:
        return ""
    return "".join(text.splitlines(keepends=True)[-lines:])


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


@contextmanager
def _cleanup_on_sigterm():
    """Turn a SIGTERM or SIGHUP (a closed terminal) of this process into SystemExit
    while ranks run, so the cleanup of ``launch`` (stop the ranks, delete the files)
    runs; only where the signal would kill us without one (the main thread, default
    handler): never replace someone's handler."""
    def exit_cleanly(signum, frame):
        raise SystemExit(128 + signum)

    main = threading.current_thread() is threading.main_thread()
    mine = [sig for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None))
            if main and sig is not None and signal.getsignal(sig) == signal.SIG_DFL]
    for sig in mine:
        signal.signal(sig, exit_cleanly)
    try:
        yield
    finally:
        for sig in mine:
            signal.signal(sig, signal.SIG_DFL)


@contextmanager
def _start_held():
    """Hold ``rank.START_SIGNALS`` back while a rank starts: the child inherits the mask
    and unblocks them once its own handlers are set; here they are delivered, to the
    launcher's handlers, as soon as the start returns."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: spawn, no inherited handlers
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, START_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


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
    startup: float | None = None,
) -> Results:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results.

    Inside ``fn``, ``torch.distributed`` is initialised (``dist.get_rank()`` says which
    rank this is). Results must be picklable. Raises ``RankFailed``, ``RankDied`` or
    ``RankTimeout`` (all ``LaunchError``) naming the rank; every child is gone when
    this returns or raises. ``on_progress(rank, text)`` is called in this process for
    each ``report_progress`` of a rank, in order (drive a progress bar with it): every
    one, those just before a failure too, before this returns or raises.
    ``startup``: seconds from the start until every rank has made progress once (a
    heartbeat), counted instead of ``timeout`` until then (default: ``timeout``).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    check_timeout(timeout, "timeout")
    startup = timeout if startup is None else startup
    check_timeout(startup, "startup")
    method = start_method or default_start_method()
    if method == "spawn" or method == "forkserver":
        fn = spawnable(fn)
    elif threads != 1:
        raise ValueError(
            f"threads={threads} needs start_method='spawn': a forked rank of a process "
            "that already ran multi-threaded torch work hangs at its first parallel op "
            "(the OpenMP pool does not survive fork); or keep threads=1")
    ctx = mp.get_context(method)
    kwargs = kwargs or {}
    start = time.monotonic()
    procs, conns, slots, paths, progress, beats = [], [], [], [], [], []
    watch = _ProgressWatch(progress, on_progress)
    with _cleanup_on_sigterm():
        scratch = _Scratch()
        try:
            store_path = scratch.file("store")
            keeper_fd = scratch.fd if method == "fork" else None
            parent = None if method == "forkserver" else os.getpid()  # whom a rank dies with
            for rank in range(world_size):
                recv_end, send_end = ctx.Pipe(duplex=False)
                slots.append(ctx.Array("c", 400, lock=False))
                progress.append(scratch.file(f"rank{rank}.progress"))
                beats.append(ctx.Value("Q", 0, lock=False))
                paths.append(scratch.file(f"rank{rank}.log"))
                p = ctx.Process(
                    target=child, name=f"minipar-rank{rank}", daemon=True,
                    args=(rank, world_size, backend, store_path, fn, args, kwargs, send_end,
                          slots[rank], progress[rank], beats[rank], paths[rank], threads,
                          max(timeout, startup), parent, keeper_fd))
                with _start_held():  # a signal now finds the rank started and known
                    p.start()
                    procs.append(p)
                    _lead_group(p)
                    scratch.watch(p.pid)
                send_end.close()
                conns.append(recv_end)
            results = _collect(procs, conns, slots, paths, _Stall(beats, timeout, startup),
                               watch)
            results.outputs = ([_read(p) for p in paths] if capture_output
                               else [""] * world_size)
            results.seconds = time.monotonic() - start
            return results
        finally:
            _stop(procs)
            for c in conns:
                c.close()
            try:
                watch()  # the reports since the last look: a failure's last steps too
            finally:
                scratch.close()


def _lead_group(p) -> None:
    """The parent's half of ``rank.lead_process_group`` (whichever runs first wins the
    race; a spawned child that already exec'd refuses it: it makes the call itself)."""
    try:
        os.setpgid(p.pid, p.pid)
    except (OSError, AttributeError):
        pass


class _ProgressWatch:
    """Calls ``on_progress`` with each line the ranks appended to their progress files
    (``rank.report_progress``) since the last call, in order; a line still being written
    waits for the next call."""

    def __init__(self, paths: list[str], callback) -> None:
        self.paths, self.callback = paths, callback
        self.done: list[int] = []  # bytes of each file already handed on
        self.poll = 0.2 if callback else 1.0

    def __call__(self) -> None:
        if self.callback is None:
            return
        self.done += [0] * (len(self.paths) - len(self.done))
        for rank, path in enumerate(self.paths):
            try:
                with open(path, "rb") as f:
                    f.seek(self.done[rank])
                    new = f.read()
            except OSError:
                continue
            lines = new[: new.rfind(b"\n") + 1]
            self.done[rank] += len(lines)
            for line in lines.split(b"\n")[:-1]:
                self.callback(rank, line.decode(errors="replace"))


class _Stall:
    """Seconds since each rank's last heartbeat; a rank still waited for that has not
    beaten for ``timeout`` seconds is stalled (the run is hung).

    Until every waited-for rank has beaten once, the run is starting (processes, imports,
    joining, a model's build, a first step): it is stalled only ``startup`` seconds
    after the launch, and then every rank's clock starts at once (a rank that made
    progress early may have been waiting all along for a peer still building).
    """

    def __init__(self, beats, timeout: float, startup: float) -> None:
        self.beats, self.timeout, self.startup = beats, timeout, startup
        self.start = time.monotonic()
        self.started = False  # every rank has made progress once
        self.seen = [(b.value, self.start) for b in beats]

    def remaining(self, waiting) -> float:
        """Seconds before the first waiting rank would be stalled (<= 0: it is)."""
        now = time.monotonic()
        for r, b in enumerate(self.beats):
            if b.value != self.seen[r][0]:
                self.seen[r] = (b.value, now)
        if not self.started:
            if not all(self.has_beaten(r) for r in waiting):
                return self.start + self.startup - now
            self.started = True
            self.seen = [(beat, now) for beat, _ in self.seen]
        return min(self.seen[r][1] + self.timeout - now for r in waiting)

    @property
    def limit(self) -> float:
        """The seconds without progress that make a rank stalled now."""
        return self.timeout if self.started else self.startup

    def has_beaten(self, rank: int) -> bool:
        return bool(self.beats[rank].value)

    def quiet(self, rank: int) -> float:
        return time.monotonic() - self.seen[rank][1]


def _collect(procs, conns, slots, paths, stall, watch) -> Results:
    """Wait for every rank's result; raise for the first rank that failed.

    When one rank fails, its peers soon fail too ("Connection reset by peer" from
    gloo), and a peer's report can reach the parent before the failing rank's death
    does. So the parent reports the root cause: once an error arrives it waits up to
    ``ROOT_CAUSE_WAIT_S`` for the other ranks to settle, then names a death first (a
    dead rank reports nothing, so its peers' errors can only be consequences), else
    the error raised earliest.
    """
    n = len(procs)
    results: list = [None] * n
    waiting = set(range(n))
    errors: list = []
    settle_by = math.inf  # when to stop waiting for the root cause of an error
    while waiting:
        remaining = stall.remaining(waiting)
        if remaining <= 0:
            raise RankTimeout(_timeout_report(slots, waiting, stall))
        handles = [conns[r] for r in waiting] + [procs[r].sentinel for r in waiting]
        wait_s = min(remaining, watch.poll, max(0.0, settle_by - time.monotonic()))
        ready = set(mp.connection.wait(handles, timeout=wait_s))
        watch()
        dead = []
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
                    waiting.discard(rank)
                    settle_by = min(settle_by, time.monotonic() + ROOT_CAUSE_WAIT_S)
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
        if errors and (not waiting or time.monotonic() >= settle_by):
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
    msg = f"rank {rank} {how} without reporting a result (it was: {get_status(slot)})"
    tail = _tail(path, 8).strip()
    return msg + (f"\n--- last output of rank {rank} ---\n{tail}" if tail else "")


def _timeout_report(slots, waiting, stall) -> str:
    limit = stall.limit
    if stall.started:
        stuck = [r for r in sorted(waiting) if stall.quiet(r) >= limit]
    else:  # start-up ran out: the ranks that never made progress
        stuck = [r for r in sorted(waiting) if not stall.has_beaten(r)]
    when = "" if stall.started or limit == stall.timeout else (
        " since the launch (the start-up's allowance: the timeout counts from every "
        "rank's first progress)")
    lines = [f"timed out: rank {stuck[0]} made no progress (no collective finished, no "
             f"step done) for {limit:g} s{when}; where each rank was:"]
    for r, slot in enumerate(slots):
        if r not in waiting:
            lines.append(f"  rank {r}: finished")
        elif stall.started or stall.has_beaten(r):
            lines.append(f"  rank {r}: {get_status(slot)} (last progress "
                         f"{stall.quiet(r):.0f} s ago)")
        else:
            lines.append(f"  rank {r}: {get_status(slot)} (no progress yet: still "
                         f"starting, {stall.quiet(r):.0f} s after the launch)")
    lines.append("A rank that skipped a collective its group entered leaves the others "
                 "waiting; compare the ops above.")
    return "\n".join(lines)


def _stop(procs) -> None:
    """Terminate, then kill, every rank's process group (the rank and whatever it
    started, even after the rank itself has finished), and reap the ranks. First, while
    a rank still runs (and holds its orphans), what left its group is killed."""
    # (a rank that ended is left out: reaped, its pid may be another process's now)
    kill_strays([p.pid for p in procs if p.is_alive()])
    for p in procs:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        _signal(p, signal.SIGKILL)
        p.join(2.0)


def _signal(p, sig: int) -> None:
    """Send ``sig`` to rank ``p``'s process group; to the rank alone if it has none."""
    try:
        os.killpg(p.pid, sig)  # the group's id is the rank's pid (see _lead_group)
    except (OSError, AttributeError):  # no such group (never formed, or all gone)
        if p.is_alive():
            p.kill() if sig == signal.SIGKILL else p.terminate()
