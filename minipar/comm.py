"""Counted communication: every collective and point-to-point call the engine makes.

Each call goes through a ``Comm`` (one process group, named by its mesh dimension) and
lands in a ``CommLog`` as a ``CommRecord``: the op, the dimension, the payload bytes,
the bytes a ring algorithm puts on the wire from this rank, and when it started and
ended. Runs report the log; the theory predicts it; the lessons show both.

Wire bytes per rank for a group of N ranks and a payload of S bytes (ring algorithms,
as NCCL and gloo use for large messages; Patarasuk & Yuan 2009):

* all-reduce: 2 (N-1)/N * S   (a reduce-scatter then an all-gather)
* all-gather: (N-1)/N * S     (S = the gathered output)
* reduce-scatter: (N-1)/N * S (S = the full input)
* broadcast: S (pipelined ring: every rank but the last forwards it once)
* all-to-all: the bytes this rank sends to the others (its own rows stay)
* send: S; recv: 0

The torch-version differences live here and nowhere else: torch 2.13 deprecates
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of ``*_single``,
which torch 2.11 (on the GPU machines) does not have.

Before each call the log tells the launcher which op this rank entered (through the
hooks a launched rank installs, ``RANK_HOOKS``), so a hang is reported as "rank 3
waits in all_reduce on tp, shape (64, 64)" instead of silence.

Several ranks on one GPU (``--backend gloo --device cuda``; NCCL refuses two ranks on
one device): gloo moves host memory, and handles CUDA tensors only in all_reduce and
broadcast (torch.distributed's backend table; all_gather and send of a CUDA tensor kill
the rank). So under gloo every CUDA tensor is *staged*: copied to the host, sent, and
the result copied back (when an async op is waited on). Counted bytes are unchanged.
The other way round, NCCL moves device memory only: a host tensor (a checkpoint's
gathered state) is staged on this rank's GPU.

**Imagined peers** (a rehearsal, ``engine.rehearse``: torch's "fake" backend, whose
collectives complete at once and write nothing). An output left as it was holds zeros
or stale bytes, and a GPU multiplies zeros faster than trained values (the chip draws
less power and keeps its clock; ``benchmarks/gemm_values.py`` measures by how much),
so a rehearsed step would read fast. Each imagined op therefore writes a *stand-in*
for what the peers would have sent: an all-gather a copy of this rank's own shard in
every peer's place, a reduce-scatter this rank's own slice, an all-to-all this rank's
own rows, a receive (which has no local twin) values drawn from N(0, 1). The stand-ins'
own time is counted apart (``CommLog.step_stand_in_seconds``), so that the rehearsed
compute can leave it out: a real collective writes its output on its own stream.
"""

from __future__ import annotations

import time
from array import array
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

# The hooks a new ``CommLog`` starts with. A rank that ``minipar.launch`` started sets
# them to its status reporters (``rank.child``), so a hang names the op each rank waits
# in; anywhere else (a notebook, torchrun) there are none.
RANK_HOOKS: dict[str, Callable | None] = {"on_enter": None, "on_exit": None}

# --- the one place that knows torch versions -----------------------------------------
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = (getattr(dist, "reduce_scatter_single", None)
                        or dist.reduce_scatter_tensor)

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _reduce_op(op: str):
    try:
        return REDUCE_OPS[op]
    except KeyError:
        raise ValueError(f"unknown reduction {op!r}; use one of {list(REDUCE_OPS)} "
                         "(average by dividing after a sum)") from None


