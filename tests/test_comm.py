"""Counted communication (minipar/comm.py): each op against plain torch, and its record.

Every rank draws its input from its own seed, so the parent can rebuild all inputs and
compute what each op must return with ordinary tensor arithmetic (a sum over ranks, a
concatenation, a slice). One launch per world size runs every op; the tests below read
its results. The records are checked against the ring formulas the module cites
(Patarasuk & Yuan 2009): all-reduce 2(N-1)/N * S, all-gather and reduce-scatter
(N-1)/N * S, broadcast and send S, recv 0.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from minipar.comm import Comm, CommLog, CommRecord, wire_bytes
from minipar.engine import _compute_seconds, imagine_peers
from minipar.launch import launch

SHAPE = (4, 8)  # both dims divisible by 2 and 4
S = 4 * 8 * 4  # payload bytes of one input (float32)


def _input(rank: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(1000 + rank))


def _every_op() -> dict:
    comm = Comm()
    r, n = comm.rank, comm.size
    x = _input(r)
    flat = x.reshape(-1)
    out: dict = {}

    t = x.clone()
    out["all_reduce_returns"] = comm.all_reduce(t)
    out["all_reduce_sum"] = t
    t = x.clone()
    comm.all_reduce(t, op="max")
    out["all_reduce_max"] = t
    out["all_gather_0"] = comm.all_gather(x, dim=0)
    out["all_gather_1"] = comm.all_gather(x, dim=1)
    out["all_gather_noncontiguous"] = comm.all_gather(x.t(), dim=0)
    out["reduce_scatter_0"] = comm.reduce_scatter(x, dim=0)
    out["reduce_scatter_1"] = comm.reduce_scatter(x, dim=1)
    out["broadcast"] = comm.broadcast(x.clone(), src=n - 1)

    got = torch.empty_like(x)  # a ring: even ranks send first, odd ones receive first
    if r % 2 == 0:
        comm.send(x, (r + 1) % n)
        comm.recv(got, (r - 1) % n)
    else:
        comm.recv(got, (r - 1) % n)
        comm.send(x, (r + 1) % n)
    out["recv"] = got
    got = torch.empty_like(x)  # the other way round, both posted before either waits
    pending = [comm.isend(2 * x, (r - 1) % n), comm.irecv(got, (r + 1) % n)]
    for p in pending:
        p.wait()
    out["irecv"] = got

    g = torch.empty(n * flat.numel())
    out["all_gather_into_returns"] = comm.all_gather_into(g, flat)
    out["all_gather_into"] = g
    s = torch.empty(flat.numel() // n)
    comm.reduce_scatter_into(s, flat)
    out["reduce_scatter_into"] = s

    t, g, s = x.clone(), torch.empty(n * flat.numel()), torch.empty(flat.numel() // n)
    pending = [comm.all_reduce(t, async_op=True), comm.all_gather_into(g, flat, True),
               comm.reduce_scatter_into(s, flat, async_op=True)]
    out["unfinished_before_wait"] = [math.isnan(p.record.end) for p in pending]
    for p in pending:
        p.wait()
    out["completed_after_wait"] = [p.is_completed() for p in pending]
    out["async"] = (t, g, s)
    comm.barrier()

    out["records"] = comm.log.to_dicts()
    out["summary"] = comm.log.summary()
    try:
        comm.all_reduce(x.clone(), op="mean")
    except ValueError as e:
        out["bad_op"] = str(e)
    out["records_after_bad_op"] = len(comm.log.records)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n} ranks")
def run(request):
    n = request.param
    return n, launch(_every_op, n, timeout=60), [_input(r) for r in range(n)]


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Sums over ranks: gloo may add in another order than torch.stack(...).sum(0)."""
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_all_reduce_sum_and_max(run):
    n, res, xs = run
    total, biggest = torch.stack(xs).sum(0), torch.stack(xs).amax(0)
    for out in res:
        assert out["all_reduce_returns"] is None  # in place
        close(out["all_reduce_sum"], total)
        assert torch.equal(out["all_reduce_max"], biggest)


