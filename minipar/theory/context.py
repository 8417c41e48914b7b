"""Context parallelism in numbers: ring traffic, activation memory, attention work per rank.

Pure functions for ``minipar.parallel.cp`` (ring attention, Liu et al. 2023, arXiv
2310.01889, with the zig-zag split of Llama 3, Dubey et al. 2024, arXiv 2407.21783,
Sec. 3.3.2). Notation: b micro-batch, s sequence length, C the cp size, w the width of
the keys one rank's attention sees (heads / tp times head_dim: d_model / tp without
grouped-query attention), e bytes per element.

* Ring traffic per layer per micro-batch, per rank. Forward: C-1 steps, each sends the
  k and v of one shard, 2 b (s/C) w e bytes: 2 b s w e (C-1)/C in all, the keys and
  values of every other rank. Backward: k and v travel the ring again (the same bytes),
  and each block's dk, dv accumulator travels with it, C-1 hops back to its owner, in
  fp32 (the accumulation precision): 2 b s w 4 (C-1)/C more. Unlike tensor
  parallelism, this does not grow with C: it is about the keys, not the shards.
* Activation memory: every tensor a layer keeps is per token, and each rank holds s/C
  tokens, so activations divide by C (the kernel keeps q, k, v, out and the
  log-sum-exp; no s x s score matrix, as in FlashAttention).
* Attention work: a query at position p sees p + 1 keys. The contiguous split gives
  rank r the positions [r s/C, (r+1) s/C): its work grows with r, the last rank does
  about 2C-1 times the first rank's. The zig-zag split (chunks r and 2C-1-r of 2C)
  gives every rank the same.
"""

from __future__ import annotations

import math

FP32 = 4


def ring_bytes(batch: int, seq_len: int, kv_width: int, cp: int,
               bytes_per_element: int = 4, grad_bytes: int = FP32) -> dict[str, dict]:
    """Sends of one rank for one attention layer and one micro-batch, forward and backward.

    ``{"forward": {"calls", "bytes"}, "backward": {"calls", "bytes"}}``; each send has a
    matching receive of the same size (a receive puts nothing on the wire). k and v
    travel as one message, so a forward step is one call. The backward runs the ring in
    reverse from the block the forward kept (``parallel.cp``): C - 2 k|v messages and
    C - 1 dk|dv accumulators (in ``grad_bytes``).
    """
    if cp <= 1:
        zero = {"calls": 0, "bytes": 0}
        return {"forward": dict(zero), "backward": dict(zero)}
    block = 2 * batch * (seq_len // cp) * kv_width  # elements of one k|v message
    kv = (cp - 1) * block * bytes_per_element
    return {"forward": {"calls": cp - 1, "bytes": kv},
            "backward": {"calls": 2 * cp - 3, "bytes": (cp - 2) * block * bytes_per_element
                         + (cp - 1) * block * grad_bytes}}


def ring_kept_bytes(batch: int, seq_len: int, kv_width: int, cp: int,
                    bytes_per_element: int = 2) -> int:
    """Bytes one ring-attention layer keeps for backward beyond plain attention: the
    k|v block its forward ends with (rank + 1's), where the backward starts."""
    return 0 if cp <= 1 else 2 * batch * (seq_len // cp) * kv_width * bytes_per_element


def activation_fraction(cp: int) -> float:
    """Share of the single-device activation memory one cp rank keeps: 1 / C."""
    return 1.0 / cp


def causal_pairs_per_rank(seq_len: int, cp: int, layout: str = "zigzag") -> list[int]:
    """Unmasked (query, key) pairs each rank computes in causal attention.

    A chunk i of length c = s / (2C) (positions i c .. i c + c - 1) sees
    c * i c + c (c + 1) / 2 pairs. Zig-zag: chunks r and 2C-1-r, c^2 (2C-1) + c (c+1)
    on every rank. Contiguous: chunks 2r and 2r+1, growing with r.
    """
    c = seq_len // (2 * cp)

    def chunk(i: int) -> int:
        return c * i * c + c * (c + 1) // 2

    if layout == "zigzag":
        return [chunk(r) + chunk(2 * cp - 1 - r) for r in range(cp)]
    if layout == "contiguous":
        return [chunk(2 * r) + chunk(2 * r + 1) for r in range(cp)]
    raise ValueError(f"unknown layout {layout!r}")


def blocks_per_rank(cp: int, layout: str = "zigzag") -> list[dict[str, int]]:
    """Blocks (of c x c query-key pairs, c = s / 2C) each rank's ring kernel runs.

    Zig-zag: 2 causal-diagonal blocks and 2C-1 full ones on every rank (step 0: the two
    diagonals and the late chunk against the early one; each later step: two full).
    Contiguous: 2 diagonals and 4r + 1 full blocks on rank r (four from every earlier
    rank's shard).
    """
    if layout == "zigzag":
        return [{"causal": 2, "full": 2 * cp - 1} for _ in range(cp)]
    if layout == "contiguous":
        return [{"causal": 2, "full": 4 * r + 1} for r in range(cp)]
    raise ValueError(f"unknown layout {layout!r}")


def attention_flops_per_rank(batch: int, seq_len: int, width: int, cp: int,
                             layout: str = "zigzag") -> list[int]:
    """Forward matmul FLOPs of one layer's attention core per rank, as the kernel runs it.

    Each block is two matmuls (q k^T and p v) of c x c x w multiply-adds: 4 b c^2 w
    FLOPs; a causal-diagonal block is computed whole and masked. The backward is about
    twice this (FlashAttention recomputes p: 2.5x). Zig-zag makes the list constant; the
    contiguous split's maximum over its mean approaches 2 as C grows, and the step
    time follows the maximum.
    """
    c = seq_len // (2 * cp)
    per_block = 4 * batch * c * c * width
    return [per_block * (n["causal"] + n["full"]) for n in blocks_per_rank(cp, layout)]


def imbalance(work: list[int]) -> float:
    """max / mean: how much longer the slowest rank takes than a balanced split would."""
    return max(work) * len(work) / sum(work)


def min_local_tokens_to_hide_ring(flops_per_second: float, bytes_per_second: float,
                                  bytes_per_element: int = 2) -> int:
    """Fewest tokens per rank (t = s / C) for which a forward ring step hides its send.

    Ring attention pays off only when computing on a block outlasts receiving the next
    one (Liu et al. 2023, Sec. 3, make the same argument for their block size). Under
    zig-zag a ring step after the first computes two full blocks of (t/2) x (t/2) pairs:
    2 * 4 b (t/2)^2 w = 2 b t^2 w FLOPs, and sends one k|v message of 2 b t w e bytes.
    Compute outlasts the transfer when 2 b t^2 w / F >= 2 b t w e / B, that is
    t >= F e / B: independent of the batch, the width and C. An H100 (about 990 TFLOP/s
    dense bf16) over NVLink (about 450 GB/s each way) needs t >= 4400 tokens per rank;
    over 50 GB/s InfiniBand, about 40k.
    """
    return math.ceil(flops_per_second * bytes_per_element / bytes_per_second)
