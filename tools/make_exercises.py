"""Generate ``exercises/`` from ``solutions/``, the single source of every exercise.

Every ``.py`` file under ``solutions/`` is copied to the same place under ``exercises/``.
Inside it, each block between a ``### BEGIN SOLUTION`` line and a ``### END SOLUTION``
line is replaced by a blank that raises ``NotImplementedError``. The blank carries no
hint: the block's ``# HINT:`` comment lines (a hint may run over several ``# HINT:`` lines,
or continue on the ``#`` lines right after it) stay in ``solutions/``, where
``hint(name, 3)`` (``solutions/course.py``) reads them when the learner asks; the error
message says how to ask:

    def ring_all_reduce(comm, t):                 def ring_all_reduce(comm, t):
        ### BEGIN SOLUTION                             # YOUR CODE HERE
        # HINT: split t into comm.size ...   ->        raise NotImplementedError(
        chunks = ...                                       "ring_all_reduce in ... is not
        ### END SOLUTION                                   implemented yet. Hint: ...")

A debugging lab plants a bug instead of a blank: a block may end with a ``### PLANTED BUG``
line followed by commented-out lines (``# code``); the exercise gets those lines
uncommented (the bug), with no mark to say where (the learner finds it from its
symptoms), and the solution keeps the code above the marker (the fix). A lab may hold
several bugs, one per *variant*: ``### PLANTED BUG 2`` starts variant 2's lines. The file
of variant k plants the lines of every block's section k and keeps the fix (without its
hints) in every block that has none; ``generate(..., variant=k)`` makes it (the course's
``another_bug`` gives the learner the next one). A ``# HINT(k):`` line in a bug section
is variant k's level-3 hint, never planted.

Files without markers are copied as they are (``__init__.py``), except the checker: its
cases (``checks/``) stay in ``solutions/`` and run from there, and ``exercises/check.py``
is a few lines that call ``solutions/check.py`` on the ``exercises`` package, so the
checker exists once. Every generated file starts with a comment naming its source, so
nobody edits the wrong one.

    python tools/make_exercises.py           # (re)write exercises/
    python tools/make_exercises.py --check   # exit 1 if exercises/ differs (CI's drift test)

Writing never silently destroys a learner's work: an exercise file with answers in it
(fewer blanks than the generated version) is first copied to ``<name>.py.bak``.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
HINT = "# HINT:"
BLANK_MARK = "# YOUR CODE HERE"
BUG = "### PLANTED BUG"
HEADER = ("# Your copy of this exercise, generated from {src} by tools/make_exercises.py.\n"
          "# Fill in the blanks (each raises NotImplementedError), then check your work with\n"
          "#     from exercises.check import check; check(\"{name}\")\n")
LAB_HEADER = ("# Your copy of this debugging lab, generated from {src}\n"
              "# by tools/make_exercises.py.\n"
              "# It runs, but something in it is wrong: find it with the lesson's instruments,\n"
              "# fix it, then check your work with\n"
              "#     from exercises.check import check; check(\"{name}\")\n")
PLAIN_HEADER = ("# Generated from {src} by tools/make_exercises.py: "
                "edit that file, not this one.\n")
_DEF = re.compile(r"^(\s*)(?:async\s+)?def\s+(\w+)")
_CLASS = re.compile(r"^(\s*)class\s+(\w+)")


class MarkerError(ValueError):
    """Unbalanced or nested solution markers; the message names the file and line."""


def _enclosing_function(lines: list[str], index: int, indent: int) -> str | None:
    """The name of the nearest ``def`` above ``index`` that is less indented, with its
    class for a method (``RowParallelLinear.forward``: a file may hold several
    ``forward``)."""
    names: list[str] = []
    for line in reversed(lines[:index]):
        m = _DEF.match(line) or (_CLASS.match(line) if names else None)
        if m and len(m.group(1)) < indent:
            names.insert(0, m.group(2))
            indent = len(m.group(1))
            if _CLASS.match(line) or indent == 0:
                break
    return ".".join(names) or None


def _hints(block: list[str]) -> list[str]:
    """The hint lines of a solution block: each ``# HINT:`` and the ``#`` lines after it."""
    out: list[str] = []
    taking = False
    for line in block:
        text = line.strip()
        if text.startswith(HINT):
            out.append(text[len(HINT):].strip())
            taking = True
        elif taking and text.startswith("#") and not text.startswith("###"):
            out.append(text.lstrip("#").strip())
        else:
            taking = False
    return out


