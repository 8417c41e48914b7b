"""What ZeRO-3's weight all-gathers carry: the compute dtype, or float8.

``Zero3`` gathers each unit's flats just in time; a *gather format* decides what goes on
the wire, as ``offload.py``'s strategies decide where the masters live. ``InComputeDtype``
(the default) casts this rank's master shard into its own slot of the flat's buffer and
gathers in place, as FSDP2 does. ``Float8Weights`` sends the weights of tensorwise float8
linears (``parallel/fp8.py``) as e4m3 bytes: half of bf16's bytes, and no cast after the
gather. This is torchao's float8 all-gather for FSDP2 (``WeightWithDynamicFloat8CastTensor``,
``precompute_float8_dynamic_scale_for_fsdp``): each rank casts its shard with the scale
one device would use, the amax of the *whole* weight, so the gathered bytes are exactly
one device's float8 weight: the amaxes of a step's shards are all-reduced (max) over the
group once, at the first gather after the weights change (``publish``), and over the tp
group where tensor parallelism splits the weight. Rowwise weights are not gathered so (as
in torchao): their forward needs W scaled per row and their dx GEMM W^T per column, two
float8 copies; one gathered copy re-cast would round twice and differ from one device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from minipar.comm import Comm, Pending
from minipar.parallel.fp8 import E4M3, Float8Matmul, Scaled, scale_for, to_float8
from minipar.parallel.zero.shards import FlatParams


class InComputeDtype:
    """Every flat gathered in its compute dtype (``f.full``'s)."""

    def kind(self, name: str) -> str:
        """Weights of one kind share a flat (here: one kind)."""
        return ""

    def adopt(self, f: FlatParams) -> None:
        """A sharded flat was built (nothing to prepare here)."""

    def start(self, f: FlatParams, comm: Comm) -> Pending:
        """Cast this rank's shard into its slot of ``f.full`` and start the gather in
        place (OnDevice: no 16-bit shard is kept; OnHost: ``f.shard`` is its device copy)."""
        f.full.untyped_storage().resize_(f.padded * f.full.element_size())
        own = f.full[f.lo:f.hi]
        with torch.no_grad():
            own.copy_(f.shard)
        return comm.all_gather_into(f.full, own, async_op=True)

    def free(self, f: FlatParams) -> None:
        f.full.untyped_storage().resize_(0)

    def held(self, f: FlatParams) -> list[torch.Tensor]:
        """The gathered buffers of ``f`` (empty while it is free)."""
        return [f.full]

    def publish(self) -> None:
        """The masters changed (after a step, a load)."""


class Float8Weights(InComputeDtype):
    """The weights of tensorwise ``Float8Matmul``s gathered as e4m3 bytes, each into its
    matmul's ``weight8``; every other weight in the compute dtype.

    ``matmuls``: weight name -> its matmul (``fp8.float8_weights``). Their weights get
    flats of their own (``kind``); those flats' compute-dtype buffers are never filled
    (the weights' leaves keep their shapes for autograd, and their gradients flow as
    before: reduce-scattered in the gradient dtype).
    """

    def __init__(self, matmuls: dict[str, Float8Matmul]) -> None:
        if any(m.recipe != "tensorwise" for m in matmuls.values()):
            raise ValueError("float8 gathers need tensorwise scales (rowwise: see gather.py)")
        self.matmuls = matmuls
        self._flats: dict[int, tuple[FlatParams, torch.Tensor, torch.Tensor]] = {}
        self._stale = True  # scales are due before the next gather

    def kind(self, name: str) -> str:
        return "float8" if name in self.matmuls else ""

    def adopt(self, f: FlatParams) -> None:
        """A byte buffer for a float8 flat, and each matmul's ``weight8`` viewing it."""
        if self.kind(f.names[0]) != "float8":
            return
        wire = torch.empty(f.padded, dtype=torch.uint8, device=f.full.device)
        scales = torch.ones(len(f.names), dtype=torch.float32, device=f.full.device)
        for k, (name, shape, o, n) in enumerate(zip(f.names, f.shapes, f.offsets, f.numels)):
            self.matmuls[name].weight8 = Scaled(wire[o:o + n].view(E4M3).view(shape), scales[k])
        wire.untyped_storage().resize_(0)  # gathered when used
        self._flats[id(f)] = (f, wire, scales)

    def publish(self) -> None:
        self._stale = True

    def start(self, f: FlatParams, comm: Comm) -> Pending:
        if id(f) not in self._flats:
            return super().start(f, comm)
        if self._stale:  # the first gather after the weights changed: every rank's
            self._rescale(comm)
        _, wire, scales = self._flats[id(f)]
        wire.untyped_storage().resize_(f.padded)
        own = wire[f.lo:f.hi]
        shard = f.shard.to(f.full.dtype)  # the values one device's linear would cast
        with torch.no_grad():
            for k, a, b in f.owned():
                own[a:b].view(E4M3).copy_(to_float8(shard[a:b], scales[k], E4M3))
        return comm.all_gather_into(wire, own, async_op=True)

    def _rescale(self, comm: Comm) -> None:
        """Each weight's scale from its whole amax: one all-reduce (max) over ``comm`` of
        every float8 weight's shard amax, then one per tp group that splits weights."""
        flats = list(self._flats.values())
        amax = torch.cat([_shard_amax(f) for f, _, _ in flats]) if flats else None
        if amax is None:
            return
        comm.all_reduce(amax, op="max")
        names = [n for f, _, _ in flats for n in f.names]
        for group, rows in _by_group(self.matmuls[n].comm for n in names):
            part = amax[rows]
            group.all_reduce(part, op="max")
            amax[rows] = part
        new = scale_for(amax, E4M3)
        o = 0
        for _, _, scales in flats:
            scales.copy_(new[o:o + scales.numel()])
            o += scales.numel()
        self._stale = False

    def free(self, f: FlatParams) -> None:
        if id(f) in self._flats:
            self._flats[id(f)][1].untyped_storage().resize_(0)
        else:
            super().free(f)

    def held(self, f: FlatParams) -> list[torch.Tensor]:
        return [self._flats[id(f)][1]] if id(f) in self._flats else super().held(f)


def _shard_amax(f: FlatParams) -> torch.Tensor:
    """Per weight of ``f``, the largest |value| of its part in this rank's shard, in the
    compute dtype (0 where the shard holds none of it)."""
    amax = torch.zeros(len(f.names), dtype=torch.float32, device=f.shard.device)
    shard = f.shard.to(f.full.dtype)
    for k, a, b in f.owned():
        amax[k] = torch.linalg.vector_norm(shard[a:b], float("inf"), dtype=torch.float32)
    return amax


def _by_group(comms: Iterable[Comm | None]) -> list[tuple[Comm, torch.Tensor]]:
    """(tp group, positions of the weights it splits), one per group."""
    rows: dict[int, tuple[Comm, list[int]]] = {}
    for i, c in enumerate(comms):
        if c is not None and c.size > 1:
            rows.setdefault(id(c), (c, []))[1].append(i)
    return [(c, torch.tensor(r)) for c, r in rows.values()]
