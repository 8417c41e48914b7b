"""Tensor parallelism (Megatron-LM) and the vocabulary-parallel loss, applied by a plan.

Tensor parallelism splits each layer's weights across ``tp`` ranks so that no rank holds
or computes the whole layer (Shoeybi et al. 2019, arXiv 1909.08053, section 3):

* MLP: ``fc`` is split by output columns, ``proj`` by input rows. GELU then runs on each
  rank's own columns, and the only communication is one all-reduce after ``proj``.
* Attention: the fused ``qkv`` weight has rows [q | k | v], heads contiguous inside each;
  each rank takes *whole heads* (rows of q, k and v of its heads), attends on its heads
  alone, and ``proj`` (split by rows) ends in one all-reduce.
* So a sublayer needs one all-reduce forward ("g") and one backward ("f", conjugate).
* MoE experts (``model.Experts``): each expert's MLP is split as the MLP is (its
  ``fc`` by output columns, ``proj`` by input rows, one all-reduce), every expert on
  every tp rank (Megatron-Core's default: expert tp = tp); with expert parallelism the
  rows arrive by all-to-all first (``ep.py``).
* Vocabulary: the embedding and the head are split by vocabulary rows. The loss is
  computed from the shards with three small all-reduces (max, sum of exp, target logit),
  so logits for the whole vocabulary never exist on one rank.

Sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198) lives next door in
``sp.py``: with ``sequence_parallel=True`` the same layers move a sequence shard between
tensor-parallel regions instead of the full activation.

How it is applied: by a *plan*, as torchtitan's ``parallelize_module(model, mesh, plan)``
reads. ``tensor_parallel_plan(sp)`` maps module-name patterns to styles
(``"blocks.*.mlp.fc": ColwiseParallel()``); ``parallelize_module`` replaces every
matching submodule of an initialised single-device ``GPT`` by its parallel version,
holding this rank's slice of the same weights. Parameter names do not change, so
``shard_tensor`` / ``unshard`` / ``gather_tensor`` move any parameter (or optimizer
state) between full and sharded form by name. Print the plan with ``describe_plan``.
Without SP the activation between blocks is the full [b, s, h] on every tp rank; with
SP it is [b, s/tp, h], rank r holding positions [r*s/tp, (r+1)*s/tp).

Dropout needs nothing special: its masks are keyed by global position
(``minipar.model.KeyedDropout``), so a sequence shard only says where it starts.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minipar.comm import Comm
from minipar.model import GPT, GPTConfig, GroupedLinear, grouped_matmul
from minipar.parallel.sp import (  # sync_sequence_parallel_grads: re-exported
    SequenceParallel,
    _GatherLinear,
    _LinearReduceScatter,
    _ReduceScatterToSP,
    sync_sequence_parallel_grads,
)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "ColumnParallelGroupedLinear",
    "RowParallelGroupedLinear", "GroupedColwiseParallel", "GroupedRowwiseParallel",
    "VocabParallelEmbedding",
    "VocabParallelCrossEntropy", "vocab_parallel_cross_entropy", "ColwiseParallel",
    "RowwiseParallel", "VocabParallel", "SequenceParallel", "VocabParallelLoss",
    "tensor_parallel_plan", "describe_plan", "parallelize_module", "apply_tensor_parallel",
    "check_tp", "tp_shard_dim", "shard_tensor", "unshard", "gather_tensor",
    "sync_sequence_parallel_grads",
]

def check_tp(cfg: GPTConfig, tp: int, sequence_parallel: bool = False) -> None:
    """Raise ValueError (one line) if ``cfg`` cannot be split ``tp`` ways. Pure; call it
    before starting processes."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor parallel size must be a positive integer, got {tp!r}")
    sizes = [("n_head", cfg.n_head), ("d_model", cfg.d_model), ("d_ff", cfg.d_ff),
             ("vocab_size", cfg.vocab_size)]
    if cfg.n_expert:
        sizes.append(("the experts' hidden size", cfg.expert_d_ff))
    if sequence_parallel:
        sizes.append(("seq_len (with sequence parallelism)", cfg.seq_len))
    for what, n in sizes:
        if n % tp:
            raise ValueError(f"tp={tp} does not divide {what}={n}; choose a tp that does")


