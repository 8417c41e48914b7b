"""Context parallelism: the sequence split across ranks, attention computed as a ring.

Each of the C ranks of a cp group keeps 1/C of every sequence's tokens for every layer,
so activation memory per rank falls by C. Everything but attention is token-wise and
runs on the local tokens unchanged; attention needs every earlier key. Ring attention
(Liu, Zaharia & Abbeel 2023, arXiv 2310.01889) fetches them without ever holding the
whole sequence: in C steps every key/value block visits every rank, each transfer
hidden behind the compute of the block before it (double buffering). Partial results
over disjoint key sets merge exactly by their log-sum-exps (``merge_attention``: the
online softmax of arXiv 1805.02867, as FlashAttention, arXiv 2205.14135, applies it).

The sequence is cut into 2C chunks; rank r holds two (``chunk_ids``: the zig-zag split
balances causal work), ``block_plan`` says which (query, key) chunk pairs each ring step
computes and ``ring_plan`` fuses them into kernel calls: matmul, softmax, matmul in fp32
(the reference, the CPU path), or PyTorch's fused flash kernel on a GPU in 16 bits
(``block_kernel``, ``cp_kernels``). The plan that puts it into a GPT: ``cp_plan.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn as nn

from minipar.comm import Comm, Pending
from minipar.parallel import cp_kernels

LAYOUTS = ("zigzag", "contiguous")
KERNELS = ("auto", "math", "flash")


# --- the split: which tokens a cp rank holds ---------------------------------------------
def chunk_ids(rank: int, cp: int, layout: str = "zigzag") -> tuple[int, int]:
    """The two chunks (of the sequence cut into 2 * cp) that ``rank`` holds, in order.

    Causal balance: cut a sequence into C contiguous pieces and rank C-1 attends to all
    of it while rank 0 attends to its own piece only: the last rank does about 2C-1
    times the first one's work, and every ring step waits for it. The zig-zag split
    (used to train Llama 3 at long context: Dubey et al. 2024, arXiv 2407.21783,
    Sec. 3.3.2) gives rank r the chunks r and 2C-1-r: an early chunk with little to
    attend to and a late one with much, the same total on every rank. ``contiguous``:
    2r and 2r+1. For a pair (query chunk i, key chunk j) causality is decided per chunk,
    never per token: j < i is a full block, j == i a causal-diagonal one, j > i skipped.
    """
    if layout == "zigzag":
        return rank, 2 * cp - 1 - rank
    if layout == "contiguous":
        return 2 * rank, 2 * rank + 1
    raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")


def check_cp(seq_len: int, cp: int) -> None:
    """Refuse a sequence that does not cut into 2 * cp equal chunks (one line)."""
    if cp < 1:
        raise ValueError(f"cp={cp}: the context-parallel size must be positive")
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} is not divisible by 2*cp={2 * cp} "
                         "(context parallelism cuts each sequence into 2*cp chunks)")


def positions(seq_len: int, rank: int, cp: int, layout: str = "zigzag",
              device: torch.device | str | None = None) -> torch.Tensor:
    """Global token positions of ``rank``'s shard, in its local order (for pos. embeddings)."""
    check_cp(seq_len, cp)
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                      for i in chunk_ids(rank, cp, layout)])


