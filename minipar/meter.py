"""Measure what a rank holds: parameters, gradients, optimizer states, activations.

The theory (``minipar.theory.memory``) predicts these numbers; a run measures them here
so the two can be put side by side. Activations are measured as the tensors autograd
saves for backward: a ``saved_tensors_hooks`` pair counts each saved tensor's bytes when
it is packed and uncounts them when autograd lets it go, and the meter keeps the peak.
A tensor saved twice (one storage) is counted once, as memory would be. The hooks run on
every saved tensor, so the engine attaches the meter only when asked
(``--measure-activations``). Bytes held inside a step by the data-parallel layer are
counted by ``HeldPeaks``, an observer that layer reports its buffers to.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.profiler
import torch.utils.checkpoint

__all__ = ["ActivationMeter", "HeldBytes", "HeldPeaks", "HostPeak", "cpu_allocations",
           "optimizer_state_bytes", "record_allocations", "rss_bytes",
           "saved_tensor_elements", "storage_bytes"]


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            if s.nbytes():
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's per-element state (Adam's two moments; not its step count)."""
    return storage_bytes(t for state in optimizer.state.values() for t in state.values()
                         if isinstance(t, torch.Tensor) and t.dim() > 0)


class HeldBytes:
    """Bytes held in tensors grouped by key (a bucket's gradient buffers), as a running
    total updated one key at a time.

    Recounting every key's tensors at each change would cost O(keys) per change,
    O(keys^2) per step: with the ~220 ZeRO buckets of gpt-1.3b tp2 with sequence
    parallelism, tens of ms of Python per step on the critical path
    (docs/benchmarks.md). Keys must not share storages (each key's tensors are
    deduplicated on their own).
    """

    def __init__(self) -> None:
        self.total, self._by_key = 0, {}

    def update(self, key, tensors: Iterable[torch.Tensor | None]) -> int:
        """``key`` now holds ``tensors`` (and nothing else); returns the new total."""
        nbytes = storage_bytes(tensors)
        self.total += nbytes - self._by_key.get(key, 0)
        self._by_key[key] = nbytes
        return self.total


class HeldPeaks:
    """The most bytes a data-parallel wrapper held at once during a step, by kind.

    Sampling memory after the step would miss what lives only inside it (ZeRO-2's
    full-size gradient buckets, ZeRO-3's gathered weights). So the engine attaches this
    observer (``sync.observe(peaks)``); the wrapper reports each change of its buffers
    (``held(kind, key, tensors)``: ``key`` of ``kind``, "grads" or "params", now holds
    ``tensors``) and calls ``reset`` when a step begins. With no observer attached the
    wrapper counts nothing.
    """

    def __init__(self) -> None:
        self._held: dict[str, HeldBytes] = {}
        self.peak: dict[str, int] = {}

    def held(self, kind: str, key, tensors: Iterable[torch.Tensor | None],
             peak: bool = True) -> None:
        total = self._held.setdefault(kind, HeldBytes()).update(key, tensors)
        if peak:
            self.peak[kind] = max(self.peak.get(kind, 0), total)

    def reset(self) -> None:
        """A new step: each peak starts from what is held now."""
        self.peak = {kind: h.total for kind, h in self._held.items()}

    def with_peaks(self, held: dict[str, int]) -> dict[str, int]:
        """``held`` (a wrapper's ``memory_bytes``, after the step) with each kind raised
        to its peak within the step."""
        return {k: max(v, self.peak.get(k, 0)) for k, v in held.items()}


class _Saved:
    """What the pack hook hands autograd: the tensor, and a release when it is dropped."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ActivationMeter:
    """Peak bytes of tensors saved for backward while the context is active.

    Parameters saved by a matmul are not activations: pass them as ``exclude`` (their
    storages are skipped). Use one meter around a whole training step.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        # by storage object, not address: ZeRO-3 frees and regathers a unit's weights
        # into the same storage at another address
        self._exclude = {t.untyped_storage()._cdata for t in exclude}
        self._live: dict[int, list] = {}  # storage ptr -> [bytes, refcount]
        self.current = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if t.untyped_storage()._cdata in self._exclude or t.device.type == "meta":
            return t
        entry = self._live.get(ptr)
        if entry is None:
            entry = self._live[ptr] = [t.untyped_storage().nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        saved = _Saved(t)
        weakref.finalize(saved, self._release, ptr)
        return saved

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, ptr: int) -> None:
        entry = self._live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[ptr]

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def saved_tensor_elements(fn: Callable[[], object], params: Iterable[torch.Tensor]) -> int:
    """Run ``fn`` and count the elements autograd saves for backward meanwhile: each
    storage once (q, k and v are views of one qkv output), ``params`` excluded. The
    measured counterpart of
    ``minipar.theory.activations.activation_elements_per_layer``."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def rss_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm; else the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return _maxrss()


def _maxrss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB else


class HostPeak:
    """Peak growth of this process's resident host memory inside a ``with`` block.

    The kernel's high-water mark (``ru_maxrss``) is exact when the block sets a new one;
    a thread sampling the resident size every millisecond covers the case where the
    process was bigger before (a forked rank inherits its parent's mark). ``peak``:
    bytes above the resident size at entry.
    """

    def __init__(self, interval: float = 0.001) -> None:
        self.interval, self.peak = interval, 0

    def __enter__(self) -> HostPeak:
        self._start, self._max_before = rss_bytes(), _maxrss()
        self._seen, self._stop = self._start, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._seen = max(self._seen, rss_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        top = max(self._seen, rss_bytes())
        if _maxrss() > self._max_before:  # a new high-water mark was set in the block
            top = max(top, _maxrss())
        self.peak = max(0, top - self._start)


@contextmanager
def record_allocations(max_entries: int = 1_000_000) -> Iterator[None]:
    """Inside: the CUDA caching allocator records every allocation with its Python stack
    (``torch.cuda.memory._snapshot`` / ``_dump_snapshot`` read them, for
    https://pytorch.org/memory_viz); recording stops on the way out.

    Recomputation's early stop is off meanwhile: torch 2.11 loses checkpoint's early-stop
    exception inside an autograd.Function while the allocator records Python stacks
    (pytorch/pytorch#179536). Without early stop recomputation runs each block to its
    end: the same bytes."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


@contextmanager
def cpu_allocations() -> Iterator[dict[str, int]]:
    """Inside: every allocation and free of CPU memory, recorded by torch's profiler
    (``profile_memory``). On the way out the dict it yields gets ``peak_allocated``: the
    most bytes allocated at once, counted from where the block began. On a GPU the
    caching allocator keeps this count itself (``torch.cuda.max_memory_allocated``); a
    rank rehearsed on the CPU is measured with this instead. The profiler costs a few
    per cent of a step."""
    found: dict[str, int] = {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        yield found
    cpu = torch.autograd.DeviceType.CPU
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == cpu),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:  # + bytes allocated, - bytes freed
        now += e.nbytes()
        peak = max(peak, now)
    found["peak_allocated"] = peak
