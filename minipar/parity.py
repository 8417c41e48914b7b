"""Parity with the single-device reference: losses, gradient norms, final parameters.

A parallel layout is correct when it trains the *same* model as one process would:
the same loss at every step, the same global gradient norm before clipping at every
step, and the same parameters at the end. Losses alone are not enough: AdamW divides
each gradient by its own running magnitude and clipping rescales it to a fixed norm, so
a gradient 10x too large (a forgotten 1/dp, a micro-batch loss not divided by m) leaves
the losses almost unchanged. The gradient norm is compared *before* clipping, where
such a factor shows in full; plain SGD without clipping shows it in the weights too.

``compare`` measures the three differences; ``audit`` turns a constant gradient ratio
into one line a user can act on ("gradients are 4.0x the reference: 4 = microbatches").
``reference_record`` and ``parity_row`` are one row of a parity matrix, as the GPU
benchmarks run it (``benchmarks/multigpu.py``, ``benchmarks/moe_parity_gpu.py``).
"""

from __future__ import annotations

import itertools
import math
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from minipar import checkpoint
from minipar.config import TrainConfig, validate
from minipar.engine import train, train_reference


@dataclass
class Parity:
    """Worst differences of a run against the reference (``inf`` where lengths differ)."""

    loss_diff: float  # max |loss - reference loss| over steps
    grad_norm_rel: float  # max |norm / reference norm - 1| over steps
    param_diff: float | None = None  # max |parameter - reference| at the end, if compared
    grad_ratios: list[float] = field(default_factory=list)  # per step: norm / reference

    def ok(self, loss_tol: float | Tolerance, grad_rtol: float | None = None,
           param_tol: float | None = None) -> bool:
        """Within tolerances: a ``Tolerance``, or the three bounds one by one."""
        if isinstance(loss_tol, Tolerance):
            loss_tol, grad_rtol, param_tol = loss_tol.loss, loss_tol.grad_rel, loss_tol.param
        return (self.loss_diff <= loss_tol and self.grad_norm_rel <= grad_rtol
                and (param_tol is None or self.param_diff is None
                     or self.param_diff <= param_tol))

    def describe(self) -> str:
        text = f"loss diff {self.loss_diff:.2e}, grad-norm rel diff {self.grad_norm_rel:.2e}"
        if self.param_diff is not None:
            text += f", parameter diff {self.param_diff:.2e}"
        return text


def _max_diff(a: list[float], b: list[float], rel: bool = False) -> float:
    if len(a) != len(b) or not a:
        return math.inf
    if rel:
        return max(abs(x / y - 1.0) if y else abs(x) for x, y in zip(a, b))
    return max(abs(x - y) for x, y in zip(a, b))


def run_grad_norms(run: dict) -> list[float]:
    """The per-step global gradient norm of a run: every rank computes the same one."""
    return list(run["ranks"][0]["grad_norms"])


def compare(run: dict, reference: dict, params: dict | None = None,
            reference_params: dict | None = None) -> Parity:
    """Differences between a run's record and ``train_reference``'s (see ``Parity``).

    ``params``/``reference_params``: name -> tensor, both full (gathered) models.
    """
    norms, ref_norms = run_grad_norms(run), list(reference["grad_norms"])
    param_diff = None
    if params is not None and reference_params is not None:
        if set(params) != set(reference_params):
            param_diff = math.inf
        else:
            param_diff = max((float((params[k].float() - reference_params[k].float())
                                    .abs().max()) for k in params), default=0.0)
    return Parity(
        loss_diff=_max_diff(list(run["losses"]), list(reference["losses"])),
        grad_norm_rel=_max_diff(norms, ref_norms, rel=True),
        param_diff=param_diff,
        grad_ratios=[x / y if y else math.inf for x, y in zip(norms, ref_norms)],
    )


@dataclass(frozen=True)
class Tolerance:
    loss: float  # absolute, on the mean loss
    grad_rel: float  # relative, on the global gradient norm before clipping
    param: float  # absolute, on every final parameter


# About 3x the worst drift measured over the covering layouts (benchmarks/parity_drift.py:
# the engine tests' covering set, its plain-SGD set, dropout 0.1 and tied embeddings;
# 5 steps of `tiny` on the Markov data, CPU/gloo; table in docs/benchmarks.md):
#   fp32 worst: loss 7.2e-7, grad 8.5e-6, param 2.7e-5 (all three: tp 2 with dropout);
#            without dropout: loss 4.8e-7, grad 7.2e-6 (tied pp2 tp2), param 1.2e-5;
#            plain SGD: loss 4.8e-7, grad 2.1e-7, param 1.2e-7.
#   bf16 worst: loss 2.0e-3 (pp x tp), grad 2.0e-2 (tp), param 5.4e-3 (tp).
# Summation order is the only fp32 difference; AdamW divides each gradient by its own
# running size, so a 1e-7 difference on a near-zero gradient becomes a visible weight
# difference and the later steps' gradients follow: the bounds grow with the steps.
# A scaling bug is a factor of 2 at least: the gradient check sees it at any of these.
TOLERANCES = {
    "fp32": Tolerance(loss=2e-6, grad_rel=2.5e-5, param=8e-5),
    "bf16": Tolerance(loss=6e-3, grad_rel=6e-2, param=1.6e-2),
}


# The factors a layout multiplies into, and the question each one raises.
_SUSPECTS = {
    "dp": "is the loss (or the reduced gradient) divided by the data-parallel size?",
    "microbatches": "is each micro-batch loss divided by m?",
    "pp": "is a gradient summed over pipeline stages that should not be?",
    "tp": "is a replicated gradient all-reduced over tp (or counted on every tp rank)?",
}


