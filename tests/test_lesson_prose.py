"""A lesson's prose states no figure its cells compute: such figures are rendered.

Every number in a lesson's markdown (and in the literal text of its ``say(...)`` calls,
the prose cells rendered from computed values) must be one of

* a reference, not a quantity: an arXiv id, a year, a lesson or section number, a
  heading's number, anything inside a code span;
* an input the learner can see: a numeric literal of the lesson's code cells (``dp=8``,
  ``microbatches=192``), or a small count (0-10) without a unit;
* a constant declared for that lesson in ``notebooks/prose_numbers.json``, with where it
  comes from (a data sheet, a paper, a measurement in ``docs/benchmarks.md``); a
  percentage is declared as ``"45 %"`` and a bare ``"45"`` does not cover it.

Anything else is a figure some cell computes, typed by hand, which goes stale the day the
computation changes (the planner's choice, a measured byte count): the lesson must render
it with ``say(f"...")`` from the value. Percentages and figures with a unit (GB, s, ...)
are never accepted as mere code inputs: "12 %" or "34 GB" is not vouched for by a ``12``
or a ``34`` somewhere in the code.
The mutation test below feeds sentences that once contradicted their outputs and requires
every stale figure to be flagged.

The lesson 07 layout puzzle is checked against the planner itself: its premise holds
(the balanced layout fits the cap but is too slow, the planner's favourite is fast but
over the cap) and the answer ``docs/instructor.md`` gives passes the budget.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
DECLARED = ROOT / "notebooks" / "prose_numbers.json"

NUMBER = re.compile(r"(?<![\w.\-/+])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)(?![\w])(?!\.\d)")
UNIT = re.compile(r"\s?(?:%|GB|GiB|MB|MiB|kB|KB|TB|B\b|bytes?\b|s\b|ms\b|µs\b|us\b|"
                  r"TFLOP/s|GB/s|GT/s|days?\b|h\b|hours?\b|min\b|x\b|×\s*(?:faster|slower|"
                  r"more|less|the))")
REFERENCE = re.compile(
    r"`[^`]*`"                                   # code spans are code
    r"|arXiv:? ?\d{4}\.\d{4,5}(?:v\d)?"          # papers
    r"|\b(?:19|20)\d\d[a-z]?\b"                  # years
    r"|\b[Ll]essons? \d\d(?:\s*(?:[–-]|and|,)\s*\d\d)*"
    r"|§\s?\d+(?:\.\d+)?(?:\s*[–-]\s*\d+)?"
    r"|\b(?:[Ss]ections?|Table|Figure|Fig\.|[Ee]q\.|[Ee]quation|Algorithm|Appendix|"
    r"[Cc]hapter|[Pp]age|p\.)\s?\(?[A-Z]?\d+(?:\.\d+)*\)?"
    r"|^#+\s*\d+\s*·"                            # a heading's number
    r"|\b\d\d_\w+", re.MULTILINE)


def _plain(x: str) -> float:
    return float(x.replace(",", ""))


def prose_numbers(text: str) -> list[tuple[str, str, str]]:
    """(number, its unit: "%", "unit" or "", context) for each quantity ``text`` states."""
    text = REFERENCE.sub(" ", text)
    out = []
    for m in NUMBER.finditer(text):
        unit = UNIT.match(text, m.end())
        kind = "" if not unit else "%" if unit.group().strip() == "%" else "unit"
        out.append((m.group(1), kind, text[max(0, m.start() - 40):m.end() + 12]))
    return out


def _code(source: str) -> ast.AST | None:
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def code_inputs(sources: list[str]) -> set[float]:
    """The numeric literals of the code cells (inputs the learner reads in the code)."""
    out: set[float] = set()
    for tree in filter(None, map(_code, sources)):
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                    and not isinstance(node.value, bool):
                out.add(float(node.value))
    return out


def said(sources: list[str]) -> list[str]:
    """The literal text of every ``say(...)`` call (the f-strings' fixed parts)."""
    out = []
    for tree in filter(None, map(_code, sources)):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "say":
                for arg in node.args:
                    parts = arg.values if isinstance(arg, ast.JoinedStr) else [arg]
                    out.append(" ".join(p.value for p in parts
                                        if isinstance(p, ast.Constant)
                                        and isinstance(p.value, str)))
    return out


def stale_figures(prose: list[str], inputs: set[float], declared: dict[str, str]
                  ) -> list[str]:
    """The numbers of ``prose`` that are neither references, inputs nor declared."""
    allowed = {_plain(k) for k in declared if not k.endswith("%")}
    percents = {_plain(k.removesuffix("%").strip()) for k in declared if k.endswith("%")}
    bad = []
    for text in prose:
        for number, unit, context in prose_numbers(text):
            value = _plain(number)
            if value in (percents if unit == "%" else allowed):
                continue
            if not unit and value in inputs:
                continue
            if not unit and value == int(value) and 0 <= value <= 10:
                continue
            bad.append(f"{number!r} in ...{' '.join(context.split())}...")
    return bad


def _lesson(path: Path) -> tuple[list[str], list[str]]:
    cells = json.loads(path.read_text())["cells"]
    text = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    return text, code


def _declared() -> dict[str, dict[str, str]]:
    return json.loads(DECLARED.read_text())


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem[:2] for p in LESSONS])
def test_prose_states_no_computed_figure(path: Path) -> None:
    markdown, code = _lesson(path)
    declared = _declared().get(path.stem[:2], {})
    bad = stale_figures(markdown + said(code), code_inputs(code), declared)
    assert not bad, (f"{path.name}: figures typed into the prose. Render each from the value "
                     "that computes it (say(f'...')), or declare a true constant with its "
                     "source in notebooks/prose_numbers.json:\n  " + "\n  ".join(bad))