def test_all_gather_along_dim_0_and_1(run):
    n, res, xs = run
    for out in res:
        assert torch.equal(out["all_gather_0"], torch.cat(xs, 0))
        assert torch.equal(out["all_gather_1"], torch.cat(xs, 1))
        assert torch.equal(out["all_gather_noncontiguous"], torch.cat([x.t() for x in xs], 0))


def test_reduce_scatter_along_dim_0_and_1(run):
    n, res, xs = run
    total = torch.stack(xs).sum(0)
    for r, out in enumerate(res):
        close(out["reduce_scatter_0"], total.chunk(n, 0)[r])
        close(out["reduce_scatter_1"], total.chunk(n, 1)[r])
        assert out["reduce_scatter_1"].shape == (SHAPE[0], SHAPE[1] // n)


def test_broadcast(run):
    n, res, xs = run
    for out in res:
        assert torch.equal(out["broadcast"], xs[n - 1])


def test_send_recv_and_isend_irecv(run):
    n, res, xs = run
    for r, out in enumerate(res):
        assert torch.equal(out["recv"], xs[(r - 1) % n])
        assert torch.equal(out["irecv"], 2 * xs[(r + 1) % n])


def test_flat_into_variants(run):
    n, res, xs = run
    flat_total = torch.stack(xs).sum(0).reshape(-1)
    for r, out in enumerate(res):
        assert out["all_gather_into_returns"] is None
        assert torch.equal(out["all_gather_into"], torch.cat([x.reshape(-1) for x in xs]))
        close(out["reduce_scatter_into"], flat_total.chunk(n)[r])


def test_async_ops_finish_on_wait(run):
    n, res, xs = run
    total = torch.stack(xs).sum(0)
    for r, out in enumerate(res):
        assert out["unfinished_before_wait"] == [True] * 3
        assert out["completed_after_wait"] == [True] * 3
        t, g, s = out["async"]
        close(t, total)
        assert torch.equal(g, torch.cat([x.reshape(-1) for x in xs]))
        close(s, total.reshape(-1).chunk(n)[r])


def _expected_records(n: int, rank: int) -> list[tuple]:
    """(op, payload bytes, wire bytes, peer) per call of ``_every_op``, in order."""
    ring = (n - 1) * S // n
    gathered = n * S  # an all-gather's payload is its output
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    p2p = ([("send", S, S, nxt), ("recv", S, 0, prv)] if rank % 2 == 0 else
           [("recv", S, 0, prv), ("send", S, S, nxt)])
    return [
        ("all_reduce", S, 2 * ring, None), ("all_reduce", S, 2 * ring, None),
        *[("all_gather", gathered, (n - 1) * S, None)] * 3,
        *[("reduce_scatter", S, ring, None)] * 2,
        ("broadcast", S, S, None),
        *p2p, ("send", S, S, prv), ("recv", S, 0, nxt),
        ("all_gather", gathered, (n - 1) * S, None), ("reduce_scatter", S, ring, None),
        ("all_reduce", S, 2 * ring, None), ("all_gather", gathered, (n - 1) * S, None),
        ("reduce_scatter", S, ring, None),
        ("barrier", 0, 0, None),
    ]


def test_records_count_payload_and_ring_wire_bytes(run):
    n, res, _ = run
    for rank, out in enumerate(res):
        recs = out["records"]
        assert [(r["op"], r["nbytes"], r["wire_bytes"], r["peer"]) for r in recs] == \
            _expected_records(n, rank)
        assert all(r["dim"] == "world" and r["dtype"] == "float32" for r in recs)
        assert all(r["start"] <= r["end"] for r in recs)  # every op, async ones too, ended
        assert recs[0]["shape"] == SHAPE and recs[2]["shape"] == (n * SHAPE[0], SHAPE[1])


def test_summary_adds_up_the_records(run):
    n, res, _ = run
    for out in res:
        log = CommLog(records=[CommRecord(**r) for r in out["records"]])
        assert out["summary"] == log.summary()  # the rank's summary, rebuilt here
        world = out["summary"]["world"]
        assert world["all_reduce"]["calls"] == 3
        assert world["all_reduce"]["bytes"] == 3 * S
        assert world["all_reduce"]["wire_bytes"] == 3 * 2 * (n - 1) * S // n
        assert (world["send"]["calls"], world["send"]["bytes"]) == (2, 2 * S)
        assert (world["recv"]["calls"], world["recv"]["wire_bytes"]) == (2, 0)
        assert all(s["seconds"] >= 0 for ops in out["summary"].values() for s in ops.values())
        assert log.total() == sum(r["wire_bytes"] for r in out["records"])
        assert log.total("nbytes", op="send") == 2 * S
        assert log.total(dim="tp") == 0


def test_a_bad_reduction_is_refused_and_not_logged(run):
    n, res, _ = run
    for out in res:
        assert "unknown reduction 'mean'" in out["bad_op"]
        assert out["records_after_bad_op"] == len(out["records"])


# --- groups: local ranks, a group of one ----------------------------------------------


def _pairs() -> dict:
    """Ranks {0, 2} and {1, 3} as two groups: local rank 1 is global rank 2 or 3."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates both
    comm = Comm(groups[rank % 2], "pair")
    t = torch.tensor([float(rank)])
    comm.broadcast(t, src=1)
    got = torch.zeros(1)
    if comm.rank == 0:
        comm.send(torch.tensor([10.0 * rank]), 1)
    else:
        comm.recv(got, 0)
    total = torch.tensor([float(rank)])
    comm.all_reduce(total)
    return {"ranks": comm.ranks, "local": comm.rank, "size": comm.size, "broadcast": t.item(),
            "got": got.item(), "sum": total.item(),
            "peers": [(r.op, r.peer) for r in comm.log.records if r.peer is not None]}


def test_ranks_given_to_a_group_are_local():
    res = launch(_pairs, 4, timeout=60)
    for rank, out in enumerate(res):
        ranks = [rank % 2, rank % 2 + 2]
        assert (out["ranks"], out["local"], out["size"]) == (ranks, rank // 2, 2)
        assert out["broadcast"] == ranks[1]  # local src 1 is the group's second rank
        assert out["sum"] == sum(ranks)
        if rank < 2:
            assert out["peers"] == [("send", ranks[1])]
        else:
            assert out["got"] == 10.0 * ranks[0] and out["peers"] == [("recv", ranks[0])]


def _alone() -> dict:
    comm = Comm()
    x = _input(0)
    t = x.clone()
    pending = comm.all_reduce(t, async_op=True)
    pending.wait()
    g, s = torch.empty(x.numel()), torch.empty(x.numel())
    comm.all_gather_into(g, x.reshape(-1))
    comm.reduce_scatter_into(s, x.reshape(-1))
    return {"same": [comm.all_gather(x) is x, comm.reduce_scatter(x) is x,
                     comm.broadcast(x) is x],
            "unchanged": [torch.equal(t, x), torch.equal(g, x.reshape(-1)),
                          torch.equal(s, x.reshape(-1))],
            "completed": pending.is_completed(), "records": len(comm.log.records)}


def test_a_group_of_one_moves_nothing():
    (out,) = launch(_alone, 1, timeout=60)
    assert out == {"same": [True] * 3, "unchanged": [True] * 3, "completed": True,
                   "records": 0}


# --- the log without processes ------------------------------------------------------------


def test_wire_bytes_formulas():
    for n in (2, 3, 4, 8):
        assert wire_bytes("all_reduce", 1024 * n, n) == 2 * (n - 1) * 1024
        assert wire_bytes("all_gather", 1024 * n, n) == (n - 1) * 1024
        assert wire_bytes("reduce_scatter", 1024 * n, n) == (n - 1) * 1024
        assert wire_bytes("broadcast", 1024, n) == wire_bytes("send", 1024, n) == 1024
        assert wire_bytes("recv", 1024, n) == 0
    assert all(wire_bytes(op, 1024, 1) == 0 for op in ("all_reduce", "broadcast", "send"))


def test_log_calls_its_hook_before_recording_and_can_be_disabled():
    seen: list[str] = []
    log = CommLog(on_enter=lambda rec: seen.append(rec.describe()))
    t = torch.zeros(3, 5, dtype=torch.bfloat16)
    rec = log.enter("all_reduce", "tp", t, 4)
    assert (rec.nbytes, rec.wire_bytes, rec.shape, rec.dtype) == (30, 45, (3, 5), "bfloat16")
    assert seen == ["all_reduce on tp, shape (3, 5) bfloat16"]
    assert log.enter("send", "pp", t, 2, peer=5).describe() == \
        "send on pp with rank 5, shape (3, 5) bfloat16"
    assert [r["op"] for r in log.to_dicts()] == ["all_reduce", "send"]
    log.enabled = False
    log.enter("all_gather", "dp", t, 2)
    assert len(log.records) == 2 and len(seen) == 3  # not recorded, still reported
    log.clear()
    assert log.records == [] and log.summary() == {} and log.total() == 0


@pytest.fixture
def imagined_world():
    """Rank 1 of 4 in this process, its three peers imagined (torch's "fake" backend,
    ``engine.imagine_peers``, as a rehearsal)."""
    assert not dist.is_initialized()
    imagine_peers(1, 4)
    try:
        yield Comm()
    finally:
        dist.destroy_process_group()


def test_imagined_peers_send_stand_ins_not_zeros(imagined_world):
    """Under the fake backend each op writes what real peers like this rank would have
    sent (a GPU multiplies zeros faster than values: a rehearsal's step would read
    fast), and the time it took is counted apart, step by step."""
    comm = imagined_world
    x = _input(1)
    assert comm.imagined
    assert torch.equal(comm.all_gather(x, dim=0), torch.cat([x] * 4))
    out = torch.zeros(4 * x.numel())
    comm.all_gather_into(out, x.reshape(-1), async_op=True).wait()
    assert torch.equal(out, x.reshape(-1).repeat(4))
    assert torch.equal(comm.reduce_scatter(x, dim=0), x[1:2])
    assert torch.equal(comm.reduce_scatter(x, dim=1), x[:, 2:4])
    shard = torch.zeros(x.numel() // 4)
    comm.reduce_scatter_into(shard, x.reshape(-1))
    assert torch.equal(shard, x.reshape(-1)[8:16])
    rows = comm.all_to_all(x, [1, 1, 1, 1], [2, 2, 1, 1])
    assert torch.equal(rows, x[torch.tensor([0, 1, 2, 3, 0, 1])])
    got = torch.zeros(SHAPE)
    comm.irecv(got, 0).wait()
    assert got.std() > 0.5 and torch.isfinite(got).all()
    header = torch.zeros(8, dtype=torch.long)
    comm.recv(header, 0)  # integers (a shape header) are left as they are
    assert not header.any()
    assert len(comm.log.step_stand_in_seconds) == 0
    comm.log.end_step()
    assert len(comm.log.step_stand_in_seconds) == 1
    assert comm.log.step_stand_in_seconds[0] > 0


def test_a_rehearsed_step_leaves_out_its_stand_ins():
    """``compute_seconds``: the median step after the first, less its stand-ins' time."""
    record = {"step_seconds": [9.0, 1.5, 1.7, 1.6], "stand_in_seconds": [0.5, 0.5, 0.6, 0.1]}
    assert _compute_seconds(record) == pytest.approx(1.1)
    assert _compute_seconds({"step_seconds": [9.0, 1.5, 1.7, 1.6]}) == 1.6