# --- the conjugate communication functions -------------------------------------------
# f and g of Megatron's figure 3, and their sequence-parallel twins. Backward receives
# a gradient that autograd may share with other branches, so we reduce a fresh copy.

def _fresh(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = _fresh(grad)
        ctx.comm.all_reduce(grad)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce of partial sums forward; identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.mark_dirty(x)  # reduced in place: x is a fresh matmul output nobody saved
        comm.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# --- layers --------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """y[..., local outputs] = x W_local^T + b_local. Input: full [b, s, h] (replicated)
    or, with SP, the sequence shard [b, s/tp, h]. Output: this rank's output columns.
    ``linear(x, w, b)``: the local product (``F.linear``; float8: ``fp8.Float8Matmul``)."""

    split = "out"  # the feature dimension the tp group splits

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, comm: Comm,
                 sequence_parallel: bool, linear: Callable = F.linear) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.comm, self.sequence_parallel, self.linear = comm, sequence_parallel, linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return _GatherLinear.apply(x, self.weight, self.bias, self.comm)
        return self.linear(_CopyToTP.apply(x, self.comm), self.weight, self.bias)


class RowParallelLinear(ColumnParallelLinear):
    """Input: this rank's slice of the features. Each rank's x W_local^T is a partial sum;
    all-reduce it (or reduce-scatter it along the sequence with SP), then add the bias
    (replicated: added once, after the sum)."""

    split = "in"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = _LinearReduceScatter.apply(x, self.weight, self.comm)
        else:
            y = _ReduceFromTP.apply(self.linear(x, self.weight, None), self.comm)
        return y if self.bias is None else y + self.bias


class ColumnParallelGroupedLinear(GroupedLinear):
    """An MoE layer's ``experts.fc`` split like ``ColumnParallelLinear``: each expert's
    output columns (dim 1 of [E, out, in]) over tp. Input: the rows sorted by expert,
    the same on every tp rank (its gradient summed over tp: f)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter, comm: Comm) -> None:
        nn.Module.__init__(self)
        self.weight, self.bias, self.comm = weight, bias, comm

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return super().forward(_CopyToTP.apply(x, self.comm), counts)


class RowParallelGroupedLinear(ColumnParallelGroupedLinear):
    """``experts.proj`` split like ``RowParallelLinear``: each expert's input rows (dim 2)
    over tp; the partial sums are all-reduced (g), then the bias (replicated) added."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromTP.apply(grouped_matmul(x, self.weight, counts), self.comm)
        return y + self.bias.repeat_interleave(counts, dim=0, output_size=x.shape[0])


class VocabParallelEmbedding(nn.Module):
    """Rows [rank*V/tp, (rank+1)*V/tp) of the table. Tokens outside the shard look up
    zeros; the sum over ranks (all-reduce, or reduce-scatter with SP) completes them."""

    def __init__(self, weight: nn.Parameter, comm: Comm, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight, self.comm, self.sequence_parallel = weight, comm, sequence_parallel

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n = self.weight.shape[0]
        local = idx - self.comm.rank * n
        outside = (local < 0) | (local >= n)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return _ReduceScatterToSP.apply(out, self.comm)
        return _ReduceFromTP.apply(out, self.comm)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from logits split by vocabulary (Megatron's
    ``vocab_parallel_cross_entropy``): loss = log sum_j exp(z_j - m) - (z_target - m),
    with m, the sum and z_target each completed by an all-reduce of [tokens] values."""

    @staticmethod
    def forward(ctx, logits, targets, comm):
        n = logits.shape[-1]
        m = logits.max(dim=-1).values
        comm.all_reduce(m, op="max")  # for stability only; any common shift is exact
        z = logits - m.unsqueeze(-1)
        local = targets - comm.rank * n
        outside = (local < 0) | (local >= n)
        local = local.masked_fill(outside, 0)
        target = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(target)
        exp = z.exp()
        total = exp.sum(dim=-1)
        comm.all_reduce(total)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, outside)
        return total.log() - target

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        onehot = (~outside).to(softmax.dtype).unsqueeze(-1)
        grad_logits = softmax.scatter_add(-1, local.unsqueeze(-1), -onehot)
        return grad_logits * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 comm: Comm) -> torch.Tensor:
    """Mean cross-entropy of [b, s, V/tp] vocabulary-shard logits against full [b, s]
    targets; equal on every tp rank."""
    flat = logits.float().flatten(0, -2)
    return _VocabParallelCrossEntropy.apply(flat, targets.flatten(), comm).mean()


