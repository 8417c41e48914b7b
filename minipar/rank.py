"""What runs inside a rank that ``minipar.launch`` started: the other side of the launcher.

A launched rank, before it calls the user's function:

* leads a process group of its own, so the launcher can stop the rank *and* whatever
  the rank started (a data-loader worker, a shell command) with one signal to the
  group: nothing outlives a run;
* adopts its orphans (Linux ``PR_SET_CHILD_SUBREAPER``): a process below it whose parent
  exits stays below it, so one that left the group (``setsid``), which the group's
  signal misses, is still found and killed (``kill_strays``): by the rank as ``fn``
  ends, by the launcher when it stops a rank still running; elsewhere only those still
  below the rank are found (``ps``: a child it started with ``start_new_session``);
* dies with its launcher (``_die_with_parent``): should the launcher die without a
  cleanup (``kill -9``), the rank first kills what left its group, then the group;
* writes its stdout and stderr to a log file, never to the notebook;
* keeps a short text in shared memory the parent can read at any time: its *status*
  (where it is: inside or after which counted collective, shown when a run hangs);
* appends its *progress* (each ``report_progress``, e.g. "step 3/50 loss 2.1") to a file
  the parent reads as it grows: every report reaches it, the last ones before a failure
  too, and nothing of them is kept in the rank;
* beats a *heartbeat*, a shared counter raised whenever it makes progress (a counted
  collective finished, a training step done, a checkpoint's bytes written): the
  launcher's timeout is the time since a rank's last beat, never the run's length.

The status is written by the hooks this module installs in ``minipar.comm`` on entering
and finishing each op, so a hang names the op a rank waits in, or the last op it
finished before it went off into code of its own (a raw ``torch.distributed`` call,
a loop that never ends).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from minipar import comm

# --- this process's status slots (set only inside a launched rank) ---------------------
_STATUS_SLOT = None  # a shared char array the parent reads when a run times out
_PROGRESS_FD = None  # the progress file, a line per report (``on_progress``'s in the parent)
_BEAT = None  # a shared counter: raised at each sign of progress (``heartbeat``)
OUTSIDE = "running code outside minipar's counted calls"


def rank_status_reporter(after: bool = False) -> Callable | None:
    """The hook comm.CommLog calls on entering an op (``after``: on finishing it); None
    outside a launched rank."""
    slot = _STATUS_SLOT
    if slot is None:
        return None

    def report(record) -> None:
        if after:
            heartbeat()
            set_status(slot, f"after {record.describe()}, then {OUTSIDE}")
        else:
            set_status(slot, f"inside {record.describe()}")

    return report


def report_progress(text: str) -> None:
    """Tell the launching process how this rank is doing (e.g. "step 3/50 loss 2.1").

    The parent hands every report, in order, to ``launch(on_progress=...)``, as one line
    (line breaks become spaces), the last ones too when the rank fails right after;
    a no-op outside a launched rank. A report that cannot be written (a full disk) is
    dropped, and the ones after it: the run goes on, its result is the rank's return.
    """
    global _PROGRESS_FD
    if _PROGRESS_FD is not None:
        data = (" ".join(text.splitlines()) + "\n").encode()
        try:
            while data:  # (one write, appended whole, unless the disk is full)
                data = data[os.write(_PROGRESS_FD, data):]
        except OSError:
            _PROGRESS_FD = None
    heartbeat()


def heartbeat() -> None:
    """Tell the launching process this rank made progress (a step, a collective, bytes
    of a checkpoint written): its ``timeout`` counts from a rank's last beat. Cheap (one
    shared integer); a no-op outside a launched rank."""
    if _BEAT is not None:
        _BEAT.value += 1


def set_status(slot, text: str) -> None:
    data = text.encode()[: len(slot) - 1]
    slot[: len(data) + 1] = data + b"\0"


def get_status(slot) -> str:
    return bytes(slot[:]).split(b"\0", 1)[0].decode(errors="replace")


# --- the rank process ------------------------------------------------------------------
PR_SET_NAME, PR_SET_CHILD_SUBREAPER = 15, 36
PARENT_POLL_S = 0.1  # how often a rank looks whether its launcher is alive


def _prctl(option: int, arg: int | bytes) -> None:
    """Linux's ``prctl`` (nothing elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg)
        except OSError:
            pass