def test_every_declared_constant_is_used() -> None:
    for lesson, numbers in _declared().items():
        if lesson.startswith("_"):
            continue
        path = next((ROOT / "notebooks").glob(f"{lesson}_*.ipynb"))
        markdown, code = _lesson(path)
        stated = {_plain(n) for text in markdown + said(code) for n, _, _ in
                  prose_numbers(text)}
        unused = [k for k, why in numbers.items()
                  if _plain(k.removesuffix("%").strip()) not in stated]
        assert not unused, f"{path.name}: declared but never stated: {unused}"
        assert all(why.strip() for why in numbers.values()), f"{lesson}: a source is empty"


def test_the_check_flags_figures_that_once_contradicted_their_outputs() -> None:
    """Sentences the lessons once printed under outputs that said otherwise."""
    inputs = code_inputs(["plan('gpt-13b', 'a100x64', 1024)\nlay = dict(dp=8, pp=16, tp=8)\n"
                          "x = 4 + 4 + 12\nGB = 1e9"])
    stale = {
        "brings memory down to 27 GB.": "27",
        "its estimate for 4 × 4 × 4 is about 12 % slower.": "12",
        "estimated about 2 % slower than the planner's best": "2",
        "**62 % here, 45 % above?**": "62",
        "The balanced layout fits but takes 15.1 s; the favourite needs 72 GB.": "15.1",
        "instead of 441,348 bytes": "441,348",
        "measured a peak of 37.7 GiB per GPU": "37.7",
    }
    for sentence, number in stale.items():
        flagged = stale_figures([sentence], inputs, {"45 %": "a claim", "12": "bytes"})
        assert any(f.startswith(repr(number)) for f in flagged), (sentence, flagged)
    fine = ["Open `exercises/zero1.py` (lesson 02, § 3; arXiv 1910.02054, 2020).",
            "## 4 · The planner", "on dp = 8, pp = 16 with 2 + 2 + 12 bytes", "two of 3 ranks"]
    assert stale_figures(fine, inputs, {"12": "bytes"}) == []
    assert said(['say(f"the best is {x:.1f} GB, about 12 % slower")']) == \
        ["the best is   GB, about 12 % slower"]


# --- lesson 07's layout puzzle ---------------------------------------------------------

def _instructor_answer(lesson: str = "07") -> dict:
    """The layout docs/instructor.md gives for a lesson's puzzle (its ``dict(...)``)."""
    text = (ROOT / "docs" / "instructor.md").read_text()
    m = re.search(rf"lesson {lesson} puzzle answer:\s*`(dict\([^`]*\))`", text)
    assert m, f"docs/instructor.md gives lesson {lesson}'s puzzle answer as `dict(...)`"
    call = ast.parse(m.group(1), mode="eval").body
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords}