class VocabParallelCrossEntropy(nn.Module):
    """The model's ``loss_fn`` for logits split by vocabulary."""

    def __init__(self, comm: Comm) -> None:
        super().__init__()
        self.comm = comm

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.comm)


# --- parameters by name: which dimension is split, and how -----------------------------

_SHARD_DIMS = {  # parameter name suffix -> dimension split across tp ranks
    "tok_emb.weight": 0, "head.weight": 0,  # by vocabulary rows
    "attn.qkv.weight": 0, "attn.qkv.bias": 0,  # by heads, inside each of q, k, v
    "attn.proj.weight": 1,
    "mlp.fc.weight": 0, "mlp.fc.bias": 0,
    "mlp.proj.weight": 1,
    # an MoE layer's experts ([E, out, in] each): every expert's MLP split as the MLP's
    "experts.fc.weight": 1, "experts.fc.bias": 1,
    "experts.proj.weight": 2,
}
_PATTERN = re.compile(r"(?:^|\.)(" + "|".join(map(re.escape, _SHARD_DIMS)) + r")$")


def tp_shard_dim(name: str) -> int | None:
    """The dimension along which parameter ``name`` is split, or None if replicated.
    Prefixes are ignored (``module.blocks.0.mlp.fc.weight`` works)."""
    match = _PATTERN.search(name)
    return None if match is None else _SHARD_DIMS[match.group(1)]


def _is_qkv(name: str) -> bool:
    return re.search(r"(?:^|\.)attn\.qkv\.(weight|bias)$", name) is not None


