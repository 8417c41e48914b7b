"""Measured paces the planner prefers to data-sheet rates, when a calibration has them.

``benchmarks/multigpu.py --sections calibrate`` measures, on the machine itself:

* the transformer block's forward + backward (``block_rates``): one tensor-parallel
  rank's share of a layer at a few micro-batch sizes. A layer's FLOPs over this pace is
  its time; it knows what an 8192^3 matmul rate cannot, that h = 2048 matrices, a
  tp-split 512-wide one, layer norms, GELU and flash attention run slower.
* each collective's seconds per call at payloads from 1 KB to 1 GB: read at a call's
  own size they give its latency and bandwidth together, where one alpha-beta line
  fitted to all sizes misses the middle ones that tensor parallelism and pipeline
  sends use.
* the real tensor-parallel block with and without sequence parallelism
  (``tp_blocks``, kept in the file, not read here): sp's extra is largest where the
  block is host-bound, so the planner prices it as the host's launches
  (``planner.HOST_LAYER_EXTRA``), not as GPU seconds.
* the final layer norm, head and loss (``head_rates``): its fp32 softmax over the
  vocabulary is memory-bound, slower than the head's 6 V h FLOPs per token at the
  matmul rate say.
* what the blocks leave out of each step, per parameter, all memory-bound (so linear
  in the parameters): the optimizer step as ``ZeroOptimizer`` runs it (global-norm
  clip, fused AdamW on the fp32 masters, the cast into the 16-bit weights;
  ``optimizer_step``) and each micro-batch's gradient added into the fp32 buffer
  (``grad_accumulate``).

Each function returns ``None`` (or 0 for the optimizer and the
accumulation) when the calibration lacks the measurement, and the planner falls back
to the data-sheet model.

Float8 (``--fp8``; ``float8_seconds``) changes a block's measured pace by what the data
sheet says its float8 linears gain and what their casts move through the card's memory.
"""

from __future__ import annotations

import math

from minipar.comm import wire_bytes
from minipar.model import GPTConfig
from minipar.theory.bubble import chunk_costs, partition_layers
from minipar.theory.clusters import Cluster, check_fp8_card
from minipar.theory.layout import Layout
from minipar.theory.params import (
    float8_linears,
    head_flops_per_token,
    hook_params,
    layer_flops_per_token,
)

# An eager block's float8 casts take this many times the seconds of a compiled block's
# (``float8_cast_bytes`` at the memory bandwidth): there the amax, the scale, the multiply,
# the conversion and a transposed operand's copy each run as a kernel of their own, and
# the reductions over a transposed operand run far under the bandwidth. Fitted to one
# gpt-13b MLP linear's forward and backward, eager, on one H100, both recipes
# (docs/benchmarks.md, "The step model prices float8"; ``tests/test_card_memory.py``).
FLOAT8_EAGER_CASTS = 4.6


def interp_log(x: float, xs: list[float], ys: list[float]) -> float:
    """``ys`` linearly interpolated at ``x`` over log ``xs`` (sorted ascending), held
    constant beyond the ends: a pace measured at 2k and 16k tokens says nothing of
    what a far larger or smaller call does, so it is not extrapolated."""
    if x <= xs[0]:
        return ys[0]
    for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]):
        if x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return ys[-1]


def _nearest(rows: tuple, hidden: int, tp: int) -> list[tuple]:
    """The rows measured at the hidden size nearest ``hidden`` (in ratio) and, among
    them, at the tp nearest ``tp``, sorted by tokens."""
    if not rows:
        return []
    h = min({r[0] for r in rows}, key=lambda v: abs(math.log(v / hidden)))
    same = [r for r in rows if r[0] == h]
    t = min({r[2] for r in same}, key=lambda v: abs(math.log(v / tp)))
    return sorted(r for r in same if r[2] == t)


def block_flops(rows: tuple, hidden: int, tokens: int, tp: int) -> float | None:
    """FLOP/s one rank reaches on its share of a layer (or of the head, from its rows),
    from ``(hidden, tokens, tp, FLOP/s)`` rows, at this micro-batch's ``tokens``."""
    near = _nearest(rows, hidden, tp)
    if not near:
        return None
    return interp_log(tokens, [r[1] for r in near], [r[3] for r in near])