def shard_sequence(x: torch.Tensor, rank: int, cp: int, layout: str = "zigzag",
                   dim: int = 1) -> torch.Tensor:
    """``rank``'s tokens of a (batch, seq, ...) tensor: its two chunks, concatenated."""
    check_cp(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, cp, layout)], dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], layout: str = "zigzag",
                     dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (rank order): inverse of ``shard_sequence``."""
    cp = len(shards)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=dim)
        a, b = chunk_ids(rank, cp, layout)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)


def gather_sequence(x: torch.Tensor, comm: Comm, layout: str = "zigzag",
                    dim: int = 1) -> torch.Tensor:
    """All-gather the local shards over the cp group and put the tokens back in order."""
    return unshard_sequence(comm.all_gather(x, dim=dim).chunk(comm.size, dim=dim), layout,
                            dim)


def block_plan(rank: int, cp: int, layout: str = "zigzag") -> list[list[tuple[int, int, str]]]:
    """Per ring step, the (local q chunk, local kv chunk, "full" | "causal") blocks to run.

    At step s a rank holds the keys of rank (rank - s) mod cp (blocks move to the next
    rank). A pair of chunks (i, j) is a full block if j < i, a causal-diagonal one if
    j == i (only at step 0), and skipped if j > i (all of its keys are in the future).
    Diagonal blocks come first, so every query row has a finite log-sum-exp from the
    first block on.
    """
    mine = chunk_ids(rank, cp, layout)
    plan = []
    for step in range(cp):
        theirs = chunk_ids((rank - step) % cp, cp, layout)
        blocks = [(qi, kj, "full" if theirs[kj] < mine[qi] else "causal")
                  for qi in range(2) for kj in range(2) if theirs[kj] <= mine[qi]]
        plan.append(sorted(blocks, key=lambda blk: blk[2] == "full"))
    return plan


class RingCall(NamedTuple):
    """One kernel call of a ring step: query chunks [q0, q1) against key chunks [k0, k1)
    of the two a rank holds (0, 1 or 2 as bounds), causal on the square diagonal or not."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def ring_plan(rank: int, cp: int, layout: str = "zigzag") -> list[list[RingCall]]:
    """``block_plan`` with each step's chunk pairs fused into as few kernel calls as
    compute the same pairs, as torch's ring does: one call a step in both layouts.

    Step 0's pairs (0,0) causal, (1,0) full, (1,1) causal are one causal call over the
    rank's two chunks side by side (its tokens are in increasing position order, so
    "key index <= query index" is exactly their mask); a later step's full blocks that
    form a rectangle are one unmasked call; anything else stays a call per block.
    """
    plan = []
    for blocks in block_plan(rank, cp, layout):
        pairs = {(qi, kj): kind for qi, kj, kind in blocks}
        qs, ks = sorted({qi for qi, _ in pairs}), sorted({kj for _, kj in pairs})
        rectangle = (len(pairs) == len(qs) * len(ks) and qs == list(range(qs[0], qs[-1] + 1))
                     and ks == list(range(ks[0], ks[-1] + 1))) if pairs else False
        if pairs == {(0, 0): "causal", (1, 0): "full", (1, 1): "causal"}:
            plan.append([RingCall(0, 2, 0, 2, True)])
        elif rectangle and all(kind == "full" for kind in pairs.values()):
            plan.append([RingCall(qs[0], qs[-1] + 1, ks[0], ks[-1] + 1, False)])
        else:
            plan.append([RingCall(qi, qi + 1, kj, kj + 1, kind == "causal")
                         for qi, kj, kind in blocks])
    return plan


def causal_pairs(seq_len: int, rank: int, cp: int, layout: str = "zigzag") -> int:
    """Unmasked (query, key) pairs of ``rank``: each query at position p sees p + 1 keys."""
    return int((positions(seq_len, rank, cp, layout) + 1).sum())


# --- the merge rule ---------------------------------------------------------------------
def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention over two disjoint key sets A and B into attention over A and B.

    ``out_x`` (..., t, hd) is softmax over keys X only, times their values; ``lse_x``
    (..., t) is log sum_{k in X} exp(score). The softmax over the union weighs each part
    by its share of the total mass: out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b
    with lse = log(e^lse_a + e^lse_b). ``logaddexp`` never exponentiates a large score,
    so this is as stable as one softmax (Milakov & Gimelshein 2018).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    out = (torch.exp(lse_a - lse).unsqueeze(-1) * out_a
           + torch.exp(lse_b - lse).unsqueeze(-1) * out_b)
    return out, lse


