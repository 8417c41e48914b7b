"""The device mesh: which rank plays which role, and the process groups that follow.

A run of ``dp * pp * tp * cp`` ranks is a 4-D grid. Every rank has coordinates
``(dp, pp, tp, cp)`` and belongs to one group per dimension: the ranks that differ
from it in that coordinate only. Tensor-parallel partners exchange activations in every
layer, so they must be neighbours (same node, fastest links): tp varies fastest in the
rank numbering. Context-parallel partners (the sequence split, ``parallel/cp.py``) pass
key/value blocks around a ring in every layer: they come next. What follows is a
convention:

* ``order="megatron"`` (default, Megatron-Core and torchtitan): rank = (pp, dp, cp, tp)
  with tp fastest, then cp, dp, pp outermost. Data-parallel replicas of one stage sit
  close.
* ``order="pp-inside-dp"`` (picotron, some tutorials): rank = (dp, pp, cp, tp). One whole
  pipeline replica is a block of consecutive ranks.

``cp`` is keyword-only (``Mesh(2, 2, 2, cp=2)``): ``Mesh(dp, pp, tp, order)`` keeps
meaning what it always did. Weights are replicated over cp as over dp, so their
gradients are summed over both: the *dp_cp group* (the ranks that differ only in dp and
cp) is where the data-parallel layer reduces and shards (as Megatron-Core's
distributed optimizer does over its data-parallel-with-context-parallel group).

``Mesh`` is pure layout, usable without any process (the lessons draw it). Inside a run,
``Mesh.connect(rank)`` creates the process groups and returns a ``RankMesh``. Nothing
here is global: the mesh is passed to whatever needs it. One more group, not a
dimension: the *embedding group* (the first and last pp ranks of one dp/tp coordinate),
where a tied embedding's two copies sum their gradients (Megatron-LM, 1909.08053).

Expert parallelism (``ep``, keyword-only) is not a fifth dimension of ranks: it splits
the dp coordinate, dp = (dp // ep) x ep with ep fastest (Megatron-Core's and
torchtitan's placement). The *ep group* (ranks differing only in that inner digit) holds
one MoE layer's experts between them; the *edp group* (same ep digit, any other dp and
cp coordinate) holds the replicas of one expert, where its gradients are summed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch.distributed as dist

from minipar.comm import Comm, CommLog

DIMS = ("dp", "pp", "tp", "cp")
ORDERS = {
    # slowest -> fastest varying coordinate
    "megatron": ("pp", "dp", "cp", "tp"),
    "pp-inside-dp": ("dp", "pp", "cp", "tp"),
}


def _check_size(name: str, size: object) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"mesh size {name}={size!r} must be a positive integer")


class Coords(NamedTuple):
    dp: int
    pp: int
    tp: int
    cp: int = 0


@dataclass(frozen=True)
class Mesh:
    """A dp x pp x tp x cp layout of ``world_size`` ranks (``cp`` keyword-only)."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    order: str = "megatron"
    cp: int = field(default=1, kw_only=True)
    ep: int = field(default=1, kw_only=True)  # expert parallel: a split of dp

    def __post_init__(self) -> None:
        for name in (*DIMS, "ep"):
            _check_size(name, getattr(self, name))
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp} (experts are split "
                             "over ranks of the data-parallel group)")
        if self.order not in ORDERS:
            raise ValueError(f"unknown rank order {self.order!r}; choose one of {list(ORDERS)}")

    @classmethod
    def for_world(cls, world_size: int, dp: int | None = None, pp: int = 1, tp: int = 1,
                  order: str = "megatron", cp: int = 1) -> Mesh:
        """A mesh filling ``world_size``; dp defaults to what pp, tp and cp leave."""
        for name, size in (("pp", pp), ("tp", tp), ("cp", cp)):
            _check_size(name, size)
        rest = pp * tp * cp
        if world_size % rest:
            what = "pp*tp" if cp == 1 else "pp*tp*cp"
            raise ValueError(f"world size {world_size} is not divisible by {what}={rest}")
        dp = world_size // rest if dp is None else dp
        mesh = cls(dp, pp, tp, order, cp=cp)
        if mesh.world_size != world_size:
            raise ValueError(
                f"layout {mesh.layout_name()} = {mesh.world_size} ranks "
                f"does not match world size {world_size}"
            )
        return mesh

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    def layout_name(self) -> str:
        """``dp=2 x pp=2 x tp=2`` (and ``x cp=C`` when cp > 1)."""
        dims = DIMS if self.cp > 1 else DIMS[:3]
        return " x ".join(f"{d}={getattr(self, d)}" for d in dims)

    @property
    def shape(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in DIMS}

    def coords(self, rank: int) -> Coords:
        """Coordinates of a global rank (mixed-radix digits, fastest dimension last)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        digits = {}
        for name in reversed(ORDERS[self.order]):
            size = getattr(self, name)
            digits[name] = rank % size
            rank //= size
        return Coords(**digits)

    def rank(self, dp: int = 0, pp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """The global rank at the given coordinates."""
        coords = {"dp": dp, "pp": pp, "tp": tp, "cp": cp}
        for name, c in coords.items():
            if not 0 <= c < getattr(self, name):
                raise ValueError(f"coordinate {name}={c} is outside 0..{getattr(self, name) - 1}")
        rank = 0
        for name in ORDERS[self.order]:
            rank = rank * getattr(self, name) + coords[name]
        return rank

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """The ranks that share every coordinate with ``rank`` except ``dim``."""
        c = self.coords(rank)._asdict()
        return [self.rank(**{**c, dim: i}) for i in range(getattr(self, dim))]

    def dp_cp_ranks(self, rank: int) -> list[int]:
        """The ranks that share ``rank``'s pp and tp coordinates: its replicas over dp and
        cp, ordered by (dp, cp) with cp fastest. Where the data-parallel layer sums."""
        c = self.coords(rank)
        return [self.rank(d, c.pp, c.tp, k) for d in range(self.dp) for k in range(self.cp)]

    def ep_ranks(self, rank: int) -> list[int]:
        """The expert-parallel group of ``rank``: the ep ranks of its dp block (dp
        coordinates ep * (d // ep) + j), everything else equal. Ordered by ep rank."""
        c = self.coords(rank)
        first = c.dp - c.dp % self.ep
        return [self.rank(first + j, c.pp, c.tp, c.cp) for j in range(self.ep)]

    def edp_ranks(self, rank: int) -> list[int]:
        """The replicas of ``rank``'s experts: the same ep digit and pp, tp coordinates,
        any other dp and cp; ordered by (dp, cp). All of dp x cp when ep = 1."""
        c = self.coords(rank)
        return [self.rank(d, c.pp, c.tp, k) for d in range(c.dp % self.ep, self.dp, self.ep)
                for k in range(self.cp)]

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of one dimension (or dp_cp, ep, edp), each a list of global
        ranks, ordered."""
        seen: dict[tuple[int, ...], None] = {}
        special = {"dp_cp": self.dp_cp_ranks, "ep": self.ep_ranks, "edp": self.edp_ranks}
        ranks_of = special.get(dim) or (lambda r: self.group_ranks(dim, r))
        for r in range(self.world_size):
            seen.setdefault(tuple(ranks_of(r)), None)
        return [list(g) for g in seen]

    def table(self) -> list[dict]:
        """One row per rank: coordinates and the group (by its first rank) of each dim."""
        rows = []
        for r in range(self.world_size):
            row = {"rank": r, **self.coords(r)._asdict()}
            for d in DIMS:
                row[f"{d}_group"] = self.group_ranks(d, r)
            rows.append(row)
        return rows

    def embedding_group(self, rank: int) -> list[int]:
        """The first and last pp ranks with ``rank``'s dp, tp and cp coordinates: where a
        tied embedding lives twice (Megatron's embedding group). One rank when pp = 1;
        [] for a rank of a middle stage."""
        c = self.coords(rank)
        ends = sorted({0, self.pp - 1})
        return [self.rank(c.dp, p, c.tp, c.cp) for p in ends] if c.pp in ends else []

    def embedding_groups(self) -> list[list[int]]:
        """Every embedding group, in rank order of their first member."""
        return [g for g in dict.fromkeys(tuple(self.embedding_group(r))
                                         for r in range(self.world_size)) if g]

    def describe(self) -> str:
        """A printable table of the layout."""
        dims = DIMS if self.cp > 1 else DIMS[:3]  # the cp columns only when there is cp
        head = f"{'rank':>4} " + " ".join(f"{d:>3}" for d in dims) + "  " + "  ".join(
            f"{d + ' group':<11}" for d in dims)
        lines = [head.rstrip()]
        for row in self.table():
            lines.append(
                f"{row['rank']:>4} " + " ".join(f"{row[d]:>3}" for d in dims) + "  "
                + "  ".join(f"{str(row[d + '_group']):<11}" for d in dims)
            )
        return "\n".join(lines)

    def connect(self, rank: int | None = None, log: CommLog | None = None,
                separate_reductions: bool = False) -> RankMesh:
        """Create the process groups (collectively, on every rank) for this rank.

        ``torch.distributed.new_group`` must be called by every rank for every group, in
        the same order, even for groups the rank is not in; that is why we loop over all.
        ``separate_reductions``: a second group over each dp x cp group's ranks, for
        ZeRO-3's reduce-scatters (``RankMesh.reductions``).
        """
        if not dist.is_initialized():
            raise RuntimeError("Mesh.connect needs torch.distributed to be initialised "
                               "(run inside minipar.launch or torchrun)")
        world = dist.get_world_size()
        if world != self.world_size:
            raise ValueError(f"mesh {self.shape} needs {self.world_size} ranks, "
                             f"the job has {world}")
        rank = dist.get_rank() if rank is None else rank
        log = CommLog() if log is None else log
        comms = {}
        # dp_cp is its own (counted) group only when there is cp; else it is dp itself
        for dim in (*DIMS, "dp_cp") if self.cp > 1 else DIMS:
            for ranks in self.groups(dim):
                group = dist.new_group(ranks) if len(ranks) < world else dist.group.WORLD
                if rank in ranks:
                    comms[dim] = Comm(group, dim, log, ranks)
        comms.setdefault("dp_cp", comms["dp"])
        if separate_reductions:  # its own communicator even over the whole world (never
            # WORLD: that is one already); counted as the dp x cp group's traffic
            for ranks in self.groups("dp_cp" if self.cp > 1 else "dp"):
                group = dist.new_group(ranks)
                if rank in ranks:
                    comms["reductions"] = Comm(group, comms["dp_cp"].dim, log, ranks)
        for dim in ("ep", "edp") if self.ep > 1 else ():  # (ep = 1: no experts split)
            for ranks in self.groups(dim):
                group = dist.new_group(ranks) if len(ranks) < world else dist.group.WORLD
                if rank in ranks:
                    comms[dim] = Comm(group, dim, log, ranks)
        # pp = 1: one weight, no copies to sum, no group
        for ranks in map(list, self.embedding_groups() if self.pp > 1 else []):
            group = dist.new_group(ranks) if len(ranks) < world else dist.group.WORLD
            if rank in ranks:
                comms["embed"] = Comm(group, "embed", log, ranks)
        world_comm = Comm(dist.group.WORLD, "world", log, list(range(world)))
        return RankMesh(self, rank, self.coords(rank), comms, world_comm, log,
                        rehearsal=dist.get_backend() == "fake")


@dataclass
class RankMesh:
    """One rank's view of a connected mesh: its coordinates and a counted Comm per dim."""

    mesh: Mesh
    rank: int
    coords: Coords
    comms: dict[str, Comm]
    world: Comm
    log: CommLog = field(repr=False)
    # a rehearsal (``engine.rehearse``): this rank alone, its peers imagined by torch's
    # "fake" process group, whose collectives move nothing; what a peer would have sent
    # (a pipeline's shape header) must then be known instead
    rehearsal: bool = False

    @property
    def dp(self) -> Comm:
        return self.comms["dp"]

    @property
    def pp(self) -> Comm:
        return self.comms["pp"]

    @property
    def tp(self) -> Comm:
        return self.comms["tp"]

    @property
    def cp(self) -> Comm:
        """The context-parallel group: the ring of ranks sharing one sequence."""
        return self.comms["cp"]

    @property
    def dp_cp(self) -> Comm:
        """dp x cp: the replicas of this rank's weights; the data-parallel layer's group
        (the same group as ``dp`` when cp = 1)."""
        return self.comms["dp_cp"]

    @property
    def reductions(self) -> Comm:
        """Where ZeRO-3 reduce-scatters its gradients: ``dp_cp`` itself, or a second
        communicator over the same ranks (``connect(separate_reductions=True)``). NCCL
        runs one collective at a time per communicator, so on one a unit's reduce-scatter
        queues ahead of the next unit's all-gather, which the backward waits for; on two
        they run side by side (FSDP2's ``set_separate_reduce_scatter_group``, fairscale's
        ``process_group_reduce_scatter``). Counted as ``dp_cp``'s traffic."""
        return self.comms.get("reductions", self.dp_cp)

    @property
    def ep(self) -> Comm | None:
        """The expert-parallel group (the ranks sharing one MoE layer's experts); None
        when ep = 1."""
        return self.comms.get("ep")

    @property
    def edp(self) -> Comm:
        """Where an expert's gradients are summed: its replicas (``dp_cp`` when ep = 1)."""
        return self.comms.get("edp", self.comms["dp_cp"])

    @property
    def embed(self) -> Comm | None:
        """The embedding group (first and last stage), None on a middle stage."""
        return self.comms.get("embed")
