"""One rank's part of a training job and one optimizer step: what every layout shares.

``build`` composes this rank's part for a mesh. The single-device reference model is
built on the meta device (shapes, no storage), the techniques are applied from the
outside, and only then does this rank give its parameters their values, one at a time:
the reference's initial values by name and seed (``parallel/materialize.py``), so every
layout starts from the same weights without any rank holding the whole model:

1. expert parallelism replaces each MoE layer's experts by this rank's share of them
   (``parallel/ep.py``); tensor parallelism replaces submodules by sharded ones (the
   experts' MLPs too), following a printable plan (``parallel/tp.py``); context
   parallelism then replaces the attention cores by the ring, the position embedding
   and dropouts by their sequence-shard versions (``parallel/cp_plan.py``);
2. the pipeline gives each of this rank's chunks exactly its layers (``parallel/pp.py``);
   the rest of the reference model is dropped;
3. recomputation replaces blocks (``parallel/recompute.py``); with ``--fp8`` the blocks'
   linears become float8 ones (``parallel/fp8.py``); then each block is compiled
   (``parallel/compile.py``);
4. data parallelism, in one place (``data_parallel``, ``parallel/zero/``): ZeRO 0-2
   (stage 0 is data parallelism itself; replicated or sharded optimizer states and
   gradients, bf16 weights with fp32 masters) or ZeRO-3 (the weights sharded too).

``train_step``: this replica's rows of the step's global batch (the same tokens whatever
the layout; only these rows are built) cut into micro-batches, and of each row this cp
rank's tokens; the schedule runs forward and backward of all of them (pp = 1: a
one-stage schedule, i.e. gradient accumulation); gradients are synchronised, clipped on
the true global norm, and the optimizer steps. Each micro-batch loss (a mean over its
tokens) is scaled by 1/(dp * cp * m) and the data-parallel reduction sums over dp x cp,
so the gradient is exactly that of the global batch's mean loss on one device.
``minipar/engine.py`` runs this on every rank, step after step.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minipar.config import (
    TrainConfig,
    device_for,
    lr_at,
    optimizer_class,
    optimizer_kwargs,
    use_compile,
)
from minipar.data import TokenSource, local_batches
from minipar.hf import HFCheckpoint
from minipar.mesh import RankMesh
from minipar.meter import HeldPeaks, HostPeak
from minipar.model import GPT, GPTConfig, set_dropout_key, set_moe_loss_scale
from minipar.parallel.chunked_loss import apply_chunked_loss
from minipar.parallel.compile import apply_compile
from minipar.parallel.cp_plan import apply_context_parallel, shard_batch
from minipar.parallel.ep import (
    ExpertDataParallel,
    apply_expert_parallel,
    expert_values,
    split_experts,
)
from minipar.parallel.fp8 import apply_fp8, float8_weights
from minipar.parallel.materialize import init_values
from minipar.parallel.pp import (
    PipelineExecutor,
    PipelineStage,
    StageLayers,
    build_stage,
    tied_copy,
)
from minipar.parallel.precision import MixedPrecision
from minipar.parallel.recompute import apply_recompute
from minipar.parallel.schedules import make_schedule
from minipar.parallel.tp import apply_tensor_parallel, tp_shard_dim
from minipar.parallel.wgrad_fusion import fuse_weight_gradients
from minipar.parallel.zero import GradientSync, OnHost, Zero3, ZeroOptimizer
from minipar.parallel.zero.gather import Float8Weights
from minipar.parallel.zero.shards import global_grad_norm
from minipar.reshard import ShardReader, load_optimizer_state

__all__ = ["Parts", "build", "data_parallel", "loss_scale", "clip_gradients", "train_step"]


@dataclass
class Parts:
    """What one rank trains, once composed."""

    model: torch.nn.Module  # StageLayers: this rank's (sharded) layers, reference names
    chunks: list[PipelineStage]  # this rank's pipeline chunks (sharing the layers)
    optimizer: torch.optim.Optimizer  # steps on what data_parallel exposes
    executor: PipelineExecutor
    data_parallel: GradientSync  # ZeroOptimizer (ZeRO 0-2) or Zero3: the gradient sync
    names: list[str]  # reference names of this rank's trainable weights
    sp_names: list[str]  # weights whose gradient is also summed over tp (SP norms)
    tied_names: list[str]  # a tied embedding's copy, summed over the embedding group
    offload: OnHost | ExpertDataParallel | None = None  # ZeRO-Offload: its traffic
    # measurement beside the mechanics: the peaks of the data-parallel buffers in a step
    peaks: HeldPeaks = field(default_factory=HeldPeaks)
    build_seconds: float = 0.0  # how long build took on this rank
    host_peak_bytes: int = 0  # the resident host memory build added at its peak


def build(cfg: TrainConfig, rm: RankMesh, resume=None) -> Parts:
    """Compose this rank's part: tp -> pp -> recompute on the meta device, then this
    rank's shards only (``parallel/materialize.py``), then data parallel (ZeRO 0-3).

    ``resume``: a ``reshard.ShardReader`` (or a checkpoint directory): the weights and
    optimizer states come from it, each rank reading only the shards it needs.
    Records ``build_seconds`` and ``host_peak_bytes`` (resident host memory growth).
    """
    # imported before measuring: a module's first import costs seconds and tens of MB
    # that are not the build's (a torch optimizer's first construction imports dynamo)
    importlib.import_module("torch._dynamo")

    t0 = time.perf_counter()
    with HostPeak() as host:
        parts = _build(cfg, rm, resume)
    parts.build_seconds, parts.host_peak_bytes = time.perf_counter() - t0, host.peak
    return parts


def _build(cfg: TrainConfig, rm: RankMesh, resume) -> Parts:
    mcfg = cfg.model_config()
    full = GPT(mcfg, device="meta")  # shapes only: no rank ever holds the whole model
    if cfg.ep > 1:  # each MoE layer keeps this rank's experts (parallel/ep.py); tp then
        apply_expert_parallel(full, rm.ep)  # splits each one
    if cfg.tp > 1:
        apply_tensor_parallel(full, rm.tp, sequence_parallel=cfg.sp)
    if cfg.cp > 1:  # after tp: the cp styles see (and keep) sequence parallelism's slice
        apply_context_parallel(full, rm.cp)
    stage = build_stage(full, rm.coords.pp, cfg.pp, cfg.virtual, cfg.head_layers)
    apply_recompute(stage, cfg.recompute, cfg.recompute_layers, cfg.recompute_rest)
    if cfg.chunked_loss:  # the last chunk's loss without fp32 logits
        apply_chunked_loss(stage)
    if cfg.fp8:  # the blocks' linears (and tp's local products) multiply in float8
        apply_fp8(stage, cfg.fp8, emulate=cfg.fp8_emulate)
    if use_compile(cfg):  # last before data parallelism: its hooks stay outside the graphs
        apply_compile(stage, cfg.compile_backend)
    model = StageLayers(stage, full.cfg)  # what the optimizer and checkpoints see
    del full  # the layers no chunk took go with it
    device = device_for(cfg)
    if isinstance(resume, str):
        resume = ShardReader(resume, mcfg, rm.coords.tp, cfg.tp)
    # each weight's value, this rank's tp shard of it: the reference initialisation
    # (by name, from the seed) or the checkpoint's tensor, made one at a time
    # (or, from --init-from, the transformers directory's)
    if resume is not None:
        values = resume.values(device)
    elif cfg.init_from:
        values = HFCheckpoint(cfg.init_from).values(rm.coords.tp, cfg.tp, device)
    else:
        values = init_values(mcfg, cfg.seed, rm.coords.tp, cfg.tp, device)
    if cfg.ep > 1:
        values = expert_values(values, rm.ep.rank, cfg.ep)
    for chunk in stage:  # MoE auxiliary losses weigh as their micro-batch's loss
        set_moe_loss_scale(chunk, loss_scale(cfg))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # parameters whose gradient is summed over another group after the dp reduction:
    # sequence parallelism's replicated norms (over tp) and a tied embedding's two
    # copies on the first and last stage (over the embedding group)
    sp_names = [n for n, p in named if getattr(p, "sequence_parallel", False)]
    tied = ("tok_emb.weight", "head.weight") if model.cfg.tie_embeddings and rm.embed else ()
    tied_names = [n for n, _ in named if n in tied]
    offload = OnHost() if cfg.offload else None  # where the fp32 masters live and step
    sync, optimizer = data_parallel(
        cfg, rm, model, [b for c in stage for b in c.blocks.values()], [sp_names, tied_names],
        values, offload)
    if offload is not None and isinstance(sync, ExpertDataParallel):
        offload = sync  # (its last_traffic: both parts' hosts)
    peaks = HeldPeaks()
    sync.observe(peaks)
    if cfg.wgrad_fusion:  # before the executor looks at the modules
        fuse_weight_gradients(stage, sync)
    actions = make_schedule(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual)
    # The data-parallel layer works through hooks, so the executor runs the chunks.
    # A synchronize after every action makes the GPU timeline true but stalls the host
    # (a few % of a small model's step): only when a trace is asked for.
    executor = PipelineExecutor(stage, rm.pp, actions, device=device,
                                synchronize=bool(cfg.trace) and device.type == "cuda",
                                boundary=stage_boundary(cfg, mcfg) if rm.rehearsal else None)
    parts = Parts(model, stage, optimizer, executor, sync, [n for n, _ in named],
                  sp_names, tied_names, offload, peaks)
    if resume is not None:
        load_optimizer_state(rm, parts, resume)
        resume.close()
    return parts


def stage_boundary(cfg: TrainConfig, mcfg: GPTConfig
                   ) -> Callable[[tuple], tuple[tuple, torch.dtype]]:
    """What crosses a pipeline boundary for a micro-batch of token ids [b, s] (s: this
    rank's share of the sequence under cp): the hidden states [b, s, h], the sequence
    cut by tp under sequence parallelism, in the blocks' dtype. A rehearsed rank is told
    this; real ranks learn it from their neighbour's header."""
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    sp = cfg.tp if cfg.sp else 1
    return lambda key: ((key[0], key[1] // sp, mcfg.d_model), dtype)


def data_parallel(cfg: TrainConfig, rm: RankMesh, model: torch.nn.Module, units: list,
                  shared: list[list[str]], materialize=None, offload: OnHost | None = None
                  ) -> tuple[GradientSync, torch.optim.Optimizer]:
    """The one place that picks the data-parallel layout: (gradient sync, optimizer).
    Every choice offers the step the same calls (``parallel/zero/protocol.GradientSync``).

    ZeRO 0-2 is one ``torch.optim.Optimizer`` (``ZeroOptimizer``: it is both) with bf16
    weights and fp32 master shards, ``cfg.ddp`` its mode; ZeRO-3 a module whose
    parameters are the fp32 shards (``Zero3``), under a plain torch optimizer.
    ``offload`` (ZeRO-Offload, ``OnHost``): the fp32 master shards live and step on the
    host. ``materialize(name, p)``: the model is still on the meta device, and each
    stage makes its buffers from these values one weight at a time, never the whole
    fp32 local model. Gradients are summed, not averaged: the executor already divides
    each micro-batch loss by dp * cp * m (``loss_scale``). The group is dp x cp
    (``rm.dp_cp``, just dp when cp = 1): the weights are replicated over both, so their
    gradients are summed, and ZeRO shards, over both (as Megatron-Core's distributed
    optimizer does with context parallelism). With ``--ep`` the experts' weights, split
    over ep, are summed and sharded over their own replicas instead (``rm.edp``): a
    second ZeroOptimizer, joined to the first by ``parallel/ep.ExpertDataParallel``.
    """
    opt_cls, opt_kwargs = optimizer_class(cfg), optimizer_kwargs(cfg, host=cfg.offload)
    bf16 = cfg.dtype == "bf16"
    # fp32 sums keep every micro-batch's low bits (Megatron's default for the same
    # reason); bf16 halves the buffers and the adds, as torch's peers sum .grad
    grad_dtype = torch.bfloat16 if cfg.grad_dtype == "bf16" else torch.float32
    # --ep: two wrappers of the model, dense weights over dp x cp, experts over their
    # replicas (each part on a host of its own); one where this stage has no MoE block
    dense, experts = split_experts(model) if cfg.ep > 1 else ([], [])
    if cfg.zero == 3:
        # --fp8 tensorwise: the float8 linears' weights are gathered in float8, already
        # cast (parallel/zero/gather.py); rowwise ones in the compute dtype, as torchao
        matmuls = float8_weights(model) if cfg.fp8 == "tensorwise" else {}

        def zero3(comm, place, names=None, reduce_comm=None):
            return Zero3(model, comm, units=units, param_dtype=torch.bfloat16 if bf16 else None,
                         shared=shared, average=False, materialize=materialize,
                         place=place, grad_dtype=grad_dtype, only=names,
                         gather=Float8Weights(matmuls) if matmuls else None,
                         reduce_comm=reduce_comm)
        # (rm.reductions: dp_cp, or its twin with --separate-reduce-group)
        if experts:
            sync = ExpertDataParallel(zero3(rm.dp_cp, offload, dense, rm.reductions),
                                      zero3(rm.edp, offload and OnHost(), experts), rm.ep)
        else:
            sync = zero3(rm.dp_cp, offload, reduce_comm=rm.reductions)
        sync.backwards_per_step = cfg.microbatches  # OnHost: shards leave at the last
        optimizer = opt_cls(sync.parameters(), **opt_kwargs)
        sync.publish_after(optimizer)
        return sync, optimizer
    # on a meta model its masters are placeholders: ZeroOptimizer makes its own shards
    # from ``materialize`` and releases them
    precision = MixedPrecision(model, torch.bfloat16) if bf16 else None
    # Overlapped (the default): a bucket per block. ZeRO-2 then holds one full-size
    # bucket at most, and every stage makes a few large collectives, not many small ones
    # (25 MB buckets cost gpt-1.3b's ZeRO-1 over a hundred reduce-scatters a step;
    # docs/benchmarks.md). ``--ddp bucketed`` keeps PyTorch DDP's 25 MB, as lesson 01
    # teaches it.
    overlap = cfg.ddp == "overlapped"  # gradient reductions in the backward, gathers forward
    bucket_mb = 25.0 if not overlap and cfg.zero < 2 else max(
        (sum(p.numel() * p.element_size() for p in u.parameters()) for u in units),
        default=25 * 2**20) / 2**20

    def zero(params, comm, place):
        return ZeroOptimizer(params, opt_cls, module=model, stage=cfg.zero, comm=comm,
                             precision=precision, average=False, shared=shared,
                             mode=cfg.ddp, bucket_mb=bucket_mb, materialize=materialize,
                             place=place, grad_dtype=grad_dtype,
                             overlap_param_gather=overlap and cfg.overlap_param_gather,
                             **opt_kwargs)
    if experts:
        weights = dict(model.named_parameters())
        sync = ExpertDataParallel(zero([weights[n] for n in dense], rm.dp_cp, offload),
                                  zero([weights[n] for n in experts], rm.edp,
                                       offload and OnHost()), rm.ep)
    else:
        sync = zero(model.parameters(), rm.dp_cp, offload)
    sync.backwards_per_step = cfg.microbatches  # reduce during the last one's backward
    return sync, sync


def loss_scale(cfg: TrainConfig) -> float:
    """What each micro-batch loss is multiplied by: the dp x cp reduction sums, so the
    sum of dp * cp * m scaled losses is the global batch's mean loss. (A cp shard's loss
    is the mean over its tokens; every shard has seq_len / cp of them, so this equals
    its token sum over the global token count.)"""
    return 1.0 / (cfg.dp * cfg.cp * cfg.microbatches)


def clip_gradients(cfg: TrainConfig, rm: RankMesh, parts: Parts) -> torch.Tensor:
    """Scale the gradients so their global L2 norm is at most ``cfg.grad_clip``.

    The one gradient norm of every layout (``zero.shards.global_grad_norm``): each element is
    counted once, on the rank that owns it: its ZeRO shard over dp x cp, tensor-parallel
    shards over tp (replicated parameters on tp rank 0 only), stages over pp. Returns
    the norm before clipping, as a 0-dim tensor on the compute device: the clip factor
    ``min(1, clip / norm)`` is computed and applied there too, as
    ``torch.nn.utils.clip_grad_norm_`` does (read the norm after the update).
    """

    def counted(name: str) -> bool:
        if tied_copy(name, parts.model.cfg):  # the last stage's copy of a tied embedding
            return False
        return rm.coords.tp == 0 or tp_shard_dim(name) is not None  # replicated: tp 0

    mine = [g for name, g in parts.data_parallel.grad_shards() if counted(name)]
    norm = global_grad_norm(mine, [rm.dp_cp, rm.tp, rm.pp], device=device_for(cfg))
    if cfg.grad_clip > 0:  # as torch.nn.utils.clip_grad_norm_: multiply by 1.0 if below
        parts.data_parallel.scale_grads((cfg.grad_clip / (norm + 1e-6)).clamp(max=1.0))
    return norm


def train_step(cfg: TrainConfig, rm: RankMesh, parts: Parts, data: TokenSource,
               step: int) -> dict:
    """One optimizer step on the global batch of ``step``. Returns loss and timeline."""

    lr = lr_at(step, cfg)
    for group in parts.optimizer.param_groups:
        group["lr"] = lr
    device = device_for(cfg)  # only this replica's rows are built (data.local_batches)
    micro = [tuple(t.to(device) for t in shard_batch(a, b, rm.cp)) for a, b in local_batches(
        data, step, cfg.batch_size, rm.coords.dp, cfg.dp, cfg.microbatches)]
    mb_size = cfg.batch_size // (cfg.dp * cfg.microbatches)

    def key_dropout(mb: int) -> None:  # masks by global sample: the reference's masks
        first = (rm.coords.dp * cfg.microbatches + mb) * mb_size
        for chunk in parts.chunks:
            set_dropout_key(chunk, cfg.seed, step, first)
    # the gradients are reduced over dp during the backwards (the last micro-batch's,
    # or each one's with ZeRO-3); the sync finishes what is still in flight
    result = parts.executor.step(micro, loss_scale=loss_scale(cfg),
                                 loss_as_tensor=True,  # read at the end of the step
                                 before_compute=key_dropout if parts.model.cfg.dropout
                                 else None)
    sync = parts.data_parallel
    sync.finish_gradient_sync()
    # sequence parallelism: layer-norm gradients summed over tp, on the shards
    sync.all_reduce_grads(parts.sp_names, rm.tp)
    if rm.embed is not None:  # a tied embedding: the first and last stage's copies
        sync.all_reduce_grads(parts.tied_names, rm.embed)
    norm = clip_gradients(cfg, rm, parts)
    parts.optimizer.step()
    # peaks of this step; parameters and optimizer states after the update
    held = parts.peaks.with_peaks(sync.memory_bytes(parts.optimizer))
    # ZeRO-Offload: host <-> device bytes of this step
    offload = parts.offload.last_traffic if parts.offload is not None else None
    sync.zero_grad()
    loss = None
    if result.loss is not None:  # last stage: the mean over the dp replicas, cp shards
        t = result.loss.detach().to(torch.float64).reshape(1)
        rm.dp_cp.all_reduce(t)
        loss = float(t) / (cfg.dp * cfg.cp)  # the step's one wait for the GPU
    return {"loss": loss, "grad_norm": float(norm), "lr": lr, "timeline": result.timeline,
            "peak_in_flight": result.peak_in_flight, "memory": held, "offload": offload}
