"""Where ZeRO keeps its fp32 masters: on the device, or on the host (ZeRO-Offload).

Mixed-precision Adam keeps 16 bytes per parameter: 2 for the 16-bit weights, 2 for their
gradients, 4 for the fp32 master and 8 for the two moments (ZeRO's "2 + 2 + 12"). Only
the first two are needed where forward and backward run. ZeRO-Offload (Ren et al. 2021,
"ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC, arXiv
2101.06840) moves the other 12, and the update, to the host: each reduced fp32 gradient
shard leaves for the host as soon as its reduction completes (during the last
micro-batch's backward), a plain torch optimizer steps the host masters, and only the
new shard cast to 16 bits crosses back. Per step and rank: the fp32 gradient shard out,
the 16-bit shard back (``theory.offload``); the paper's argument (Sec. 4) is that this
is the least traffic that moves the optimizer off the device.

``ZeroOptimizer`` and ``Zero3`` take one of two strategies with the same methods:
``OnDevice`` (the masters stay where the model is) or ``OnHost``; their code has no
branch on offloading. On CUDA ``OnHost`` copies on a side stream into pinned buffers
(made once: fresh host memory each step costs its page faults again).
"""

from __future__ import annotations

import torch
from torch import nn

from minipar.meter import optimizer_state_bytes, storage_bytes


