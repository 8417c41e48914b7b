"""ZeRO: data parallelism without the redundant copies (Rajbhandari et al. 2019,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", arXiv 1910.02054).

Plain data parallelism keeps on *every* rank the whole model state: with mixed-precision
Adam 2 bytes of weights, 2 of gradients and 12 of optimizer state (fp32 master, two
moments) per parameter, 16 Psi bytes for Psi parameters. ZeRO gives each of the N ranks
one N-th of that state and communicates instead:

* stage 1 (P_os): each rank keeps the optimizer state (and fp32 master) of its shard
  only. Gradients are *reduce-scattered* (rank r receives the summed gradient of shard r),
  each rank updates its shard, and an *all-gather* returns the new weights to everyone.
  A reduce-scatter plus an all-gather moves exactly what one all-reduce moves: 2(N-1)/N.
* stage 2 (P_os+g): the full-size gradient buffer of a bucket is freed as soon as it has
  been reduce-scattered, during backward; a rank keeps the gradient of its shard only.
* stage 3 (P_os+g+p): the weights are sharded too. A *unit* (a transformer block, say)
  is all-gathered just before its forward, freed after, gathered again before its
  backward and freed once its gradients are out: 3(N-1)/N, 1.5x data parallelism, for a
  per-rank model state of 16 Psi / N.
* stage 0 is plain data parallelism in the same machinery (all-reduce, no shards), so
  one optimizer object covers every stage.

Stage 3's units. A parameter is gathered when the module using it runs: the innermost
of the given ``units`` (by default every module in an ``nn.ModuleList``: a GPT's blocks)
around the module that registers it, or else that module itself (an embedding, the final
norm, the head; they need not be called through the root's forward, so a pipeline stage
that runs its own pieces works). A tied weight is gathered by each module that uses it.

Layout. The parameters of a bucket (stages 0-2) or unit (stage 3) are laid end to end in
one flat buffer, padded with zeros to a multiple of N; rank r owns the contiguous shard
[r*S, (r+1)*S). The model's parameters become views into that buffer, so an all-gather
into it updates the model in place. Stage 3 frees the buffer by resizing its storage to
zero bytes (what PyTorch FSDP does): every view, including those autograd saved for
backward, sees the data again once it is re-gathered. Frozen parameters are left alone
(replicated, never reduced or updated).

Use (any torch optimizer class and its keyword arguments)::

    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=2, comm=mesh.dp, lr=1e-3)
    loss = model(x, y); loss.backward()
    opt.step()                       # finishes the gradient sync first if needed
    opt.zero_grad()

``no_sync()`` and ``finish_gradient_sync()`` work as in ``DataParallel``. With stages
2 and 3 ``finish_gradient_sync()`` may also be called after *each* micro-batch's backward:
the gradients are reduce-scattered and added to the shard, and the full-size buffers
are freed (the memory-lean choice; ``no_sync()`` trades memory for communication).
Stage 3 requires every rank to call the same units in the same order (the model's
control flow must not depend on the rank's data), and units gather through ``__call__``.
Gradients are accumulated in the parameters' dtype, reduced in ``reduce_dtype`` and kept
for the shard in fp32 (so a rank's gradient shard is 4 bytes per element, not the
paper's 2: it feeds the fp32 optimizer directly and can accumulate micro-batches).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from minipar.comm import Comm, Pending
from minipar.parallel.dp import (
    MB,
    Reducer,
    broadcast_module,
    bucket_params,
    optimizer_state_bytes,
    storage_bytes,
    trainable_params,
)
from minipar.parallel.precision import MixedPrecision


class FlatParams:
    """Parameters laid end to end in one buffer padded to ``parts`` equal shards.

    ``full``: the whole buffer in the model's dtype (the parameters are views of it).
    ``master``: this rank's shard [lo, hi) in fp32, the parameter the optimizer updates.
    ``shard``: (stage 3) this rank's shard in the model's dtype, the all-gather's source.
    ``grad``: the full-size gradient buffer while gradients accumulate (else None).
    """

    def __init__(self, params: list[nn.Parameter], names: list[str], group: int,
                 sources: list[torch.Tensor], rank: int, parts: int):
        self.params, self.names, self.group = params, names, group
        self.shapes = [tuple(p.shape) for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:k]) for k in range(len(params))]
        self.numel = sum(self.numels)
        self.padded = -(-self.numel // parts) * parts
        size = self.padded // parts
        self.lo, self.hi = rank * size, (rank + 1) * size
        p0 = params[0]
        if any(p.dtype != p0.dtype or p.device != p0.device for p in params):
            raise ValueError("parameters of one group must share dtype and device")
        self.full = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        master = torch.zeros(self.padded, dtype=torch.float32, device=p0.device)
        with torch.no_grad():
            for p, src, o, n in zip(params, sources, self.offsets, self.numels):
                self.full[o:o + n].copy_(p.detach().reshape(-1))
                master[o:o + n].copy_(src.reshape(-1))
                p.data = self.full[o:o + n].view_as(p)
        self.master = nn.Parameter(master[self.lo:self.hi].clone())
        self.shard: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None


class _Unit:
    """Parameters ZeRO-3 gathers and frees together, when one of ``modules`` runs."""

    def __init__(self, modules: list[nn.Module], flats: list[FlatParams]):
        self.modules, self.flats = modules, flats
        self.params = [p for f in flats for p in f.params]
        self.param_ids = {id(p) for p in self.params}
        self.state = "free"  # free -> gathering (in flight) -> gathered
        self.pending: list[Pending] = []
        self.in_backward = False
        self.waiting: set[int] = set()  # parameters whose gradient this backward awaits


def _tensors(x) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _value_to_share(source, trainable: set[int], p: nn.Parameter) -> torch.Tensor:
    return source(p) if id(p) in trainable else p.data


def default_units(module: nn.Module) -> list[nn.Module]:
    """Every module held in an ``nn.ModuleList`` (a GPT's blocks)."""
    return [m for ml in module.modules() if isinstance(ml, nn.ModuleList) for m in ml]


class ZeroOptimizer:
    """ZeRO stage 0-3 around ``optimizer_cls(**optim_kwargs)``, over ``comm`` (dp).

    ``params``: a module (all its trainable parameters), or parameters, or torch-style
    group dicts (``[{"params": [...], "weight_decay": 0.0}, ...]``; pass ``module=`` too
    for names and stage 3). ``average``: divide the gradient sum by the dp size.
    ``units``: stage 3's gather units (default ``default_units``); ``prefetch``: start
    gathering the next unit (forward) or the previous one (backward) while this one
    computes. ``max_inflight``: buckets being reduced at once in stages 2-3 (each holds
    its full-size buffer until done; stages 0-1 keep those buffers anyway).
    """

    def __init__(self, params: nn.Module | Iterable, optimizer_cls: type =
                 torch.optim.AdamW, *, stage: int = 1, comm: Comm | None = None,
                 module: nn.Module | None = None, precision: MixedPrecision | None = None,
                 reduce_dtype: torch.dtype | None = None, average: bool = True,
                 bucket_mb: float = 25.0, units: Iterable[nn.Module] | None = None,
                 prefetch: bool = False, max_inflight: int = 2, broadcast: bool = True,
                 **optim_kwargs):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        self.stage, self.comm = stage, comm or Comm()
        self.precision, self.reduce_dtype, self.average = precision, reduce_dtype, average
        self.prefetch = prefetch
        if isinstance(params, nn.Module):
            module, groups = module or params, [{"params": list(params.parameters())}]
        else:
            groups = list(params)
            if not groups or not isinstance(groups[0], dict):
                groups = [{"params": groups}]
        if stage == 3 and module is None:
            raise ValueError("ZeRO-3 gathers weights per module: pass the module")
        self.module = module
        self._group_of: dict[int, int] = {}
        self.params: list[nn.Parameter] = []
        for g, group in enumerate(groups):
            for p in trainable_params(group["params"]):
                if id(p) in self._group_of:
                    raise ValueError("a parameter appears in two parameter groups")
                self._group_of[id(p)] = g
                self.params.append(p)
        self._names = {id(p): f"param{i}" for i, p in enumerate(self.params)}
        order = list(module.parameters()) if module is not None else self.params
        self._names.update({id(p): n for n, p in module.named_parameters()} if module else {})
        self._pos = {id(p): i for i, p in enumerate(order)}
        self._sync_initial_values(broadcast)

        self.units: list[_Unit] = []
        self._hooks: list = []
        self._triggers: list[nn.Module] = []  # stage 3: modules whose forward gathers
        if stage < 3:
            self.flats = self._bucket_flats(bucket_mb * MB, len(groups))
        else:
            self.flats = self._unit_flats(units, len(groups))
        if precision is not None:
            precision.release()
        self._where = {id(p): (i, k) for i, f in enumerate(self.flats)
                       for k, p in enumerate(f.params)}
        self.optimizer = optimizer_cls(
            [{**{k: v for k, v in group.items() if k != "params"},
              "params": [f.master for f in self.flats if f.group == g]}
             for g, group in enumerate(groups)
             if any(f.group == g for f in self.flats)], **optim_kwargs)
        self._index = {id(p): i for i, p in enumerate(
            p for g in self.optimizer.param_groups for p in g["params"])}
        self._inflight: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._reducer = Reducer([len(f.params) for f in self.flats], self._start,
                                self._complete, max_inflight if stage >= 2 else None)
        self._sync, self._synced, self._end_queued = True, True, False
        self.skipped_steps = 0
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad)
                        for p in self.params]
        for m in self._triggers:
            self._hooks += [m.register_forward_pre_hook(self._pre_forward),
                            m.register_forward_hook(self._post_forward)]

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    # --- construction -------------------------------------------------------------
    def _source(self, p: nn.Parameter) -> torch.Tensor:
        """The fp32 value a master starts from (MixedPrecision kept it before the cast)."""
        return self.precision.master(p).data if self.precision else p.data

    def _sync_initial_values(self, broadcast: bool) -> None:
        """Every rank starts from rank 0's weights (the masters, with mixed precision)."""
        if not broadcast:
            return
        values = partial(_value_to_share, self._source, set(self._group_of))
        if self.module is not None:
            broadcast_module(self.module, self.comm, values)
        for p in [] if self.module is not None else self.params:
            self.comm.broadcast(values(p), src=0)
        with torch.no_grad():
            for p in self.params if self.precision else []:
                p.copy_(self._source(p))  # the 16-bit weights follow the shared masters

    def _flat(self, params: list[nn.Parameter], group: int) -> FlatParams:
        parts = self.comm.size if self.stage >= 1 else 1
        rank = self.comm.rank if self.stage >= 1 else 0
        params = sorted(params, key=lambda p: self._pos[id(p)])
        return FlatParams(params, [self._names[id(p)] for p in params], group,
                          [self._source(p) for p in params], rank, parts)

    def _bucket_flats(self, bucket_bytes: float, n_groups: int) -> list[FlatParams]:
        """Stages 0-2: buckets in reverse parameter order, never mixing groups."""
        flats = []
        for g in range(n_groups):
            group = sorted((p for p in self.params if self._group_of[id(p)] == g),
                           key=lambda p: self._pos[id(p)])
            flats += [self._flat(b, g) for b in bucket_params(group, bucket_bytes)]
        flats.sort(key=lambda f: -max(self._pos[id(p)] for p in f.params))
        return flats

    def _unit_flats(self, units, n_groups: int) -> list[FlatParams]:
        """Stage 3: who gathers what. A parameter is gathered by the module that uses it:
        the innermost given unit around the module that registers it or, outside every
        unit, that module itself (an embedding, the final norm). A weight registered by
        several modules (a tied embedding and head) is gathered by each of them."""
        given = {id(u) for u in (default_units(self.module) if units is None else units)}
        triggers: dict[int, list[nn.Module]] = {}  # parameter -> modules that gather it
        seen: set[int] = set()

        def walk(m: nn.Module, unit: nn.Module | None) -> None:
            if id(m) in seen:
                return
            seen.add(id(m))
            unit = m if id(m) in given else unit
            for p in m.parameters(recurse=False):
                t = unit if unit is not None else m
                mods = triggers.setdefault(id(p), [])
                if id(p) in self._group_of and all(t is not x for x in mods):
                    mods.append(t)
                    if all(t is not x for x in self._triggers):
                        self._triggers.append(t)
            for child in m.children():
                walk(child, unit)

        walk(self.module, None)
        if any(not triggers.get(id(p)) for p in self.params):
            raise ValueError("ZeRO-3 shards the module's own parameters; some given "
                             "parameters are not in the module")
        by_set: dict[tuple[int, ...], list[nn.Parameter]] = {}
        for p in sorted(self.params, key=lambda p: self._pos[id(p)]):
            by_set.setdefault(tuple(sorted(map(id, triggers[id(p)]))), []).append(p)
        pos = {id(m): i for i, m in enumerate(self._triggers)}
        for params in by_set.values():
            flats = [self._flat(mine, g) for g in range(n_groups)
                     if (mine := [p for p in params if self._group_of[id(p)] == g])]
            self.units.append(_Unit(triggers[id(params[0])], flats))
            self._hooks.append(torch.autograd.graph.register_multi_grad_hook(
                self.units[-1].params, partial(self._unit_grads_computed, self.units[-1]),
                mode="all"))
        for u in self.units:  # keep the shard, free the full buffer
            for f in u.flats:
                f.shard = f.full[f.lo:f.hi].clone()
                f.full.untyped_storage().resize_(0)
        self._unit_of = {pid: u for u in self.units for pid in u.param_ids}
        self._units_of = {id(m): [u for u in self.units if any(x is m for x in u.modules)]
                          for m in self._triggers}
        # Reduction order: backward finishes the last-used module first, the first last.
        self.units.sort(key=lambda u: -min(pos[id(m)] for m in u.modules))
        return [f for u in self.units for f in u.flats]

    # --- stage 3: gather just in time, free right after -------------------------------
    def _gather(self, u: _Unit, async_op: bool = False) -> None:
        if u.state == "free":
            for f in u.flats:
                f.full.untyped_storage().resize_(f.padded * f.full.element_size())
            u.pending = [self.comm.all_gather_into(f.full, f.shard, async_op=True)
                         for f in u.flats]
            u.state = "gathering"
        if u.state == "gathering" and not async_op:
            for pending in u.pending:
                pending.wait()
            u.pending, u.state = [], "gathered"

    def _free(self, u: _Unit) -> None:
        if u.state != "free":
            self._gather(u)  # an in-flight gather must land before its buffer goes
            for f in u.flats:
                f.full.untyped_storage().resize_(0)
            u.state = "free"

    def _neighbour(self, module: nn.Module, step: int) -> list[_Unit]:
        """Units of the next (step=1) or previous (-1) module in registration order."""
        i = next(i for i, m in enumerate(self._triggers) if m is module) + step
        return self._units_of[id(self._triggers[i])] if 0 <= i < len(self._triggers) else []

    def _pre_forward(self, module: nn.Module, args) -> None:
        for u in self._units_of[id(module)]:
            self._gather(u)
        if self.prefetch:
            for u in self._neighbour(module, 1):
                self._gather(u, async_op=True)

    def _post_forward(self, module: nn.Module, args, output) -> None:
        for u in self._units_of[id(module)]:
            if not u.in_backward:  # (a recomputation inside backward keeps it)
                self._free(u)
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(partial(self._pre_backward, module))

    def _pre_backward(self, module: nn.Module, grad: torch.Tensor) -> None:
        """Runs when the gradient of the module's output is ready: its backward is next."""
        if not self._end_queued:  # one clean-up at the end of this backward pass
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._end_queued = True
        for u in self._units_of[id(module)]:
            self._gather(u)
            if not u.in_backward:
                u.in_backward, u.waiting = True, set(u.param_ids)
        if self.prefetch:
            for u in self._neighbour(module, -1):
                self._gather(u, async_op=True)

    def _end_of_backward(self) -> None:
        """Free whatever is still gathered (a unit with a parameter unused this pass)."""
        self._end_queued = False
        for u in self.units:
            u.in_backward = False
            self._free(u)

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Stage 3: hold every unit's full weights (evaluation, inspection) for a while."""
        for u in self.units:
            self._gather(u)
        try:
            yield
        finally:
            for u in self.units:
                self._free(u)

    # --- gradients: hook, reduce (in bucket order), accumulate into the shard ---------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate full-size gradients locally; none is reduced."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_grad(self, p: nn.Parameter) -> None:
        i, k = self._where[id(p)]
        f = self.flats[i]
        self._reducer.check_open(i)
        if f.grad is None:
            f.grad = torch.zeros(f.padded, dtype=p.grad.dtype, device=p.grad.device)
        o, n = f.offsets[k], f.numels[k]
        f.grad[o:o + n].add_(p.grad.reshape(-1))
        p.grad = None
        self._arrived(p)

    def _arrived(self, p: nn.Parameter) -> None:
        """The gradient of ``p`` for this backward is in the buffer (or p was unused)."""
        self._synced = False
        if self.units:
            u = self._unit_of[id(p)]
            u.waiting.discard(id(p))
            if u.in_backward and not u.waiting:  # the unit's backward is done
                u.in_backward = False
                self._free(u)
        if self._sync:
            self._reducer.mark_ready(self._where[id(p)][0], id(p))

    def _unit_grads_computed(self, u: _Unit, grads: list[torch.Tensor | None]) -> None:
        """Stage 3, once per backward: the last gradient this backward computes for the
        unit is ready. A parameter with none was not used: it counts as arrived (a zero
        gradient), so the unit's reduce-scatter starts at the same point of the backward
        on every rank, even where ranks used different parameters. (Counting arrivals
        alone would leave it to the end on some ranks only, and the ranks would then
        enter the next unit's all-gather and this reduce-scatter in different orders.)"""
        for p, g in zip(u.params, grads):
            if g is None:
                self._arrived(p)

    def _start(self, i: int) -> Pending:
        f = self.flats[i]
        if f.grad is None:  # nothing arrived here: this rank contributes zeros
            f.grad = torch.zeros(f.padded, dtype=f.full.dtype, device=f.full.device)
        wire = f.grad
        if self.reduce_dtype is not None and self.reduce_dtype != wire.dtype:
            wire = wire.to(self.reduce_dtype)
        if self.average:
            wire.div_(self.comm.size)
        if self.stage == 0:
            out, pending = wire, self.comm.all_reduce(wire, async_op=True)
        else:
            out = torch.empty(f.hi - f.lo, dtype=wire.dtype, device=wire.device)
            pending = self.comm.reduce_scatter_into(out, wire, async_op=True)
        self._inflight[i] = (wire, out)
        return pending

    def _complete(self, i: int) -> None:
        f = self.flats[i]
        _, out = self._inflight.pop(i)
        g = out[f.lo:f.hi] if self.stage == 0 else out
        g = g.to(torch.float32, copy=True)
        if self.precision is not None and self.precision.scaling:
            g.mul_(self.precision.inv_scale)
        if f.master.grad is None:
            f.master.grad = g
        else:
            f.master.grad.add_(g)
        if self.stage <= 1:
            f.grad.zero_()  # stages 0-1 keep the full gradient buffer
        else:
            f.grad = None

    def finish_gradient_sync(self) -> None:
        """Reduce every bucket not reduced yet, wait, and add the result to the shard."""
        for u in self.units:
            u.in_backward = False
            self._free(u)
        self._reducer.flush()
        self._synced = True

    sync_gradients = finish_gradient_sync

    # --- the step ------------------------------------------------------------------
    def step(self) -> bool:
        """Update this rank's shard and share the new weights. False if skipped (fp16
        overflow)."""
        if not self._synced:
            self.finish_gradient_sync()
        if self.precision is not None and self.precision.scaling:
            bad = torch.zeros((), device=self.flats[0].master.device)
            for f in self.flats:
                if f.master.grad is not None and not torch.isfinite(f.master.grad).all():
                    bad.fill_(1.0)
            if self.stage >= 1:
                self.comm.all_reduce(bad, op="max")
            self.precision.update_scale(bool(bad))
            if bool(bad):
                self.skipped_steps += 1
                self.zero_grad()
                return False
        self.optimizer.step()
        self._publish()
        return True

    @torch.no_grad()
    def _publish(self) -> None:
        """New fp32 shards -> the model: copy (stage 0), all-gather (1, 2), keep (3)."""
        pending = []
        for f in self.flats:
            new = f.master.detach().to(f.full.dtype)
            if self.stage == 0:
                f.full.copy_(new)
            elif self.stage == 3:
                f.shard.copy_(new)
            else:
                pending.append(self.comm.all_gather_into(f.full, new, async_op=True))
        for p in pending:
            p.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for f in self.flats:
            f.master.grad = None
            if f.grad is not None:
                if self.stage <= 1:
                    f.grad.zero_()
                else:
                    f.grad = None
        for p in self.params:
            p.grad = None

    # --- clipping and accounting -----------------------------------------------------
    def _owned(self, f: FlatParams) -> Iterator[tuple[int, int, int]]:
        """(k, a, b): the part of parameter k inside this rank's shard, as [a, b) of it."""
        for k, (o, n) in enumerate(zip(f.offsets, f.numels)):
            a, b = max(o, f.lo), min(o + n, f.hi)
            if a < b:
                yield k, a - f.lo, b - f.lo

    def grad_norm_sq(self, count: Callable[[str], bool] | None = None,
                     reduce_dp: bool = False) -> torch.Tensor:
        """This rank's share of the squared L2 norm of the synchronised gradient (fp32).

        The share is the elements of this rank's shard (stage 0: all of them, counted on
        dp rank 0 only), so summing over the dp group counts every element once;
        ``reduce_dp=True`` does that sum here. ``count`` keeps only parameters whose name
        passes it (an engine skips replicated tensor-parallel weights on all but one tp
        rank, then sums the result over its pipeline and tensor dimensions too).
        """
        device = self.flats[0].master.device if self.flats else None
        total = torch.zeros((), dtype=torch.float32, device=device)
        for f in self.flats:
            g = f.master.grad
            if g is not None and count is None:
                total += g.pow(2).sum()
            elif g is not None:
                for k, a, b in self._owned(f):
                    if count(f.names[k]):
                        total += g[a:b].pow(2).sum()
        if self.stage == 0 and (reduce_dp or self.comm.rank == 0):
            return total
        if self.stage == 0:
            return total.zero_()
        if reduce_dp:
            self.comm.all_reduce(total)
        return total

    def scale_grads(self, factor: float) -> None:
        for f in self.flats:
            if f.master.grad is not None:
                f.master.grad.mul_(factor)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the dp-wide gradient norm (data parallelism only); returns the norm."""
        if not self._synced:
            self.finish_gradient_sync()
        norm = float(self.grad_norm_sq(reduce_dp=True).sqrt())
        if norm > max_norm:
            self.scale_grads(max_norm / (norm + 1e-6))
        return norm

    def all_reduce_grads(self, params: Iterable[nn.Parameter], comm: Comm) -> None:
        """Sum the synchronised gradients of ``params`` over another group ``comm``
        (sequence-parallel LayerNorm weights over tp). Summing over dp then over tp is
        summing over both, so doing it on the shards is exact; every rank of ``comm``
        must hold the same layout (the tp ranks of one dp rank do)."""
        want = {id(p) for p in params}
        parts = [(f.master.grad, a, b) for f in self.flats if f.master.grad is not None
                 for k, a, b in self._owned(f) if id(f.params[k]) in want]
        if comm.size == 1 or not parts:
            return
        flat = torch.cat([g[a:b] for g, a, b in parts])
        comm.all_reduce(flat)
        o = 0
        for g, a, b in parts:
            g[a:b].copy_(flat[o:o + b - a])
            o += b - a

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: model weights (or shards), gradients, optimizer.

        ``optimizer`` is the fp32 master shard plus the inner optimizer's per-element
        state; ``grads`` the full-size buffers alive plus the fp32 gradient shard.
        """
        model = list(self.module.parameters()) if self.module else self.params
        shards = [f.shard for f in self.flats]
        return {
            "params": storage_bytes(model + shards),
            "grads": storage_bytes([f.grad for f in self.flats] + [p.grad for p in model]
                                   + [f.master.grad for f in self.flats]),
            "optimizer": storage_bytes(f.master for f in self.flats)
            + optimizer_state_bytes(self.optimizer),
        }

    def _gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        """The whole padded flat from every rank's shard (stage 0: nothing to gather)."""
        return shard if self.stage == 0 else self.comm.all_gather(shard.contiguous())

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter in fp32, by name, from the masters (collective)."""
        return self.full_state_by_name()[0]

    # --- checkpoints -----------------------------------------------------------------
    def full_state_by_name(self, named: dict[str, nn.Parameter] | None = None
                           ) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
        """(fp32 weights, optimizer states) of every trainable parameter by name, whole
        (collective over dp; on the CPU). ``named`` chooses the names (default: the
        module's). Layout-free, so a checkpoint can be loaded at any dp size or stage."""
        names = {id(p): n for n, p in named.items()} if named else self._names
        weights, states = {}, {}
        for f in self.flats:
            master = self._gather_flat(f.master.detach())
            state = {k: self._gather_flat(v) if _elementwise(v) else v
                     for k, v in self.optimizer.state.get(f.master, {}).items()}
            for p, shape, o, n in zip(f.params, f.shapes, f.offsets, f.numels):
                name = names[id(p)]
                weights[name] = master[o:o + n].view(shape).cpu().clone()
                states[name] = {k: (v[o:o + n].view(shape) if _elementwise(v) else v)
                                .cpu().clone() if isinstance(v, torch.Tensor) else v
                                for k, v in state.items()}
        return weights, states

    def load_full_state_by_name(self, states: dict[str, dict],
                                weights: dict[str, torch.Tensor] | None = None) -> None:
        """Take this rank's shard of whole states (and fp32 weights, if given) by name."""
        with torch.no_grad():
            for f in self.flats:
                if weights is not None:
                    f.master.copy_(self._slice(f, [weights[n] for n in f.names]))
                first = states.get(f.names[0])
                if first:
                    self.optimizer.state[f.master] = {
                        k: self._slice(f, [states[n][k] for n in f.names]) if
                        _elementwise(v) else (v.clone() if isinstance(v, torch.Tensor) else v)
                        for k, v in first.items()}
        self._publish()

    def _slice(self, f: FlatParams, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's shard of the flat made of ``tensors`` (one per parameter of f)."""
        flat = torch.zeros(f.padded, dtype=tensors[0].dtype)
        for t, o, n in zip(tensors, f.offsets, f.numels):
            flat[o:o + n] = t.reshape(-1).cpu()
        return flat[f.lo:f.hi].clone().to(f.master.device)

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer, with the layout needed to reassemble it
        (``consolidate``); save one per dp rank."""
        return {
            "format": "minipar.zero/1", "stage": self.stage,
            "dp_size": self.comm.size, "dp_rank": self.comm.rank,
            "flats": [{"names": f.names, "shapes": f.shapes, "numel": f.numel,
                       "padded": f.padded, "lo": f.lo, "hi": f.hi,
                       "index": self._index[id(f.master)]} for f in self.flats],
            "masters": [f.master.detach().clone() for f in self.flats],
            "optimizer": _cloned(self.optimizer.state_dict()),  # a snapshot, not aliases
            "loss_scale": self.precision.scale if self.precision else None,
        }

    def load_state_dict(self, sd: dict) -> None:
        """Load a shard saved with the same layout. Any other layout (dp size, stage,
        buckets): ``full = consolidate(shards)``, then
        ``load_full_state_by_name(full["state"], full["params"])``."""
        mine = self.state_dict()
        if (sd["dp_size"], sd["dp_rank"], sd["flats"]) != \
                (mine["dp_size"], mine["dp_rank"], mine["flats"]):
            raise ValueError("checkpoint layout differs from this optimizer's; reshard with "
                             "consolidate() and load_full_state_by_name()")
        with torch.no_grad():
            for f, m in zip(self.flats, sd["masters"]):
                f.master.copy_(m)
        self.optimizer.load_state_dict(_cloned(sd["optimizer"]))  # torch would alias it
        if self.precision is not None and sd.get("loss_scale"):
            self.precision.scale = sd["loss_scale"]
        self._publish()


def _cloned(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _cloned(v) for k, v in x.items()}
    return [_cloned(v) for v in x] if isinstance(x, list) else x


def _elementwise(v) -> bool:
    """An optimizer state with one value per element (Adam's moments; not its step)."""
    return isinstance(v, torch.Tensor) and v.dim() > 0


def consolidate(shards: list[dict]) -> dict:
    """Reassemble the dp ranks' ``state_dict()``s into one layout-free state by name:
    ``{"params": {name: fp32}, "state": {name: {key: tensor}}, "param_groups": [...]}``."""
    shards = sorted(shards, key=lambda s: s["dp_rank"])
    params, state, groups = {}, {}, {}
    for i, flat in enumerate(shards[0]["flats"]):
        whole = {"master": torch.zeros(flat["padded"])}
        for s in shards:
            lo, hi = s["flats"][i]["lo"], s["flats"][i]["hi"]
            whole["master"][lo:hi] = s["masters"][i]
            for k, v in s["optimizer"]["state"].get(flat["index"], {}).items():
                if _elementwise(v):
                    whole.setdefault(k, torch.zeros(flat["padded"], dtype=v.dtype))[lo:hi] = v
                else:
                    whole.setdefault(k, v)
        o = 0
        for name, shape in zip(flat["names"], flat["shapes"]):
            n = torch.Size(shape).numel()
            views = {k: v[o:o + n].view(shape).clone() if _elementwise(v) else v
                     for k, v in whole.items()}
            params[name] = views.pop("master")
            state[name] = views
            o += n
        for g in shards[0]["optimizer"]["param_groups"]:
            if flat["index"] in g["params"]:
                entry = groups.setdefault(id(g), {**{k: v for k, v in g.items()
                                                     if k != "params"}, "names": []})
                entry["names"] += flat["names"]
    return {"params": params, "state": state, "param_groups": list(groups.values()),
            "loss_scale": shards[0].get("loss_scale")}
