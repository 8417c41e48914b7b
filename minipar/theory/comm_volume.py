"""Bytes one rank communicates per training step, per mesh dimension and op.

The result has the shape of ``CommLog.summary()`` (``{dim: {op: {"calls", "bytes",
"wire_bytes"}}}``), so a prediction and a measured run compare key by key. ``bytes``
is the payload of each call as the log records it (an all-gather's gathered output, a
reduce-scatter's full input); ``wire_bytes`` is what a ring algorithm sends from this
rank, computed by the same ``minipar.comm.wire_bytes`` the log uses:
all-reduce 2(N-1)/N S, all-gather and reduce-scatter (N-1)/N S, send S, recv 0.

What each dimension moves (b micro-batch, s sequence, h hidden, L layers, m
micro-batches, e bytes per activation element):

* dp, data parallel (Li et al. 2020, PyTorch DDP): one all-reduce of the gradients per
  step. ZeRO stages 1 and 2 (Rajbhandari et al. 2019, Sec. 7) replace it by a
  reduce-scatter of the gradients and an all-gather of the updated weights: the same
  2(N-1)/N per parameter. Stage 3 all-gathers the weights again in the backward pass:
  3(N-1)/N, 1.5x data parallel. Stages 2 and 3 keep only a shard of the gradient, so
  with m > 1 micro-batches they reduce-scatter after every micro-batch's backward, and
  stage 3 gathers the weights for every forward and backward (DeepSpeed and FSDP
  without ``no_sync`` behave this way). A recomputed block gathers nothing more: the
  gather for its backward serves the forward run again inside it. With ``--fp8
  tensorwise`` stage 3 gathers the blocks' linear weights as float8 bytes
  (``parallel/zero/gather.py``): 1 byte per element instead of 2 (bf16), and once a step
  one all-reduce (max) of their amaxes, 4 bytes per weight matrix. (Float8's amax
  all-reduces over tp are not predicted.)
* tp, tensor parallel (Shoeybi et al. 2019, Sec. 3): per layer two all-reduces of
  b*s*h in the forward (after attention and after the MLP) and two in the backward (the
  conjugate "f" operators at the qkv and fc inputs), plus one for the
  vocabulary-parallel embedding (forward) and one at the head's input (backward), and
  three small ones of b*s fp32 for the vocabulary-parallel cross-entropy (max, sum of
  exponentials, target logit). Full recomputation repeats the forward collectives of
  the blocks that recompute: every block, or with ``recompute_layers`` N the first N of
  each model chunk (``params.stage_recomputed_layers``, the rule the engine applies).
  Sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2) turns each all-reduce
  into a reduce-scatter plus an all-gather (the same bytes on the wire), and, as in the
  paper and in ``minipar.parallel.tp``, a column-parallel linear keeps only its input's
  sequence shard and all-gathers it again in the backward: one more all-gather per
  column linear (qkv, fc, head). The replicated parameters (layer norms, row biases,
  position embedding) then see only part of the sequence: one all-reduce of their
  gradients per step completes them.
* pp, pipeline parallel: per micro-batch and model chunk, the activation b*s*h is sent
  to the next stage and its gradient back (divided by t with sequence parallelism,
  where each tp rank owns a sequence shard). Tied embeddings with pp > 1 add one
  all-reduce of the embedding gradient between the first and last stage (Megatron's
  embedding group), booked under its own dimension, ``embed``, as the comm log does.
  Not predicted: ``minipar.parallel.pp``'s one small shape header per boundary the
  first time a shape crosses it, and its optional broadcast of the loss.
* cp, context parallel (Liu et al. 2023, arXiv 2310.01889; ``minipar.theory.context``):
  each rank holds s/C tokens, so every tp, pp and loss figure above uses s/C; per layer
  and micro-batch the ring sends C-1 k|v messages forward and C-1 k|v plus C-1 fp32
  dk|dv accumulators backward (``ring_bytes``), under ``cp``; recomputation (full or
  selective) runs a recomputed block's forward ring again. The weights are replicated
  over cp as over dp: the data-parallel traffic is that of a dp*cp group, booked under
  ``dp_cp`` (the comm log's name for it) when C > 1.
* a mixture of experts (``_moe``; GShard, arXiv 2006.16668): the experts' tp all-reduces
  carry the routed rows (k a token), sp all-gathers the sequence around the layer, cp
  all-gathers the expert ids, ep moves the rows by all-to-all (``theory.moe``) and
  reduces the experts' gradients over their own replicas, ``edp``.
Not predicted: the engine's one fp32 all-reduce of the gradient norm per group, its
fp64 all-reduce of the loss over dp x cp, and how it buckets the dp reductions (one
call here).
"""

