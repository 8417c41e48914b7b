"""Tensor parallelism (Megatron-LM), sequence parallelism and the vocabulary-parallel loss.

Tensor parallelism splits each layer's weights across ``tp`` ranks so that no rank holds
or computes the whole layer (Shoeybi et al. 2019, arXiv 1909.08053, section 3):

* MLP: ``fc`` is split by output columns, ``proj`` by input rows. GELU then runs on each
  rank's own columns, and the only communication is one all-reduce after ``proj``.
* Attention: the fused ``qkv`` weight has rows [q | k | v], heads contiguous inside each;
  each rank takes *whole heads* (rows of q, k and v of its heads), attends on its heads
  alone, and ``proj`` (split by rows) ends in one all-reduce.
* So a sublayer needs one all-reduce forward ("g") and one backward ("f", conjugate).
* Vocabulary: the embedding and the head are split by vocabulary rows. The loss is
  computed from the shards with three small all-reduces (max, sum of exp, target logit),
  so logits for the whole vocabulary never exist on one rank.

Sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198, section 4.2.2): outside
the tensor-parallel regions (layer norms, dropout, residual adds) every rank would
otherwise hold and compute the same full [b, s, h] activations. Instead each rank keeps
a slice of the sequence: the all-reduce "g" becomes a reduce-scatter along the sequence,
"f" becomes an all-gather, and the backward passes swap them: the same bytes (an
all-reduce *is* a reduce-scatter plus an all-gather), while the replicated activations
shrink by ``tp``. Like the paper we keep each column linear's *sharded* input and
all-gather it again in backward, rather than keep the full one: one extra all-gather per
column linear, 5/4 of plain TP's bytes per layer.

How it is applied. ``apply_tensor_parallel(model, comm)`` slices the weights of an
already-initialised single-device ``GPT`` in place, so the parallel run starts from
exactly the reference weights. Parameter names do not change, so ``shard_tensor`` /
``unshard`` / ``gather_tensor`` move any parameter (or optimizer state) between full and
sharded form by name. The model keeps ``embed`` / ``blocks`` / ``logits`` / ``loss``:

* without SP the activation between blocks (and across pipeline stages) is the full
  [b, s, h], identical on every tp rank;
* with SP it is [b, s/tp, h]: tp rank r holds positions [r*s/tp, (r+1)*s/tp);
* ``logits`` returns this rank's vocabulary shard [b, s, V/tp]; ``loss`` takes it with
  the full targets [b, s] and returns the mean loss, equal on every tp rank.

Dropout matches one device exactly: each rank draws the full-size mask from the shared
generator state, as the single device does, and keeps its slice (heads for attention,
sequence for SP). Megatron instead gives each tp rank its own RNG stream, which is
cheaper but cannot be compared with one device. With dropout > 0 attention is computed
explicitly (the fused kernel's mask cannot be sliced); with dropout = 0 it uses SDPA.
The price: every rank draws full-size masks, and the dropout path stores the s x s scores.
Exact on CPU; a GPU reference's fused attention dropout draws its own way, so compare
GPU runs at dropout 0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from minipar.comm import Comm
from minipar.model import GPT, GPTConfig

SEQ = 1  # the sequence dimension of [batch, seq, hidden] activations


def check_tp(cfg: GPTConfig, tp: int, sequence_parallel: bool = False) -> None:
    """Raise ValueError (one line) if ``cfg`` cannot be split ``tp`` ways. Pure; call it
    before starting processes."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor parallel size must be a positive integer, got {tp!r}")
    sizes = [("n_head", cfg.n_head), ("d_model", cfg.d_model), ("d_ff", cfg.d_ff),
             ("vocab_size", cfg.vocab_size)]
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


