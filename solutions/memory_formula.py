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
    ### BEGIN SOLUTION
    # HINT: shard = math.ceil(n_params / dp). The optimizer state is sharded from stage 1
    # on, the gradients from stage 2, the weights from stage 3; unsharded states count
    # n_params. Multiply by the bytes per parameter w, g, o.
    shard = math.ceil(n_params / dp)
    return {"params": (shard if zero >= 3 else n_params) * w,
            "grads": (shard if zero >= 2 else n_params) * g,
            "optimizer": (shard if zero >= 1 else n_params) * o}
    ### END SOLUTION


def in_flight(schedule: str, pp: int, microbatches: int, stage: int) -> int:
    """Micro-batches whose activations ``stage`` holds at its peak: "gpipe", "1f1b" or
    "zb" (one chunk per stage)."""
    ### BEGIN SOLUTION
    # HINT: gpipe: every forward before any backward, so m. 1f1b: stage s runs p - s - 1
    # warm-up forwards plus one, so min(m, p - s). zb (ZB-H1) holds each activation until
    # its late weight pass: min(m, p) on every stage.
    if schedule == "gpipe":
        return microbatches
    if schedule == "zb":
        return min(microbatches, pp)
    return min(microbatches, pp - stage)
    ### END SOLUTION


def stage_memory(cfg: GPTConfig | str, stage: int, dp: int = 1, pp: int = 1, tp: int = 1,
                 zero: int = 0, dtype: str = "bf16", microbatches: int = 1,
                 schedule: str = "1f1b", sp: bool = False,
                 recompute: str = "none") -> dict:
    """{"params", "grads", "optimizer", "activations", "total"} in bytes on one rank of
    pipeline ``stage`` (micro-batch size 1; activations rounded to an int)."""
    cfg = get_config(cfg)
    n_params = stage_params(cfg, pp, tp, stage)  # this rank's parameters after tp and pp
    per_layer = sum(layer_activations(cfg, 1, tp, sp, recompute, dtype).values())
    ### BEGIN SOLUTION
    # HINT: k = in_flight(...) for this stage; activations = (per_layer * layers on this
    # stage (stage_layers(cfg.n_layer, pp, stage)) + edge_bytes(...)) * k, rounded with
    # int(round(...)); add model_state_bytes(n_params, dp, zero, dtype) and a "total".
    # zb also keeps, for each deferred weight pass, the gradients of the outputs of the
    # modules with weights (linears, layer norms): add deferred_weight_grad_bytes(cfg, 1,
    # tp, sp, dtype) to per_layer.
    if schedule == "zb":
        per_layer += deferred_weight_grad_bytes(cfg, 1, tp, sp, dtype)
    k = in_flight(schedule, pp, microbatches, stage)
    layers = stage_layers(cfg.n_layer, pp, stage)
    act = (per_layer * layers + edge_bytes(cfg, pp, stage, tp, sp, dtype)) * k
    out = {**model_state_bytes(n_params, dp, zero, dtype), "activations": int(round(act))}
    out["total"] = sum(out.values())
    return out
    ### END SOLUTION


def device_memory(cfg: GPTConfig | str, **layout) -> dict:
    """``stage_memory`` of the most loaded stage (the first or the last), plus "stage"."""
    pp = layout.get("pp", 1)
    ### BEGIN SOLUTION
    # HINT: compute stage_memory for stage 0 and stage pp - 1 and return the one with the
    # larger "total", with its stage number added as "stage".
    rows = [{"stage": s, **stage_memory(cfg, s, **layout)} for s in sorted({0, pp - 1})]
    return max(rows, key=lambda r: r["total"])
    ### END SOLUTION