def test_layout_puzzle_premise_holds_and_the_instructor_answer_passes(capsys) -> None:
    from solutions.course import LAYOUT_PUZZLE, layout_puzzle, score_layout

    p = layout_puzzle()
    cap, target = LAYOUT_PUZZLE["memory_cap"], LAYOUT_PUZZLE["step_target"]
    balanced, favourite = p["balanced"], p["favourite"]
    assert balanced.memory["total"] <= cap < favourite.memory["total"]
    assert favourite.step_time <= target < balanced.step_time
    result = score_layout(_instructor_answer(), **LAYOUT_PUZZLE)
    assert result["passed"], result
    assert "PASS" in capsys.readouterr().out


def test_moe_puzzle_premise_holds_and_the_instructor_answer_passes(capsys) -> None:
    """Lesson 09: the planner's favourite is over the cap, every layout that keeps all
    experts on each rank (ep = 1) within the cap is too slow, and the answer passes."""
    from solutions.course import moe_puzzle, score_layout

    p = moe_puzzle()
    cap, target = p["puzzle"]["memory_cap"], p["puzzle"]["step_target"]
    assert p["favourite"].memory["total"] > cap
    assert p["replicated"] is not None and p["replicated"].step_time > target
    result = score_layout(_instructor_answer("09"), **p["puzzle"])
    assert result["passed"], result
    assert "PASS" in capsys.readouterr().out


# --- every lesson ends where a learner can go on ----------------------------------------

def test_every_lesson_ends_with_its_summary_and_links_on() -> None:
    """The last markdown cell of a lesson is its summary (what was learned), with a link
    back to the index and one to the next lesson (the file must exist), and the lesson's
    last cell shows the calibration score of the learner's predictions."""
    for k, path in enumerate(LESSONS):
        cells = json.loads(path.read_text())["cells"]
        last_md = "".join([c for c in cells if c["cell_type"] == "markdown"][-1]["source"])
        assert "## Summary" in last_md, path.name
        links = re.findall(r"\]\(([^)\s]+\.ipynb)\)", last_md)
        assert "index.ipynb" in links, f"{path.name}: no link back to the index"
        if k + 1 < len(LESSONS):
            assert LESSONS[k + 1].name in links, f"{path.name}: no link to the next lesson"
        assert all((path.parent / link).exists() for link in links), (path.name, links)
        assert "show_calibration()" in "".join(cells[-1]["source"]), path.name


# --- a prediction is asked before any cell shows its answer --------------------------

def test_gpt3_model_states_are_predicted_before_a_table_prints_them() -> None:
    """Lesson 07 asks for GPT-3's model states per GPU on tp = 8, pp = 16; its table of
    stage 0's bytes by pp prints that figure (with the embeddings), so the table comes
    after the prediction's answer, not before the guess."""
    cells = ["".join(c["source"]) for c in
             json.loads((ROOT / "notebooks" / "07_planning_at_scale.ipynb").read_text())
             ["cells"]]
    ask = next(i for i, s in enumerate(cells) if 'predict("GPT-3 model states per GPU' in s)
    guess = next(i for i, s in enumerate(cells) if s.startswith("my_states_gb = None"))
    shows = [i for i, s in enumerate(cells)
             if 'memory_breakdown("gpt3-175b"' in s and "print(" in s]
    assert shows and guess < ask < min(shows), (guess, ask, shows)


def test_lesson_00_states_the_checkers_limits() -> None:
    """The times lesson 00 gives for a check's hang report are the checker's own."""
    from solutions.check import EXERCISES, HANG_SECONDS
    cells = json.loads((ROOT / "notebooks" / "00_collectives_and_launcher.ipynb")
                       .read_text())["cells"]
    text = " ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    text = " ".join(text.split())
    start, hang = EXERCISES["ring_allreduce"].timeout, HANG_SECONDS
    assert f"no progress for {hang:.0f} s (they get {start:.0f} s to start)" in text
    assert f"ranks get {start:.0f} s to start, then {hang:.0f} s without progress" in text
