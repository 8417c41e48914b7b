"""Lesson 00 exercise: ring all-reduce built from point-to-point messages only.

Every rank holds a tensor of the same shape; afterwards every rank must hold the
element-wise sum of all of them. The obvious way (everyone sends to rank 0, rank 0 adds
and sends the total back, see ``naive_all_reduce``) makes rank 0 send (N-1) full copies:
its link is the bottleneck and the cost grows with N.

The ring (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", 2009; popularised for deep learning by Baidu in 2017 and by Horovod,
arXiv 1802.05799) spreads the work evenly: the ranks sit on a circle, each sends only to
its right neighbour and receives only from its left, and the tensor is cut into N
chunks. It runs in two phases of N-1 steps, one chunk per rank and step:

1. reduce-scatter: afterwards rank r holds chunk (r+1) mod N summed over all N ranks;
2. all-gather: afterwards every rank holds every summed chunk.

Each rank then sends 2 (N-1) chunks of S/N bytes, 2 (N-1)/N * S in all, whatever N is:
the figure ``minipar.comm`` records as the wire bytes of an ``all_reduce``. Which chunk
travels at which step, so that each partial sum picks up one more contribution per hop,
is the exercise (lesson 00 § 5 draws the ring; ``hint("ring_allreduce", 1)``).

You write ``ring_reduce_scatter``, ``ring_all_gather`` and ``ring_all_reduce``. Use only
``comm.send``, ``comm.recv``, ``comm.isend``, ``comm.irecv`` (or the ``exchange`` helper
below), never ``comm.all_reduce``. What the check tests, on rings of 2, 3 and 4 ranks
(2 hides index bugs: left and right are the same rank), with tensors that divide evenly,
that do not, and that are smaller than the ring: the chunk each phase leaves complete,
every rank's result against the sum, and the communication log: point-to-point
messages only, N-1 sends per phase, 2 (N-1)/N of the tensor's bytes in all.
"""

from __future__ import annotations

import torch

from minipar.comm import Comm


def exchange(comm: Comm, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
    """Send ``send`` to rank ``dst`` while receiving into ``recv`` from rank ``src``.

    Why not ``comm.send`` then ``comm.recv``? In a ring every rank sends at the same
    moment. A blocking send may wait until the receiver has posted its receive, and the
    receiver is itself stuck in its own send: all ranks wait forever (a deadlock). Posting
    the send without waiting (``isend``), receiving, then waiting for the send to finish
    lets every message find its receiver.
    """
    pending = comm.isend(send, dst)
    comm.recv(recv, src)
    pending.wait()


def naive_all_reduce(comm: Comm, t: torch.Tensor) -> torch.Tensor:
    """All-reduce through rank 0: gather, add, send back (given, for comparison).

    Rank 0 receives N-1 tensors and sends N-1 tensors: (N-1) * S bytes leave it, which
    grows with N while every other rank's link sits idle most of the time.
    """
    if comm.rank == 0:
        buf = torch.empty_like(t)
        for src in range(1, comm.size):
            t += comm.recv(buf, src)
        for dst in range(1, comm.size):
            comm.send(t, dst)
    else:
        comm.send(t, 0)
        comm.recv(t, 0)
    return t


def ring_reduce_scatter(comm: Comm, chunks: list[torch.Tensor]) -> int:
    """Sum ``chunks`` around the ring; return the index of the chunk now complete here.

    ``chunks`` has one tensor per rank (``comm.size`` of them; sizes may differ by one
    element, as ``torch.tensor_split`` makes them) and is updated in place. When this
    returns, ``chunks[(rank + 1) % size]`` holds the sum of that chunk over all ranks;
    the other chunks hold partial sums. Returns ``(rank + 1) % size``.
    """
    ### BEGIN SOLUTION
    # HINT: at step s = 0 .. size-2, send chunks[(rank - s) % size] to the right
    # neighbour (rank + 1) % size and receive, from the left neighbour, into a scratch
    # buffer shaped like chunks[(rank - s - 1) % size]; then add the buffer to that
    # chunk. Use exchange() so the sends cannot deadlock.
    n, rank = comm.size, comm.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[recv_i])
        exchange(comm, chunks[send_i], right, incoming, left)
        chunks[recv_i] += incoming
    return (rank + 1) % n
    ### END SOLUTION


def ring_all_gather(comm: Comm, chunks: list[torch.Tensor], owned: int) -> None:
    """Circulate finished chunks until every rank holds all of them (in place).

    On entry ``chunks[owned]`` is complete on this rank, and the left neighbour's
    complete chunk is ``owned - 1`` (mod size), as ``ring_reduce_scatter`` leaves them.
    The other chunks may hold anything; they are overwritten, never added to.
    """
    ### BEGIN SOLUTION
    # HINT: at step s = 0 .. size-2, send chunks[(owned - s) % size] to the right and
    # receive straight into chunks[(owned - s - 1) % size] from the left: this time the
    # incoming chunk replaces what was there, so no scratch buffer is needed.
    n, rank = comm.size, comm.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_i, recv_i = (owned - step) % n, (owned - step - 1) % n
        exchange(comm, chunks[send_i], right, chunks[recv_i], left)
    ### END SOLUTION


def ring_all_reduce(comm: Comm, t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over the ranks of ``comm``, in place, with the ring; return ``t``.

    Works for any shape and size, also when ``t`` has fewer elements than there are
    ranks (some chunks are then empty, and empty messages are fine).
    """
    if comm.size == 1:
        return t
    if not t.is_contiguous():  # the chunks must be views into t's own storage
        flat = t.contiguous()
        ring_all_reduce(comm, flat)
        return t.copy_(flat)
    ### BEGIN SOLUTION
    # HINT: t.view(-1) is a flat view of t's storage; torch.tensor_split(flat, comm.size)
    # cuts it into views, so updating the chunks updates t. Run ring_reduce_scatter on
    # the chunks, then ring_all_gather with the index it returns.
    chunks = list(torch.tensor_split(t.view(-1), comm.size))
    owned = ring_reduce_scatter(comm, chunks)
    ring_all_gather(comm, chunks, owned)
    return t
    ### END SOLUTION
