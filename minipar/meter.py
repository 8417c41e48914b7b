"""Measure what a rank holds: parameters, gradients, optimizer states, activations.

The theory (``minipar.theory.memory``) predicts these numbers; a run measures them here
so the two can be put side by side. Activations are measured as the tensors autograd
saves for backward: a ``saved_tensors_hooks`` pair counts each saved tensor's bytes when
it is packed and uncounts them when autograd lets it go, and the meter keeps the peak.
A tensor saved twice (one storage) is counted once, as memory would be.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn

# The byte counters live with data parallelism, their first user; re-exported here.
from minipar.parallel.dp import optimizer_state_bytes, storage_bytes

__all__ = ["ActivationMeter", "module_bytes", "optimizer_state_bytes", "saved_tensor_elements",
           "storage_bytes"]


def module_bytes(modules: Iterable[nn.Module]) -> tuple[int, int]:
    """(parameter bytes, gradient bytes) held by ``modules``."""
    params = [p for m in modules for p in m.parameters()]
    return storage_bytes(params), storage_bytes(p.grad for p in params)


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
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list] = {}  # storage ptr -> [bytes, refcount]
        self.current = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._exclude or t.device.type == "meta":
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
