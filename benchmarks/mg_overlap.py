"""multigpu.py's ``overlap``section (not written yet)."""


def section_overlap(run) -> None:
    run.row("overlap", "not written yet", lambda: {"status": "refused", "reason": "todo"})
