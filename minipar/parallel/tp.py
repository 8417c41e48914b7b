"""Tensor parallelism (Megatron-LM) with sequence parallelism, applied by a plan.

Each layer's weights are split over the ``tp`` ranks (Shoeybi et al. 2019, arXiv
1909.08053, section 3): ``qkv`` and ``fc`` by output rows (attention by whole heads),
``proj`` by input columns, so a sublayer costs one all-reduce forward ("g") and one
backward ("f"); the embedding, head and loss are split by vocabulary rows, so no rank
holds logits for the whole vocabulary. An MoE layer's experts are split as the MLP is,
every expert on every tp rank (Megatron-Core's default, expert tp = tp; with expert
parallelism the rows arrive by all-to-all first, ``ep.py``). Sequence parallelism
(Korthikanti et al. 2022, arXiv 2205.05198, 4.2.2) is the same layers with g a
reduce-scatter and f an all-gather along the sequence: outside the tp regions a rank
keeps positions [r*s/tp, (r+1)*s/tp). An MoE layer under it gathers the sequence first
and routes it whole (``SequenceParallelMoE``).

The plan (``tensor_parallel_plan``) maps module-name patterns to styles named and meant
as torch's; ``parallelize_module`` swaps each matching submodule of a single-device
``GPT`` for its parallel version. The plan is the one statement of how a parameter is
split (``tp_split``): checkpoints and sharded initialisation read it.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard

from minipar.comm import Comm
from minipar.model import GPT, GPTConfig, GroupedLinear, KeyedDropout, MoE, grouped_matmul

__all__ = [
    "check_tp", "wanted", "ColumnParallelLinear", "RowParallelLinear",
    "ColumnParallelGroupedLinear", "RowParallelGroupedLinear", "GroupedColwiseParallel",
    "GroupedRowwiseParallel",
    "VocabParallelEmbedding", "SequenceShardedEmbedding", "SequenceParallelDropout",
    "VocabParallelCrossEntropy", "vocab_parallel_cross_entropy",
    "sync_sequence_parallel_grads", "Split", "ParallelStyle", "ColwiseParallel",
    "RowwiseParallel", "SequenceParallel", "Stacked", "SequenceShardedPositions",
    "VocabParallelLoss", "SequenceParallelMoE", "GatheredSequence", "tensor_parallel_plan",
    "describe_plan", "parallelize_module",
    "apply_tensor_parallel", "param_splits", "tp_split", "tp_shard_dim", "shard_tensor",
    "unshard", "gather_tensor",
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
# f and g of Megatron's figure 3. Backward receives a gradient that autograd may share
# with other branches, so we reduce a fresh copy.

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


# --- sequence parallelism's f and g -------------------------------------------------
# An all-reduce *is* a reduce-scatter plus an all-gather: SP moves the same bytes as TP
# while the activations outside the tp regions shrink by tp. Like the paper we keep each
# column linear's *sharded* input and all-gather it again in backward rather than keep
# the full one: 5/4 of plain TP's bytes per layer. Zero bubble (arXiv 2401.10241) splits
# a backward in two calls, input gradients (B) and weight gradients (W); each function
# asks which gradients *this* call wants (``wanted``), so B + W move what one backward
# moves.

SEQ = 1  # the sequence dimension of [batch, seq, hidden] activations


def wanted(ctx, i: int) -> bool:
    """Does *this* backward call use the gradient of input ``i``?

    ``ctx.needs_input_grad`` only says whether it could. The zero-bubble schedule splits
    a backward in two calls, one for input gradients (B) and one for weight gradients
    (W, arXiv 2401.10241); each must run only its own communication. The engine's own
    answer is ``_will_engine_execute_node`` (what ``register_multi_grad_hook`` uses).
    """
    if not ctx.needs_input_grad[i]:
        return False
    if torch.compiler.is_compiling():  # traced backwards are whole (zb is not compiled),
        return True  # and a traced ctx has no graph edges to ask
    node = ctx.next_functions[i][0]
    try:
        return node is None or torch._C._will_engine_execute_node(node)
    except (AttributeError, RuntimeError):  # a leaf inside autograd.grad: be safe
        return True


class _ReduceScatterToSP(torch.autograd.Function):
    """SP's g: reduce-scatter partial sums along the sequence; all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.reduce_scatter(x.contiguous(), dim=SEQ)

    @staticmethod
    def backward(ctx, grad):
        if not wanted(ctx, 0):  # B of a split backward, below a module output it keeps
            return None, None
        return ctx.comm.all_gather(grad.contiguous(), dim=SEQ), None


