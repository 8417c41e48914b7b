# Your copy of this exercise, generated from solutions/zero1.py by tools/make_exercises.py.
# Fill in the blanks (each raises NotImplementedError), then check your work with
#     from exercises.check import check; check("zero1")
"""Lesson 02 exercise: a ZeRO-1 optimizer step.

Plain data parallelism keeps N identical copies of everything: weights, gradients and
the optimizer's states. With Adam the states are the big part (two fp32 values per
parameter, more under mixed precision), and every rank computes the same update for
every parameter. ZeRO stage 1 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC 2020, arXiv 1910.02054, section 5.1) splits the
optimizer's work: rank r owns 1/N of the parameters, keeps optimizer state for those
only, and updates only those; yet after every step every rank must hold the same whole
model as data parallelism would, at the same communication volume, 2 (N-1)/N of the
parameter bytes per rank. What the two collectives the check expects carry, and where
they go around the shard's update, is the exercise (lesson 02 § 2, ``hint("zero1", 1)``).

Parameters are handled as one flat vector, padded with zeros to a multiple of N, so
every rank's shard has the same length (collectives want equal pieces).

You write ``shard_range`` and ``Zero1.step``. Communicate only through ``self.comm``.
What the check tests: ``shard_range`` against the rule above; then 2 and 3 ranks (3
does not divide the parameter count, so padding matters) train a small MLP for three
steps, each rank on its own batch, and every rank's weights must equal a single-process
AdamW stepping on the mean of all ranks' gradients; the log must hold one reduce-scatter
and one all-gather per step and nothing else, and the optimizer's states must be 1/N of
the model's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from minipar.comm import Comm


def shard_range(numel: int, world: int, rank: int) -> tuple[int, int]:
    """The slice [lo, hi) of a flat vector of ``numel`` elements, padded to a multiple of
    ``world``, that ``rank`` owns. Every shard has ceil(numel / world) elements; ``hi``
    may pass ``numel`` (the tail is padding)."""
    # YOUR CODE HERE
    raise NotImplementedError(
        'shard_range in exercises/zero1.py is not implemented yet. Hint: ask for '
        "one with hint('zero1', 1) (a nudge), 2 (the method) or 3 (the answer), "
        'from exercises.course')


class Zero1:
    """AdamW (or ``optimizer_cls``) with its states sharded over the ranks of ``comm``.

    Use it like a torch optimizer after a plain backward (no gradient all-reduce):
    ``loss.backward(); zero.step(); zero.zero_grad()``. Afterwards every rank holds the
    same updated parameters, exactly as a single process stepping on the mean gradient.
    """

    def __init__(self, params, comm: Comm | None = None,
                 optimizer_cls: type = torch.optim.AdamW, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.comm = comm or Comm()
        self.numel = sum(p.numel() for p in self.params)
        self.lo, self.hi = shard_range(self.numel, self.comm.size, self.comm.rank)
        self.padded = (self.hi - self.lo) * self.comm.size
        # This rank's slice of the weights: the only parameter the inner optimizer sees,
        # so Adam's states are 1/N of the model.
        self.shard = nn.Parameter(self.flatten([p.detach() for p in self.params])
                                  [self.lo:self.hi].clone())
        self.optimizer = optimizer_cls([self.shard], **kwargs)

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One flat fp32 vector of ``tensors`` end to end, zero-padded to ``self.padded``."""
        flat = torch.zeros(self.padded, dtype=torch.float32)
        flat[:self.numel] = torch.cat([t.reshape(-1).float() for t in tensors])
        return flat

    def unflatten_into_params(self, flat: torch.Tensor) -> None:
        """Copy consecutive slices of ``flat`` into the parameters (padding ignored)."""
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def step(self) -> None:
        """One optimizer step: afterwards every rank holds the same updated parameters, those
        of one process stepping on the mean of the ranks' gradients."""
        # YOUR CODE HERE
        raise NotImplementedError(
            'Zero1.step in exercises/zero1.py is not implemented yet. Hint: ask for '
            "one with hint('zero1', 1) (a nudge), 2 (the method) or 3 (the answer), "
            'from exercises.course')

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.shard.grad = None

    def state_bytes(self) -> int:
        """Bytes of the inner optimizer's state tensors on this rank."""
        return sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                   for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
