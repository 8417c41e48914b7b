"""The PyTorch-native peers minipar is timed against, written once for every benchmark.

Each function builds PyTorch's own implementation of a technique on minipar's plain
``GPT`` (the model knows nothing of parallelism, so both sides run the same modules):

* ``MasterWeights``: bf16 weights, fp32 master copies, AdamW on the masters, global-norm
  clipping, copy back: the arithmetic of minipar's ``MixedPrecision`` without the
  machinery (Micikevicius et al. 2018), for peers that have no mixed precision of their
  own (DDP, ``torch.distributed.pipelining``).
* ``fsdp2``: ``fully_shard`` on every block, then the root (FSDP2), optionally with bf16
  parameters and fp32 gradient reduction, optionally on the meta device (a model that
  does not fit one device is initialised shard by shard), optionally with activation
  checkpointing of every block.
* ``dtensor_tp``: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``
  (and ``SequenceParallel`` plus ``PrepareModuleInput`` for sequence parallelism: the
  torchtitan recipe).
* ``UpToLogits`` / ``torch_pipeline``: minipar's stage split run by
  ``torch.distributed.pipelining``'s schedules.
* ``context_parallel_peer`` / ``cp_train_step``: ``context_parallel`` (torch's ring
  attention, head-tail load balancing) on a replicated model (bf16 weights, fp32
  masters, DDP over the cp group), the position embedding replaced by ``GivenPositions``
  so that the position ids can be a sequence-sharded buffer like the tokens.

Used by ``bench_dp.py``, ``bench_tp.py``, ``bench_pp.py`` (CPU, gloo) and ``multigpu.py``
(GPUs, NCCL), ``mg_cp.py`` (context parallelism). Nothing here is imported by minipar itself.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from minipar.model import GPT, embed_tokens
from minipar.parallel.tp import shard_tensor

# minipar schedule -> torch.distributed.pipelining class and chunks per rank. torch has
# no single-chunk ZB-H1; its zero-bubble schedule for looped stages, the peer of
# interleaved-zb, is the closest.
TORCH_SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
                   "interleaved": ("ScheduleInterleaved1F1B", 2),
                   "zb": ("ScheduleInterleavedZeroBubble", 2),
                   "interleaved-zb": ("ScheduleInterleavedZeroBubble", 2)}


class MasterWeights:
    """fp32 masters of a bf16 model's parameters, stepped by AdamW; ``step`` clips on the
    global norm (summed over ``group`` when the parameters are split across ranks)."""

    def __init__(self, params, lr: float = 3e-4, fused: bool = False, clip: float = 1.0,
                 group=None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.masters = [nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=lr, fused=fused or None)
        self.clip, self.group = clip, group

    def step(self) -> None:
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
            p.grad = None
        grads = [m.grad for m in self.masters]
        norm_sq = torch.nn.utils.get_total_norm(grads, 2.0).square()
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(norm_sq, group=self.group)
        factor = (self.clip / (norm_sq.sqrt() + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, factor)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)


def clip_mixed(params, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` for a tensor-parallel model whose parameters are partly DTensors
    (sharded linears) and partly plain tensors (replicated layer norms without sequence
    parallelism): torch's refuses the mix. Replicated gradients are counted once."""
    grads = [p.grad for p in params if p.grad is not None]
    dist_grads = [g for g in grads if hasattr(g, "full_tensor")]
    plain = [g for g in grads if not hasattr(g, "full_tensor")]
    total = torch.zeros((), device=grads[0].device if grads else "cpu")
    if dist_grads:
        norm = torch.nn.utils.get_total_norm(dist_grads, 2.0)
        total = total + (norm.full_tensor() if hasattr(norm, "full_tensor") else norm) ** 2
    if plain:
        total = total + torch.nn.utils.get_total_norm(plain, 2.0).to(total.device) ** 2
    factor = (max_norm / (total.sqrt() + 1e-6)).clamp(max=1.0)
    if dist_grads:  # a DTensor takes a number, not a plain tensor (one host sync)
        torch._foreach_mul_(dist_grads, float(factor))
    if plain:
        torch._foreach_mul_(plain, factor)
    return total.sqrt()


def init_like_gpt(model: nn.Module, n_layer: int) -> None:
    """GPT-2 initialisation (as ``GPT.reset_parameters``) on each rank's local shards:
    a model built on the meta device gets the same distribution, not the same values."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if p.dim() == 1:
                local.fill_(0.0 if name.endswith("bias") else 1.0)
            else:
                std = 0.02 / (math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 1)
                local.normal_(0.0, std)


def fsdp2(model: GPT, mesh, *, bf16: bool = False, recompute: bool | int = False,
          meta: bool = False, device: torch.device | None = None,
          separate_reduce_group: bool = False) -> GPT:
    """FSDP2: ``fully_shard`` per block then the root; bf16 parameters with fp32 reduction
    when ``bf16``; every block checkpointed when ``recompute`` is True, the first N when
    it is N (Megatron's ``--recompute-num-layers``, as minipar's ``--recompute-layers``:
    the peer at the fewest recomputed blocks that fit a card). ``meta``: ``model`` was
    built on the meta device; its shards are materialised on ``device`` and initialised.
    ``separate_reduce_group``: its reduce-scatters on a communicator of their own
    (``FSDPModule.set_separate_reduce_scatter_group``, minipar's
    ``--separate-reduce-group``); a torch without it raises."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 else MixedPrecisionPolicy())
    if recompute is not False:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        first = len(model.blocks) if recompute is True else int(recompute)
        for i, block in enumerate(model.blocks[:first]):
            model.blocks[i] = checkpoint_wrapper(block)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if separate_reduce_group:
        if not hasattr(model, "set_separate_reduce_scatter_group"):
            raise RuntimeError(f"torch {torch.__version__}'s FSDP2 has no "
                               "set_separate_reduce_scatter_group")
        model.set_separate_reduce_scatter_group(True)
    if meta:
        model.to_empty(device=device)
        init_like_gpt(model, len(model.blocks))
    return model


