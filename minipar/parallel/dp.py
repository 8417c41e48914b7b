"""Data parallelism: every rank holds the whole model and they average their gradients.

Each of the N data-parallel ranks runs forward and backward on its own slice of the
global batch. The loss is a mean, so the gradient of the global batch is the mean of
the ranks' gradients: one all-reduce (sum, then divide by N) after backward makes every
replica hold the same gradient, and the same optimizer step keeps them identical.
A ring all-reduce sends 2 (N-1)/N of the gradient bytes from each rank.

Three versions, each faster than the last (Li et al. 2020, "PyTorch Distributed",
arXiv 2006.15704, section 3.2):

* ``naive``: after backward, one all-reduce per parameter. Simple, but a model has
  hundreds of small tensors and each collective pays a fixed latency.
* ``bucketed``: gradients live in a few flat buffers ("buckets", ``bucket_mb`` each),
  filled in *reverse* parameter order (the order backward produces them), and each
  bucket is all-reduced in one call. Parameter gradients are views into the buckets, so
  nothing is copied.
* ``overlapped``: a hook on every parameter (``register_post_accumulate_grad_hook``)
  notes when its gradient is final; as soon as a whole bucket is final its all-reduce is
  started asynchronously, while backward still computes the earlier layers.
  ``finish_gradient_sync()`` waits for the rest.

In all three, the training loop calls ``finish_gradient_sync()`` after backward and
before the optimizer step: an explicit call, because a pipeline schedule runs many
backwards per step and decides itself when the gradients are complete.

Gradient accumulation: backwards inside ``with ddp.no_sync():`` only accumulate
locally; the reduction happens once, for the sum of the micro-batches.

Edge cases, handled as PyTorch DDP does: parameters are broadcast from rank 0 when
wrapped (replicas must start identical); frozen parameters (``requires_grad=False``)
are never reduced; a tied weight is one parameter, reduced once; a parameter no rank
used keeps ``grad=None`` with ``find_unused=True``, otherwise it gets a zero gradient.
Buckets are always reduced in the same order on every rank: one whose parameter was
unused here waits until ``finish_gradient_sync()``, and the buckets after it wait too,
so the ranks never enter different collectives.

The reusable pieces (``trainable_params``, ``bucket_params``, ``Reducer``,
``global_grad_norm``) are also what ``minipar.parallel.zero`` builds on. The wrapper is
an ``nn.Module`` shaped like ``torch.nn.parallel.DistributedDataParallel``: call it,
ask it for ``parameters()`` or ``state_dict()`` (keys prefixed ``module.``), move the
module to its device *before* wrapping (the gradient buckets are allocated there).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from minipar.comm import Comm, Pending
from minipar.meter import optimizer_state_bytes, storage_bytes

MODES = ("naive", "bucketed", "overlapped")
MB = 2**20


# --- pieces shared with ZeRO ---------------------------------------------------------------
def trainable_params(params: nn.Module | Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters that need gradients, each once (a tied weight appears once)."""
    if isinstance(params, nn.Module):
        params = params.parameters()  # already de-duplicated by identity
    seen: set[int] = set()
    out = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def bucket_params(params: list[nn.Parameter], bucket_bytes: float) -> list[list[nn.Parameter]]:
    """Greedy buckets of about ``bucket_bytes`` each, in *reverse* parameter order.

    Backward produces the gradients of the last layers first, so the first bucket is
    complete first. A parameter is never split; a parameter larger than the cap gets a
    bucket of its own. ``bucket_bytes=0`` gives one bucket per parameter.
    """
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def claim_gradients(params: Iterable[nn.Parameter], owner: str) -> None:
    """Record that ``owner`` synchronises these parameters' gradients; refuse a second.

    Two synchronisers on one parameter (``DataParallel`` and ``ZeroOptimizer``) would
    each reduce the same gradient, silently (both hooks run; the sum is taken twice).
    """
    params = list(params)
    for p in params:
        other = getattr(p, "grad_synchronizer", None)
        if other is not None:
            raise ValueError(f"a parameter's gradient is already synchronised by {other}; "
                             f"{owner} would reduce it a second time: use one of them")
    for p in params:
        p.grad_synchronizer = owner


def release_gradients(params: Iterable[nn.Parameter]) -> None:
    for p in params:
        if hasattr(p, "grad_synchronizer"):
            del p.grad_synchronizer


