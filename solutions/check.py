"""Check an exercise: a clear PASS, FAIL or TODO with a hint, never a hang.

From a notebook or a script::

    from exercises.check import check
    check("ring_allreduce")     # one exercise
    check()                     # all of them

``check`` checks the package it is imported from (``exercises.check`` checks your code
in ``exercises/``, ``solutions.check`` the reference solutions); pass ``impl=`` to check
another package that has the same modules. It prints one line per exercise:

* ``PASS``: every case agreed with the reference.
* ``TODO``: a blank still raises ``NotImplementedError`` (it says which function, with
  the blank's hint).
* ``FAIL``: a wrong answer, an exception, or a hang; with what went wrong and a hint.

Multi-rank checks run through ``minipar.launch`` (``launch_case``): the ranks get the
exercise's timeout to start, then ``HANG_SECONDS`` without progress, so a deadlock in
your code comes back within seconds as a message naming the op each rank was stuck in.
Before a check runs, your module is re-imported, so edits you saved since the last check
count.

Each exercise's cases live in ``checks/<name>.py``: a function ``run(impl, timeout)``
that raises ``CheckFailure`` (a message and a hint) or returns a one-line summary.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import traceback
from dataclasses import dataclass, field

import torch

from minipar.launch import LaunchError, RankFailed, RankTimeout, launch
from minipar.rank import heartbeat


@dataclass(frozen=True)
class Exercise:
    lesson: str
    title: str
    functions: tuple[str, ...]  # what the learner fills in
    timeout: float = 30.0  # seconds per launched run


EXERCISES: dict[str, Exercise] = {
    "ring_allreduce": Exercise(
        "00", "ring all-reduce from send/recv",
        ("ring_reduce_scatter", "ring_all_gather", "ring_all_reduce")),
    "debug_deadlock": Exercise(
        "00", "debugging lab: ring moves, one of them wrong",
        ("shift_right", "shift_left", "ring_all_gather", "ring_sum"), timeout=5.0),
    "ddp_buckets": Exercise(
        "01", "bucketed, overlapped gradient all-reduce",
        ("bucket_params", "BucketedDDP")),
    "zero1": Exercise(
        "02", "a ZeRO-1 optimizer step", ("shard_range", "Zero1")),
    "tp_linear": Exercise(
        "04", "column- and row-parallel linear layers",
        ("CopyToTP", "ReduceFromTP", "ColumnParallelLinear", "RowParallelLinear")),
    "debug_sp": Exercise(
        "04", "debugging lab: sequence parallelism with partial gradients",
        ("finish_gradients",)),
    "pipeline_1f1b": Exercise(
        "05", "the 1F1B schedule as data", ("one_f_one_b_compute", "peak_in_flight")),
    "debug_pipeline": Exercise(
        "05", "debugging lab: a pipeline step that does not train like one process",
        ("pipeline_step", "grad_norm")),
    "mesh_coords": Exercise("06", "rank <-> (dp, pp, tp), both orders", ("coords", "group")),
    "memory_formula": Exercise(
        "07", "memory per device with the pipeline term", ("in_flight", "device_memory")),
    "recompute_cheap": Exercise(
        "07", "keep a recipe, not a tensor (cheap recomputation)", ("recipe_hooks",)),
    "attention_merge": Exercise(
        "08", "merge partial attention by log-sum-exp (ring attention)",
        ("merge_attention",)),
    "moe_dispatch": Exercise(
        "09", "dispatch and combine by all-to-all (expert parallelism)",
        ("dispatch", "combine"), timeout=60.0),
}


# Seconds a check's rank may go without progress (a counted collective or message that
# finished) once every rank has started: the cases make one every few milliseconds.
HANG_SECONDS = 10.0


def warm_up_optimizers() -> None:
    """Step an optimizer once: the first step in a process imports torch's compiler
    machinery (1-2 s, longer on a busy machine). Forked ranks inherit it from a parent
    that ran this; a spawned rank runs it while it still counts as starting."""
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    torch.optim.AdamW([p]).step()


def _started(fn, *args):
    warm_up_optimizers()
    heartbeat()  # this rank is up: from here on a hang counts HANG_SECONDS, not start-up's
    return fn(*args)


def launch_case(fn, world: int, args: tuple, timeout: float) -> list:
    """``launch(fn, world, args=args)`` for a check's cases: ``timeout`` seconds for the
    ranks to start, then a rank that makes no progress for ``HANG_SECONDS`` (or the
    timeout, if shorter) is reported as hung."""
    warm_up_optimizers()
    return launch(_started, world, args=(fn, *args), timeout=min(timeout, HANG_SECONDS),
                  startup=timeout)


class CheckFailure(AssertionError):
    """A case disagreed with the reference; ``hint`` says where to look."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


