# Your copy of this exercise, generated from solutions/tp_linear.py by tools/make_exercises.py.
# Fill in the blanks (each raises NotImplementedError), then check your work with
#     from exercises.check import check; check("tp_linear")
"""Lesson 03 exercise: column- and row-parallel linear layers (Megatron-LM).

A linear layer y = x W^T + b with W of shape [out, in] can be cut across ranks in two
ways (Shoeybi et al., "Megatron-LM", 2019, arXiv 1909.08053, section 3):

* Column parallel: rank r keeps rows r of W split by *output* features (and the same
  slice of b). Given the whole input x, it computes its own slice of the outputs, with
  no communication at all.
* Row parallel: rank r keeps W split by *input* features. Given its own slice of the
  input features, it computes x_r W_r^T, a partial sum; the ranks' partial sums add up
  to x W^T. One all-reduce completes it; the bias is added once, after the sum.

Put a column-parallel layer in front of a row-parallel one, and the column layer's
output slice is exactly the row layer's input slice: an MLP (or attention, head by
head) needs one all-reduce in forward. Two autograd functions mark the boundaries:

* f ("copy to the tensor-parallel region"), before the column layer: identity forward.
  Every rank used the same x, and each rank's backward only sees its own outputs'
  contribution to dL/dx, so backward all-reduces the input gradient.
* g ("reduce from the region"), after the row layer: all-reduce forward; identity
  backward (the output gradient is already the same on every rank).

f and g are conjugates: each is the other with forward and backward swapped.

You write ``CopyToTP``, ``ReduceFromTP`` (their forward and backward) and the two
layers: their slicing of a full ``nn.Linear`` and their forward. Communicate only
through the ``comm`` you are given.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minipar.comm import Comm


class CopyToTP(torch.autograd.Function):
    """f: forward returns x unchanged; backward all-reduces (sums) the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        # YOUR CODE HERE
        raise NotImplementedError(
            'forward in exercises/tp_linear.py is not implemented yet. Hint: ask for '
            "one with hint('tp_linear', 1) (a nudge), 2 (the idea) or 3 (the "
            'formula), from exercises.course')

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # YOUR CODE HERE
        raise NotImplementedError(
            'backward in exercises/tp_linear.py is not implemented yet. Hint: ask for'
            " one with hint('tp_linear', 1) (a nudge), 2 (the idea) or 3 (the "
            'formula), from exercises.course')


class ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduces (sums) x over the ranks; backward returns the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        # YOUR CODE HERE
        raise NotImplementedError(
            'forward in exercises/tp_linear.py is not implemented yet. Hint: ask for '
            "one with hint('tp_linear', 1) (a nudge), 2 (the idea) or 3 (the "
            'formula), from exercises.course')

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # YOUR CODE HERE
        raise NotImplementedError(
            'backward in exercises/tp_linear.py is not implemented yet. Hint: ask for'
            " one with hint('tp_linear', 1) (a nudge), 2 (the idea) or 3 (the "
            'formula), from exercises.course')


class ColumnParallelLinear(nn.Module):
    """This rank's output features of ``full`` (an ``nn.Linear`` with the same weights on
    every rank). Input: the whole x. Output: y[..., lo:hi] of the full layer, where this
    rank owns out_features / comm.size consecutive outputs."""

    def __init__(self, full: nn.Linear, comm: Comm):
        super().__init__()
        self.comm = comm
        # YOUR CODE HERE
        raise NotImplementedError(
            '__init__ in exercises/tp_linear.py is not implemented yet. Hint: ask for'
            " one with hint('tp_linear', 1) (a nudge), 2 (the idea) or 3 (the "
            'formula), from exercises.course')

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # YOUR CODE HERE
        raise NotImplementedError(
            'forward in exercises/tp_linear.py is not implemented yet. Hint: ask for '
            "one with hint('tp_linear', 1) (a nudge), 2 (the idea) or 3 (the "
            'formula), from exercises.course')


class RowParallelLinear(nn.Module):
    """This rank's input features of ``full``. Input: x[..., lo:hi], this rank's slice of
    the input features (what a ColumnParallelLinear before it outputs). Output: the
    whole y of the full layer, the same on every rank."""

    def __init__(self, full: nn.Linear, comm: Comm):
        super().__init__()
        self.comm = comm
        # YOUR CODE HERE
        raise NotImplementedError(
            '__init__ in exercises/tp_linear.py is not implemented yet. Hint: ask for'
            " one with hint('tp_linear', 1) (a nudge), 2 (the idea) or 3 (the "
            'formula), from exercises.course')

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # YOUR CODE HERE
        raise NotImplementedError(
            'forward in exercises/tp_linear.py is not implemented yet. Hint: ask for '
            "one with hint('tp_linear', 1) (a nudge), 2 (the idea) or 3 (the "
            'formula), from exercises.course')


class ParallelMLP(nn.Module):
    """fc (column) -> GELU -> proj (row): one all-reduce forward, one backward."""

    def __init__(self, fc: nn.Linear, proj: nn.Linear, comm: Comm):
        super().__init__()
        self.fc, self.proj = ColumnParallelLinear(fc, comm), RowParallelLinear(proj, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))