def shard_tensor(name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """Rank ``tp_rank``'s part of the full tensor of parameter ``name`` (or of its
    optimizer state). May share memory with ``full``. For qkv: q, k and v rows of this
    rank's heads, in that order."""
    dim = tp_shard_dim(name)
    if dim is None:
        return full
    if _is_qkv(name):
        three = full.reshape(3, full.shape[0] // 3, *full.shape[1:])
        return three.chunk(tp, dim=1)[tp_rank].reshape(-1, *full.shape[1:])
    return full.chunk(tp, dim=dim)[tp_rank]


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor of parameter ``name`` from every rank's shard (rank order)."""
    dim = tp_shard_dim(name)
    if dim is None:
        return shards[0]
    if _is_qkv(name):
        rest = shards[0].shape[1:]
        parts = [s.reshape(3, s.shape[0] // 3, *rest) for s in shards]
        return torch.cat(parts, dim=1).reshape(-1, *rest)
    return torch.cat(shards, dim=dim)


def gather_tensor(name: str, local: torch.Tensor, comm: Comm) -> torch.Tensor:
    """All-gather a sharded tensor over the tp group and return the full one."""
    if tp_shard_dim(name) is None or comm.size == 1:
        return local
    gathered = comm.all_gather(local.detach().contiguous(), dim=0)
    return unshard(name, list(gathered.chunk(comm.size, dim=0)))


# --- styles and the plan -------------------------------------------------------------
# A style turns one reference submodule into its parallel version. ``shard(name, p)``
# gives this rank's slice of parameter ``p`` (named ``name``): one new Parameter per
# original, so a tied weight stays tied.

@dataclass(frozen=True)
class ColwiseParallel:
    """nn.Linear -> ColumnParallelLinear (weight and bias split by output rows)."""

    sequence_parallel: bool = False

    def apply(self, module: nn.Linear, name: str, comm: Comm, shard) -> nn.Module:
        bias = None if module.bias is None else shard(f"{name}.bias", module.bias)
        return ColumnParallelLinear(shard(f"{name}.weight", module.weight), bias, comm,
                                    self.sequence_parallel)


@dataclass(frozen=True)
class RowwiseParallel(ColwiseParallel):
    """nn.Linear -> RowParallelLinear (weight split by input columns, bias replicated)."""

    def apply(self, module: nn.Linear, name: str, comm: Comm, shard) -> nn.Module:
        return RowParallelLinear(shard(f"{name}.weight", module.weight), module.bias, comm,
                                 self.sequence_parallel)


@dataclass(frozen=True)
class GroupedColwiseParallel:
    """GroupedLinear (an MoE layer's ``experts.fc``) -> ColumnParallelGroupedLinear."""

    def apply(self, module: GroupedLinear, name: str, comm: Comm, shard) -> nn.Module:
        return ColumnParallelGroupedLinear(shard(f"{name}.weight", module.weight),
                                           shard(f"{name}.bias", module.bias), comm)


@dataclass(frozen=True)
class GroupedRowwiseParallel:
    """GroupedLinear (``experts.proj``) -> RowParallelGroupedLinear (bias replicated)."""

    def apply(self, module: GroupedLinear, name: str, comm: Comm, shard) -> nn.Module:
        return RowParallelGroupedLinear(shard(f"{name}.weight", module.weight), module.bias,
                                        comm)


@dataclass(frozen=True)
class VocabParallel(ColwiseParallel):
    """nn.Embedding -> VocabParallelEmbedding (rows of the vocabulary)."""

    def apply(self, module: nn.Embedding, name: str, comm: Comm, shard) -> nn.Module:
        return VocabParallelEmbedding(shard(f"{name}.weight", module.weight), comm,
                                      self.sequence_parallel)


@dataclass(frozen=True)
class VocabParallelLoss:
    """CrossEntropy -> VocabParallelCrossEntropy (takes logits split by vocabulary)."""

    def apply(self, module: nn.Module, name: str, comm: Comm, shard) -> nn.Module:
        return VocabParallelCrossEntropy(comm)


def tensor_parallel_plan(sequence_parallel: bool = False) -> dict[str, object]:
    """Megatron's split of a ``GPT``, as module-name pattern -> style (``*``: any)."""
    sp = sequence_parallel
    plan: dict[str, object] = {"tok_emb": VocabParallel(sp)}
    if sp:
        plan |= {"pos_emb": SequenceParallel(), "drop": SequenceParallel(),
                 "blocks.*.resid_drop*": SequenceParallel()}
    return plan | {
        "blocks.*.attn.qkv": ColwiseParallel(sp), "blocks.*.attn.proj": RowwiseParallel(sp),
        "blocks.*.mlp.fc": ColwiseParallel(sp), "blocks.*.mlp.proj": RowwiseParallel(sp),
        "blocks.*.mlp.experts.fc": GroupedColwiseParallel(),
        "blocks.*.mlp.experts.proj": GroupedRowwiseParallel(),
        "head": ColwiseParallel(sp), "loss_fn": VocabParallelLoss(),
    }


def describe_plan(plan: dict[str, object]) -> str:
    """The plan as a table a learner can read, one pattern per line."""
    width = max(map(len, plan))
    return "\n".join(f"{pattern:<{width}}  {style!r}" for pattern, style in plan.items())


def parallelize_module(model: nn.Module, comm: Comm, plan: dict[str, object]) -> nn.Module:
    """Replace every submodule of ``model`` that matches a pattern of ``plan`` by what
    its style makes of it, in place; patterns are applied in order. Returns ``model``."""
    new: dict[int, nn.Parameter] = {}  # id(original) -> this rank's part: ties survive

    def shard(name: str, p: nn.Parameter) -> nn.Parameter:
        if id(p) not in new:
            part = shard_tensor(name, p.detach(), comm.rank, comm.size)
            new[id(p)] = nn.Parameter(part.clone(), requires_grad=p.requires_grad)
        return new[id(p)]

    for pattern, style in plan.items():
        for name, module in list(model.named_modules()):
            if name and fnmatch.fnmatchcase(name, pattern):
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf,
                        style.apply(module, name, comm, shard))
    return model


def apply_tensor_parallel(model: GPT, comm: Comm, sequence_parallel: bool = False) -> GPT:
    """Split a full, initialised ``GPT`` over the tp group ``comm``, in place, with
    ``tensor_parallel_plan``. With SP the replicated parameters (layer norms, position
    embedding, row biases) see only part of the sequence: they are marked
    ``p.sequence_parallel = True``; call ``sync_sequence_parallel_grads`` after backward.
    """
    check_tp(model.cfg, comm.size, sequence_parallel)
    parallelize_module(model, comm, tensor_parallel_plan(sequence_parallel))
    for name, p in model.named_parameters():
        if sequence_parallel and tp_shard_dim(name) is None:
            p.sequence_parallel = True
    return model