def global_grad_norm(pieces: Iterable[torch.Tensor], groups: Iterable[Comm] = (),
                     device: torch.device | None = None) -> torch.Tensor:
    """The L2 norm of a gradient spread over ranks: the one norm every layout uses.

    ``pieces``: the gradient elements this rank *owns*, each element of the model owned
    by exactly one rank of the ``groups`` (a ZeRO shard over dp; a replicated tensor-
    parallel weight on tp rank 0 only; a pipeline stage's own layers). The squared sum is
    added up over each group. Computed on the device, fused (as
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


def broadcast_module(module: nn.Module, comm: Comm,
                     values: Callable[[nn.Parameter], torch.Tensor] | None = None) -> None:
    """Make every rank hold rank 0's parameters and buffers (replicas start identical)."""
    with torch.no_grad():
        for p in module.parameters():
            comm.broadcast(values(p) if values else p.data, src=0)
        for b in module.buffers():
            comm.broadcast(b.data, src=0)


class Reducer:
    """Start bucket reductions in bucket order, each as soon as its bucket is complete.

    Why in order: every rank must enter the same collectives in the same order, but
    gradients can become final in different orders on different ranks (a parameter this
    rank did not use never reports). So bucket i is only started after buckets 0..i-1,
    the rule PyTorch DDP follows. ``start(i)`` begins bucket i's collective and returns a
    ``Pending``; ``complete(i)`` runs once it has finished. ``max_inflight`` bounds the
    buckets in flight (each keeps its buffer alive until completed): ZeRO-2 relies on it
    to keep gradient memory small.
    """

    def __init__(self, sizes: list[int], start: Callable[[int], Pending],
                 complete: Callable[[int], None], max_inflight: int | None = None):
        self.sizes, self._start, self._complete = sizes, start, complete
        self.max_inflight = max_inflight
        self._ready: list[set[int]] = [set() for _ in sizes]
        self._next = 0  # the next bucket to start
        self._inflight: deque[tuple[int, Pending]] = deque()

    def started(self, bucket: int) -> bool:
        return bucket < self._next

    def check_open(self, bucket: int) -> None:
        """Refuse a gradient for a bucket already being reduced."""
        if self.started(bucket):
            raise RuntimeError(
                "a gradient arrived for a bucket already being reduced: call "
                "finish_gradient_sync() after each synchronised backward, and run "
                "accumulation backwards inside no_sync()")

    def mark_ready(self, bucket: int, key: int) -> None:
        """Gradient ``key`` of ``bucket`` is final; start every bucket that can start."""
        self.check_open(bucket)
        self._ready[bucket].add(key)
        while self._next < len(self.sizes) and \
                len(self._ready[self._next]) == self.sizes[self._next]:
            self._launch()

    def _launch(self) -> None:
        i = self._next
        self._next += 1
        self._inflight.append((i, self._start(i)))
        while self.max_inflight is not None and len(self._inflight) > self.max_inflight:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        i, pending = self._inflight.popleft()
        pending.wait()
        self._complete(i)

    def flush(self) -> None:
        """Start the buckets not started yet (in order), wait for all, and reset."""
        while self._next < len(self.sizes):
            self._launch()
        while self._inflight:
            self._complete_oldest()
        self._ready = [set() for _ in self.sizes]
        self._next = 0


class NoSync:
    """``no_sync()``, PyTorch DDP's name: backwards inside only accumulate gradients
    locally; nothing is reduced until a synchronised backward or the next sync."""

    _sync = True

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous


# --- the wrapper -----------------------------------------------------------------------
class DataParallel(NoSync, nn.Module):
    """Wrap ``module`` for data parallelism over ``comm`` (the mesh's dp group).

    ``ddp(*args)`` runs the module (``forward``). After backward call ``finish_gradient_sync()``;
    then any torch optimizer can step on ``module.parameters()``.

    ``average=True`` divides the summed gradients by the dp size (what a plain loop
    wants). ``average=False`` only sums: for an engine that already scaled every
    micro-batch loss by 1 / (dp * microbatches). ``reduce_dtype`` is the dtype on the
    wire (default: the gradients' own); the result is stored back in the gradients'
    dtype. ``bucket_mb`` is the bucket size in MiB (PyTorch DDP's default is 25).
    ``precision``: the model's ``MixedPrecision``, so that its fp32 masters are the ones
    broadcast from rank 0 (the 16-bit weights are then rounded from them).
    """

    def __init__(self, module: nn.Module, comm: Comm | None = None, *,
                 mode: str = "overlapped", bucket_mb: float = 25.0, average: bool = True,
                 reduce_dtype: torch.dtype | None = None, find_unused: bool = False,
                 broadcast: bool = True, precision=None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        super().__init__()
        self.module, self.comm, self.mode = module, comm or Comm(), mode
        self.average, self.reduce_dtype, self.find_unused = average, reduce_dtype, find_unused
        self.params = trainable_params(module)
        claim_gradients(self.params, "DataParallel")
        if broadcast and precision is not None:  # share the fp32 masters, then round
            trainable = {id(p) for p in self.params}
            broadcast_module(module, self.comm, lambda p: precision.master(p).data
                             if id(p) in trainable else p.data)
            precision.copy_to_model()
        elif broadcast:
            broadcast_module(module, self.comm)
        self._sync = True
        self._used: set[int] = set()  # ids of parameters that got a gradient since the sync
        self._views: dict[int, torch.Tensor] = {}
        self._bucket_of: dict[int, int] = {}
        self._buckets: list[torch.Tensor] = []  # flat gradient buffers
        self._wire: dict[int, torch.Tensor] = {}  # bucket -> tensor on the wire, if cast
        sizes = self._make_buckets(bucket_mb * MB) if mode != "naive" else []
        self._reducer = Reducer(sizes, self._start, self._complete)
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for p in self.params]

    def _make_buckets(self, bucket_bytes: float) -> list[int]:
        """One flat gradient buffer per bucket; each parameter's .grad is a view into it.
        Returns the number of parameters of each bucket."""
        buckets = bucket_params(self.params, bucket_bytes)
        for i, bucket in enumerate(buckets):
            p0 = bucket[0]
            flat = torch.zeros(sum(p.numel() for p in bucket), dtype=p0.dtype,
                               device=p0.device)
            offset = 0
            for p in bucket:
                view = flat[offset:offset + p.numel()].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self._views[id(p)], self._bucket_of[id(p)] = view, i
                offset += p.numel()
            self._buckets.append(flat)
        return [len(b) for b in buckets]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # --- backward hook: the gradient of ``p`` is final for this backward --------------
    def _on_grad(self, p: nn.Parameter) -> None:
        self._used.add(id(p))
        if self.mode == "naive":
            return
        bucket, view = self._bucket_of[id(p)], self._views[id(p)]
        self._reducer.check_open(bucket)
        if p.grad.data_ptr() != view.data_ptr():  # zero_grad(set_to_none) dropped the view
            view.copy_(p.grad)
            p.grad = view
        if self.mode == "overlapped" and self._sync:
            self._reducer.mark_ready(bucket, id(p))

    def _start(self, i: int) -> Pending:
        flat = self._buckets[i]
        if self.average:
            flat.div_(self.comm.size)
        wire = flat
        if self.reduce_dtype is not None and self.reduce_dtype != flat.dtype:
            wire = self._wire[i] = flat.to(self.reduce_dtype)
        return self.comm.all_reduce(wire, async_op=True)

    def _complete(self, i: int) -> None:
        wire = self._wire.pop(i, None)
        if wire is not None:
            self._buckets[i].copy_(wire)

    def finish_gradient_sync(self) -> None:
        """Make every replica's gradients the dp mean (or sum); call after backward."""
        used, self._used = self._used, set()
        if self.mode == "naive":
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if self.average:
                    p.grad.div_(self.comm.size)
                wire = p.grad if self.reduce_dtype in (None, p.dtype) else \
                    p.grad.to(self.reduce_dtype)
                self.comm.all_reduce(wire)
                if wire is not p.grad:
                    p.grad.copy_(wire)
        else:
            for p in self.params:  # unused here: contribute zeros (the view may be stale)
                if id(p) not in used and not self._reducer.started(self._bucket_of[id(p)]):
                    self._views[id(p)].zero_()
                    p.grad = self._views[id(p)]
            self._reducer.flush()
        if self.find_unused:
            self._drop_unused_everywhere(used)

    sync_gradients = finish_gradient_sync

    def _drop_unused_everywhere(self, used: set[int]) -> None:
        """Parameters no rank used keep grad None, as on one device (an extra all-reduce)."""
        flags = torch.tensor([id(p) in used for p in self.params], dtype=torch.int32)
        self.comm.all_reduce(flags)
        for p, n in zip(self.params, flags.tolist()):
            if n == 0:
                p.grad = None

    # --- accounting ----------------------------------------------------------------
    def memory_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds: ``params``, ``grads``, ``optimizer``.

        ``optimizer`` counts its per-element state, plus any parameter it updates that is
        not the module's own (MixedPrecision's fp32 master copies).
        """
        own = {id(p) for p in self.module.parameters()}
        extra = [p for g in (optimizer.param_groups if optimizer else [])
                 for p in g["params"] if id(p) not in own]
        return {
            "params": storage_bytes(self.module.parameters()),
            "grads": storage_bytes([p.grad for p in self.module.parameters()]
                                   + [p.grad for p in extra]),
            "optimizer": (optimizer_state_bytes(optimizer) + storage_bytes(extra)
                          if optimizer else 0),
        }

    def remove(self) -> None:
        """Remove the gradient hooks (the module is left as it is)."""
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks.clear()
        release_gradients(self.params)
