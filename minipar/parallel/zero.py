"""ZeRO stages 0-2: data parallelism without redundant optimizer states and gradients
(Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", arXiv 1910.02054). Stage 3, which shards the weights too, is ``zero3.py``.

Plain data parallelism keeps on *every* rank the whole model state: with mixed-precision
Adam 2 bytes of weights, 2 of gradients and 12 of optimizer state (fp32 master, two
moments) per parameter, 16 Psi bytes for Psi parameters. ZeRO gives each of the N ranks
one N-th of that state and communicates instead:

* stage 1 (P_os): each rank keeps the optimizer state (and fp32 master) of its shard
  only. Gradients are *reduce-scattered* (rank r receives the summed gradient of shard r),
  each rank updates its shard, and an *all-gather* returns the new weights to everyone.
  A reduce-scatter plus an all-gather moves exactly what one all-reduce moves: 2(N-1)/N.
* stage 2 (P_os+g): the full-size gradient buffer of a bucket is reduce-scattered as
  soon as the last micro-batch's backward has filled it, and freed: between the end of
  backward and the step a rank holds the gradient of its shard only.
* stage 0 is plain data parallelism in the same machinery (all-reduce, no shards), so
  one optimizer covers the replicated and the sharded layouts.

``ZeroOptimizer`` is a ``torch.optim.Optimizer``: its ``param_groups`` hold *your*
parameters (set ``lr`` there), it has ``state``, ``defaults``, ``add_param_group``,
``zero_grad``, ``step``, ``state_dict``. Inside, the parameters of a bucket are laid end
to end in one flat buffer padded to a multiple of N (they become views of it); rank r
owns the contiguous shard [r*S, (r+1)*S), whose fp32 *master* the inner optimizer
(any torch optimizer class) updates.

Gradients. A hook takes each parameter's gradient as backward produces it and adds it to
the bucket's buffer, in fp32 by default (``grad_dtype``): summing many bf16 micro-batch
gradients in bf16 loses their low bits (Megatron accumulates and reduces in fp32 for the
same reason). A linear layer's weight gradient can skip the hook: ``accumulate_product``
adds it in the GEMM that makes it (``wgrad_fusion.py``). The bucket is reduced once every
gradient in it has arrived ``backwards_per_step`` times (an engine running m micro-batches
sets m), i.e. during the last micro-batch's backward. ``reduce_dtype=torch.bfloat16``
halves the bytes on the wire at a measured cost in drift (docs/architecture.md). As in
``DataParallel``: ``no_sync()``, ``finish_gradient_sync()``.

``offload=True`` (ZeRO-Offload, ``parallel/offload.py``): fp32 masters, their gradients,
states and step on the host; the 16-bit shard comes back before the all-gather.

Use::

    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=2, comm=mesh.dp, lr=1e-3)
    loss = model(x, y); loss.backward()
    opt.step()                       # finishes the gradient sync, steps, shares weights
    opt.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from minipar.comm import Comm, Pending
from minipar.meter import HeldBytes, PeakBytes, optimizer_state_bytes, storage_bytes
from minipar.parallel.dp import MB, Reducer, bucket_params, claim_gradients, trainable_params
from minipar.parallel.offload import HostShards, OnHost
from minipar.parallel.param_gather import ParamGathers
from minipar.parallel.zero_state import (  # noqa: F401 (consolidate: public here too)
    FlatParams,
    ShardedState,
    all_reduce_grads,
    clip_owned,
    consolidate,
    realize,
    sharded_state,
)

MASTER_DTYPE = torch.float32  # the dtype the optimizer updates (mixed precision's masters)


class ZeroOptimizer(OnHost, ShardedState, torch.optim.Optimizer):
    """ZeRO stage 0-2 around ``optimizer_class(**defaults)``, over ``comm`` (the dp group).

    ``params``: a module, parameters, or torch-style group dicts (pass ``module=`` for
    names and the broadcast of its buffers). ``precision``: the model's ``MixedPrecision``
    (its fp32 masters seed ours, its loss scale is undone). ``average``: divide the
    gradient sum by the dp size. ``shared``: parameters (or names) that
    ``all_reduce_grads`` will sum over another group; each gets a flat buffer of its own
    so its shard is the same slice on every rank of that group. ``overlap``: reduce
    buckets during backward (else at ``finish_gradient_sync``); ``bucket_mb=0``: a
    bucket per parameter. ``max_inflight``: stage 2's buckets in flight at once.
    ``overlap_param_gather``: ``step`` returns with stage 1/2's weight gathers in flight,
    each finished by the next forward (``param_gather.py``; needs ``module``).
    ``materialize``: ``values(name, p) -> tensor`` for a ``module`` on the meta device
    (``parallel/materialize.py``): each bucket is filled one weight at a time, never the
    whole fp32 local model; every rank computes the same values, nothing is broadcast
    (as ``Zero3``'s ``materialize``). ``offload``: see above.
    """

    def __init__(self, params: nn.Module | Iterable, optimizer_class: type =
                 torch.optim.AdamW, *, stage: int = 1, comm: Comm | None = None,
                 module: nn.Module | None = None, precision=None,
                 grad_dtype: torch.dtype | None = torch.float32,
                 reduce_dtype: torch.dtype | None = None, average: bool = True,
                 bucket_mb: float = 25.0, overlap: bool = True, max_inflight: int = 2,
                 broadcast: bool = True, shared: Iterable = (), materialize=None,
                 offload: bool = False, overlap_param_gather: bool = False, **defaults):
        if stage not in (0, 1, 2):
            raise ValueError(f"ZeroOptimizer covers stages 0-2, got {stage!r}; stage 3 "
                             "shards the weights too: minipar.parallel.zero3.Zero3")
        if isinstance(params, nn.Module):
            module, params = module or params, params.parameters()
        if materialize is not None and module is None:
            raise ValueError("materialize= needs module= (the weights' names)")
        self.stage, self.comm, self.module = stage, comm or Comm(), module
        self.precision, self.average, self.overlap = precision, average, overlap
        self.grad_dtype, self.reduce_dtype = grad_dtype, reduce_dtype
        self.optimizer_class, self.bucket_bytes = optimizer_class, bucket_mb * MB
        self.broadcast = broadcast
        self.max_inflight = max_inflight if stage == 2 else None
        self.overlap_param_gather, self._gathers = overlap_param_gather, ParamGathers(module)
        named = dict(module.named_parameters()) if module is not None else {}
        self._names = {id(p): n for n, p in named.items()}
        self._pos = {id(p): i for i, p in enumerate(named.values())}
        self._shared = {id(named[s]) if isinstance(s, str) else id(s) for s in shared}
        self._values = materialize
        self.offload = HostShards() if offload else None  # masters on the host
        self.flats: list[FlatParams] = []
        self.inner: torch.optim.Optimizer | None = None
        self._inner_group: dict[int, int] = {}
        self._grad_hooks: list = []
        self._arrivals: dict[int, int] = {}
        self._inflight: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._sync, self._synced = True, True
        self.backwards_per_step = 1  # backwards whose gradients one step sums
        self.grad_bytes, self._held = PeakBytes(), HeldBytes()  # peak; held now
        self.skipped_steps = 0
        for n, p in named.items():  # frozen weights on the meta device: made here
            if materialize is not None and p.is_meta and not p.requires_grad:
                realize(p, materialize(n, p).to(p.dtype))
        if broadcast and module is not None and materialize is None:  # and frozen: rank 0's
            with torch.no_grad():
                for t in [*module.buffers(), *(p for p in module.parameters()
                                               if not p.requires_grad)]:
                    self.comm.broadcast(t.data, src=0)
        super().__init__(params, defaults)
        self.state = self.inner.state  # per master shard: exp_avg, exp_avg_sq, ...

    # --- construction: torch calls this for each group -----------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        g = len(self.param_groups) - 1
        params = trainable_params(self.param_groups[g]["params"])
        claim_gradients(params, "ZeroOptimizer")
        for p in params:
            self._names.setdefault(id(p), f"group{g}.param{len(self._names)}")
            self._pos.setdefault(id(p), len(self._pos))
        new = self._bucket_flats(params, g, self._initial_values(params))
        if new:
            hyper = {k: v for k, v in self.param_groups[g].items() if k != "params"}
            group = {**hyper, "params": [f.master for f in new]}
            if self.inner is None:
                self.inner = self.optimizer_class([group], **self.defaults)
            else:
                self.inner.add_param_group(group)
            self._inner_group[g] = len(self.inner.param_groups) - 1
        self.flats = sorted(self.flats + new, key=lambda f: -max(self._pos[id(p)]
                                                                 for p in f.params))
        self._where = {id(p): (i, k) for i, f in enumerate(self.flats)
                       for k, p in enumerate(f.params)}
        self._reducer = Reducer([len(f.params) for f in self.flats], self._start,
                                self._complete, self.max_inflight)
        self._grad_hooks += [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _initial_values(self, params: list[nn.Parameter]
                        ) -> Callable[[nn.Parameter], torch.Tensor]:
        """``p -> its initial value``, the same on every rank: made when asked by
        ``materialize`` (the model is on the meta device: a bucket is filled one value
        at a time), else rank 0's weights (the fp32 masters, with precision)."""
        if self._values is not None:
            return lambda p: self._values(self._names[id(p)], p)
        sources = [self.precision.master(p).data if self.precision else p.data
                   for p in params]
        with torch.no_grad():
            for p, src in zip(params, sources):
                if self.broadcast:
                    self.comm.broadcast(src, src=0)
                if src is not p.data:
                    p.copy_(src)  # the 16-bit weights follow the shared masters
        by_id = {id(p): src for p, src in zip(params, sources)}
        return lambda p: by_id[id(p)]

    def _bucket_flats(self, params: list[nn.Parameter], group: int,
                      source: Callable[[nn.Parameter], torch.Tensor]) -> list[FlatParams]:
        """Buckets in reverse parameter order; a shared parameter alone in its own."""
        params = sorted(params, key=lambda p: self._pos[id(p)])
        alone = [[p] for p in params if id(p) in self._shared]
        buckets = bucket_params([p for p in params if id(p) not in self._shared],
                                self.bucket_bytes) + alone
        parts, rank = (1, 0) if self.stage == 0 else (self.comm.size, self.comm.rank)
        flats = []
        for b in buckets:
            b = sorted(b, key=lambda p: self._pos[id(p)])
            f = FlatParams(b, [self._names[id(p)] for p in b], group,
                           lambda k, b=b: source(b[k]), rank, parts, b[0].dtype, MASTER_DTYPE)
            f.bind()  # the parameters become views of the flat buffer
            if self.offload is not None:  # the master shard lives on the host only
                f.master = self.offload.to_host(f.master)
            flats.append(f)
        if self.precision is not None:
            self.precision.release()  # ours are the masters now
        return flats

    # --- gradients: hook, reduce (in bucket order), accumulate into the shard ---------
    def _on_grad(self, p: nn.Parameter) -> None:
        if p.grad is not None:  # (None: a fused weight, whose product arrived already)
            self._accumulate(p, lambda f, k, dtype, first: f.add_grad(k, p.grad, dtype, first))
            p.grad = None

    def fusable(self, linear: nn.Linear) -> bool:
        return id(linear.weight) in self._where

    def accumulate_product(self, p: nn.Parameter, dy: torch.Tensor, x: torch.Tensor) -> None:
        """p's gradient is dy^T x: add it to the sum in one GEMM (``wgrad_fusion.py``)."""
        self._accumulate(p, lambda f, k, dtype, first: f.add_product(k, dy, x, dtype, first))

    def _accumulate(self, p: nn.Parameter, add: Callable) -> None:
        i, k = self._where[id(p)]
        f = self.flats[i]
        self._reducer.check_open(i)
        # first: no arrival of p since zero_grad or finish_gradient_sync zeroed its slot
        if add(f, k, self.grad_dtype or p.dtype, id(p) not in self._arrivals):
            self._observe(f)
        self._synced = False
        arrived = self._arrivals[id(p)] = self._arrivals.get(id(p), 0) + 1
        if self._sync and self.overlap and arrived >= self.backwards_per_step:
            self._reducer.mark_ready(i, id(p))  # this step's last gradient of p

    def _start(self, i: int) -> Pending:
        f = self.flats[i]
        if f.grad is None:  # nothing arrived here: this rank contributes zeros
            f.grad = torch.zeros(f.padded, dtype=self.grad_dtype or f.full.dtype,
                                 device=f.full.device)
            self._held.update(id(f), self._held_by(f))  # observed once reduced, as before
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
        factor = self.precision.unscale_factor() if self.precision is not None else 1.0
        if self.offload is not None:  # the shard leaves now; lands (scaled) before it is read
            self.offload.grad_to_host(i, out, f.master, factor)
        elif f.master.grad is None and self.stage == 0 and out.dtype == f.master.dtype:
            f.master.grad = out  # stage 0: the reduced buffer itself
        else:
            g = out.to(f.master.dtype)
            f.master.grad = g if f.master.grad is None else f.master.grad.add_(g)
        if self.stage == 1:
            f.grad.zero_()  # stage 1 keeps the full-size gradient buffer
        else:
            f.grad = None
        if factor != 1.0 and self.offload is None:
            f.master.grad.mul_(factor)
        self._observe(f)

    def _held_by(self, f: FlatParams) -> tuple:  # (offload: the device's, not the host's)
        return (f.grad,) if self.offload else (f.grad, f.master.grad)

    def _observe(self, f: FlatParams) -> None:
        """``f``'s buffers changed: recount ``f``'s alone, not every flat's."""
        self.grad_bytes.observe(self._held.update(id(f), self._held_by(f)))

    def _grads_held(self) -> int:
        return storage_bytes(t for f in self.flats for t in self._held_by(f))

    def finish_gradient_sync(self) -> None:
        """Reduce every bucket not reduced yet, wait, and add the result to the shard."""
        self._reducer.flush()
        if self.offload is not None:
            self.offload.land_all()
        self._arrivals.clear()
        self._synced = True

    # --- the step ------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """Update this rank's shard, share the new weights; False if skipped (overflow)."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step takes no closure")
        if not self._synced:
            self.finish_gradient_sync()
        if self.precision is not None and self.precision.scaling:
            bad = torch.zeros((), device=self.flats[0].full.device)
            for f in self.flats:
                if f.master.grad is not None and not torch.isfinite(f.master.grad).all():
                    bad.fill_(1.0)
            self.comm.all_reduce(bad, op="max")
            self.precision.update_scale(bool(bad))
            if bool(bad):
                self.skipped_steps += 1
                self.zero_grad()
                return False
        for g, group in enumerate(self.param_groups):  # lr and co. as the caller set them
            if g in self._inner_group:
                self.inner.param_groups[self._inner_group[g]].update(
                    {k: v for k, v in group.items() if k != "params"})
        self.inner.step()
        self.publish(self.overlap_param_gather)
        return True

    @torch.no_grad()
    def publish(self, overlap: bool = False) -> None:
        """New fp32 shards -> the model's weights: copy (stage 0) or all-gather (1, 2);
        ``overlap``: each gather finishes when the next forward first needs its bucket
        (``param_gather.py``; ``step`` passes ``overlap_param_gather``)."""
        if self.offload is not None:  # cast on the host, 16-bit bytes back, then gathered
            return self.offload.publish_flats(self.flats, self.comm, gather=self.stage > 0)
        if self.stage > 0:
            return self._gathers.start(self.flats, self.comm, overlap)
        for f in self.flats:
            if f.master.untyped_storage().data_ptr() != f.full.untyped_storage().data_ptr():
                f.full.copy_(f.master.detach())  # (fp32: the master *is* the weights)

    def finish_param_sync(self) -> None:
        """Wait for the weights' gathers still in flight (``overlap_param_gather``)."""
        self._gathers.wait_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for f in self.flats:  # stage 1 keeps its full buffer (_complete zeroed it if reduced)
            f.master.grad = None
            if f.grad is not None and (self.stage != 1 or not self._synced):
                f.grad = f.grad.zero_() if self.stage == 1 else None
        for p in [p for group in self.param_groups for p in group["params"]]:
            p.grad = None
        if self.inner is not None:  # (a wrapped OffloadOptimizer zeroes its host grads)
            self.inner.zero_grad(set_to_none=True)
        self._arrivals.clear()
        self._held = HeldBytes()  # recounted once a step: _observe keeps it current
        for f in self.flats:
            self._held.update(id(f), self._held_by(f))
        self.grad_bytes.reset(self._held.total)

    # --- clipping, other groups, accounting -----------------------------------------
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the dp-wide gradient norm (data parallelism only); returns the norm."""
        if not self._synced:
            self.finish_gradient_sync()
        if self.offload is not None:  # host shards: the norm is summed on the device
            return self.offload.clip(self, max_norm)
        return clip_owned(self.flats, self.comm, max_norm)

    def all_reduce_grads(self, params: Iterable, comm: Comm) -> None:
        """Sum the synchronised gradients of ``params`` (or names) over another group
        ``comm`` (sequence-parallel norms over tp; a tied embedding over the first and
        last pipeline stages). Exact on the shards when the parameter was named in
        ``shared`` at construction (its own flat buffer)."""
        names = {p if isinstance(p, str) else self._names.get(id(p)) for p in params}
        if self.offload is not None:  # host shards: the sum runs on the device (NCCL)
            return self.offload.all_reduce_grads(self.flats, names, comm)
        all_reduce_grads(self.flats, names, comm)

    def memory_bytes(self, optimizer=None) -> dict[str, int]:
        """Bytes this rank holds: weights, gradients (the peak of this step: full-size
        buffers and fp32 shard), optimizer (fp32 master shards and the inner state)."""
        weights = list(self.module.parameters()) if self.module else \
            [p for g in self.param_groups for p in g["params"]]
        full = {f.full.untyped_storage().data_ptr() for f in self.flats}
        out = {"params": storage_bytes(weights),
               "grads": max(self.grad_bytes.peak, self._grads_held())}
        if self.offload is not None:  # ZeRO-Offload: masters, grads, states on the host
            return out | {"optimizer": 0,
                          "host_optimizer": self.offload.host_bytes(self.flats, self.inner)}
        host = getattr(self.inner, "host_bytes", None)  # a wrapped OffloadOptimizer
        out["optimizer"] = (0 if host else optimizer_state_bytes(self.inner)) + storage_bytes(
            f.master for f in self.flats if f.master.untyped_storage().data_ptr() not in full)
        return out | ({"host_optimizer": host()} if host else {})

    # --- checkpoints (layout-free by name; see zero_state.py) -------------------------
    def _stepper(self, optimizer=None) -> torch.optim.Optimizer:
        return self.inner  # (the state by name is always this optimizer's own)

    def state_dict(self) -> dict:
        """This rank's shard, with the layout to reassemble it (``consolidate``)."""
        return sharded_state(self.flats, self.inner, self.comm, self.stage,
                             self.precision.scale if self.precision else None)

    def load_state_dict(self, sd: dict) -> None:
        """Load a shard saved with the same layout. Any other layout: ``consolidate``,
        then ``load_full_state_by_name(full["state"], full["params"])``."""
        from minipar.parallel.zero_state import load_sharded_state

        load_sharded_state(self.flats, self.inner, self.comm, sd)
        if self.precision is not None and sd.get("loss_scale"):
            self.precision.scale = sd["loss_scale"]
        self.publish()
