"""ZeRO-Offload: the optimizer (master weights, states, step) lives in host memory.

Mixed-precision Adam keeps 16 bytes per parameter: 2 for the 16-bit weights, 2 for their
gradients, 4 for the fp32 master copy and 8 for the two moments (ZeRO's "2 + 2 + 12").
Only the first two are needed where the forward and backward run. ZeRO-Offload (Ren et
al. 2021, arXiv 2101.06840) moves the other 12, and the update itself, to the CPU:

* the device keeps the 16-bit parameters (or fp32 ones when asked: the data path is the
  same, which is how the tests compare it with a plain optimizer bit for bit);
* each gradient is copied to a pinned host buffer as soon as backward produces it
  (``register_post_accumulate_grad_hook``), on a side CUDA stream with a non-blocking
  copy, so the transfer overlaps the rest of the backward; the device gradient is then
  released. On the host it is added, in fp32, to the master's gradient, which also
  accumulates micro-batches;
* ``step()`` runs any torch optimizer on the fp32 masters on the CPU, then copies the
  updated weights, cast to the device dtype, back into the model's parameters.

Per step that is one gradient copy per parameter and micro-batch to the host and one
parameter copy back (``minipar.theory.offload``); the paper's argument (Sec. 4) is that
this is the least traffic that moves the optimizer off the device, and that PCIe hides
it behind backward for large enough batches. The CPU step is the price: the paper hides
it with a vectorised CPU Adam and a one-step delay; minipar uses torch's own optimizer
(the engine: its fused CPU AdamW) and no delay, so parity stays exact.

Use::

    opt = OffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3,
                           param_dtype=torch.bfloat16)  # casts the model's parameters
    for micro in batches:
        model(micro).backward()       # gradients stream to the host as they appear
    opt.step()                        # CPU step, weights back to the device
    opt.zero_grad()
    opt.last_traffic                  # {"to_host": bytes, "to_device": bytes}

When a gradient is not final when accumulated (data parallelism still has to reduce
it), pass ``overlap=False`` and call ``offload_grads()`` after the reduction.

With ZeRO (``train --offload``) the engine does not wrap the optimizer: ``HostShards``
below gives ``ZeroOptimizer`` (stages 0-2) the paper's scheme over its flat shards. The
fp32 master shard lives only on the host (the device keeps the compute-dtype weights
``full`` and the gradient buffers); each bucket's gradient is reduced (stage 0) or
reduce-scattered (1, 2) in fp32 on the device, and its shard leaves for the host as soon
as that reduction completes, during the last micro-batch's backward, straight into the
master's fp32 gradient (pinned, made once: fresh host memory each step costs its page
faults again); a plain torch optimizer steps the host masters; the new shard is cast to
the compute dtype on the host and only those 16-bit bytes cross back, into this rank's
slot of ``full``, which an in-place all-gather then publishes. Per step and rank: the
fp32 gradient shard to the host, the 16-bit shard back (``theory.offload``). The host
passes over the shard: norm, clip scale (none if 1), step, cast (``benchmarks/
offload_host.py`` times each).

ZeRO-3 (``Zero3(offload=True)``, DeepSpeed's offloaded-optimizer stage 3 in small) does
the same per unit: the host holds the fp32 master shard, the device a 16-bit shard that
each just-in-time gather reads; the micro-batches' reduce-scattered fp32 shards add up
on the device and the sum crosses once, during the last one's backward (DeepSpeed adds
them on the CPU: a host pass each); after the step the 16-bit shard comes back.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn


class OffloadOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer_cls`` so that it steps fp32 host copies of ``params``.

    ``param_groups`` and ``state`` are the inner (host) optimizer's, so learning-rate
    schedules and checkpoints see the usual structure; the groups hold the masters.
    """

    def __init__(self, params: Iterable[nn.Parameter], optimizer_cls: type =
                 torch.optim.AdamW, *, param_dtype: torch.dtype | None = None,
                 overlap: bool = True, **optimizer_kwargs) -> None:
        params = list(params)
        if params and isinstance(params[0], dict):  # param groups (as ZeroOptimizer passes)
            params = [p for g in params for p in g["params"]]
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("OffloadOptimizer got no trainable parameters")
        device = self.params[0].device
        self.cuda = device.type == "cuda"
        pin = self.cuda  # pinned (page-locked) host memory: needed for async copies
        with torch.no_grad():
            # Masters first, from the weights as given (fp32): the reference's values.
            self.masters = [p.detach().to("cpu", torch.float32, copy=True)
                            for p in self.params]
            if param_dtype is not None:
                for p in self.params:
                    p.data = p.data.to(param_dtype)
        for m in self.masters:
            m.grad = torch.zeros_like(m)
        # Host landing buffers in the device dtype: what crosses the bus is 16-bit.
        self._host_grads = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin)
                            for p in self.params]
        self._host_params = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin)
                             for p in self.params]
        self.inner = optimizer_cls(self.masters, **optimizer_kwargs)
        super().__init__(self.masters, self.inner.defaults)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._in_flight: dict[int, torch.cuda.Event | None] = {}  # index -> copy done
        self.traffic = {"to_host": 0, "to_device": 0}  # since the last step
        self.last_traffic = dict(self.traffic)
        self._hooks = ([p.register_post_accumulate_grad_hook(self._on_grad)
                        for p in self.params] if overlap else [])

    # --- gradients: device -> host, as they are produced --------------------------------
    def _on_grad(self, p: nn.Parameter) -> None:
        self._copy_to_host(self._index[id(p)])

    def _copy_to_host(self, i: int) -> None:
        p = self.params[i]
        if p.grad is None:
            return
        self._land(i)  # the buffer may still hold this parameter's previous micro-batch
        grad, buf = p.grad, self._host_grads[i]
        if self.cuda:
            # The side stream waits for the backward kernels that made the gradient,
            # then copies while the main stream goes on with the rest of the backward.
            self._stream.wait_stream(torch.cuda.current_stream(p.device))
            with torch.cuda.stream(self._stream):
                buf.copy_(grad, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            grad.record_stream(self._stream)  # keep its memory until the copy ran
        else:
            buf.copy_(grad)
            done = None
        self._in_flight[i] = done
        self.traffic["to_host"] += grad.numel() * grad.element_size()
        p.grad = None  # the device keeps no gradient: that memory is what offload saves

    def _land(self, i: int) -> None:
        """Wait for parameter i's copy, if one is in flight, and add it to the master."""
        if i not in self._in_flight:
            return
        done = self._in_flight.pop(i)
        if done is not None:
            done.synchronize()
        # fp32 accumulation on the host: g1 + g2 + ... in the order backward made them.
        self.masters[i].grad.add_(self._host_grads[i])

    def offload_grads(self) -> None:
        """Copy every gradient still on the device (``overlap=False``, or leftovers)."""
        for i in range(len(self.params)):
            self._copy_to_host(i)

    def _land_all(self) -> None:
        for i in list(self._in_flight):
            self._land(i)

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 host masters (their ``.grad`` is the step's gradient): clip these."""
        self.offload_grads()
        self._land_all()
        return self.masters

    # --- the step on the host, parameters back -----------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("OffloadOptimizer.step takes no closure")
        self.master_params()  # every gradient on the host and landed
        self.inner.step()
        for p, m, buf in zip(self.params, self.masters, self._host_params):
            buf.copy_(m)  # fp32 -> device dtype, on the CPU: half the bytes cross the bus
            if self.cuda:
                with torch.cuda.stream(self._stream):
                    p.data.copy_(buf, non_blocking=True)
            else:
                p.data.copy_(buf)
            self.traffic["to_device"] += p.numel() * p.element_size()
        if self.cuda:
            # The next forward (on the main stream) must see the new weights, and the
            # host buffers must not be rewritten while a copy still reads them.
            torch.cuda.current_stream(self.params[0].device).wait_stream(self._stream)
            self._stream.synchronize()
        self.last_traffic, self.traffic = self.traffic, {"to_host": 0, "to_device": 0}
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._land_all()
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad.zero_()  # the host accumulator is reused, never reallocated

    def host_master(self, p: torch.Tensor) -> torch.Tensor:
        """The host fp32 master of device parameter ``p`` (its state's key)."""
        return self.masters[self._index[id(p)]]

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def host_bytes(self) -> int:
        """Host memory this optimizer holds: masters, their grads, states, landing buffers."""
        tensors = [*self.masters, *(m.grad for m in self.masters), *self._host_grads,
                   *self._host_params]
        tensors += [v for s in self.inner.state.values() for v in s.values()
                    if torch.is_tensor(v)]
        return sum(t.numel() * t.element_size() for t in tensors)


class OnHost:
    """Mixed into ``ZeroOptimizer`` and ``Zero3`` (before ``ShardedState``): where their
    shards live on the host (``self.offload``, a ``HostShards``), the shared methods
    that would run a collective on them, or scale them by a device tensor, change."""

    offload: HostShards | None

    def scale_grads(self, factor: float | torch.Tensor) -> None:
        if self.offload is not None:
            if isinstance(factor, torch.Tensor):
                factor = factor.cpu()  # the shards are on the host (waits for the norm)
            if float(factor) == 1.0:  # a norm under the clip limit: x * 1 is x, so the
                return  # pass over every host shard (a read and a write each) is saved
        super().scale_grads(factor)

    def full_state_by_name(self, optimizer=None) -> tuple[dict, dict]:
        """(fp32 weights, optimizer states) by name, whole (collective)."""
        if self.offload is None:
            return super().full_state_by_name(optimizer)
        return self.offload.full_state(self.flats, self._stepper(optimizer), self.comm)


class HostShards:
    """The host side of ZeRO + offload: fp32 master shards, their gradients, the copies.

    ``ZeroOptimizer(offload=True)`` and ``Zero3(offload=True)`` call ``to_host`` on each
    master shard they build, ``grad_to_host`` when a bucket's (unit's) reduction
    completes, ``land_all`` before anything reads the gradients, and ``publish`` after
    the CPU step (ZeRO-3: into the 16-bit device shard its gathers read). On CUDA the
    copies run on a side stream into pinned buffers (``non_blocking``), so the gradient
    copies overlap the rest of the backward; on the CPU they are plain copies.
    """

    def __init__(self) -> None:
        self.cuda, self.stream = False, None  # set by the first ``to_host`` (its device)
        # host buffers: made once per flat (fresh GBs each step cost their page faults)
        self._grads: dict[int, torch.Tensor] = {}  # flat -> its master's fp32 gradient
        self._landing: dict[int, torch.Tensor] = {}  # flat -> a later landing's buffer
        self._up: dict[int, torch.Tensor] = {}  # flat -> its 16-bit parameter buffer
        self._in_flight: dict[int, tuple] = {}  # flat -> (done, master, factor, buffer)
        self._on_device: dict[int, tuple] = {}  # flat -> (device sum, master, factor)
        self.traffic = {"to_host": 0, "to_device": 0}  # since the last publish
        self.last_traffic = dict(self.traffic)

    def _buffer(self, store: dict, i: int, like: torch.Tensor, dtype) -> torch.Tensor:
        if i not in store:
            store[i] = torch.empty(like.shape, dtype=dtype, pin_memory=self.cuda)
        return store[i]

    def to_host(self, master: torch.Tensor) -> nn.Parameter:
        """A host copy of a freshly built master shard (the device's is dropped)."""
        if master.is_cuda and self.stream is None:
            self.cuda, self.stream = True, torch.cuda.Stream(master.device)
        host = torch.empty(master.shape, dtype=master.dtype, pin_memory=self.cuda)
        host.copy_(master.detach())
        return nn.Parameter(host)

    def grad_to_host(self, i: int, shard: torch.Tensor, master: torch.Tensor,
                     factor: float = 1.0, more: bool = False) -> None:
        """Start copying flat i's reduced gradient ``shard`` to the host; it becomes (the
        step's first) or is added to ``master.grad`` (fp32, times ``factor``) when it
        lands. ``more``: another micro-batch's shard follows this step (ZeRO-3): summed
        on the device in the host's order, they leave with the last (or ``land_all``)."""
        if i in self._on_device:  # the earlier micro-batches' sum, on the device
            shard = self._on_device.pop(i)[0].add_(shard)
        if more:
            self._on_device[i] = (shard, master, factor)
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
        self._in_flight[i] = (done, master, factor, buf)
        self.traffic["to_host"] += shard.numel() * shard.element_size()

    def land(self, i: int) -> None:
        """Wait for flat i's copy, if one is in flight, and put it in its master's grad."""
        if i not in self._in_flight:
            return
        done, master, factor, buf = self._in_flight.pop(i)
        if done is not None:
            done.synchronize()
        grad = self._buffer(self._grads, i, master, master.dtype)
        if master.grad is None:  # the step's first: it is the gradient
            if buf is not grad:
                grad.copy_(buf)  # (another dtype on the wire: cast up here)
            if factor != 1.0:
                grad.mul_(factor)
            master.grad = grad
        else:  # in place, as scaling a copy first (factor: 1, or a loss scale's 1/2^k)
            master.grad.add_(buf, alpha=factor)

    def land_all(self) -> None:
        for i in list(self._on_device):  # sums whose last micro-batch did not say so
            self.grad_to_host(i, *self._on_device.pop(i))
        for i in list(self._in_flight):
            self.land(i)

    def on_device(self) -> list[torch.Tensor]:  # sums waiting for their last micro-batch
        return [t for t, _, _ in self._on_device.values()]

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

    def publish_flats(self, flats: list, comm, gather: bool) -> None:
        """ZeRO 0-2: into this rank's slot of each flat's ``full``, then (``gather``:
        sharded) the slots are all-gathered in place."""
        slots = [f.full[f.lo:f.hi] for f in flats]
        self.publish([f.master for f in flats], slots)
        if gather:
            for p in [comm.all_gather_into(f.full, slot, async_op=True)
                      for f, slot in zip(flats, slots)]:
                p.wait()

    # --- the gradient shards on the host, where a collective wants the device -------
    def all_reduce_grads(self, flats: list, names: set[str], comm) -> None:
        """``zero_state.all_reduce_grads`` for host shards: the pieces of ``names`` are
        summed over ``comm`` on the device (NCCL reduces device memory only)."""
        parts = [(f.master.grad, a, b) for f in flats if f.master.grad is not None
                 for k, a, b in f.owned() if f.names[k] in names]
        if comm.size > 1 and parts:
            flat = torch.cat([g[a:b] for g, a, b in parts]).to(flats[0].full.device)
            comm.all_reduce(flat)
            flat, o = flat.cpu(), 0
            for g, a, b in parts:
                g[a:b].copy_(flat[o:o + b - a])
                o += b - a

    def clip(self, sync, max_norm: float) -> float:
        """``sync.clip_grad_norm_`` for host shards: the norm summed on the device."""
        from minipar.parallel.dp import global_grad_norm

        norm = global_grad_norm((g for _, g in sync.grad_shards()), [sync.comm],
                                device=sync.flats[0].full.device)
        sync.scale_grads((max_norm / (norm + 1e-6)).clamp(max=1.0))
        return float(norm)

    def full_state(self, flats: list, optimizer, comm) -> tuple[dict, dict]:
        """``zero_state.full_state`` for host shards: each is gathered on the device."""
        from minipar.parallel.zero_state import full_state, gatherer

        gather, device = gatherer(comm), flats[0].full.device
        return full_state(flats, optimizer, lambda f, t: gather(f, t.to(device)).cpu())

    def host_bytes(self, flats: list, optimizer) -> int:
        """Host memory: masters, their gradients, the optimizer's states, the buffers."""
        masters = [f.master for f in flats]
        grads = {id(t): t for t in [*self._grads.values(),
                                    *(m.grad for m in masters if m.grad is not None)]}
        tensors = [*masters, *grads.values(), *self._landing.values(), *self._up.values()]
        tensors += [v for s in (optimizer.state.values() if optimizer else ())
                    for v in s.values() if torch.is_tensor(v)]
        return sum(t.numel() * t.element_size() for t in tensors)
