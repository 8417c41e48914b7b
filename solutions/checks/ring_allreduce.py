"""Cases for the ring all-reduce exercise (lesson 00).

Every rank builds every rank's input from a seed, so each can compute the expected sum
alone and report facts back; the parent turns the first wrong fact into a message.
Ring sizes 2, 3 and 4 (2 hides index bugs: left and right are the same rank), tensor
sizes that divide evenly, that do not, and that are smaller than the ring.
"""

from __future__ import annotations

import importlib
import math

import torch

from minipar.comm import Comm, wire_bytes

from ..check import expect, launch_case

WORLDS = (2, 3, 4)
# Even sizes first, in their own run: an index bug there shows up as a wrong sum. With
# uneven chunks the same bug may pair a send with a receive of another size, which
# gloo answers by aborting the process (reported as such, with a hint).
EVEN = ((12,), (3, 4))
UNEVEN = ((10,), (2,), (3, 5))
P2P = {"send", "recv"}


def _inputs(shape: tuple[int, ...], n: int, case: int) -> list[torch.Tensor]:
    """Every rank's input for one case: small integers, so sums are exact in float32."""
    g = torch.Generator().manual_seed(1000 * n + case)
    return [torch.randint(-8, 9, shape, generator=g).float() for _ in range(n)]


def _ops(comm: Comm) -> dict[str, int]:
    ops: dict[str, int] = {}
    for r in comm.log.records:
        ops[r.op] = ops.get(r.op, 0) + 1
    return ops


def _unwaited(comm: Comm) -> list[str]:
    """The isend/irecv calls logged since the last clear that nobody waited for: their
    records never got an end time."""
    return [r.describe() for r in comm.log.records if math.isnan(r.end)]


def _contributors(value: float, n: int) -> str:
    """Which ranks' inputs a probe chunk holds: rank r contributed 2**r, once each."""
    if value != int(value) or not 0 <= value < 2 ** n:
        return f"an impossible mix ({value:g}: some rank's input was added twice)"
    ranks = [r for r in range(n) if int(value) >> r & 1]
    return "{" + ", ".join(map(str, ranks)) + "}"


def _probe(mod, comm: Comm) -> list[float]:
    """Reduce-scatter chunks where rank r holds 2**r everywhere; the value of each chunk
    afterwards says which ranks' contributions reached it."""
    chunks = [torch.full((2,), 2.0 ** comm.rank) for _ in range(comm.size)]
    mod.ring_reduce_scatter(comm, chunks)
    return [float(c[0]) for c in chunks]


def _rank_cases(impl: str, shapes: tuple[tuple[int, ...], ...]) -> list[dict]:
    """Run on every rank: each function on each shape; return facts, not verdicts."""
    mod = importlib.import_module(f"{impl}.ring_allreduce")
    comm = Comm()
    n, rank = comm.size, comm.rank
    probe = _probe(mod, comm)
    facts = []
    for case, shape in enumerate(shapes):
        xs = _inputs(shape, n, case)
        total = torch.stack(xs).sum(0)
        want = list(torch.tensor_split(total.reshape(-1), n))

        comm.log.clear()
        chunks = list(torch.tensor_split(xs[rank].clone().reshape(-1), n))
        owned = mod.ring_reduce_scatter(comm, chunks)
        rs_unwaited = _unwaited(comm)
        rs_ok = isinstance(owned, int) and 0 <= owned < n and torch.equal(chunks[owned],
                                                                         want[owned])
        rs_ops = _ops(comm)

        comm.log.clear()
        mine = (rank + 1) % n
        chunks = [torch.full_like(w, float("nan")) for w in want]
        chunks[mine] = want[mine].clone()
        mod.ring_all_gather(comm, chunks, mine)
        ag_unwaited = _unwaited(comm)
        ag_ok = all(torch.equal(c, w) for c, w in zip(chunks, want))
        ag_ops = _ops(comm)

        comm.log.clear()
        t = xs[rank].clone()
        out = mod.ring_all_reduce(comm, t)
        facts.append({
            "shape": shape, "owned": owned, "probe": probe, "rs_ok": rs_ok, "rs_ops": rs_ops,
            "ag_ok": ag_ok, "ag_ops": ag_ops, "unwaited": {
                "ring_reduce_scatter": rs_unwaited, "ring_all_gather": ag_unwaited,
                "ring_all_reduce": _unwaited(comm)},
            "ar_same": out is t, "ar_ok": torch.equal(t, total),
            "ar_ops": _ops(comm), "ar_wire": comm.log.total("nbytes", op="send"),
            "ar_expected_wire": wire_bytes("all_reduce", t.numel() * t.element_size(), n)})
    return facts


