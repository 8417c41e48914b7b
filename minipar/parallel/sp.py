"""Sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198, section 4.2.2).

Outside the tensor-parallel regions (layer norms, dropout, residual adds) every tp rank
would otherwise hold and compute the same full [b, s, h] activations. Instead each rank
keeps a slice of the sequence, positions [r*s/tp, (r+1)*s/tp): Megatron's "g" (the
all-reduce after a row-parallel linear) becomes a reduce-scatter along the sequence, "f"
(before a column-parallel linear) an all-gather, and the backward passes swap them: the
same bytes (an all-reduce *is* a reduce-scatter plus an all-gather), while the replicated
activations shrink by ``tp``. Like the paper we keep each column linear's *sharded* input
and all-gather it again in backward, rather than keep the full one: 5/4 of plain TP's
bytes per layer.

``minipar.parallel.tp`` uses these functions when its layers are built with
``sequence_parallel=True``; the ``SequenceParallel`` style replaces the position
embedding and the dropouts. Parameters that stay replicated then see only part of the
sequence: ``sync_sequence_parallel_grads`` sums their gradients over tp.

Zero bubble (arXiv 2401.10241) splits a backward in two calls, input gradients (B) and
weight gradients (W). Each function below asks which gradients *this* call wants
(``wanted``) and communicates only for those, so B + W move what one backward moves.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minipar.comm import Comm
from minipar.model import KeyedDropout

SEQ = 1  # the sequence dimension of [batch, seq, hidden] activations


def wanted(ctx, i: int) -> bool:
    """Does *this* backward call use the gradient of input ``i``?

    ``ctx.needs_input_grad`` only says whether it could. The zero-bubble schedule splits
    a backward in two calls, one for input gradients (B) and one for weight gradients
    (W, arXiv 2401.10241); each must run only its own communication. The engine's own
    answer is ``_will_engine_execute_node`` (what ``register_multi_grad_hook`` uses).
    """
    if not ctx.needs_input_grad[i]:
        return False
    node = ctx.next_functions[i][0]
    try:
        return node is None or torch._C._will_engine_execute_node(node)
    except (AttributeError, RuntimeError):  # a leaf inside autograd.grad: be safe
        return True


class _ReduceScatterToSP(torch.autograd.Function):
    """SP's g: reduce-scatter partial sums along the sequence; all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.reduce_scatter(x.contiguous(), dim=SEQ)

    @staticmethod
    def backward(ctx, grad):
        if not wanted(ctx, 0):  # B of a split backward, below a module output it keeps
            return None, None
        return ctx.comm.all_gather(grad.contiguous(), dim=SEQ), None


class _GatherLinear(torch.autograd.Function):
    """SP's f fused with the column linear: all-gather the sequence, then x W^T + b.

    Saves the *sharded* input and gathers it again in backward for the weight gradient
    (Korthikanti et al. 4.2.2), so the full [b, s, h] input is never kept alive. The
    re-gather runs only when the weight gradient is wanted, the reduce-scatter only when
    the input gradient is: a split backward (B, then W) moves what one backward moves.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.comm, ctx.has_bias = comm, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(comm.all_gather(x.contiguous(), dim=SEQ), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if wanted(ctx, 0):
            grad_x = ctx.comm.reduce_scatter(grad.matmul(weight), dim=SEQ)
        g2 = grad.reshape(-1, grad.shape[-1])
        if wanted(ctx, 1):
            full = ctx.comm.all_gather(x.contiguous(), dim=SEQ)  # the extra all-gather
            grad_w = g2.t().matmul(full.reshape(-1, full.shape[-1]))
        if ctx.has_bias and wanted(ctx, 2):
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, None


class _LinearReduceScatter(torch.autograd.Function):
    """SP's row linear: x W^T, then reduce-scatter along the sequence.

    Both gradients need the all-gathered output gradient. When B asks for the input
    gradient alone and a W pass will ask for the weight's later, the gathered gradient is
    kept for it rather than gathered twice.
    """

    @staticmethod
    def forward(ctx, x, weight, comm):
        ctx.comm = comm
        ctx.save_for_backward(x, weight)
        return comm.reduce_scatter(F.linear(x, weight).contiguous(), dim=SEQ)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full = getattr(ctx, "gathered", None)
        if full is None:
            full = ctx.comm.all_gather(grad.contiguous(), dim=SEQ)
        want_x, want_w = wanted(ctx, 0), wanted(ctx, 1)
        ctx.gathered = full if ctx.needs_input_grad[1] and not want_w else None
        grad_x = full.matmul(weight) if want_x else None
        grad_w = None
        if want_w:
            grad_w = full.reshape(-1, full.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        return grad_x, grad_w, None


# --- layers and the style -----------------------------------------------------------

class SequenceShardedEmbedding(nn.Module):
    """SP's position embedding: the full (replicated) table, looked up only for this
    rank's positions. Its gradient is partial: ``sync_sequence_parallel_grads`` sums it."""

    def __init__(self, weight: nn.Parameter, comm: Comm) -> None:
        super().__init__()
        self.weight, self.comm = weight, comm

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        if pos.shape[0] % self.comm.size:
            raise ValueError(f"sequence length {pos.shape[0]} is not divisible by "
                             f"tp={self.comm.size} (needed by sequence parallelism)")
        return F.embedding(pos.chunk(self.comm.size)[self.comm.rank], self.weight)


class SequenceParallelDropout(KeyedDropout):
    """Dropout of a sequence shard [b, s/tp, h]: one device's mask for those positions."""

    def __init__(self, p: float, site: int, comm: Comm) -> None:
        super().__init__(p, site)
        self.comm = comm

    def forward(self, x: torch.Tensor, position_offset: int = 0) -> torch.Tensor:
        return super().forward(x, position_offset + self.comm.rank * x.shape[SEQ])


@dataclass(frozen=True)
class SequenceParallel:
    """Position embedding or dropout -> its version for a sequence shard (SP only)."""

    def apply(self, module: nn.Module, name: str, comm: Comm, shard) -> nn.Module:
        if isinstance(module, KeyedDropout):
            return SequenceParallelDropout(module.p, module.site, comm)
        return SequenceShardedEmbedding(module.weight, comm)


def sync_sequence_parallel_grads(params: nn.Module | Iterable[nn.Parameter],
                                 comm: Comm) -> None:
    """Sum over the tp group the gradients of parameters marked ``sequence_parallel``
    (replicated ones used on a sequence shard), in one flat all-reduce. Call after the
    backward of the last micro-batch, before gradient clipping. Nothing without SP.

    Works on a whole model, a pipeline stage, or a list of parameters.
    """
    if isinstance(params, nn.Module):
        params = params.parameters()
    grads = [p.grad for p in params
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if comm.size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
