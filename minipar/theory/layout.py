"""A layout: how a model is spread over GPUs and trained, as one frozen value.

The memory model (``memory.memory_per_stage``), the traffic model
(``comm_volume.comm_volume``), the step-time model (``planner.evaluate``) and the
planner's search all describe a run by the same settings: the parallel sizes (data,
pipeline, tensor, context, expert), the ZeRO stage, the batch split (micro-batch size
and count), the pipeline schedule, sequence parallelism, recomputation, offload, the
precision, compilation and the optimizer's kernel. ``Layout`` names them once (by
default one GPU, bf16 mixed-precision Adam stepped by torch's fused kernel, the CUDA
default), so a lesson reads ``memory_per_stage("gpt-13b", Layout(dp=4, zero=3))``. It is frozen:
a plain value that is hashable (a cached function may take it) and is changed by
copying (``with_``). A run's own is ``TrainConfig.layout()`` (``minipar.config``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from minipar.parallel.schedules import SPLIT_BACKWARD


@dataclass(frozen=True)
class Layout:
    """The parallel sizes, ZeRO stage, batch split, schedule and precision of one run."""

    dp: int = 1  # data-parallel replicas
    pp: int = 1  # pipeline stages
    tp: int = 1  # tensor-parallel ranks per layer
    cp: int = 1  # context-parallel ranks per sequence
    ep: int = 1  # expert-parallel ranks (inside dp): each MoE layer's experts split
    zero: int = 0  # ZeRO stage, 0-3
    microbatch_size: int = 1  # sequences per micro-batch on one dp rank
    microbatches: int = 1  # micro-batches per step
    schedule: str = "1f1b"  # gpipe, 1f1b, interleaved, zb
    virtual: int = 1  # model chunks per pipeline rank (interleaved)
    head_layers: int = 0  # the last pipeline chunk's layers fewer (``partition_layers``)
    sp: bool = False  # sequence parallelism (with tp > 1)
    recompute: str = "none"  # none, selective, cheap, full
    recompute_layers: int | None = None  # only the first N blocks of a chunk recompute
    recompute_rest: str = "none"  # what the others do: none, or cheap
    offload: bool = False  # ZeRO-Offload: masters, optimizer states and step on the host
    dtype: str = "bf16"  # compute dtype: bf16 (mixed precision) or fp32
    optimizer: str = "adam"  # adam(w), sgd, sgd-momentum
    # which torch kernel steps it (``memory.OPTIMIZER_KERNELS``): fused, foreach (multi-
    # tensor), forloop (one tensor at a time), host (ZeRO-Offload's step on the CPU)
    optimizer_kernel: str = "fused"
    grad_dtype: str = "fp32"  # where 16-bit gradients are summed and reduced
    # ZeRO-3's reduce-scatters on a second communicator over the same ranks, beside the
    # all-gathers instead of queued behind them (``RankMesh.reductions``)
    separate_reduce_group: bool = False
    fp8: str | None = None  # the blocks' linears in float8: rowwise or tensorwise
    chunked_loss: bool = False  # the loss keeps no fp32 logits (``parallel/chunked_loss``)
    # blocks through torch.compile (``parallel/compile.py``); None: not said, as ``train``
    # has it by default (``compiled_by_default``), priced as eager blocks
    compiled: bool | None = None
    order: str = "megatron"  # how ranks map to mesh coordinates (``minipar.mesh``)

    @property
    def gpus(self) -> int:
        """The ranks it takes: dp x pp x tp x cp (ep lies inside dp)."""
        return self.dp * self.pp * self.tp * self.cp

    @property
    def global_batch(self) -> int:
        """Sequences per step: dp x micro-batch size x micro-batches."""
        return self.dp * self.microbatch_size * self.microbatches

    def compiled_by_default(self, dropout: float = 0.0) -> bool:
        """Whether a run of this layout on CUDA compiles its blocks when it says neither
        ``--compile`` nor ``--no-compile``: where compilation applies (no dropout, whose
        per-step mask keys would recompile every step; not the zero-bubble schedules,
        whose split weight gradient runs at pp = 1 too; not cheap recomputation, which
        notes outputs as the block runs) and has paid on a GPU: data parallelism alone.
        Under a pipeline compiled blocks stepped slower than eager ones: a compiled block,
        split into several graphs at its fused linears, costs the host more per call than
        the eager block, and a stage that waits on its neighbours waits on its host too
        (docs/benchmarks.md; ``planner.HOST_COMPILED_FACTOR``); tp, cp and pipeline blocks
        compile when asked (``parallel/compile.py``)."""
        return (not dropout and self.schedule not in SPLIT_BACKWARD
                and self.pp == self.tp == self.cp == 1 and not self.cheap_recompute)

    @property
    def cheap_recompute(self) -> bool:
        """Whether some blocks recompute cheaply (``recompute`` or ``recompute_rest``)."""
        return "cheap" in (self.recompute, self.recompute_rest)

    def with_(self, **changes) -> Layout:
        return replace(self, **changes)

    def with_batch(self, global_batch: int) -> Layout:
        """This layout with as many micro-batches as make ``global_batch`` sequences."""
        if global_batch % (self.dp * self.microbatch_size):
            raise ValueError(f"global batch {global_batch} is not divisible by dp*b = "
                             f"{self.dp}*{self.microbatch_size}")
        return self.with_(microbatches=global_batch // (self.dp * self.microbatch_size))

    def label(self) -> str:
        """One line: the sizes, the ZeRO stage, the batch split, and what is not default."""
        sched = "" if self.pp == 1 else (
            f" {self.schedule}" + (f" v={self.virtual}" if self.virtual > 1 else ""))
        extras = (" sp" if self.sp else "") + (
            f" recompute={self.recompute}" if self.recompute != "none" else "") + (
            f" recompute-layers={self.recompute_layers}"
            if self.recompute_layers is not None else "") + (
            f" recompute-rest={self.recompute_rest}" if self.recompute_rest != "none"
            else "") + (
            f" head-layers={self.head_layers}" if self.head_layers else "") + (
            " chunked-loss" if self.chunked_loss else "") + (
            " separate-reduce-group" if self.separate_reduce_group else "") + (
            f" fp8={self.fp8}" if self.fp8 else "")
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        cp += f" ep={self.ep}" if self.ep > 1 else ""
        # the kernel only where it is not the default's (fused; offload's host step)
        named_kernel = self.optimizer_kernel not in ("fused", "host")
        return (f"tp={self.tp} pp={self.pp} dp={self.dp}{cp} zero={self.zero} "
                f"b={self.microbatch_size} m={self.microbatches}{sched}{extras}"
                + (" offload" if self.offload else "")
                + (f" {self.optimizer_kernel}" if named_kernel else ""))

    def train_flags(self, model: str) -> list[str]:
        """The ``python -m minipar train`` flags that run this layout of ``model``."""
        flags = ["--model", model, "--dp", str(self.dp), "--pp", str(self.pp),
                 "--tp", str(self.tp)]
        flags += ["--cp", str(self.cp)] if self.cp > 1 else []
        flags += ["--ep", str(self.ep)] if self.ep > 1 else []
        flags += ["--zero", str(self.zero), "--microbatches", str(self.microbatches),
                  "--batch-size", str(self.global_batch)]
        if self.pp > 1:
            flags += ["--schedule", self.schedule]
            flags += ["--virtual", str(self.virtual)] if self.virtual > 1 else []
            flags += ["--head-layers", str(self.head_layers)] if self.head_layers else []
        flags += ["--sp"] if self.sp else []
        flags += ["--recompute", self.recompute] if self.recompute != "none" else []
        if self.recompute_layers is not None:
            flags += ["--recompute-layers", str(self.recompute_layers)]
        flags += ["--recompute-rest", self.recompute_rest] if self.recompute_rest != "none" else []
        flags += ["--offload"] if self.offload else []
        flags += ["--no-fused"] if self.optimizer_kernel in ("foreach", "forloop") else []
        flags += ["--grad-dtype", self.grad_dtype] if self.grad_dtype != "fp32" else []
        flags += ["--order", self.order] if self.order != "megatron" else []
        flags += ["--fp8", self.fp8] if self.fp8 else []
        flags += ["--chunked-loss"] if self.chunked_loss else []
        flags += ["--separate-reduce-group"] if self.separate_reduce_group else []
        if self.compiled is not None and self.compiled != self.compiled_by_default():
            flags += ["--compile" if self.compiled else "--no-compile"]  # (a CPU: eager)
        return flags + ["--dtype", self.dtype]

    def command(self, model: str, backend: str = "nccl") -> str:
        """The command line that trains this layout on its GPUs (one rank per GPU)."""
        return " ".join(["python -m minipar train", *self.train_flags(model),
                         "--backend", backend])
