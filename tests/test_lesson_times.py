"""The index's time per lesson is computed from the lesson, never typed.

``tools/lesson_times.py`` estimates a learner's time from each lesson's words, code,
predictions, exercises and measured execution time, at rates the index states. These
tests fail when a lesson changes and the index was not rewritten
(``python tools/lesson_times.py --write``), when a lesson has no measured execution time
(``--measure``), and show that the check itself catches a stale figure.
"""

from __future__ import annotations

import json

from _scripts import load_script


def _tool():
    return load_script("tools/lesson_times.py")


def _index_text(tool) -> str:
    return "".join(json.loads(tool.INDEX.read_text())["cells"][0]["source"])


def test_every_notebook_has_a_measured_execution_time() -> None:
    tool = _tool()
    names = {p.name for p in tool.lessons()} | {"index.ipynb"}
    assert set(tool.measured_seconds()) == names, "python tools/lesson_times.py --measure"
    assert all(0 < s < 600 for s in tool.measured_seconds().values())


def test_the_index_states_the_computed_times() -> None:
    tool = _tool()
    text = _index_text(tool)
    assert len(list(tool.ROW.finditer(text))) == len(tool.lessons())
    assert tool.check(text) == [], "python tools/lesson_times.py --write"


def test_the_check_catches_a_stale_time_and_a_stale_rate() -> None:
    tool = _tool()
    text = _index_text(tool)
    row = next(tool.ROW.finditer(text))
    minutes = int(row["min"])
    stale = text.replace(row.group(0), row.group(0).replace(f"| {minutes} min |",
                                                            f"| {minutes + 5} min |"))
    assert any(row["file"] in p for p in tool.check(stale))
    assert any("total" in p for p in tool.check(text.replace(" hours in all", "0 hours in all")))
    wrong_rate = " ".join(text.split()).replace(f"{tool.PROSE_WPM} words", "200 words")
    assert any("method" in p for p in tool.check(wrong_rate))


def test_the_estimate_counts_what_the_learner_does(tmp_path) -> None:
    """A lesson of 300 words, one prediction and an exercise of two functions: 2 min of
    reading, 2 of predicting, 16 of writing, plus its measured run."""
    tool = _tool()
    nb = {"cells": [
        {"cell_type": "markdown", "source": ["word " * 300]},
        {"cell_type": "code", "source": ['with predict("q", my_q, 1.0):\n    pass\n']},
        {"cell_type": "code", "source": ['report = check("zero1")\n']},
    ]}
    path = tmp_path / "99_made_up.ipynb"
    path.write_text(json.dumps(nb))
    e = tool.estimate(path, {path.name: 60})
    assert (e["prose_words"], e["predictions"], e["functions"], e["labs"]) == (300, 1, 2, 0)
    assert e["read"] >= 300 / tool.PROSE_WPM and e["run"] == 1.0
    raw = e["read"] + e["run"] + tool.PREDICT_MIN + 2 * tool.FUNCTION_MIN
    assert e["minutes"] % tool.ROUND_MIN == 0 and raw <= e["minutes"] < raw + tool.ROUND_MIN
