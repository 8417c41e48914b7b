# Your copy of this debugging lab, generated from solutions/debug_deadlock.py
# by tools/make_exercises.py.
# It runs, but something in it is wrong: find it with the lesson's instruments,
# fix it, then check your work with
#     from exercises.check import check; check("debug_deadlock")
# Bug 1 of 4: another_bug("debug_deadlock") (from exercises.course) plants the next.
"""Lesson 00 debugging lab: ring moves built from send and recv, one of them wrong.

Every ring algorithm is made of a few moves between neighbours. This file holds them,
each a handful of lines over ``Comm``'s point-to-point calls:

* ``pass_along(comm, t, dst, src)``: send ``t`` to ``dst`` while receiving from ``src``;
* ``shift_right`` / ``shift_left``: every rank passes its tensor one place round the
  ring, to the right (rank + 1) or to the left (rank - 1);
* ``ring_all_gather``: N - 1 shifts to the right, and every rank holds every tensor;
* ``ring_sum``: N - 1 shifts to the left, and every rank holds the sum of all of them.

``check("debug_deadlock")`` runs each move on 3 ranks, in the order above, then all of
them on 2 and 4, and compares what every rank ends with against the move's definition.
Your copy has one bug. It may hang: then the report says which call each rank was inside,
and with which rank, when the check gave up, and which moves had finished. Or a move may
leave the wrong tensor: rank r starts with 2**r everywhere, so any value names the ranks
it came from. Work from that to the line, fix it (point-to-point calls only: no
``all_reduce`` or other collective), and check again.
"""

from __future__ import annotations

import torch

from minipar.comm import Comm


def pass_along(comm: Comm, t: torch.Tensor, dst: int, src: int) -> torch.Tensor:
    """Send ``t`` to rank ``dst`` and return the tensor that rank ``src`` sends us.

    The send is posted without waiting (``isend``) before the receive, so that every rank
    of a ring can call this at once: a blocking send would wait for a receive that its
    partner posts only after its own send.
    """
    incoming = torch.empty_like(t)
    pending = comm.isend(t, dst)
    comm.recv(incoming, src)
    pending.wait()
    return incoming


def shift_right(comm: Comm, t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` moves to rank + 1 (mod N); returns what rank - 1 held."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    return pass_along(comm, t, right, left)


def shift_left(comm: Comm, t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` moves to rank - 1 (mod N); returns what rank + 1 held."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    incoming = torch.empty_like(t)
    comm.recv(incoming, right)
    comm.send(t, left)
    return incoming


def ring_all_gather(comm: Comm, t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t``, in rank order, on every rank: N - 1 shifts to the right."""
    out = [torch.empty_like(t) for _ in range(comm.size)]
    out[comm.rank] = t.clone()
    travelling = t.clone()
    for step in range(1, comm.size):
        travelling = shift_right(comm, travelling)
        out[(comm.rank - step) % comm.size] = travelling
    return out


def ring_sum(comm: Comm, t: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's ``t``, on every rank: N - 1 shifts to the left, each
    rank adding what passes through it (N - 1 whole tensors sent: simple, not cheap)."""
    total = t.clone()
    travelling = t.clone()
    for _ in range(comm.size - 1):
        travelling = shift_left(comm, travelling)
        total += travelling
    return total
