# Your copy of this exercise, generated from solutions/tp_linear.py by tools/make_exercises.py.
# Fill in the blanks (each raises NotImplementedError), then check your work with
#     from exercises.check import check; check("tp_linear")
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
        # YOUR CODE HERE
        raise NotImplementedError(
            'CopyToTP.forward in exercises/tp_linear.py is not implemented yet. Hint:'
            " ask for one with hint('tp_linear', 1) (a nudge), 2 (the method) or 3 "
            '(the answer), from exercises.course')

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # YOUR CODE HERE
        raise NotImplementedError(
            'CopyToTP.backward in exercises/tp_linear.py is not implemented yet. '
            "Hint: ask for one with hint('tp_linear', 1) (a nudge), 2 (the method) or"
            ' 3 (the answer), from exercises.course')


class ReduceFromTP(torch.autograd.Function):
    """g, where the region ends: each rank holds a row-parallel layer's partial result,
    and every rank must leave with the whole value and the same gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        # YOUR CODE HERE
        raise NotImplementedError(
            'ReduceFromTP.forward in exercises/tp_linear.py is not implemented yet. '
            "Hint: ask for one with hint('tp_linear', 1) (a nudge), 2 (the method) or"
            ' 3 (the answer), from exercises.course')

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # YOUR CODE HERE
        raise NotImplementedError(
            'ReduceFromTP.backward in exercises/tp_linear.py is not implemented yet. '
            "Hint: ask for one with hint('tp_linear', 1) (a nudge), 2 (the method) or"
            ' 3 (the answer), from exercises.course')


class ColumnParallelLinear(nn.Module):
    """This rank's output features of ``full`` (an ``nn.Linear`` with the same weights on
    every rank). Input: the whole x. Output: y[..., lo:hi] of the full layer, where this
    rank owns out_features / comm.size consecutive outputs."""

    def __init__(self, full: nn.Linear, comm: Comm):
        super().__init__()
        self.comm = comm
        # YOUR CODE HERE
        raise NotImplementedError(
            'ColumnParallelLinear.__init__ in exercises/tp_linear.py is not '
            "implemented yet. Hint: ask for one with hint('tp_linear', 1) (a nudge), "
            '2 (the method) or 3 (the answer), from exercises.course')

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # YOUR CODE HERE
        raise NotImplementedError(
            'ColumnParallelLinear.forward in exercises/tp_linear.py is not '
            "implemented yet. Hint: ask for one with hint('tp_linear', 1) (a nudge), "
            '2 (the method) or 3 (the answer), from exercises.course')


class RowParallelLinear(nn.Module):
    """This rank's input features of ``full``. Input: x[..., lo:hi], this rank's slice of
    the input features (what a ColumnParallelLinear before it outputs). Output: the
    whole y of the full layer, the same on every rank."""

    def __init__(self, full: nn.Linear, comm: Comm):
        super().__init__()
        self.comm = comm
        # YOUR CODE HERE
        raise NotImplementedError(
            'RowParallelLinear.__init__ in exercises/tp_linear.py is not implemented '
            "yet. Hint: ask for one with hint('tp_linear', 1) (a nudge), 2 (the "
            'method) or 3 (the answer), from exercises.course')

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # YOUR CODE HERE
        raise NotImplementedError(
            'RowParallelLinear.forward in exercises/tp_linear.py is not implemented '
            "yet. Hint: ask for one with hint('tp_linear', 1) (a nudge), 2 (the "
            'method) or 3 (the answer), from exercises.course')


class ParallelMLP(nn.Module):
    """fc (column) -> GELU -> proj (row), the MLP of a transformer block."""

    def __init__(self, fc: nn.Linear, proj: nn.Linear, comm: Comm):
        super().__init__()
        self.fc, self.proj = ColumnParallelLinear(fc, comm), RowParallelLinear(proj, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))