def audit(ratios: list[float], layout: dict[str, int], tol: float = 0.02) -> str | None:
    """One line when the gradient norm is a simple factor off the reference.

    ``ratios``: per step, the run's gradient norm over the reference's. The first step
    decides: both start from the same weights there, so its ratio is the scale error
    alone (later steps mix in the weights' divergence). ``layout``: the run's sizes, e.g.
    ``{"dp": 2, "microbatches": 4, "pp": 1, "tp": 1}``. The ratio is matched against each
    size, each product of sizes, and their inverses; returns ``None`` when the gradients
    agree or no simple factor explains them.
    """
    if not ratios or not math.isfinite(ratios[0]) or ratios[0] <= 0:
        return None
    ratio = ratios[0]
    if abs(ratio - 1.0) <= tol:
        return None
    sizes = {k: v for k, v in layout.items() if v > 1}
    for n in range(1, len(sizes) + 1):
        for combo in itertools.combinations(sizes, n):
            factor = math.prod(sizes[k] for k in combo)
            named = combo[0] if n == 1 else "(" + " x ".join(combo) + ")"
            for f, word in ((factor, ""), (1.0 / factor, "1/")):
                if abs(ratio / f - 1.0) <= tol:
                    question = " ".join(_SUSPECTS[k] for k in combo)
                    return (f"gradients are {ratio:.3g}x the reference: {ratio:.3g} = "
                            f"{word}{named}; {question}")
    return None


def final_parameters(checkpoint_dir: str) -> dict:
    """The full (gathered) parameters a run saved, by reference name, in fp32."""
    state, _ = checkpoint.load(checkpoint_dir)
    return {k: v.float() for k, v in state["model"].items()}


def audit_sizes(cfg: TrainConfig) -> dict[str, int]:
    """The sizes ``audit`` matches a gradient ratio against, from a run's config."""
    return {"dp": cfg.dp, "microbatches": cfg.microbatches, "pp": cfg.pp, "tp": cfg.tp}


def reference_record(cfg: TrainConfig) -> dict:
    """What a run is held against: ``train_reference(cfg)``'s losses and gradient norms,
    and its final parameters (fp32 copies, by name)."""
    ref = train_reference(cfg)
    return {"losses": ref["losses"], "grad_norms": ref["grad_norms"],
            "params": {k: v.detach().float().clone()
                       for k, v in ref["model"].state_dict().items()}}


def parity_row(cfg: TrainConfig, reference: Callable[[], dict]) -> tuple[dict, dict | None]:
    """One row of a parity matrix: train ``cfg`` (its final parameters saved to a
    temporary directory, removed after) and compare it with ``reference()`` (a
    ``reference_record``, asked for only once ``config.validate`` accepts ``cfg``)
    against ``TOLERANCES[cfg.dtype]``. Returns (the row, the run's record); a layout
    ``validate`` refuses is ``{"status": "refused", "reason": ...}`` and no record."""
    try:
        validate(cfg)
    except ValueError as e:
        return {"status": "refused", "reason": str(e)}, None
    ref = reference()
    save = tempfile.mkdtemp(prefix="minipar-parity-")
    try:
        cfg.save = save
        record = train(cfg)
        params = {k: v.cpu() for k, v in final_parameters(save).items()}
    finally:
        shutil.rmtree(save, ignore_errors=True)
    p = compare(record, ref, params, ref["params"])
    tol = TOLERANCES[cfg.dtype]
    return {"status": "ok" if p.ok(tol) else "drift", "loss_diff": p.loss_diff,
            "grad_norm_rel": p.grad_norm_rel, "param_diff": p.param_diff,
            "grad_ratios": p.grad_ratios, "tolerance": vars(tol),
            "audit": audit(p.grad_ratios, audit_sizes(cfg)), "losses": record["losses"],
            "reference_losses": ref["losses"], "brief": p.describe()}, record


def check_run(cfg, record: dict) -> dict:
    """Train the single-device reference for ``cfg`` and compare ``record`` with it.

    Returns what ``--compare`` adds to a run's JSON: ``reference_losses``,
    ``reference_grad_norms``, ``parity`` (the worst differences) and ``audit`` (one line
    when the gradients are a simple factor off, else ``None``). Final parameters are
    compared when the run saved a checkpoint (``cfg.save``) at its last step.
    """
    ref = train_reference(cfg)
    first = record.get("first_step", 0)  # a resumed run: the reference's same steps
    for key in ("losses", "grad_norms"):
        ref[key] = ref[key][first:first + len(record["losses"])]
    params = ref_params = None
    if cfg.save and cfg.stop_at in (None, cfg.steps):
        params = final_parameters(cfg.save)
        ref_params = {k: v.detach().float() for k, v in ref["model"].state_dict().items()}
    parity = compare(record, ref, params, ref_params)
    tol = TOLERANCES[cfg.dtype]
    return {"reference_losses": ref["losses"], "reference_grad_norms": ref["grad_norms"],
            "parity": {"loss_diff": parity.loss_diff, "grad_norm_rel": parity.grad_norm_rel,
                       "param_diff": parity.param_diff, "ok": parity.ok(tol),
                       "tolerance": {"loss": tol.loss, "grad_rel": tol.grad_rel,
                                     "param": tol.param}},
            "audit": audit(parity.grad_ratios, audit_sizes(cfg))}
