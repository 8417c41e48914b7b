"""Lesson 04 exercise: column- and row-parallel linear layers (Megatron-LM).

A linear layer y = x W^T + b with W of shape [out, in] can be cut across ranks in two
ways (Shoeybi et al., "Megatron-LM", 2019, arXiv 1909.08053, section 3):

* column parallel: rank r keeps the rows of W (and the entries of b) of its slice of the
  *output* features; it receives the whole x and returns its slice of y;
* row parallel: rank r keeps the columns of W of its slice of the *input* features; it
  receives only its slice of x (what a column-parallel layer before it returns) and
  returns the whole y, the same on every rank.

Where a tensor-parallel region begins and ends, two autograd functions make the ranks
agree: f (``CopyToTP``) before a column-parallel layer, g (``ReduceFromTP``) after a
row-parallel one. What each must do in forward and in backward, so that every rank's
values *and gradients* are the single device's, is the heart of the exercise: work it
out from what each rank holds on each side of the boundary (lesson 04 § 2,
``hint("tp_linear", 1)``).

You write ``CopyToTP`` and ``ReduceFromTP`` (forward and backward) and the two layers
(their slicing of a full ``nn.Linear`` and their forward). Communicate only through the
``comm`` you are given. What the check tests, on 2 and 4 ranks, against the full layers
on one device: a column-parallel layer alone (its output slice and the input gradient),
a row-parallel layer alone (the whole output and the input slice's gradient), and
fc -> GELU -> proj as an MLP (output, input gradient, every weight and bias gradient),
with the number of all-reduces in forward and in backward read from the communication
log; then that ``ReduceFromTP`` leaves the tensor it is given as it was, and
``CopyToTP``'s backward the gradient it is given (autograd may still need either).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minipar.comm import Comm


class CopyToTP(torch.autograd.Function):
    """f, where the region begins: every rank holds the same ``x``, and the column-parallel
    layers after it each see only their own outputs' part of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ### BEGIN SOLUTION
        # HINT: keep comm on ctx (ctx.comm = comm) for backward, and return x as it is.
        ctx.comm = comm
        return x
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ### BEGIN SOLUTION
        # HINT: all-reduce a contiguous copy of grad (grad.contiguous().clone()) with
        # ctx.comm.all_reduce, and return it together with None (comm needs no gradient).
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad)
        return grad, None
        ### END SOLUTION


class ReduceFromTP(torch.autograd.Function):
    """g, where the region ends: each rank holds a row-parallel layer's partial result,
    and every rank must leave with the whole value and the same gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ### BEGIN SOLUTION
        # HINT: all-reduce a contiguous copy of x (never the input itself: autograd may
        # still need it) and return the copy.
        out = x.contiguous().clone()
        comm.all_reduce(out)
        return out
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ### BEGIN SOLUTION
        # HINT: the identity: return grad, None.
        return grad, None
        ### END SOLUTION


class ColumnParallelLinear(nn.Module):
    """This rank's output features of ``full`` (an ``nn.Linear`` with the same weights on
    every rank). Input: the whole x. Output: y[..., lo:hi] of the full layer, where this
    rank owns out_features / comm.size consecutive outputs."""

    def __init__(self, full: nn.Linear, comm: Comm):
        super().__init__()
        self.comm = comm
        ### BEGIN SOLUTION
        # HINT: the weight is [out, in]: take rows. torch.chunk(full.weight.detach(),
        # comm.size, dim=0)[comm.rank].clone() wrapped in nn.Parameter; the bias (if any)
        # is chunked the same way along its only dimension. Set self.weight, self.bias.
        w = torch.chunk(full.weight.detach(), comm.size, dim=0)[comm.rank]
        self.weight = nn.Parameter(w.clone())
        self.bias = None if full.bias is None else nn.Parameter(
            torch.chunk(full.bias.detach(), comm.size, dim=0)[comm.rank].clone())
        ### END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        # HINT: F.linear(CopyToTP.apply(x, self.comm), self.weight, self.bias)
        return F.linear(CopyToTP.apply(x, self.comm), self.weight, self.bias)
        ### END SOLUTION


class RowParallelLinear(nn.Module):
    """This rank's input features of ``full``. Input: x[..., lo:hi], this rank's slice of
    the input features (what a ColumnParallelLinear before it outputs). Output: the
    whole y of the full layer, the same on every rank."""

    def __init__(self, full: nn.Linear, comm: Comm):
        super().__init__()
        self.comm = comm
        ### BEGIN SOLUTION
        # HINT: take columns of the weight: torch.chunk(..., comm.size, dim=1). The bias
        # is not split: every rank keeps all of it (added once, after the all-reduce).
        w = torch.chunk(full.weight.detach(), comm.size, dim=1)[comm.rank]
        self.weight = nn.Parameter(w.clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())
        ### END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        # HINT: the partial sum F.linear(x, self.weight) (no bias!), through
        # ReduceFromTP.apply(..., self.comm), then add self.bias if there is one.
        y = ReduceFromTP.apply(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias
        ### END SOLUTION


class ParallelMLP(nn.Module):
    """fc (column) -> GELU -> proj (row), the MLP of a transformer block."""

    def __init__(self, fc: nn.Linear, proj: nn.Linear, comm: Comm):
        super().__init__()
        self.fc, self.proj = ColumnParallelLinear(fc, comm), RowParallelLinear(proj, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))
