"""The data-parallel layer as the training step sees it: one interface, three classes.

``step.data_parallel`` builds one of ``ZeroOptimizer`` (stages 0-2, ``optimizer.py``),
``Zero3`` (``stage3.py``) or ``ep.ExpertDataParallel`` (two ZeroOptimizers when experts
are split); ``step.py``, ``engine.py``, ``checkpoint.py`` and ``reshard.py`` call only
what ``GradientSync`` declares, so any of them (or a learner's own) plugs in. The
interface follows ZeRO's data flow (Rajbhandari et al. 2020, arXiv 1910.02054): finish
the reduction, look at the owned gradient shards (norm, clip, a sum over another group),
step, share the weights, and read or write the state by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from minipar.comm import Comm
from minipar.parallel.zero.shards import FlatParams


class GradientSync(Protocol):
    """What a data-parallel wrapper offers the training step."""

    backwards_per_step: int  # backwards whose gradients one step sums (micro-batches)

    @property
    def flats(self) -> list[FlatParams]:
        """The flat buffers (their ``full`` is the weights: not activations)."""
        ...

    def finish_gradient_sync(self) -> None:
        """Finish every reduction still to do or in flight (after the backwards)."""
        ...

    def grad_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(reference name, gradient elements) this rank owns, each element once."""
        ...

    def scale_grads(self, factor: float | torch.Tensor) -> None:
        """Multiply every owned gradient by ``factor`` (clipping)."""
        ...

    def all_reduce_grads(self, params: Iterable, comm: Comm) -> None:
        """Sum the gradients of ``params`` (names) over another group."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None:
        ...

    def memory_bytes(self, optimizer: torch.optim.Optimizer | None = None
                     ) -> dict[str, int]:
        """Bytes held now: ``params``, ``grads``, ``optimizer`` (``host_optimizer``)."""
        ...

    def full_state_by_name(self, optimizer: torch.optim.Optimizer | None = None
                           ) -> tuple[dict, dict]:
        """(fp32 weights, optimizer states) by reference name, whole (collective)."""
        ...

    def load_full_state_by_name(self, states: dict, weights: dict | None = None,
                                optimizer: torch.optim.Optimizer | None = None) -> None:
        """Take this rank's shard of whole states (and weights) by name."""
        ...

    def finish_param_sync(self) -> None:
        """Wait for weights still on the wire after a step."""
        ...

    def observe(self, observer) -> None:
        """Report buffer changes to ``observer`` (``meter.HeldPeaks``): measurement."""
        ...

    def fusable(self, linear: nn.Linear) -> bool:
        """Whether ``linear``'s weight gradient may be added in its GEMM."""
        ...

    def accumulate_product(self, p: nn.Parameter, dy: torch.Tensor, x: torch.Tensor
                           ) -> None:
        """Add p's gradient dy^T x to the sum (``wgrad_fusion.py``)."""
        ...
