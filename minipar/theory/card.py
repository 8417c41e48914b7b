"""What a GPU must hold for one rank, beyond the live tensors ``theory.memory`` counts:
the CUDA runtime outside PyTorch's caching allocator, and the allocator's reserve over
the peak of live tensors (blocks it keeps between sizes that do not fit each other).
Neither comes from a paper: both are fitted to runs of ``python -m minipar train`` on
4 x H100 80GB, 4 x H200 and one H100 (``benchmarks/card_memory.py`` records them,
``benchmarks/reserve_fit.py`` fits them; the rows and the errors are in
docs/benchmarks.md, and ``tests/test_card_memory.py`` holds every prediction to them).

``card_peak`` is the one answer to "does this layout fit this card" (and ``host_fit``,
under ``--offload``, to "do its host states fit the node"): the planner prices layouts
with them, and ``train`` checks a run against the device and its host with them before
the first step. ``MEMORY_MARGIN`` is the headroom a plan keeps on top.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipar.model import GPTConfig
from minipar.theory.layout import Layout
from minipar.theory.memory import OPTIMIZER_KERNELS, memory_per_stage

# The process's share of the card beyond the caching allocator's reserve: the CUDA
# context and cuBLAS workspaces, and NCCL's buffers for a rank's peers. Measured with
# torch 2.11 and NCCL on H100 80GB, the most any rank held over its peak reserve: in
# 4 x H100 runs of data, tensor and context parallelism 2.7 GiB (tp 2 3.0, cp 2 3.1),
# with a pipeline 1.3 GiB more (its point-to-point peers: pp 2 3.9, pp 4 4.0); a run of
# one rank, whose communicators have no peer (``card_memory.py --gpus 1``), 1.3; a
# rehearsed rank (``engine.rehearse``), which opens no communicator at all, 0.75.
CUDA_RUNTIME_BYTES = int(2.7 * 2**30)
PIPELINE_PEERS_BYTES = int(1.3 * 2**30)
CUDA_RUNTIME_ALONE_BYTES = int(1.3 * 2**30)
REHEARSED_RUNTIME_BYTES = int(0.75 * 2**30)
# A second communicator over the data-parallel ranks (``--separate-reduce-group``), priced
# as what a rank's communicators with peers added above one alone: 2.7 - 1.3 GiB.
SECOND_COMMUNICATOR_BYTES = CUDA_RUNTIME_BYTES - CUDA_RUNTIME_ALONE_BYTES


def runtime_bytes(layout: Layout) -> int:
    """What a rank of ``layout`` holds on its GPU outside the caching allocator."""
    if layout.gpus == 1:
        return CUDA_RUNTIME_ALONE_BYTES
    return (CUDA_RUNTIME_BYTES + (PIPELINE_PEERS_BYTES if layout.pp > 1 else 0)
            + (SECOND_COMMUNICATOR_BYTES if layout.separate_reduce_group else 0))


@dataclass(frozen=True)
class ReserveFit:
    """The caching allocator's reserve over the live-tensor peak, for one optimizer
    kernel: ``factor`` x live + ``extra`` bytes (ZeRO 0-2) or ``zero3_factor`` x live +
    ``zero3_extra`` (ZeRO-3), plus ``zero1_share`` and, with a pipeline,
    ``pipeline_share`` of the gradient buffer (ZeRO 0-2), plus ``loss_share`` of the
    loss workspace.

    Why those terms: ZeRO-1 frees and remakes its full-size fp32 sum's neighbours every
    step; the multi-tensor AdamW makes and frees a temporary the size of the fp32
    parameters every step, and a pipeline interleaves those blocks with its micro-batches'
    activations; ZeRO-3's per-unit gathers and frees fragment in proportion to what is
    live; the loss's logits over the vocabulary, the largest blocks a step makes and
    frees, leave segments that later, smaller tensors split."""

    factor: float
    extra: float
    zero3_factor: float
    zero3_extra: float
    zero1_share: float
    pipeline_share: float
    loss_share: float = 0.0

    def reserved(self, live: int, grads: int, zero: int, pp: int, loss: int = 0) -> int:
        if zero == 3:
            return int(live * self.zero3_factor + self.zero3_extra + self.loss_share * loss)
        share = (self.zero1_share if zero == 1 else 0.0) + (
            self.pipeline_share if pp > 1 else 0.0)
        return int(live * self.factor + self.extra + share * grads + self.loss_share * loss)


# Fitted by least squares on the relative error to every recorded row whose reserve
# stayed 6 GiB under its card's capacity (nearer, the allocator frees its cache and
# retries), one fit per optimizer kernel; a test checks these are the fit's answer.
RESERVE_FITS = {
    "fused": ReserveFit(1.011, 0.881 * 2**30, 1.052, 0.109 * 2**30, 0.278, 0.052, 0.339),
    "foreach": ReserveFit(1.037, 0.352 * 2**30, 1.083, 0.807 * 2**30, 0.277, 0.463, 0.252),
}
# Which fit a kernel's runs follow: only the multi-tensor kernel's full-size temporary
# changes how the cache fragments (the host's step under offload and the per-tensor loop
# make none, as the fused kernel).
FIT_OF_KERNEL = {"fused": "fused", "host": "fused", "forloop": "fused", "foreach": "foreach"}

# The headroom a plan keeps on top (share of the card): above the largest
# under-prediction of either fit (a test holds them under it), so that no layout the
# model lets through runs out of memory.
MEMORY_MARGIN = 0.07


def reserve_fit(kernel: str) -> ReserveFit:
    """The reserve fit of an optimizer kernel (``memory.OPTIMIZER_KERNELS``)."""
    if kernel not in FIT_OF_KERNEL:
        raise ValueError(f"optimizer kernel must be one of {OPTIMIZER_KERNELS}, got {kernel!r}")
    return RESERVE_FITS[FIT_OF_KERNEL[kernel]]


def card_bytes(row: dict, layout: Layout, device: str = "cuda") -> dict[str, int]:
    """From a stage's live-tensor peak (``row["total"]``, its gradients ``row["grads"]``)
    under ``layout`` to what the card must hold: ``reserved`` (the caching allocator's
    peak reserve, ``reserve_fit`` of the layout's optimizer kernel) and ``process``
    (``reserved`` plus the runtime outside the allocator). On the CPU the allocator keeps
    no reserve and the runtime is the interpreter's and torch's."""
    if device != "cuda":
        return {"reserved": row["total"], "process": row["total"] + 300 * 2**20}
    reserved = reserve_fit(layout.optimizer_kernel).reserved(
        row["total"], row.get("grads", 0), layout.zero, layout.pp,
        row.get("loss_workspace", 0))
    return {"reserved": reserved, "process": reserved + runtime_bytes(layout)}


def card_peak(cfg: GPTConfig | str, layout: Layout = Layout(), *, device: str = "cuda",
              accounting: str = "fused", stage: int | None = None) -> dict:
    """What the busiest rank of ``layout`` needs of its card: the ``memory_per_stage`` row
    of the stage that needs the most (``stage``, or the first or the last: a middle stage
    holds no more than the first) with ``card_bytes`` added (``reserved``, ``process``).
    The planner and ``train``'s fit check both ask this function."""
    stages = sorted({0, layout.pp - 1}) if stage is None else [stage]
    rows = memory_per_stage(cfg, layout, accounting=accounting, stages=stages)
    for row in rows:
        row.update(card_bytes(row, layout, device))
    busiest = max(rows, key=lambda r: r["process"])
    if layout.offload:  # the host's busiest rank may be another stage's (the head's)
        busiest["host"] = max(r["host"] for r in rows)
    return busiest


def host_fit(host_per_rank: int, ranks_per_node: int, host_memory: int) -> bool:
    """Whether ``--offload``'s host states (``card_peak``'s ``host``: each rank's fp32
    master, gradient and AdamW moments and its upload buffer) of every rank of a node
    fit the node's ``host_memory`` bytes; 0: not known, not checked. The planner and
    ``train``'s fit check both ask this: past it, the kernel's out-of-memory killer ends
    a rank mid-step."""
    return not host_memory or host_per_rank * ranks_per_node <= host_memory
