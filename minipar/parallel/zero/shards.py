"""The flat, sharded layout ZeRO keeps its state in: one helper both wrappers hold.

ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC20, arXiv 1910.02054) lays the parameters of one bucket (stages
0-2) or unit (stage 3) end to end in one buffer, padded with zeros to a multiple of the N
ranks that share it; rank r owns the contiguous shard [r*S, (r+1)*S) and keeps its
*master* (the fp32 values the optimizer updates). ``FlatParams`` is one such buffer;
``Shards`` is the helper ``ZeroOptimizer`` and ``Zero3`` both hold (composition): their
flats, the group, where the masters live (``offload.OnDevice`` or ``OnHost``), and what
is done to every flat alike: the gradient elements a rank owns, the one norm over them,
clipping, a sum over another group, and the training state by name. A checkpoint must
not depend on the layout (dp size, buckets, stage): ``full_state`` gathers each
parameter's weights and optimizer states back *by name*, ``load_full_state`` takes a
rank's slice of them, so a run saved at one layout resumes at any other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from minipar.comm import Comm


class FlatParams:
    """Parameters laid end to end in one buffer padded to ``parts`` equal shards.

    ``master``: this rank's shard [lo, hi) in ``master_dtype``, the parameter the optimizer
    updates (the whole buffer itself when it is unsharded and already of that dtype).
    ``full``: the whole buffer in the compute ``dtype`` (``keep_full=False``: left
    unfilled, for ZeRO-3 to gather into: it casts ``master`` into its own slot of
    ``full`` and all-gathers in place, as FSDP2 does, so no 16-bit shard is kept between
    steps). ``grad``: the full-size gradient buffer while
    gradients accumulate (else None). Only one unit's fp32 values exist at a time here.
    """

    def __init__(self, params: list, names: list[str], group: int,
                 sources: list[torch.Tensor] | Callable[[int], torch.Tensor], rank: int,
                 parts: int, dtype: torch.dtype,
                 master_dtype: torch.dtype = torch.float32, keep_full: bool = True):
        self.params, self.names, self.group = params, names, group
        self.shapes = [tuple(p.shape) for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:k]) for k in range(len(params))]
        self.numel = sum(self.numels)
        self.padded = -(-self.numel // parts) * parts
        size = self.padded // parts
        self.lo, self.hi = rank * size, (rank + 1) * size
        self.grad: torch.Tensor | None = None
        self._unwritten: set[int] = set()  # slots of ``grad`` no gradient has reached yet
        if not keep_full:  # ZeRO-3: only this rank's shard is ever made, value by value
            self._shard_only(sources, master_dtype, dtype, parts)
            return
        self._fill(sources if callable(sources) else sources.__getitem__, master_dtype,
                   dtype, parts)

    def _fill(self, make: Callable[[int], torch.Tensor], master_dtype: torch.dtype,
              dtype: torch.dtype, parts: int) -> None:
        """``full`` (compute dtype) and the ``master`` shard, filled parameter by
        parameter from ``make(k)``: parameter k's value, given or made when asked
        (sharded initialisation, ``materialize.py``). Only one such value is alive at a
        time: no fp32 copy of the bucket, let alone of the model, beside the two. Weights
        already in the master dtype (fp32) need no master of their own: the shard is this
        rank's slot of ``full`` (a view), which the optimizer updates in place and the
        all-gather then sends."""
        own = dtype == master_dtype  # fp32 weights: the master is their slot of full
        full = master = None
        with torch.no_grad():
            for k, (o, n) in enumerate(zip(self.offsets, self.numels)):
                src = make(k).reshape(-1)
                if full is None:  # zeros: the padding holds no weight
                    full = torch.zeros(self.padded, dtype=dtype, device=src.device)
                    master = full[self.lo:self.hi] if own else torch.zeros(
                        self.hi - self.lo, dtype=master_dtype, device=src.device)
                full[o:o + n].copy_(src)  # the cast rounds as .to(dtype) would
                a, b = max(o, self.lo), min(o + n, self.hi)
                if not own and a < b:
                    master[a - self.lo:b - self.lo].copy_(src[a - o:b - o])
                del src
        self.full, self.master = full, nn.Parameter(master)

    def _shard_only(self, sources, master_dtype: torch.dtype, dtype: torch.dtype,
                    parts: int) -> None:
        """``sources``: tensors, or ``source(k)`` making parameter k's value when asked
        (sharded initialisation): only parameters overlapping [lo, hi) are made, one at
        a time, and only their overlap is kept."""
        make = sources if callable(sources) else sources.__getitem__
        shard, device = None, None
        with torch.no_grad():
            for k, a, b in self.owned():
                src = make(k)
                if shard is None:
                    device = src.device
                    shard = torch.zeros(self.hi - self.lo, dtype=master_dtype, device=device)
                o = self.offsets[k]
                shard[a:b].copy_(src.reshape(-1)[self.lo + a - o:self.lo + b - o])
                del src
        if shard is None:  # all padding (a tiny flat over many ranks)
            device = self.params[0].device if self.params[0].device.type != "meta" \
                else make(0).device
            shard = torch.zeros(self.hi - self.lo, dtype=master_dtype, device=device)
        self.master = nn.Parameter(shard)
        self.full = torch.empty(self.padded, dtype=dtype, device=device)
        if parts == 1:
            self.full.copy_(self.master.detach())

    def bind(self) -> None:
        """Make the parameters views of the flat buffer (an all-gather updates them)."""
        for p, o, n in zip(self.params, self.offsets, self.numels):
            realize(p, self.full[o:o + n].view(p.shape))

    def add_grad(self, k: int, g: torch.Tensor, dtype: torch.dtype) -> bool:
        """Accumulate parameter k's gradient ``g`` into ``grad`` (made if there is none:
        returns True then). The first gradient of k since the buffer was made or restarted
        is copied into its slot, later ones added: a copy reads nothing (2 + 4 bytes an
        element, an add to zeros 2 + 4 + 4, after a fill of 4)."""
        slot, made, first = self._slot(k, dtype, g.device)
        (slot.copy_ if first else slot.add_)(g.reshape(-1))
        return made

    def add_product(self, k: int, dy: torch.Tensor, x: torch.Tensor,
                    dtype: torch.dtype) -> bool:
        """As ``add_grad`` for g = dy^T x (a linear layer's weight gradient, dy [t, out],
        x [t, in]), in one matrix multiply that reads and writes the sum: no 16-bit g is
        made (``wgrad_fusion.py``). A first product is written with beta 0: the slot is
        not read (whatever it held, NaN included, is ignored, as ``addmm`` documents)."""
        slot, made, first = self._slot(k, dtype, dy.device)
        out, beta = slot.view(dy.shape[-1], x.shape[-1]), 0.0 if first else 1.0
        if dy.dtype == dtype:
            out.addmm_(dy.t(), x, beta=beta)
        elif dy.is_cuda:  # bf16 products summed in fp32 by the GEMM itself
            torch.addmm(out, dy.t(), x, beta=beta, out_dtype=dtype, out=out)
        else:  # (no mixed-dtype GEMM on the CPU: the operands are widened)
            out.addmm_(dy.t().to(dtype), x.to(dtype), beta=beta)
        return made

    def _slot(self, k: int, dtype: torch.dtype, device: torch.device
              ) -> tuple[torch.Tensor, bool, bool]:
        """Parameter k's part of the gradient buffer; whether the buffer was made now;
        whether k's slot holds no gradient yet. A new buffer is left unfilled (its
        slots are written by their first gradient, ``reduced_grad`` zeroes the rest) but
        for the padding, which no parameter writes and a reduction sends."""
        made = self.grad is None
        if made:
            self.grad = torch.empty(self.padded, dtype=dtype, device=device)
            self.grad[self.numel:].zero_()
            self.restart_grad()
        first = k in self._unwritten
        self._unwritten.discard(k)
        return self.grad[self.offsets[k]:self.offsets[k] + self.numels[k]], made, first

    def reduced_grad(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The gradient buffer, complete, for a reduction: the slots of parameters that
        received no gradient (unused this step) zeroed; a buffer of zeros if none did."""
        if self.grad is None:
            self._unwritten.clear()
            self.grad = torch.zeros(self.padded, dtype=dtype, device=device)
        for k in sorted(self._unwritten):
            self.grad[self.offsets[k]:self.offsets[k] + self.numels[k]].zero_()
        self._unwritten.clear()
        return self.grad

    def restart_grad(self) -> None:
        """Keep the buffer, but count every slot unwritten: the next gradients are copied
        in, not added (what a ``zero_()`` would do, without writing the zeros)."""
        self._unwritten = set(range(len(self.numels)))

    def owned(self) -> Iterator[tuple[int, int, int]]:
        """(k, a, b): the part of parameter k inside this rank's shard, as [a, b) of it."""
        for k, (o, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(o, self.lo), min(o + n, self.hi)
            if a < b:
                yield k, a - self.lo, b - self.lo

    def slice(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's shard of the flat made of ``tensors`` (one per parameter)."""
        flat = torch.zeros(self.padded, dtype=tensors[0].dtype)
        for t, o, n in zip(tensors, self.offsets, self.numels):
            flat[o:o + n] = t.reshape(-1).cpu()
        return flat[self.lo:self.hi].clone().to(self.master.device)


def realize(p: nn.Parameter, value: torch.Tensor) -> None:
    """Make ``value`` the data of ``p``, which may be on the meta device, keeping the
    object (optimizer groups, hooks and the user hold it). ``p.data = value`` cannot move
    a meta tensor to a device; ``torch.utils.swap_tensors`` can (its attributes, e.g.
    ``sequence_parallel``, are carried over)."""
    if p.is_meta:
        new = nn.Parameter(torch.empty(0, dtype=value.dtype, device=value.device),
                           requires_grad=p.requires_grad)
        new.__dict__.update(p.__dict__)
        torch.utils.swap_tensors(p, new)
    p.data = value


def global_grad_norm(pieces: Iterable[torch.Tensor], groups: Iterable[Comm] = (),
                     device: torch.device | None = None) -> torch.Tensor:
    """The L2 norm of a gradient spread over ranks: the one norm every layout uses.

    ``pieces``: the gradient elements this rank *owns*, each element of the model owned
    by exactly one rank of the ``groups`` (a ZeRO shard over dp; a replicated tensor-
    parallel weight on tp rank 0 only; a pipeline stage's own layers). The squared sum is
    added up over each group. Computed on ``device`` (default: the pieces'), fused (as
    ``torch.nn.utils.clip_grad_norm_``): the host does not wait for the GPU here.
    """
    pieces = [t.detach().float() for t in pieces]
    total = torch.zeros((), dtype=torch.float32,
                        device=device or (pieces[0].device if pieces else None))
    if pieces:
        total += torch.nn.utils.get_total_norm(pieces, 2.0).to(total.device).square()
    for group in groups:
        if group.size > 1:
            group.all_reduce(total)
    return total.sqrt()


class Shards:
    """What ``ZeroOptimizer`` and ``Zero3`` share: their ``flats`` over ``comm``, with the
    masters where ``place`` keeps them, and the calls that treat every flat alike.

    ``observers``: measurement attached from outside (``meter.HeldPeaks``): the wrappers
    report each change of their buffers through ``held``; with none, nothing is counted.
    """

    def __init__(self, comm: Comm, place) -> None:
        self.comm, self.place = comm, place
        self.flats: list[FlatParams] = []
        self.sync = True  # False inside no_sync(): backwards only accumulate
        self.observers: list = []
        self.hooks: list = []  # autograd and module hooks, removed by ``remove``

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """PyTorch DDP's name: backwards inside only accumulate gradients locally."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def held(self, kind: str, key, tensors: Callable[[], Iterable], peak: bool = True
             ) -> None:
        """Tell the observers that ``key`` now holds ``tensors()`` of ``kind``."""
        for observer in self.observers:
            observer.held(kind, key, tensors(), peak)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    # --- gradients: owned pieces, norm, clip, a sum over another group -----------------
    def grad_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, gradient elements) this rank owns after the sync: its shard of each
        flat (an unsharded flat, replicated on every rank: owned by rank 0). Over the
        group every element is owned once: what ``global_grad_norm`` is taken on."""
        for f in self.flats:
            if f.master.grad is not None and (self.comm.rank == 0 or f.lo != 0
                                              or f.hi != f.padded):
                for k, a, b in f.owned():
                    yield f.names[k], f.master.grad[a:b]

    def scale_grads(self, factor: float | torch.Tensor) -> None:
        self.place.scale([f.master.grad for f in self.flats if f.master.grad is not None],
                         factor)

    def clip(self, max_norm: float) -> float:
        """Clip by the norm over ``comm`` (data parallelism alone); returns the norm."""
        norm = global_grad_norm((g for _, g in self.grad_shards()), [self.comm],
                                device=self.flats[0].full.device)
        self.scale_grads((max_norm / (norm + 1e-6)).clamp(max=1.0))
        return float(norm)

    def all_reduce_grads(self, names: set[str], comm: Comm) -> None:
        """Sum the gradient shards of the parameters ``names`` over another group, on the
        device (where the collective runs). Exact when each such parameter has a flat of
        its own (its shard is then the same slice on every rank of ``comm``)."""
        parts = [(f.master.grad, a, b) for f in self.flats if f.master.grad is not None
                 for k, a, b in f.owned() if f.names[k] in names]
        if comm.size > 1 and parts:
            flat = torch.cat([g[a:b] for g, a, b in parts]).to(self.flats[0].full.device)
            comm.all_reduce(flat)
            o = 0
            for g, a, b in parts:
                g[a:b].copy_(flat[o:o + b - a])
                o += b - a

    # --- the training state by name (layout-free) and by shard ---------------------------
    def full_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """(fp32 weights, optimizer states) by reference name, whole (collective)."""
        def gather(f: FlatParams, shard: torch.Tensor) -> torch.Tensor:
            if f.lo == 0 and f.hi == f.padded:  # unsharded
                return shard
            return self.comm.all_gather(shard.to(f.full.device).contiguous())
        return full_state(self.flats, optimizer, gather)

    def load_full_state(self, optimizer: torch.optim.Optimizer, states: dict,
                        weights: dict | None = None) -> None:
        """Take this rank's shard of whole states (and fp32 weights, if given) by name."""
        with torch.no_grad():
            for f in self.flats:
                if weights is not None:
                    f.master.copy_(f.slice([weights[n] for n in f.names]))
                first = states.get(f.names[0])
                if first:
                    optimizer.state[f.master] = {
                        k: f.slice([states[n][k] for n in f.names]).to(f.master.device)
                        if _elementwise(v) else _scalar_state(v, optimizer, f.master)
                        for k, v in first.items()}


def _elementwise(v) -> bool:
    """An optimizer state with one value per element (Adam's moments; not its step)."""
    return isinstance(v, torch.Tensor) and v.dim() > 0


def _scalar_state(v, optimizer: torch.optim.Optimizer, param: torch.Tensor):
    """A state of one value (Adam's step) where torch's own ``load_state_dict`` puts it:
    on the parameter's device for a fused or capturable kernel, which reads it there, and
    on the host otherwise (a checkpoint is read onto the host)."""
    if not isinstance(v, torch.Tensor):
        return v
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])),
                 {})
    on_device = group.get("fused") or group.get("capturable")
    return v.detach().to(param.device if on_device else "cpu", copy=True)