class _GatherLinear(torch.autograd.Function):
    """SP's f fused with the column linear: all-gather the sequence, then x W^T + b.

    Saves the *sharded* input and gathers it again in backward for the weight gradient
    (Korthikanti et al. 4.2.2), so the full [b, s, h] input is never kept alive. The
    re-gather runs only when the weight gradient is wanted, the reduce-scatter only when
    the input gradient is: a split backward (B, then W) moves what one backward moves.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.comm, ctx.has_bias = comm, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(comm.all_gather(x.contiguous(), dim=SEQ), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if wanted(ctx, 0):
            grad_x = ctx.comm.reduce_scatter(grad.matmul(weight), dim=SEQ)
        g2 = grad.reshape(-1, grad.shape[-1])
        if wanted(ctx, 1):
            full = ctx.comm.all_gather(x.contiguous(), dim=SEQ)  # the extra all-gather
            grad_w = g2.t().matmul(full.reshape(-1, full.shape[-1]))
        if ctx.has_bias and wanted(ctx, 2):
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, None


class _LinearReduceScatter(torch.autograd.Function):
    """SP's row linear: x W^T, then reduce-scatter along the sequence.

    Both gradients need the all-gathered output gradient. When B asks for the input
    gradient alone and a W pass will ask for the weight's later, the gathered gradient is
    kept for it rather than gathered twice.
    """

    @staticmethod
    def forward(ctx, x, weight, comm):
        ctx.comm = comm
        ctx.save_for_backward(x, weight)
        return comm.reduce_scatter(F.linear(x, weight).contiguous(), dim=SEQ)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full = getattr(ctx, "gathered", None)
        if full is None:
            full = ctx.comm.all_gather(grad.contiguous(), dim=SEQ)
        want_x, want_w = wanted(ctx, 0), wanted(ctx, 1)
        ctx.gathered = full if ctx.needs_input_grad[1] and not want_w else None
        grad_x = full.matmul(weight) if want_x else None
        grad_w = None
        if want_w:
            grad_w = full.reshape(-1, full.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        return grad_x, grad_w, None


class _GatherWholeSequence(torch.autograd.Function):
    """All-gather the sequence shards; backward: this rank's slice of the gradient, which
    is the same on every tp rank (what consumes the whole sequence is replicated)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.all_gather(x.contiguous(), dim=SEQ)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.comm.size, dim=SEQ)[ctx.comm.rank].contiguous(), None


class _SliceSequence(torch.autograd.Function):
    """This rank's slice of a whole (replicated) sequence; backward: all-gather the
    slices' gradients, so what made the whole sequence sees all of it on every rank."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.chunk(comm.size, dim=SEQ)[comm.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        if not wanted(ctx, 0):  # B of a split backward, below a module output it keeps
            return None, None
        return ctx.comm.all_gather(grad.contiguous(), dim=SEQ), None


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


class SequenceParallelMoE(MoE):
    """An MoE layer under sequence parallelism: all-gather the sequence shards, run the
    tensor-parallel layer on the whole sequence (every tp rank routes it alike, so the
    capacity counts the reference's tokens; the experts' MLPs are split as without SP),
    then keep this rank's slice. Takes over the layer's router, queues and experts
    (names kept); its replicated weights see the whole sequence, so their gradients are
    already whole (not marked ``sequence_parallel``). The layer moves an all-gather each
    way besides plain TP's all-reduces; Megatron-Core and torchtitan reduce-scatter a
    partial output instead, which needs the experts' output unreduced.
    """

    def __init__(self, moe: MoE, comm: Comm) -> None:
        with torch.device("meta"):  # its parts are the layer's own, not made anew
            super().__init__(moe.cfg)
        self.router, self.queues, self.experts = moe.router, moe.queues, moe.experts
        self.loss_scale, self.comm = moe.loss_scale, comm

    @torch._disable_dynamo  # eager, as ``MoE.forward``: its shapes are data
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        whole = super().forward(_GatherWholeSequence.apply(x, self.comm))
        return _SliceSequence.apply(whole, self.comm)


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


class SequenceShardedEmbedding(nn.Module):
    """SP's position embedding: the full (replicated) table, looked up only for this
    rank's positions. Its gradient is partial: ``sync_sequence_parallel_grads`` sums it."""

    def __init__(self, weight: nn.Parameter, comm: Comm) -> None:
        super().__init__()
        self.weight, self.comm = weight, comm

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        if pos.shape[0] % self.comm.size:
            raise ValueError(f"sequence length {pos.shape[0]} is not divisible by "
                             f"tp={self.comm.size} (needed by sequence parallelism)")
        return F.embedding(pos.chunk(self.comm.size)[self.comm.rank], self.weight)