# --- one block, forward and backward, in fp32 ---------------------------------------------
def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:  # a diagonal block: query i sees keys 0..i of the same chunk
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one key block: (out, lse), fp32.

    ``F.scaled_dot_product_attention`` would compute ``out`` but does not return the
    log-sum-exp the merge needs (only private fused kernels do: ``cp_kernels`` calls
    them on GPUs), so this is plain matmul-softmax: clear first.
    """
    s = _scores(q.float(), k.float(), scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v.float(), lse


def block_backward(q, k, v, dout, lse, delta, scale: float, causal: bool):
    """(dq, dk, dv) of one block, the probabilities recomputed from the final lse.

    With p = exp(s - lse) the block's share of the *whole-row* softmax and
    delta = rowsum(dout * out) (FlashAttention, Alg. 2): dv = p^T dout,
    ds = p * (dout v^T - delta), dq = ds k * scale, dk = ds^T q * scale.
    """
    q, k, v = q.float(), k.float(), v.float()
    p = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv


class BlockKernel(NamedTuple):
    """How a block is computed; the ring calls both kinds the same way.

    forward(q, k, v, scale, causal) -> (out fp32, lse fp32, aux);
    backward(q, k, v, out, dout, lse, aux, scale, causal) -> (dq, dk, dv), with out and
    dout the whole rows' (merged) output and its gradient, in ``io_dtype`` (None: q's).
    """

    name: str
    forward: Callable
    backward: Callable
    io_dtype: torch.dtype | None


def _math_forward(q, k, v, scale: float, causal: bool):
    return (*block_forward(q, k, v, scale, causal), None)


def _math_backward(q, k, v, out, dout, lse, aux, scale: float, causal: bool):
    delta = (dout * out).sum(-1)  # rowsum(dout * out), per query (the flash kernel's D)
    return block_backward(q, k, v, dout, lse, delta, scale, causal)


MATH = BlockKernel("math", _math_forward, _math_backward, torch.float32)
FLASH = BlockKernel("flash", cp_kernels.flash_block_forward,
                    cp_kernels.flash_block_backward, None)


def block_kernel(q: torch.Tensor, kernel: str = "auto") -> BlockKernel:
    """The block kernel for q: flash where it runs (CUDA sm80+, fp16/bf16, hd <= 256)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; use one of {KERNELS}")
    if kernel == "auto":
        return FLASH if cp_kernels.flash_available(q) else MATH
    return FLASH if kernel == "flash" else MATH


# --- the ring ---------------------------------------------------------------------------
def _exchange(comm: Comm, send: torch.Tensor, recv: torch.Tensor,
              reverse: bool = False) -> list[Pending]:
    """Send ``send`` to the next rank and receive ``recv`` from the previous one (the
    other way round with ``reverse``: the backward's ring).

    Even ranks send first, odd ranks receive first: with two ranks both messages share
    one pair of ranks, and NCCL runs a pair's operations in the order they were posted,
    so the orders must match or both ranks wait for each other.
    """
    step = -1 if reverse else 1
    to, source = (comm.rank + step) % comm.size, (comm.rank - step) % comm.size
    if comm.rank % 2 == 0:
        return [comm.isend(send, to), comm.irecv(recv, source)]
    return [comm.irecv(recv, source), comm.isend(send, to)]


def _wait(pending: list[Pending]) -> None:
    for p in pending:
        p.wait()


