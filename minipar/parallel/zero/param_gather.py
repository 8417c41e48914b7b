"""ZeRO-1/2's weight all-gather, hidden behind the next forward pass.

After the optimizer step each rank holds the new fp32 values of its own shard only; an
all-gather hands every rank the full new 16-bit weights (``ZeroOptimizer.publish``
casts the shard into its own slot of the bucket's buffer, which is gathered in place).
Waited for at once, it sits between the step and the next forward with nothing to hide
it: for gpt-1.3b on 4 GPUs, 2.6 GB, several milliseconds of every step. Yet a bucket's
weights are first read only when the first module holding one of them runs. So the
gathers start right after the step, in the order the forward reads the buckets, the step
returns, and a forward pre-hook on every module that holds a weight waits for its own
buckets only: the last layers' weights travel while the first layers compute.
Megatron-LM does the same with its distributed optimizer (``--overlap-param-gather``);
FSDP's forward prefetch is the stage-3 form of the idea (Zhao et al. 2023, arXiv
2304.11277, section 3.3).

What this asks of the model: every weight is read by a call of the module that holds it
(``module(x)``, as ``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm`` and minipar's models
do), so that the hook runs first. Anything that reads the weights another way (a test
looking at ``p.data`` right after ``step()``) calls ``ZeroOptimizer.finish_param_sync()``.
A bucket no module claims is waited for at once.

The hooks are placed at the first gather, not when the optimizer is built: the modules
may be replaced in between (``wgrad_fusion.py`` swaps ``nn.Linear`` for a fused one over
the same parameters).
"""

from __future__ import annotations

from functools import partial

from torch import nn

from minipar.comm import Comm, Pending


class ParamGathers:
    """The all-gathers of a step's new weights, each finished by the first module that
    reads one of its bucket's weights (or by ``wait_all``)."""

    def __init__(self, module: nn.Module | None) -> None:
        self.module = module
        self._pending: dict[int, Pending] = {}  # flat index -> its gather
        self._hooks: list | None = None  # placed at the first start
        self._claimed: set[int] = set()  # flats some module's hook waits for

    def start(self, flats: list, comm: Comm, overlap: bool) -> None:
        """Gather each flat's new shard, already in its own slot [lo, hi) of the flat's
        full buffer, in place, in forward order (the flats are in reverse parameter
        order, the backward's); ``overlap=False``: wait here for all of them."""
        self.wait_all()  # one gather of a bucket in flight at a time
        if overlap and self._hooks is None:
            self._place_hooks(flats)
        for i in reversed(range(len(flats))):
            f = flats[i]
            self._pending[i] = comm.all_gather_into(f.full, f.full[f.lo:f.hi], async_op=True)
        for i in list(self._pending):
            if not overlap or i not in self._claimed:
                self.wait(i)

    def wait(self, i: int) -> None:
        work = self._pending.pop(i, None)
        if work is not None:
            work.wait()  # on CUDA: the compute stream waits for the gather, not the host

    def wait_all(self) -> None:
        for i in list(self._pending):
            self.wait(i)

    def _place_hooks(self, flats: list) -> None:
        where = {id(p): i for i, f in enumerate(flats) for p in f.params}
        self._hooks = []
        if self.module is None:
            return
        for m in self.module.modules():
            mine = sorted({where[id(p)] for p in m.parameters(recurse=False) if id(p) in where})
            if mine:
                self._claimed.update(mine)
                self._hooks.append(m.register_forward_pre_hook(partial(self._before, mine)))

    def _before(self, flats: list[int], module: nn.Module, args) -> None:
        for i in flats:
            self.wait(i)
