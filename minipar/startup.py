"""A Ctrl-C while the command line starts: kept until the imports are done, then one line.

``python -m minipar`` imports the package, then its ``__main__``, and torch among them
takes seconds to load. A KeyboardInterrupt raised inside an import can surface as another
error (a half-loaded torch refuses to load again) and a traceback, which no handler of the
command line can catch yet. So while they load, SIGINT only sets a flag; once they are
done, a kept Ctrl-C ends the program as an interrupted command does (exit status 130)."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def interrupt_kept(active: bool) -> Iterator[None]:
    """Hold a Ctrl-C during the block when ``active`` (the program starting, in its main
    thread); after it, exit with status 130 and one line if one came."""
    if not (active and threading.current_thread() is threading.main_thread()):
        yield
        return
    kept: list[int] = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: kept.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
    if kept:
        print("minipar: interrupted", file=sys.stderr)
        raise SystemExit(130)