def expect(condition: bool, message: str, hint: str = "") -> None:
    """Raise ``CheckFailure(message, hint)`` unless ``condition`` holds."""
    if not condition:
        raise CheckFailure(message, hint)


@dataclass
class CheckResult:
    name: str
    status: str  # "pass", "todo" or "fail"
    message: str
    hint: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def __str__(self) -> str:
        label = {"pass": "PASS", "todo": "TODO", "fail": "FAIL"}[self.status]
        text = f"{label}  {self.name}: {self.message}"
        if self.hint:
            text += f"\n      hint: {self.hint}"
        return text


@dataclass
class Report:
    """The results of one ``check`` call, in order; ``passed`` when all passed."""

    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    def __getitem__(self, name: str) -> CheckResult:
        return next(r for r in self.results if r.name == name)

    def __repr__(self) -> str:
        counts = ", ".join(f"{r.name}: {r.status}" for r in self.results)
        return f"Report({counts})"


def default_impl() -> str:
    """The package this module belongs to: ``exercises`` or ``solutions``."""
    return __name__.rpartition(".")[0] or "exercises"


def load(name: str, impl: str | None = None):
    """Import ``<impl>.<name>`` afresh (so saved edits count) and return the module."""
    module = f"{impl or default_impl()}.{name}"
    importlib.invalidate_caches()
    if module in sys.modules:
        return importlib.reload(sys.modules[module])
    return importlib.import_module(module)


_RANK_ERROR = re.compile(r"rank (\d+) raised (\w+): (.*)")


def _where_in_learner_code(tb: str, impl: str) -> str:
    """The last line of a traceback that points into the learner's package."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', tb)
    for path, line, func in reversed(frames):
        if f"/{impl}/" in path.replace("\\", "/"):
            return f" (at {impl}/{path.replace(chr(92), '/').split(f'/{impl}/')[-1]}" \
                   f":{line}, in {func})"
    return ""


def _todo(name: str, message: str) -> CheckResult:
    """A blank's NotImplementedError ("<where> is not implemented yet. Hint: ...")."""
    where, _, hint = message.partition(" is not implemented yet.")
    if not hint and not message.endswith(" is not implemented yet."):
        return CheckResult(name, "todo", f"not implemented yet ({message})")
    return CheckResult(name, "todo", f"not implemented yet ({where})",
                       hint.strip().removeprefix("Hint:").strip())