def _judge(n: int, rank: int, f: dict) -> None:
    where = f"on {n} ranks, shape {f['shape']}, rank {rank}"
    want_owned = (rank + 1) % n
    expect(f["owned"] == want_owned,
           f"ring_reduce_scatter returned {f['owned']!r} {where}; expected {want_owned}",
           "return (rank + 1) % size: after size-1 steps that is the chunk that has "
           "collected every rank's contribution")
    for fn, calls in f["unwaited"].items():
        expect(not calls, f"{fn} {where} returned with {len(calls)} message(s) never "
               f"waited for (the first: {calls[0] if calls else ''}): a receive's buffer "
               "may not hold its data yet, and a send's may still be read",
               "isend and irecv return at once: call .wait() on what they return before "
               "reading or changing the buffer (exchange() does that for you)")
    held = "; ".join(f"chunk {k} holds ranks {_contributors(v, n)}"
                     for k, v in enumerate(f["probe"]))
    expect(f["rs_ok"], f"ring_reduce_scatter: chunk {want_owned} is not the full sum {where}: "
           f"expected chunk {want_owned} to hold the contributions of ranks "
           f"{_contributors(2 ** n - 1, n)}; after your reduce-scatter (rank r adding 2**r) "
           f"rank {rank}'s {held}",
           "the chunk a rank sends must be the one it added to in the previous step; "
           "hint('ring_allreduce', 2) for the idea")
    expect(set(f["rs_ops"]) <= P2P and f["rs_ops"].get("send", 0) == n - 1,
           f"ring_reduce_scatter used {f['rs_ops'] or 'no counted ops'} {where}; "
           f"expected exactly {n - 1} sends and receives",
           "one exchange per step, size-1 steps, only through comm (send/recv/isend/"
           "irecv); calling torch.distributed directly bypasses the count")
    expect(f["ag_ok"], f"ring_all_gather left some chunks wrong {where}",
           "start from the chunk you own and walk the same way as the reduce-scatter; "
           "received chunks replace, never add")
    expect(set(f["ag_ops"]) <= P2P and f["ag_ops"].get("send", 0) == n - 1,
           f"ring_all_gather used {f['ag_ops'] or 'no counted ops'} {where}; "
           f"expected exactly {n - 1} sends and receives",
           "one exchange per step, size-1 steps, only through comm")
    expect(f["ar_ok"], f"ring_all_reduce gave a wrong sum {where}",
           "cut a flat view of t into size chunks (torch.tensor_split(t.view(-1), size)), "
           "reduce-scatter them, then all-gather from the returned index")
    expect(f["ar_same"], f"ring_all_reduce did not return its input tensor {where}",
           "work in place on views of t and return t itself")
    expect(set(f["ar_ops"]) <= P2P,
           f"ring_all_reduce used {sorted(set(f['ar_ops']) - P2P)} {where}",
           "build it from send/recv only; comm.all_reduce is what you are writing")
    expect(f["ar_ops"].get("send", 0) == 2 * (n - 1),
           f"ring_all_reduce sent {f['ar_ops'].get('send', 0)} messages {where}; the ring "
           f"sends 2 * (size - 1) = {2 * (n - 1)}",
           "size-1 steps of reduce-scatter, then size-1 steps of all-gather")
    if f["shape"][0] % n == 0 and len(f["shape"]) == 1:
        expect(f["ar_wire"] == f["ar_expected_wire"],
               f"ring_all_reduce sent {f['ar_wire']} bytes {where}; a ring sends "
               f"2 (N-1)/N * S = {f['ar_expected_wire']}",
               "send one chunk (S/N bytes) per step, never the whole tensor")


def run(impl: str, timeout: float) -> str:
    """All cases on 2, 3 and 4 ranks; the first disagreement raises ``CheckFailure``."""
    for n in WORLDS:
        for shapes in (EVEN, UNEVEN):
            per_rank = launch_case(_rank_cases, n, args=(impl, shapes), timeout=timeout)
            for rank, facts in enumerate(per_rank):
                for f in facts:
                    _judge(n, rank, f)
    return (f"{len(EVEN) + len(UNEVEN)} shapes on {', '.join(map(str, WORLDS))} ranks: "
            "sums exact, only send/recv, 2(N-1) messages and 2(N-1)/N * S bytes per rank")
