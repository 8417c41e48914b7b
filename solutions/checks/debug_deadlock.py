"""Cases for the deadlock lab (lesson 00): every ring move of ``debug_deadlock`` on 2, 3
and 4 ranks must finish and leave on each rank what its definition says, with
point-to-point messages only. The moves run one launch each on 3 ranks, in the order a
ring algorithm builds on them, so a hang report names the move that was running (a
symptom: which of its lines left the ranks waiting is for the learner to find)."""

from __future__ import annotations

import importlib

import torch

from minipar.comm import Comm
from minipar.launch import RankTimeout, launch

from ..check import CheckFailure, expect

MOVES = ("shift_right", "ring_all_gather", "ring_sum", "shift_left")


def _rank(impl: str, moves: tuple[str, ...]) -> dict:
    mod = importlib.import_module(f"{impl}.debug_deadlock")
    comm = Comm()
    t = torch.full((3,), float(2 ** comm.rank))
    got = {}
    for move in moves:
        out = getattr(mod, move)(comm, t)
        got[move] = [x.tolist() for x in out] if isinstance(out, list) else out.tolist()
    return {"got": got, "ops": sorted({r.op for r in comm.log.records})}


def _expected(move: str, rank: int, n: int):
    value = {"shift_right": 2.0 ** ((rank - 1) % n), "shift_left": 2.0 ** ((rank + 1) % n),
             "ring_sum": float(2 ** n - 1)}
    if move == "ring_all_gather":
        return [[2.0 ** r] * 3 for r in range(n)]
    return [value[move]] * 3


def _verify(outs: list[dict], moves: tuple[str, ...], n: int) -> None:
    for rank, out in enumerate(outs):
        for move in moves:
            want = _expected(move, rank, n)
            expect(out["got"][move] == want,
                   f"{move} on {n} ranks: rank {rank} expected {want}, got {out['got'][move]}",
                   f"rank r starts with 2**r everywhere: read the got value as the ranks "
                   f"it came from, and follow {move}'s messages")
        expect(set(out["ops"]) <= {"send", "recv"},
               f"on {n} ranks, rank {rank} used {out['ops']}", "send/recv only")


def run(impl: str, timeout: float) -> str:
    done: list[str] = []
    for move in MOVES:
        try:
            outs = launch(_rank, 3, args=(impl, (move,)), timeout=timeout)
        except RankTimeout as exc:
            where = "; ".join(line.strip() for line in str(exc).splitlines()[1:-1])
            before = f"{', '.join(done)} finished; then " if done else ""
            raise CheckFailure(
                f"on 3 ranks, {before}{move} hung ({where})",
                "some rank waits for a message that its partner never posts: note which "
                f"call each rank is inside and with whom, then follow {move}'s code down "
                "to the calls it makes, in the order every rank makes them") from None
        _verify(outs, (move,), 3)
        done.append(move)
    for n in (2, 4):
        _verify(launch(_rank, n, args=(impl, MOVES), timeout=timeout), MOVES, n)
    return "every move on 2, 3 and 4 ranks: the right tensors, no hang"
