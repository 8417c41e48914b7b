"""multigpu.py's ``cp``section (not written yet)."""


def section_cp(run) -> None:
    run.row("cp", "not written yet", lambda: {"status": "refused", "reason": "todo"})
