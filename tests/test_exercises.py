"""The exercises: solutions pass, blanks fail cleanly, the checker catches mistakes,
and exercises/ is exactly what tools/make_exercises.py makes from solutions/.

    pytest tests/test_exercises.py                    # CI: the reference solutions
    pytest tests/test_exercises.py --impl exercises   # a learner: your own code

With ``--impl exercises`` each exercise passes only once you have filled it in, and the
drift test checks that your files still define what the lessons import (instead of
demanding they equal the generated blanks, which your answers no longer do).
"""

from __future__ import annotations

import ast
import math
import re
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest tests/...` does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

from _scripts import load_script  # noqa: E402

from solutions.check import EXERCISES, check, run_one  # noqa: E402


def _load_generator():
    return load_script("tools/make_exercises.py")


gen = _load_generator()


@pytest.fixture
def impl(request) -> str:
    return request.config.getoption("--impl")


def _package(root: Path, name: str, files: dict[str, str]) -> str:
    """Write an importable package ``name`` under ``root`` (already on sys.path)."""
    pkg = root / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    return name


# --- every exercise, against the chosen package ------------------------------------
@pytest.mark.parametrize("name", list(EXERCISES))
def test_exercise_passes_its_check(name: str, impl: str, capsys) -> None:
    report = check(name, impl=impl)
    printed = capsys.readouterr().out
    if not report.passed:  # the checker's own words, without a pytest traceback
        pytest.fail(printed, pytrace=False)
    assert printed.startswith(f"PASS  {name}: ")


# --- the generated blanks fail cleanly (built fresh from solutions/, not your copy) -
# A lab's report gives the symptom (the hang, the ratio, the differing parameters) and
# never the fix: none of the words after "never" may appear in it.
LABS = {"debug_deadlock": ["FAIL", "ring_all_gather finished; then ring_sum hung",
                           "inside recv on world with rank"],
        "debug_pipeline": ["FAIL", "m=4: gradient norm expected", "(one process), got",
                           "gradients are 2x the reference: 2 = pp"],
        "debug_sp": ["FAIL", "14 of 29 gradients differ from one process",
                     "worst ln_f.bias: off by"]}
NEVER = ["isend", "exchange()", "loss_scale", "1 / m", "divided by m", "microbatch_loss",
         "finish_gradients", "sequence shard", "summed over tp", "dim()"]


@pytest.mark.parametrize("name", [n for n in EXERCISES if n not in LABS])
def test_blank_reports_not_implemented(name: str, tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    blank = gen.generate(ROOT / "solutions" / f"{name}.py", ROOT / "solutions")
    assert gen.HINT not in blank, "hints stay behind hint(), never in the blank"
    pkg = _package(tmp_path, f"blank_{name}", {f"{name}.py": blank})
    result = run_one(name, impl=pkg, timeout=30)
    assert result.status == "todo", str(result)
    assert str(result).startswith(f"TODO  {name}: not implemented yet (")
    assert f"exercises/{name}.py" in result.message
    assert f"hint({name!r}, 1)" in result.hint, "the TODO says how to ask for a hint"


@pytest.mark.parametrize("name", list(LABS))
def test_planted_bug_fails_with_the_audit(name: str, tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    buggy = gen.generate(ROOT / "solutions" / f"{name}.py", ROOT / "solutions")
    assert "NotImplementedError" not in buggy
    assert "BUG" not in buggy and "###" not in buggy, "nothing marks where the bug is"
    pkg = _package(tmp_path, f"bug_{name}", {f"{name}.py": buggy})
    # the deadlock lab's planted hang lasts the whole timeout: 10 s, as the ring mutants'
    # below (a move takes 0.3 s at a load of 6, a stalled rendezvous adds 5 s)
    text = str(run_one(name, impl=pkg, timeout=10 if name == "debug_deadlock" else 30))
    for word in LABS[name]:
        assert word in text, f"{word!r} missing from the report:\n{text}"
    for word in NEVER:
        assert word not in text, f"the report gives the fix away ({word!r}):\n{text}"


# What an exercise asks the learner to derive: none of it may appear in the file the
# learner opens (docstrings included) nor in hint levels 1-2; level 3 is the answer.
GIVEAWAYS = {
    "attention_merge": ["logaddexp", "lse_a - lse", "log(e^lse_a", "e^lse_a + e^lse_b"],
    "pipeline_1f1b": ["pp - r - 1", "p - r - 1", "min(m, pp - r)", "(p-1)/(m+p-1)",
                      "(p - 1) / (m + p - 1)", "warm-up"],
    "memory_formula": ["p - s", "GPipe m", "min(m, p)", "x layers of"],
    "recompute_cheap": ["noted.get(t.data_ptr()", "module.forward(source)",
                        "t.numel() != out.numel()", "as_strided(*"],
    "tp_linear": ["identity forward", "identity backward", "backward all-reduces",
                  "forward all-reduces"],
    "ring_allreduce": ["(rank - s", "one index lower", "it has just added to"],
    "zero1": ["1. reduce-scatter", "reduce-scatter the gradients, step"],
    "moe_dispatch": ["expert * ep + source", "got.sum(1)", "back[order]", "sum(1)"],
}


@pytest.mark.parametrize("name", sorted(GIVEAWAYS))
def test_exercises_state_the_contract_not_the_answer(name: str, capsys) -> None:
    from solutions.course import hint
    text = (ROOT / "exercises" / f"{name}.py").read_text()
    hint(name, 1)
    hint(name, 2)
    asked = capsys.readouterr().out
    for phrase in GIVEAWAYS[name]:
        assert phrase.lower() not in text.lower(), f"exercises/{name}.py gives away {phrase!r}"
        assert phrase.lower() not in asked.lower(), f"hint {name} 1-2 gives away {phrase!r}"
    assert "What the check tests" in text  # the contract includes how it is checked
    hint(name, 3)
    assert capsys.readouterr().out.count("\n") >= 2  # the answer is there when asked


@pytest.mark.parametrize("name", list(EXERCISES))
def test_every_exercise_has_three_hint_levels(name: str, capsys) -> None:
    from solutions.course import HINTS, hint
    assert set(HINTS[name]) == {1, 2}
    for level in (1, 2, 3):
        hint(name, level)
    out = capsys.readouterr().out
    assert out.count(f"{name}, hint ") == 3 and len(out.splitlines()) >= 6


def test_predict_hides_the_answer_until_a_guess_and_keeps_the_score(capsys) -> None:
    """No guess: the answer is not printed (a notebook run top to bottom shows none).
    A guess: printed beside the answer and kept, latest per question, for the calibration
    score in the log domain (conftest points the file at a temporary directory)."""
    from solutions.course import calibration, predict, predictions_path
    assert predict("bytes", None, 1000.0, "B").close is None
    out = capsys.readouterr().out
    assert "1000" not in out and "not answered yet" in out
    assert not predictions_path().exists() and calibration()["answered"] == 0
    assert predict("bytes", 2000, 1000.0, "B").close is False
    assert predict("bytes", 1010, 1000.0, "B").close is True  # replaces the first guess
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "bytes: you predicted 2000 B, the run measured 1000 B (off by 2x)"
    predict("bubble", 0.2, 0.25, by="the simulation gives")
    assert capsys.readouterr().out.endswith("the simulation gives 0.25 (off by 0.8x)\n")
    c = calibration()
    assert c["answered"] == 2 and c["wrong_sign"] == 0
    assert abs(c["mean_log_error"] - (math.log(1010 / 1000) + math.log(1.25)) / 2) < 1e-12
    predict("sign", -1.0, 3.0)
    assert calibration()["wrong_sign"] == 1 and calibration()["answered"] == 3


def test_predict_block_shows_its_output_outside_a_notebook(capsys) -> None:
    """Outside a notebook nothing can be revealed later: the block prints at once, and an
    error inside it still fails the cell."""
    from solutions.course import predict
    with predict("q", None, 4.0):
        print("the table")
    assert "the table" in capsys.readouterr().out
    with pytest.raises(AssertionError), predict("q", None, 4.0):
        raise AssertionError("a failing check inside the block")


def test_predict_box_reveals_only_after_a_number() -> None:
    from minipar.viz.widgets import PredictBox
    seen, shown = [], []
    box = PredictBox("q", "GB", lambda g: seen.append(g) or f"you said {g}, answer 4")
    box.later = type("Captured", (), {"show": lambda self: shown.append(1)})()
    assert box.result.value == ""
    box.press()  # nothing typed: no answer, nothing held back shown
    assert "answer 4" not in box.result.value and seen == [] and shown == []
    box.field.value = "2,000"
    box.press()
    box.press()
    assert seen == [2000.0, 2000.0] and "answer 4" in box.result.value and shown == [1]


def test_show_calibration_reads_the_file(capsys) -> None:
    from solutions.course import calibration, record_prediction, show_calibration
    show_calibration()
    assert "none answered yet" in capsys.readouterr().out
    record_prediction("a", 2.0, 1.0)
    record_prediction("b", 0.5, 1.0)
    show_calibration()
    assert abs(calibration()["factor"] - 2.0) < 1e-12
    assert "2 answered, typically off by a factor of 2.00" in capsys.readouterr().out


def test_lesson_checks_are_exported_and_fail_on_what_the_page_denies() -> None:
    import exercises.course as course
    from solutions.course import __all__ as names
    from solutions.course import check_sharded_build, check_spanning
    assert all(hasattr(course, n) for n in names)
    mb = 2**20
    builds = {"model_bytes": 210 * mb,
              0: {"host_peak_bytes": [235 * mb] * 4, "build_seconds": [2.4] * 4},
              3: {"host_peak_bytes": [80 * mb] * 4, "build_seconds": [0.9] * 4}}
    assert len(check_sharded_build(builds)) == 2
    builds[3]["host_peak_bytes"][2] = 140 * mb  # a ZeRO-3 rank that built too much
    with pytest.raises(AssertionError):
        check_sharded_build(builds)

    def spanning(mesh, dim):  # a wrong one: never crosses a server
        return f"0/{len(mesh.groups(dim))}"
    with pytest.raises(AssertionError):
        check_spanning(spanning)


def test_syllabus_map_cells_point_into_their_sections() -> None:
    tool = load_script("tools/syllabus_cells.py")
    text = tool.MAP.read_text()
    assert len(tool.references(text)) > 80
    assert tool.check(text) == []
    ref = re.search(r"03 § 3 \(cells (\d+)–", text)  # a reference, moved out of § 3
    assert ref and tool.check(text.replace(ref.group(0), "03 § 3 (cells 7–")) != []


# --- the checker catches typical mistakes (mutants of the solution) ----------------
RING_MUTANTS = {
    # name: (text in solutions/ring_allreduce.py, replacement, words the report must say)
    "deadlock": ("exchange(comm, chunks[send_i], right, incoming, left)",
                 "comm.recv(incoming, left); comm.send(chunks[send_i], right)",
                 ["FAIL", "hung", "recv on world"]),
    "forgets_the_wait": ("    pending = comm.isend(send, dst)\n    comm.recv(recv, src)\n"
                         "    pending.wait()\n",
                         "    comm.isend(send, dst)\n    comm.irecv(recv, src)\n",
                         ["FAIL", "ring_reduce_scatter on 2 ranks", "never waited for",
                          "(the first: send on world with rank 1", "call .wait()"]),
    "wrong_send_index": ("send_i, recv_i = (rank - step) % n, (rank - step - 1) % n",
                         "send_i, recv_i = (rank + step) % n, (rank - step - 1) % n",
                         ["FAIL", "on 3 ranks", "not the full sum", "hint:"]),
    "adds_in_all_gather": ("exchange(comm, chunks[send_i], right, chunks[recv_i], left)",
                           "buf = torch.empty_like(chunks[recv_i]); "
                           "exchange(comm, chunks[send_i], right, buf, left); "
                           "chunks[recv_i] += buf",
                           ["FAIL", "ring_all_gather left some chunks wrong"]),
    "receive_buffer_too_small": ("exchange(comm, chunks[send_i], right, chunks[recv_i], left)",
                                 "exchange(comm, chunks[send_i], right, chunks[recv_i][1:], left)",
                                 ["FAIL", "did not fit its receive buffer", "arrived for a"]),
    "copies_instead_of_views": ("torch.tensor_split(t.view(-1), comm.size)",
                                "torch.tensor_split(t.reshape(-1).clone(), comm.size)",
                                ["FAIL", "ring_all_reduce gave a wrong sum"]),
    "calls_all_reduce": ("    owned = ring_reduce_scatter(comm, chunks)\n"
                         "    ring_all_gather(comm, chunks, owned)\n",
                         "    comm.all_reduce(t)\n",
                         ["FAIL", "used ['all_reduce']", "send/recv only"]),
    "raises": ("    owned = ring_reduce_scatter(comm, chunks)\n",
               "    raise TypeError('boom')\n",
               ["FAIL", "raised TypeError: boom", "ring_allreduce.py:",
                "in ring_all_reduce"]),
    "syntax_error": ("def ring_all_reduce(", "def ring_all_reduce((",
                     ["FAIL", "SyntaxError"]),
}


@pytest.mark.parametrize("mutant", list(RING_MUTANTS))
def test_checker_catches_ring_mistakes(mutant: str, tmp_path, monkeypatch) -> None:
    old, new, words = RING_MUTANTS[mutant]
    source = (ROOT / "solutions" / "ring_allreduce.py").read_text()
    assert source.count(old) == 1, f"mutant {mutant} no longer matches the solution"
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg = _package(tmp_path, f"mut_{mutant}", {"ring_allreduce.py": source.replace(old, new)})
    result = run_one("ring_allreduce", impl=pkg, timeout=10)
    text = str(result)
    assert result.status == "fail", text
    for word in words:
        assert word in text, f"{word!r} missing from the report:\n{text}"


def test_a_hang_is_reported_within_seconds_of_the_start(tmp_path, monkeypatch) -> None:
    """The exercise's timeout (30 s for the ring) is the ranks' allowance to start; once
    they have, a deadlock is reported after HANG_SECONDS without progress."""
    from solutions.check import HANG_SECONDS
    old, new, words = RING_MUTANTS["deadlock"]
    source = (ROOT / "solutions" / "ring_allreduce.py").read_text().replace(old, new)
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg = _package(tmp_path, "hang_default", {"ring_allreduce.py": source})
    start = time.monotonic()
    text = str(run_one("ring_allreduce", impl=pkg))  # the exercise's own timeout
    assert time.monotonic() - start < EXERCISES["ring_allreduce"].timeout - 5, text
    assert f"last progress {HANG_SECONDS:.0f} s ago" in text
    for word in words:
        assert word in text, f"{word!r} missing from the report:\n{text}"


# --- exercises/ is what the generator makes --------------------------------------
def test_exercises_match_the_generator(impl: str) -> None:
    if impl == "solutions":
        problems = gen.drift(ROOT)
        assert not problems, "exercises/ drifted from solutions/ (run `make exercises`):\n" \
            + "\n".join(problems)
        return
    # A learner's files differ by their answers; they must still define every name.
    for path, text in gen.expected_files(ROOT).items():
        assert path.exists(), f"{path.relative_to(ROOT)} is missing: `git checkout` it"
        want = _top_level_names(text)
        have = _top_level_names(path.read_text())
        assert want <= have, f"{path.relative_to(ROOT)} lost {sorted(want - have)}"


def _top_level_names(text: str) -> set[str]:
    tree = ast.parse(text)
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}


# --- the generator itself --------------------------------------------------------
def test_generator_replaces_blocks_with_hinted_blanks() -> None:
    src = ("def f(x):\n"
           "    y = 1\n"
           "    ### BEGIN SOLUTION\n"
           "    # HINT: double it,\n"
           "    # then add y.\n"
           "    z = 2 * x\n"
           "    return z + y\n"
           "    ### END SOLUTION\n")
    out = gen.strip_solutions(src, "exercises/m.py")
    assert "2 * x" not in out and "BEGIN" not in out and "y = 1" in out
    namespace: dict = {}
    exec(compile(out, "m.py", "exec"), namespace)
    with pytest.raises(NotImplementedError) as err:
        namespace["f"](3)
    assert str(err.value) == ("f in exercises/m.py is not implemented yet. Hint: ask for "
                              "one with hint('m', 1) (a nudge), 2 (the method) or 3 (the "
                              "answer), from exercises.course")
    assert "double it" not in out  # the hint stays in solutions/, behind hint()


def test_generator_names_a_methods_class() -> None:
    """Two classes with a forward each: the blank says which forward is not written."""
    src = "".join(f"class {c}:\n"
                  "    def forward(self, x):\n"
                  "        ### BEGIN SOLUTION\n"
                  "        return x\n"
                  "        ### END SOLUTION\n\n" for c in ("A", "B"))
    out = gen.strip_solutions(src, "exercises/m.py")
    namespace: dict = {}
    exec(compile(out, "m.py", "exec"), namespace)
    for c in ("A", "B"):
        with pytest.raises(NotImplementedError) as err:
            namespace[c]().forward(1)
        assert str(err.value).startswith(f"{c}.forward in exercises/m.py is not implemented")


def test_generator_plants_a_bug() -> None:
    src = ("def f(m):\n"
           "    ### BEGIN SOLUTION\n"
           "    return 1 / m\n"
           "    ### PLANTED BUG\n"
           "    # return 1.0  # as it comes\n"
           "    ### END SOLUTION\n")
    out = gen.strip_solutions(src, "exercises/m.py")
    assert out == "def f(m):\n    return 1.0  # as it comes\n"  # unmarked


@pytest.mark.parametrize("src", [
    "### BEGIN SOLUTION\nx = 1\n",
    "x = 1\n### END SOLUTION\n",
    "### BEGIN SOLUTION\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n",
])
def test_generator_rejects_unbalanced_markers(src: str) -> None:
    with pytest.raises(gen.MarkerError, match="exercises/m.py:"):
        gen.strip_solutions(src, "exercises/m.py")


def test_every_exercise_has_a_solution_block_and_a_checker() -> None:
    for name, ex in EXERCISES.items():
        text = (ROOT / "solutions" / f"{name}.py").read_text()
        assert gen.BEGIN in text, f"solutions/{name}.py has no solution block"
        assert (ROOT / "solutions" / "checks" / f"{name}.py").exists()
        blank = gen.generate(ROOT / "solutions" / f"{name}.py", ROOT / "solutions")
        assert _top_level_names(blank) >= set(ex.functions)


def test_regenerating_keeps_a_learners_answers(tmp_path) -> None:
    (tmp_path / "solutions").mkdir()
    src = tmp_path / "solutions" / "ex.py"
    src.write_text("def f():\n    ### BEGIN SOLUTION\n    # HINT: one\n    return 1\n"
                   "    ### END SOLUTION\n")
    gen.write(tmp_path)
    ex = tmp_path / "exercises" / "ex.py"
    assert "NotImplementedError" in ex.read_text() and gen.drift(tmp_path) == []
    src.write_text(src.read_text() + "\n\nX = 2\n")  # the author changes the solution
    gen.write(tmp_path)  # an untouched copy is simply replaced
    assert not (tmp_path / "exercises" / "ex.py.bak").exists()
    answered = ex.read_text().replace(gen.BLANK_MARK, "return 1  # mine")
    ex.write_text(answered)  # the learner answers
    assert gen.drift(tmp_path) == ["exercises/ex.py differs from its generated version"]
    src.write_text(src.read_text() + "Y = 3\n")
    gen.write(tmp_path)
    assert (tmp_path / "exercises" / "ex.py.bak").read_text() == answered


# --- checker messages show expected against got ----------------------------------
MESSAGE_MUTANTS = {
    # name: (exercise, text in its solution, replacement, words the report must say)
    "ring_contributions": (
        "ring_allreduce", "send_i, recv_i = (rank - step) % n, (rank - step - 1) % n",
        "send_i, recv_i = (rank + step) % n, (rank - step - 1) % n",
        ["expected chunk 1 to hold the contributions of ranks {0, 1, 2}",
         "chunk 1 holds ranks {0, 2}"]),
    "1f1b_diff": (
        "pipeline_1f1b", "        warm = min(pp - r - 1, microbatches)\n",
        "        warm = min(pp - r, microbatches)\n",
        ["differs from 1F1B at pp=2, m=2, rank 1, position 1: expected B0, got F1",
         "min(pp - r, m) forwards before its first B", "runs 1; yours runs 2"]),
    "1f1b_deadlock": (
        "pipeline_1f1b", "            acts += [Action(\"F\", warm + i, r), Action(\"B\", i, r)]\n",
        "            acts += [Action(\"B\", i, r), Action(\"F\", warm + i, r)]\n",
        ["differs from 1F1B at pp=2, m=1, rank 1, position 0: expected F0, got B0",
         "runs 1; yours runs 0"]),
    "1f1b_chunk": (
        "pipeline_1f1b", "        acts = [Action(\"F\", i, r) for i in range(warm)]\n",
        "        acts = [Action(\"F\", i, 0) for i in range(warm)]\n",
        ["rank 1 (pp=3, m=1): every action's chunk must be the rank's stage, 1; "
         "got chunk 0, 1"]),
    "1f1b_gpipe": (
        "pipeline_1f1b", "        warm = min(pp - r - 1, microbatches)\n",
        "        warm = microbatches\n", ["differs from 1F1B", "that is GPipe's order"]),
    "ddp_world_size": (
        "ddp_buckets", "flat = self.flat[i] / self.comm.size", "flat = self.flat[i]",
        ["your gradients are exactly 2.0x the whole-batch gradient = world size (2)"]),
    "ddp_forgets_the_wait": (
        "ddp_buckets", "            self.pending[i].wait()\n", "",
        ["finish_gradient_sync returned on rank 0 with overlap=True, step 0 with",
         "all-reduces never waited for", "call .wait() on each bucket's Pending"]),
    "ddp_divided_twice": (
        "ddp_buckets", "        self.flat[i] = flat\n",
        "        self.flat[i] = flat = flat / self.comm.size\n",
        ["your gradients are exactly 0.5x the whole-batch gradient = 1 / world size (2)"]),
    "zero1_world_size": (
        "zero1", "self.comm.reduce_scatter(grads) / self.comm.size",
        "self.comm.reduce_scatter(grads)",
        ["step 0 on 2 ranks, rank 0: the gradient your optimizer stepped on",
         "exactly 2.0x the mean gradient's = world size (2)", "divide the reduce-scattered"]),
    "ddp_launch_when_full": (
        "ddp_buckets",
        "        while (self.next_to_launch < len(self.buckets)\n"
        "               and len(self.ready[self.next_to_launch])\n"
        "               == len(self.buckets[self.next_to_launch])):\n"
        "            self._launch(self.next_to_launch)\n"
        "            self.next_to_launch += 1\n",
        "        b = self.bucket_of[id(p)]\n"
        "        if len(self.ready[b]) == len(self.buckets[b]):\n"
        "            self._launch(b)\n"
        "            self.next_to_launch = max(self.next_to_launch, b + 1)\n",
        ["expected all-reduces of buckets [0, 1, 2], got [1, 0, 2]"]),
    "mesh_rank_reversed": (
        "mesh_coords", "    for name in ORDERS[order]:\n        r = r * sizes",
        "    for name in reversed(ORDERS[order]):\n        r = r * sizes",
        ["rank((0, 0, 1)) for dp=1, pp=2, tp=2, order='megatron' is 2; expected 1",
         "rank must undo coords"]),
    "tp_backward_one_gradient": (
        "tp_linear", "        ctx.comm.all_reduce(grad)\n        return grad, None\n",
        "        ctx.comm.all_reduce(grad)\n        return grad\n",
        ["raised RuntimeError: function CopyToTPBackward returned an incorrect number of "
         "gradients (expected 2, got 1)", "the error was raised outside your file",
         "check('tp_linear', raise_errors=True) shows the full traceback"]),
    "merge_averages": (
        "attention_merge", "    return w_a * out_a + w_b * out_b, lse\n",
        "    return (out_a + out_b) / 2, lse\n",
        ["out[1, 1, 2, 3] expected 0.30772, got -0.12402", "you averaged the two parts"]),
    "merge_sum_of_logs": (
        "attention_merge", "    return w_a * out_a + w_b * out_b, lse\n",
        "    return w_a * out_a + w_b * out_b, lse_a + lse_b\n",
        ["lse[1, 0, 4] expected 3.42986, got 5.35390", "not the sum of the logs"]),
    "merge_overflows": (
        "attention_merge", "    lse = torch.logaddexp(lse_a, lse_b)\n",
        "    lse = torch.log(torch.exp(lse_a) + torch.exp(lse_b))\n",
        ["on large scores (log-sum-exps up to 228)", "holds inf or nan",
         "exponentiate only differences"]),
    "merge_no_unsqueeze": (
        "attention_merge", "    return w_a * out_a + w_b * out_b, lse\n",
        "    return (torch.exp(lse_a - lse) * out_a + torch.exp(lse_b - lse) * out_b, lse)\n",
        ["merge_attention raised RuntimeError", "out_a has shape (2, 2, 5, 4)",
         ".unsqueeze(-1)"]),
    "recipe_holds_the_output": (
        "recompute_cheap", "        return module, source, (t.size(), t.stride(), "
        "t.storage_offset())\n",
        "        return module, out, (t.size(), t.stride(), t.storage_offset())\n",
        ["a recipe holds a noted output itself", "keep what makes the output"]),
    "recipe_only_the_same_object": (
        "recompute_cheap", "        if out is None or t.numel() != out.numel() or t.dtype "
        "!= out.dtype:\n",
        "        if t is not out:\n",
        ["one forward made 0 recipes; expected 3", "accept a view of the whole output"]),
    "recipe_from_the_output": (
        "recompute_cheap", "            return module.forward(source).as_strided(*view)\n",
        "            return module.forward(module.forward(source)).as_strided(*view)\n",
        ["gradient of attn.qkv.weight[", "]: expected 2.3174", "(the block keeping "
         "everything), got 2.3174", "(off by "]),
    "recipe_without_size_test": (
        "recompute_cheap", "        if out is None or t.numel() != out.numel() or t.dtype "
        "!= out.dtype:\n",
        "        if out is None or t.dtype != out.dtype:\n",
        ["pack(t) for a tensor that starts at a noted output's address and is longer (64 "
         "elements; the output is its first 32", "expected t itself back, got a recipe",
         "unpack then raised RuntimeError", "as many elements, the same dtype"]),
    "recipe_without_dtype_test": (
        "recompute_cheap", "        if out is None or t.numel() != out.numel() or t.dtype "
        "!= out.dtype:\n",
        "        if out is None or t.numel() != out.numel():\n",
        ["pack(t) for a noted output's bytes seen as int32", "expected t itself back, got a "
         "recipe", "unpack then made torch.float32 of shape (4, 8) where t is torch.int32"]),
    "recipe_ignores_the_strides": (
        "recompute_cheap", "            return module.forward(source).as_strided(*view)\n",
        "            return module.forward(source).reshape(view[0])\n",
        ["unpack(pack(t)) for a transposed view of a noted output (shape (8, 4), strides "
         "(1, 8)): element [0, 1] expected", ", got", "Tensor.as_strided"]),
    "tp_reduce_in_place": (
        "tp_linear", "        out = x.contiguous().clone()\n", "        out = x.contiguous()\n",
        ["ReduceFromTP.forward changed its input in place on 2 ranks, rank 0: x[0, 0, 0] "
         "expected", "(as it was handed over), got", "autograd may still need x itself"]),
    "tp_backward_in_place": (
        "tp_linear", "        grad = grad.contiguous().clone()\n",
        "        grad = grad.contiguous()\n",
        ["CopyToTP.backward changed the gradient it was handed in place on 2 ranks, rank 0: "
         "grad[0, 0, 0] expected", "(as it was handed over), got",
         "an add gives one gradient to both its inputs"]),
    "memory_even_stages": (
        "memory_formula", "    layers = stage_layers(cfg.n_layer, pp, stage)\n",
        "    layers = cfg.n_layer // pp\n",
        ["device_memory(tiny, {'dp': 1, 'pp': 3", "activations = 1260288; expected 1886976",
         "8 layers on 3 stages are not 2 each but 3 + 3 + 2"]),
    "ddp_forgets_the_reset": (
        "ddp_buckets", "                offset += p.numel()\n        self.reset()\n",
        "                offset += p.numel()\n",
        ["0 all-reduces for", "with overlap=True, step 1; expected", "one per bucket",
         "reset the bookkeeping"]),
    "dispatch_unsorted": (
        "moe_dispatch", "    return rows[order], got.sum(0), (order, send, recv)\n",
        "    return rows, got.sum(0), (torch.arange(len(rows)), send, recv)\n",
        ["2 ranks: rank 0 (experts 0-3), returned row", "expected row", "of rank 1, got row",
         "the right rows arrived in the wrong order"]),
    "combine_no_inverse": (
        "moe_dispatch", "    return all_to_all(y[back], comm, recv, send)\n",
        "    return all_to_all(y[order], comm, recv, send)\n",
        ["combine on rank", "expected that of row", "undo dispatch's sort"]),
    "combine_sizes_not_swapped": (
        "moe_dispatch", "    return all_to_all(y[back], comm, recv, send)\n",
        "    return all_to_all(y[back], comm, send, recv)\n",
        ["2 ranks: on rank 0, combine (given 5 result rows", "send sizes [3, 5], which "
         "add up to 8", "combine sends back with the split sizes of dispatch swapped"]),
    "dispatch_receives_its_send_sizes": (
        "moe_dispatch", "    recv = got.sum(1).tolist()\n", "    recv = send\n",
        ["a message did not fit its receive buffer", "an all-to-all's split sizes"]),
    "dispatch_not_differentiable": (
        "moe_dispatch", "    rows = all_to_all(x, comm, send, recv)\n",
        "    rows = comm.all_to_all(x, send, recv)\n",
        ["moe-tiny on dp 2, ep 2", "gradient norm expected", "(one process), got"]),
}


@pytest.mark.parametrize("mutant", list(MESSAGE_MUTANTS))
def test_checker_shows_expected_against_got(mutant: str, tmp_path, monkeypatch) -> None:
    name, old, new, words = MESSAGE_MUTANTS[mutant]
    source = (ROOT / "solutions" / f"{name}.py").read_text()
    assert source.count(old) == 1, f"mutant {mutant} no longer matches the solution"
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg = _package(tmp_path, f"msg_{mutant}", {f"{name}.py": source.replace(old, new)})
    text = str(run_one(name, impl=pkg, timeout=20))
    assert text.startswith(f"FAIL  {name}: "), text
    for word in words:
        assert word in text, f"{word!r} missing from the report:\n{text}"


# --- other correct answers pass (a check tests the contract, not the reference's way) -
CORRECT_VARIANTS = {
    # name: (exercise, [(text in its solution, replacement), ...])
    "ddp_divides_before_the_all_reduce": (
        "ddp_buckets", [("        self.flat[i] = flat\n",
                         "        flat = flat / self.comm.size\n        self.flat[i] = flat\n"),
                        ("            flat = self.flat[i] / self.comm.size\n",
                         "            flat = self.flat[i]\n")]),
}


@pytest.mark.parametrize("variant", list(CORRECT_VARIANTS))
def test_checker_passes_other_correct_answers(variant: str, tmp_path, monkeypatch) -> None:
    name, edits = CORRECT_VARIANTS[variant]
    source = (ROOT / "solutions" / f"{name}.py").read_text()
    for old, new in edits:
        assert source.count(old) == 1, f"variant {variant} no longer matches the solution"
        source = source.replace(old, new)
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg = _package(tmp_path, f"ok_{variant}", {f"{name}.py": source})
    result = run_one(name, impl=pkg, timeout=20)
    assert result.passed, str(result)


# --- the design puzzles are solvable, and the instruments say so -------------------
def test_schedule_puzzles_have_solutions(capsys) -> None:
    from minipar.parallel.schedules import COMPUTE, make_schedule
    from solutions.course import score_schedule

    def compute(name, p, m, v=1):
        return [[a for a in acts if a.kind in COMPUTE] for acts in make_schedule(name, p, m, v)]
    assert score_schedule(None, 0.12, 3) is None
    assert score_schedule(compute("zb", 3, 6), 0.12, max_in_flight=3)["passed"]
    assert not score_schedule(compute("1f1b", 3, 6), 0.12, max_in_flight=3)["passed"]
    assert score_schedule(compute("interleaved", 2, 4, 2), 0.125)["passed"]
    assert not score_schedule([list(reversed(r)) for r in compute("1f1b", 2, 4)], 1.0)["passed"]
    out = capsys.readouterr().out
    assert "not answered yet" in out and "PASS" in out and "not a valid schedule" in out


def test_layout_puzzle_has_a_solution(capsys) -> None:
    from solutions.course import score_layout
    budget = dict(model="gpt-13b", cluster="a100x64", global_batch=1024, memory_cap=30e9,
                  step_target=14.6)
    assert score_layout(None, **budget) is None
    assert not score_layout(dict(tp=4, pp=4, dp=4), **budget)["passed"]  # too slow
    assert not score_layout(dict(tp=1, pp=1, dp=64, zero=3), **budget)["passed"]
    assert score_layout(dict(tp=2, pp=4, dp=8, zero=1, schedule="zb", sp=True,
                             recompute="selective"), **budget)["passed"]


def test_h100_section_helpers_read_the_committed_data(capsys) -> None:
    """Lesson 06 § 6: the measured files load, hold together and say what the page says."""
    import copy

    from solutions.course import (
        check_h100_trace,
        h100_data,
        h100_headline_table,
        h100_overlap_table,
        overlap_of_picture,
    )
    data = h100_data()
    rows = h100_overlap_table(data)
    assert rows["minipar tp 4, sp"]["hidden"] == 0
    head = h100_headline_table(data)
    assert all(0.3 < r["step_ratio"] < 1.5 for r in head)
    seen = overlap_of_picture(data["overlap"]["picture"])
    assert seen["reduce_scatter_under_backward"] > 0.9
    trace = h100_data("h100x4_pp2_tp2_sp_step.json")
    runs = check_h100_trace(trace)
    assert {r: s["coords"]["pp"] for r, s in runs.items()} == {0: 0, 1: 0, 2: 1, 3: 1}
    out = capsys.readouterr().out
    assert "python benchmarks/multigpu.py --sections overlap" in out and "FSDP2" in out
    bad = copy.deepcopy(data)  # a table that contradicts itself must fail
    bad["overlap"]["rows"][1]["exposed_share"] = 0.2
    with pytest.raises(AssertionError):
        h100_overlap_table(bad)
    late = copy.deepcopy(trace)  # a tp partner drifting 5 ms behind must fail
    for e in late["traceEvents"]:
        if e.get("ph") == "X" and e["pid"] == 1 and e["tid"] == 0:
            e["ts"] += 5000
    with pytest.raises(AssertionError):
        check_h100_trace(late)


def test_h100_artifacts_tool_trims_and_merges() -> None:
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    from h100_artifacts import merge, trim_trace
    ev = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0"}}]
    ev += [{"ph": "X", "pid": 0, "tid": 0, "name": f"F{s}", "ts": 1000.0 * s, "dur": 10.0,
            "args": {"kind": "F", "mb": 0, "step": s}} for s in range(3)]
    ev += [{"ph": "X", "pid": 0, "tid": 1, "name": "all_gather tp", "ts": 1000.0 * s + 2,
            "dur": 1.0, "args": {}} for s in range(3)]
    out = trim_trace({"traceEvents": ev})
    xs = [e for e in out["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["ts"]) for e in xs] == [("F2", 0.0), ("all_gather tp", 2.0)]
    assert out["otherData"]["step"] == 2 and out["traceEvents"][0]["ph"] == "M"
    assert merge([(0, 1), (1.004, 2), (3, 4)], gap=0.005) == [[0, 2], [3, 4]]


# --- the capstone (lesson 10): its brief decides, its instruments read a trace ----------
CAPSTONE_SMALL = {"model": "tiny", "data": "markov", "ranks": 2, "batch_size": 4,
                  "steps": 4, "eval_every": 4, "rehearsal_steps": 2, "memory_cap": 1e6,
                  "target_val_loss": 9.0}
PACE = {"matmul_flops": 10e9, "bus_bandwidth": 200e6, "latency": 5e-3, "ranks": 8}


def test_capstone_brief_rules_layouts_out_and_leaves_a_choice() -> None:
    from solutions.course import CAPSTONE, capstone_cluster, capstone_layouts, capstone_plan
    layouts = capstone_layouts(cluster=capstone_cluster(PACE))
    cap = CAPSTONE["memory_cap"]
    fastest = min(layouts, key=lambda c: c["time"]["step"])
    assert fastest["memory"] > cap  # the cap decides
    choice = capstone_plan(layouts)
    fits = [c for c in layouts if c["memory"] <= cap]
    assert choice in fits and len(fits) > 1
    assert choice["time"]["step"] == min(c["time"]["step"] for c in fits)
    assert all(set(c["time"]) >= {"compute", "bubble", "tp", "dp", "step"} for c in layouts)
    assert any(c["time"]["bubble"] > 0 for c in layouts) and any(
        c["time"]["tp"] > 0 for c in layouts)


def test_capstone_model_allows_every_layout_and_takes_its_recipe() -> None:
    from minipar.config import TrainConfig, learning_rate, warmup_steps
    from minipar.model import PRESETS
    from minipar.theory.params import param_count
    from solutions.course import CAPSTONE, capstone_config
    mc = PRESETS["gpt-10m"]
    assert 9.5e6 < param_count(mc) < 10.5e6
    assert all(x % 8 == 0 for x in (mc.n_layer, mc.n_head, mc.d_model, mc.d_ff, mc.vocab_size))
    job = capstone_config(dict(dp=8, pp=1, tp=1, zero=0, sp=False, microbatches=1), whole=True)
    assert job.model_config() == mc  # byte-level text keeps the preset's vocabulary
    assert learning_rate(job) == 1e-3 and warmup_steps(job) == CAPSTONE["steps"] // 10
    rehearsal = capstone_config(dict(dp=8, pp=1, tp=1, zero=0, sp=False, microbatches=1))
    assert (rehearsal.steps, rehearsal.stop_at) == (job.steps, CAPSTONE["rehearsal_steps"])
    assert warmup_steps(rehearsal) == warmup_steps(job)  # the job's own first steps
    assert isinstance(job, TrainConfig)


def test_capstone_pace_measures_this_machine() -> None:
    from solutions.course import capstone_pace
    pace = capstone_pace(dict(CAPSTONE_SMALL), seconds=0.05)
    assert pace["matmul_flops"] > 1e6 and pace["bus_bandwidth"] > 1e4  # even on a busy machine
    assert 0 < pace["latency"] < 1 and pace["ranks"] == 2


def test_capstone_committed_run_meets_the_brief() -> None:
    from solutions.course import CAPSTONE, DATA, LONG_RUN, capstone_long_run
    path = DATA / LONG_RUN
    assert path.stat().st_size < 200_000
    run = capstone_long_run()
    b = CAPSTONE
    assert len(run["losses"]) == b["steps"] and run["eval"][-1]["step"] == b["steps"]
    assert run["eval"][-1]["loss"] <= b["target_val_loss"]
    assert run["losses"][-1] < run["losses"][0] / 2
    assert len(run["sample"]) > 200
    prov = run["provenance"]
    for flag in (f"--model {b['model']}", f"--data {b['data']}", f"--steps {b['steps']}",
                 f"--batch-size {b['batch_size']}", f"--eval-every {b['eval_every']}"):
        assert flag in prov["command"]
    assert prov["wall_time_s"] > 0 and prov["machine"] and prov["date"]


def test_capstone_gpu_run_is_the_same_job_trained_longer() -> None:
    """The committed GPU run trains the brief's model on the brief's text, several times
    longer than the brief (the lesson reads its overfitting from it): its validation loss
    falls below the brief's run's, then turns up while the training loss keeps falling."""
    from solutions.course import CAPSTONE, DATA, GPU_RUN, capstone_long_run
    assert (DATA / GPU_RUN).stat().st_size < 200_000
    run, brief_run = capstone_long_run(gpu=True), capstone_long_run()
    prov = run["provenance"]
    for flag in (f"--model {CAPSTONE['model']}", f"--data {CAPSTONE['data']}",
                 "--backend nccl"):
        assert flag in prov["command"]
    assert len(run["losses"]) > 2 * CAPSTONE["steps"]
    best = min(run["eval"], key=lambda e: e["loss"])
    assert best["loss"] < brief_run["eval"][-1]["loss"]
    assert run["eval"][-1]["loss"] > best["loss"]  # what the lesson says: it turned up
    assert run["losses"][-1] < best["loss"]  # while the training loss kept falling
    assert "def " in run["sample"] and "self" in run["sample"]


def test_capstone_grade_holds_the_rehearsal_to_the_job(capsys) -> None:
    from solutions.course import score_capstone
    run = {"losses": [5.6, 5.1], "ranks": [{"memory": {"total": 90e6}}]}
    long_run = {"losses": [5.6, 5.1, 4.0], "eval": [{"step": 3, "loss": 1.0}]}
    rows = [{"what": "peak of any rank (rank 0)", "predicted": 60e6, "measured": 90e6,
             "gap": 0.5},
            {"what": "rank 0 dp bytes in a step", "predicted": 100, "measured": 100, "gap": 0},
            {"what": "busiest rank: step, ms", "predicted": 1000, "measured": 1500,
             "gap": 0.5}]
    g = score_capstone(run, long_run, rows)
    assert g["parity"] and g["loss"] and g["memory"] and g["time_prediction"]
    assert not g["memory_prediction"] and not g["passed"]  # the planner's peak: 50 % off
    g = score_capstone(run, long_run, rows, mine={"peak_mb": 88, "step_ms": 400})
    assert g["memory_prediction"] and not g["time_prediction"]  # 1500 / 400 > 2
    assert "your peak memory" in capsys.readouterr().out
    g = score_capstone({**run, "losses": [5.6, 5.2]}, long_run, rows)
    assert not g["parity"]  # not the job's own second step


def test_capstone_reads_a_step_of_the_trace() -> None:
    from minipar.trace import chrome_trace
    from solutions.course import step_wire_bytes, trace_breakdown

    def step(s, t):  # rank 0: F then B of step s from t; a send and a reduce-scatter
        return [{"name": "F0", "kind": "F", "mb": 0, "step": s, "start": t, "end": t + 0.01},
                {"name": "B0", "kind": "B", "mb": 0, "step": s, "start": t + 0.02,
                 "end": t + 0.04}]
    comm = [{"op": op, "dim": dim, "start": t + 0.011, "end": t + 0.015, "nbytes": 100,
             "shape": [25]} for t in (0.0, 1.0, 2.0)
            for op, dim in (("send", "pp"), ("reduce_scatter", "dp"))]
    comm.append({"op": "all_reduce", "dim": "dp", "start": 2.5, "end": 2.6, "nbytes": 8,
                 "shape": [2]})  # after the last step: a validation pass, not counted
    trace = chrome_trace([{"rank": 0, "coords": {}, "comm_records": comm,
                           "timeline": step(0, 0.0) + step(1, 1.0) + step(2, 2.0)}])
    assert step_wire_bytes(trace, {"dp": 2, "pp": 2}) == {"pp": 100, "dp": 50}
    parts = trace_breakdown(trace)[0]
    assert parts["step_ms"] == pytest.approx(40.0) and parts["compute_ms"] == pytest.approx(30)
    assert parts["collective_ms"] == pytest.approx(4.0)  # the reduce-scatter, not the send
    assert parts["waiting_ms"] == pytest.approx(6.0)
    assert parts["dp_ms"] == pytest.approx(4.0) and parts["tp_ms"] == 0


# --- every lab holds several bugs, each found from its symptom -----------------------
def _lab_variants() -> list[tuple[str, int]]:
    return [(name, v) for name in LABS
            for v in range(2, gen.variants((ROOT / "solutions" / f"{name}.py").read_text()) + 1)]


def test_labs_hold_four_bugs_each_with_its_own_answer(capsys) -> None:
    from solutions.course import _formula
    for name in LABS:
        src = ROOT / "solutions" / f"{name}.py"
        n = gen.variants(src.read_text())
        assert n >= 4, f"{name} plants {n} bugs"
        files = {gen.generate(src, ROOT / "solutions", v) for v in range(1, n + 1)}
        assert len(files) == n  # four different files
        answers = [_formula(name, v) for v in range(1, n + 1)]
        assert all(answers) and len({str(a) for a in answers}) == n  # one answer each


@pytest.mark.parametrize("name,variant", _lab_variants())
def test_every_planted_bug_fails_with_a_symptom(name: str, variant: int, tmp_path,
                                                monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    buggy = gen.generate(ROOT / "solutions" / f"{name}.py", ROOT / "solutions", variant)
    assert "BUG" not in buggy.split("\n", 6)[-1] and "HINT" not in buggy
    pkg = _package(tmp_path, f"bug{variant}_{name}", {f"{name}.py": buggy})
    result = run_one(name, impl=pkg, timeout=30)
    assert result.status == "fail", str(result)
    for word in NEVER:
        assert word not in str(result), f"the report gives the fix away ({word!r}):\n{result}"


def test_another_bug_replaces_the_copy_and_the_answer_follows(tmp_path, capsys) -> None:
    from solutions.course import another_bug, lab_variant
    (tmp_path / "exercises").mkdir()
    mine = tmp_path / "exercises" / "debug_sp.py"
    mine.write_text(gen.generate(ROOT / "solutions" / "debug_sp.py", ROOT / "solutions"))
    assert lab_variant("debug_sp", tmp_path) == 1
    assert another_bug("debug_sp", root=tmp_path) == 2
    assert lab_variant("debug_sp", tmp_path) == 2 and "bug 2 of 4" in capsys.readouterr().out
    assert (tmp_path / "exercises" / "debug_sp.py.bak").read_text().count("p.dim() > 1") == 1
    assert another_bug("debug_sp", 4, root=tmp_path) == 4
    assert another_bug("debug_sp", root=tmp_path) == 1  # round again
    with pytest.raises(ValueError):
        another_bug("ring_allreduce", root=tmp_path)


def test_lesson_runs_launch_under_spawn() -> None:
    """The runs that plug an exercise into training live in an importable module, so a
    rank started by spawn (where fork is missing: Windows) runs them too."""
    from minipar.launch import launch
    from solutions.course import adamw_on_both_batches, train_with_zero1
    ranks = launch(train_with_zero1, 2, args=("solutions", 2), timeout=120,
                   start_method="spawn")
    one = adamw_on_both_batches(steps=2)
    assert all(abs(pair[r] - ranks[r]["losses"][s]) < 1e-5
               for s, pair in enumerate(one["losses"]) for r in (0, 1))