def _classify(name: str, impl: str, exc: BaseException) -> CheckResult:
    """Turn whatever a check raised into a result a learner can act on."""
    if isinstance(exc, CheckFailure):
        return CheckResult(name, "fail", str(exc), exc.hint)
    if isinstance(exc, NotImplementedError):
        return _todo(name, str(exc))
    if isinstance(exc, RankTimeout):
        where = "; ".join(line.strip() for line in str(exc).splitlines()[1:-1])
        return CheckResult(
            name, "fail", f"the ranks hung ({where})",
            "some rank waits for a message or collective that its partner never posts: "
            "note the call each rank is inside and with whom, then find where your code "
            "makes those calls, in the order every rank makes them")
    if isinstance(exc, RankFailed):
        m = _RANK_ERROR.match(str(exc).splitlines()[0])
        if m and m.group(2) == "NotImplementedError":
            return _todo(name, m.group(3))
        where = _where_in_learner_code(str(exc), impl)
        first = str(exc).splitlines()[0]
        source = ("the error came from the line named above" if where else
                  "the error was raised outside your file, by the code (torch's or the "
                  "check's) that your functions or what they returned were handed to")
        return CheckResult(name, "fail", f"{first}{where}",
                           f"{source}; check({name!r}, raise_errors=True) shows the full "
                           "traceback")
    if isinstance(exc, LaunchError) and "data size doesn't match" in str(exc):
        sizes = re.search(r"(\d+) vs (\d+)", str(exc))
        got = f" ({sizes.group(1)} bytes arrived for a {sizes.group(2)}-byte buffer)" \
            if sizes else ""
        return CheckResult(
            name, "fail", f"{str(exc).splitlines()[0]}: a message did not fit its "
            f"receive buffer{got}",
            "gloo aborts when a message and the buffer that receives it differ in size: "
            "what a rank sends must have the size its partner receives into (a ring's "
            "chunk at each step; an all-to-all's split sizes, as each side gives them)")
    if isinstance(exc, LaunchError):
        return CheckResult(name, "fail", str(exc).splitlines()[0],
                           "a rank died without reporting: look for os._exit, sys.exit "
                           "or running out of memory")
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    where = _where_in_learner_code(tb, impl)
    return CheckResult(name, "fail", f"{type(exc).__name__}: {exc}{where}",
                       "the exception came from the line named above" if where else
                       "the exception was raised outside your file, by the code (torch's "
                       "or the check's) that your functions or what they returned were "
                       f"handed to; check({name!r}, raise_errors=True) shows the full "
                       "traceback")


def run_one(name: str, impl: str | None = None, timeout: float | None = None,
            raise_errors: bool = False) -> CheckResult:
    """Check one exercise without printing; returns its ``CheckResult``."""
    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}; choose one of {sorted(EXERCISES)}")
    impl = impl or default_impl()
    ex = EXERCISES[name]
    checker = importlib.import_module(f".checks.{name}", __package__ or None)
    try:
        load(name, impl)
        summary = checker.run(impl, ex.timeout if timeout is None else timeout)
    except Exception as exc:  # every failure becomes a result, never a crash
        result = _classify(name, impl, exc)
        if raise_errors and result.status == "fail":
            raise
        return result
    return CheckResult(name, "pass", summary)


def check(name: str | None = None, impl: str | None = None, timeout: float | None = None,
          raise_errors: bool = False) -> Report:
    """Check one exercise (or every one, in lesson order), print PASS/TODO/FAIL lines.

    ``impl`` is the package to check (default: the one this module lives in);
    ``timeout`` overrides the per-run limit in seconds; ``raise_errors=True`` re-raises
    an unexpected exception with its full traceback instead of summarising it.
    """
    names = [name] if name else list(EXERCISES)
    report = Report()
    for n in names:
        result = run_one(n, impl, timeout, raise_errors)
        print(result, flush=True)
        report.results.append(result)
    return report


def overview(impl: str | None = None) -> list[dict]:
    """One row per exercise (lesson, name, title, file, blanks left), printed as a table.

    "Blanks left" counts the functions whose body still raises the generated
    ``NotImplementedError``; it reads the files, runs nothing, and takes no time.
    """
    impl = impl or default_impl()
    rows = []
    for name, ex in EXERCISES.items():
        spec = importlib.util.find_spec(f"{impl}.{name}")
        text = open(spec.origin).read() if spec and spec.origin else ""
        lab = name.startswith("debug_")  # a lab has a bug to find, not blanks to fill
        rows.append({"lesson": ex.lesson, "exercise": name, "title": ex.title,
                     "file": f"{impl}/{name}.py",
                     "blanks": None if lab else text.count("# YOUR CODE HERE")})
    print(f"{'lesson':<7}{'exercise':<18}{'blanks left':<13}what you build")
    for r in rows:
        left = "(a lab)" if r["blanks"] is None else r["blanks"]
        print(f"{r['lesson']:<7}{r['exercise']:<18}{left!s:<13}{r['title']}")
    return rows
