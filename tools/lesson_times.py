"""The time each lesson takes a learner, computed from the lesson itself.

The index states a time per lesson. Typed by hand such a figure goes stale the day a
lesson grows, so it is computed here from what a learner does, at stated rates:

* **read** the prose (markdown cells and the text of ``say(...)`` cells) at
  ``PROSE_WPM`` words a minute, and the code cells' words at ``CODE_WPM``;
* **run** the cells: the lesson's execution time top to bottom, measured with
  ``tools/execute_notebook.py`` and kept in ``notebooks/lesson_times.json``;
* **predict**: ``PREDICT_MIN`` per ``predict(...)`` question;
* **exercise**: ``FUNCTION_MIN`` per function the learner writes (the ``functions`` of
  each exercise the lesson checks, ``solutions/check.py``), ``LAB_MIN`` per debugging lab
  (one bug found from its symptoms), ``DESIGN_MIN`` per design task graded by a
  ``score_...(...)`` call (a schedule, a layout, the capstone's job).

Each lesson is rounded up to 5 minutes; the index page's own time joins the total.

    python tools/lesson_times.py            # the table of estimates, term by term
    python tools/lesson_times.py --write    # put them into notebooks/index.ipynb
    python tools/lesson_times.py --check    # exit 1 if the index states other times
    python tools/lesson_times.py --measure  # re-time every notebook (minutes, 2 cores)
    python tools/lesson_times.py --measure notebooks/03_zero_3.ipynb  # or only some
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
INDEX = NOTEBOOKS / "index.ipynb"
MEASURED = NOTEBOOKS / "lesson_times.json"

PROSE_WPM = 150   # technical prose, read to be understood (the usual 200-250 is for fiction)
CODE_WPM = 75     # code is read at half that: every name is looked up
PREDICT_MIN = 2   # read the question, work out a number, type it, compare
FUNCTION_MIN = 8  # a first attempt at one function, with a hint or two
LAB_MIN = 15      # read the symptoms, localise the bug, fix it, re-check
DESIGN_MIN = 10   # a schedule, a layout or a job under a budget, scored
ROUND_MIN = 5

ROW = re.compile(r"^\| (?P<n>\d\d) \| \[[^\]]+\]\((?P<file>[^)]+\.ipynb)\) \|.*\| "
                 r"(?P<min>\d+) min \|$", re.MULTILINE)
TOTAL = re.compile(r"About (?P<h>[\d.]+) hours in all, with this page")


def lessons() -> list[Path]:
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _said(code: str) -> str:
    """The literal text of a cell's ``say(...)`` calls (rendered prose)."""
    try:
        tree = ast.parse("\n".join(line for line in code.splitlines()
                                   if not line.lstrip().startswith(("%", "!"))))
    except SyntaxError:
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "say":
            for arg in node.args:
                for v in (arg.values if isinstance(arg, ast.JoinedStr) else [arg]):
                    if isinstance(v, ast.Constant) and isinstance(v.value, str):
                        parts.append(v.value)
                    elif isinstance(v, ast.FormattedValue):
                        parts.append("N")  # a rendered value reads as one word
    return " ".join(parts)


def activities(path: Path) -> dict:
    """What a learner meets in a lesson: words to read, questions, exercises."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from solutions.check import EXERCISES

    cells = _cells(path)
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    prose = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    prose += [_said(s) for s in code]
    said_cells = [s for s in code if _said(s)]
    joined = "\n".join(code)
    checked = re.findall(r"\bcheck\(\"(\w+)\"", joined)
    return {
        "prose_words": sum(len(s.split()) for s in prose),
        "code_words": sum(len(s.split()) for s in code if s not in said_cells),
        "predictions": len(re.findall(r"\bpredict\(", joined)),
        "functions": sum(len(EXERCISES[n].functions) for n in checked
                         if not n.startswith("debug_")),
        "labs": sum(1 for n in checked if n.startswith("debug_")),
        "designs": len(re.findall(r"\bscore_\w+\(", joined)),
    }


def measured_seconds() -> dict[str, float]:
    return json.loads(MEASURED.read_text())["seconds"]


def estimate(path: Path, seconds: dict[str, float] | None = None) -> dict:
    """Minutes per term and the lesson's total, rounded up to ``ROUND_MIN``."""
    seconds = measured_seconds() if seconds is None else seconds
    a = activities(path)
    terms = {
        "read": a["prose_words"] / PROSE_WPM + a["code_words"] / CODE_WPM,
        "run": seconds[path.name] / 60,
        "predict": a["predictions"] * PREDICT_MIN,
        "exercise": (a["functions"] * FUNCTION_MIN + a["labs"] * LAB_MIN
                     + a["designs"] * DESIGN_MIN),
    }
    raw = sum(terms.values())
    return {**a, **terms, "minutes": ROUND_MIN * math.ceil(raw / ROUND_MIN - 1e-9)}