def call_seconds(curves: tuple, op: str, payload: float, group: int) -> float | None:
    """Seconds of one ``op`` call of ``payload`` bytes in a ``group``-rank group, from
    ``(op, payload bytes, bus bandwidth per size)`` curves: this call's wire bytes over
    the bus bandwidth measured at its payload (each curve as ``clusters.calibrated``
    read it: its running maximum over sizes, ``clusters.rising``). A ``recv`` waits for
    the same transfer as its ``send``: it takes the send's time."""
    op = "send" if op == "recv" else op
    curve = next((c for c in curves if c[0] == op), None)
    if curve is None or group < 2:
        return None
    bandwidth = interp_log(max(payload, 1.0), list(curve[1]), list(curve[2]))
    return wire_bytes(op, int(payload), group) / bandwidth


def chunk_seconds(cfg: GPTConfig, cluster: Cluster, layout: Layout,
                  efficiency: float) -> list[float]:
    """Seconds of one micro-batch's forward + backward on each of the ``pp * virtual``
    pipeline chunks (one with pp = 1): its layers (``partition_layers``) at the measured
    block pace of this micro-batch's tokens and tp share (recomputation adds its FLOPs at
    that pace, or ``cheap_recompute_seconds``, on the first ``recompute_layers`` of the
    chunk where the layout names them), the last chunk's head and loss at theirs; without
    a measured pace, at the matmul rate times ``efficiency``. Each micro-batch also adds
    the gradients of the chunk's rank (a stage's parameters, spread over its chunks) into
    the fp32 buffer, at the measured pace (0 without): the linear weights' are added in
    their GEMM, as the calibrated block adds its bf16 ``.grad``, so only the rest count
    (``hook_params``, which takes the ZeRO stage). ``bubble.pipeline_seconds`` runs the
    schedule on them."""
    tp, pp, virtual, head = layout.tp, layout.pp, layout.virtual, layout.head_layers
    tokens = layout.microbatch_size * cfg.seq_len // layout.cp  # a rank's tokens per micro-batch
    slow = cluster.matmul_rate * efficiency
    rate = block_flops(cluster.block_rates, cfg.d_model, tokens, tp) or slow
    head_rate = block_flops(cluster.head_rates, cfg.d_model, tokens, tp) or slow
    n, head_cost = pp * virtual, head_flops_per_token(cfg) / head_rate
    def layer(mode: str) -> float:  # (float8's: a micro-batch's, per token of the tp share)
        return (layer_flops_per_token(cfg, mode) / rate
                + cheap_recompute_seconds(cfg, cluster, layout.dtype, mode)
                + float8_seconds(cfg, cluster, layout, mode, efficiency) * tp / tokens)
    per_token = chunk_costs(cfg.n_layer, n, layer(layout.recompute), head_cost, head)
    redo = layout.recompute_layers
    if redo is not None and layout.recompute != "none":  # the rest of a chunk: its own
        kept = chunk_costs(cfg.n_layer, n, layer(layout.recompute_rest), head_cost, head)
        share = [min(redo, len(c)) / len(c) if c else 0.0
                 for c in partition_layers(cfg.n_layer, n, head)]
        per_token = [k + (r - k) * s for k, r, s in zip(kept, per_token, share)]
    acc = cluster.accumulate_s_per_param / virtual  # 0 unmeasured: skip the counting
    accumulate = [acc and acc * hook_params(cfg, pp, tp, s, virtual, head, layout.zero)
                  for s in range(pp)]
    return [tokens / tp * t + accumulate[c % pp] for c, t in enumerate(per_token)]


def cheap_recompute_seconds(cfg: GPTConfig, cluster: Cluster, dtype: str,
                            mode: str) -> float:
    """What cheap recomputation (``mode`` "cheap") adds to a layer, per token
    (``chunk_seconds`` divides it by tp, as the FLOPs): the two layer norms and GELU run
    again in the backward, each reading its input and writing its output once, at the
    GPU's data-sheet memory bandwidth (0 where it is not known, or for another mode).
    From the bytes; on one H100 it gave 3.6 and 23 ms a step where 3.7 and 28 were
    measured (``tests/test_card_memory.py``)."""
    bandwidth = cluster.gpu.memory_bandwidth
    if mode != "cheap" or not bandwidth:
        return 0.0
    e = 2 if dtype == "bf16" else 4
    return 2 * e * (2 * cfg.d_model + cfg.d_ff) / bandwidth