from __future__ import annotations

import math
from collections import defaultdict

from minipar.comm import wire_bytes
from minipar.model import GPTConfig
from minipar.theory.context import ring_bytes
from minipar.theory.layout import Layout
from minipar.theory.memory import _ALIASES, state_bytes
from minipar.theory.models import get_model
from minipar.theory.moe import COUNT_BYTES, all_to_all_bytes, kept_share
from minipar.theory.params import (
    check_divisible,
    float8_linears,
    param_table,
    stage_expert_params,
    stage_layers,
    stage_moe_layers,
    stage_params,
    stage_recomputed_layers,
)


def _add(out: dict, dim: str, op: str, calls: int, nbytes: int, n: int) -> None:
    """Book ``calls`` calls of ``op`` with payload ``nbytes`` each, group of ``n``."""
    if n <= 1 or calls == 0:
        return  # minipar.comm logs nothing for a group of one
    s = out[dim][op]
    s["calls"] += calls
    s["bytes"] += calls * nbytes
    s["wire_bytes"] += calls * wire_bytes(op, nbytes, n)


def float8_gathered(cfg: GPTConfig | str, pp: int = 1, tp: int = 1, stage: int = 0,
                    virtual: int = 1, head_layers: int = 0) -> tuple[int, int]:
    """(elements, weight matrices) of one rank's weights that ``--fp8`` multiplies in
    float8: every block's linear weights (a dense block's four, an MoE block's attention
    two, tp-split; its router stays in the compute dtype)."""
    cfg = get_model(cfg)
    layers = stage_layers(cfg.n_layer, pp, stage, virtual, head_layers)
    moe = stage_moe_layers(cfg, pp, stage, virtual, head_layers) if cfg.n_expert else 0
    numel, matrices = 0, 0
    for n, is_moe in ((layers - moe, False), (moe, True)):
        linears = float8_linears(cfg, tp, is_moe)
        numel += n * sum(k * out for k, out in linears)
        matrices += n * len(linears)
    return numel, matrices


def dp_volume(n_params: int, dp: int, zero: int = 0, dtype: str = "bf16",
              microbatches: int = 1, dim: str = "dp", float8: tuple[int, int] = (0, 0)
              ) -> dict:
    """Data-parallel traffic of one rank holding ``n_params`` parameters (before ZeRO):
    an all-reduce of the gradients (stage 0), or reduce-scatter + all-gather (ZeRO
    paper, Sec. 7.2: the same 2 Psi per rank for stages 1 and 2, 3 Psi for stage 3).
    ``microbatches``: ZeRO-3 reduce-scatters (and gathers) every micro-batch; minipar's
    ZeRO-2 keeps each bucket whole until the last micro-batch's backward, then reduces
    it once (``parallel/zero/optimizer.py``). ``float8``: (elements, matrices) of the
    parameters ZeRO-3 gathers in float8 (``float8_gathered``)."""
    out: dict = defaultdict(lambda: defaultdict(lambda: {"calls": 0, "bytes": 0,
                                                         "wire_bytes": 0}))
    pw, pg, _ = state_bytes(dtype)
    padded = math.ceil(n_params / dp) * dp  # flat buffers padded to a multiple of dp
    if zero == 0:
        _add(out, dim, "all_reduce", 1, n_params * pg, dp)
    elif zero in (1, 2):  # once a step: the last micro-batch's backward reduces
        _add(out, dim, "reduce_scatter", 1, padded * pg, dp)
        _add(out, dim, "all_gather", 1, padded * pw, dp)
    elif zero == 3:
        _add(out, dim, "reduce_scatter", microbatches, padded * pg, dp)
        f8, matrices = float8
        rest = math.ceil((n_params - f8) / dp) * dp
        gathered = rest * pw + math.ceil(f8 / dp) * dp  # float8: one byte an element
        _add(out, dim, "all_gather", 2 * microbatches, gathered, dp)
        _add(out, dim, "all_reduce", 1 if matrices else 0, 4 * matrices, dp)  # amaxes
    else:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
    return out


