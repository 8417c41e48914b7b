"""Cases for the deadlock lab (lesson 00): ``shift_right`` on 2, 3 and 4 ranks must finish
and move every tensor one rank to the right, with point-to-point messages only."""

from __future__ import annotations

import importlib

import torch

from minipar.comm import Comm
from minipar.launch import launch

from ..check import expect


def _rank(impl: str) -> dict:
    mod = importlib.import_module(f"{impl}.debug_deadlock")
    comm = Comm()
    got = mod.shift_right(comm, torch.full((3,), float(comm.rank)))
    return {"got": got.tolist(), "ops": sorted({r.op for r in comm.log.records})}


def run(impl: str, timeout: float) -> str:
    for n in (2, 3, 4):
        for rank, out in enumerate(launch(_rank, n, args=(impl,), timeout=timeout)):
            left = (rank - 1) % n
            expect(out["got"] == [float(left)] * 3,
                   f"on {n} ranks, rank {rank} expected rank {left}'s tensor "
                   f"{[float(left)] * 3}, got {out['got']}",
                   "receive from the left neighbour, send to the right one")
            expect(set(out["ops"]) <= {"send", "recv"},
                   f"on {n} ranks, rank {rank} used {out['ops']}", "send/recv only")
    return "2, 3 and 4 ranks: every tensor moved one rank to the right, no hang"
