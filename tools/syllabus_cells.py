"""Keep the cell numbers of ``docs/syllabus_map.md`` true to the notebooks.

The map says where each topic is taught as *lesson § section (cell n)*, cells counted from
0 in notebook order, as JupyterLab shows them. Lessons grow, and a number that was right
points at the wrong cell after a cell is inserted above it. This tool

* prints each lesson's outline: its sections (``## ...`` headings) with their cell ranges
  and the first line of every cell, to find the number a reference should have;
* with ``--check``, reads every reference of the map's tables and fails when a cell does
  not exist or lies outside the section the reference names (``02 § 2 (cells 9-11)``:
  cells 9 to 11 must lie in section 2 of lesson 02; ``§ 1-2`` allows either section;
  ``Summary`` and ``introduction`` are sections too; a reference with no section, such
  as ``exercise `zero1` (cells 25-28)``, must only exist).

    python tools/syllabus_cells.py 02        # the outline of lesson 02 (or: all)
    python tools/syllabus_cells.py --check   # exit 1 if a reference is out of place
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "syllabus_map.md"

# a lesson ("02", "index"), a section after it or alone ("§ 2", "§ 2–3", "Summary",
# "introduction"), the word "exercise" (its cells need no section), or cells ("cell 4",
# "cells 4–6")
TOKEN = re.compile(
    r"(?P<lesson>\b(?:0\d|10|index)\b)(?=\s*(?:§|Summary|introduction|\(|,|cells?\b))"
    r"|§\s*(?P<s1>\d+)(?:\s*[–-]\s*(?P<s2>\d+))?"
    r"|\b(?P<named>Summary|introduction)\b|\b(?P<exercise>exercise)\b"
    r"|\bcells?\s+(?P<a>\d+)(?:\s*[–-]\s*(?P<b>\d+))?")


def notebook(lesson: str) -> Path:
    if lesson == "index":
        return ROOT / "notebooks" / "index.ipynb"
    return next((ROOT / "notebooks").glob(f"{lesson}_*.ipynb"))


def sources(lesson: str) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(notebook(lesson).read_text())["cells"]]


def sections(cells: list[str]) -> dict[str, range]:
    """Section name ("introduction", "1", "2", ..., "Summary") -> its cells. A cell whose
    heading comes after some text belongs to both the section before and its own."""
    starts, ends = [("introduction", 0)], []
    for i, text in enumerate(cells):
        m = re.search(r"^## (\d+|Summary)\b", text, re.MULTILINE)
        if m:
            starts.append((m.group(1), i))
            ends.append(i + 1 if m.start() > 0 else i)
    ends.append(len(cells))
    return {name: range(i, end) for (name, i), end in zip(starts, ends)}


def outline(lesson: str) -> str:
    cells = sources(lesson)
    secs = sections(cells)
    out = [f"{lesson}: {notebook(lesson).name}"]
    for name, span in secs.items():
        out.append(f"  § {name}: cells {span.start}–{span.stop - 1}")
        for i in span:
            first = cells[i].strip().splitlines()[0] if cells[i].strip() else ""
            out.append(f"    {i:>3}  {first[:80]}")
    return "\n".join(out)


def references(text: str) -> list[tuple[int, str, tuple[str, ...] | None, int, int]]:
    """(map line, lesson, sections or None, first cell, last cell) for each reference
    in the table rows of the map's topic and error sections."""
    out = []
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("## 1"))
    for n, line in enumerate(lines[first:], first + 1):
        if not line.startswith("|"):
            continue
        for column in line.split(" | "):
            lesson, secs = None, None
            for m in TOKEN.finditer(column):
                if m.group("lesson"):
                    lesson, secs = m.group("lesson"), None
                elif m.group("s1"):
                    lo, hi = int(m.group("s1")), int(m.group("s2") or m.group("s1"))
                    secs = tuple(str(k) for k in range(lo, hi + 1))
                elif m.group("named"):
                    secs = (m.group("named"),)
                elif m.group("exercise"):
                    secs = None  # an exercise's cells: the lesson's exercise sections
                elif lesson is not None:
                    a = int(m.group("a"))
                    out.append((n, lesson, secs, a, int(m.group("b") or a)))
    return out


def check(text: str) -> list[str]:
    problems, cache = [], {}
    for n, lesson, secs, a, b in references(text):
        if lesson not in cache:
            cells = sources(lesson)
            cache[lesson] = (len(cells), sections(cells))
        count, spans = cache[lesson]
        where = f"line {n}: {lesson} {'§ ' + '–'.join(secs) if secs else ''} cells {a}–{b}"
        if not 0 <= a <= b < count:
            problems.append(f"{where}: the notebook has cells 0–{count - 1}")
        elif secs and not all(any(i in spans.get(s, ()) for s in secs) for i in (a, b)):
            held = ", ".join(f"§ {s} = {spans[s].start}–{spans[s].stop - 1}"
                             for s in secs if s in spans)
            problems.append(f"{where}: outside the section ({held or 'no such section'})")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lesson", nargs="?", default="all", help="00..10, index or all")
    parser.add_argument("--check", action="store_true", help="check the map's references")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(MAP.read_text())
        print("\n".join(problems) or f"{MAP.relative_to(ROOT)}: every reference in place")
        return 1 if problems else 0
    numbered = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    lessons = ([p.name[:2] for p in numbered] + ["index"]
               if args.lesson == "all" else [args.lesson])
    print("\n\n".join(outline(lesson) for lesson in lessons))
    return 0


if __name__ == "__main__":
    sys.exit(main())
