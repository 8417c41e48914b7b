"""The mesh (minipar/mesh.py): rank <-> coordinates, groups, errors, process groups.

The oracle for the layout is an enumeration, not arithmetic: list every coordinate
triple in the order's nesting (slowest dimension outermost, as nested loops would) and
call the position in that list the rank. The mesh's mixed-radix arithmetic must agree.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from minipar.launch import launch
from minipar.mesh import DIMS, ORDERS, Mesh

ORDER_NAMES = list(ORDERS)
DIMS3 = ("dp", "pp", "tp")  # the dimensions of size 2 in the 8-rank connect test


def all_meshes(max_world: int = 8):
    """Every (dp, pp, tp) factorisation of 1..max_world, in both rank orders."""
    for world in range(1, max_world + 1):
        for dp, pp in itertools.product(range(1, world + 1), repeat=2):
            if world % (dp * pp) == 0:
                for order in ORDER_NAMES:
                    yield Mesh(dp, pp, world // (dp * pp), order)


def enumerated(mesh: Mesh) -> list[dict[str, int]]:
    """The oracle: coordinates in rank order, by nested loops (slowest dim outermost)."""
    names = ORDERS[mesh.order]
    return [dict(zip(names, c)) for c in
            itertools.product(*(range(getattr(mesh, n)) for n in names))]


MESHES = list(all_meshes())


def test_every_factorisation_is_covered():
    # 1..8 have 1, 3, 3, 6, 3, 9, 3, 10 ordered factorisations into three factors.
    assert len(MESHES) == 2 * (1 + 3 + 3 + 6 + 3 + 9 + 3 + 10)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_coords_and_rank_round_trip(mesh):
    oracle = enumerated(mesh)
    assert len(oracle) == mesh.world_size
    for rank, coords in enumerate(oracle):
        assert mesh.coords(rank)._asdict() == coords
        assert mesh.rank(**coords) == rank


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_groups_differ_in_one_coordinate_and_partition_the_world(mesh):
    oracle = enumerated(mesh)
    for dim in DIMS:
        groups = mesh.groups(dim)
        assert sorted(r for g in groups for r in g) == list(range(mesh.world_size))
        assert all(len(g) == getattr(mesh, dim) for g in groups)
        for rank in range(mesh.world_size):
            others = {d: c for d, c in oracle[rank].items() if d != dim}
            expected = [r for r, c in enumerate(oracle)
                        if all(c[d] == v for d, v in others.items())]
            assert mesh.group_ranks(dim, rank) == expected  # ordered by ``dim``'s coord
            assert [oracle[r][dim] for r in expected] == list(range(getattr(mesh, dim)))


def test_megatron_order_puts_tp_neighbours_together_and_pp_outermost():
    mesh = Mesh(dp=2, pp=2, tp=2)
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_pp_inside_dp_order_makes_each_pipeline_a_block():
    mesh = Mesh(dp=2, pp=2, tp=2, order="pp-inside-dp")
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for d in range(2):  # replica d is ranks 4d .. 4d+3
        assert {r for r in range(8) if mesh.coords(r).dp == d} == set(range(4 * d, 4 * d + 4))


def test_table_and_describe_agree_with_coords():
    mesh = Mesh(dp=2, pp=1, tp=2)
    rows = mesh.table()
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        assert (row["dp"], row["pp"], row["tp"], row["cp"]) == tuple(mesh.coords(row["rank"]))
        assert row["tp_group"] == mesh.group_ranks("tp", row["rank"])
    lines = mesh.describe().splitlines()
    assert len(lines) == 1 + mesh.world_size and lines[0].split()[:4] == ["rank", "dp", "pp", "tp"]


@pytest.mark.parametrize("kwargs, match", [
    ({"dp": 0}, "dp=0"),
    ({"pp": -2}, "pp=-2"),
    ({"tp": 2.0}, "tp=2.0"),
    ({"dp": True}, "dp=True"),
    ({"order": "tp-outermost"}, "unknown rank order"),
])
def test_invalid_shapes_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Mesh(**kwargs)


def test_out_of_range_ranks_and_coordinates_are_refused():
    mesh = Mesh(dp=2, pp=2, tp=2)
    for bad in (-1, 8):
        with pytest.raises(ValueError, match="outside a world of 8"):
            mesh.coords(bad)
    with pytest.raises(ValueError, match="pp=2 is outside 0..1"):
        mesh.rank(pp=2)
    with pytest.raises(ValueError, match="tp=-1"):
        mesh.rank(tp=-1)


def test_for_world_fills_dp_and_reports_mismatches():
    assert Mesh.for_world(8, pp=2, tp=2) == Mesh(2, 2, 2)
    assert Mesh.for_world(6, tp=3, order="pp-inside-dp") == Mesh(2, 1, 3, "pp-inside-dp")
    with pytest.raises(ValueError, match="not divisible by pp\\*tp=3"):
        Mesh.for_world(8, pp=3)
    with pytest.raises(ValueError, match="= 6 ranks does not match world size 8"):
        Mesh.for_world(8, dp=3, pp=2)
    with pytest.raises(ValueError, match="pp=0"):
        Mesh.for_world(8, pp=0)


def test_connect_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed"):
        Mesh(2).connect()


# --- connect(): real process groups on 8 ranks -------------------------------------------


def _connect_and_reduce(order: str) -> dict:
    try:
        Mesh(2, 2, 1).connect()  # 4 ranks' worth of mesh in a job of 8
        wrong_world = ""
    except ValueError as e:
        wrong_world = str(e)
    rm = Mesh(2, 2, 2, order).connect()
    out = {"rank": rm.rank, "coords": tuple(rm.coords), "wrong_world": wrong_world,
           "world": (rm.world.size, rm.world.rank, rm.world.ranks)}
    for dim in DIMS3:
        comm = rm.comms[dim]
        t = torch.tensor([float(rm.rank)])
        comm.all_reduce(t)
        out[dim] = (comm.size, comm.rank, comm.ranks, comm.dim, t.item())
    t = torch.tensor([float(rm.rank)])
    rm.embed.all_reduce(t)  # pp = 2: every rank is on the first or the last stage
    out["embed"] = (rm.embed.ranks, rm.embed.dim, t.item())
    out["logged"] = sorted({(r.op, r.dim) for r in rm.log.records})
    return out


@pytest.mark.parametrize("order", ORDER_NAMES)
def test_connect_gives_each_rank_its_groups(order):
    mesh = Mesh(2, 2, 2, order)
    results = launch(_connect_and_reduce, 8, args=(order,), timeout=60)
    for rank, res in enumerate(results):
        assert res["rank"] == rank and res["coords"] == tuple(mesh.coords(rank))
        assert "needs 4 ranks, the job has 8" in res["wrong_world"]
        assert res["world"] == (8, rank, list(range(8)))
        for dim in DIMS3:
            size, local, ranks, name, total = res[dim]
            assert ranks == mesh.group_ranks(dim, rank) and size == 2 and name == dim
            assert local == ranks.index(rank) == getattr(mesh.coords(rank), dim)
            assert total == sum(ranks)  # the all-reduce really ran on that group
        ranks, name, total = res["embed"]
        assert ranks == mesh.embedding_group(rank) and name == "embed" and total == sum(ranks)
        assert res["logged"] == [("all_reduce", d) for d in sorted((*DIMS3, "embed"))]


@pytest.mark.parametrize("order", ORDER_NAMES)
def test_embedding_groups_join_first_and_last_stage_of_each_dp_tp_coordinate(order):
    """Megatron's embedding group: where a tied embedding's two copies sum gradients."""
    mesh = Mesh(2, 4, 2, order)
    groups = mesh.embedding_groups()
    assert len(groups) == mesh.dp * mesh.tp
    for group in groups:
        first, last = (mesh.coords(r) for r in group)
        assert (first.pp, last.pp) == (0, 3)
        assert (first.dp, first.tp) == (last.dp, last.tp)
    middle = [r for r in range(mesh.world_size) if mesh.coords(r).pp in (1, 2)]
    assert all(mesh.embedding_group(r) == [] for r in middle)
    assert Mesh(2, 1, 2).embedding_group(3) == [3]  # pp = 1: one weight, nothing to sum


@pytest.mark.parametrize("order", ORDER_NAMES)
def test_cp_sits_between_tp_and_dp(order):
    """Megatron-Core's order: tp fastest, then cp, then dp (pp-inside-dp keeps cp next
    to tp too); every coordinate round-trips and dp_cp joins the replicas of a weight."""
    mesh = Mesh(2, 2, 2, order, cp=2)
    assert mesh.world_size == 16 and mesh.shape == {"dp": 2, "pp": 2, "tp": 2, "cp": 2}
    oracle = enumerated(mesh)
    for rank, coords in enumerate(oracle):
        assert mesh.coords(rank)._asdict() == coords and mesh.rank(**coords) == rank
    assert mesh.group_ranks("cp", 0) == [0, 2]  # next after the tp pair
    assert mesh.group_ranks("tp", 0) == [0, 1]
    for r in range(16):
        c = mesh.coords(r)
        group = mesh.dp_cp_ranks(r)
        assert len(group) == 4 and r in group
        assert {(mesh.coords(g).pp, mesh.coords(g).tp) for g in group} == {(c.pp, c.tp)}
    groups = mesh.groups("dp_cp")  # one per (pp, tp): a partition of the world
    assert len(groups) == 4 and sorted(r for g in groups for r in g) == list(range(16))
    assert Mesh.for_world(8, tp=2, cp=2) == Mesh(2, 1, 2, cp=2)
    head = mesh.describe().splitlines()[0].split()
    assert head[:5] == ["rank", "dp", "pp", "tp", "cp"] and "cp" in head[5:]


def _connect_cp() -> dict:
    rm = Mesh(2, 1, 1, cp=2).connect()
    out = {}
    for name in ("cp", "dp", "dp_cp"):
        t = torch.tensor([float(rm.rank)])
        getattr(rm, name).all_reduce(t)
        out[name] = (getattr(rm, name).ranks, getattr(rm, name).dim, t.item())
    return out


def test_connect_builds_counted_cp_and_dp_cp_groups():
    results = launch(_connect_cp, 4, timeout=60)
    mesh = Mesh(2, 1, 1, cp=2)
    for rank, res in enumerate(results):
        assert res["cp"] == (mesh.group_ranks("cp", rank), "cp", sum(res["cp"][0]))
        assert res["dp"][0] == mesh.group_ranks("dp", rank)
        assert res["dp_cp"] == ([0, 1, 2, 3], "dp_cp", 6.0)


def _connect_reductions(cp: int, separate: bool) -> dict:
    rm = Mesh(2, 2, 1, cp=cp).connect(separate_reductions=separate)
    t = torch.tensor([float(rm.rank)])
    rm.reductions.all_reduce(t)
    return {"ranks": rm.reductions.ranks, "dim": rm.reductions.dim, "sum": t.item(),
            "own": rm.reductions.group is not rm.dp_cp.group,
            "logged": sorted({(r.op, r.dim) for r in rm.log.records})}


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("separate", [False, True])
def test_reductions_get_a_communicator_of_their_own_over_the_same_ranks(cp, separate):
    """``separate_reductions``: a second group over each dp x cp group (ZeRO-3's
    reduce-scatters run beside its all-gathers), counted as that group's traffic;
    without it, the reductions' group is dp_cp itself."""
    mesh = Mesh(2, 2, 1, cp=cp)
    results = launch(_connect_reductions, mesh.world_size, args=(cp, separate), timeout=60)
    dim = "dp_cp" if cp > 1 else "dp"
    for rank, res in enumerate(results):
        ranks = mesh.dp_cp_ranks(rank)
        assert res["ranks"] == ranks and res["sum"] == sum(ranks)
        assert res["own"] is separate and res["dim"] == dim
        assert res["logged"] == [("all_reduce", dim)]
