"""Cases for the mesh coordinates exercise (lesson 06): every (dp, pp, tp) with at
most 16 ranks, both orders, every rank, against ``minipar.mesh.Mesh``."""

from __future__ import annotations

import importlib

from minipar.mesh import DIMS, ORDERS, Mesh

from ..check import expect


def run(impl: str, timeout: float) -> str:
    mod = importlib.import_module(f"{impl}.mesh_coords")
    layouts = [(d, p, t) for d in range(1, 17) for p in range(1, 17) for t in range(1, 17)
               if d * p * t <= 16]
    for order in ORDERS:
        for d, p, t in layouts:
            mesh = Mesh(d, p, t, order)
            # coords and rank on every rank before any group: a group is built from
            # both, so a wrong rank would otherwise be reported as a wrong group
            for r in range(mesh.world_size):
                where = f"rank {r} of dp={d}, pp={p}, tp={t}, order={order!r}"
                want = tuple(mesh.coords(r))[:3]  # (dp, pp, tp); cp = 1 here
                got = mod.coords(r, d, p, t, order)
                expect(tuple(got) == want, f"coords: {where} is {got}; expected {want}",
                       "megatron digits are (pp, dp, tp), pp-inside-dp (dp, pp, tp), slowest "
                       "first; the last (tp) is rank % tp")
                back = mod.rank(want, d, p, t, order)
                expect(back == r, f"rank({want}) for dp={d}, pp={p}, tp={t}, order={order!r} "
                       f"is {back}; expected {r}", "rank must undo coords")
            for r in range(mesh.world_size):
                where = f"rank {r} of dp={d}, pp={p}, tp={t}, order={order!r}"
                for dim in DIMS[:3]:  # the exercise's three dimensions
                    g = list(mod.group(dim, r, d, p, t, order))
                    expect(g == mesh.group_ranks(dim, r),
                           f"group({dim!r}) of {where} is {g}; expected "
                           f"{mesh.group_ranks(dim, r)}",
                           "vary only that coordinate, from 0 up, keeping the other two")
    return f"{len(layouts)} layouts x 2 orders: coords, rank and groups agree with Mesh"
