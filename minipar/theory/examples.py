"""Worked examples: the syllabus's layouts, two current open models, and where the
published per-GPU memory figures for GPT-3 175B come from.

The syllabus texts plan four models (1.3B on 8 GPUs, 13B on 64, GPT-3 175B on 1024,
1T on 4096). ``EXAMPLES`` keeps each with the layout a text proposes, so a lesson can
put that layout beside the planner's choice. Two of the texts then estimate GPT-3 175B's
memory per GPU on the 1024-GPU layout (tp = 8, pp = 16, dp = 8) and reach about 40 GB
and about 28 GB. ``gpt3_memory_claims`` redoes both with the assumptions written out,
and adds what the formulas of this package say for the same layout.

The model configs, ``llama3-8b-like`` and ``llama3-70b-like`` included, live in
``minipar.theory.models``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minipar.theory.clusters import Cluster, cluster
from minipar.theory.memory import memory_breakdown
from minipar.theory.models import MODELS, get_model

__all__ = ["EXAMPLES", "Example", "MODELS", "get_model", "gpt3_memory_claims"]


@dataclass(frozen=True)
class Example:
    """A model on a cluster, a global batch (sequences), and a proposed layout."""

    model: str
    cluster: Cluster
    global_batch: int
    layout: dict = field(default_factory=dict)  # dp, pp, tp as a text proposes
    source: str = ""
    settings: dict = field(default_factory=dict)  # extra keywords for plan / evaluate


EXAMPLES: dict[str, Example] = {
    # Batches: GPT-3's (Brown et al. 2020, Table 2.1: 0.5M, 2M and 3.2M tokens of 2048)
    # and Narayanan et al. 2021's 3072 sequences for the 1T model.
    "1.3b-on-8": Example("gpt-1.3b", cluster(8, "A100-80GB"), 512,
                         {"dp": 8, "pp": 1, "tp": 1}, "syllabus: data parallel only"),
    "13b-on-64": Example("gpt-13b", cluster(64, "A100-80GB"), 1024,
                         {"dp": 4, "pp": 4, "tp": 4}, "syllabus: balanced 3D"),
    "175b-on-1024": Example("gpt3-175b", cluster(1024, "A100-80GB"), 1536,
                            {"dp": 8, "pp": 16, "tp": 8}, "syllabus; Narayanan et al. "
                            "Table 1 uses tp=8, pp=16 too, on 1536 GPUs"),
    "1t-on-4096": Example("gpt-1t", cluster(4096, "A100-80GB"), 3072,
                          {"dp": 8, "pp": 32, "tp": 16}, "syllabus: tp=16 crosses the "
                          "8-GPU node; Narayanan et al. use tp=8, pp=64 on 3072 GPUs"),
    # Current models train with fused (flash) attention: no s x s score matrices stored.
    "llama3-8b-on-8": Example("llama3-8b-like", cluster(8, "H100-80GB"), 512,
                              settings={"accounting": "fused"}),
    "llama3-70b-on-64": Example("llama3-70b-like", cluster(64, "H100-80GB"), 512,
                                settings={"accounting": "fused"}),
}

GPT3_PARAMS = 175e9


def gpt3_memory_claims() -> list[dict]:
    """Per-GPU memory of GPT-3 175B on tp = 8, pp = 16 (dp = 8), three ways, in bytes.

    1. One text: fp32 weights (4 bytes/param) and fp32 gradients (4) over tp * pp,
       Adam at "3x parameters" (12 bytes/param, which would be fp32 momentum, variance
       *and* a master copy, though fp32 training needs no master copy: Adam's own
       states are 8 bytes), plus 10 GB of activations and 2.5 GB of working memory,
       both asserted, not derived: about 40 GB.
    2. The other: bf16 weights (2) and gradients (2), fp32 Adam states with master
       weights (12): the ZeRO paper's 16 bytes/param, over tp * pp; plus ~4 GB of
       activations and ~2 GB of all-gather buffers, asserted: about 28 GB.
    3. This package: the same 16 bytes/param (no ZeRO), with the activations of the
       first stage computed (Korthikanti et al.: micro-batch 1, sequence 2048, 1F1B
       holding p micro-batches) for sequence parallelism + selective recomputation,
       and for plain tensor parallelism without recomputation; and with ZeRO-1 over
       dp = 8, which shrinks the optimizer share eightfold.

    Neither published total is wrong arithmetic; they differ in bytes per parameter
    (20 vs 16) and in the activation figure they assume (10 GB vs 4 GB).
    """
    per_rank = GPT3_PARAMS / (8 * 16)
    rows = []

    def row(name: str, w: float, g: float, o: float, act: float, extra: float,
            assumptions: str) -> dict:
        r = {"source": name, "params": w * per_rank, "grads": g * per_rank,
             "optimizer": o * per_rank, "activations": act, "other": extra,
             "assumptions": assumptions}
        r["total"] = r["params"] + r["grads"] + r["optimizer"] + act + extra
        return r

    rows.append(row("text A (~40 GB)", 4, 4, 12, 10e9, 2.5e9,
                    "fp32 weights+grads, Adam '3x params' (12 B), 10 GB activations and "
                    "2.5 GB working memory asserted"))
    rows.append(row("text B (~28 GB)", 2, 2, 12, 4e9, 2e9,
                    "bf16 weights+grads, fp32 Adam+master (12 B), ~4 GB activations and "
                    "~2 GB all-gather buffers asserted"))
    cfg = get_model("gpt3-175b")
    for label, zero, sp, rc in (("sp + selective", 0, True, "selective"),
                                ("tp only, no recompute", 0, False, "none"),
                                ("sp + selective, ZeRO-1", 1, True, "selective")):
        mem = memory_breakdown(cfg, dp=8, pp=16, tp=8, zero=zero, dtype="bf16",
                               microbatch_size=1, microbatches=1536 // 8, schedule="1f1b",
                               sp=sp, recompute=rc)
        r = {"source": f"minipar ({label})", **{k: mem[k] for k in
             ("params", "grads", "optimizer", "activations", "total")}, "other": 0.0,
             "assumptions": f"bf16 Adam (2+2+12 B), ZeRO-{zero}, first stage, micro-batch 1, "
                            f"192 micro-batches, 1F1B, {label}"}
        rows.append(r)
    return rows