def comm_volume(cfg: GPTConfig | str, layout: Layout = Layout(), *,
                stage: int = 0) -> dict[str, dict[str, dict[str, int]]]:
    """Predicted ``CommLog.summary()`` of one rank of pipeline stage ``stage`` for one
    training step of ``layout`` (``microbatches`` micro-batches of ``microbatch_size``
    sequences). The schedule does not change the bytes, only when they move. With
    ``fp8`` tensorwise, ZeRO-3 gathers the blocks' linear weights in float8. A
    mixture-of-experts model adds what ``_moe`` books."""
    cfg = get_model(cfg)
    dp, pp, tp, cp, ep, zero, dtype = (layout.dp, layout.pp, layout.tp, layout.cp, layout.ep,
                                       layout.zero, layout.dtype)
    virtual, recompute, head = layout.virtual, layout.recompute, layout.head_layers
    check_divisible(cfg, tp)
    sp = layout.sp and tp > 1  # sequence parallelism splits over the tp group
    m = layout.microbatches
    # a cp rank holds s / cp tokens of each sequence: everything per token shrinks
    s, b, h, v = cfg.seq_len // cp, layout.microbatch_size, cfg.d_model, cfg.vocab_size
    e = 2 if _ALIASES.get(dtype, dtype) == "bf16" else 4
    first, last = stage == 0, stage == pp - 1
    layers = stage_layers(cfg.n_layer, pp, stage, virtual, head)
    moe = stage_moe_layers(cfg, pp, stage, virtual, head) if cfg.n_expert else 0
    # the blocks whose forward runs again in the backward (all, or the first N of a chunk;
    # cheap recomputation runs none again: a layer norm or GELU has no collective)
    redone, moe_redone = (stage_recomputed_layers(cfg, pp, stage, virtual, head,
                                                  layout.recompute_layers)
                          if recompute in ("selective", "full") else (0, 0))

    # data parallel, for the parameters this rank holds; split experts over their replicas
    float8 = (float8_gathered(cfg, pp, tp, stage, virtual, head)
              if layout.fp8 == "tensorwise" else (0, 0))
    n = stage_params(cfg, pp, tp, stage, virtual, head, ep=ep)
    experts = stage_expert_params(cfg, pp, stage, virtual, head, ep, tp) if ep > 1 else 0
    out = dp_volume(n - experts, dp * cp, zero, dtype, m, "dp_cp" if cp > 1 else "dp", float8)
    if experts and dp * cp > ep:
        out["edp"] = dp_volume(experts, dp * cp // ep, zero, dtype, m, "edp")["edp"]

    # tensor parallel, per micro-batch: collectives of b*s*h activations (an MoE layer's
    # MLP collectives: ``_moe``)
    dense = layers - moe
    act = s * b * h * e
    # full recomputation: these blocks' forward collectives run twice
    redo_dense, redo_moe = (redone - moe_redone, moe_redone) if recompute == "full" else (0, 0)
    if sp:
        # per layer: 2 column linears (AG fwd, AG + RS bwd), 2 row linears (RS fwd, AG bwd)
        gathers = (dense * 6 + redo_dense * 2 + moe * 3 + redo_moe + (1 if first else 0)
                   + (2 if last else 0))
        scatters = (dense * 4 + redo_dense * 2 + moe * 2 + redo_moe + (1 if first else 0)
                    + (1 if last else 0))
        _add(out, "tp", "all_gather", m * gathers, act, tp)
        _add(out, "tp", "reduce_scatter", m * scatters, act, tp)
    else:
        n_coll = (dense * 4 + redo_dense * 2 + moe * 2 + redo_moe + (1 if first else 0)
                  + (1 if last else 0))
        _add(out, "tp", "all_reduce", m * n_coll, act, tp)
    if last:  # vocabulary-parallel cross-entropy: max, sum-exp, target logit (fp32)
        _add(out, "tp", "all_reduce", 3 * m, s * b * 4, tp)
    if sp:  # gradients of the replicated parameters, summed over the sequence shards
        table = param_table(cfg)
        replicated = layers * sum(p.numel for p in table
                                  if p.where == "layer" and not p.tp_split)
        replicated -= moe * h  # an MoE layer has no mlp.proj.bias, its own are whole
        replicated += sum(p.numel for p in table if not p.tp_split and (
            (p.where == "first" and first) or (p.where == "last" and last)))
        _add(out, "tp", "all_reduce", 1, replicated * state_bytes(dtype)[1], tp)

    # context parallel: the ring, per layer and micro-batch (k|v in the compute dtype,
    # dk|dv accumulators in fp32); recomputation (full or selective) runs the forward
    # ring of the blocks that recompute again
    if cp > 1:
        ring = ring_bytes(b, cfg.seq_len, h // tp, cp, e)
        fwd = layers + redone
        calls = m * (fwd * ring["forward"]["calls"] + layers * ring["backward"]["calls"])
        nbytes = m * (fwd * ring["forward"]["bytes"] + layers * ring["backward"]["bytes"])
        for op in ("send", "recv"):
            st = out["cp"][op]
            st["calls"] += calls
            st["bytes"] += nbytes
            st["wire_bytes"] += nbytes if op == "send" else 0
    if moe:
        _moe(out, cfg, layout, moe, redo_moe, s, e)

    # pipeline: sends to the next chunk and gradients back, per micro-batch
    boundary = act // (tp if sp else 1)
    fwd_sends = virtual - (1 if last else 0)   # the model's last chunk sends nothing on
    bwd_sends = virtual - (1 if first else 0)  # the model's first chunk sends no grad
    _add(out, "pp", "send", m * (fwd_sends + bwd_sends), boundary, pp)
    _add(out, "pp", "recv", m * (fwd_sends + bwd_sends), boundary, pp)
    if cfg.tie_embeddings and pp > 1 and (first or last):  # the embedding group
        _add(out, "embed", "all_reduce", 1, v * h // tp * state_bytes(dtype)[1], 2)
    return {d: {op: dict(x) for op, x in ops.items()} for d, ops in out.items()}


def _moe(out: dict, cfg: GPTConfig, layout: Layout, moe: int, redo: int, s: int,
         e: int) -> None:
    """Book the traffic of this rank's ``moe`` MoE layers, ``redo`` of them recomputed
    in full, each on ``s`` tokens of a sequence (the cp shard), per micro-batch:

    * tp: the experts' MLPs are split as the MLP is, but their two all-reduces (the
      output's in the forward, the input gradient's in the backward) carry the routed
      rows, k a token times the share the capacity keeps (``moe.kept_share``); under sp
      the layer (``tp.SequenceParallelMoE``) all-gathers the sequence before them and
      all-gathers the output's gradient slices after them in the backward;
    * cp: the expert ids (k int64 a token) all-gathered over cp in the forward
      (``cp_plan.ShardQueues``; integers: no gradient, nothing in the backward);
    * ep: the all-to-all (``moe.all_to_all_bytes``), and the experts' gradients reduced
      over their dp * cp / ep replicas (booked by ``comm_volume`` under ``edp``).

    A recomputed layer runs each forward collective again."""
    tp, cp, ep, m, b = layout.tp, layout.cp, layout.ep, layout.microbatches, layout.microbatch_size
    h, k, kept = cfg.d_model, cfg.moe_top_k, kept_share(cfg)
    fwd = moe + redo  # forwards of a micro-batch, over the layers
    routed = round(b * s * k * kept) * h * e  # the rows of one layer and micro-batch
    _add(out, "tp", "all_reduce", m * (fwd + moe), routed, tp)
    if layout.sp:
        _add(out, "tp", "all_gather", m * (fwd + moe), b * s * h * e, tp)
    _add(out, "cp", "all_gather", m * fwd, b * s * cp * k * COUNT_BYTES, cp)
    if ep > 1:
        dtype = "bf16" if e == 2 else "fp32"
        a2a = [all_to_all_bytes(cfg, m * b * s, ep, dtype, kept, again, m, n)
               for again, n in ((False, moe - redo), (True, redo))]
        out["ep"]["all_to_all"] = {key: sum(x[key] for x in a2a)
                                   for key in ("calls", "bytes", "wire_bytes")}


def total_wire_bytes(volume: dict, dim: str | None = None) -> int:
    """Sum of ``wire_bytes`` over ops (and over dims unless ``dim`` is given)."""
    return sum(x["wire_bytes"] for d, ops in volume.items() if dim in (None, d)
               for x in ops.values())