class OnDevice:
    """The masters, their gradients, the optimizer state and the step on the device."""

    def keep(self, master: nn.Parameter) -> nn.Parameter:
        """Where a freshly built master shard lives: here, as it is."""
        return master

    def working_copy(self, master: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
        """What ZeRO-3's gather reads this rank's slot from: the master (cast then), its
        very storage but detached, so that no read of it joins an autograd graph."""
        return master.detach()

    def grad_in(self, i: int, shard: torch.Tensor, master: nn.Parameter,
                more: bool = False) -> None:
        """Flat i's reduced gradient ``shard`` becomes, or is added to, ``master.grad``
        (a shard already of the master's dtype is taken as it is: no copy)."""
        g = shard.to(master.dtype)
        master.grad = g if master.grad is None else master.grad.add_(g)

    def land_all(self) -> None:
        """Every gradient is in its master's ``grad`` already."""

    def device_grads(self, master: nn.Parameter) -> list[torch.Tensor]:
        """The gradient tensors of ``master`` held on the device."""
        return [master.grad] if master.grad is not None else []

    def on_device(self) -> list[torch.Tensor]:
        """Gradient sums waiting on the device for a later micro-batch: none."""
        return []

    def scale(self, grads: list[torch.Tensor], factor: float | torch.Tensor) -> None:
        if grads:
            torch._foreach_mul_(grads, factor)

    @torch.no_grad()
    def publish(self, masters: list[torch.Tensor], slots: list[torch.Tensor]) -> None:
        """Each updated master into its ``slot`` in the compute dtype (nothing to do where
        the slot *is* the master: fp32 weights unsharded, or ZeRO-3's own shard)."""
        for m, slot in zip(masters, slots):
            if slot.data_ptr() != m.data_ptr():
                slot.copy_(m.detach())

    def optimizer_bytes(self, masters: list[torch.Tensor], optimizer) -> dict[str, int]:
        """Device bytes of the optimizer: ``masters`` (those that are not the weights
        themselves) and the optimizer's per-element state."""
        state = optimizer_state_bytes(optimizer) if optimizer is not None else 0
        return {"optimizer": storage_bytes(masters) + state}


class OnHost:
    """ZeRO-Offload: fp32 master shards, their gradients, the state and step on the host.

    The gradient copies run on a side CUDA stream (``non_blocking``), so they overlap the
    rest of the backward; on the CPU they are plain copies. ``last_traffic``: the bytes
    each way of the last step (``to_host``, ``to_device``).
    """

    def __init__(self) -> None:
        self.cuda, self.stream = False, None  # set by the first ``keep`` (its device)
        self._masters: list[nn.Parameter] = []  # every master shard kept here
        # host buffers: made once per flat (fresh GBs each step cost their page faults)
        self._grads: dict[int, torch.Tensor] = {}  # flat -> its master's fp32 gradient
        self._landing: dict[int, torch.Tensor] = {}  # flat -> a later landing's buffer
        self._up: dict[int, torch.Tensor] = {}  # flat -> its 16-bit parameter buffer
        self._in_flight: dict[int, tuple] = {}  # flat -> (done, master, buffer)
        self._on_device: dict[int, tuple] = {}  # flat -> (device sum, master)
        self.traffic = {"to_host": 0, "to_device": 0}  # since the last publish
        self.last_traffic = dict(self.traffic)

    def _buffer(self, store: dict, i: int, like: torch.Tensor, dtype) -> torch.Tensor:
        if i not in store:
            store[i] = torch.empty(like.shape, dtype=dtype, pin_memory=self.cuda)
        return store[i]

    def keep(self, master: torch.Tensor) -> nn.Parameter:
        """A host copy of a freshly built master shard (the device's is dropped)."""
        if master.is_cuda and self.stream is None:
            self.cuda, self.stream = True, torch.cuda.Stream(master.device)
        host = torch.empty(master.shape, dtype=master.dtype, pin_memory=self.cuda)
        host.copy_(master.detach())
        self._masters.append(nn.Parameter(host))
        return self._masters[-1]

    def working_copy(self, master: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
        """What ZeRO-3's gather reads this rank's slot from: a device copy of the master
        shard in the compute dtype (``publish`` refreshes it after each step)."""
        return master.detach().to(dtype)

    def grad_in(self, i: int, shard: torch.Tensor, master: torch.Tensor,
                more: bool = False) -> None:
        """Start copying flat i's reduced gradient ``shard`` to the host; it becomes (the
        step's first) or is added to ``master.grad`` (fp32) when it lands. ``more``:
        another micro-batch's shard follows this step (ZeRO-3): summed on the device in
        the host's order, they leave with the last (or ``land_all``)."""
        if i in self._on_device:  # the earlier micro-batches' sum, on the device
            shard = self._on_device.pop(i)[0].add_(shard)
        if more:
            self._on_device[i] = (shard, master)
            return
        self.land(i)  # an earlier reduction of this step must be in ``master.grad`` first
        if master.grad is None and shard.dtype == master.dtype:
            # the step's first landing goes straight into the gradient accumulator (the
            # optimizer's zero_grad dropped the last step's): no host pass to copy it
            buf = self._buffer(self._grads, i, master, master.dtype)
        else:
            buf = self._buffer(self._landing, i, shard, shard.dtype)
        done = None
        if self.cuda:
            # the side stream waits for the reduction, then copies while the main
            # stream goes on with the backward; the allocator keeps ``shard`` until then
            self.stream.wait_stream(torch.cuda.current_stream(shard.device))
            with torch.cuda.stream(self.stream):
                buf.copy_(shard, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            shard.record_stream(self.stream)
        else:
            buf.copy_(shard)
        self._in_flight[i] = (done, master, buf)
        self.traffic["to_host"] += shard.numel() * shard.element_size()

    def land(self, i: int) -> None:
        """Wait for flat i's copy, if one is in flight, and put it in its master's grad."""
        if i not in self._in_flight:
            return
        done, master, buf = self._in_flight.pop(i)
        if done is not None:
            done.synchronize()
        grad = self._buffer(self._grads, i, master, master.dtype)
        if master.grad is None:  # the step's first: it is the gradient
            if buf is not grad:
                grad.copy_(buf)  # (another dtype on the wire: cast up here)
            master.grad = grad
        else:
            master.grad.add_(buf)

    def land_all(self) -> None:
        for i in list(self._on_device):  # sums whose last micro-batch did not say so
            self.grad_in(i, *self._on_device.pop(i))
        for i in list(self._in_flight):
            self.land(i)

    def on_device(self) -> list[torch.Tensor]:
        """Gradient sums waiting on the device for the step's last micro-batch."""
        return [t for t, _ in self._on_device.values()]

    def publish(self, masters: list[torch.Tensor], slots: list[torch.Tensor]) -> None:
        """Each updated host master, cast on the host (it rounds as the device's cast
        would), into its device ``slot`` in the compute dtype: only those bytes cross
        the bus, on the side stream; the main stream then waits for them."""
        if self.cuda and slots:  # nothing queued before may still read the old weights
            self.stream.wait_stream(torch.cuda.current_stream(slots[0].device))
        for i, (m, slot) in enumerate(zip(masters, slots)):
            if self.cuda:  # one cast, into the pinned buffer the copy reads
                buf = self._buffer(self._up, i, m, slot.dtype)
                buf.copy_(m.detach())
                with torch.cuda.stream(self.stream):
                    slot.copy_(buf, non_blocking=True)
            else:  # the "device" is the host: cast straight into the slot
                slot.copy_(m.detach())
            self.traffic["to_device"] += slot.numel() * slot.element_size()
        if self.cuda and slots:  # the gather and the next forward wait for the copies;
            torch.cuda.current_stream(slots[0].device).wait_stream(self.stream)
            self.stream.synchronize()  # the host too, before it rewrites the buffers
        self.last_traffic, self.traffic = self.traffic, {"to_host": 0, "to_device": 0}

    def device_grads(self, master: nn.Parameter) -> list[torch.Tensor]:
        """The gradient tensors of ``master`` held on the device: none (on the host)."""
        return []

    def scale(self, grads: list[torch.Tensor], factor: float | torch.Tensor) -> None:
        if isinstance(factor, torch.Tensor):
            factor = factor.cpu()  # the shards are on the host (waits for the norm)
        if float(factor) != 1.0 and grads:  # under the clip limit x * 1 is x: the pass
            torch._foreach_mul_(grads, factor)  # over every host shard is saved

    def optimizer_bytes(self, masters: list[torch.Tensor], optimizer) -> dict[str, int]:
        """Nothing on the device; on the host: every master kept here (not only
        ``masters``, those separate from the weights), their gradients, the optimizer's
        states and the landing and upload buffers."""
        masters = self._masters
        grads = {id(t): t for t in [*self._grads.values(),
                                    *(m.grad for m in masters if m.grad is not None)]}
        tensors = [*masters, *grads.values(), *self._landing.values(), *self._up.values()]
        tensors += [v for s in (optimizer.state.values() if optimizer else ())
                    for v in s.values() if torch.is_tensor(v)]
        return {"optimizer": 0,
                "host_optimizer": sum(t.numel() * t.element_size() for t in tensors)}