def table() -> tuple[dict[str, int], int]:
    """Minutes per lesson file, and the course's total (index page included)."""
    seconds = measured_seconds()
    per = {p.name: estimate(p, seconds)["minutes"] for p in lessons()}
    return per, sum(per.values()) + estimate(INDEX, seconds)["minutes"]


def _hours(total_min: int) -> str:
    return f"{total_min / 60:.1f}"


def method() -> list[str]:
    """The phrases by which the index states the rates above (checked there)."""
    return [f"{PROSE_WPM} words a minute", f"its code at {CODE_WPM}",
            f"{PREDICT_MIN} minutes per prediction", f"{FUNCTION_MIN} per function",
            f"{LAB_MIN} per debugging lab", f"{DESIGN_MIN} per design puzzle",
            f"rounded up to {ROUND_MIN} minutes"]


def check(text: str | None = None) -> list[str]:
    """What the index states that the computation does not give (empty: all true)."""
    text = "".join(_cells(INDEX)[0]["source"]) if text is None else text
    per, total = table()
    stated = {m["file"]: int(m["min"]) for m in ROW.finditer(text)}
    problems = [f"{name}: the index states {stated.get(name)} min, the estimate is {want}"
                for name, want in per.items() if stated.get(name) != want]
    problems += [f"{name}: in the index's table, not a lesson" for name in stated
                 if name not in per]
    flat = " ".join(text.split())
    problems += [f"the index does not say the method: {phrase!r}" for phrase in method()
                 if phrase not in flat]
    m = TOTAL.search(text)
    if not m or m["h"] != _hours(total):
        problems.append(f"the total: the index states {m and m['h']} hours, "
                        f"the estimate is {_hours(total)}")
    return problems


def write() -> None:
    nb = json.loads(INDEX.read_text())
    per, total = table()
    text = "".join(nb["cells"][0]["source"])
    text = ROW.sub(lambda m: m.group(0)[:m.start("min") - m.start()] + f"{per[m['file']]} min |"
                   if m["file"] in per else m.group(0), text)
    text = TOTAL.sub(f"About {_hours(total)} hours in all, with this page", text)
    nb["cells"][0]["source"] = text.splitlines(keepends=True)
    INDEX.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def cell_seconds(executed: dict) -> float:
    """The seconds a notebook's cells ran, from the timings nbclient records in each
    executed cell (``metadata.execution``): the kernel's start is not the learner's."""
    from datetime import datetime

    total = 0.0
    for c in executed["cells"]:
        times = c.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in times and "shell.execute_reply" in times:
            start, end = (datetime.fromisoformat(times[k].replace("Z", "+00:00"))
                          for k in ("iopub.execute_input", "shell.execute_reply"))
            total += (end - start).total_seconds()
    return total


def measure(paths: list[Path] | None = None) -> None:
    """Execute notebooks (default: every lesson and the index) one after another; keep
    each one's cell seconds in ``notebooks/lesson_times.json`` as soon as it is timed."""
    data = json.loads(MEASURED.read_text()) if MEASURED.exists() else {}
    seconds = data.setdefault("seconds", {})
    with tempfile.TemporaryDirectory() as out:
        for path in paths or [*lessons(), INDEX]:
            subprocess.run([sys.executable, str(ROOT / "tools" / "execute_notebook.py"),
                            "--timeout", "180", "--output-dir", out, str(path)], check=True)
            executed = json.loads((Path(out) / path.name).read_text())
            seconds[path.name] = round(cell_seconds(executed))
            data["seconds"] = dict(sorted(seconds.items()))
            MEASURED.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
            print(f"{path.name}: {seconds[path.name]} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="update notebooks/index.ipynb")
    mode.add_argument("--check", action="store_true", help="exit 1 if the index is stale")
    mode.add_argument("--measure", nargs="*", metavar="NOTEBOOK",
                      help="re-time these notebooks (none named: every one)")
    args = parser.parse_args(argv)
    if args.measure is not None:
        measure([Path(p).resolve() for p in args.measure])
    if args.write:
        write()
    if args.check:
        problems = check()
        print("\n".join(problems) or "notebooks/index.ipynb: every time as estimated")
        return 1 if problems else 0
    seconds = measured_seconds()
    print(f"{'lesson':<36} {'words':>6} {'code':>5} {'pred':>4} {'fn':>3} {'lab':>3} "
          f"{'dsgn':>4} {'read':>5} {'run':>4} {'ex':>4} {'min':>4}")
    for path in [*lessons(), INDEX]:
        e = estimate(path, seconds)
        print(f"{path.name:<36} {e['prose_words']:>6} {e['code_words']:>5} "
              f"{e['predictions']:>4} {e['functions']:>3} {e['labs']:>3} {e['designs']:>4} "
              f"{e['read']:>5.1f} {e['run']:>4.1f} {e['exercise']:>4} {e['minutes']:>4}")
    print(f"total: {table()[1]} min = {_hours(table()[1])} h")
    return 0


if __name__ == "__main__":
    sys.exit(main())
