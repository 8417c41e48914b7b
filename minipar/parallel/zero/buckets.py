"""Data parallelism's gradient buckets, and the order they are reduced in.

Every data-parallel rank holds the whole model and runs forward and backward on its own
slice of the global batch. The loss is a mean, so the gradient of the global batch is
the mean of the ranks' gradients: one all-reduce (sum, then divide by N) after backward.
A ring all-reduce sends 2 (N-1)/N of the gradient bytes from each rank. Three ways to
run it, each faster than the last (Li et al. 2020, "PyTorch Distributed", arXiv
2006.15704, section 3.2), the ``mode`` of ``ZeroOptimizer`` (``train --ddp``):

* ``naive``: one all-reduce per parameter after backward: hundreds of small
  collectives, each paying a fixed latency;
* ``bucketed``: gradients laid in a few flat buffers ("buckets", ``bucket_params``),
  filled in *reverse* parameter order (the order backward produces them), one
  collective per bucket after backward;
* ``overlapped``: each bucket's collective starts as soon as its last gradient is final,
  while backward still computes the earlier layers (``Reducer``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

import torch
from torch import nn

from minipar.comm import Comm, Pending

MODES = ("naive", "bucketed", "overlapped")
MB = 2**20


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

    Two synchronisers on one parameter (two ``ZeroOptimizer`` s, or one and a ``Zero3``)
    would each reduce the same gradient, silently (both hooks run; the sum is taken twice).
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


def broadcast_module(module: nn.Module, comm: Comm) -> None:
    """Make every rank hold rank 0's parameters and buffers (replicas start identical)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            comm.broadcast(t.data, src=0)


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
