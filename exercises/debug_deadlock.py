# Your copy of this debugging lab, generated from solutions/debug_deadlock.py
# by tools/make_exercises.py.
# It runs, but something in it is wrong: find it with the lesson's instruments,
# fix it, then check your work with
#     from exercises.check import check; check("debug_deadlock")
"""Lesson 00 debugging lab: a shift around the ring that hangs.

``shift_right`` should pass every rank's tensor to its right neighbour: afterwards rank r
holds what rank r - 1 (mod size) held. It is the basic move of every ring algorithm. As
written in your copy it hangs: run ``check("debug_deadlock")`` and read the hang report,
which says which operation each rank was stuck in. Then fix the order of the messages
(without ``all_reduce`` or any other collective) and check again.
"""

from __future__ import annotations

import torch

from minipar.comm import Comm


def shift_right(comm: Comm, t: torch.Tensor) -> torch.Tensor:
    """Send ``t`` to rank (rank + 1) % size; return what arrives from rank (rank - 1) % size."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    incoming = torch.empty_like(t)
    # FIND THE BUG HERE
    comm.recv(incoming, left)  # wait for the left neighbour's tensor...
    comm.send(t, right)  # ...then pass ours on
    return incoming