def _die_with_parent(parent: int) -> None:
    """End this rank, what it started and what left its group, once ``parent`` (the
    process that started it) is gone: the launcher's ``kill -9`` runs no cleanup of its
    own. A thread looks at this process's parent every ``PARENT_POLL_S`` seconds (its
    own parent is gone when that changed, to init or an adopting ancestor), portable
    where Linux's ``PR_SET_PDEATHSIG`` is not; that signal would also kill the rank at
    once, before it could find its strays (they are below it only while it lives)."""
    threading.Thread(target=_watch_parent, args=(parent,), name="minipar-parent-watch",
                     daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    kill_strays([os.getpid()])
    try:
        if os.getpgid(0) == os.getpid():  # (never the launcher's group: a failed setpgid)
            os.killpg(0, signal.SIGKILL)
    except OSError:
        pass
    os._exit(1)


def _adopt_orphans() -> None:
    """Ask Linux to re-parent to this process, not to init, any process below it whose
    parent exits (a double fork, a daemon): ``kill_strays`` finds it below the rank."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _set_process_name(name: str) -> None:
    """Show ``minipar-rank3`` in ps, top and psutil, not a copy of the parent's name."""
    _prctl(PR_SET_NAME, name.encode()[:15])


def kill_strays(ranks: list[int]) -> None:
    """SIGKILL every process below each of ``ranks`` (pids, each its process group's
    leader) that left the rank's group (``setsid``), which the signal to the group
    misses. Call it while the rank lives: it holds its orphans (``_adopt_orphans``, Linux;
    elsewhere an orphan is beyond reach). Looked up until none is left (a stray may fork
    meanwhile)."""
    for _ in range(50):  # (about a second at most, for one that cannot die at once)
        below = _children()
        strays = [pid for rank in ranks for pid, group in _descendants(below, rank)
                  if group != rank]
        if not strays:
            return
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # it ended meanwhile
                pass
        time.sleep(0.02)


def _children() -> dict[int, list[tuple[int, int]]]:
    """Each live process's children, as (pid, process group)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for pid, parent, group in _processes():
        children.setdefault(parent, []).append((pid, group))
    return children


def _processes() -> list[tuple[int, int, int]]:
    """(pid, parent, process group) of each live process (a zombie is dead: its parent
    reaps it), from Linux's /proc, else from ``ps`` (macOS); none where neither answers."""
    if not os.path.isdir("/proc/self"):
        return _processes_of_ps()
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    rows = []
    for pid in entries:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            # "pid (name) state ppid pgrp ...": the name may hold spaces and parentheses
            state, parent, group = stat[stat.rindex(b")") + 2:].split()[:3]
        except (OSError, ValueError):  # it ended meanwhile
            continue
        if state not in (b"Z", b"X"):
            rows.append((pid, int(parent), int(group)))
    return rows


def _processes_of_ps() -> list[tuple[int, int, int]]:
    try:
        out = subprocess.run(["ps", "-A", "-o", "pid=", "-o", "ppid=", "-o", "pgid=", "-o",
                              "stat="], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 4 and all(f.isdigit() for f in fields[:3]) \
                and not fields[3].startswith("Z"):
            rows.append((int(fields[0]), int(fields[1]), int(fields[2])))
    return rows


def _descendants(children: dict[int, list[tuple[int, int]]], pid: int) -> list[tuple[int, int]]:
    """(pid, process group) of every process below ``pid``."""
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += [p for p, _ in below]
    return found


def lead_process_group() -> None:
    """Make this process the leader of a new process group (its children join it), so
    ``os.killpg`` stops them together. The parent makes the same call for us right after
    the start, whichever of the two comes first."""
    try:
        os.setpgid(0, 0)
    except (OSError, AttributeError):  # AttributeError: Windows
        pass


# The signals the launcher holds back while it starts a rank (``launch._start_held``): a
# forked child runs the launcher's handlers until ``child`` sets its own, and one of these
# arriving in between would raise the launcher's SystemExit or KeyboardInterrupt in the
# child, a traceback on the user's terminal. The child unblocks them once its handlers
# are set; whatever arrived meanwhile is then taken by those.
START_SIGNALS = {s for s in (getattr(signal, n, None) for n in ("SIGINT", "SIGTERM", "SIGHUP"))
                 if s is not None}


def child(rank, world_size, backend, store_path, fn, args, kwargs, conn, slot, progress_path,
          beat, out_path, threads, timeout, parent_pid, keeper_fd=None):
    """The body of rank ``rank``: set up, run ``fn``, send back its result or error.
    ``parent_pid``: the launcher's pid (the rank dies with it), or None where a server
    forks the ranks (``forkserver``, which exits with the launcher): that server's.
    ``keeper_fd``: a forked rank's copy of the launcher's pipe to its keeper, closed at
    once (held open, it would hide the launcher's death from the keeper)."""
    global _STATUS_SLOT, _PROGRESS_FD, _BEAT
    _adopt_orphans()
    lead_process_group()
    _set_process_name(f"minipar-rank{rank}")
    _die_with_parent(parent_pid or os.getppid())  # (already gone: it ends the rank now)
    if keeper_fd is not None:
        os.close(keeper_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C for us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's cleanup handler
    if hasattr(signal, "pthread_sigmask"):  # (not on Windows, where nothing was held)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, START_SIGNALS)
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
    _STATUS_SLOT, _BEAT = slot, beat
    _PROGRESS_FD = os.open(progress_path, os.O_WRONLY | os.O_APPEND)
    set_status(slot, "starting")
    comm.RANK_HOOKS.update(on_enter=rank_status_reporter(),
                           on_exit=rank_status_reporter(after=True))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    try:
        torch.set_num_threads(threads)
        set_status(slot, "joining the process group")
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
        set_status(slot, f"{OUTSIDE} (no counted collective entered yet)")
        result = fn(*args, **kwargs)
        payload = pickle.dumps(("ok", result))
        ok = True
        set_status(slot, "finished")
    except BaseException as e:  # report everything, SystemExit included
        ok = False
        tb = traceback.format_exc()
        payload = pickle.dumps(("error", (type(e).__name__, str(e), tb,
                                          get_status(slot), time.time())))
    kill_strays([os.getpid()])  # before the parent hears of the end: none outlives it
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send_bytes(payload)
    conn.close()
    try:
        if ok and dist.is_initialized():
            # Leave together: a rank that closes its sockets while a slower peer is still
            # in init_process_group makes that peer fail ("connectFullMesh failed ...
            # Connection closed by peer"), e.g. when fn returns without communicating.
            dist.barrier()
            dist.destroy_process_group()
    except Exception:
        pass