def wire_bytes(op: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends for ``op`` on ``n`` ranks with payload ``nbytes`` (ring; an
    all-to-all split evenly keeps 1/n of its payload)."""
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * nbytes // n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * nbytes // n
    if op in ("broadcast", "send"):
        return nbytes
    return 0


@dataclass
class CommRecord:
    op: str
    dim: str
    nbytes: int
    wire_bytes: int
    shape: tuple[int, ...]
    dtype: str
    start: float
    end: float = float("nan")
    peer: int | None = None  # global rank on the other side of a send / recv
    sent_to: tuple[int, ...] | None = None  # all_to_all: bytes to each rank of the group

    def describe(self) -> str:
        peer = f" with rank {self.peer}" if self.peer is not None else ""
        return f"{self.op} on {self.dim}{peer}, shape {tuple(self.shape)} {self.dtype}"


@dataclass
class CommLog:
    """A rank's record of everything it communicated.

    ``on_enter`` is called with each record before the op runs, ``on_exit`` once it is
    over; the launcher uses them to say where a rank is stuck (inside an op, or after).
    Set ``enabled=False`` to stop recording (for benchmarks of the recording itself).

    **Bounded over long runs.** ``records`` holds every call since the log was made,
    until the engine calls ``end_step()`` after each training step: that folds the
    step's records into running totals (what ``summary`` and ``total`` report) and one
    line per step (``step_wire_bytes``, ``step_seconds``: 16 bytes a step; a rehearsal's
    ``step_stand_in_seconds`` too), and keeps
    only the last step's records, unless ``keep=True`` (``--trace`` wants every event).
    A 100,000-step run then holds a few MB, not millions of records. An all-to-all's
    record also keeps the bytes it sent to each rank of its group (``sent_to``), summed
    in ``summary`` (a row of who sends what to whom: one number per group rank).
    """

    records: list[CommRecord] = field(default_factory=list)
    on_enter: Callable[[CommRecord], None] | None = None
    enabled: bool = True
    on_exit: Callable[[CommRecord], None] | None = None
    step_wire_bytes: array = field(default_factory=lambda: array("d"))
    step_seconds: array = field(default_factory=lambda: array("d"))
    # imagined peers: the seconds each step spent writing stand-ins (module docstring)
    step_stand_in_seconds: array = field(default_factory=lambda: array("d"))
    _stand_ins: list = field(default_factory=list)  # this step's: CUDA event pairs, floats
    _folded: dict = field(default_factory=dict)  # (dim, op) -> [calls, bytes, wire, s]
    _kept: int = 0  # records[:_kept] are already folded (kept for a trace)

    def __post_init__(self) -> None:
        if self.on_enter is None:
            self.on_enter = RANK_HOOKS["on_enter"]
        if self.on_exit is None:
            self.on_exit = RANK_HOOKS["on_exit"]

    def enter(self, op: str, dim: str, t: torch.Tensor, n: int, nbytes: int | None = None,
              peer: int | None = None, wire: int | None = None,
              sent_to: tuple[int, ...] | None = None) -> CommRecord:
        nbytes = t.numel() * t.element_size() if nbytes is None else nbytes
        wire = wire_bytes(op, nbytes, n) if wire is None else wire
        rec = CommRecord(op, dim, nbytes, wire, tuple(t.shape),
                         str(t.dtype).replace("torch.", ""), time.time(), peer=peer,
                         sent_to=sent_to)
        if self.on_enter is not None:
            self.on_enter(rec)
        if self.enabled:
            self.records.append(rec)
        return rec

    def finish(self, rec: CommRecord) -> None:
        """Stamp the end of ``rec``'s op, which is over."""
        rec.end = time.time()
        if self.on_exit is not None:
            self.on_exit(rec)

    def stand_in(self, t: torch.Tensor, write: Callable[[], object]) -> None:
        """Run ``write`` (an imagined op's stand-in for ``t``) and count its time."""
        if t.is_cuda:  # on the stream, without waiting for it
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            write()
            end.record()
            self._stand_ins.append((start, end))
        else:
            t0 = time.perf_counter()
            write()
            self._stand_ins.append(time.perf_counter() - t0)

    def clear(self) -> None:
        self.records.clear()
        self.step_wire_bytes, self.step_seconds = array("d"), array("d")
        self.step_stand_in_seconds = array("d")
        self._stand_ins.clear()
        self._folded.clear()
        self._kept = 0

    def end_step(self, keep: bool = False) -> None:
        """Fold this step's records into the totals; drop the previous step's details
        (all are kept with ``keep``). Call it once a step's ops have all completed."""
        new = self.records[self._kept:]
        wire = seconds = 0.0
        for r in new:
            s = self._folded.setdefault((r.dim, r.op), [0, 0, 0, 0.0, None])
            took = max(0.0, r.end - r.start) if r.end == r.end else 0.0
            s[0], s[1], s[2], s[3] = s[0] + 1, s[1] + r.nbytes, s[2] + r.wire_bytes, s[3] + took
            s[4] = _add_rows(s[4], r.sent_to)
            wire, seconds = wire + r.wire_bytes, seconds + took
        self.step_wire_bytes.append(wire)
        self.step_seconds.append(seconds)
        if self._stand_ins:  # (a rehearsal's)
            self.step_stand_in_seconds.append(sum(map(_seconds, self._stand_ins)))
            self._stand_ins.clear()
        if not keep:
            self.records = new  # the last step's records only
        self._kept = len(self.records)

    def _all(self):
        """(dim, op, calls, bytes, wire bytes, seconds, bytes sent to each group rank or
        None): folded totals, then the rest."""
        for (dim, op), (calls, nbytes, wire, seconds, sent_to) in self._folded.items():
            yield dim, op, calls, nbytes, wire, seconds, sent_to
        for r in self.records[self._kept:]:
            took = max(0.0, r.end - r.start) if r.end == r.end else 0.0
            yield r.dim, r.op, 1, r.nbytes, r.wire_bytes, took, r.sent_to

    def summary(self) -> dict[str, dict[str, dict[str, float]]]:
        """{dim: {op: {"calls", "bytes", "wire_bytes", "seconds"}}}, over the whole run;
        an all-to-all also has ``sent_to``: bytes to each rank of its group."""
        out: dict = defaultdict(lambda: defaultdict(
            lambda: {"calls": 0, "bytes": 0, "wire_bytes": 0, "seconds": 0.0}))
        for dim, op, calls, nbytes, wire, seconds, sent_to in self._all():
            s = out[dim][op]
            s["calls"] += calls
            s["bytes"] += nbytes
            s["wire_bytes"] += wire
            s["seconds"] += seconds
            if sent_to is not None:
                s["sent_to"] = _add_rows(s.get("sent_to"), sent_to)
        return {d: dict(ops) for d, ops in out.items()}

    def total(self, key: str = "wire_bytes", dim: str | None = None,
              op: str | None = None) -> int:
        """Sum of ``nbytes`` or ``wire_bytes`` over the whole run (folded steps too)."""
        column = {"nbytes": 3, "wire_bytes": 4}[key]
        return sum(row[column] for row in self._all()
                   if (dim is None or row[0] == dim) and (op is None or row[1] == op))

    def to_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]