class SequenceParallelDropout(KeyedDropout):
    """Dropout of a sequence shard [b, s/tp, h]: one device's mask for those positions."""

    def __init__(self, p: float, site: int, comm: Comm) -> None:
        super().__init__(p, site)
        self.comm = comm

    def forward(self, x: torch.Tensor, position_offset: int = 0) -> torch.Tensor:
        return super().forward(x, position_offset + self.comm.rank * x.shape[SEQ])


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


def sync_sequence_parallel_grads(params: nn.Module | Iterable[nn.Parameter],
                                 comm: Comm) -> None:
    """Sum over the tp group the gradients of parameters marked ``sequence_parallel``
    (replicated ones used on a sequence shard), in one flat all-reduce. Call after the
    backward of the last micro-batch, before gradient clipping. Nothing without SP.

    Works on a whole model, a pipeline stage, or a list of parameters.
    """
    if isinstance(params, nn.Module):
        params = params.parameters()
    grads = [p.grad for p in params
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if comm.size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


# --- styles: what the plan makes of one submodule ---------------------------------------
# Named and meant as torch's (``torch.distributed.tensor.parallel``), with torch's
# placements: ``Replicate()`` (every rank holds all of it), ``Shard(d)`` (split along
# dimension d). minipar has no DTensor: a layout says what a local tensor *is*, and the
# modules made take and return local tensors (torch's ``use_local_output=True``).

@dataclass(frozen=True)
class Split:
    """How one parameter lies over the tp group: split along ``dim`` (None: whole on
    every rank). ``parts`` > 1: the tensor stacks that many matrices along ``dim`` (the
    fused q|k|v: 3), each split alike, so a rank holds its rows of each."""

    dim: int | None = None
    parts: int = 1


class ParallelStyle:
    """What a plan maps a module-name pattern to (torch: ``ParallelStyle``)."""

    def param_splits(self, module: nn.Module) -> dict[str, Split]:
        """How each of ``module``'s own parameters is split (absent: replicated)."""
        return {}

    def apply(self, module: nn.Module, comm: Comm) -> nn.Module:
        """The module that replaces ``module``, whose parameters are already this
        rank's parts (``parallelize_module`` cut them by ``param_splits``)."""
        raise NotImplementedError


def _allow(style: ParallelStyle, what: str, got: object, allowed: tuple) -> None:
    if got not in allowed:
        hint = " (minipar has no DTensor)" if what == "use_local_output" else ""
        raise ValueError(f"{type(style).__name__}: {what}={got!r} is not supported{hint}; "
                         f"use {' or '.join(map(repr, allowed))}")


def _kind(style: ParallelStyle, module: nn.Module, *kinds: type) -> None:
    if not isinstance(module, kinds):
        raise TypeError(f"{type(style).__name__} applies to "
                        f"{' or '.join(k.__name__ for k in kinds)}, not {type(module).__name__}")


@dataclass(frozen=True, kw_only=True)
class ColwiseParallel(ParallelStyle):
    """nn.Linear -> ``ColumnParallelLinear``: weight and bias split by output rows.

    ``input_layouts``: ``Replicate()`` (the whole activation; f before) or ``Shard(1)``
    (a sequence shard; SP's all-gather before). Output: this rank's output features,
    ``Shard(-1)``. torch's defaults."""

    input_layouts: Placement | None = None
    output_layouts: Placement | None = None
    use_local_output: bool = field(default=True, repr=False)  # minipar: always True

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_layouts", self.input_layouts or Replicate())
        object.__setattr__(self, "output_layouts", self.output_layouts or Shard(-1))
        _allow(self, "input_layouts", self.input_layouts, (Replicate(), Shard(SEQ)))
        _allow(self, "output_layouts", self.output_layouts, (Shard(-1),))
        _allow(self, "use_local_output", self.use_local_output, (True,))

    def param_splits(self, module: nn.Module) -> dict[str, Split]:
        _kind(self, module, nn.Linear)
        return {"weight": Split(0), "bias": Split(0)}

    def apply(self, module: nn.Module, comm: Comm) -> nn.Module:
        return ColumnParallelLinear(module.weight, module.bias, comm,
                                    self.input_layouts == Shard(SEQ))


@dataclass(frozen=True)
class GroupedColwiseParallel(ParallelStyle):
    """``GroupedLinear`` (an MoE layer's ``experts.fc``, [E, out, in]) ->
    ``ColumnParallelGroupedLinear``: every expert's output rows split, as ``mlp.fc``'s
    (minipar's own: torch has no style for grouped experts)."""

    def param_splits(self, module: nn.Module) -> dict[str, Split]:
        _kind(self, module, GroupedLinear)
        return {"weight": Split(1), "bias": Split(1)}

    def apply(self, module: nn.Module, comm: Comm) -> nn.Module:
        return ColumnParallelGroupedLinear(module.weight, module.bias, comm)


@dataclass(frozen=True)
class GroupedRowwiseParallel(ParallelStyle):
    """``GroupedLinear`` (``experts.proj``) -> ``RowParallelGroupedLinear``: every
    expert's input columns split, as ``mlp.proj``'s; the bias stays whole."""

    def param_splits(self, module: nn.Module) -> dict[str, Split]:
        _kind(self, module, GroupedLinear)
        return {"weight": Split(2)}

    def apply(self, module: nn.Module, comm: Comm) -> nn.Module:
        return RowParallelGroupedLinear(module.weight, module.bias, comm)


@dataclass(frozen=True, kw_only=True)
class RowwiseParallel(ParallelStyle):
    """nn.Linear -> ``RowParallelLinear`` (weight split by input columns, bias whole);
    nn.Embedding -> ``VocabParallelEmbedding`` (table split by vocabulary rows).

    ``input_layouts``: the linear's input is this rank's features, ``Shard(-1)``; the
    embedding's, the whole token ids, ``Replicate()`` (as torchtitan writes it).
    ``output_layouts``: ``Replicate()`` (all-reduce after) or ``Shard(1)`` (SP's
    reduce-scatter along the sequence after)."""

    input_layouts: Placement | None = None
    output_layouts: Placement | None = None
    use_local_output: bool = field(default=True, repr=False)  # minipar: always True

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_layouts", self.input_layouts or Shard(-1))
        object.__setattr__(self, "output_layouts", self.output_layouts or Replicate())
        _allow(self, "output_layouts", self.output_layouts, (Replicate(), Shard(SEQ)))
        _allow(self, "use_local_output", self.use_local_output, (True,))

    def param_splits(self, module: nn.Module) -> dict[str, Split]:
        _kind(self, module, nn.Linear, nn.Embedding)
        linear = isinstance(module, nn.Linear)
        _allow(self, f"input_layouts (of an {type(module).__name__})", self.input_layouts,
               (Shard(-1),) if linear else (Replicate(),))
        return {"weight": Split(1 if linear else 0)}

    def apply(self, module: nn.Module, comm: Comm) -> nn.Module:
        sp = self.output_layouts == Shard(SEQ)
        if isinstance(module, nn.Embedding):
            return VocabParallelEmbedding(module.weight, comm, sp)
        return RowParallelLinear(module.weight, module.bias, comm, sp)


@dataclass(frozen=True, kw_only=True)
class SequenceParallel(ParallelStyle):
    """A token-wise module (dropout, a norm) run on a sequence shard, ``Shard(1)`` in and
    out, with the single device's result for those positions. Its parameters stay whole
    on every rank (``sync_sequence_parallel_grads`` sums their gradients)."""

    sequence_dim: int = 1

    def __post_init__(self) -> None:
        _allow(self, "sequence_dim", self.sequence_dim, (SEQ,))

    def apply(self, module: nn.Module, comm: Comm) -> nn.Module:
        if isinstance(module, KeyedDropout):  # its mask is keyed by global position
            return SequenceParallelDropout(module.p, module.site, comm)
        _kind(self, module, nn.LayerNorm)
        return module


@dataclass(frozen=True)
class Stacked(ParallelStyle):
    """``style`` on a weight that stacks ``parts`` matrices along its split dimension
    (the fused q|k|v projection: 3): each part is split as ``style`` splits one, so a
    rank holds whole heads of q, of k and of v. minipar's own: torch's styles cut the
    tensor as one, which is why torchtitan keeps wq, wk and wv apart."""

    style: ParallelStyle
    parts: int = 3

    def param_splits(self, module: nn.Module) -> dict[str, Split]:
        return {leaf: Split(s.dim, self.parts if s.dim is not None else 1)
                for leaf, s in self.style.param_splits(module).items()}

    def apply(self, module: nn.Module, comm: Comm) -> nn.Module:
        return self.style.apply(module, comm)


@dataclass(frozen=True)
class SequenceShardedPositions(ParallelStyle):
    """The position embedding -> ``SequenceShardedEmbedding``: the whole table, looked up
    at this rank's positions only (SP). minipar's own: torch has no such style."""

    def apply(self, module: nn.Module, comm: Comm) -> nn.Module:
        _kind(self, module, nn.Embedding)
        return SequenceShardedEmbedding(module.weight, comm)


@dataclass(frozen=True)
class GatheredSequence(ParallelStyle):
    """Under SP, an ``MoE`` -> ``SequenceParallelMoE`` (the whole sequence in, this rank's
    slice out; torchtitan writes it ``PrepareModuleInputOutput``). A dense MLP, whose fc
    and proj carry SP themselves, is left as it is. minipar's own style."""

    def apply(self, module: nn.Module, comm: Comm) -> nn.Module:
        return SequenceParallelMoE(module, comm) if isinstance(module, MoE) else module


@dataclass(frozen=True)
class VocabParallelLoss(ParallelStyle):
    """The model's loss -> ``VocabParallelCrossEntropy``, for logits split by vocabulary
    (torch does this with the ``loss_parallel()`` context manager)."""

    def apply(self, module: nn.Module, comm: Comm) -> nn.Module:
        return VocabParallelCrossEntropy(comm)


# --- the plan ---------------------------------------------------------------------------

Plan = dict[str, ParallelStyle]


def tensor_parallel_plan(sequence_parallel: bool = False) -> Plan:
    """Megatron's split of a ``GPT``, as module-name pattern -> style (``*``: any), in
    torchtitan's words: with SP, ``Shard(1)`` (a sequence shard) where the activation
    would be whole, ``Replicate()``."""
    seq = Shard(SEQ) if sequence_parallel else Replicate()
    plan: Plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)}
    if sequence_parallel:
        plan |= {"pos_emb": SequenceShardedPositions(), "drop": SequenceParallel(),
                 "blocks.*.resid_drop*": SequenceParallel(), "blocks.*.mlp": GatheredSequence()}
    return plan | {
        "blocks.*.attn.qkv": Stacked(ColwiseParallel(input_layouts=seq), parts=3),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=seq),
        "blocks.*.mlp.fc": ColwiseParallel(input_layouts=seq),
        "blocks.*.mlp.proj": RowwiseParallel(output_layouts=seq),
        "blocks.*.mlp.experts.fc": GroupedColwiseParallel(),
        "blocks.*.mlp.experts.proj": GroupedRowwiseParallel(),
        "head": ColwiseParallel(input_layouts=seq),
        "loss_fn": VocabParallelLoss(),
    }