def float8_seconds(cfg: GPTConfig, cluster: Cluster, layout: Layout, mode: str,
                   efficiency: float) -> float:
    """What ``--fp8`` changes in one block's forward and backward of one micro-batch on
    one rank under recomputation ``mode`` (seconds; negative where it saves; 0 without
    float8). Its float8 linears (``params.float8_linears``; an MoE model's blocks in
    their shares) multiply in float8: three GEMMs a linear (y, dx, dW; y again under full
    recomputation) at the card's float8 rate times ``efficiency`` instead of the 16-bit
    rate (the measured matmul rate when calibrated, else the data sheet's times
    ``efficiency``), plus their casts (``float8_cast_bytes``) at the card's memory
    bandwidth, ``FLOAT8_EAGER_CASTS`` times longer in eager blocks. The head, the
    embeddings, attention's own products and the experts' grouped GEMMs stay in 16
    bits, in the block's measured pace. Float8's amax all-reduces over tp are not priced."""
    if layout.fp8 is None:
        return 0.0
    check_fp8_card(cluster)
    tokens = layout.microbatch_size * cfg.seq_len // layout.cp
    forwards = 2 if mode == "full" else 1
    e = 2 if layout.dtype == "bf16" else 4
    weight8 = layout.fp8 == "tensorwise" and layout.zero == 3  # ZeRO-3 gathers float8
    slower = 1 / (cluster.matmul_flops or cluster.peak_flops * efficiency)
    faster = 1 / (cluster.gpu.fp8_flops * efficiency)
    bandwidth = cluster.gpu.memory_bandwidth
    casts = 1.0 if layout.compiled else FLOAT8_EAGER_CASTS
    per_byte = casts / bandwidth if bandwidth else 0.0
    moe_share = cfg.n_moe_layers / cfg.n_layer
    seconds = 0.0
    for share, moe in ((1 - moe_share, False), (moe_share, True)):
        if share:
            linears = float8_linears(cfg, layout.tp, moe)
            flops = (2 + forwards) * 2 * tokens * sum(k * n for k, n in linears)
            cast = float8_cast_bytes(layout.fp8, tokens, linears, e, weight8, forwards)
            seconds += share * (flops * (faster - slower) + cast * per_byte)
    return seconds


def float8_cast_bytes(recipe: str, tokens: int, linears: tuple[tuple[int, int], ...],
                      e: int = 2, weight8: bool = False, forwards: int = 1) -> float:
    """Bytes the float8 casts of a block's ``linears`` ((in, out) features) move in one
    micro-batch of ``tokens`` (``parallel/fp8.py``), as a compiled block runs them: a
    cast with its amax reads the ``e``-byte operand twice and writes it in float8
    (2e + 1 bytes an element), a cast with a known scale reads it once (e + 1), a
    float8 transpose reads and writes a byte (2). Rowwise casts each GEMM's operands
    from 16 bits: x and W for y, dy and W^T for dx, dy^T and x^T for dW. Tensorwise casts
    x, W and dy once (under ``weight8`` W arrives in float8: ZeRO-3 gathers it so), W^T
    with W's scale (a transpose under ``weight8``), and transposes the float8 x and dy
    for dW. ``forwards``: how many times the forward's casts run (2: full recomputation)."""
    cast, scaled, moved = 2 * e + 1, e + 1, 2
    x = tokens * sum(k for k, _ in linears)
    dy = tokens * sum(n for _, n in linears)
    w = sum(k * n for k, n in linears)
    if recipe == "rowwise":
        return cast * (forwards * (x + w) + (dy + w) + (dy + x))
    w_forward, w_t = (0, moved) if weight8 else (cast, scaled)
    return forwards * (cast * x + w_forward * w) + cast * dy + w_t * w + moved * (dy + x)


def stepped_params(n_params: int, shards: int, zero: int) -> int:
    """Parameters whose optimizer step this rank runs: its shard of the (padded) flats
    at ZeRO stage 1 and up, all of them at stage 0."""
    return -(-n_params // shards) if zero >= 1 else n_params


def optimizer_seconds(cluster: Cluster, n_params: int, shards: int, zero: int) -> float:
    """The optimizer step's seconds (clip, AdamW, the 16-bit copy) on this rank's shard
    of ``n_params`` over ``shards`` (dp x cp) ranks, at the measured pace; 0 without a
    measurement (ZeRO-Offload steps on the host: ``theory.offload``)."""
    return stepped_params(n_params, shards, zero) * cluster.step_s_per_param