class RingAttentionFunction(torch.autograd.Function):
    """Causal attention over a sequence sharded across ``comm``, as a ring.

    The ranks form a ring; while a rank computes its queries against the key/value
    block it holds, it already sends that block to its successor and receives the next
    one from its predecessor (non-blocking ``isend`` / ``irecv`` into a second buffer),
    so the transfer hides behind the compute when the block is big enough. The backward
    is a ring too: as in FlashAttention it recomputes the probabilities from the saved
    (q, k, v, out, lse), and the key/value gradients travel with their blocks back to
    the rank that owns them.

    q, k, v: this rank's (batch, heads, t_local, hd) in the layout's local order; returns
    the same shape. k and v travel together as one (2, ...) message per step.
    """

    @staticmethod
    def forward(ctx, q, k, v, comm: Comm, layout: str, scale: float, kernel: str):
        plan = ring_plan(comm.rank, comm.size, layout)
        kern = block_kernel(q, kernel)
        aux = None  # the flash kernel's rng state etc., the same for every block
        c = q.shape[2] // 2  # tokens per chunk
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # merged here
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        seen = [False, False]  # a query chunk's first block is written, later ones merged
        kv = torch.stack([k, v])
        buffers = [kv, torch.empty_like(kv)]  # double buffering: compute one, fill other
        for step, blocks in enumerate(plan):
            cur = buffers[step % 2]
            last = step == comm.size - 1
            pending = [] if last else _exchange(comm, cur, buffers[(step + 1) % 2])
            for b in blocks:
                qs, ks = slice(b.q0 * c, b.q1 * c), slice(b.k0 * c, b.k1 * c)
                o, s, aux = kern.forward(q[:, :, qs], cur[0][:, :, ks], cur[1][:, :, ks],
                                         scale, b.causal)
                if not any(seen[b.q0:b.q1]):
                    out[:, :, qs], lse[:, :, qs] = o, s
                else:
                    out[:, :, qs], lse[:, :, qs] = merge_attention(out[:, :, qs],
                                                                   lse[:, :, qs], o, s)
                seen[b.q0:b.q1] = [True] * (b.q1 - b.q0)
            _wait(pending)
        res = out.to(q.dtype)
        # The block the ring ends with (rank + 1's k|v) is kept: the backward starts there.
        ctx.save_for_backward(q, k, v, out if kern.io_dtype else res, lse, cur)
        ctx.comm, ctx.layout, ctx.scale, ctx.kern, ctx.aux = comm, layout, scale, kern, aux
        return res

    @staticmethod
    def backward(ctx, dout):
        """The forward's ring run backwards: last step first, on the kept block, then
        each earlier step's block arrives from the *next* rank (kv goes to the previous
        one), its dk|dv accumulator with it one step behind. A block's accumulator thus
        ends at its owner in the last step, the rank's own block, and that transfer hides
        behind the own block's compute: no exposed send at the end (C - 2 k|v messages
        and C - 1 accumulators, ``theory.context.ring_bytes``)."""
        q, k, v, out, lse, held = ctx.saved_tensors
        comm, scale, kern = ctx.comm, ctx.scale, ctx.kern
        plan, c = ring_plan(comm.rank, comm.size, ctx.layout), q.shape[2] // 2
        dout = dout.to(kern.io_dtype or q.dtype)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        cur = held  # at cp 1, the own block
        incoming, incoming_pending = None, []  # the accumulator of the block we hold
        for step in reversed(range(comm.size)):  # the forward's steps, last first
            # step - 1's block, if another rank's: the next rank holds it now
            nxt = torch.empty_like(cur) if step > 1 else None
            pending = _exchange(comm, cur, nxt, reverse=True) if step > 1 else []
            dkv = torch.zeros(cur.shape, dtype=torch.float32, device=cur.device)
            for b in plan[step]:
                qs, ks = slice(b.q0 * c, b.q1 * c), slice(b.k0 * c, b.k1 * c)
                g = kern.backward(q[:, :, qs], cur[0][:, :, ks], cur[1][:, :, ks],
                                  out[:, :, qs], dout[:, :, qs], lse[:, :, qs], ctx.aux,
                                  scale, b.causal)
                dq[:, :, qs] += g[0]
                dkv[0][:, :, ks] += g[1]
                dkv[1][:, :, ks] += g[2]
            _wait(incoming_pending)  # the other ranks' share of this block, if any
            if incoming is not None:
                dkv += incoming
            if step > 0:  # pass it on towards its owner; take the next block's share
                incoming = torch.empty_like(dkv)
                incoming_pending = _exchange(comm, dkv, incoming, reverse=True)
            _wait(pending)
            cur = nxt if step > 1 else torch.stack([k, v])
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm,
                   layout: str = "zigzag", scale: float | None = None,
                   kernel: str = "auto") -> torch.Tensor:
    """Causal softmax(q k^T * scale) v over the whole sequence, each rank holding a shard.

    Inputs and output: (batch, heads, t_local, head_dim), t_local = seq_len / cp, tokens
    in ``shard_sequence``'s order (``layout``); scale defaults to 1/sqrt(hd); kernel:
    "auto" (``block_kernel``: flash on GPUs in 16 bits, else math), "math" or "flash"."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")
    if q.shape[2] % 2:
        raise ValueError(f"t_local={q.shape[2]} must be even: a cp rank holds two chunks")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return RingAttentionFunction.apply(q, k, v, comm, layout, scale, kernel)


class RingAttention(nn.Module):
    """The attention core for a cp rank: ``core(q, k, v)`` of ``CausalSelfAttention``.

    Same signature and shapes as ``minipar.model.CausalSelfAttention.core`` (inputs
    (b, heads, t_local, hd), output the same), so a plan can put it where the core was;
    no parameters. Attention dropout would need the reference's mask per block: refused.
    """

    def __init__(self, comm: Comm, layout: str = "zigzag", dropout: float = 0.0) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")
        self.comm, self.layout, self.dropout = comm, layout, dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.training and self.dropout > 0:
            raise NotImplementedError("ring attention has no attention dropout; "
                                      "use --dropout 0 with --cp")
        return ring_attention(q, k, v, self.comm, self.layout)

    core = forward  # the name the model's attention uses

    def extra_repr(self) -> str:
        return f"cp={self.comm.size}, layout={self.layout}"