def describe_plan(plan: Plan) -> str:
    """The plan as a table a learner can read, one pattern per line."""
    width = max(map(len, plan))
    return "\n".join(f"{pattern:<{width}}  {style!r}" for pattern, style in plan.items())


def param_splits(model: nn.Module, plan: Plan) -> dict[str, Split]:
    """Name -> split of every parameter of the single-device ``model`` that ``plan``
    splits: what ``parallelize_module`` would cut, read without cutting anything."""
    out: dict[str, Split] = {}
    for pattern, style in plan.items():
        for name, module in model.named_modules():
            if name and fnmatch.fnmatchcase(name, pattern):
                for leaf, split in style.param_splits(module).items():
                    if getattr(module, leaf, None) is not None:
                        out[f"{name}.{leaf}"] = split
    return out


def parallelize_module(model: nn.Module, comm: Comm, plan: Plan) -> nn.Module:
    """Replace every submodule of ``model`` that matches a pattern of ``plan`` by what
    its style makes of it, in place; patterns are applied in order. Each parameter the
    style splits becomes a new Parameter holding this rank's part, once per original
    (a tied weight stays tied). Returns ``model``."""
    new: dict[int, nn.Parameter] = {}  # id(original) -> this rank's part
    for pattern, style in plan.items():
        for name, module in list(model.named_modules()):
            if not name or not fnmatch.fnmatchcase(name, pattern):
                continue
            for leaf, split in style.param_splits(module).items():
                p = getattr(module, leaf, None)
                if p is None:
                    continue
                if id(p) not in new:
                    part = _take(split, p.detach(), comm.rank, comm.size)
                    new[id(p)] = nn.Parameter(part.clone(), requires_grad=p.requires_grad)
                setattr(module, leaf, new[id(p)])
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, style.apply(module, comm))
    return model


