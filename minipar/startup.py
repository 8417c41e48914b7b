"""A Ctrl-C while the command line starts: kept until the imports are done, then one line.

``python -m minipar`` imports the package, then compiles and runs its ``__main__``, and
torch among the imports takes seconds to load. A KeyboardInterrupt raised inside an
import can surface as another error (a half-loaded torch refuses to load again) and a
traceback, which no handler of the command line can catch yet. So from the package's
first line (``hold_interrupts``) to the end of ``__main__``'s imports
(``release_interrupts``) SIGINT only sets a flag; then a kept Ctrl-C ends the program as
an interrupted command does: one line, exit status 130."""

from __future__ import annotations

import signal
import sys
import threading


def hold_interrupts(active: bool) -> None:
    """Keep SIGINT from here on when ``active`` (the program starting, in its main
    thread), unless already kept."""
    if not active or threading.current_thread() is not threading.main_thread():
        return
    if hasattr(signal.getsignal(signal.SIGINT), "kept"):
        return

    def keep(signum, frame) -> None:
        keep.kept.append(signum)
    keep.kept = []
    keep.before = signal.signal(signal.SIGINT, keep)


def release_interrupts() -> None:
    """Stop keeping SIGINT (where ``hold_interrupts`` started it); exit with status 130
    and one line if one came meanwhile."""
    if threading.current_thread() is not threading.main_thread():
        return
    keep = signal.getsignal(signal.SIGINT)
    if not hasattr(keep, "kept"):
        return
    signal.signal(signal.SIGINT, keep.before)
    if keep.kept:
        print("minipar: interrupted", file=sys.stderr)
        raise SystemExit(130)
