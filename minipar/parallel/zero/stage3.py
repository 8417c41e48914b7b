"""ZeRO stage 3: shard the weights too, gather each unit just in time, free it after
(Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC20, arXiv 1910.02054, section 5.3; PyTorch FSDP, Zhao et al. 2023, arXiv
2304.11277).

Stage 3 keeps on each of the N ranks 1/N of the weights too (16 Psi / N bytes of model
state). A *unit* (a block: by default every module of an ``nn.ModuleList``) is gathered
just before its forward and freed after; gathered again for its backward, freed, and
its gradient reduce-scattered at once: a rank holds a few units' full weights or
gradients at most. 3(N-1)/N of the weights move per step, 1.5x data parallelism.

What lives where (FSDP's choices):
* the wrapper's ``parameters()`` are the fp32 *master shards*, one per unit: give them
  to any torch optimizer; each gradient has its shard's shape. After ``optimizer.step()``
  call ``publish()`` (or ``publish_after(optimizer)`` once) to share the new weights.
* compute runs on ``param_dtype`` (bf16, say) copies gathered per unit; the full fp32
  model never exists on the device after construction (built one unit at a time).
* gradients are accumulated per unit in ``grad_dtype`` (fp32) and reduced in
  ``reduce_dtype`` (default the same). Under gradient accumulation each micro-batch's
  backward reduce-scatters its units at once: between micro-batches a rank keeps only
  its fp32 gradient shard (FSDP2's default; ``no_sync()`` keeps the full-size unit
  gradients instead and reduces once, trading memory for communication).
* modules of the types in ``replicate`` (small norms, say) are not sharded: their
  weights stay gathered and their gradients are all-reduced.

The module's trainable weights become plain tensors viewing their unit's flat buffer
(no storage while the unit is free): its own code runs as written. Wrap it on its
device. Every rank runs the same units in the same order, through ``__call__``. The
zero-bubble schedule's deferred W pass is refused (``config.validate``). ``place``
(``offload.py``): the fp32 masters on the device, or on the host (ZeRO-Offload; the
gathers then read a 16-bit device copy of the shard, refreshed after each step).
``gather`` (``gather.py``): what the all-gathers carry, the compute dtype (default) or,
for the weights of float8 linears, float8 bytes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from minipar.comm import Comm
from minipar.meter import storage_bytes
from minipar.parallel.zero.buckets import broadcast_module
from minipar.parallel.zero.gather import Float8Weights, InComputeDtype
from minipar.parallel.zero.offload import OnDevice, OnHost
from minipar.parallel.zero.shards import FlatParams, Shards
from minipar.parallel.zero.units import Unit, default_units, group_weights, who_gathers

MASTER_DTYPE = torch.float32
# a unit's full-size gradient on the wire at once, beside the one filling
UNITS_IN_FLIGHT = 1


class Zero3(nn.Module):
    """Shard ``module``'s trainable weights over ``comm`` (the dp group), ZeRO-3 style.

    ``units``: the modules gathered as one (default ``default_units``); a weight outside
    every unit is gathered by the module that registers it (an embedding, a head; a tied
    weight by each module that uses it). ``prefetch``: start gathering the next unit
    (forward) or the previous one (backward) while this one computes. ``shared``: groups
    of weight names that ``all_reduce_grads`` will sum over another group, a group per
    such sum (sequence parallelism's replicated norms over tp, a tied embedding over its
    pair): a unit's weights of one group share a flat of their own, laid out alike on
    every rank of that group, so that its shard is the same slice there (one gather and
    one reduction a unit, not one a weight). ``average``: divide the gradient sum by the
    dp size. ``reduce_comm``: where the gradients are reduced (default ``comm``): a
    second group over the same ranks (``RankMesh.reductions``) lets a unit's
    reduce-scatter run beside the next unit's all-gather rather than ahead of it.
    ``materialize``: ``values(name, p) -> tensor`` for a ``module`` built on the meta
    device (``parallel/materialize.py``): each weight is made when its unit is built and
    only this rank's shard kept (the local model never exists whole); nothing is
    broadcast, every rank computes the same values. ``place``: see above. ``only``: the
    names of the weights this wrapper shards over ``comm`` (default: every trainable
    one); the others are left to another wrapper of the same module over its own group
    (``parallel/ep.py``: the experts over their replicas). ``gather``: see above.
    """

    def __init__(self, module: nn.Module, comm: Comm | None = None, *,
                 units: Iterable[nn.Module] | None = None,
                 param_dtype: torch.dtype | None = None,
                 grad_dtype: torch.dtype = torch.float32,
                 reduce_dtype: torch.dtype | None = None,
                 replicate: tuple[type, ...] = (), shared: Iterable[Iterable[str]] = (),
                 prefetch: bool = True, average: bool = True, broadcast: bool = True,
                 max_inflight: int = UNITS_IN_FLIGHT, materialize=None,
                 place: OnDevice | OnHost | None = None, only: Iterable[str] | None = None,
                 gather: InComputeDtype | Float8Weights | None = None,
                 reduce_comm: Comm | None = None):
        super().__init__()
        self.shards = Shards(comm or Comm(), place or OnDevice())
        self.comm, self.place = self.shards.comm, self.shards.place
        self.reduce_comm = reduce_comm or self.comm
        if self.reduce_comm.ranks != self.comm.ranks:
            raise ValueError(f"reduce_comm spans ranks {self.reduce_comm.ranks}, the weights "
                             f"are sharded over {self.comm.ranks}: they must be the same")
        self.gather = gather or InComputeDtype()
        self.module = module
        self.grad_dtype, self.reduce_dtype = grad_dtype, reduce_dtype or grad_dtype
        self.prefetch, self.average, self.max_inflight = prefetch, average, max_inflight
        only = None if only is None else set(only)
        named = {n: p for n, p in module.named_parameters()
                 if p.requires_grad and (only is None or n in only)}
        self._values = materialize
        if broadcast and materialize is None:  # every rank starts from rank 0's weights
            broadcast_module(module, self.comm)
        for p in module.parameters():  # frozen weights: replicated, in the compute dtype
            if not p.requires_grad and param_dtype is not None and p.is_floating_point():
                p.data = p.data.to(param_dtype)
        self.names = list(named)  # the reference names, in order
        self._name_of = {id(p): n for n, p in named.items()}
        self.units: list[Unit] = []
        self._build(named, set(units) if units is not None else set(default_units(module)),
                    replicate, [set(group) for group in shared], param_dtype)
        self.masters = nn.ParameterList([f.master for u in self.units for f in u.flats])
        self.shards.flats = [f for u in self.units for f in u.flats]
        self._unit_of = {id(t): u for u in self.units for t in u.leaves}
        self._where = {id(t): (f, k) for f in self.flats for k, t in enumerate(f.params)}
        self._units_of = {id(m): [u for u in self.units if any(x is m for x in u.modules)]
                          for m in self._triggers}
        self._inflight: deque = deque()
        self._index = {id(f): i for i, f in enumerate(self.flats)}
        self._end_queued = False
        self.backwards_per_step, self._backwards = 1, 0  # (OnHost: sends at the last)
        hooks = self.shards.hooks
        hooks += [t.register_post_accumulate_grad_hook(self._on_grad)
                  for u in self.units for t in u.leaves]
        hooks += [torch.autograd.graph.register_multi_grad_hook(
            u.leaves, partial(self._unit_grads_computed, u), mode="all") for u in self.units]
        for m in self._triggers:
            hooks += [m.register_forward_pre_hook(self._pre_forward),
                      m.register_forward_hook(self._post_forward)]

    @property
    def flats(self) -> list[FlatParams]:
        return self.shards.flats

    # --- construction: who gathers what (units.py), one unit's values at a time --
    def _build(self, named: dict, given: set, replicate: tuple, shared: list[set],
               param_dtype: torch.dtype | None) -> None:
        triggers, owners, self._triggers = who_gathers(self.module, named, given)
        by_set = group_weights(named, triggers, replicate)
        leaves: dict[int, torch.Tensor] = {}
        parts, rank = self.comm.size, self.comm.rank
        any_shared = set().union(*shared)
        for (_, replicated), params in by_set.items():
            kinds = [self.gather.kind(self._name_of[id(p)]) for p in params]
            groups = [[p for p, k in zip(params, kinds) if k == kind
                       and self._name_of[id(p)] not in any_shared]
                      for kind in dict.fromkeys(kinds)]
            groups += [[p for p in params if self._name_of[id(p)] in names] for names in shared]
            flats = []
            for group in filter(None, groups):
                dtype = param_dtype or group[0].dtype
                names = [self._name_of[id(p)] for p in group]
                sources = [p.detach() for p in group] if self._values is None else \
                    (lambda k, g=group, ns=names: self._values(ns[k], g[k]))
                f = FlatParams(group, names, 0, sources, 0 if replicated else rank,
                               1 if replicated else parts, dtype, MASTER_DTYPE,
                               keep_full=False)
                f.params = []  # the weights become plain leaves viewing the flat buffer
                for p, o, n in zip(group, f.offsets, f.numels):
                    leaf = torch.empty(0, dtype=dtype, device=f.master.device).requires_grad_()
                    leaf.data = f.full[o:o + n].view(p.shape)
                    leaves[id(p)] = leaf
                    f.params.append(leaf)
                    if p.device.type != "meta":
                        p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # free it
                # what the gathers read this rank's slot from (a replicated unit: its
                # buffer, always whole), then where the master lives
                f.shard = f.full if replicated else self.place.working_copy(f.master, dtype)
                f.master = self.place.keep(f.master)
                if not replicated:
                    f.full.untyped_storage().resize_(0)  # gathered when used
                    self.gather.adopt(f)
                flats.append(f)
            self.units.append(Unit(triggers[id(params[0])], flats, replicated))
        for m, local, p in owners:  # swap each registered weight for its leaf
            del m._parameters[local]
            setattr(m, local, leaves[id(p)])
        pos = {id(m): i for i, m in enumerate(self._triggers)}
        # reduction order: backward finishes the last-used module first
        self.units.sort(key=lambda u: -min(pos[id(m)] for m in u.modules))

    # --- gather just in time, free right after ------------------------------------------
    def _gather(self, u: Unit, async_op: bool = False) -> None:
        if u.state == "free":
            u.pending = [self.gather.start(f, self.comm) for f in u.flats]
            u.state = "gathering"
            self.shards.held("params", 0, self._params_held)
        if u.state == "gathering" and not async_op:
            for pending in u.pending:
                pending.wait()
            u.pending, u.state = [], "gathered"

    def _free(self, u: Unit) -> None:
        if u.state != "free" and not u.replicated:
            self._gather(u)  # an in-flight gather must land before its buffer goes
            for f in u.flats:
                self.gather.free(f)
            u.state = "free"

    def _params_held(self) -> list[torch.Tensor]:
        """Gathered buffers, and the shards the gathers read when they are in the compute
        dtype (an fp32 master of 16-bit weights counts as optimizer state)."""
        return [t for f in self.flats for t in self.gather.held(f)] + [
            f.shard for f in self.flats if f.shard.dtype == f.full.dtype]

    def _neighbour(self, module: nn.Module, step: int) -> list[Unit]:
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
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(partial(self._pre_backward, module))

    def _pre_backward(self, module: nn.Module, grad: torch.Tensor) -> None:
        """Runs when the gradient of the module's output is ready: its backward is next."""
        if not self._end_queued:  # one clean-up at the end of this backward pass
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._end_queued = True
        for u in self._units_of[id(module)]:
            self._gather(u)
            if not u.in_backward:
                u.in_backward, u.waiting = True, {id(t) for t in u.leaves}
        if self.prefetch:
            for u in self._neighbour(module, -1):
                self._gather(u, async_op=True)

    def _end_of_backward(self) -> None:
        """Free whatever is still gathered (a unit with a weight unused this pass), and
        land the reductions in flight: after ``backward()`` the gradient shards are
        complete, so an optimizer may step without a ``finish_gradient_sync`` (as FSDP)."""
        self._end_queued = False
        for u in self.units:
            u.in_backward = False
            self._free(u)
        while self._inflight:
            self._complete_oldest()
        self._backwards += 1

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Hold every unit's full weights for a while (evaluation, inspection)."""
        for u in self.units:
            self._gather(u)
        try:
            yield
        finally:
            for u in self.units:
                self._free(u)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # --- gradients: accumulate per unit, reduce-scatter as each unit completes ----------
    def _on_grad(self, t: torch.Tensor) -> None:
        if t.grad is not None:  # (None: a fused weight, whose product arrived already)
            g, t.grad = t.grad, None
            self._add(t, lambda f, k: f.add_grad(k, g, self.grad_dtype))

    def fusable(self, linear: nn.Linear) -> bool:
        """Whether ``wgrad_fusion`` may replace ``linear``: not when its own call gathers
        its weight (a weight outside every unit): the new module would lose that hook."""
        return id(linear.weight) in self._where and all(m is not linear
                                                        for m in self._triggers)

    def accumulate_product(self, t: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
        """t's gradient is dy^T x: add it to the unit's sum in one GEMM."""
        self._add(t, lambda f, k: f.add_product(k, dy, x, self.grad_dtype))

    def _add(self, t: torch.Tensor, add) -> None:
        f, k = self._where[id(t)]
        if add(f, k):  # (the buffer knows which slots a gradient reached: ``FlatParams``)
            self.shards.held("grads", 0, self._grads_held)
        self._arrived(t)

    def _arrived(self, t: torch.Tensor) -> None:
        u = self._unit_of[id(t)]
        u.dirty = True
        u.waiting.discard(id(t))
        if u.in_backward and not u.waiting:  # the unit's backward is done
            u.in_backward = False
            self._free(u)
            if self.shards.sync:
                self._reduce(u)

    def _unit_grads_computed(self, u: Unit, grads: list[torch.Tensor | None]) -> None:
        """Once per backward: a weight with no gradient was unused and counts as arrived
        (zero), so the reduce-scatter starts at the same point on every rank."""
        for t, g in zip(u.leaves, grads):
            if g is None:
                self._arrived(t)

    def _reduce(self, u: Unit) -> None:
        u.dirty = False
        for f in u.flats:
            wire = f.reduced_grad(self.grad_dtype, f.full.device)
            # the buffer now belongs to the collective: the next micro-batch's gradients
            # go to a new one (it may arrive while this one is still on the wire)
            f.grad, wire = None, wire.to(self.reduce_dtype)
            if self.average:
                wire.div_(self.comm.size)
            if u.replicated:
                out, pending = wire, self.reduce_comm.all_reduce(wire, async_op=True)
            else:
                out = torch.empty(f.hi - f.lo, dtype=wire.dtype, device=wire.device)
                pending = self.reduce_comm.reduce_scatter_into(out, wire, async_op=True)
            while len(self._inflight) >= self.max_inflight:  # make room first: the
                self._complete_oldest()  # buffers in flight are all the memory it costs
            self._inflight.append((f, wire, out, pending))
            self.shards.held("grads", 0, self._grads_held)

    def _complete_oldest(self) -> None:
        f, _, out, pending = self._inflight.popleft()
        pending.wait()
        # OnHost: to the host at the step's last backward (the earlier ones' shards add
        # up on the device: no host pass, one crossing)
        more = self._backwards + 1 < self.backwards_per_step
        self.place.grad_in(self._index[id(f)], out, f.master, more=more)
        self.shards.held("grads", 0, self._grads_held)

    def _grads_held(self) -> list[torch.Tensor]:
        """The gradient tensors on the device: unit buffers, shards, those in flight."""
        return [t for f in self.flats for t in [f.grad, *self.place.device_grads(f.master)]]\
            + [t for _, w, o, _ in self._inflight for t in (w, o)] + self.place.on_device()

    def finish_gradient_sync(self) -> None:
        """Reduce every unit with gradients not reduced yet (in unit order) and wait."""
        for u in self.units:
            u.in_backward = False
            self._free(u)
            if u.dirty:
                self._reduce(u)
        while self._inflight:
            self._complete_oldest()
        self.place.land_all()
        self._backwards = 0

    def no_sync(self) -> AbstractContextManager[None]:
        """Keep the full-size unit gradients; the next synchronised backward reduces."""
        return self.shards.no_sync()

    # --- after the optimizer step --------------------------------------------------------
    @torch.no_grad()
    def publish(self) -> None:
        """The updated fp32 masters -> what the gathers read (``f.shard``): a replicated
        unit's weights; a sharded unit's master itself (OnDevice: nothing to do, cast
        when next gathered) or its 16-bit device copy (OnHost); float8 gathers take new
        scales at their next gather."""
        self.place.publish([f.master for f in self.flats], [f.shard for f in self.flats])
        self.gather.publish()

    def publish_after(self, optimizer: torch.optim.Optimizer):
        """Call ``publish`` after every ``optimizer.step()`` (torch step hooks; before
        it, every gradient lands, for an optimizer stepping right after backward)."""
        optimizer.register_step_pre_hook(lambda *_: self.place.land_all())
        return optimizer.register_step_post_hook(lambda *_: self.publish())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for f in self.flats:
            f.master.grad, f.grad = None, None
        self._backwards = 0
        if self.shards.observers:  # a new step's peaks start from what is held now
            self.shards.held("grads", 0, self._grads_held, peak=False)
            self.shards.held("params", 0, self._params_held, peak=False)
            for observer in self.shards.observers:
                observer.reset()

    # --- clipping, other groups, accounting, checkpoints -----------------------------------
    def grad_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, gradient elements) this rank owns (``Shards.grad_shards``)."""
        return self.shards.grad_shards()

    def scale_grads(self, factor: float | torch.Tensor) -> None:
        self.shards.scale_grads(factor)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the dp-wide gradient norm (data parallelism only); returns the norm."""
        self.finish_gradient_sync()
        return self.shards.clip(max_norm)

    def all_reduce_grads(self, names: Iterable[str], comm: Comm) -> None:
        """Sum the gradient shards of ``names`` over another group (see ``shared``)."""
        self.shards.all_reduce_grads(set(names), comm)

    def finish_param_sync(self) -> None:
        """Every unit is gathered before it runs: nothing is left in flight."""

    def observe(self, observer) -> None:
        """Report every change of the weight and gradient buffers to ``observer``."""
        self.shards.observers.append(observer)

    def memory_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes held now: weights (shards and gathered units), gradients (unit buffers
        and fp32 shards); optimizer: fp32 master shards that are not the weights, and
        ``optimizer``'s state (``place``'s split between device and host)."""
        separate = [f.master for f in self.flats if f.full.dtype != f.master.dtype]
        return {"params": storage_bytes(self._params_held()),
                "grads": storage_bytes(self._grads_held()),
                **self.place.optimizer_bytes(separate, optimizer)}

    def remove(self) -> None:
        """Remove the hooks (the module keeps its weights as they are)."""
        self.shards.remove()

    def full_state_by_name(self, optimizer: torch.optim.Optimizer | None = None
                           ) -> tuple[dict, dict]:
        """(fp32 weights, optimizer states) by reference name, whole (collective)."""
        return self.shards.full_state(self._stepper(optimizer))

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self.full_state_by_name()[0]

    def load_full_state_by_name(self, states: dict, weights: dict | None = None,
                                optimizer: torch.optim.Optimizer | None = None) -> None:
        """Take this rank's shard of whole states (and fp32 weights) by name."""
        self.shards.load_full_state(self._stepper(optimizer), states, weights)
        self.publish()

    def _stepper(self, optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer:
        """The optimizer whose state is keyed by the masters (none: an empty one)."""
        return optimizer or torch.optim.SGD(self.masters, lr=0.0)
