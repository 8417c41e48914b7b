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

Applied from outside, like every technique: the blocks' ``forward`` (or the attention's
``core``) is replaced on the instance by a checkpointed call, so parameter names, and
with them tensor parallelism and checkpoints, are untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "selective", "full")


def _checkpointed(fn: Callable) -> Callable:
    def run(*args):
        # use_reentrant=False: works with inputs that need no grad and with hooks
        return checkpoint(fn, *args, use_reentrant=False)
    return run


def apply_recompute(blocks: Iterable[nn.Module], mode: str) -> None:
    """Make each transformer block recompute its activations in backward (in place)."""
    if mode not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, got {mode!r}")
    for block in blocks:
        if mode == "full":
            block.forward = _checkpointed(block.forward)
        elif mode == "selective":
            block.attn.core = _checkpointed(block.attn.core)
