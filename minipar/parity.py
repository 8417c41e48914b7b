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
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field


@dataclass
class Parity:
    """Worst differences of a run against the reference (``inf`` where lengths differ)."""

    loss_diff: float  # max |loss - reference loss| over steps
    grad_norm_rel: float  # max |norm / reference norm - 1| over steps
    param_diff: float | None = None  # max |parameter - reference| at the end, if compared
    grad_ratios: list[float] = field(default_factory=list)  # per step: norm / reference

    def ok(self, loss_tol: float, grad_rtol: float, param_tol: float | None = None) -> bool:
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


# The factors a layout multiplies into, and the question each one raises.
_SUSPECTS = {
    "dp": "is the loss (or the reduced gradient) divided by the data-parallel size?",
    "microbatches": "is each micro-batch loss divided by m?",
    "pp": "is a gradient summed over pipeline stages that should not be?",
    "tp": "is a replicated gradient all-reduced over tp (or counted on every tp rank)?",
}


def audit(ratios: list[float], layout: dict[str, int], tol: float = 0.02) -> str | None:
    """One line when the gradient norm is a constant simple factor off the reference.

    ``layout``: the run's sizes, e.g. ``{"dp": 2, "microbatches": 4, "pp": 1, "tp": 1}``.
    The ratio is matched against each size, each product of sizes, and their inverses;
    returns ``None`` when the gradients agree or no simple factor explains them.
    """
    finite = [r for r in ratios if math.isfinite(r) and r > 0]
    if not finite:
        return None
    mean = sum(finite) / len(finite)
    if abs(mean - 1.0) <= tol or max(abs(r / mean - 1.0) for r in finite) > tol:
        return None  # agrees, or not a constant factor
    sizes = {k: v for k, v in layout.items() if v > 1}
    for n in range(1, len(sizes) + 1):
        for combo in itertools.combinations(sizes, n):
            factor = math.prod(sizes[k] for k in combo)
            named = " x ".join(combo)
            for f, word in ((factor, ""), (1.0 / factor, "1/")):
                if abs(mean / f - 1.0) <= tol:
                    question = " ".join(_SUSPECTS[k] for k in combo)
                    return (f"gradients are {mean:.3g}x the reference: {mean:.3g} = "
                            f"{word}{named if n == 1 else '(' + named + ')'}; {question}")
    return None
