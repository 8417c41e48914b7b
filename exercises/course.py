# Generated from solutions/course.py by tools/make_exercises.py: edit that file, not this one.
"""The learner's instruments: hints on request, predictions, and scored design puzzles.

    from exercises.course import hint, predict, score_schedule, score_layout

* ``hint(name, level)``: help for an exercise or lab, only when asked. Level 1 is a
  nudge (where to look), 2 the idea (what the algorithm does), 3 the formula (the
  index arithmetic, read from the reference solution's ``# HINT:`` lines, so the
  hints cannot drift from the code they describe).
* ``predict(question, guess, measured)``: you write a number before a cell measures it;
  the cell prints your guess beside the measurement. ``None`` means "not answered yet"
  and prints the measurement alone, so a notebook runs top to bottom either way.
* ``score_schedule`` and ``score_layout``: budgeted design puzzles. Your schedule (a
  list of actions per rank) or layout (tp, pp, dp, ...) is validated and priced by the
  same functions the engine and the planner use, and compared with a target.
"""

from __future__ import annotations

import re
from pathlib import Path

LEVELS = {1: "a nudge", 2: "the idea", 3: "the formula"}

# Levels 1 and 2, per exercise or lab. Level 3 comes from the solution's own # HINT: lines.
HINTS: dict[str, dict[int, str]] = {
    "ring_allreduce": {
        1: "Draw 3 ranks on a circle and 3 chunks per rank. After one step of the "
           "reduce-scatter, which chunk has picked up a second contribution on rank 1?",
        2: "Every step, each rank sends the chunk it most recently added to (at step 0: its "
           "own chunk number) to the right, and adds what arrives from the left into the "
           "chunk one index lower. Both indices move down by one per step, mod size. The "
           "all-gather walks the same way from the finished chunk, overwriting.",
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
        2: "reduce-scatter the flat gradient (each rank gets the sum of its own shard), "
           "divide by N, step the optimizer on the shard only, then all-gather the "
           "shards into every rank's parameters. Pad so N divides the length.",
    },
    "tp_linear": {
        1: "A column-parallel layer splits the output features, a row-parallel one the "
           "input features. Which of the two needs a sum of partial results in forward?",
        2: "f is the identity in forward and an all-reduce in backward (before a column "
           "layer); g is an all-reduce in forward and the identity in backward (after a "
           "row layer). The row layer adds its bias once, after the sum.",
    },
    "pipeline_1f1b": {
        1: "How many forwards must the last rank run before it can start a backward? "
           "And the first rank, with p stages downstream of it?",
        2: "Rank r runs p - r - 1 warm-up forwards, then alternates one forward and one "
           "backward (oldest micro-batch first), then drains the backwards left. The "
           "peak count is a running +1 per F, -1 per B.",
    },
    "mesh_coords": {
        1: "A rank number is a number written in a mixed radix; which digit varies "
           "fastest in Megatron order?",
        2: "Peel digits off from the fastest axis with % and //; build a rank back with "
           "Horner's rule from the slowest axis. A group varies one digit, keeping the "
           "other two.",
    },
    "memory_formula": {
        1: "Split the bytes into model states (depend on ZeRO stage and dp) and "
           "activations (depend on the schedule and the stage). Which stage holds most?",
        2: "States: each of weights, gradients, optimizer is divided by dp from the ZeRO "
           "stage that shards it. Activations: per-layer bytes x layers of the stage x "
           "micro-batches in flight (GPipe m, 1F1B p - s, ZB-H1 p), plus the embedding "
           "or head on the edge stages.",
    },
    "attention_merge": {
        1: "Each part is a softmax normalised over its own keys. Over both key sets, the "
           "denominator is the sum of the two parts' denominators. What is each part's "
           "denominator, given its lse?",
        2: "The union's mass is e^lse_a + e^lse_b, so lse = log(e^lse_a + e^lse_b). Part "
           "A's output was divided by e^lse_a only; multiply it by e^lse_a / e^lse = "
           "e^(lse_a - lse), likewise B, and add. Never compute e^lse itself: scores "
           "can be large.",
    },
    "debug_deadlock": {
        1: "Read the hang report: which operation is every rank stuck in, and who would "
           "have to act first to free it?",
        2: "A blocking receive on every rank at once waits for a send that nobody has "
           "posted yet. Make the send not wait (isend), or let half of the ranks send "
           "first.",
    },
    "debug_sp": {
        1: "Run gradient_audit(): which parameters differ from one process, and what do "
           "they have in common? Where in a layer are they used under sequence "
           "parallelism?",
        2: "The layer norms (and every parameter outside the tensor-parallel regions) run "
           "on each rank's part of the sequence, so each rank's gradient is a partial "
           "sum over its tokens. Nothing in the tp layers adds those parts: one all-reduce "
           "over tp after the backward must.",
    },
    "debug_pipeline": {
        1: "Run gradient_audit(): it prints the ratio of this run's gradient norm to one "
           "process. Which size of the layout equals that ratio?",
        2: "The pipeline accumulates the gradients of m micro-batch losses; one process "
           "computes the gradient of the mean over the batch. What must each micro-batch "
           "loss be multiplied by before its backward?",
    },
}