def apply_tensor_parallel(model: GPT, comm: Comm, sequence_parallel: bool = False) -> GPT:
    """Split a full ``GPT`` (initialised, or on the meta device) over the tp group
    ``comm``, in place, with ``tensor_parallel_plan``. With SP the parameters the plan
    leaves whole (norms, position embedding, row biases) see only part of the sequence:
    they are marked ``p.sequence_parallel = True``; call ``sync_sequence_parallel_grads``
    after backward. (Not an MoE layer's: it sees the whole sequence, ``SequenceParallelMoE``.)"""
    check_tp(model.cfg, comm.size, sequence_parallel)
    plan = tensor_parallel_plan(sequence_parallel)
    split = param_splits(model, plan)
    parallelize_module(model, comm, plan)  # names unchanged
    whole = {f"{name}.{leaf}" for name, m in model.named_modules()
             if isinstance(m, SequenceParallelMoE) for leaf, _ in m.named_parameters()}
    for name, p in model.named_parameters():
        if sequence_parallel and name not in split and name not in whole:
            p.sequence_parallel = True
    return model


# --- a parameter by name: its split, read from the plan -------------------------------

@functools.cache
def _gpt_splits() -> dict[str, Split]:
    # the plan on meta-device GPTs, dense and with experts (splits depend on module
    # kinds, not on sizes or SP), every block's names folded into block 0's
    out = {}
    for preset in ("tiny", "moe-tiny"):
        for name, split in param_splits(GPT(preset, device="meta"),
                                        tensor_parallel_plan()).items():
            out[re.sub(r"(^|\.)blocks\.\d+\.", r"\1blocks.0.", name)] = split
    return out


