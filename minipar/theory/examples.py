"""Worked examples: four layouts often proposed, two current open models, and where the
published per-GPU memory figures for GPT-3 175B come from.

Four models are often used to teach layouts (1.3B on 8 GPUs, 13B on 64, GPT-3 175B on
1024, 1T on 4096). ``EXAMPLES`` keeps each with the layout usually proposed for it and
the public source that settles whether it is a good one, so a lesson can put that layout
beside the planner's choice. Two per-GPU memory figures circulate for GPT-3 175B on the
1024-GPU layout (tp = 8, pp = 16, dp = 8): about 40 GB and about 28 GB.
``gpt3_memory_claims`` redoes both with the assumptions written out, labels each by the
bytes per parameter it assumes against the ZeRO paper's count (arXiv 1910.02054, §3.1),
and adds what the formulas of this package say for the same layout.

The model configs, ``llama3-8b-like`` and ``llama3-70b-like`` included, live in
``minipar.theory.models``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minipar.theory.clusters import Cluster, cluster
from minipar.theory.layout import Layout
from minipar.theory.memory import memory_breakdown
from minipar.theory.models import MODELS, get_model

__all__ = ["EXAMPLES", "Example", "MODELS", "get_model", "gpt3_memory_claims"]


@dataclass(frozen=True)
class Example:
    """A model on a cluster, a global batch (sequences), and a proposed layout."""

    model: str
    cluster: Cluster
    global_batch: int
    layout: Layout | None = None  # dp, pp, tp: the layout often proposed
    source: str = ""  # the public source that settles whether that layout is a good one
    settings: dict = field(default_factory=dict)  # extra keywords for plan / evaluate


EXAMPLES: dict[str, Example] = {
    # Batches: GPT-3's (Brown et al. 2020, Table 2.1: 0.5M, 2M and 3.2M tokens of 2048)
    # and Narayanan et al. 2021's 3072 sequences for the 1T model.
    "1.3b-on-8": Example("gpt-1.3b", cluster(8, "A100-80GB"), 512,
                         Layout(dp=8, pp=1, tp=1),
                         "data parallel only: 16 B/param x 1.3B = 21 GB of model states "
                         "(ZeRO, arXiv 1910.02054 §3.1) fits an 80 GB A100 (NVIDIA data "
                         "sheet)"),
    "13b-on-64": Example("gpt-13b", cluster(64, "A100-80GB"), 1024,
                         Layout(dp=4, pp=4, tp=4),
                         "balanced 3D; Narayanan et al. 2021 (arXiv 2104.04473) §3, "
                         "takeaway 2: the smallest tp x pp that fits, dp for the rest"),
    "175b-on-1024": Example("gpt3-175b", cluster(1024, "A100-80GB"), 1536,
                            Layout(dp=8, pp=16, tp=8),
                            "Narayanan et al. 2021 §3, takeaway 1: tp up to the 8 GPUs "
                            "of a server, pp across servers"),
    "1t-on-4096": Example("gpt-1t", cluster(4096, "A100-80GB"), 3072,
                          Layout(dp=8, pp=32, tp=16),
                          "tp=16 crosses the 8-GPU server; Narayanan et al. 2021, Table 1: "
                          "1T trained with tp=8, pp=64 on 3072 GPUs"),
    # Current models train with fused (flash) attention: no s x s score matrices stored.
    "llama3-8b-on-8": Example("llama3-8b-like", cluster(8, "H100-80GB"), 512,
                              settings={"accounting": "fused"}),
    "llama3-70b-on-64": Example("llama3-70b-like", cluster(64, "H100-80GB"), 512,
                                settings={"accounting": "fused"}),
}

GPT3_PARAMS = 175e9
ZERO_COUNT = ("Rajbhandari et al., ZeRO (arXiv 1910.02054) §3.1: mixed-precision Adam keeps "
              "2 + 2 + 12 = 16 bytes per parameter")


def gpt3_memory_claims() -> list[dict]:
    """Per-GPU memory of GPT-3 175B on tp = 8, pp = 16 (dp = 8), three ways, in bytes.

    1. The ~40 GB claim: fp32 weights (4 bytes/param) and fp32 gradients (4) over tp * pp,
       Adam at "3x parameters" (12 bytes/param, which would be fp32 momentum, variance
       *and* a master copy, though fp32 training needs no master copy: Adam's own
       states are 8 bytes), plus 10 GB of activations and 2.5 GB of working memory,
       both asserted, not derived: about 40 GB.
    2. The ~28 GB claim: bf16 weights (2) and gradients (2), fp32 Adam states with master
       weights (12): the ZeRO paper's 16 bytes/param, over tp * pp; plus ~4 GB of
       activations and ~2 GB of all-gather buffers, asserted: about 28 GB.
    3. This package: the same 16 bytes/param (no ZeRO), with the activations of the
       first stage computed (Korthikanti et al.: micro-batch 1, sequence 2048, 1F1B
       holding p micro-batches) for sequence parallelism + selective recomputation,
       and for plain tensor parallelism without recomputation; and with ZeRO-1 over
       dp = 8, which shrinks the optimizer share eightfold.

    Neither published total is wrong arithmetic; they differ in bytes per parameter
    (20 vs 16) and in the activation figure they assume (10 GB vs 4 GB). Each row's
    ``source`` names the claim by its total and bytes per parameter beside the count of
    the source that settles it (the ZeRO paper, arXiv 1910.02054, §3.1: 2 + 2 + 12 = 16
    bytes for mixed-precision Adam); ``settled_by`` cites it in full.
    """
    per_rank = GPT3_PARAMS / (8 * 16)
    rows = []

    def row(name: str, w: float, g: float, o: float, act: float, extra: float,
            assumptions: str) -> dict:
        r = {"source": name, "params": w * per_rank, "grads": g * per_rank,
             "optimizer": o * per_rank, "activations": act, "other": extra,
             "assumptions": assumptions, "settled_by": ZERO_COUNT}
        r["total"] = r["params"] + r["grads"] + r["optimizer"] + act + extra
        return r

    rows.append(row("~40 GB: 20 B/param (ZeRO §3.1: 16)", 4, 4, 12, 10e9, 2.5e9,
                    "fp32 weights+grads, Adam '3x params' (12 B), 10 GB activations and "
                    "2.5 GB working memory asserted"))
    rows.append(row("~28 GB: 16 B/param (ZeRO §3.1: 16)", 2, 2, 12, 4e9, 2e9,
                    "bf16 weights+grads, fp32 Adam+master (12 B), ~4 GB activations and "
                    "~2 GB all-gather buffers asserted"))
    cfg = get_model("gpt3-175b")
    for label, zero, sp, rc in (("sp + selective", 0, True, "selective"),
                                ("tp only, no recompute", 0, False, "none"),
                                ("sp + selective, ZeRO-1", 1, True, "selective")):
        mem = memory_breakdown(cfg, Layout(dp=8, pp=16, tp=8, zero=zero, dtype="bf16",
                                           microbatch_size=1, microbatches=1536 // 8,
                                           schedule="1f1b", sp=sp, recompute=rc))
        r = {"source": f"minipar ({label})", **{k: mem[k] for k in
             ("params", "grads", "optimizer", "activations", "total")}, "other": 0.0,
             "settled_by": "computed: minipar.theory.memory (Korthikanti et al., "
                           "arXiv 2205.05198, for the activations)",
             "assumptions": f"bf16 Adam (2+2+12 B), ZeRO-{zero}, first stage, micro-batch 1, "
                            f"192 micro-batches, 1F1B, {label}"}
        rows.append(r)
    return rows