def _cloned(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _cloned(v) for k, v in x.items()}
    return [_cloned(v) for v in x] if isinstance(x, list) else x


def full_state(flats: list[FlatParams], optimizer: torch.optim.Optimizer,
               gather: Callable[[FlatParams, torch.Tensor], torch.Tensor]
               ) -> tuple[dict, dict]:
    """(fp32 weights, optimizer states) of every parameter by name, whole, on the CPU.
    ``gather(f, shard)``: the whole padded flat (an all-gather over the ranks sharing it)."""
    weights, states = {}, {}
    for f in flats:
        master = gather(f, f.master.detach())
        state = {k: gather(f, v.to(f.master.device)) if _elementwise(v) else v
                 for k, v in optimizer.state.get(f.master, {}).items()}
        for name, shape, o, n in zip(f.names, f.shapes, f.offsets, f.numels):
            weights[name] = master[o:o + n].view(shape).cpu().clone()
            states[name] = {k: (v[o:o + n].view(shape) if _elementwise(v) else v)
                            .cpu().clone() if isinstance(v, torch.Tensor) else v
                            for k, v in state.items()}
    return weights, states


def sharded_state(flats: list[FlatParams], optimizer: torch.optim.Optimizer, comm: Comm,
                  stage: int) -> dict:
    """One rank's shard of the optimizer, with the layout to reassemble it."""
    index = {id(p): i for i, p in enumerate(
        p for g in optimizer.param_groups for p in g["params"])}
    return {
        "format": "minipar.zero/1", "stage": stage,
        "dp_size": comm.size, "dp_rank": comm.rank,
        "flats": [{"names": f.names, "shapes": f.shapes, "numel": f.numel,
                   "padded": f.padded, "lo": f.lo, "hi": f.hi,
                   "index": index[id(f.master)]} for f in flats],
        "masters": [f.master.detach().clone() for f in flats],
        "optimizer": _cloned(optimizer.state_dict()),  # a snapshot, not aliases
    }


def load_sharded_state(flats: list[FlatParams], optimizer: torch.optim.Optimizer,
                       comm: Comm, sd: dict) -> None:
    """Load a shard saved with the same layout (another layout: ``Shards.full_state``
    at the save, ``Shards.load_full_state`` at the load)."""
    mine = sharded_state(flats, optimizer, comm, sd["stage"])
    if (sd["dp_size"], sd["dp_rank"], sd["flats"]) != \
            (mine["dp_size"], mine["dp_rank"], mine["flats"]):
        raise ValueError("checkpoint layout differs from this optimizer's; save with "
                         "full_state_by_name() and load with load_full_state_by_name()")
    with torch.no_grad():
        for f, m in zip(flats, sd["masters"]):
            f.master.copy_(m)
    optimizer.load_state_dict(_cloned(sd["optimizer"]))  # torch would alias it