def tp_split(name: str) -> Split:
    """How ``tensor_parallel_plan`` splits the ``GPT`` parameter ``name`` (or its
    optimizer state). Prefixes are ignored (``module.blocks.3.mlp.fc.weight`` works)."""
    parts = re.sub(r"(^|\.)blocks\.\d+\.", r"\1blocks.0.", name).split(".")
    for i in range(len(parts)):
        split = _gpt_splits().get(".".join(parts[i:]))
        if split is not None:
            return split
    return Split()


def tp_shard_dim(name: str) -> int | None:
    """The dimension along which parameter ``name`` is split, or None if replicated."""
    return tp_split(name).dim


def _blocks(split: Split, t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` with its stacked parts as a leading dimension, and the axis to cut."""
    if split.parts == 1:
        return t, split.dim
    return t.reshape(*t.shape[:split.dim], split.parts, -1, *t.shape[split.dim + 1:]), \
        split.dim + 1


def _take(split: Split, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    if split.dim is None:
        return full
    t, axis = _blocks(split, full)
    part = t.chunk(tp, dim=axis)[tp_rank]
    return part.flatten(split.dim, axis) if split.parts > 1 else part


def shard_tensor(name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """Rank ``tp_rank``'s part of the full tensor of parameter ``name`` (or of its
    optimizer state). May share memory with ``full``. For qkv: q, k and v rows of this
    rank's heads, in that order."""
    return _take(tp_split(name), full, tp_rank, tp)


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor of parameter ``name`` from every rank's shard (rank order)."""
    split = tp_split(name)
    if split.dim is None:
        return shards[0]
    blocks = [_blocks(split, s) for s in shards]
    full = torch.cat([t for t, _ in blocks], dim=blocks[0][1])
    return full.flatten(split.dim, split.dim + 1) if split.parts > 1 else full


def gather_tensor(name: str, local: torch.Tensor, comm: Comm) -> torch.Tensor:
    """All-gather a sharded tensor over the tp group and return the full one."""
    if tp_split(name).dim is None or comm.size == 1:
        return local
    gathered = comm.all_gather(local.detach().contiguous(), dim=0)
    return unshard(name, list(gathered.chunk(comm.size, dim=0)))