def dtensor_tp(ref: GPT, ws: int, sp: bool, device_type: str = "cpu") -> GPT:
    """A copy of ``ref`` split ``ws`` ways by DTensor tensor parallelism (vocabulary-
    parallel head; use ``loss_parallel()`` around forward and backward). The fused qkv
    rows are reordered so that each rank's contiguous block holds whole heads, and each
    attention module is told its local head count (as torchtitan does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    model = copy.deepcopy(ref)
    with torch.no_grad():  # rank-major [q_r | k_r | v_r] blocks, so a row chunk = heads
        for i, block in enumerate(model.blocks):
            for kind in ("weight", "bias"):
                p = getattr(block.attn.qkv, kind)
                name = f"blocks.{i}.attn.qkv.{kind}"
                p.copy_(torch.cat([shard_tensor(name, p, r, ws) for r in range(ws)]))
            # (the attention reads its local head count off the width qkv returns)
    mesh = init_device_mesh(device_type, (ws,))
    seq = Shard(1)
    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(),
                                   output_layouts=seq if sp else Replicate()),
        "head": ColwiseParallel(input_layouts=seq if sp else Replicate(),
                                output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan["pos_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
        plan["ln_f"] = SequenceParallel()
    for i in range(len(model.blocks)):
        b = f"blocks.{i}."
        plan.update({b + "attn.qkv": ColwiseParallel(), b + "mlp.fc": ColwiseParallel(),
                     b + "attn.proj": RowwiseParallel(output_layouts=seq if sp else Replicate()),
                     b + "mlp.proj": RowwiseParallel(output_layouts=seq if sp else Replicate())})
        if sp:
            gather = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
            plan.update({b + "ln1": SequenceParallel(), b + "ln2": SequenceParallel(),
                         b + "attn": gather, b + "mlp": copy.deepcopy(gather)})
    return parallelize_module(model, mesh, plan)


class UpToLogits(nn.Module):
    """A minipar chunk that stops at the logits: torch's schedules apply the loss."""

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.chunk
        h = embed_tokens(c.tok_emb, c.pos_emb, c.drop, x) if c.is_first else x
        for block in c.blocks.values():
            h = block(h)
        return c.head(c.ln_f(h)) if c.is_last else h


def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def torch_pipeline(chunks: list, n_stages: int, name: str, microbatches: int,
                   device: torch.device):
    """``torch.distributed.pipelining`` running minipar's chunks (``build_stage``) with
    the schedule that matches ``name`` (``TORCH_SCHEDULES``). Returns the schedule."""
    from torch.distributed import pipelining

    stages = [pipelining.PipelineStage(UpToLogits(c), c.index, n_stages, device)
              for c in chunks]
    cls = getattr(pipelining, TORCH_SCHEDULES[name][0])
    looped = len(stages) > 1 or TORCH_SCHEDULES[name][1] > 1
    return cls(stages if looped else stages[0], n_microbatches=microbatches,
               loss_fn=pipeline_loss)


class GivenPositions(nn.Module):
    """A position embedding that looks up given position ids (``ids``: (batch, t), set
    before each forward) instead of 0..t-1: under torch's ``context_parallel`` a rank
    holds the head-tail shard of the sequence, so its positions are a buffer sharded
    like the tokens. ``forward(pos)`` reads ``ids`` at the local indices ``pos`` (what
    ``embed_tokens`` passes). Keeps the name ``pos_emb.weight``."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight
        self.ids: torch.Tensor | None = None  # not a buffer: it differs by cp rank

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        ids = pos if self.ids is None else self.ids[..., pos]
        return F.embedding(ids, self.weight)


def context_parallel_peer(model: GPT, device: torch.device, rotate: str = "allgather"):
    """torch's context parallelism over every rank: ``model`` (on ``device``, fp32) gets
    ``GivenPositions``, fp32 masters (``MasterWeights``), bf16 weights and DDP (the
    gradient averaged over the cp group). Returns (ddp, masters, mesh); step with
    ``cp_train_step``. SDPA must run causal (``is_causal=True``: the load balancer needs
    it) on a CUDA kernel (flash, efficient or cuDNN); torch has no CPU path for it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.parallel import DistributedDataParallel as DDP

    set_rotate_method(rotate)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("cp",))
    model.pos_emb = GivenPositions(model.pos_emb.weight)  # a submodule replaced
    masters = MasterWeights(model.parameters(), fused=device.type == "cuda")
    model.to(torch.bfloat16)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=25)
    return ddp, masters, mesh


def cp_train_step(ddp, masters: MasterWeights, mesh, x: torch.Tensor,
                  y: torch.Tensor) -> float:
    """One step on the full (batch, seq) tokens ``x``, targets ``y`` (every rank passes
    the same): ``context_parallel`` shards them and the position ids in place (head-
    tail), forward and backward run inside it, then the masters step."""
    from torch.distributed.tensor.experimental import context_parallel

    x, y = x.clone(), y.clone()  # sharded in place
    pos = torch.arange(x.shape[1], device=x.device).repeat(x.shape[0], 1)
    with context_parallel(mesh, buffers=[x, y, pos], buffer_seq_dims=[1, 1, 1],
                          no_restore_buffers={x, y, pos}):
        ddp.module.pos_emb.ids = pos
        loss = ddp(x, y)
        loss.backward()
    ddp.module.pos_emb.ids = None
    masters.step()
    return loss.item()
