"""Lesson 09 exercise: dispatch tokens to the ranks that hold their experts, and combine.

Expert parallelism (GShard, Lepikhin et al. 2020, arXiv 2006.16668) splits each MoE
layer's E experts over the ep ranks of a group: rank j holds experts
[j E/ep, (j+1) E/ep). Every rank routes its own tokens, so each rank has rows for every
expert, and each expert needs rows from every rank. Two all-to-alls move them:
*dispatch* sends each row to its expert's rank, *combine* brings each result home.

The one tool: ``all_to_all(x, comm, send, recv)`` from ``minipar.parallel.ep``, a
counted, differentiable ``all_to_all_single`` with split sizes: rank i sends its first
``send[0]`` rows to rank 0, the next ``send[1]`` to rank 1, ..., and receives
``recv[j]`` rows from each rank j, rank 0's first. Every rank must pass sizes that
agree with its partners' (what i sends to j is what j receives from i), so a rank has
to learn how many rows it will receive before the rows can move.

The contract (``comm.size`` = ep ranks, E experts, L = E / ep local ones):

* ``dispatch(x, counts, comm)``: ``x`` this rank's rows sorted by global expert,
  ``counts`` [E] (int64) how many of them each expert gets. Returns ``(rows,
  local_counts, plan)``: every rank's rows for *my* experts, sorted by my expert and,
  inside one expert, by source rank (rank 0's rows first, each rank's in the order it
  sent them); ``local_counts`` [L] the rows per local expert; ``plan`` anything
  ``combine`` needs.
* ``combine(y, plan, comm)``: ``y`` one result row per row ``dispatch`` returned, in
  the same order; returns this rank's results in the order of the original ``x``.

What the check tests: on 2 and 4 ranks, random rows with random (and empty) counts:
the rows and counts ``dispatch`` returns against the expected ones (built from every
rank's inputs), ``combine`` of a function of the rows against that function of ``x``;
then a real run: ``moe-tiny`` trained on dp 2 with ep 2 through your two functions,
against one process (losses and gradient norms per step).
"""

from __future__ import annotations

import torch

from minipar.comm import Comm
from minipar.parallel.ep import all_to_all


def dispatch(x: torch.Tensor, counts: torch.Tensor, comm: Comm) -> tuple:
    """Send each row of ``x`` (sorted by global expert, ``counts`` [E] per expert) to the
    rank holding its expert. Returns ``(rows, local_counts, plan)`` (see the module)."""
    ep = comm.size
    local = counts.numel() // ep
    ### BEGIN SOLUTION
    # HINT: counts.view(ep, local)[j] are my rows for rank j's experts. First exchange
    # the counts themselves: got = comm.all_to_all(counts.view(ep, local), [1] * ep,
    # [1] * ep) is [source rank, my expert]. Then send = counts.view(ep, local).sum(1),
    # recv = got.sum(1) (as lists) and rows = all_to_all(x, comm, send, recv) arrive by
    # source rank, then expert: sort them by (expert, source) with a stable sort of the
    # key expert * ep + source, one key per row (repeat_interleave by got).
    got = comm.all_to_all(counts.view(ep, local), [1] * ep, [1] * ep)
    send = counts.view(ep, local).sum(1).tolist()
    recv = got.sum(1).tolist()
    rows = all_to_all(x, comm, send, recv)
    key = torch.arange(local) * ep + torch.arange(ep)[:, None]  # [source, expert]
    order = torch.sort(key.flatten().repeat_interleave(got.flatten()), stable=True)[1]
    return rows[order], got.sum(0), (order, send, recv)
    ### END SOLUTION


def combine(y: torch.Tensor, plan, comm: Comm) -> torch.Tensor:
    """Send each result row of ``y`` (in ``dispatch``'s order) back to its row's rank;
    returns this rank's results in the order of the ``x`` given to ``dispatch``."""
    ### BEGIN SOLUTION
    # HINT: undo the sort first: back = torch.empty_like(order); back[order] =
    # torch.arange(len(order)); y[back] is by source rank again. Then the all-to-all
    # the other way: all_to_all(y[back], comm, recv, send).
    order, send, recv = plan
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel())
    return all_to_all(y[back], comm, recv, send)
    ### END SOLUTION