def _blank(indent: str, function: str | None, name: str, path: str) -> list[str]:
    """The lines that replace a solution block: a raise that says how to ask for a hint."""
    where = f"{function} in {path}" if function else path
    message = (f"{where} is not implemented yet. Hint: ask for one with "
               f"hint({name!r}, 1) (a nudge), 2 (the method) or 3 (the answer), "
               f"from exercises.course")
    out = [f"{indent}{BLANK_MARK}\n", f"{indent}raise NotImplementedError(\n"]
    pieces = textwrap.wrap(message, 72, drop_whitespace=False)
    for k, piece in enumerate(pieces):
        end = ")" if k == len(pieces) - 1 else ""
        out.append(f"{indent}    {piece!r}{end}\n")
    return out


_BUG_LINE = re.compile(r"^### PLANTED BUG(?: (\d+))?$")
VARIANT_HINT = re.compile(r"^# HINT\((\d+)\):")


def _bug_sections(block: list[str]) -> tuple[list[str], dict[int, list[str]]]:
    """A block's fix (the lines before its first bug marker) and its bug sections by
    variant (``### PLANTED BUG`` is variant 1)."""
    fix: list[str] = []
    bugs: dict[int, list[str]] = {}
    current: list[str] = fix
    for line in block:
        m = _BUG_LINE.match(line.strip())
        if m:
            current = bugs.setdefault(int(m.group(1) or 1), [])
        else:
            current.append(line)
    return fix, bugs


def variants(text: str) -> int:
    """How many bug variants a lab's solution file plants (0: not a lab)."""
    found = {int(m.group(1) or 1) for line in text.splitlines()
             if (m := _BUG_LINE.match(line.strip()))}
    return max(found, default=0)


def _planted(block: list[str], indent: str, variant: int = 1) -> list[str] | None:
    """What replaces a lab's block in variant ``variant``: that variant's bug lines,
    uncommented, or the fix without its hints where the block has no such bug; None for
    a block that plants nothing (an exercise's blank)."""
    fix, bugs = _bug_sections(block)
    if not bugs:
        return None
    if variant not in bugs:
        hints = _hint_lines(fix)
        return [line for k, line in enumerate(fix) if k not in hints]
    out = []
    for line in bugs[variant]:
        stripped = line.strip()
        if VARIANT_HINT.match(stripped):
            continue
        body = stripped[2:] if stripped.startswith("# ") else stripped.lstrip("#")
        out.append(f"{indent}{body}\n" if body else "\n")
    return out


def _hint_lines(block: list[str]) -> set[int]:
    """The indices of the lines of ``block`` that belong to a ``# HINT:`` comment (the
    marker line and the ``#`` lines right after it)."""
    out, taking = set(), False
    for k, line in enumerate(block):
        text = line.strip()
        if text.startswith(HINT):
            out.add(k)
            taking = True
        elif taking and text.startswith("#") and not text.startswith("###"):
            out.add(k)
        else:
            taking = False
    return out


def strip_solutions(text: str, exercise_path: str, name: str = "", variant: int = 1) -> str:
    """The exercise version of a solution file's text (markers replaced by blanks, or a
    lab's blocks by the bug of ``variant``)."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == END:
            raise MarkerError(f"{exercise_path}:{i + 1}: {END} without {BEGIN}")
        if line.strip() != BEGIN:
            out.append(line)
            i += 1
            continue
        start = i
        indent = line[: len(line) - len(line.lstrip())]
        i += 1
        while i < len(lines) and lines[i].strip() not in (BEGIN, END):
            i += 1
        if i == len(lines) or lines[i].strip() == BEGIN:
            raise MarkerError(f"{exercise_path}:{start + 1}: {BEGIN} is not closed by {END}")
        block = lines[start + 1:i]
        function = _enclosing_function(lines, start, len(indent))
        planted = _planted(block, indent, variant)
        name = name or Path(exercise_path).stem
        out.extend(planted if planted is not None else
                   _blank(indent, function, name, exercise_path))
        i += 1
    return "".join(out)


CHECK_SHIM = '''"""Check your exercises: ``check("ring_allreduce")``, or ``check()`` for all.

