"""Activation recomputation: keep less for backward, compute it again when needed.

A layer's backward needs tensors from its forward. Keeping them all costs
sbh(34 + 5as/h) bytes per layer in fp16 (Korthikanti et al. 2022, arXiv 2205.05198, eq. 1);
recomputing trades that memory for extra forward FLOPs:

* ``full``: keep only each block's input; run the block's forward again during backward
  (Chen et al. 2016, arXiv 1604.06174). About 2sbh bytes per layer remain, for one extra
  forward per block (33% more compute for a forward + backward of 3 units).
* ``selective``: recompute only the attention core (softmax(QK^T/sqrt(d)) V), whose saved
  tensors grow with s^2 but which costs little to recompute (the paper's section 5).
  With a fused attention kernel (SDPA, flash) the s^2 scores are never stored anyway, so
  selective recomputation saves little here: the lessons measure exactly how little.

Applied from outside, like every technique, by replacing submodules: each block by a
``RecomputedBlock`` that adopts the block's children (so every parameter keeps its name,
and with it tensor parallelism and checkpoints), or each attention core (no parameters)
by ``Recompute(core)``. Dropout masks are keyed by position, not drawn from a generator,
so the recomputed forward drops exactly what the first one dropped.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from minipar.model import Block

MODES = ("none", "selective", "full")


class Recompute(nn.Module):
    """Run ``module`` without keeping its activations; run it again in backward."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        # use_reentrant=False: works with inputs that need no grad and with hooks
        return checkpoint(self.module, *args, use_reentrant=False)


class RecomputedBlock(Block):
    """A transformer block that recomputes itself in backward. It takes over the given
    block's submodules (the same objects, under the same names), so it holds no copy."""

    def __init__(self, block: Block) -> None:
        nn.Module.__init__(self)  # not Block.__init__: adopt, do not create, the layers
        for name, child in block.named_children():
            self.add_module(name, child)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(Block.forward, self, x, use_reentrant=False)


def apply_recompute(stages: Iterable[nn.Module], mode: str, layers: int | None = None) -> None:
    """Replace, in every module of ``stages`` with a ``blocks`` container, each block
    (``full``) or each block's attention core (``selective``). ``layers`` N: only the
    first N blocks of each chunk (Megatron's partial recomputation,
    ``--recompute-num-layers``): the rest keep their activations and skip the extra
    forward, for the memory a card has to spare."""
    if mode not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, got {mode!r}")
    for stage in stages:
        for key, block in list(stage.blocks.named_children())[:layers]:
            if mode == "full":
                stage.blocks[key] = RecomputedBlock(block)
            elif mode == "selective":
                block.attn.core = Recompute(block.attn.core)