def _seconds(timed) -> float:
    """A stand-in's seconds: counted on the host, or between two CUDA events."""
    if isinstance(timed, float):
        return timed
    start, end = timed
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _add_rows(total: list[int] | None, row) -> list[int] | None:
    """Element-wise sum of two per-rank byte rows (None: no row)."""
    if row is None:
        return total
    return list(row) if total is None else [a + b for a, b in zip(total, row)]


class Pending:
    """An asynchronous op in flight; ``wait()`` finishes it and stamps its end time."""

    def __init__(self, work, record: CommRecord, then: Callable[[], None] | None = None,
                 finish: Callable[[CommRecord], None] | None = None):
        self.work, self.record, self.then, self.finish = work, record, then, finish

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
            if self.finish is not None:
                self.finish(self.record)
            else:
                self.record.end = time.time()
            if self.then is not None:
                self.then()

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


class Comm:
    """Counted collectives on one process group, named by its mesh dimension."""

    def __init__(self, group=None, dim: str = "world", log: CommLog | None = None,
                 ranks: Sequence[int] | None = None):
        self.group = group if group is not None else dist.group.WORLD
        self.dim = dim
        self.log = CommLog() if log is None else log
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.ranks = list(ranks) if ranks is not None else dist.get_process_group_ranks(
            self.group)
        backend = dist.get_backend(self.group)  # where tensors must be (module docstring)
        self.imagined = backend == "fake"  # its peers too: ops write stand-ins
        self._draws: torch.Generator | None = None  # (a receive's stand-in values)
        self._wire: torch.device | None = None
        if backend == "gloo":
            self._wire = torch.device("cpu")
        elif backend == "nccl":
            self._wire = torch.device("cuda", torch.cuda.current_device())

    def __repr__(self) -> str:
        return f"Comm({self.dim}, rank {self.rank} of {self.ranks})"

    def _on_wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself, or a copy of it where the backend moves tensors (a host copy of a
        CUDA tensor for gloo, a device copy of a host tensor for NCCL)."""
        if self._wire is None or t.device.type == self._wire.type:
            return t
        return t.detach().to(self._wire)

    @staticmethod
    def _back(t: torch.Tensor, h: torch.Tensor):
        """Copy a staged result ``h`` back into ``t`` (None if nothing was staged)."""
        return None if h is t else (lambda: t.copy_(h))

    def _run(self, op, t, fn, async_op, nbytes=None, peer=None, then=None, wire=None,
             sent_to=None, stand_in=None):
        rec = self.log.enter(op, self.dim, t, self.size, nbytes, peer, wire, sent_to)
        work = fn()
        if self.imagined and stand_in is not None:  # what the peers would have sent
            self.log.stand_in(t, stand_in)
        if async_op:
            return Pending(work, rec, then, self.log.finish)
        self.log.finish(rec)
        if then is not None:
            then()
        return None

    def _drawn(self, t: torch.Tensor):
        """A receive's stand-in: ``t`` filled from N(0, 1) (a floating tensor; a shape
        header or other integers stay as they are), from this Comm's own generator; None
        where the peers are real."""
        if not (self.imagined and t.is_floating_point()):
            return None
        if self._draws is None:
            self._draws = torch.Generator(t.device).manual_seed(0)
        return lambda: t.normal_(generator=self._draws)

    # --- collectives -------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: str = "sum", async_op: bool = False):
        """Reduce ``t`` in place across the group (sum, max or min)."""
        rop = _reduce_op(op)  # a bad name fails on one rank too, and before logging
        if self.size == 1:
            return Pending(None, None) if async_op else None
        h = self._on_wire(t)
        return self._run("all_reduce", t, lambda: dist.all_reduce(
            h, rop, group=self.group, async_op=async_op), async_op, then=self._back(t, h))

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` (rank order) and return it."""
        if self.size == 1:
            return t
        # The flat op gathers along dim 0 (and gloo wants exactly that output shape).
        src = self._on_wire(t.contiguous())
        out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype,
                          device=src.device)
        self._run("all_gather", out, lambda: _all_gather_flat(out, src, group=self.group),
                  False, stand_in=lambda: _copies(out, src))
        out = out.to(t.device)
        if dim == 0:
            return out
        return torch.cat(out.chunk(self.size, 0), dim=dim)

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor,
                        async_op: bool = False):
        """Gather flat shards into a preallocated flat ``out`` (ZeRO-3's hot path)."""
        if self.size == 1:
            out.copy_(t)
            return Pending(None, None) if async_op else None
        h_out, h_in = self._on_wire(out), self._on_wire(t)
        return self._run("all_gather", out, lambda: _all_gather_flat(
            h_out, h_in, group=self.group, async_op=async_op), async_op,
            then=self._back(out, h_out), stand_in=lambda: _copies(h_out, h_in))

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0, op: str = "sum") -> torch.Tensor:
        """Sum ``t`` across ranks and return this rank's equal slice along ``dim``."""
        rop = _reduce_op(op)
        if self.size == 1:
            return t
        dim %= t.dim()
        if t.shape[dim] % self.size:
            raise ValueError(f"reduce_scatter: size {t.shape[dim]} of dim {dim} is not "
                             f"divisible by the group size {self.size}")
        # The flat op scatters along dim 0, so lay the chunks one after another. Along
        # another dim (SP's sequence, dim 1 of [b, s, h]) that is one permuting copy,
        # [b, n*s/n, h] -> [n, b, s/n, h]; it used to be two (a reshape copy of each
        # chunk, then a cat), i.e. twice the memory traffic of the payload per call.
        shape = (*t.shape[:dim], t.shape[dim] // self.size, *t.shape[dim + 1:])
        src = t.contiguous() if dim == 0 else (
            t.unflatten(dim, (self.size, -1)).movedim(dim, 0).contiguous().view(-1))
        src = self._on_wire(src)
        out = torch.empty(shape, dtype=t.dtype, device=src.device)
        flat_out = out.view(-1) if dim else out
        self._run("reduce_scatter", t, lambda: _reduce_scatter_flat(
            flat_out, src, rop, group=self.group), False,
            stand_in=lambda: _own_slice(flat_out, src, self.rank))
        return out.to(t.device)

    def reduce_scatter_into(self, out: torch.Tensor, t: torch.Tensor, op: str = "sum",
                            async_op: bool = False):
        """Reduce-scatter a flat ``t`` into a preallocated flat ``out`` (ZeRO-2/3)."""
        rop = _reduce_op(op)
        if self.size == 1:
            out.copy_(t)
            return Pending(None, None) if async_op else None
        h_out, h_in = self._on_wire(out), self._on_wire(t)
        return self._run("reduce_scatter", t, lambda: _reduce_scatter_flat(
            h_out, h_in, rop, group=self.group, async_op=async_op), async_op,
            then=self._back(out, h_out), stand_in=lambda: _own_slice(h_out, h_in, self.rank))

    def all_to_all(self, t: torch.Tensor, send_rows: list[int],
                   recv_rows: list[int]) -> torch.Tensor:
        """Rows of ``t`` to each rank of the group: the first ``send_rows[0]`` to rank 0,
        the next ``send_rows[1]`` to rank 1, ...; returns the rows received, rank 0's
        first (``all_to_all_single`` with split sizes; expert parallelism's dispatch and
        combine). Counted: the payload sent, on the wire the rows that leave, and the
        bytes sent to each rank (``sent_to``)."""
        row = t.shape[1:].numel() * t.element_size()
        out_shape = (sum(recv_rows), *t.shape[1:])
        if self.size == 1:
            return t.clone()
        src = self._on_wire(t.contiguous())
        out = torch.empty(out_shape, dtype=t.dtype, device=src.device)
        wire = (sum(send_rows) - send_rows[self.rank]) * row
        self._run("all_to_all", src, lambda: dist.all_to_all_single(
            out, src, list(recv_rows), list(send_rows), group=self.group), False,
            wire=wire, sent_to=tuple(int(n) * row for n in send_rows),
            stand_in=(lambda: _own_rows(out, src)) if len(src) else self._drawn(out))
        return out.to(t.device)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy ``t`` from the group's local rank ``src`` to every rank, in place."""
        if self.size > 1:
            h = self._on_wire(t)
            self._run("broadcast", t, lambda: dist.broadcast(
                h, self.ranks[src], group=self.group), False, then=self._back(t, h))
        return t

    def barrier(self) -> None:
        if self.size > 1:
            probe = torch.zeros(1)
            self._run("barrier", probe, lambda: dist.barrier(group=self.group), False, 0)

    # --- point to point (ranks are local to the group) ----------------------------
    def send(self, t: torch.Tensor, dst: int) -> None:
        peer, h = self.ranks[dst], self._on_wire(t.contiguous())
        self._run("send", t, lambda: dist.send(h, peer, group=self.group), False, peer=peer)

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        peer, h = self.ranks[src], self._on_wire(t)
        self._run("recv", t, lambda: dist.recv(h, peer, group=self.group), False, peer=peer,
                  then=self._back(t, h), stand_in=self._drawn(h))
        return t

    def isend(self, t: torch.Tensor, dst: int) -> Pending:
        peer, h = self.ranks[dst], self._on_wire(t.contiguous())
        return self._run("send", t, lambda: dist.isend(h, peer, group=self.group), True,
                         peer=peer)

    def irecv(self, t: torch.Tensor, src: int) -> Pending:
        peer, h = self.ranks[src], self._on_wire(t)
        return self._run("recv", t, lambda: dist.irecv(h, peer, group=self.group), True,
                         peer=peer, then=self._back(t, h), stand_in=self._drawn(h))


# --- what imagined peers send (module docstring) ---------------------------------------
def _copies(out: torch.Tensor, shard: torch.Tensor) -> None:
    """An all-gather's stand-in: this rank's shard in every rank's place."""
    n = out.numel() // shard.numel()
    out.view(n, -1).copy_(shard.reshape(1, -1).expand(n, -1))


def _own_slice(out: torch.Tensor, full: torch.Tensor, rank: int) -> None:
    """A reduce-scatter's stand-in: this rank's slice of its own input."""
    out.view(-1).copy_(full.view(-1, out.numel())[rank])


def _own_rows(out: torch.Tensor, rows: torch.Tensor) -> None:
    """An all-to-all's stand-in: this rank's own rows (some), repeated to fill the
    output."""
    for start in range(0, len(out), len(rows)):
        part = out[start:start + len(rows)]
        part.copy_(rows[:len(part)])
