# Your copy of this exercise, generated from solutions/memory_formula.py by tools/make_exercises.py.
# Fill in the blanks (each raises NotImplementedError), then check your work with
#     from exercises.check import check; check("memory_formula")
"""Lesson 07 exercise: the memory of one device, with the pipeline term.

Everything a training step keeps on a GPU falls in two families.

**Model states**: weights, gradients and optimizer state, at the bytes per parameter of
``BYTES_PER_PARAM`` (the ZeRO paper's count, Rajbhandari et al., arXiv 1910.02054,
Sec. 3.1), some of them split over the dp data-parallel ranks depending on the ZeRO
stage (lesson 02 says which stage splits what; a split state is ceil(n / dp) elements).

**Activations** (Korthikanti et al., arXiv 2205.05198): one transformer layer keeps a
fixed number of bytes per micro-batch for its backward (``layer_activations``, given),
and the first and last stages keep a little more (``edge_bytes``, given). A pipeline
stage keeps them for every micro-batch it holds at its peak, and how many that is
depends on the schedule and on the stage (lesson 05: what your ``peak_in_flight``
counted).

You write ``model_state_bytes``, ``in_flight``, ``stage_memory`` and
``device_memory``. What the check tests: each function, byte for byte, against
``minipar.theory.memory`` (``model_states``, the in-flight count, ``memory_breakdown``)
on layouts of the four worked-example models (every ZeRO stage, GPipe, 1F1B and ZB-H1,
with and without sp and recomputation, bf16 and fp32) and of the tiny one (its 8
layers on 3 stages too: 3 + 3 + 2); a mismatch names the layout, the term and both
numbers.
"""

from __future__ import annotations

import math

from minipar.model import GPTConfig, get_config
from minipar.theory.memory import (
    deferred_weight_grad_bytes,
    edge_activations,
    layer_activations,
)
from minipar.theory.params import stage_layers, stage_params

BYTES_PER_PARAM = {  # (weights, gradients, optimizer state) with Adam
    "bf16": (2, 2, 12),
    "fp32": (4, 4, 8),
}


def edge_bytes(cfg: GPTConfig, pp: int, stage: int, tp: int = 1, sp: bool = False,
               dtype: str = "bf16") -> float:
    """Bytes per micro-batch kept outside the transformer layers on ``stage`` (given)."""
    total = 0.0
    if stage == 0:
        total += sum(edge_activations(cfg, "first", 1, tp, sp, dtype).values())
    if stage == pp - 1:
        total += sum(edge_activations(cfg, "last", 1, tp, sp, dtype).values())
    return total


def model_state_bytes(n_params: int, dp: int, zero: int, dtype: str = "bf16") -> dict:
    """{"params", "grads", "optimizer"}: bytes on one rank holding ``n_params`` before
    ZeRO, with ZeRO ``zero`` (0-3) over ``dp`` ranks."""
    w, g, o = BYTES_PER_PARAM[dtype]
    # YOUR CODE HERE
    raise NotImplementedError(
        'model_state_bytes in exercises/memory_formula.py is not implemented yet.'
        " Hint: ask for one with hint('memory_formula', 1) (a nudge), 2 (the "
        'method) or 3 (the answer), from exercises.course')


def in_flight(schedule: str, pp: int, microbatches: int, stage: int) -> int:
    """Micro-batches whose activations ``stage`` holds at its peak: "gpipe", "1f1b" or
    "zb" (one chunk per stage)."""
    # YOUR CODE HERE
    raise NotImplementedError(
        'in_flight in exercises/memory_formula.py is not implemented yet. Hint: '
        "ask for one with hint('memory_formula', 1) (a nudge), 2 (the method) or "
        '3 (the answer), from exercises.course')


def stage_memory(cfg: GPTConfig | str, stage: int, dp: int = 1, pp: int = 1, tp: int = 1,
                 zero: int = 0, dtype: str = "bf16", microbatches: int = 1,
                 schedule: str = "1f1b", sp: bool = False,
                 recompute: str = "none") -> dict:
    """{"params", "grads", "optimizer", "activations", "total"} in bytes on one rank of
    pipeline ``stage`` (micro-batch size 1; activations rounded to an int)."""
    cfg = get_config(cfg)
    n_params = stage_params(cfg, pp, tp, stage)  # this rank's parameters after tp and pp
    per_layer = sum(layer_activations(cfg, 1, tp, sp, recompute, dtype).values())
    # YOUR CODE HERE
    raise NotImplementedError(
        'stage_memory in exercises/memory_formula.py is not implemented yet. '
        "Hint: ask for one with hint('memory_formula', 1) (a nudge), 2 (the "
        'method) or 3 (the answer), from exercises.course')


def device_memory(cfg: GPTConfig | str, **layout) -> dict:
    """``stage_memory`` of the most loaded stage (the first or the last), plus "stage"."""
    pp = layout.get("pp", 1)
    # YOUR CODE HERE
    raise NotImplementedError(
        'device_memory in exercises/memory_formula.py is not implemented yet. '
        "Hint: ask for one with hint('memory_formula', 1) (a nudge), 2 (the "
        'method) or 3 (the answer), from exercises.course')
