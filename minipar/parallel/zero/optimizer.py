"""ZeRO stages 0-2: data parallelism without redundant optimizer states and gradients
(Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC20, arXiv 1910.02054). Stage 3, which shards the weights too: ``stage3.py``.

Plain data parallelism keeps on *every* rank the whole model state: with mixed-precision
Adam 2 bytes of weights, 2 of gradients and 12 of optimizer state (fp32 master, two
moments) per parameter, 16 Psi bytes for Psi parameters. ZeRO gives each of the N ranks
one N-th of that state and communicates instead:

* stage 0 is data parallelism itself (the engine's ``--ddp``, PyTorch DDP's design):
  every bucket's gradient is all-reduced, every rank steps the whole model;
* stage 1 (P_os): each rank keeps the optimizer state (and fp32 master) of its shard
  only. Gradients are *reduce-scattered* (rank r receives the summed gradient of shard r),
  each rank updates its shard, and an *all-gather* returns the new weights to everyone.
  A reduce-scatter plus an all-gather moves exactly what one all-reduce moves: 2(N-1)/N;
* stage 2 (P_os+g): a bucket's full-size gradient buffer is reduce-scattered as soon as
  the last micro-batch's backward has filled it, and freed.

``ZeroOptimizer`` is a ``torch.optim.Optimizer`` (its ``param_groups`` hold *your*
parameters). The parameters of a bucket become views of one flat buffer
(``shards.FlatParams``); a hook adds each gradient to the bucket's sum, in fp32 by
default (``grad_dtype``: summing many bf16 micro-batch gradients in bf16 loses their low
bits; Megatron accumulates in fp32 for the same reason), and the bucket is reduced
(``mode``, ``buckets.py``) once every gradient in it has arrived ``backwards_per_step``
times. A linear layer's weight gradient can skip the hook: ``accumulate_product`` adds it
in the GEMM that makes it (``wgrad_fusion.py``). ``place``: where the fp32 masters live
and step, ``offload.OnDevice()`` or ``offload.OnHost()`` (ZeRO-Offload).

Use::

    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=2, comm=mesh.dp, lr=1e-3)
    loss = model(x, y); loss.backward()
    opt.step()                       # finishes the gradient sync, steps, shares weights
    opt.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

import torch
from torch import nn

from minipar.comm import Comm, Pending
from minipar.meter import storage_bytes
from minipar.parallel.precision import MixedPrecision
from minipar.parallel.zero.buckets import (
    MB,
    MODES,
    Reducer,
    bucket_params,
    claim_gradients,
    release_gradients,
    trainable_params,
)
from minipar.parallel.zero.offload import OnDevice, OnHost
from minipar.parallel.zero.param_gather import ParamGathers
from minipar.parallel.zero.shards import (
    FlatParams,
    Shards,
    load_sharded_state,
    realize,
    sharded_state,
)

MASTER_DTYPE = torch.float32  # the dtype the optimizer updates (mixed precision's masters)
# ZeRO-2's full-size buckets on the wire at once (beside the one filling): bounded, as the
# buffer of each is alive until its reduce-scatter completes
BUCKETS_IN_FLIGHT = 2


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO stage 0-2 around ``optimizer_class(**defaults)``, over ``comm`` (the dp group).

    ``params``: a module, parameters, or torch-style group dicts (pass ``module=`` for
    names and the broadcast of its buffers). ``precision``: the model's
    ``MixedPrecision`` (its fp32 masters seed ours). ``mode``: ``naive`` (a bucket per
    parameter, reduced after backward), ``bucketed`` (``bucket_mb`` buckets, reduced
    after backward) or ``overlapped`` (reduced during backward). ``average``: divide the
    gradient sum by the dp size. ``shared``: groups of parameters (or names) that
    ``all_reduce_grads`` will sum over another group, a group per such sum (as
    ``Zero3``'s): each group's weights share a bucket of their own, laid out alike on
    every rank of that group, so that its shards are the same slices there.
    ``max_inflight``: stage 2's buckets in flight at once. ``overlap_param_gather``:
    ``step`` returns with stage 1/2's weight gathers in flight, each finished by the
    next forward (``param_gather.py``; needs ``module``). ``materialize``: ``values(name, p) ->
    tensor`` for a ``module`` on the meta device (``parallel/materialize.py``): each
    bucket is filled one weight at a time, never the whole fp32 local model; every rank
    computes the same values, nothing is broadcast. ``place``: see above.
    """

    def __init__(self, params: nn.Module | Iterable, optimizer_class: type =
                 torch.optim.AdamW, *, stage: int = 1, comm: Comm | None = None,
                 module: nn.Module | None = None, precision: MixedPrecision | None = None,
                 mode: str = "overlapped", grad_dtype: torch.dtype | None = torch.float32,
                 reduce_dtype: torch.dtype | None = None, average: bool = True,
                 bucket_mb: float = 25.0, max_inflight: int = BUCKETS_IN_FLIGHT,
                 broadcast: bool = True,
                 shared: Iterable[Iterable] = (), materialize=None,
                 place: OnDevice | OnHost | None = None,
                 overlap_param_gather: bool = False, **defaults):
        if stage not in (0, 1, 2):
            raise ValueError(f"ZeroOptimizer covers stages 0-2, got {stage!r}; stage 3 "
                             "shards the weights too: minipar.parallel.zero.Zero3")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(params, nn.Module):
            module, params = module or params, params.parameters()
        if materialize is not None and module is None:
            raise ValueError("materialize= needs module= (the weights' names)")
        self.stage, self.module, self.precision = stage, module, precision
        self.shards = Shards(comm or Comm(), place or OnDevice())
        self.comm, self.place = self.shards.comm, self.shards.place
        self.average, self.overlap = average, mode == "overlapped"
        self.grad_dtype, self.reduce_dtype = grad_dtype, reduce_dtype
        self.optimizer_class = optimizer_class
        self.bucket_bytes = 0 if mode == "naive" else bucket_mb * MB
        self.broadcast = broadcast
        self.max_inflight = max_inflight if stage == 2 else None
        self.overlap_param_gather, self._gathers = overlap_param_gather, ParamGathers(module)
        named = dict(module.named_parameters()) if module is not None else {}
        self._names = {id(p): n for n, p in named.items()}
        self._pos = {id(p): i for i, p in enumerate(named.values())}
        self._shared = [{id(named[s]) if isinstance(s, str) else id(s) for s in group}
                        for group in shared]
        self._values = materialize
        self.inner: torch.optim.Optimizer | None = None
        self._inner_group: dict[int, int] = {}
        self._params: list[nn.Parameter] = []
        self._arrivals: dict[int, int] = {}
        self._inflight: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._synced = True
        self.backwards_per_step = 1  # backwards whose gradients one step sums
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

    @property
    def flats(self) -> list[FlatParams]:
        return self.shards.flats

    # --- construction: torch calls this for each group -----------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        g = len(self.param_groups) - 1
        params = trainable_params(self.param_groups[g]["params"])
        claim_gradients(params, "ZeroOptimizer")
        self._params += params
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
        # the order backward completes them in: a bucket is complete when its earliest
        # parameter's gradient arrives. (A group of shared ones, sequence parallelism's
        # norms of every block, completes near the end: ordered by its latest parameter
        # it would come first and hold back every bucket behind it, and ZeRO-2 would keep
        # every full-size gradient buffer to the end of the backward.)
        self.shards.flats = sorted(self.flats + new, key=lambda f: -min(self._pos[id(p)]
                                                                        for p in f.params))
        self._where = {id(p): (i, k) for i, f in enumerate(self.flats)
                       for k, p in enumerate(f.params)}
        self._reducer = Reducer([len(f.params) for f in self.flats], self._start,
                                self._complete, self.max_inflight)
        self.shards.hooks += [p.register_post_accumulate_grad_hook(self._on_grad)
                              for p in params]

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
        """Buckets in reverse parameter order; each group of shared ones in its own."""
        params = sorted(params, key=lambda p: self._pos[id(p)])
        any_shared = set().union(*self._shared)
        apart = [[p for p in params if id(p) in group] for group in self._shared]
        buckets = bucket_params([p for p in params if id(p) not in any_shared],
                                self.bucket_bytes) + [b for b in apart if b]
        parts, rank = (1, 0) if self.stage == 0 else (self.comm.size, self.comm.rank)
        flats = []
        for b in buckets:
            b = sorted(b, key=lambda p: self._pos[id(p)])
            f = FlatParams(b, [self._names[id(p)] for p in b], group,
                           lambda k, b=b: source(b[k]), rank, parts, b[0].dtype, MASTER_DTYPE)
            f.bind()  # the parameters become views of the flat buffer
            f.master = self.place.keep(f.master)
            flats.append(f)
        if self.precision is not None:
            self.precision.release()  # ours are the masters now
        return flats

    # --- gradients: hook, reduce (in bucket order), accumulate into the shard ---------
    def _on_grad(self, p: nn.Parameter) -> None:
        if p.grad is not None:  # (None: a fused weight, whose product arrived already)
            self._accumulate(p, lambda f, k, dtype: f.add_grad(k, p.grad, dtype))
            p.grad = None

    def fusable(self, linear: nn.Linear) -> bool:
        return id(linear.weight) in self._where

    def accumulate_product(self, p: nn.Parameter, dy: torch.Tensor, x: torch.Tensor) -> None:
        """p's gradient is dy^T x: add it to the sum in one GEMM (``wgrad_fusion.py``)."""
        self._accumulate(p, lambda f, k, dtype: f.add_product(k, dy, x, dtype))

    def _accumulate(self, p: nn.Parameter, add: Callable) -> None:
        i, k = self._where[id(p)]
        f = self.flats[i]
        self._reducer.check_open(i)
        if add(f, k, self.grad_dtype or p.dtype):
            self._held(f)
        self._synced = False
        arrived = self._arrivals[id(p)] = self._arrivals.get(id(p), 0) + 1
        if self.shards.sync and self.overlap and arrived >= self.backwards_per_step:
            self._reducer.mark_ready(i, id(p))  # this step's last gradient of p

    def _start(self, i: int) -> Pending:
        f = self.flats[i]
        made = f.grad is None  # nothing arrived here: this rank contributes zeros
        wire = f.reduced_grad(self.grad_dtype or f.full.dtype, f.full.device)
        if made:
            self._held(f, peak=False)  # (its peak is the one once reduced)
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
        self.place.grad_in(i, out, f.master)  # the shard's sum (or on its way to the host)
        if self.stage == 1:
            f.restart_grad()  # stage 1 keeps the full-size gradient buffer
        else:
            f.grad = None
        self._held(f)

    def _held(self, f: FlatParams, peak: bool = True) -> None:
        """Report ``f``'s gradient buffers on the device to the observers (measurement)."""
        self.shards.held("grads", id(f), lambda: [f.grad, *self.place.device_grads(f.master)],
                         peak)

    def finish_gradient_sync(self) -> None:
        """Reduce every bucket not reduced yet, wait, and add the result to the shard."""
        self._reducer.flush()
        self.place.land_all()
        self._arrivals.clear()
        self._synced = True

    def no_sync(self) -> AbstractContextManager[None]:
        """Backwards inside only accumulate; the next synchronised one reduces the sum."""
        return self.shards.no_sync()

    # --- the step ------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Update this rank's shard and share the new weights."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step takes no closure")
        if not self._synced:
            self.finish_gradient_sync()
        for g, group in enumerate(self.param_groups):  # lr and co. as the caller set them
            if g in self._inner_group:
                self.inner.param_groups[self._inner_group[g]].update(
                    {k: v for k, v in group.items() if k != "params"})
        self.inner.step()
        self.publish(self.overlap_param_gather)

    @torch.no_grad()
    def publish(self, overlap: bool = False) -> None:
        """New fp32 shards -> the model's weights: each cast into its own slot of the
        bucket's buffer (``place``), then, sharded (stages 1, 2), all-gathered in place;
        ``overlap``: each gather finishes when the next forward first needs its bucket
        (``param_gather.py``; ``step`` passes ``overlap_param_gather``)."""
        self.finish_param_sync()
        self.place.publish([f.master for f in self.flats],
                           [f.full[f.lo:f.hi] for f in self.flats])
        if self.stage > 0:
            self._gathers.start(self.flats, self.comm, overlap)

    def finish_param_sync(self) -> None:
        """Wait for the weights' gathers still in flight (``overlap_param_gather``)."""
        self._gathers.wait_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for f in self.flats:  # stage 1 keeps its full buffer (_complete restarted it)
            f.master.grad = None
            if f.grad is not None and (self.stage != 1 or not self._synced):
                if self.stage == 1:
                    f.restart_grad()
                else:
                    f.grad = None
        for p in [p for group in self.param_groups for p in group["params"]]:
            p.grad = None
        if self.inner is not None:
            self.inner.zero_grad(set_to_none=True)
        self._arrivals.clear()
        if self.shards.observers:  # a new step's peak starts from what is held now
            for f in self.flats:
                self._held(f, peak=False)
            for observer in self.shards.observers:
                observer.reset()

    # --- clipping, other groups, accounting -----------------------------------------
    def grad_shards(self):
        """(name, gradient elements) this rank owns (``Shards.grad_shards``)."""
        return self.shards.grad_shards()

    def scale_grads(self, factor: float | torch.Tensor) -> None:
        self.shards.scale_grads(factor)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the dp-wide gradient norm (data parallelism only); returns the norm."""
        if not self._synced:
            self.finish_gradient_sync()
        return self.shards.clip(max_norm)

    def all_reduce_grads(self, params: Iterable, comm: Comm) -> None:
        """Sum the synchronised gradients of ``params`` (or names) over another group
        ``comm`` (sequence-parallel norms over tp; a tied embedding over the first and
        last pipeline stages). Exact on the shards when the parameter was named in
        ``shared`` at construction (its group's own bucket)."""
        names = {p if isinstance(p, str) else self._names.get(id(p)) for p in params}
        self.shards.all_reduce_grads(names, comm)

    def observe(self, observer) -> None:
        """Report every change of the gradient buffers to ``observer`` (measurement)."""
        self.shards.observers.append(observer)

    def memory_bytes(self, optimizer=None) -> dict[str, int]:
        """Bytes this rank holds now: weights, gradients (full-size buffers and the fp32
        shard), optimizer (fp32 master shards and the inner state; ``place``'s split)."""
        weights = list(self.module.parameters()) if self.module else self._params
        full = {f.full.untyped_storage().data_ptr() for f in self.flats}
        separate = [f.master for f in self.flats
                    if f.master.untyped_storage().data_ptr() not in full]
        grads = [t for f in self.flats for t in [f.grad, *self.place.device_grads(f.master)]]
        return {"params": storage_bytes(weights), "grads": storage_bytes(grads),
                **self.place.optimizer_bytes(separate, self.inner)}

    def remove(self) -> None:
        """Remove the gradient hooks (the model keeps its weights as they are)."""
        self.shards.remove()
        release_gradients(self._params)

    # --- checkpoints: by name (any layout), or this rank's shard (the same layout) -----
    def full_state_by_name(self, optimizer=None) -> tuple[dict, dict]:
        """(fp32 weights, optimizer states) by reference name, whole (collective)."""
        return self.shards.full_state(self.inner)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self.full_state_by_name()[0]

    def load_full_state_by_name(self, states: dict, weights: dict | None = None,
                                optimizer=None) -> None:
        """Take this rank's shard of whole states (and fp32 weights) by name."""
        self.shards.load_full_state(self.inner, states, weights)
        self.publish()

    def state_dict(self) -> dict:
        """This rank's shard, with the layout it was saved at."""
        return sharded_state(self.flats, self.inner, self.comm, self.stage)

    def load_state_dict(self, sd: dict) -> None:
        """Load a shard saved with the same layout; any other layout goes by name:
        ``full_state_by_name`` there, ``load_full_state_by_name`` here."""
        load_sharded_state(self.flats, self.inner, self.comm, sd)
        self.publish()
