"""The learner's instruments: hints on request, predictions, and scored design puzzles.

    from exercises.course import hint, predict, score_schedule, score_layout

* ``hint(name, level)``: help for an exercise or lab, only when asked. Level 1 is a
  nudge (a question that points where to look), 2 the method (how to get there, without
  the result), 3 the answer (read from the reference solution's ``# HINT:`` lines, so the
  hints cannot drift from the code they describe).
* ``predict(question, guess, measured)``: your guess first, then the answer. ``None``
  means "not answered yet": the answer stays hidden, and a box with a Reveal button takes
  your guess (a notebook run top to bottom shows no answer); what a cell shows inside
  ``with predict(...):`` waits for the guess too. Every answered guess is kept
  in a small JSON file (``predictions_path()``: ``~/.minipar/predictions.json``, or
  ``$MINIPAR_PREDICTIONS``); ``show_calibration()``, at the end of every lesson, prints
  how far off you are on average, in the log domain (a factor of 2 too high or too low
  counts the same).
* ``score_schedule`` and ``score_layout``: budgeted design puzzles. Your schedule (a
  list of actions per rank) or layout (tp, pp, dp, ...) is validated and priced by the
  same functions the engine and the planner use, and compared with a target.
* ``say(text)``: a lesson's sentences about what a cell computed, rendered from the values
  (markdown), so the prose cannot contradict the outputs it describes.
* ``check_...`` (and ``measure_builds``): what a lesson's runs must show, asserted in one
  call, so the pages read as lessons and ``make notebooks`` still fails when the engine
  stops doing what a page says.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import textwrap
from pathlib import Path

__all__ = ["HINTS", "LAYOUT_PUZZLE", "LEVELS", "PREDICTIONS_ENV", "Prediction", "calibration",
           "check_dp_run", "check_h100_trace", "check_sharded_build", "check_sp_run",
           "check_spanning", "check_tp_run", "check_zero_memory", "h100_data",
           "h100_headline_table", "h100_overlap_table", "hint", "layout_puzzle", "log_error",
           "measure_builds", "MOE_PUZZLE", "moe_puzzle", "overlap_of_picture", "predict",
           "predictions_path", "record_prediction", "router_demo", "say", "score_layout",
           "score_schedule", "show_calibration", "CAPSTONE", "capstone_layouts",
           "capstone_config", "capstone_command", "capstone_plan", "capstone_pace",
           "capstone_cluster", "capstone_long_run", "run_extent", "layout_label", "reconcile",
           "score_capstone", "step_wire_bytes", "trace_breakdown", "ring_timing", "another_bug",
           "lab_variant", "train_with_ring", "train_with_ddp", "train_with_zero1",
           "adamw_on_both_batches", "run_schedule",
           "ring_layer_on_a_shard", "ring_layer_errors", "FP8_RUNS", "fp8_gpu_runs",
           "fp8_gpu_table", "BLOCK_SAVED", "fp8_memory", "RECOMPUTE_RUNS",
           "recompute_layers_runs"]

PREDICTIONS_ENV = "MINIPAR_PREDICTIONS"  # where record_prediction keeps your guesses
LEVELS = {1: "a nudge", 2: "the method", 3: "the answer"}

# Levels 1 and 2, per exercise or lab: a nudge (a question), then the method (how to get
# to the answer, never the answer itself). Level 3 is the solution's own # HINT: lines.
HINTS: dict[str, dict[int, str]] = {
    "ring_allreduce": {
        1: "Draw 3 ranks on a circle and 3 chunks per rank. After one step of the "
           "reduce-scatter, which chunk has picked up a second contribution on rank 1?",
        2: "Work it on paper first: N = 3 ranks, 3 chunks each, and for every step write "
           "which chunk each rank sends right and into which chunk it adds what arrives "
           "from the left, so that a partial sum gains one contribution per hop. Read the "
           "pattern off as a formula in the rank and the step, mod N. The all-gather is "
           "the same walk from the finished chunk, replacing instead of adding.",
    },
    "ddp_buckets": {
        1: "Gradients become ready from the last layer to the first. Which parameters "
           "should share the first bucket, and what must hold before a bucket may launch?",
        2: "Fill buckets walking the parameters in reverse. A hook marks its parameter "
           "ready; launch buckets strictly in order (0, 1, 2, ...) and only when *all* of "
           "a bucket's parameters are ready: every rank must issue the same collectives "
           "in the same order, whatever order its hooks fire in.",
    },
    "zero1": {
        1: "Each rank keeps optimizer state for 1/N of the flat parameter vector. Which "
           "two collectives turn full gradients into a summed shard, and an updated shard "
           "back into full parameters?",
        2: "Follow one gradient element: where must it be summed over the ranks, and who "
           "needs the sum? Only the rank that owns that element's optimizer state. After "
           "the update, who needs the new value? Everyone. Pick the collective for each "
           "of the two moves, flatten the parameters into one padded vector for both, and "
           "mind that a collective sums where the optimizer wants a mean.",
    },
    "tp_linear": {
        1: "A column-parallel layer splits the output features, a row-parallel one the "
           "input features. Which of the two needs a sum of partial results in forward?",
        2: "For each boundary, list what every rank holds in forward (the same x, or a "
           "partial sum of y) and in backward (its own part of dL/dx, or the same dL/dy), "
           "and what the single device would have there. Where the ranks hold parts of a "
           "sum, a collective must add them; where they already agree, nothing is needed. "
           "Then slice nn.Linear's weight along the right dimension for each layer, and "
           "decide on how many ranks the bias may be added.",
    },
    "pipeline_1f1b": {
        1: "How many forwards must the last rank run before it can start a backward? "
           "And the first rank, with p stages downstream of it?",
        2: "Reason backwards from the last rank: a micro-batch's backward on rank r "
           "needs its backward on rank r + 1, which needs its forward to have reached the "
           "last rank. Count how many forwards rank r can run before its first backward "
           "can arrive; after that, keep the count of held micro-batches constant (one in, "
           "the oldest out); at the end only backwards are left. Check it against the "
           "timeline of lesson 05 § 2. For the idle share, count the step's slots and the "
           "busy ones on any rank.",
    },
    "mesh_coords": {
        1: "A rank number is a number written in a mixed radix; which digit varies "
           "fastest in Megatron order?",
        2: "Write the rank as digits of a mixed-radix number, slowest digit first, in "
           "the order the layout names: peel digits off from the fastest with % and //, "
           "and build a rank back with Horner's rule. A group keeps every digit but one "
           "and lets that one run through its range.",
    },
    "memory_formula": {
        1: "Split the bytes into model states (depend on ZeRO stage and dp) and "
           "activations (depend on the schedule and the stage). Which stage holds most?",
        2: "Build it term by term and compare each with minipar.theory.memory: first the "
           "three model states for each ZeRO stage (which of them does each stage divide "
           "by dp?), then the micro-batches a stage holds, read off the schedules' "
           "timelines of lesson 05 (or your peak_in_flight), then activations as the "
           "per-layer bytes times what the stage holds, then the edges.",
    },
    "recompute_cheap": {
        1: "Which saved tensors are the ones to replace, and how do you recognise one when "
           "pack is handed a reshaped view of it rather than the output itself?",
        2: "pack: look the tensor's data address up in noted; a match that covers the "
           "whole output (count the elements, check the dtype) becomes a small tuple of "
           "what makes it again plus how the saved tensor was laid out; anything else goes "
           "back unchanged. unpack: run the module once more on what it was given, without "
           "its hooks and without recording a graph, and lay the result out as saved.",
    },
    "attention_merge": {
        1: "Each part is a softmax normalised over its own keys. Over both key sets, the "
           "denominator is the sum of the two parts' denominators. What is each part's "
           "denominator, given its lse?",
        2: "Undo the normalisation: out_x times its softmax denominator is the "
           "un-normalised sum over X. Add the two un-normalised sums and divide by the "
           "union's denominator; then rewrite every factor so that only differences of "
           "log-sum-exps are exponentiated (never e^lse itself: scores can be large). "
           "torch has a function for log(e^a + e^b).",
    },
    "moe_dispatch": {
        1: "Before any row can move, every rank must know how many rows it will receive "
           "from each rank: what could the ranks exchange first, and with which sizes?",
        2: "Exchange the counts by an all-to-all of one row per rank, then the rows with "
           "split sizes taken from the counts (yours to send, theirs to receive). The rows "
           "arrive grouped by source rank; give each row a sort key made of its expert "
           "and its source, and sort stably. combine applies the inverse permutation, "
           "then the all-to-all with the two split lists swapped.",
    },
    "debug_deadlock": {
        1: "Which move failed first, and how: a hang (which call is each rank inside, "
           "and with which rank?) or a wrong tensor (rank r starts with 2**r everywhere, "
           "so a value names the ranks it came from)?",
        2: "Follow that move's code down to its send and recv calls and play them out for "
           "three ranks at once: who sends to whom, who receives from whom, what is stored "
           "or added where. If every rank's first call blocks until a partner acts, and "
           "every partner is blocked the same way, nobody moves. Compare with the moves "
           "that passed.",
    },
    "debug_sp": {
        1: "Run gradient_audit(): which parameters differ from one process, and what do "
           "they have in common that the ones that agree lack? How far off are they? Under "
           "sequence parallelism, what does a rank compute for the replicated parameters "
           "used on its part of the sequence?",
        2: "Those parameters' gradients are partial sums over a rank's tokens, to be added "
           "over tp after the backward. Find the code that does that adding and check, "
           "line by line, which parameters it takes (print p.sequence_parallel and "
           "p.dim() for each), and whether it adds the parts, averages them or leaves "
           "them as they are.",
    },
    "debug_pipeline": {
        1: "Run gradient_audit(m) for m = 2, 4 and 8: how does the ratio of the gradient "
           "norms move with m? Which sizes of the run would give that ratio, and is it the "
           "gradients or their measurement that is off?",
        2: "The executor adds the gradients of the m micro-batch losses, each multiplied "
           "by loss_scale first; one process computes the gradient of the mean over the "
           "batch. Work out the loss_scale that makes the two equal and compare it with "
           "what the step passes; then check that grad_norm covers every stage.",
    },
}


def _formula(name: str, variant: int | None = None) -> list[tuple[str, str]]:
    """(function, hint text) for every ``# HINT:`` block in ``solutions/<name>.py``. For a
    lab with several bugs, those of bug ``variant`` only (``# HINT(k):`` lines; the plain
    ``# HINT:`` lines belong to bug 1); ``None``: the bug in the learner's copy."""
    path = Path(__file__).resolve().parents[1] / "solutions" / f"{name}.py"
    if not path.exists():
        return []
    text = path.read_text()
    tagged = re.search(r"^\s*# HINT\(\d+\):", text, re.MULTILINE) is not None
    if tagged and variant is None:
        variant = lab_variant(name)
    out: list[tuple[str, str]] = []
    function, taking = "", False
    for line in text.splitlines():
        line_text = line.strip()
        m = re.match(r"(?:async\s+)?def\s+(\w+)", line_text)
        k = re.match(r"# HINT\((\d+)\):", line_text)
        if m:
            function, taking = m.group(1), False
        elif k:
            taking = False
            if int(k.group(1)) == variant:
                body = line_text[k.end():].strip()
                if out and out[-1][0] == function and out[-1][2] == variant:
                    out[-1] = (function, out[-1][1] + " " + body, variant)
                else:
                    out.append((function, body, variant))
        elif line_text.startswith("# HINT:"):
            taking = not tagged or variant == 1
            if taking:
                out.append((function, line_text[len("# HINT:"):].strip(), 1))
        elif taking and line_text.startswith("#") and not line_text.startswith("###"):
            out[-1] = (out[-1][0], out[-1][1] + " " + line_text.lstrip("#").strip(), 1)
        else:
            taking = False
    return [(f, h) for f, h, _ in out]


def lab_variant(name: str, root: Path | None = None) -> int:
    """Which bug of lab ``name`` the learner's copy (``exercises/<name>.py`` under the
    course's root, or ``root``) holds: its header says ``# Bug k of n``; 1 when it does
    not."""
    path = (root or Path(__file__).resolve().parents[1]) / "exercises" / f"{name}.py"
    head = path.read_text()[:1000] if path.exists() else ""
    m = re.search(r"^# Bug (\d+) of \d+", head, re.MULTILINE)
    return int(m.group(1)) if m else 1


def another_bug(name: str, variant: int | None = None, root: Path | None = None) -> int:
    """Replace your copy of lab ``name`` with its next bug (or bug ``variant``), keeping
    the copy you had as ``exercises/<name>.py.bak``. Returns the bug's number. ``root``:
    the course's folder (default: this one; tests pass a copy)."""
    import importlib.util

    course = Path(__file__).resolve().parents[1]
    root = root or course
    spec = importlib.util.spec_from_file_location("make_exercises",
                                                  course / "tools" / "make_exercises.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    src = course / "solutions" / f"{name}.py"
    n = gen.variants(src.read_text())
    if n < 2:
        raise ValueError(f"{name!r} is not a lab with several bugs")
    variant = variant or lab_variant(name, root) % n + 1
    if not 1 <= variant <= n:
        raise ValueError(f"{name!r} has bugs 1 to {n}, not {variant}")
    mine = root / "exercises" / f"{name}.py"
    if mine.exists():
        mine.with_name(mine.name + ".bak").write_text(mine.read_text())
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_text(gen.generate(src, course / "solutions", variant))
    print(f"exercises/{name}.py now holds bug {variant} of {n} (your copy is in "
          f"{name}.py.bak): run check({name!r}) and hunt it down")
    return variant


def hint(name: str, level: int = 1, function: str | None = None) -> None:
    """Print hint ``level`` (1 a nudge, 2 the method, 3 the answer) for exercise ``name``.

    Ask for the lowest level that gets you moving; level 3 is close to the answer.
    ``function`` narrows level 3 to one function of the exercise.
    """
    if level not in LEVELS:
        raise ValueError(f"level is 1 (a nudge), 2 (the method) or 3 (the answer), not {level}")
    if name not in HINTS:
        raise ValueError(f"no hints for {name!r}; choose one of {sorted(HINTS)}")
    print(f"{name}, hint {level} ({LEVELS[level]}):")
    if level < 3:
        print("  " + HINTS[name][level])
        return
    items = [(f, h) for f, h in _formula(name) if function in (None, f)]
    for f, h in items or [("", HINTS[name][2])]:
        print(f"  {f + ': ' if f else ''}{h}")


def say(text: str) -> None:
    """Show ``text`` (markdown) as prose. A lesson states what a cell computed by rendering
    the values into its sentences here (an f-string), never by typing them: the page then
    cannot contradict the outputs above it when the engine or the theory changes."""
    text = textwrap.dedent(text).strip()
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        print(text)
        return
    if get_ipython() is None:
        print(text)
    else:
        display(Markdown(text))


def predictions_path() -> Path:
    """Where your predictions are kept: ``$MINIPAR_PREDICTIONS`` if set, else
    ``~/.minipar/predictions.json`` (one small JSON file; delete it to start afresh)."""
    env = os.environ.get(PREDICTIONS_ENV)
    return Path(env) if env else Path.home() / ".minipar" / "predictions.json"


def _load_predictions() -> dict:
    try:
        return json.loads(predictions_path().read_text())
    except (OSError, ValueError):
        return {}


def log_error(guess: float, answer: float) -> float | None:
    """|ln(guess / answer)|: 0 for a perfect guess, ln 2 = 0.69 for a factor of 2 either
    way. A guess of the wrong sign (or a zero) has no log error: ``None``."""
    if guess == answer:
        return 0.0
    if guess * answer <= 0:
        return None
    return abs(math.log(guess / answer))


def record_prediction(question: str, guess: float, answer: float) -> float | None:
    """Keep your latest guess for ``question`` (a rerun replaces it); returns its log error."""
    err = log_error(guess, answer)
    book = _load_predictions()
    book[question] = {"guess": guess, "answer": answer, "log_error": err}
    path = predictions_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(book, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:  # a read-only home: the score is lost, the lesson goes on
        print(f"(your prediction could not be saved to {path}: {exc.strerror})")
    return err


def calibration() -> dict:
    """Your running calibration over the course: how many predictions you answered, their
    mean log error (``mean_log_error``, the typical factor off is its exponential) and
    how many had the wrong sign."""
    errors = [v["log_error"] for v in _load_predictions().values()]
    scored = [e for e in errors if e is not None]
    mean = sum(scored) / len(scored) if scored else None
    return {"answered": len(errors), "wrong_sign": len(errors) - len(scored),
            "mean_log_error": mean, "factor": math.exp(mean) if scored else None}


def show_calibration() -> None:
    """Print the calibration score (the last cell of every lesson)."""
    c = calibration()
    if not c["answered"]:
        print("Your predictions: none answered yet. Each question of the course takes your "
              "guess before it shows the answer; your score is kept in "
              f"{predictions_path().name} (see predictions_path()).")
        return
    typical = (f"typically off by a factor of {c['factor']:.2f} "
               f"(mean |ln(guess / answer)| = {c['mean_log_error']:.2f})"
               if c["factor"] else "none of them with the right sign")
    sign = f"; {c['wrong_sign']} with the wrong sign" if c["wrong_sign"] else ""
    print(f"Your predictions over the course: {c['answered']} answered, {typical}{sign}.")


def _verdict(question: str, guess: float, measured: float, unit: str, tol: float, fmt: str,
             by: str) -> tuple[bool, str]:
    u = f" {unit}" if unit else ""
    close = abs(guess - measured) <= tol * max(abs(measured), 1e-12)
    verdict = (f"within {tol:.0%}" if close else
               f"off by {guess / measured:.3g}x" if measured else "off")
    return close, (f"{question}: you predicted {guess:{fmt}}{u}, {by} "
                   f"{measured:{fmt}}{u} ({verdict})")


class Prediction:
    """What ``predict`` returns: ``close`` (True within the tolerance, False outside it,
    None: no guess yet) and a context manager for what would give the answer away.
    Unanswered in a notebook, the outputs of ``with predict(...):`` (prints, figures) are
    held back and shown under the box when the learner presses Reveal; answered, or
    outside a notebook, they are shown at once. Errors inside still fail the cell."""

    def __init__(self, close: bool | None, box=None):
        self.close, self.box, self._capture = close, box, None

    def __enter__(self) -> Prediction:
        if self.box is not None:
            from IPython.utils.capture import capture_output

            self._capture = capture_output()
            self.box.later = self._capture.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        if self._capture is not None:
            self._capture.__exit__(*exc)
        return False

    def _ipython_display_(self) -> None:  # a cell ending in predict(...) shows nothing more
        pass


def predict(question: str, guess: float | None, measured: float, unit: str = "",
            tol: float = 0.05, fmt: str = ".4g", by: str = "the run measured") -> Prediction:
    """Your guess first, then the answer. ``guess``: a number you wrote in the cell above,
    or ``None``: then the answer stays hidden, and in a live notebook a box takes your
    guess and a Reveal button shows the answer beside it, with whatever the cell shows
    inside ``with predict(...):`` (a notebook run top to bottom shows no answer).

    ``by`` says where the value came from ("the run measured", "the simulation gives",
    "the formula gives"): a number computed from theory is not called a measurement.
    Every answered guess is kept (``record_prediction``) for the course's calibration
    score (``show_calibration``). ``.close`` of the result: True when the guess is within
    ``tol`` (relative) of the answer, False when it is not, None when there is no guess
    yet. Never raises on a wrong guess: a prediction is for you, not for the grader.
    """
    if guess is not None:
        close, line = _verdict(question, guess, measured, unit, tol, fmt, by)
        record_prediction(question, guess, measured)
        print(line)
        return Prediction(close)
    print(f"{question}: not answered yet. Type your guess in the box and press Reveal "
          "(or set it in the cell above and rerun).")
    from minipar.viz.widgets import PredictBox, in_kernel

    if not in_kernel():
        return Prediction(None)
    from IPython.display import display

    def reveal(value: float) -> str:
        record_prediction(question, value, measured)
        return _verdict(question, value, measured, unit, tol, fmt, by)[1]

    box = PredictBox(question, unit, reveal)
    display(box.widget)
    return Prediction(None, box)


def score_schedule(compute, target_ratio: float, max_in_flight: int | None = None,
                   label: str = "your schedule") -> dict | None:
    """Validate and price a pipeline schedule written as data; print the verdict.

    ``compute``: per rank, the compute actions (``Action("F"|"B"|"W", mb, chunk)``) in
    the order the rank runs them; sends and receives are added for you. Passes when the
    simulated bubble ratio (idle over work, unit costs F = B = W = 1 when W is split,
    else F = 1, B = 2) is at most ``target_ratio`` and, if given, no rank holds more than
    ``max_in_flight`` activations. ``None`` prints the target and returns ``None``.
    """
    from minipar.parallel.schedules import ScheduleError, validate, with_communication
    from minipar.theory import bubble

    if compute is None:
        cap = f", at most {max_in_flight} held per rank" if max_in_flight else ""
        print(f"{label}: not answered yet (target: bubble ratio <= {target_ratio:.3f}{cap})")
        return None
    try:
        actions = with_communication([list(acts) for acts in compute])
        validate(actions)
    except (ScheduleError, ValueError) as exc:
        print(f"{label}: not a valid schedule: {exc}")
        return {"passed": False, "error": str(exc)}
    st = bubble.bubble_stats(bubble.simulate(actions))
    peaks = bubble.peak_in_flight(actions)
    ok_bubble = st["bubble_ratio"] <= target_ratio + 1e-9
    ok_mem = max_in_flight is None or max(peaks) <= max_in_flight
    print(f"{label}: bubble ratio {st['bubble_ratio']:.3f} (target <= {target_ratio:.3f}), "
          f"idle share {st['bubble_fraction']:.3f}, peak held per rank {peaks}"
          + (f" (cap {max_in_flight})" if max_in_flight else ""))
    print("PASS" if ok_bubble and ok_mem else
          "not yet: " + ("bubble above target" if not ok_bubble else "holds too much"))
    return {"passed": ok_bubble and ok_mem, "bubble_ratio": st["bubble_ratio"], "peaks": peaks}


def score_layout(layout: dict | None, model: str, cluster: str, global_batch: int,
                 memory_cap: float, step_target: float) -> dict | None:
    """Price a layout with the planner's ``evaluate``; pass when it fits ``memory_cap``
    bytes per GPU and its estimated step takes at most ``step_target`` seconds.

    ``layout``: fields of ``minipar.theory.layout.Layout`` (tp, pp, dp, zero,
    microbatch_size, schedule, virtual, sp, recompute; the micro-batches follow from the
    global batch). ``None``: not answered yet.
    """
    from minipar.theory.layout import Layout
    from minipar.theory.planner import evaluate

    if layout is None:
        print(f"not answered yet (target: at most {memory_cap / 1e9:.0f} GB per GPU, "
              f"a step of at most {step_target:.2f} s)")
        return None
    try:
        est = evaluate(model, cluster, Layout(**layout).with_batch(global_batch))
    except (ValueError, TypeError) as exc:
        print(f"not a layout the planner can build: {exc}")
        return {"passed": False, "error": str(exc)}
    mem, step, lay = est.memory["total"], est.step_time, est.layout
    keys = ("compute", "bubble", "tp") + (("ep",) if lay.ep > 1 else ()) + ("pp", "dp")
    parts = ", ".join(f"{k} {est.time[k]:.2f}" for k in keys)
    print(f"{lay.label()}\n  memory {mem / 1e9:.1f} GB per GPU (cap {memory_cap / 1e9:.0f}); "
          f"step {step:.2f} s (target {step_target:.2f}): {parts}; MFU {est.mfu:.0%}")
    ok = mem <= memory_cap and step <= step_target
    print("PASS" if ok else "not yet: " + ("over the memory cap" if mem > memory_cap
                                           else "too slow"))
    return {"passed": ok, "memory": mem, "step_time": step}


# Lesson 07's design puzzle: 13B on 64 A100s under a memory cap and a step target. Its
# premise (the balanced layout fits but is too slow, the planner's favourite is fast but
# too big) is computed by ``layout_puzzle`` and tested, never typed into the page.
LAYOUT_PUZZLE = dict(model="gpt-13b", cluster="a100x64", global_batch=1024,
                     memory_cap=30e9, step_target=14.6)
BALANCED = dict(tp=4, pp=4, dp=4)


def layout_puzzle() -> dict:
    """The two layouts lesson 07's puzzle starts from, priced by the planner:
    ``balanced`` (tp = pp = dp = 4, the planner's defaults otherwise) and ``favourite``
    (the planner's first choice without a cap), with ``text``: the premise as markdown."""
    from minipar.theory.layout import Layout
    from minipar.theory.planner import evaluate, plan

    p = LAYOUT_PUZZLE
    balanced = evaluate(p["model"], p["cluster"],
                        Layout(**BALANCED).with_batch(p["global_batch"]))
    favourite = plan(p["model"], p["cluster"], p["global_batch"]).best

    def priced(lay) -> str:
        return f"{lay.memory['total'] / 1e9:.1f} GB and {lay.step_time:.2f} s"
    text = (f"The balanced `{balanced.layout.label()}` needs {priced(balanced)}; the "
            f"planner's favourite, `{favourite.layout.label()}`, needs {priced(favourite)}.")
    return {"balanced": balanced, "favourite": favourite, "text": text}


# Lesson 09's puzzle: an MoE model of 13.8B parameters (moe-1.3b with 64 experts per MoE
# layer; 1.3B active) on 64 A100s under a memory cap and a step target. Its premise (the
# planner's favourite is over the cap; no layout that keeps every expert on every rank,
# ep = 1, meets both) is computed by ``moe_puzzle`` and tested.
MOE_PUZZLE = dict(model=None, cluster="a100x64", global_batch=512, memory_cap=20e9,
                  step_target=1.0)


def moe_puzzle() -> dict:
    """Lesson 09's puzzle, priced by the planner: ``puzzle`` (``score_layout``'s
    arguments, the model included), ``favourite`` (the planner's first choice without a
    cap), ``replicated`` (the fastest layout with ep = 1 under the cap, or None) and
    ``solvable`` (some layout meets both)."""
    from minipar.model import get_config
    from minipar.theory.planner import plan

    p = {**MOE_PUZZLE, "model": get_config("moe-1.3b").with_(n_expert=64)}
    layouts = plan(p["model"], p["cluster"], p["global_batch"],
                   recomputes=("none", "selective"), schedules=("1f1b",))
    under = [lay for lay in layouts if lay.memory["total"] <= p["memory_cap"]]
    replicated = next((lay for lay in under if lay.layout.ep == 1), None)
    return {"puzzle": p, "favourite": layouts.best, "replicated": replicated,
            "solvable": any(lay.step_time <= p["step_target"] for lay in under)}


def router_demo(aux_coef: float, n_expert: int = 8, tokens: int = 512, steps: int = 300,
                seed: int = 0) -> dict:
    """A router trained on 2-D tokens (lesson 09 § 1): ``tokens`` points from ``n_expert``
    clusters of unequal sizes; the "task" wants each token at its own cluster's expert
    (a cross-entropy on the router's logits, standing in for how well an expert serves
    a token), plus ``aux_coef`` times ``minipar.model.load_balancing_loss``. Returns
    the points, each token's expert (top-1 ``route``), the load per expert, and the two
    losses at the end."""
    import torch
    import torch.nn.functional as F

    from minipar.model import load_balancing_loss, route

    g = torch.Generator().manual_seed(seed)
    share = torch.tensor([0.5 ** (i / 2) for i in range(n_expert)])
    cluster = torch.multinomial(share / share.sum(), tokens, replacement=True, generator=g)
    angle = 2 * math.pi * cluster / n_expert
    x = torch.stack([angle.cos(), angle.sin()], 1) + 0.35 * torch.randn(tokens, 2, generator=g)
    router = torch.nn.Linear(2, n_expert, bias=False)
    with torch.no_grad():
        router.weight.copy_(0.01 * torch.randn(n_expert, 2, generator=g))
    opt = torch.optim.Adam(router.parameters(), lr=0.05)
    for _ in range(steps):
        logits = router(x)
        _, expert, _, probs = route(logits[None], 1, 0)
        task = F.cross_entropy(logits, cluster)
        balance = load_balancing_loss(probs, expert)
        opt.zero_grad()
        (task + aux_coef * balance).backward()
        opt.step()
    with torch.no_grad():
        logits = router(x)
        _, expert, _, probs = route(logits[None], 1, 0)
        task, balance = F.cross_entropy(logits, cluster), load_balancing_loss(probs, expert)
    picked = expert[0, :, 0].tolist()
    load = [picked.count(e) / tokens for e in range(n_expert)]
    return {"points": x.tolist(), "experts": picked, "load": load, "n_expert": n_expert,
            "task_loss": float(task), "balance_loss": float(balance),
            "max_over_mean": max(load) * n_expert}


# --- what the lessons' runs show ------------------------------------------------------
# A lesson states what a run does and shows the run; the checks below assert each claim,
# so `make notebooks` fails when the engine stops doing what the page says, and the page
# itself reads as a lesson (one call where a block of asserts would be).

def _same_losses(reference: list[float], losses: list[float], tol: float = 1e-4) -> None:
    assert len(reference) == len(losses), (reference, losses)
    worst = max(abs(a - b) for a, b in zip(reference, losses))
    assert worst < tol, f"losses differ from one process by up to {worst:.3g}"


def check_dp_run(run: dict, model_cfg, steps: int) -> None:
    """Lesson 01 § 2: under dp = 2 with fp32 AdamW each rank holds 4 + 4 + 8 bytes per
    parameter, and each step all-reduces every gradient once (plus the 8-byte loss and the
    4-byte squared gradient norm), sending the ring's 2 (N-1)/N of it."""
    from minipar.comm import wire_bytes
    from minipar.theory import Layout, comm_volume, param_count

    n, rank0 = param_count(model_cfg), run["ranks"][0]
    mem = rank0["memory"]
    assert mem["params"] == mem["grads"] == 4 * n, mem
    assert mem["optimizer"] == 8 * n, mem  # two fp32 Adam moments
    theory = comm_volume(model_cfg, Layout(dp=2, dtype="fp32"))["dp"]["all_reduce"]
    grad_bytes = (rank0["comm"]["dp"]["all_reduce"]["bytes"] - 12 * steps) // steps
    assert grad_bytes == theory["bytes"] == 4 * n, (grad_bytes, theory)
    assert theory["wire_bytes"] == wire_bytes("all_reduce", 4 * n, 2), theory


def check_zero_memory(runs: dict[int, dict], n_params: int) -> None:
    """Lessons 02 § 2 and 03 § 1: what rank 0 of each ZeRO stage in ``runs`` (dp = 2,
    fp32) held at its peak, against ``model_states``: the table's shards plus what the
    implementation keeps. ``runs`` holds stage 1 (stages 2 and 3 are compared with it)."""
    from minipar.theory.memory import model_states

    for z, run in runs.items():
        mem, want = run["ranks"][0]["memory"], model_states(n_params, 2, z, "fp32")
        if z < 3:  # whole weights in stages 0-2
            assert mem["params"] == want["params"], (z, mem, want)
        else:  # at its peak: the shard plus the units gathered at that moment
            assert mem["params"] > want["params"], (z, mem, want)
        if z == 1:  # the full gradient it reduce-scatters, and beside it the shard back
            shard = model_states(n_params, 2, 2, "fp32")["grads"]
            assert mem["grads"] == want["grads"] + shard, (z, mem, want)
        if z >= 2:  # the shard, plus one block's bucket while it is reduce-scattered
            assert want["grads"] <= mem["grads"] < runs[1]["ranks"][0]["memory"]["grads"]
        # Adam's moments, sharded from stage 1: fp32 weights are their own masters (the
        # optimizer steps this rank's slot of them in place), so the share is the table's
        assert mem["optimizer"] == want["optimizer"], (z, mem)


def measure_builds(stages: tuple[int, ...] = (0, 3), dp: int = 4, **model) -> dict:
    """Lesson 03 § 3: one step of ``train`` per ZeRO stage on ``dp`` ranks; per stage the
    ranks' ``host_peak_bytes`` and ``build_seconds`` (what each rank's build of its part
    cost), and ``model_bytes``: the whole model in fp32."""
    from minipar.config import TrainConfig
    from minipar.engine import train
    from minipar.theory import param_count

    out: dict = {}
    for z in stages:
        cfg = TrainConfig(dp=dp, zero=z, steps=1, batch_size=dp, timeout=300, **model)
        ranks = train(cfg)["ranks"]
        out[z] = {"host_peak_bytes": [r["host_peak_bytes"] for r in ranks],
                  "build_seconds": [r["build_seconds"] for r in ranks]}
        out["model_bytes"] = 4 * param_count(cfg.model_config())
    return out


def check_sharded_build(builds: dict) -> list[str]:
    """Lesson 03 § 3: under ZeRO-0 every rank makes the whole model (its host peak is at
    least the model's bytes); under ZeRO-3 each keeps only its shard, so every rank's peak
    is at least half the model's bytes below the smallest ZeRO-0 peak (the shard is a
    quarter at dp 4; the rest of the gap absorbs the process's own noise, a few MB).
    Returns the verdicts as sentences that do not vary."""
    model, z0, z3 = builds["model_bytes"], builds[0], builds[3]
    assert min(z0["host_peak_bytes"]) >= model, (model, z0)
    assert max(z3["host_peak_bytes"]) <= min(z0["host_peak_bytes"]) - model / 2, (z0, z3)
    n = len(z0["host_peak_bytes"])
    return [f"ZeRO-0: each of the {n} ranks' host peak is at least the whole model "
            f"({model / 1e6:.0f} MB of fp32)",
            "ZeRO-3: each rank's host peak is lower by more than half the model's bytes"]


def check_tp_run(run: dict, reference: list[float], cfg) -> None:
    """Lesson 04 § 3: tp = 2 trains like one process; each rank holds ``stage_params``
    (half the split matrices, the replicated norms and row biases whole); per step the tp
    all-reduces are ``comm_volume``'s plus one fp32, the gradient norm's partial sum."""
    from minipar.theory import comm_volume, stage_params

    _same_losses(reference, run["losses"])
    mc, rank0, steps = cfg.model_config(), run["ranks"][0], cfg.steps
    assert rank0["memory"]["params"] == 4 * stage_params(mc, tp=2), rank0["memory"]
    theory = comm_volume(mc, cfg.layout())["tp"]["all_reduce"]  # the run's own layout
    measured = rank0["comm"]["tp"]["all_reduce"]
    assert measured["calls"] == steps * (theory["calls"] + 1), (measured, theory)
    assert measured["bytes"] == steps * (theory["bytes"] + 4), (measured, theory)


def check_sp_run(sp_run: dict, tp_run: dict, reference: list[float]) -> float:
    """Lesson 04 § 4: tp = 2 with sequence parallelism trains like one process, keeps
    fewer activations than tp alone, near the per-layer formula's 1 - 17/22 = 23 % and
    nowhere near 1 - 1/t = 50 %, and its tp traffic has reduce-scatters and all-gathers.
    Returns the share of rank 0's peak saved activations that sp removed."""
    _same_losses(reference, sp_run["losses"])
    tp_act = tp_run["ranks"][0]["memory"]["activations"]
    sp_act = sp_run["ranks"][0]["memory"]["activations"]
    saving = 1 - sp_act / tp_act
    assert 0.1 < saving < 0.35, (tp_act, sp_act)
    assert {"all_gather", "reduce_scatter"} <= set(sp_run["ranks"][0]["comm"]["tp"])
    return saving


def check_spanning(spanning) -> None:
    """Lesson 06 § 1: ``spanning(mesh, dim)`` ("crossing/groups" over servers of 8). In
    Megatron order the tp groups of 2 x 4 x 8 stay inside servers and those of tp = 16
    cannot; the dp pairs of 2 x 8 x 4 sit 4 ranks apart (one server) in Megatron order and
    32 apart (across servers) with pp inside dp."""
    from minipar.mesh import Mesh

    assert spanning(Mesh(2, 4, 8), "tp") == "0/8"
    assert spanning(Mesh(2, 2, 16), "tp") == "4/4"
    assert spanning(Mesh(2, 8, 4), "dp") == "0/32"
    assert spanning(Mesh(2, 8, 4, "pp-inside-dp"), "dp") == "32/32"


# --- lesson 06 § 6: four H100s (measured files under notebooks/data/) -----------------------
DATA = Path(__file__).resolve().parents[1] / "notebooks" / "data"


def h100_data(name: str = "h100x4.json") -> dict:
    """A measured file of ``notebooks/data`` (JSON), as a dict."""
    import json

    return json.loads((DATA / name).read_text())


def _coords(trace: dict) -> dict[int, dict[str, int]]:
    """Rank -> mesh coordinates, from the trace's process names ("rank 2 (dp0 pp1 tp0)")."""
    return {e["pid"]: {k: int(v) for k, v in re.findall(r"([a-z]+)(\d+)", e["args"]["name"])
                       if k in ("dp", "pp", "tp", "cp")}
            for e in trace["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "process_name"}


def check_h100_trace(trace: dict, schedule: str = "1f1b", tp_skew_ms: float = 2.0) -> dict:
    """Lesson 06 § 6: one step of a pp x tp run on GPUs (``minipar.trace`` format).
    Every rank ran its stage's part of ``schedule`` in order; the tp ranks of a stage
    started every action within ``tp_skew_ms`` of each other; every forward and backward
    contains tp collectives on the rank's comm track. Returns, per rank, the action
    order and the number of tp collectives inside each F and B."""
    from minipar.parallel.schedules import COMPUTE, make_schedule
    from minipar.viz.timeline import chrome_trace_lanes

    lanes, coords = chrome_trace_lanes(trace), _coords(trace)
    pp = 1 + max(c["pp"] for c in coords.values())
    actions = {r: [s for s in lanes[f"rank {r} compute"] if s[2] in COMPUTE] for r in coords}
    m = max(int(s[3][1:]) for a in actions.values() for s in a) + 1
    want = [[f"{a.kind}{a.mb}" for a in acts if a.kind in COMPUTE]
            for acts in make_schedule(schedule, pp, m)]
    out = {}
    for r, acts in sorted(actions.items()):
        names = [s[3] for s in acts]
        assert names == want[coords[r]["pp"]], f"rank {r} ran {names}"
        comm = [s for s in lanes[f"rank {r} comm"] if s[3].endswith(" tp")]
        inside = [sum(a[0] <= c[0] and c[1] <= a[1] for c in comm) for a in acts]
        assert min(inside) > 0, f"rank {r}: an action without a tp collective"
        out[r] = {"coords": coords[r], "actions": names, "tp_collectives": inside}
    for r, acts in actions.items():
        partners = [q for q in actions if q != r and {k: v for k, v in coords[q].items()
                                                      if k != "tp"} ==
                    {k: v for k, v in coords[r].items() if k != "tp"}]
        for q in partners:
            skew = max(abs(a[0] - b[0]) for a, b in zip(acts, actions[q]))
            assert skew < tp_skew_ms, f"ranks {r} and {q} drift apart by {skew:.2f} ms"
    return out


def _union(spans) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted((a, b) for a, b, *_ in spans if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _covered(xs, ys) -> float:
    """Time the spans ``xs`` and ``ys`` share (each as a union)."""
    xs, ys, i, j, t = _union(xs), _union(ys), 0, 0, 0.0
    while i < len(xs) and j < len(ys):
        t += max(0.0, min(xs[i][1], ys[j][1]) - max(xs[i][0], ys[j][0]))
        i, j = (i + 1, j) if xs[i][1] < ys[j][1] else (i, j + 1)
    return t


def overlap_of_picture(picture: dict, tol: float = 0.02) -> dict:
    """Lesson 06 § 6: NCCL time and the share under compute, from the picture's merged
    lanes; asserted within ``tol`` of the same arithmetic on the raw kernels
    (``picture["stats"]``, written with the lanes by tools/h100_artifacts.py)."""
    nccl, compute = picture["lanes"]["NCCL"], picture["lanes"]["compute"]
    total = sum(b - a for a, b in _union(nccl))
    hidden = _covered(nccl, compute) / total
    by_kind = {k: sum(b - a for a, b, kk in nccl if kk == k) for k in {s[2] for s in nccl}}
    under_b = _covered([s for s in nccl if s[2] == "reduce-scatter"],
                       [s for s in compute if s[2] == "backward"])
    assert abs(hidden - picture["stats"]["hidden_share"]) < tol, (hidden, picture["stats"])
    assert abs(total - picture["stats"]["nccl_ms"]) < tol * total
    return {"nccl_ms": total, "hidden_share": hidden, "by_kind_ms": by_kind,
            "reduce_scatter_under_backward": under_b / by_kind["reduce-scatter"]}


def h100_overlap_table(data: dict) -> dict[str, dict]:
    """Lesson 06 § 6: print the measured overlap rows of ``data["overlap"]`` (with their
    provenance); assert they hold together (hidden share in [0, 1], exposed at most the
    NCCL time, the exposed share equal to exposed / step) and what the page says: tensor
    parallelism hides none of its communication, ZeRO-2 exposes under 5 % of its step.
    Returns the rows by name."""
    ov = data["overlap"]
    rows = {r["run"]: r for r in ov["rows"]}
    print(f"{data['device']}, torch {data['torch']}, NCCL {data['nccl']}: {ov['model']}")
    print(f"`{ov['command']}`\n")
    print(f"{'run':<24}{'NCCL ms/step':>13}{'hidden':>8}{'exposed ms':>12}")
    for name, r in rows.items():
        assert 0 <= r["hidden"] <= 1 and r.get("exposed_ms", 0) <= r["nccl_ms"]
        if "step_ms" in r:
            assert abs(r["exposed_ms"] / r["step_ms"] - r["exposed_share"]) < 0.001
        exposed = f"{r['exposed_ms']:.1f}" if "exposed_ms" in r else f"{r['nccl_ms']:.1f} (all)"
        print(f"{name:<24}{r['nccl_ms']:>13.1f}{r['hidden']:>8.0%}{exposed:>12}")
    tp = [r for n, r in rows.items() if "tp" in n]
    assert tp and all(r["hidden"] == 0 for r in tp)
    assert rows["minipar dp 4, ZeRO-2"]["exposed_share"] < 0.05
    return rows


def h100_headline_table(data: dict) -> list[dict]:
    """Lesson 06 § 6: the headline 4-GPU rows of ``data["headline"]`` beside their
    PyTorch peers, with the ratios minipar / peer (below 1: minipar is faster or
    smaller); returns the rows with ``step_ratio`` (and ``memory_ratio``) added."""
    head = data["headline"]
    print(f"{'run (4 GPUs)':<54}{'minipar':>10}{'PyTorch':>10}{'ratio':>7}"
          f"{'peak GiB':>13}  PyTorch peer")
    out = []
    for r in head["rows"]:
        (m, p), unit = r["step_ms"], "ms"
        row = {**r, "step_ratio": m / p}
        mem = ""
        if "peak_gib" in r:
            row["memory_ratio"] = r["peak_gib"][0] / r["peak_gib"][1]
            mem = f"{r['peak_gib'][0]:.1f} / {r['peak_gib'][1]:.1f}"
        if m >= 1000:
            m, p, unit = m / 1e3, p / 1e3, "s"
        print(f"{r['run']:<54}{m:>7.4g} {unit:<2}{p:>7.4g} {unit:<2}{row['step_ratio']:>7.2f}"
              f"{mem:>13}  {r['peer']}")
        out.append(row)
    w = head["weak_scaling"]
    print(f"\nweak scaling, {w['run']}: {w['efficiency']:.1%} ({w['meaning']})")
    return out


# --- lesson 07 § 4: partial recomputation on GPUs (each run's own train --json) -----------
RECOMPUTE_RUNS = "benchmarks/results/speed-gpu-4xH200-2026-11-28m1"  # gpt-13b dp 4 ZeRO-3


def recompute_layers_runs(folder: str = RECOMPUTE_RUNS) -> list[dict]:
    """Lesson 07 § 4: gpt-13b runs that recompute all of their blocks or only the first N
    (``python -m minipar train ... --recompute full [--recompute-layers N] --json``): per
    run the blocks recomputed, the command's config, the step (median after two, the
    slowest rank), the largest allocated and reserved peaks over the ranks, the GPUs and
    their capacity; the fewest recomputed first."""
    from minipar.model import get_config

    root = Path(__file__).resolve().parents[1]
    out = []
    for path in sorted((root / folder).glob("train_*13b*.json")):
        rec = json.loads(path.read_text())
        ranks, cfg = rec["ranks"], rec["config"]
        steps = [max(r["step_seconds"][i] for r in ranks)
                 for i in range(len(ranks[0]["step_seconds"]))]
        layers = cfg["recompute_layers"] or get_config(cfg["model"]).n_layer
        out.append({"layers": layers, "config": cfg, "step_s": statistics.median(steps[2:]),
                    "allocated": max(r["device_memory"]["peak_allocated"] for r in ranks),
                    "reserved": max(r["device_memory"]["peak_reserved"] for r in ranks),
                    "gpus": rec["world_size"],
                    "card_gib": ranks[0]["device_memory"]["capacity"] / 2**30})
    return sorted(out, key=lambda r: r["layers"])


# --- lesson 07 § 6: float8 on GPUs (the benchmark's recorded JSON) -------------------------
FP8_RUNS = ("benchmarks/results/fp8-2xH200-2026-11-28j2.json",     # kernel, speed, loss
            "benchmarks/results/fp8-peer-1xH100-2026-11-28j3.json",  # torchao beside minipar
            # kernels on one H100; both at 13B's width, tensorwise casting once a step
            "benchmarks/results/fp8-slice-13b-tensorwise-once-1xH100-2026-12-05p5.json",
            "benchmarks/results/fp8-loss-seeds-1xH100-2026-12-05p4.json")  # loss, three seeds


def _fp8_run(r: dict, who: str, device: str) -> dict:
    """One training run of the benchmark, labelled "model layout, who (GPUs)"."""
    words = [w for w in r["name"].split() if w != "torchao"]
    shown = {"dp": "dp {}", "zero": "ZeRO-{}", "recompute": "{} recompute"}
    layout = [shown[k].format(v) for k, v in (w.split("=") for w in words if "=" in w)
              if k in shown]
    # a slice of a model ("gpt-13b x6": its first 6 blocks at full width) keeps the mark
    from minipar.model import get_config

    cut = re.fullmatch(r"x(\d+)", words[1])
    model = f"{words[0]} {words[1]}" if cut else words[0]
    shape = (f"{words[0]}, {cut[1]} of {get_config(words[0]).n_layer} blocks" if cut
             else model)
    row = {"model": model, "recipe": r["fp8"] or "bf16", "who": who, "device": device,
           "label": " ".join([shape, *layout]) + f", {who.split()[0]} ({device})",
           "command": r.get("command", ""), "ok": r["status"] == "ok"}
    if row["ok"]:
        row.update(speedup=r.get("speedup_vs_bf16", 1.0), step_s=r["step_s"],
                   tokens_per_s=r["tokens_per_s"], peak_gib=r["peak_gib"], mfu=r.get("mfu"),
                   wire_saved=r.get("wire_bytes_saved_vs_bf16", 0.0),
                   wire_saved_predicted=r.get("predicted_wire_bytes_saved_vs_bf16", 0))
    else:
        row["error"] = "out of memory" if "OutOfMemory" in r["error"] else "failed"
        card = re.search(r"total capacity of ([\d.]+) GiB", r["error"])
        row["card_gib"] = float(card.group(1)) if card else None
    return row


def fp8_gpu_runs(files: tuple[str, ...] = FP8_RUNS) -> dict:
    """Lesson 07 § 6: what ``benchmarks/fp8_gpu.py`` recorded (JSON files under the
    repository root): ``kernel`` (one 8192^3 matmul, and one linear layer's forward +
    backward, bf16 against float8), ``runs`` (training steps in bf16, rowwise and
    tensorwise, minipar and torchao's ``Float8Linear``: tokens/s, speed over the same
    run's bf16, the dp bytes saved on the wire; or why a run failed) and ``loss`` (the
    last 20 steps' mean loss, and its ratio to bf16's)."""
    root = Path(__file__).resolve().parents[1]
    out: dict = {"runs": [], "loss": {}}
    for f in files:
        rec = json.loads((root / f).read_text())
        rows = {name: sec["rows"] for name, sec in rec["sections"].items()}
        names = {r["device_name"] for sec in rows.values() for r in sec if r.get("device_name")}
        name = names.pop() if names else rec["meta"]["device_name"]  # (loss rows name none)
        device = f"{rec['meta']['gpus']} x {name.replace('NVIDIA ', '').split()[0]}"
        out["torch"] = rec["meta"]["torch"]
        for k in rows.get("kernel", []):
            out["kernel"] = {"device": device, "n": k["n"], "shape": k["linear_shape"],
                             "bf16": k["bf16_tflops"],
                             "rowwise": k["rowwise_e4m3xe4m3_fast_accum_tflops"],
                             "tensorwise": k["tensorwise_e4m3xe4m3_fast_accum_tflops"],
                             "linear_ms": {x: k[f"linear_{x}_ms"]
                                           for x in ("bf16", "rowwise", "tensorwise")}}
        for r in rows.get("speed", []) + rows.get("speed1", []):
            out["runs"].append(_fp8_run(r, "minipar", device))
        for r in rows.get("peer", []):
            out["runs"].append(_fp8_run(r, f"torchao {r['torchao']}", device))
        if rows.get("loss"):  # the last file with loss runs gives them all (one setting)
            out["loss"] = {}
        for r in rows.get("loss", []):
            model, data = r["name"].split()[:2]
            run = out["loss"].setdefault(r["fp8"] or "bf16", {
                "model": model, "data": data, "steps": r["steps"], "device": device,
                "finals": [], "ratios": []})
            run["finals"].append(r["final_loss"])
            run["ratios"].append(r.get("final_loss_ratio_vs_bf16", 1.0))
    for run in out["loss"].values():  # over the seeds
        run["final"], run["ratio"] = statistics.fmean(run["finals"]), statistics.fmean(
            run["ratios"])
    return out


BLOCK_SAVED = "benchmarks/results/block-saved-cpu-2026-12-05.json"  # benchmarks/block_saved.py


def fp8_memory(runs: list[dict], saved: str = BLOCK_SAVED) -> dict:
    """Lesson 07 § 6: the 13B slice's peaks on one H100 (``runs``: ``fp8_gpu_runs``'s,
    bf16 and rowwise), the memory model's live-tensor peak for each run's command
    (``theory.card.card_peak``, as ``train`` predicts it), and what one block keeps for
    its backward, counted tensor by tensor (``benchmarks/block_saved.py``'s recorded rows:
    bytes a token and hidden unit, eager and compiled, per recipe); the slice's blocks,
    width and tokens a micro-batch."""
    from minipar.__main__ import build_parser, train_config
    from minipar.theory.card import card_peak

    out: dict = {"measured": {}, "predicted": {}, "kept": {}}
    for recipe in ("bf16", "rowwise"):
        run = next(r for r in runs if r["model"] == "gpt-13b x6" and r["recipe"] == recipe
                   and r["who"] == "minipar" and r["device"].startswith("1"))
        cfg = train_config(build_parser().parse_args(run["command"].split()[3:]))
        out["measured"][recipe] = run["peak_gib"]
        model, layout = cfg.model_config(), cfg.layout("cuda")
        out.update(device=run["device"], command=run["command"], blocks=model.n_layer,
                   width=model.d_model, tokens=layout.microbatch_size * model.seq_len)
        out["predicted"][recipe] = card_peak(model, layout)["total"] / 2**30
    rec = json.loads((Path(__file__).resolve().parents[1] / saved).read_text())
    for r in rec["rows"]:
        # (the file has rows that recompute, by flag or under a memory budget, too)
        if r.get("recompute", "none") == "none" and r.get("memory_budget", 1.0) == 1.0:
            how = "compiled" if r["compiled"] else "eager"
            out["kept"][how, r["recipe"] or "bf16"] = r["per_token_hidden"]
    return out


def fp8_gpu_table(data: dict) -> list[dict]:
    """Print the runs of ``fp8_gpu_runs`` (tokens/s, speed over bf16's, peak memory) and
    the loss ratios; returns the float8 runs as ``fp8_speed_figure`` draws them."""
    print(f"{'run':<56}{'recipe':<12}{'tokens/s':>10}{'x bf16':>8}{'peak GiB':>10}")
    for r in data["runs"]:
        if r["ok"]:
            print(f"{r['label']:<56}{r['recipe']:<12}{r['tokens_per_s']:>10,.0f}"
                  f"{r['speedup']:>8.2f}{r['peak_gib']:>10.1f}")
        else:
            print(f"{r['label']:<56}{r['recipe']:<12}  {r['error']} ({r['card_gib']} GiB card)")
    loss = data["loss"]
    bf16 = loss["bf16"]
    print(f"\n{bf16['model']} on {bf16['data']} ({bf16['device']}), mean loss of the last 20 of "
          f"{bf16['steps']} steps, {len(bf16['finals'])} seeds:")
    for k, v in loss.items():
        print(f"  {k:<11}" + "  ".join(f"{x:.4f}" for x in v["finals"])
              + ("" if k == "bf16" else "   x bf16's: " + "  ".join(
                  f"{x:.4f}" for x in v["ratios"]) + f"   mean {v['ratio']:.4f}"))
    return [{"run": r["label"].replace(", ", "<br>"), "recipe": r["recipe"],
             "speedup": r.get("speedup"), "note": r.get("error", "")}
            for r in data["runs"] if r["recipe"] != "bf16"]


# --- the capstone (lesson 10) ---------------------------------------------------------
# A model of about 10M parameters, 8 CPU ranks, a memory cap per rank and a target
# validation loss on real text. The learner plans with minipar.theory (the planner's
# step model, priced at paces measured on this machine), predicts, rehearses the job's
# first steps, reads their trace, and reconciles; these helpers enumerate the layouts,
# build the run's config and grade the gap. The cap is set between the layouts' predicted
# peaks, so that it rules some out (tested). The job's full run is long (minutes to an
# hour on a laptop): one is committed (``capstone_long_run``), with how it was made.
CAPSTONE = dict(model="gpt-10m", data="pystdlib", ranks=8, batch_size=16, steps=500,
                eval_every=50, rehearsal_steps=2, memory_cap=100e6, target_val_loss=1.5)
LONG_RUN = "capstone_long_run.json"  # under notebooks/data
GPU_RUN = "capstone_gpu_run.json"  # the same job, longer, on GPUs (tools/capstone_long_run.py)


def capstone_pace(brief: dict | None = None, seconds: float = 0.5) -> dict:
    """This machine's paces with the brief's ranks all busy at once, as the job will
    run: each rank's matmul FLOP/s (one thread, the model's MLP matmul, all ranks
    timing together), and an all-reduce's bus bandwidth and latency over all ranks
    (gloo). The lowest rank's rate and the slowest collective set the pace."""
    from minipar.launch import launch

    b = brief or CAPSTONE
    mc = capstone_config(_any_layout(b), b).model_config()
    out = launch(_pace_on_a_rank, b["ranks"], args=(mc.d_model, mc.seq_len, seconds))
    return {"matmul_flops": min(r["flops"] for r in out),
            "bus_bandwidth": min(r["bus_bandwidth"] for r in out),
            "latency": max(r["latency"] for r in out), "ranks": b["ranks"]}


def _pace_on_a_rank(hidden: int, tokens: int, seconds: float) -> dict:
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    x, w = torch.randn(tokens, hidden), torch.randn(hidden, 4 * hidden)
    dist.barrier()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x @ w
        n += 1
    flops = 2 * tokens * hidden * 4 * hidden * n / (time.perf_counter() - t0)
    world = dist.get_world_size()

    def timed(numel: int, repeats: int) -> float:
        t = torch.ones(numel)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(t)
        return (time.perf_counter() - start) / repeats

    latency = timed(1, 5)
    size = 2**20  # 4 MB of fp32
    bus = 2 * (world - 1) / world * 4 * size / max(timed(size, 3) - latency, 1e-9)
    return {"flops": flops, "bus_bandwidth": bus, "latency": latency}


def _any_layout(brief: dict) -> dict:
    return dict(dp=brief["ranks"], pp=1, tp=1, zero=0, sp=False, microbatches=1)


def capstone_cluster(pace: dict, brief: dict | None = None):
    """The brief's ranks as a planner ``Cluster``: each rank a device with the memory cap,
    the measured matmul rate, and one link for every collective (the measured bus
    bandwidth and latency: on one machine, every group is inside the node)."""
    from minipar.theory.clusters import GPU, Cluster

    b = brief or CAPSTONE
    rank = GPU("CPU rank", int(b["memory_cap"]), pace["matmul_flops"],
               pace["bus_bandwidth"], pace["bus_bandwidth"])
    return Cluster(f"{b['ranks']} CPU ranks", b["ranks"], rank, b["ranks"],
                   latency=pace["latency"], matmul_flops=pace["matmul_flops"])


def capstone_layouts(brief: dict | None = None, cluster=None) -> list[dict]:
    """Every layout of ``brief["ranks"]`` ranks the engine runs for the brief's model
    (tp dividing the heads, pp the layers; ZeRO 0-3 over dp; sp with tp; 4 micro-batches
    with a pipeline, else 1), each with what ``minipar.theory`` predicts for it in fp32
    Adam: ``memory`` (bytes, the most loaded rank), ``wire`` (bytes rank 0 sends a step,
    by group), ``bubble`` (1F1B's idle share) and, given a ``cluster``
    (``capstone_cluster``), ``time``: the planner's step in seconds and its parts
    (``planner.evaluate``). Sorted by predicted step time (without a cluster: bytes)."""
    from minipar.theory.bubble import bubble_fraction_formula
    from minipar.theory.comm_volume import comm_volume
    from minipar.theory.memory import memory_per_stage
    from minipar.theory.planner import evaluate

    b = brief or CAPSTONE
    mc = capstone_config(_any_layout(b), b).model_config()
    n, out = b["ranks"], []
    for tp in (t for t in (1, 2, 4, 8) if n % t == 0 and mc.n_head % t == 0):
        for pp in (p for p in (1, 2, 4, 8) if (n // tp) % p == 0 and mc.n_layer % p == 0):
            dp = n // (tp * pp)
            m = 4 if pp > 1 else 1
            for zero in range(4) if dp > 1 else (0,):
                lay = dict(dp=dp, pp=pp, tp=tp, zero=zero, sp=tp > 1, microbatches=m)
                theory = capstone_config(lay, b).layout()  # what the theory prices
                rows = memory_per_stage(mc, theory, accounting="fused")
                vol = comm_volume(mc, theory)
                wire = {g: sum(v["wire_bytes"] for v in ops.values()) for g, ops in vol.items()}
                c = {"layout": lay, "memory": max(r["total"] for r in rows), "wire": wire,
                     "bubble": bubble_fraction_formula("1f1b", pp, m)}
                if cluster is not None:
                    c["time"] = evaluate(mc, cluster, theory, matmul_efficiency=1.0).time
                out.append(c)
    return sorted(out, key=lambda c: (c["time"]["step"] if "time" in c else 0,
                                      sum(c["wire"].values()), c["memory"]))


def capstone_plan(layouts: list[dict], brief: dict | None = None) -> dict:
    """The brief's choice among ``capstone_layouts``: predicted to fit the memory cap,
    then the fastest predicted step (untimed: the fewest bytes on the wire; ties: the
    least memory)."""
    b = brief or CAPSTONE
    fits = [c for c in layouts if c["memory"] <= b["memory_cap"]]
    return min(fits, key=lambda c: (c["time"]["step"] if "time" in c else 0,
                                    sum(c["wire"].values()), c["memory"]))


def layout_label(lay: dict) -> str:
    """``dp 2 pp 2 tp 1 ZeRO-1`` (sp and micro-batches when they apply)."""
    text = f"dp {lay['dp']} pp {lay['pp']} tp {lay['tp']} ZeRO-{lay['zero']}"
    return text + (" sp" if lay.get("sp") else "") + \
        (f" m {lay['microbatches']}" if lay.get("microbatches", 1) > 1 else "")


def capstone_config(layout: dict, brief: dict | None = None, trace: str | None = None,
                    whole: bool = False):
    """The ``TrainConfig`` of the capstone job for ``layout``: the rehearsal (the job's
    first ``rehearsal_steps``, stopped there with ``stop_at``: the job's own schedule,
    loss for loss; with ``trace``, traced and its activations measured), or the
    ``whole`` job, evaluated every ``eval_every`` steps."""
    from minipar.config import TrainConfig

    b = brief or CAPSTONE
    return TrainConfig(model=b["model"], data=b["data"], steps=b["steps"],
                       batch_size=b["batch_size"], eval_every=b["eval_every"] if whole else 0,
                       stop_at=None if whole else b["rehearsal_steps"], trace=trace,
                       measure_activations=trace is not None, **layout)


def _layout_flags(lay: dict) -> str:
    flags = f"--dp {lay['dp']} --pp {lay['pp']} --tp {lay['tp']} --zero {lay['zero']}"
    flags += " --sp" if lay.get("sp") else ""
    return flags + (f" --microbatches {lay['microbatches']}"
                    if lay.get("microbatches", 1) > 1 else "")


def capstone_command(layout: dict, brief: dict | None = None, backend: str = "gloo",
                     rehearsal: bool = False) -> str:
    """The whole job as one command line (``backend="nccl"``: on GPUs, one rank a GPU), or
    its traced ``rehearsal``."""
    b = brief or CAPSTONE
    gpu = " --backend nccl" if backend == "nccl" else ""
    head = (f"python -m minipar train --model {b['model']} --data {b['data']} "
            f"{_layout_flags(layout)} --batch-size {b['batch_size']} --steps {b['steps']}")
    if rehearsal:
        return (f"{head} --stop-at {b['rehearsal_steps']}{gpu} --trace trace.json "
                "--measure-activations --json rehearsal.json")
    return f"{head} --eval-every {b['eval_every']}{gpu} --save capstone --json run.json"


def capstone_long_run(path: str | Path | None = None, gpu: bool = False) -> dict:
    """A whole run of the job: yours (``path``: the ``--json`` of ``capstone_command``'s
    run; a ``sample`` key, if you add one, is shown), else the one committed with the
    course (``notebooks/data/capstone_long_run.json``: its command, machine, date and wall
    time under ``provenance``; ``gpu``: the same job trained longer on GPUs,
    ``capstone_gpu_run.json``). Adds ``tokens_seen`` and ``corpus_bytes`` (the training
    text) where missing."""
    data = json.loads(Path(path or DATA / (GPU_RUN if gpu else LONG_RUN)).read_text())
    data.setdefault("provenance", {"command": "your own run", "source": str(path)})
    data.setdefault("sample", "(no sample yet: see the sample command above)")
    if "tokens_seen" not in data:
        data.update(run_extent(data["config"], len(data["losses"])))
    return data


def run_extent(config: dict, steps: int) -> dict:
    """``tokens_seen`` by a run of ``steps`` steps of ``config`` (a run JSON's), and the
    bytes of its training text, ``corpus_bytes`` (the held-out share left out)."""
    import os

    from minipar.config import TrainConfig
    from minipar.corpus import VAL_FRACTION, text_files

    seq = TrainConfig(model=config["model"], data=config["data"]).model_config().seq_len
    size = sum(os.path.getsize(f) for f in text_files(config["data"]))
    return {"tokens_seen": steps * config["batch_size"] * seq,
            "corpus_bytes": int(size * (1 - VAL_FRACTION))}


def step_wire_bytes(trace: dict, sizes: dict[str, int]) -> dict[str, int]:
    """Bytes rank 0 put on the wire in one whole step of a ``--trace`` trace, by group: the
    communication that starts between the first compute of the second-to-last step and
    the first of the last (so the optimizer's collectives count, and a validation pass
    after training does not). ``sizes``: each group's number of ranks ({"dp": 2, ...})."""
    from minipar.comm import wire_bytes

    xs = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] == 0]
    firsts: dict[int, float] = {}
    for e in xs:
        step = e["args"].get("step") if e["tid"] == 0 else None
        if step is not None:
            firsts[step] = min(firsts.get(step, e["ts"]), e["ts"])
    last = max(firsts)
    t0, t1 = firsts[last - 1], firsts[last]
    out: dict[str, int] = {}
    for e in xs:
        if e["tid"] == 1 and t0 <= e["ts"] < t1:
            op, group = e["name"].split()
            out[group] = out.get(group, 0) + wire_bytes(op, e["args"]["bytes"], sizes[group])
    return out


def reconcile(run: dict, predicted: dict, trace: dict) -> list[dict]:
    """Predicted against measured: rank 0's memory part by part, the most loaded rank's
    peak, the bytes rank 0 sent in one step by group (from the trace), and, when the
    prediction was timed, the busiest rank's last step by part (``trace_breakdown``;
    the schedule's bubble and the pipeline's sends against its waiting). Returns the rows
    (``what``, ``predicted``, ``measured``, ``gap``: measured / predicted - 1) and prints
    them (times in ms)."""
    from minipar.theory.comm_volume import comm_volume
    from minipar.theory.memory import memory_per_stage

    lay = predicted["layout"]
    mc = _run_model(run)
    size = run["config"]["batch_size"] // (lay["dp"] * lay["microbatches"])
    theory = capstone_config(lay).layout().with_(microbatch_size=size)
    stages = memory_per_stage(mc, theory, accounting="fused")
    vol = comm_volume(mc, theory)
    sent = step_wire_bytes(trace, {"dp": lay["dp"], "pp": lay["pp"], "tp": lay["tp"]})
    rank0 = run["ranks"][0]
    rows = [{"what": f"rank 0 {part}", "predicted": stages[0][part],
             "measured": rank0["memory"][part]}
            for part in ("params", "grads", "optimizer", "activations", "total")]
    top = max(run["ranks"], key=lambda r: r["memory"]["total"])
    rows.append({"what": f"peak of any rank (rank {top['rank']})",
                 "predicted": predicted["memory"], "measured": top["memory"]["total"]})
    for group, ops in vol.items():
        rows.append({"what": f"rank 0 {group} bytes in a step",
                     "predicted": sum(v["wire_bytes"] for v in ops.values()),
                     "measured": sent.get(group, 0)})
    if "time" in predicted:
        rows += _time_rows(predicted["time"], trace_breakdown(trace))
    print(f"{'':<34}{'predicted':>12}{'measured':>12}{'gap':>8}")
    for r in rows:
        p, m = r["predicted"], r["measured"]
        r["gap"] = m / p - 1 if p else 0.0 if not m else math.inf
        gap = f"{r['gap']:>+8.0%}" if r["gap"] != math.inf else f"{'(none)':>8}"
        print(f"{r['what']:<34}{p:>12,.0f}{m:>12,.0f}{gap}")
    return rows


def _run_model(run: dict):
    """The model a run's JSON trained (its ``config``)."""
    from minipar.config import TrainConfig

    keep = ("model", "data", "layers", "hidden", "heads", "ffn", "vocab", "seq_len")
    return TrainConfig(**{k: run["config"][k] for k in keep}).model_config()


def _time_rows(time: dict, parts: dict[int, dict[str, float]]) -> list[dict]:
    """The planner's step (seconds) beside the busiest rank's last traced step (ms)."""
    busiest = max(parts.values(), key=lambda p: p["compute_ms"])
    pairs = [("compute", time["compute"], busiest["compute_ms"]),
             ("bubble + pp waits", time["bubble"] + time["pp"], busiest["waiting_ms"]),
             ("tp", time["tp"], busiest["tp_ms"]),
             ("dp", time["dp"] + time["update"], busiest["dp_ms"]),
             ("step", time["step"], busiest["step_ms"])]
    return [{"what": f"busiest rank: {name}, ms", "predicted": 1e3 * p, "measured": m}
            for name, p, m in pairs]


def score_capstone(run: dict, long_run: dict, rows: list[dict], mine: dict | None = None,
                   brief: dict | None = None, time_factor: float = 2.0) -> dict:
    """Grade the capstone. The rehearsal (``run``) is the job's first steps: its losses
    are the whole run's (``long_run``, any layout) to 1e-4, it stayed under the memory
    cap as measured, and the predictions held: the peak memory within 25 %, every
    group's bytes within 1 %, the busiest rank's step within ``time_factor`` either way
    (``reconcile``'s rows: the planner's). ``mine``: your own ``peak_mb`` and
    ``step_ms``, graded in place of the planner's where given. The whole run reached the
    target validation loss. Prints one line each."""
    b = brief or CAPSTONE
    mine = {k: v for k, v in (mine or {}).items() if v is not None}
    first = long_run["losses"][:len(run["losses"])]
    worst = max(abs(a - c) for a, c in zip(run["losses"], first))
    val = long_run["eval"][-1]["loss"]
    peak = max(r["memory"]["total"] for r in run["ranks"])
    guess = mine.get("peak_mb", 0) * 1e6 or next(r["predicted"] for r in rows
                                                 if r["what"].startswith("peak"))
    mem_gap = peak / guess - 1
    byte_rows = [r for r in rows if r["what"].endswith("bytes in a step")]
    byte_gap = max(byte_rows, key=lambda r: abs(r["gap"]))
    step = next((r for r in rows if r["what"] == "busiest rank: step, ms"), None)
    said = mine.get("step_ms") or (step and step["predicted"])
    factor = step and said and max(step["measured"] / said, said / step["measured"])
    whose = {k: "your" if k in mine else "the planner's" for k in ("peak_mb", "step_ms")}
    grades = {"parity": worst < 1e-4, "loss": val <= b["target_val_loss"],
              "memory": peak <= b["memory_cap"], "memory_prediction": abs(mem_gap) <= 0.25,
              "bytes_prediction": abs(byte_gap["gap"]) <= 0.01,
              "time_prediction": factor is not None and factor <= time_factor}
    lines = [("parity", "the job's first steps, loss for loss: within "
              + ("1e-4 at every step" if grades["parity"] else f"{worst:.2g}")),
             ("loss", f"validation loss {val:.2f} after {long_run['eval'][-1]['step']} "
              f"steps (target at most {b['target_val_loss']})"),
             ("memory", f"measured peak {peak / 1e6:.1f} MB on the busiest rank (cap "
              f"{b['memory_cap'] / 1e6:.0f} MB)"),
             ("memory_prediction", f"{whose['peak_mb']} peak memory: off by "
              f"{abs(mem_gap):.0%} (25 % passes)"),
             ("bytes_prediction", f"bytes a step predicted within {abs(byte_gap['gap']):.1%} "
              f"(worst: {byte_gap['what']}; 1 % passes)"),
             ("time_prediction", f"{whose['step_ms']} step time " + (
                 f"off by a factor {factor:.2f} ({time_factor:g} passes)" if factor
                 else "(no timed prediction)"))]
    for key, text in lines:
        print(f"{'PASS' if grades[key] else 'FAIL'}  {text}")
    grades["passed"] = all(grades.values())
    return grades


def trace_breakdown(trace: dict) -> dict[int, dict[str, float]]:
    """Per rank, the last traced step of a ``--trace`` Chrome trace split into
    milliseconds of compute, of collectives not under compute (``collective_ms``, and by
    group: ``tp_ms``, ``dp_ms``; sends and receives count as waiting: posted early,
    they are in flight, not busy) and of waiting (the rest: the bubble, a partner's
    lateness, and on a shared CPU, other ranks on the cores)."""
    from minipar.viz.timeline import step_lanes

    lanes = step_lanes(trace)
    step = max(b for spans in lanes.values() for _, b, *_ in spans)
    out: dict[int, dict[str, float]] = {}
    for rank in sorted({int(lane.split()[1]) for lane in lanes}):
        comp = [(a, b) for a, b, *_ in lanes.get(f"rank {rank} compute", [])]
        coll = [(a, b, name.split()[-1]) for a, b, _, name in lanes.get(f"rank {rank} comm", [])
                if not name.startswith(("send", "recv"))]
        busy = sum(b - a for a, b in _union(comp))
        total = _exposed([(a, b) for a, b, _ in coll], comp)
        out[rank] = {"step_ms": step, "compute_ms": busy, "collective_ms": total,
                     "waiting_ms": step - busy - total}
        for group in ("tp", "dp"):
            out[rank][f"{group}_ms"] = _exposed([(a, b) for a, b, g in coll if g == group],
                                                comp)
    return out


def _exposed(spans: list[tuple[float, float]], under: list[tuple[float, float]]) -> float:
    """How long ``spans`` run while nothing of ``under`` does."""
    return sum(b - a for a, b in _union(spans)) - _covered(spans, under)


# --- lesson 08: ring attention measured, and the merge inside a layer -----------------
def ring_timing(layout: str, shape: tuple[int, int, int, int] = (1, 4, 4096, 64),
                repeats: int = 10) -> dict:
    """Run on each rank of a cp group: this thread's CPU seconds inside the attention blocks
    of a ring-attention forward (the least of ``repeats``; one compute thread, and its own
    CPU time only: not the communication threads', nor other processes' on a loaded
    machine) and the sends it counted. ``shape``: (batch, heads, sequence, head dim).

    One rank computes a block at a time (a file lock around each): on a laptop's two
    cores, ranks computing together slow each other unevenly (two threads on one core's
    hyperthreads each take longer per block), and the spread would measure the scheduler,
    not the split. The sends and waits between blocks are untouched."""
    import fcntl
    import os
    import tempfile
    import time

    import torch

    from minipar.comm import Comm
    from minipar.parallel import cp

    torch.set_num_threads(1)
    comm = Comm(dim="cp")
    plain, busy = cp.block_forward, [0.0]
    lock = os.path.join(tempfile.gettempdir(), "minipar-ring-timing.lock")

    def timed(*args, **kwargs):
        with open(lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
            t = time.thread_time()
            out = plain(*args, **kwargs)
            busy[0] += time.thread_time() - t
        return out

    cp.block_forward = timed  # this rank's process only
    g = torch.Generator().manual_seed(0)
    q, k, v = (cp.shard_sequence(torch.randn(*shape, generator=g), comm.rank, comm.size,
                                 layout, dim=2) for _ in range(3))
    core = cp.RingAttention(comm, layout)
    per_run = []
    with torch.no_grad():
        core(q, k, v)  # warm-up
        for _ in range(repeats):
            busy[0] = 0.0
            comm.log.clear()
            core(q, k, v)
            per_run.append(busy[0])
    return {"busy": min(per_run), "sends": comm.log.summary()["cp"]["send"]}


def _layer_input(cfg):
    import torch

    return torch.randn(2, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(1))


def ring_layer_on_a_shard(impl: str, cfg) -> dict:
    """Run on each rank of a cp group: a transformer layer whose attention core is
    ``RingAttention`` with ``<impl>.attention_merge``'s merge, on this rank's zig-zag share
    of the sequence; its output, input gradient and weight gradients summed over cp."""
    import importlib

    import torch

    from minipar.comm import Comm
    from minipar.model import Block
    from minipar.parallel import cp

    cp.merge_attention = importlib.import_module(f"{impl}.attention_merge").merge_attention
    comm = Comm(dim="cp")
    torch.manual_seed(0)
    block = Block(cfg)
    block.attn.core = cp.RingAttention(comm)  # a submodule replaced, as a plan does
    x_mine = cp.shard_sequence(_layer_input(cfg), comm.rank, comm.size).requires_grad_()
    out = block(x_mine)
    out.pow(2).sum().backward()
    grads = [p.grad for p in block.parameters()]
    for g in grads:  # cp ranks hold the same weights: sum their gradients, as dp does
        comm.all_reduce(g)
    return {"out": out.detach(), "dx": x_mine.grad, "grads": grads}


def ring_layer_errors(results: list[dict], cfg) -> dict[str, float]:
    """The worst differences (relative to the largest value) between the cp ranks'
    ``ring_layer_on_a_shard`` results, put back in order, and one process's layer."""
    import torch

    from minipar.model import Block
    from minipar.parallel import cp

    torch.manual_seed(0)
    ref = Block(cfg)
    x = _layer_input(cfg).requires_grad_()
    out = ref(x)
    out.pow(2).sum().backward()

    def rel(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got - want).abs().max() / want.abs().max()).item()

    return {"output": rel(cp.unshard_sequence([r["out"] for r in results]), out.detach()),
            "input gradient": rel(cp.unshard_sequence([r["dx"] for r in results]), x.grad),
            "weight gradients": max(rel(g, p.grad) for g, p in zip(results[0]["grads"],
                                                                   ref.parameters()))}


# --- "your code trains": the runs that plug an exercise into training (lessons 00-02) ---
# Each runs on every rank of a launched job (or alone, world 1) and takes the package to
# load the learner's code from by name, so it is importable: a rank started by spawn
# (Windows) can run it as well as a forked one.
def _impl(name: str, impl: str):
    import importlib

    return importlib.import_module(f"{impl}.{name}")


def train_with_ring(impl: str = "solutions", steps: int = 8, batch: int = 16,
                    world: int | None = None) -> dict:
    """Lesson 00 § 7: the two-layer tiny GPT trained with data parallelism by hand: each
    rank's slice of the batch, all gradients flattened into one buffer, summed by
    ``<impl>.ring_allreduce.ring_all_reduce`` and divided by the world size, then AdamW.
    ``world`` 1 (or no job): one process on the whole batch. Returns the losses, the bytes
    sent per step and the gradient buffer's bytes."""
    import torch
    import torch.distributed as dist

    from minipar.comm import Comm
    from minipar.data import MarkovData, split_batch
    from minipar.model import GPT, get_config

    world = world or (dist.get_world_size() if dist.is_initialized() else 1)
    rank = dist.get_rank() if world > 1 else 0
    cfg = get_config("tiny").with_(n_layer=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = MarkovData(cfg.vocab_size, cfg.seq_len, seed=0)
    comm = Comm() if world > 1 else None
    ring = _impl("ring_allreduce", impl) if comm else None
    losses, sent, grads = [], [], None
    for step in range(steps):
        x, y = data.batch(step, batch)
        [(mx, my)] = split_batch(x, y, rank, world, 1)
        loss = model(mx, my)
        loss.backward()
        if comm is not None:
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            comm.log.clear()
            ring.ring_all_reduce(comm, grads)
            sent.append(comm.log.total("nbytes", op="send"))
            grads /= world
            offset = 0
            for p in model.parameters():
                p.grad.copy_(grads[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "sent": sent, "grad_bytes": grads.numel() * 4 if comm else 0}


def train_with_ddp(impl: str = "solutions", steps: int = 6, batch: int = 16,
                   bucket_bytes: int = 64_000, world: int | None = None) -> dict:
    """Lesson 01 § 6: the two-layer tiny GPT on each rank's slice of the batch, its
    gradients averaged by ``<impl>.ddp_buckets.BucketedDDP`` (buckets of
    ``bucket_bytes``), AdamW. Returns the losses, the all-reduces per step and the
    bucket count; ``world`` 1 (or no job): one process on the whole batch."""
    import torch
    import torch.distributed as dist

    from minipar.comm import Comm
    from minipar.data import MarkovData, split_batch
    from minipar.model import GPT, get_config

    world = world or (dist.get_world_size() if dist.is_initialized() else 1)
    rank = dist.get_rank() if world > 1 else 0
    cfg = get_config("tiny").with_(n_layer=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    comm = Comm() if world > 1 else None
    ddp = _impl("ddp_buckets", impl).BucketedDDP(model, comm, bucket_bytes=bucket_bytes) \
        if comm else None
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = MarkovData(cfg.vocab_size, cfg.seq_len, seed=0)
    losses, calls = [], []
    for step in range(steps):
        x, y = data.batch(step, batch)
        [(mx, my)] = split_batch(x, y, rank, world, 1)
        if comm:
            comm.log.clear()
        loss = model(mx, my)
        loss.backward()
        if ddp:
            ddp.finish_gradient_sync()
            calls.append(len(comm.log.records))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "calls": calls, "buckets": len(ddp.buckets) if ddp else 1}


def _mlp_batch(step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def _mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))


def train_with_zero1(impl: str = "solutions", steps: int = 5) -> dict:
    """Lesson 02 § 4, on each rank: a small MLP on this rank's batches, stepped by
    ``<impl>.zero1.Zero1``. Returns the losses, the optimizer state bytes it holds and
    the collectives it used."""
    from minipar.comm import Comm

    comm, net = Comm(), _mlp()
    opt = _impl("zero1", impl).Zero1(net.parameters(), comm, lr=0.01)
    losses = []
    for step in range(steps):
        x, y = _mlp_batch(step, comm.rank)
        loss = (net(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": opt.state_bytes(),
            "ops": sorted({r.op for r in comm.log.records})}


def adamw_on_both_batches(steps: int = 5, ranks: int = 2) -> dict:
    """Lesson 02 § 4's reference: the same MLP in one process, AdamW on the mean gradient
    of every rank's batch. Returns each step's per-rank losses and the Adam state bytes."""
    import torch

    net = _mlp()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    out = []
    for step in range(steps):
        losses = [(net(x) - y).pow(2).mean() for x, y in
                  (_mlp_batch(step, r) for r in range(ranks))]
        (sum(losses) / ranks).backward()
        opt.step()
        opt.zero_grad()
        out.append([v.item() for v in losses])
    return {"losses": out, "state": 8 * sum(p.numel() for p in net.parameters())}


def run_schedule(impl: str = "solutions", microbatches: int = 4,
                 sleep_per_unit: float = 0.03) -> dict:
    """Lesson 05 § 7, on each rank of a pipeline: one step of the tiny GPT driven by
    ``<impl>.pipeline_1f1b.one_f_one_b``'s lists, each action padded by
    ``sleep_per_unit`` seconds per unit of work (a stand-in for a bigger model). Returns
    the loss and the rank's timeline."""
    import torch

    from minipar.comm import Comm
    from minipar.data import MarkovData, split_batch
    from minipar.model import GPT, get_config
    from minipar.parallel.pp import PipelineExecutor, build_stage

    mine, cfg, comm = _impl("pipeline_1f1b", impl), get_config("tiny"), Comm()
    torch.manual_seed(0)
    chunks = build_stage(GPT(cfg), comm.rank, comm.size)
    ex = PipelineExecutor(chunks, comm, mine.one_f_one_b(comm.size, microbatches),
                          sleep_per_unit=sleep_per_unit)
    x, y = MarkovData(cfg.vocab_size, cfg.seq_len).batch(0, 8)
    res = ex.step(split_batch(x, y, 0, 1, microbatches), broadcast_loss=True)
    return {"loss": res.loss, "timeline": res.timeline}