class _ReduceScatterToSP(torch.autograd.Function):
    """SP's g: reduce-scatter partial sums along the sequence; all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.reduce_scatter(x.contiguous(), dim=SEQ)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_gather(grad.contiguous(), dim=SEQ), None


class _GatherLinear(torch.autograd.Function):
    """SP's f fused with the column linear: all-gather the sequence, then x W^T + b.

    Saves the *sharded* input and gathers it again in backward for the weight gradient
    (Korthikanti et al. 4.2.2), so the full [b, s, h] input is never kept alive.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.comm, ctx.has_bias = comm, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(comm.all_gather(x.contiguous(), dim=SEQ), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        comm = ctx.comm
        full = comm.all_gather(x.contiguous(), dim=SEQ)  # the extra all-gather
        grad_x = comm.reduce_scatter(grad.matmul(weight), dim=SEQ)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_w = g2.t().matmul(full.reshape(-1, full.shape[-1]))
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


# --- layers --------------------------------------------------------------------------

class _ParallelLinear(nn.Module):
    """A linear layer holding this rank's part of the weight (and bias, if any)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, comm: Comm,
                 sequence_parallel: bool) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.comm, self.sequence_parallel = comm, sequence_parallel


class ColumnParallelLinear(_ParallelLinear):
    """y[..., local outputs] = x W_local^T + b_local. Input: full [b, s, h] (replicated)
    or, with SP, the sequence shard [b, s/tp, h]. Output: this rank's output columns."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return _GatherLinear.apply(x, self.weight, self.bias, self.comm)
        return F.linear(_CopyToTP.apply(x, self.comm), self.weight, self.bias)


class RowParallelLinear(_ParallelLinear):
    """Input: this rank's slice of the features. Each rank's x W_local^T is a partial sum;
    all-reduce it (or reduce-scatter it along the sequence with SP), then add the bias
    (replicated: added once, after the sum)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = _ReduceScatterToSP.apply(partial, self.comm)
        else:
            y = _ReduceFromTP.apply(partial, self.comm)
        return y if self.bias is None else y + self.bias


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


def _sliced_dropout(x: torch.Tensor, p: float, dim: int, comm: Comm) -> torch.Tensor:
    """Dropout of this rank's slice (along ``dim``) of a full-size tensor, with exactly
    the mask one device would draw: draw the full mask, keep our slice (a copy, so the
    full mask is freed)."""
    full = list(x.shape)
    full[dim] *= comm.size
    mask = F.dropout(torch.ones(full, dtype=x.dtype, device=x.device), p, training=True)
    return x * mask.narrow(dim, comm.rank * x.shape[dim], x.shape[dim]).contiguous()


class ShardedDropout(nn.Module):
    """SP's dropout on a sequence shard [b, s/tp, h], equal to one device's slice."""

    def __init__(self, p: float, comm: Comm) -> None:
        super().__init__()
        self.p, self.comm = p, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return _sliced_dropout(x, self.p, SEQ, self.comm)


class ParallelAttention(nn.Module):
    """Causal self-attention on this rank's heads: qkv column-parallel (whole heads),
    proj row-parallel. The names ``qkv`` and ``proj`` match the reference module."""

    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, n_head: int,
                 head_dim: int, dropout: float, comm: Comm) -> None:
        super().__init__()
        self.qkv, self.proj = qkv, proj
        self.n_head, self.head_dim, self.dropout, self.comm = n_head, head_dim, dropout, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [b, s, 3 * local width]: [q | k | v] of our heads
        b, s, _ = qkv.shape
        width = self.n_head * self.head_dim
        q, k, v = (z.view(b, s, self.n_head, self.head_dim).transpose(1, 2)
                   for z in qkv.split(width, dim=2))
        y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, width))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention on our heads; the part selective recomputation redoes."""
        if self.training and self.dropout > 0:
            return self._explicit(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def _explicit(self, q, k, v):
        """softmax(q k^T / sqrt(d)) with the single device's dropout mask, our heads."""
        s = q.shape[2]
        att = q.matmul(k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        att = att.masked_fill(causal, float("-inf")).softmax(dim=-1)
        return _sliced_dropout(att, self.dropout, 1, self.comm).matmul(v)


# --- the vocabulary-parallel loss ----------------------------------------------------

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


class TensorParallelGPT(GPT):
    """A ``GPT`` after ``apply_tensor_parallel``: the same forward, a vocab-parallel loss.

    ``apply_tensor_parallel`` sets an existing model's class to this one (its modules
    and parameters stay where they are), so ``forward``, ``embed``, ``logits`` and
    pipeline stages that call ``loss`` all pick up the sharded loss. ``forward(idx)``
    without targets returns this rank's logits shard [b, s, V/tp].
    """

    tp_comm: Comm
    sequence_parallel: bool

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.tp_comm)


# --- parameters by name: which dimension is split, and how -----------------------------

_SHARD_DIMS = {  # parameter name suffix -> dimension split across tp ranks
    "tok_emb.weight": 0, "head.weight": 0,  # by vocabulary rows
    "attn.qkv.weight": 0, "attn.qkv.bias": 0,  # by heads, inside each of q, k, v
    "attn.proj.weight": 1,
    "mlp.fc.weight": 0, "mlp.fc.bias": 0,
    "mlp.proj.weight": 1,
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


# --- applying it ---------------------------------------------------------------------

def apply_tensor_parallel(model: GPT, comm: Comm, sequence_parallel: bool = False) -> GPT:
    """Split a full, initialised ``GPT`` over the tp group ``comm``, in place.

    Sharded weights are copied out of the full ones with ``shard_tensor``; replicated
    parameters (layer norms, position embedding, row-parallel biases) stay the same
    objects. With SP those are marked ``p.sequence_parallel = True``: each rank sees only
    its part of the sequence, so call ``sync_sequence_parallel_grads`` after backward.
    """
    cfg, tp, rank, sp = model.cfg, comm.size, comm.rank, sequence_parallel
    check_tp(cfg, tp, sp)

    def part(name: str, p: nn.Parameter | None) -> nn.Parameter | None:
        if p is None:
            return None
        if tp_shard_dim(name) is None:
            return p
        return nn.Parameter(shard_tensor(name, p.detach(), rank, tp).clone(),
                            requires_grad=p.requires_grad)

    model.tok_emb = VocabParallelEmbedding(part("tok_emb.weight", model.tok_emb.weight),
                                           comm, sp)
    if sp:
        model.pos_emb = SequenceShardedEmbedding(model.pos_emb.weight, comm)
        model.drop = ShardedDropout(cfg.dropout, comm)

    def linear(kind: type, old: nn.Linear, name: str) -> nn.Module:
        return kind(part(f"{name}.weight", old.weight), part(f"{name}.bias", old.bias),
                    comm, sp)

    for i, block in enumerate(model.blocks):
        a, pre = block.attn, f"blocks.{i}"
        block.attn = ParallelAttention(
            linear(ColumnParallelLinear, a.qkv, f"{pre}.attn.qkv"),
            linear(RowParallelLinear, a.proj, f"{pre}.attn.proj"),
            a.n_head // tp, a.head_dim, a.dropout, comm)
        # The reference MLP's forward runs unchanged on the swapped layers.
        block.mlp.fc = linear(ColumnParallelLinear, block.mlp.fc, f"{pre}.mlp.fc")
        block.mlp.proj = linear(RowParallelLinear, block.mlp.proj, f"{pre}.mlp.proj")
        if sp:
            block.resid_drop1 = ShardedDropout(cfg.dropout, comm)
            block.resid_drop2 = ShardedDropout(cfg.dropout, comm)
    head = model.tok_emb.weight if cfg.tie_embeddings else part("head.weight",
                                                                model.head.weight)
    model.head = ColumnParallelLinear(head, None, comm, sp)

    model.__class__ = TensorParallelGPT
    model.tp_comm, model.sequence_parallel = comm, sp
    for name, p in model.named_parameters():
        if sp and tp_shard_dim(name) is None:
            p.sequence_parallel = True
    return model


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


def grad_sq_sum(named_params: Iterable[tuple[str, nn.Parameter]],
                tp_rank: int) -> torch.Tensor:
    """This rank's share of the squared global gradient norm, for clipping.

    Sharded parameters contribute their local part on every rank; replicated ones
    (``tp_shard_dim(name) is None``) only on tp rank 0, so summing the result over the
    tp group (and pp) counts each parameter once. Call after the SP gradient sync.
    """
    parts = [p.grad.detach().float().pow(2).sum() for name, p in named_params
             if p.grad is not None and (tp_rank == 0 or tp_shard_dim(name) is not None)]
    return torch.stack(parts).sum() if parts else torch.zeros(())


def activation_elements_per_layer(cfg: GPTConfig, batch: int, tp: int,
                                  sequence_parallel: bool) -> int:
    """Elements one layer keeps for backward on one tp rank, as this file implements it
    (dropout = 0, attention through SDPA), b = batch, s = seq_len, h, f = d_ff, a, t = tp:

    * outside the tensor-parallel regions: the two layer-norm inputs and outputs (the
      outputs are the qkv and fc inputs), 4sbh, and their mean and 1/std, 4sb;
      divided by t only with sequence parallelism;
    * inside (always divided by t): q, k, v (3sbh), the attention output (sbh, proj's
      input), GELU's input and output (2sbf), SDPA's logsumexp (asb).

    Korthikanti et al. (eqs. 2 and 4) count fp16 bytes: sbh(10 + 24/t + 5as/(ht))
    without SP, sbh(34/t + 5as/(ht)) with. Ours, in elements: sbh(4 + 12/t) vs 16sbh/t
    for f = 4h, plus the small sb terms. The differences: no dropout masks (the paper's
    2sbh bytes; none at dropout 0), and no s x s scores (the 5as/(ht) term): fused
    attention recomputes them in backward from the logsumexp.
    """
    b, s, h, f, a, t = batch, cfg.seq_len, cfg.d_model, cfg.d_ff, cfg.n_head, tp
    outside = 4 * s * b * h + 4 * s * b
    inside = 4 * s * b * h + 2 * s * b * f + a * s * b
    return (outside // t if sequence_parallel else outside) + inside // t


def saved_tensor_elements(fn: Callable[[], object], params: Iterable[torch.Tensor]) -> int:
    """Run ``fn`` and count the elements autograd saves for backward meanwhile: each
    storage once (q, k and v are views of one qkv output), ``params`` excluded. The
    measured counterpart of ``activation_elements_per_layer``."""
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