The checker and its cases live once, in ``solutions/check.py`` and ``solutions/checks/``;
these functions run them on your code in ``exercises/`` (``impl="solutions"`` checks the
reference instead).
"""

from solutions import check as _checker
from solutions.check import EXERCISES, CheckResult, Report  # noqa: F401


def load(name, impl="exercises"):
    return _checker.load(name, impl)


def run_one(name, impl="exercises", timeout=None, raise_errors=False):
    return _checker.run_one(name, impl, timeout, raise_errors)


def check(name=None, impl="exercises", timeout=None, raise_errors=False):
    return _checker.check(name, impl, timeout, raise_errors)


def overview(impl="exercises"):
    return _checker.overview(impl)
'''


COURSE_SHIM = '''"""The course's helpers: ``hint``, ``predict``, puzzle scores, and the checks of
what the lessons' runs show.

They live once, in ``solutions/course.py`` (no answers in them to blank out); this module
gives them (its ``__all__``) to lessons under the ``exercises`` package.
"""

from solutions.course import *  # noqa: F403
from solutions.course import __all__  # noqa: F401
'''

# Plain modules (no blanks) the exercises package reaches through a few lines of
# re-export rather than a second copy.
SHIMS = {"check.py": CHECK_SHIM, "course.py": COURSE_SHIM}


def _generated(rel: str) -> bool:
    """Whether ``solutions/<rel>`` has a counterpart in exercises/ (the cases do not)."""
    return not rel.startswith("checks/")


def generate(src: Path, solutions: Path, variant: int = 1) -> str:
    """The generated text of ``exercises/<rel>`` for the solution file ``src`` (a lab's
    bug ``variant``; the first unless asked)."""
    rel = src.relative_to(solutions).as_posix()
    text = src.read_text()
    src_name = f"solutions/{rel}"
    if rel in SHIMS:
        return PLAIN_HEADER.format(src=src_name) + SHIMS[rel]
    if not any(line.strip() in (BEGIN, END) for line in text.splitlines()):
        return PLAIN_HEADER.format(src=src_name) + text
    name = rel.removesuffix(".py").replace("/", ".")
    body = strip_solutions(text, f"exercises/{rel}", name, variant)
    n = variants(text)
    if not n:
        return HEADER.format(src=src_name, name=name) + body
    more = (f"# Bug {variant} of {n}: another_bug(\"{name}\") (from exercises.course) plants "
            "the next.\n") if n > 1 else ""
    return LAB_HEADER.format(src=src_name, name=name) + more + body


def expected_files(root: Path = ROOT) -> dict[Path, str]:
    """{path under exercises/: its generated text} for every solution file."""
    solutions = root / "solutions"
    return {root / "exercises" / src.relative_to(solutions): generate(src, solutions)
            for src in sorted(solutions.rglob("*.py"))
            if "__pycache__" not in src.parts
            and _generated(src.relative_to(solutions).as_posix())}


def drift(root: Path = ROOT) -> list[str]:
    """What differs between exercises/ and what the generator would write (empty: none)."""
    expected = expected_files(root)
    problems = []
    for path, text in expected.items():
        rel = path.relative_to(root)
        if not path.exists():
            problems.append(f"{rel} is missing")
        elif path.read_text() != text:
            problems.append(f"{rel} differs from its generated version")
    for path in sorted((root / "exercises").rglob("*.py")):
        if "__pycache__" not in path.parts and path not in expected:
            problems.append(f"{path.relative_to(root)} has no source in solutions/")
    return problems


def _has_learner_work(old: str, new: str) -> bool:
    """Whether ``old`` (a file about to be overwritten) holds answers ``new`` would lose.

    A file that still has at least as many blanks as the new version is taken to be an
    older generated copy (the solutions changed); one with fewer blanks has answers.
    """
    return BLANK_MARK in new and old.count(BLANK_MARK) < new.count(BLANK_MARK)


def write(root: Path = ROOT) -> list[str]:
    """Write exercises/, keeping a learner's answers as ``.bak``. Returns what changed."""
    changed = []
    for path, text in expected_files(root).items():
        old = path.read_text() if path.exists() else None
        if old == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if old is not None and _has_learner_work(old, text):
            path.with_name(path.name + ".bak").write_text(old)
            print(f"kept your answers in {path.relative_to(root)}.bak")
        path.write_text(text)
        changed.append(str(path.relative_to(root)))
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="report drift and exit 1 instead of writing")
    args = parser.parse_args(argv)
    if args.check:
        problems = drift()
        for p in problems:
            print(p)
        if problems:
            print("run `make exercises` to regenerate exercises/ from solutions/")
        return 1 if problems else 0
    changed = write()
    print("\n".join(f"wrote {c}" for c in changed) or "exercises/ is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