def _formula(name: str) -> list[tuple[str, str]]:
    """(function, hint text) for every ``# HINT:`` block in ``solutions/<name>.py``."""
    path = Path(__file__).resolve().parents[1] / "solutions" / f"{name}.py"
    if not path.exists():
        return []
    out: list[tuple[str, str]] = []
    function, taking = "", False
    for line in path.read_text().splitlines():
        text = line.strip()
        m = re.match(r"(?:async\s+)?def\s+(\w+)", text)
        if m:
            function, taking = m.group(1), False
        elif text.startswith("# HINT:"):
            out.append((function, text[len("# HINT:"):].strip()))
            taking = True
        elif taking and text.startswith("#") and not text.startswith("###"):
            out[-1] = (out[-1][0], out[-1][1] + " " + text.lstrip("#").strip())
        else:
            taking = False
    return out


def hint(name: str, level: int = 1, function: str | None = None) -> None:
    """Print hint ``level`` (1 a nudge, 2 the idea, 3 the formula) for exercise ``name``.

    Ask for the lowest level that gets you moving; level 3 is close to the answer.
    ``function`` narrows level 3 to one function of the exercise.
    """
    if level not in LEVELS:
        raise ValueError(f"level is 1 (a nudge), 2 (the idea) or 3 (the formula), not {level}")
    if name not in HINTS:
        raise ValueError(f"no hints for {name!r}; choose one of {sorted(HINTS)}")
    print(f"{name}, hint {level} ({LEVELS[level]}):")
    if level < 3:
        print("  " + HINTS[name][level])
        return
    items = [(f, h) for f, h in _formula(name) if function in (None, f)]
    for f, h in items or [("", HINTS[name][2])]:
        print(f"  {f + ': ' if f else ''}{h}")


def predict(question: str, guess: float | None, measured: float, unit: str = "",
            tol: float = 0.05, fmt: str = ".4g", by: str = "the run measured") -> bool | None:
    """Print your ``guess`` beside the ``measured`` value; ``None``: not answered yet.

    ``by`` says where the value came from ("the run measured", "the simulation gives",
    "the formula gives"): a number computed from theory is not called a measurement.

    Returns True when the guess is within ``tol`` (relative) of the measurement, False
    when it is not, None when there is no guess. Never raises on a wrong guess: a
    prediction is for you, not for the grader.
    """
    u = f" {unit}" if unit else ""
    got = f"{measured:{fmt}}{u}"
    if guess is None:
        print(f"{question}: not answered yet (set your guess above and rerun); "
              f"{by} {got}")
        return None
    close = abs(guess - measured) <= tol * max(abs(measured), 1e-12)
    verdict = (f"within {tol:.0%}" if close else
               f"off by {guess / measured:.3g}x" if measured else "off")
    print(f"{question}: you predicted {guess:{fmt}}{u}, {by} {got} ({verdict})")
    return close


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

    ``layout``: keyword arguments of ``minipar.theory.planner.evaluate`` (tp, pp, dp,
    zero, microbatch_size, schedule, virtual, sp, recompute). ``None``: not answered yet.
    """
    from minipar.theory.planner import evaluate

    if layout is None:
        print(f"not answered yet (target: at most {memory_cap / 1e9:.0f} GB per GPU, "
              f"a step of at most {step_target:.2f} s)")
        return None
    try:
        lay = evaluate(model, cluster, global_batch=global_batch, **layout)
    except (ValueError, TypeError) as exc:
        print(f"not a layout the planner can build: {exc}")
        return {"passed": False, "error": str(exc)}
    mem, step = lay.memory["total"], lay.step_time
    parts = ", ".join(f"{k} {lay.time[k]:.2f}" for k in ("compute", "bubble", "tp", "pp", "dp"))
    print(f"{lay.label()}\n  memory {mem / 1e9:.1f} GB per GPU (cap {memory_cap / 1e9:.0f}); "
          f"step {step:.2f} s (target {step_target:.2f}): {parts}; MFU {lay.mfu:.0%}")
    ok = mem <= memory_cap and step <= step_target
    print("PASS" if ok else "not yet: " + ("over the memory cap" if mem > memory_cap
                                           else "too slow"))
    return {"passed": ok, "memory": mem, "step_time": step}
