"""Memory per device: model states (parameters, gradients, optimizer) and activations.

Model states follow the ZeRO paper (Rajbhandari et al. 2019, arXiv 1910.02054, Sec. 3.1
and 5): mixed-precision Adam keeps, per parameter, 2 bytes of half-precision weights,
2 bytes of half-precision gradients and K = 12 bytes of fp32 optimizer state (master
weights, momentum, variance): "16 Psi" bytes for Psi parameters. ZeRO stage 1
partitions the optimizer state over the N_d data-parallel ranks, stage 2 also the
gradients, stage 3 also the parameters. Tensor and pipeline parallelism decide *which*
parameters a rank has (``params.stage_params``); ZeRO then divides them by dp.

Activations follow Korthikanti et al. 2022 (arXiv 2205.05198, Sec. 4, Table 2). We list
every tensor one transformer layer keeps for its backward pass (``layer_activations``)
rather than copy the closed forms, so the same list serves fp32 runs and runs with
fused attention and no dropout (``accounting="fused"``, what ``minipar.model`` keeps);
with the paper's accounting and 2-byte activations the sums are exactly
the paper's ``sbh(34 + 5as/h)`` and its tensor / sequence parallel variants (tests check
all rows of Table 2). A pipeline stage keeps several micro-batches' activations at once:
``inflight`` counts them per schedule (Sec. 4.2.3).

What is stored for backward is not the whole peak. Under ``accounting="fused"`` the
last stage's rows also carry ``loss_workspace``: the cross-entropy's backward holds the
fp32 gradients of the log-probabilities and of the logits (``2 x 4 s b V`` bytes) beside
the stored log-softmax output, while every activation is still alive. With GPT-2's
50k vocabulary that is the largest single term for models up to ~1B parameters
(``loss_workspace``).

Mixture of experts (``model.MoE``; ``theory.moe``): an MoE block keeps the rows it
sends to its experts and their hidden activations instead of the MLP's; with expert
parallelism (``ep``) the expert weights are E/ep per rank and ZeRO shards their states
over their dp/ep replicas, and the all-to-all's send and receive buffers are live while
an MoE block runs (``moe_layer_activations``).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

from minipar.checks import positive  # the command line's check (no 0 or -4 ranks)
from minipar.mesh import Mesh  # layout only; no process groups
from minipar.model import GPTConfig
from minipar.parallel.recompute import MODES as RECOMPUTE
from minipar.parallel.schedules import (
    SCHEDULES,
    SPLIT_BACKWARD,
    VIRTUAL_STAGES,
)
from minipar.parallel.zero.optimizer import BUCKETS_IN_FLIGHT
from minipar.parallel.zero.stage3 import UNITS_IN_FLIGHT
from minipar.theory.activations import (  # loss_workspace, ACCOUNTINGS: re-exported
    ACCOUNTINGS,
    deferred_weight_grad_bytes,
    loss_workspace,
)
from minipar.theory.bubble import SIMULATED_PP, schedule_actions
from minipar.theory.context import ring_kept_bytes
from minipar.theory.layout import Layout
from minipar.theory.models import get_model
from minipar.theory.offload import zero_offload_memory
from minipar.theory.params import (
    block_params,
    check_divisible,
    partition_layers,
    stage_expert_params,
    stage_layers,
    stage_moe_layers,
    stage_params,
    stage_recomputed_layers,
)

# Bytes per parameter: (weights, gradients, optimizer state).
# "bf16" is mixed precision as in the ZeRO paper (Sec. 3.1): 16-bit weights and grads,
# fp32 master weights inside the optimizer state. "fp32" keeps everything in fp32.
_OPTIMIZER_STATES = {  # fp32 values per parameter the optimizer keeps
    "adam": 2,            # exp_avg, exp_avg_sq (Kingma & Ba 2015)
    "sgd": 0,
    "sgd-momentum": 1,    # momentum buffer
}
_ALIASES = {"adamw": "adam", "fp16": "bf16"}
PRECISIONS = ("fp32", "bf16")


def _act_bytes(dtype: str) -> int:
    """Bytes per activation element: 2 under bf16 mixed precision, else 4."""
    return 2 if _ALIASES.get(dtype, dtype) == "bf16" else 4


def state_bytes(dtype: str = "bf16", optimizer: str = "adam") -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter; bf16 Adam gives (2, 2, 12)."""
    dtype, optimizer = _ALIASES.get(dtype, dtype), _ALIASES.get(optimizer, optimizer)
    if dtype not in PRECISIONS:
        raise ValueError(f"dtype must be one of {PRECISIONS} (or fp16), got {dtype!r}")
    if optimizer not in _OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {list(_OPTIMIZER_STATES)} or adamw, "
                         f"got {optimizer!r}")
    k = 4 * _OPTIMIZER_STATES[optimizer]
    if dtype == "bf16":
        return 2, 2, k + 4  # + the fp32 master copy of the weights
    return 4, 4, k


def sharded(n_params: int, parts: int, experts: int = 0, ep: int = 1) -> int:
    """Elements of one rank's ZeRO shard of ``n_params``: ceil(n / parts), where the
    ``experts`` among them (expert parallelism) shard over their parts / ep replicas."""
    return math.ceil((n_params - experts) / parts) + math.ceil(experts / (parts // ep))


def model_states(n_params: int, dp: int = 1, zero: int = 0, dtype: str = "bf16",
                 optimizer: str = "adam", experts: int = 0, ep: int = 1) -> dict[str, int]:
    """Bytes of weights, gradients and optimizer state on one data-parallel rank that
    holds ``n_params`` parameters before ZeRO (ZeRO paper, Sec. 5, Fig. 1).

    A partitioned state is split in dp equal shards of ceil(n / dp) elements (the
    flat buffer is padded to a multiple of dp, as ZeRO implementations do).
    ``minipar.parallel.zero`` differs in two details a measurement will show: it pads
    each bucket (a few elements more per bucket), and it keeps the gradient shard in
    fp32 (4 bytes, not the paper's 2, under bf16 with stage 2 or 3).
    Example (the paper's Fig. 1): 7.5B parameters, dp = 64, bf16 Adam: 120 GB with
    stage 0, 31.4 GB with stage 1, 16.6 GB with stage 2, 1.9 GB with stage 3.
    ``experts`` of the ``n_params`` are split by expert parallelism: their states shard
    over their dp / ep replicas (``sharded``).
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
    pw, pg, po = state_bytes(dtype, optimizer)
    shard = sharded(n_params, dp, experts, ep)
    return {
        "params": (shard if zero >= 3 else n_params) * pw,
        "grads": (shard if zero >= 2 else n_params) * pg,
        "optimizer": (shard if zero >= 1 else n_params) * po,
    }


# --- activations -----------------------------------------------------------------------
# What a layer norm or GELU makes for the next linear: a pass over memory to make again
CHEAP_TO_RECOMPUTE = ("qkv input (ln1 output)", "fc input (ln2 output)",
                      "mlp proj input (gelu output)")
# What the weight gradients of a block read: the inputs (and the layer norms' statistics)
# of its parameter-owning modules, dW = dy^T x for a linear
WEIGHT_PASS_INPUTS = ("ln1 input", "qkv input (ln1 output)", "attention proj input",
                      "ln2 input", "fc input (ln2 output)", "mlp proj input (gelu output)",
                      "layer-norm mean and 1/std")


def layer_activations(cfg: GPTConfig | str, microbatch_size: int = 1, tp: int = 1,
                      sp: bool = False, recompute: str = "none", dtype: str = "bf16",
                      accounting: str = "korthikanti", cp: int = 1,
                      float8_compiled: bool = False) -> dict[str, float]:
    """Bytes one transformer layer stores for backward, per micro-batch, on one tp rank.

    Korthikanti et al. 2022, Sec. 4.1 and Table 2 (s sequence, b micro-batch, h hidden,
    a heads, t = tp; 2-byte activations, 1-byte dropout masks):

        no parallelism             sbh (34 + 5as/h)
        tensor parallel            sbh (10 + 24/t + 5as/(ht))
        tensor + sequence parallel sbh (34/t + 5as/(ht))
        + selective recompute      drop the 5as/h term: sbh (10 + 24/t), or sbh 34/t with sp
        full recompute             2 sbh (the layer input only)

    ``recompute="cheap"`` (``parallel/recompute.py``; not the paper's) keeps neither layer
    norm's output nor GELU's, made again in the backward from the inputs kept anyway.

    Tensor parallelism splits what lies between its two communication points (q, k,
    v, attention scores, the MLP's wide tensors); the layer norms, their outputs and
    the residual dropout masks stay whole on every tp rank ("replicated") unless
    sequence parallelism splits them along the sequence. With full recomputation and
    sp the stored layer input is the sequence shard, so it is divided by t too (the
    paper, Sec. 5, only treats the case without sp: 2sbh).

    ``accounting="korthikanti"`` is the paper's: dropout everywhere, the a*s^2*b
    attention scores stored. ``accounting="fused"`` is what a run with fused attention
    (SDPA, FlashAttention; Dao et al. 2022) keeps, as ``minipar.model`` runs: no score
    matrices, only the softmax statistics (fp32, a*s*b); dropout masks only when
    ``cfg.dropout > 0``; and the layer norms' saved mean and 1/std (fp32, 4sb), which
    the paper leaves out.

    ``float8_compiled``: the block's linears multiply in float8 (``parallel/fp8.py``) and
    the block is compiled, one graph. The compiler's partitioner (AOTAutograd's min-cut)
    then keeps neither layer norm's output nor GELU's: in the backward their consumers are
    float8 casts, into which it fuses their recomputation from what is kept anyway (the
    layer norms' inputs and statistics, GELU's input). A 16-bit linear's consumer there
    is a matrix multiply, which fuses nothing, so those stay. 12 bytes a token and hidden
    unit less (of 32): counted on a compiled block's saved tensors (``tests/test_fp8.py``)
    and measured on one H100 (``tests/test_card_memory.py``, docs/benchmarks.md).
    """
    cfg = get_model(cfg)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"accounting must be one of {ACCOUNTINGS}, got {accounting!r}")
    if sp and tp == 1:
        sp = False  # sequence parallelism splits over the tp group; nothing to split
    s, b, h, f, a = cfg.seq_len, microbatch_size, cfg.d_model, cfg.d_ff, cfg.n_head
    e = _act_bytes(dtype)
    fused = accounting == "fused"
    drop = cfg.dropout > 0 if fused else True
    sbh = s * b * h
    rep = tp if sp else 1  # what divides the "replicated" region
    if recompute == "full":
        return {"layer input (checkpoint)": sbh * e / rep}
    items = {
        "ln1 input": sbh * e / rep,
        "qkv input (ln1 output)": sbh * e / rep,
        "q, k (for Q K^T)": 2 * sbh * e / tp,
        "v (for scores . V)": sbh * e / tp,
    }
    if fused:
        items["softmax statistics (fused attention)"] = a * s * b * 4 / tp
    elif recompute == "none":
        scores = a * s * s * b
        items["softmax output"] = scores * e / tp
        items["attention dropout mask"] = scores * 1 / tp
        items["attention dropout output"] = scores * e / tp
    if cp > 1:  # ring attention keeps rank + 1's k|v block; like all, / cp by the caller
        items["ring attention: kept k|v block"] = cp * ring_kept_bytes(b, s, h // tp, cp, e)
    items["attention proj input"] = sbh * e / tp
    if drop:
        items["attention residual dropout mask"] = sbh * 1 / rep
    items["ln2 input"] = sbh * e / rep
    items["fc input (ln2 output)"] = sbh * e / rep
    items["gelu input"] = s * b * f * e / tp
    items["mlp proj input (gelu output)"] = s * b * f * e / tp
    if float8_compiled or recompute == "cheap":  # made again in the backward (for float8,
        for item in CHEAP_TO_RECOMPUTE:          # inside its casts)
            del items[item]
    if drop:
        items["mlp residual dropout mask"] = sbh * 1 / rep
    if fused:
        items["layer-norm mean and 1/std"] = 4 * s * b * 4 / rep
    return items


def moe_layer_activations(cfg: GPTConfig | str, microbatch_size: int = 1,
                          recompute: str = "none", dtype: str = "bf16",
                          ep: int = 1, tp: int = 1, sp: bool = False,
                          cp: int = 1) -> dict[str, float]:
    """Bytes an MoE block stores for backward per micro-batch beyond a dense block's
    (``layer_activations`` less its MLP's two wide tensors), and ``dispatch``: the
    all-to-all buffers live while it runs (not stored). tp splits the experts' hidden
    activations as it splits the MLP's; their input and output rows are whole.

    A sequence's k s assignments become rows sorted by expert: the experts keep their
    input rows (h), hidden activations before and after GELU (g each) and outputs (h,
    for the gate); the router its fp32 probabilities (E per token); the routing two int64
    indices per row. Rows: k s per sequence, at most E C with a capacity C
    (``moe.capacity``). Under ep a rank's experts serve every ep rank's rows: balanced
    routing gives k s again, and a capacity bounds them at E C a sequence (dropless has
    no bound: all tokens may pick this rank's experts). ``dispatch``: under ep, the rows
    sent and the rows received (2 x rows x h), beside the stored ones. cp: a rank's
    s / cp tokens (the capacity still counts the whole sequence's); sp: the layer runs
    on the whole sequence gathered over tp, and its router keeps that input.
    """
    cfg = get_model(cfg)
    if not cfg.n_expert or recompute == "full":
        return {}
    s, b, h, e = cfg.seq_len // cp, microbatch_size, cfg.d_model, _act_bytes(dtype)
    g, k, n = cfg.expert_d_ff, cfg.moe_top_k, cfg.n_expert
    slots = (n * math.ceil(cfg.capacity_factor * k * cfg.seq_len / n)
             if cfg.capacity_factor > 0 else 0)
    # (under cp the capacity is decided over the whole sequence, ``cp_plan.ShardQueues``:
    # a rank's experts fill their share, slots / cp, of its sequences' slots)
    per_seq = k * s if not slots else (slots / cp if ep > 1 else min(k * s, slots))
    rows = b * per_seq
    dense = layer_activations(cfg, microbatch_size, tp, False, recompute, dtype, "fused", cp)
    return {
        "expert input rows": rows * h * e,
        "expert hidden (GELU input and output)": 2 * rows * g * e / tp,
        "expert outputs (for the gate)": rows * h * e,
        "router probabilities (fp32)": s * b * n * 4,
        "routing indices (int64)": 2 * rows * 8,
        # (cheap recomputation keeps no GELU output; a dense layer's rows count the whole
        # sequence's, as ``layer_activations``' do: this rank's s / cp of them)
        "less the MLP's": -(dense["gelu input"]
                            + dense.get("mlp proj input (gelu output)", 0)) / cp,
        "the gathered sequence (sp)": s * b * h * e * (1 - 1 / tp) if sp else 0,
        "dispatch": 2 * rows * h * e if ep > 1 else 0,
    }


def edge_activations(cfg: GPTConfig | str, where: str, microbatch_size: int = 1,
                     tp: int = 1, sp: bool = False, dtype: str = "bf16",
                     accounting: str = "korthikanti") -> dict[str, float]:
    """Bytes stored per micro-batch outside the transformer layers (Korthikanti Sec. 4.3).

    ``where="first"``: the token ids (int64, for the embedding's backward; Megatron's
    estimator counts them) and the embedding dropout mask (``sbh/t`` with sp).
    ``where="last"``: the final layer norm's input, the head's input and the logits kept
    in fp32 for the cross-entropy: ``4sbh/t (1 + v/h)`` in the paper (with sp; the
    logits are split by the vocabulary-parallel head).
    """
    cfg = get_model(cfg)
    if sp and tp == 1:
        sp = False
    s, b, h, v = cfg.seq_len, microbatch_size, cfg.d_model, cfg.vocab_size
    e = _act_bytes(dtype)
    drop = cfg.dropout > 0 if accounting == "fused" else True
    rep = tp if sp else 1
    if where == "first":
        items = {"token ids": s * b * 8}
        if drop:
            items["embedding dropout mask"] = s * b * h / rep
        return items
    if where == "last":
        return {"ln_f input": s * b * h * e / rep, "head input": s * b * h * e / rep,
                "logits (fp32, for the loss)": s * b * v * 4 / tp}
    raise ValueError(f"where must be 'first' or 'last', got {where!r}")


def inflight(schedule: str, pp: int, microbatches: int, stage: int = 0,
             virtual: int = 1) -> int:
    """Peak number of micro-batches (model chunks, when interleaved) whose forward has
    run on ``stage`` and whose backward has not: the activations the stage holds.

    * GPipe (Huang et al. 2019): all m forwards first, so m.
    * 1F1B (PipeDream-Flush, Narayanan et al. 2021): stage s runs p - s warm-up
      forwards, then alternates: min(m, p - s). The first stage holds p micro-batches,
      each with L/p layers: L layers' worth, whatever p (Korthikanti Sec. 4.2.3).
    * interleaved 1F1B with v chunks (Narayanan et al. 2021, Sec. 2.2; Megatron's
      warm-up of 2(p - s - 1) + (v - 1)p chunk forwards, then one more before the first
      backward): min(m v, 2(p - s - 1) + (v - 1)p + 1) chunks of L/(pv) layers. On the
      first stage that is L (1 + (p-1)/(pv)) layers' worth, the paper's factor.
    * ZB-H1 (Qi et al. 2023, arXiv 2401.10241, Sec. 3): an activation is held until
      its weight-gradient pass W, and stage s defers s of them, so every stage holds
      min(m, p): the first stage's 1F1B peak, now on all stages (the paper's "peak
      memory no more than 1F1B's" is about the worst stage).
    * interleaved zero bubble: interleaved 1F1B's count plus the s weight passes stage
      s defers (``split_in_flight``): min(m v, 2(p - 1) + (v - 1)p + 1 - s) with enough
      micro-batches, one less per stage (not the same on all, as ZB-H1's).

    ``minipar.theory.bubble`` derives the same counts from the schedules' action lists
    (a test checks they agree when that module is present).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is outside 0..{pp - 1}")
    if virtual > 1 and schedule not in VIRTUAL_STAGES:
        raise ValueError(f"virtual={virtual} chunks need an interleaved schedule")
    m = microbatches
    if schedule == "gpipe":
        return m
    if schedule == "interleaved":
        return min(m * virtual, 2 * (pp - stage - 1) + (virtual - 1) * pp + 1)
    if schedule in SPLIT_BACKWARD:
        return sum(split_in_flight(schedule, pp, m, stage, virtual))
    return min(m, pp - stage)


def block_activations(cfg: GPTConfig, layout: Layout, mode: str,
                      accounting: str = "fused", weight_pass: bool = False) -> float:
    """What one block of ``layout`` stores for its backward under recomputation
    ``mode`` (``layer_activations``, summed), per micro-batch, before cp's split.
    ``weight_pass``: only what its weight gradients read under ZB-H1's split backward
    (``WEIGHT_PASS_INPUTS``). There each module runs on a detached input, a leaf of its
    own graph, which holds it till W: a cheap recomputation's recipe frees nothing
    then, and keeps GELU's input besides."""
    # (tp's float8 linears gather or keep their inputs themselves: not counted as gone)
    float8_compiled = layout.fp8 is not None and layout.compiled and layout.tp == 1
    return _block_bytes(cfg, layout.microbatch_size, layout.tp, layout.sp, layout.dtype,
                        layout.cp, float8_compiled, mode, accounting, weight_pass)


@lru_cache(maxsize=4096)  # (asked for every stage of every layout a planner prices)
def _block_bytes(cfg: GPTConfig, b: int, tp: int, sp: bool, dtype: str, cp: int,
                 float8_compiled: bool, mode: str, accounting: str, weight_pass: bool) -> float:
    held = "none" if weight_pass and mode == "cheap" else mode
    items = layer_activations(cfg, b, tp, sp, held, dtype, accounting, cp, float8_compiled)
    if not weight_pass:
        return sum(items.values())
    recipe = items["gelu input"] if mode == "cheap" else 0
    return recipe + sum(v for k, v in items.items() if k in WEIGHT_PASS_INPUTS)


def embedding_grad_bytes(cfg: GPTConfig, tp: int, dtype: str) -> int:
    """The embedding's (or a tied head's) whole weight gradient on one tp rank, in the
    compute dtype, as autograd makes it: dense, every row of the vocabulary."""
    return cfg.vocab_size * cfg.d_model // tp * _act_bytes(dtype)


def split_in_flight(schedule: str, pp: int, microbatches: int, stage: int,
                    virtual: int = 1) -> tuple[int, int]:
    """What stage ``stage`` of a split-backward schedule (ZB-H1, interleaved zero bubble)
    holds before the backward B that finds it fullest, chunks of equal size: (the
    micro-batches, or chunks, whose B has run and whose W has not, each keeping what its
    W reads and its output gradients; those whose forward has run and whose B has not,
    that B's own among them, each keeping all it stored).

    The F and B run in the order of the schedule they split (1F1B, interleaved 1F1B),
    whose warm-up leaves ``warm`` forwards in flight (``inflight``); the steady state keeps
    that many while forwards remain, and stage s defers its first s weight passes
    (``schedules.zb_h1``, ``schedules.defer_weight_passes``). The fullest B is the one
    after min(s, f) of them, f the forwards left after the warm-up: ZB-H1 with m >= p
    holds (s, p - s), p on every stage. (Tested against a walk along the action lists.)"""
    base = "interleaved" if schedule in VIRTUAL_STAGES else "1f1b"
    warm = inflight(base, pp, microbatches, stage, virtual)
    return min(stage, microbatches * virtual - warm), warm


class Moment(NamedTuple):
    """A split-backward stage just before one of its B: per local chunk, the micro-batches
    whose B has run and whose W has not (``deferred``), and those whose F has run and
    whose B has not, the coming B's own among them (``in_flight``); and the coming B's
    local chunk (``chunk``)."""

    deferred: tuple[int, ...]
    in_flight: tuple[int, ...]
    chunk: int


def split_moments(schedule: str, pp: int, microbatches: int, stage: int,
                  virtual: int = 1) -> tuple[Moment, ...]:
    """The moments (``Moment``) before each B of a split-backward stage, chunk by chunk,
    where its chunks differ in size (interleaved: the first holds the embedding's layers,
    the last rank's last the head's fewer). Walked along the schedule's own list
    (``schedules.make_schedule``) at up to 4 pp micro-batches (the warm-up and the first
    steady rounds, where a stage is fullest, are the same with more). Past
    ``SIMULATED_PP`` stages the list costs seconds to build: one moment then,
    ``split_moment``'s closed form."""
    if pp > SIMULATED_PP:
        return split_moment(schedule, pp, microbatches, stage, virtual),
    return _walked_moments(schedule, pp, min(microbatches, 4 * pp), stage, virtual)


def split_moment(schedule: str, pp: int, microbatches: int, stage: int,
                 virtual: int = 1) -> Moment:
    """``split_in_flight``'s moment told chunk by chunk, in closed form: its deferred
    passes are all of the last local chunk (whose backwards come first), and its forwards
    run pp micro-batches of a local chunk at a time. (One of ``split_moments``' walked
    ones: tested.)"""
    done, warm = split_in_flight(schedule, pp, microbatches, stage, virtual)
    groups, rest = divmod(warm + done, pp * virtual)  # the forwards run by then
    busy = [groups * pp + min(pp, max(0, rest - j * pp)) for j in range(virtual)]
    busy[-1] -= done
    return Moment((0,) * (virtual - 1) + (done,), tuple(busy), virtual - 1)


@lru_cache(maxsize=1024)
def _walked_moments(schedule: str, pp: int, microbatches: int, stage: int,
                    virtual: int) -> tuple[Moment, ...]:
    """Every distinct ``Moment`` before a B of ``stage``, read off the schedule's list."""
    done, busy = [0] * virtual, [0] * virtual
    moments = set()
    for a in schedule_actions(schedule, pp, microbatches, virtual)[stage]:
        local = a.chunk // pp
        if a.kind == "F":
            busy[local] += 1
        elif a.kind == "B":
            moments.add(Moment(tuple(done), tuple(busy), local))
            busy[local] -= 1
            done[local] += 1
        elif a.kind == "W":
            done[local] -= 1
    return tuple(sorted(moments))


def stage_activations(cfg: GPTConfig | str, layout: Layout = Layout(), stage: int = 0,
                      accounting: str = "korthikanti", during_loss: bool = False) -> float:
    """Peak activation bytes on one rank of pipeline stage ``stage``: per-layer bytes x
    layers per chunk x chunks in flight (interleaved: chunks in flight / v, as Megatron's
    estimator; uneven chunks: their mean size, each at its own under a split backward,
    ``split_moments``), plus the embedding terms on the first
    stage and the head terms on the last, times its micro-batches in flight. An MoE
    block's stored rows replace its MLP's (``moe_layer_activations``; its all-to-all
    buffers are ``memory_per_stage``'s). ``recompute_layers`` N: only the first N blocks
    of each chunk recompute, the rest keep everything (Megatron's partial recomputation)
    or recompute cheaply (``recompute_rest``).
    ``during_loss``: the peak while the last stage runs the loss's backward (its workspace
    beside it). Under a split backward (fused accounting) the B in flight there keeps no
    logits gradient, which is still the loss's workspace; under interleaved zero bubble
    the last stage's fullest moment can be another chunk's B, where no loss runs.
    Counted before context parallelism's split (``memory_per_stage`` divides by cp): what
    each cp rank holds whole, an embedding's gradient, an MoE layer's rows, cp times."""
    peak, at_loss = _stage_activation_peaks(cfg, layout, stage, accounting)
    return at_loss if during_loss else peak


def _stage_activation_peaks(cfg: GPTConfig | str, layout: Layout, stage: int,
                            accounting: str) -> tuple[float, float]:
    """``stage_activations``' peak, and its peak while the loss's backward runs."""
    cfg = get_model(cfg)
    check_divisible(cfg, layout.tp)
    b, tp, sp, cp, dtype = (layout.microbatch_size, layout.tp, layout.sp, layout.cp,
                            layout.dtype)
    pp, virtual, head, schedule = layout.pp, layout.virtual, layout.head_layers, layout.schedule

    chunks_in_flight = inflight(schedule, pp, layout.microbatches, stage, virtual)
    at_loss = None  # (a split backward's own; else the peak)
    layers = stage_layers(cfg.n_layer, pp, stage, virtual, head) / virtual
    # per chunk (a mean over the stage's chunks): the blocks that recompute, and the rest
    redone, moe_redone = (n / virtual for n in stage_recomputed_layers(
        cfg, pp, stage, virtual, head, layout.recompute_layers))
    # what the blocks past the first N do (none, cheap); minipar's ZB-H1 runs each module
    # on a detached input, a leaf of the module's graph that holds it till W, so a cheap
    # recomputation's recipe frees none of it
    stitched = schedule in SPLIT_BACKWARD and accounting == "fused"
    mode, rest = ("none" if stitched and r == "cheap" else r
                  for r in (layout.recompute, layout.recompute_rest))
    total = (block_activations(cfg, layout, mode, accounting) * redone
             + block_activations(cfg, layout, rest, accounting) * (layers - redone)
             ) * chunks_in_flight

    def per_moe_layer(mode: str) -> float:
        moe = moe_layer_activations(cfg, b, mode, dtype, layout.ep, tp, sp, cp)
        moe.pop("dispatch", None)
        return cp * sum(moe.values())  # a rank's, counted as the whole sequence's (/ cp)
    moe_layers = stage_moe_layers(cfg, pp, stage, virtual, head) / virtual
    total += (per_moe_layer(mode) * moe_redone
              + per_moe_layer(rest) * (moe_layers - moe_redone)) * chunks_in_flight
    if schedule in SPLIT_BACKWARD and not stitched:  # the paper's: each in flight keeps dy
        total += deferred_weight_grad_bytes(cfg, b, tp, sp, dtype) * layers * chunks_in_flight
    elif schedule in SPLIT_BACKWARD:  # minipar's: B(i) ends holding one more W's worth
        kept = (block_activations(cfg, layout, layout.recompute, accounting, True) * redone
                + block_activations(cfg, layout, layout.recompute_rest, accounting, True)
                * (layers - redone) + deferred_weight_grad_bytes(cfg, b, tp, sp, dtype) * layers)
        total, at_loss = _split_backward_peaks(cfg, layout, stage, total / chunks_in_flight,
                                               kept)
    at_loss = total if at_loss is None else at_loss
    whole = max(1, math.ceil(chunks_in_flight / virtual))  # micro-batches in flight
    edges = 0.0
    if stage == 0:
        edges += whole * sum(edge_activations(cfg, "first", b, tp, sp, dtype,
                                              accounting).values())
    if stage == pp - 1:
        # minipar's ZB-H1 frees the fp32 logits with B (W needs only the head's input):
        # one micro-batch's, as 1F1B's
        last = edge_activations(cfg, "last", b, tp, sp, dtype, accounting)
        loss = last.pop("logits (fp32, for the loss)")
        if layout.chunked_loss:  # the logits kept as the head made them, no fp32 copy
            loss *= _act_bytes(dtype) / 4
        edges += whole * sum(last.values()) + (1 if stitched else whole) * loss
    return total + edges, at_loss + edges


def _split_backward_peaks(cfg: GPTConfig, layout: Layout, stage: int, per_chunk: float,
                          kept: float) -> tuple[float, float]:
    """A split-backward stage's fullest moment (``split_moments``), and its fullest while
    the loss runs (the last stage's last chunk's B), each local chunk at its own size:
    ``per_chunk`` is what a chunk of the stage's mean size stores for a micro-batch,
    ``kept`` what its W reads. On the last stage the head's W reads the logits' gradient
    too; on the first, W makes the embedding's whole gradient."""
    pp, virtual, head, tp = layout.pp, layout.virtual, layout.head_layers, layout.tp
    mean = stage_layers(cfg.n_layer, pp, stage, virtual, head) / virtual
    chunks = partition_layers(cfg.n_layer, pp * virtual, head)
    # a stage of no blocks (the head alone, --head-layers taking its last chunk's share)
    # keeps no block's inputs for W
    share = [len(chunks[stage + j * pp]) / mean if mean else 0.0 for j in range(virtual)]
    keeps = [kept * x for x in share]
    logits_grad = (cfg.seq_len * layout.microbatch_size * cfg.vocab_size
                   * _act_bytes(layout.dtype) / tp if stage == pp - 1 else 0)
    keeps[-1] += logits_grad
    # the embedding's gradient: every cp rank makes all of it, counted here as the whole
    # sequence's (memory_per_stage divides by cp)
    made = layout.cp * embedding_grad_bytes(cfg, tp, layout.dtype) if stage == 0 else 0

    def held(moment: Moment, loss_runs: bool) -> float:
        """The deferred W's inputs, the micro-batches in flight, and the coming B's own
        growth: what it will keep beyond what its forward stored (while the loss runs,
        the head's logits gradient is still the loss's workspace, counted beside)."""
        making = keeps[moment.chunk] - (logits_grad if loss_runs else 0)
        return (sum(d * k for d, k in zip(moment.deferred, keeps))
                + sum(n * per_chunk * x for n, x in zip(moment.in_flight, share))
                + max(0.0, making + made - per_chunk * share[moment.chunk]))
    moments = split_moments(layout.schedule, pp, layout.microbatches, stage, virtual)
    peak = max(held(moment, False) for moment in moments)
    if stage != pp - 1:
        return peak, peak
    return peak, max(held(moment, True) for moment in moments if moment.chunk == virtual - 1)


# --- the whole picture -------------------------------------------------------------------
def _minipar_grads(grads: int, n: int, shard: int, zero: int, dtype: str,
                   grad_dtype: str, microbatches: int = 1) -> int:
    """The gradient bytes minipar holds (``accounting="fused"``), where the paper's
    ``grads`` counts 2 under bf16: ZeRO 0-2 sum micro-batches in ``grad_dtype`` (fp32 by
    default, 4 bytes). ZeRO-2 reduces once a step, in the last micro-batch's backward:
    with one micro-batch it holds the fp32 shard only, with more the full-size sum waits
    through the micro-batches before it (ZeRO-3's shard is counted already)."""
    if zero == 3 or state_bytes(dtype)[0] == 4:
        return grads
    full = n * (4 if grad_dtype == "fp32" else 2)
    return shard * 4 if zero == 2 and microbatches == 1 else full


def buffers_in_flight(cfg: GPTConfig, layout: Layout, moe: bool = False) -> tuple[int, int]:
    """What the data-parallel layer holds in a backward beyond the gradients it keeps,
    a block's worth at a time (``moe``: the stage has MoE blocks, the larger unit): at
    the backward's start (its first block) and later in it.

    * ZeRO-3: the unit computing and the one prefetched, gathered in the compute dtype,
      and the unit's full-size gradient filling; later also ``UNITS_IN_FLIGHT`` more on
      the wire (``parallel/zero/stage3.py``);
    * ZeRO-2, in the one backward that reduces (the only one with one micro-batch): the
      bucket filling; later also ``BUCKETS_IN_FLIGHT`` on the wire, a block's
      full-size gradient each (``step.data_parallel``'s buckets);
    * ZeRO 0-1, and ZeRO-2 with more micro-batches: none beyond the full-size buffer
      counted as their gradients;
    * with a head tied to the embedding on one stage, every stage of ZeRO: the head's
      weight gradient, waiting in the compute dtype from the head's backward to the
      embedding's for autograd to sum the two uses (ZeRO-3 keeps the unit gathered as
      long: its backward ends with the embedding's).
    """
    unit = block_params(cfg, layout.tp, layout.ep, moe)
    grad = 2 if layout.grad_dtype == "bf16" else 4
    tied = 0
    if cfg.tie_embeddings and layout.pp == 1:  # the head's gradient (and ZeRO-3's unit)
        tied = embedding_grad_bytes(cfg, layout.tp, layout.dtype)
        tied *= 2 if layout.zero == 3 else 1
    if layout.zero == 3:
        gathered = 2 * unit * _act_bytes(layout.dtype) + tied
        return gathered + unit * grad, gathered + unit * (1 + UNITS_IN_FLIGHT) * grad
    if layout.zero == 2 and layout.microbatches == 1:
        return unit * grad + tied, unit * (1 + BUCKETS_IN_FLIGHT) * grad + tied
    return tied, tied


def recompute_transient(cfg: GPTConfig, layout: Layout, stage: int = 0) -> float:
    """What recomputation makes again for one block during its backward: the block's
    stored activations less what it keeps (``none``'s less ``layout.recompute``'s), on
    a stage with a recomputed block (0 without)."""
    if layout.recompute == "none" or not stage_recomputed_layers(
            cfg, layout.pp, stage, layout.virtual, layout.head_layers,
            layout.recompute_layers)[0]:
        return 0.0
    return (block_activations(cfg, layout, "none")
            - block_activations(cfg, layout, layout.recompute)) / layout.cp


# Which torch kernel steps the optimizer (``Layout.optimizer_kernel``; a run's is
# ``config.optimizer_kernel``): ``fused`` (one kernel per tensor list, in place: torch's
# ``fused=True``, minipar's default on CUDA), ``foreach`` (multi-tensor ``torch._foreach_*``
# ops, torch's default on CUDA without it), ``forloop`` (one tensor at a time, torch's
# default on the CPU) and ``host`` (ZeRO-Offload: the step runs on the CPU).
OPTIMIZER_KERNELS = ("fused", "foreach", "forloop", "host")


def optimizer_step_bytes(n: int, parts: int, zero: int, dtype: str = "bf16",
                         optimizer: str = "adam", experts: int = 0, ep: int = 1,
                         kernel: str = "fused") -> int:
    """The transient of the optimizer step itself on the device, as torch 2.13 allocates
    it (``benchmarks/optimizer_memory.py``, measured on the CPU; on 4 x H100 with torch
    2.11, gpt-13b dp 4 ZeRO-3 peaks in its multi-tensor step, as booked): the multi-tensor
    (``foreach``) AdamW allocates each list op's outputs whole, so it keeps one temporary
    the size of the fp32 parameters it updates (the shard under ZeRO 1-3; ``sharded``);
    the fused kernel makes none; the per-tensor loop two of one tensor at a time (a
    bucket or a unit's shard: not counted); SGD, with or without momentum, none (without
    weight decay, the default; with it the foreach kernel makes one too); the host's step
    (``host``) none on the device."""
    if kernel not in OPTIMIZER_KERNELS:
        raise ValueError(f"optimizer kernel must be one of {OPTIMIZER_KERNELS}, got {kernel!r}")
    if kernel != "foreach" or _ALIASES.get(optimizer, optimizer) != "adam":
        return 0
    return (sharded(n, parts, experts, ep) if zero >= 1 else n) * 4


def memory_per_stage(cfg: GPTConfig | str | None = None, layout: Layout = Layout(), *,
                     params: int | None = None, accounting: str = "korthikanti",
                     stages: list[int] | None = None) -> list[dict]:
    """``memory_breakdown`` for each pipeline stage (or the listed ``stages``) of
    ``layout``; every data-, tensor- and context-parallel rank of a stage holds the same
    (up to ZeRO padding). ``memory_per_stage("gpt-13b", Layout(dp=4, zero=3))``.

    Context parallelism (``cp``, ``minipar.theory.context``): a rank keeps s / cp tokens
    of every sequence, so its activations divide by cp (ring attention stores no s x s
    scores; with ``accounting="korthikanti"`` that term is divided by cp too, as the
    kernel does not keep it at all); the weights are replicated over cp, so ZeRO shards
    over dp * cp. ZeRO-3 in 16 bits as ``parallel.zero.stage3`` holds it: its gathers cast
    from the fp32 master shard, so no 16-bit shard (``params`` 0), and the gradient
    shard is fp32 (4 bytes): the paper's 2 + 2 bytes, as 0 + 4. ZeRO-Offload
    (``offload``, Ren et al. 2021; ``theory.offload``): the fp32 master shard and the
    optimizer states leave the device (``optimizer`` is 0), the device keeps the
    compute-dtype weights (ZeRO-3: now a 16-bit shard, which the gathers read) and the
    gradient buffers, and ``host`` counts what the host holds (``zero_offload_memory``:
    master, its gradient, states, landing buffers).
    Expert parallelism (``ep``, dividing dp): a rank holds E/ep experts of each MoE
    block, whose states ZeRO shards over dp/ep (``n_experts`` of ``n_params``), and
    ``moe_dispatch`` counts the all-to-all's buffers, live in the backward. The step's
    own temporary (``optimizer_step``) is the layout's ``optimizer_kernel``'s
    (``optimizer_step_bytes``: the multi-tensor AdamW's, none for the fused kernel).
    """
    if cfg is None and params is None:
        raise ValueError("give a model config (or preset name) or params=N")
    dp, pp, tp, cp, ep, zero = (layout.dp, layout.pp, layout.tp, layout.cp, layout.ep,
                                layout.zero)
    b, m, dtype, optimizer = (layout.microbatch_size, layout.microbatches, layout.dtype,
                              layout.optimizer)
    for flag, value in (("dp", dp), ("pp", pp), ("tp", tp), ("cp", cp),
                        ("virtual", layout.virtual), ("ep", ep), ("microbatch-size", b),
                        ("microbatches", m), ("params", params)):
        positive(flag, value)
    cfg = get_model(cfg) if cfg is not None else None
    if ep > 1 and (cfg is None or not cfg.n_expert):
        raise ValueError(f"--ep {ep} needs a mixture-of-experts model (--moe-experts E)")
    if dp % ep or (cfg is not None and cfg.n_expert % ep):
        raise ValueError(f"--ep {ep} must divide --dp {dp} and the number of experts "
                         f"({cfg.n_expert if cfg else 0})")
    if cfg is not None and cp > 1 and cfg.seq_len % (2 * cp):
        raise ValueError(f"--cp {cp} needs a sequence length divisible by 2*cp={2 * cp} "
                         f"(the zig-zag split's chunks); seq_len is {cfg.seq_len}")
    stages = list(range(pp)) if stages is None else stages
    out = []
    for s in stages:
        if cfg is None:  # model states only, the parameters spread evenly
            n, ne = math.ceil(params / (pp * tp)), 0
            act = at_loss = 0.0
        else:
            n = stage_params(cfg, pp, tp, s, layout.virtual, layout.head_layers, ep)
            ne = stage_expert_params(cfg, pp, s, layout.virtual, layout.head_layers, ep, tp)
            act, at_loss = (x / cp for x in _stage_activation_peaks(cfg, layout, s,
                                                                     accounting))
        shard = sharded(n, dp * cp, ne, ep)
        row = {"stage": s, "n_params": n,
               **model_states(n, dp * cp, zero, dtype, optimizer, ne, ep),
               "activations": int(round(act))}
        if ne:
            row["n_experts"] = ne
        pw = state_bytes(dtype, optimizer)[0]
        if zero == 3 and pw < 4:  # a 16-bit shard only where offload took the master away
            row["params"], row["grads"] = (shard * pw if layout.offload else 0), shard * 4
        if layout.offload:
            states = state_bytes("fp32", optimizer)[2]  # the moments, fp32, on the host
            row["host"] = zero_offload_memory(  # (a GPU's: with its upload buffer)
                n, pw, states, dp * cp, zero,
                grad_bytes=2 if layout.grad_dtype == "bf16" else 4)["host"]
            row["optimizer"] = 0  # master shard, states and step on the host
        row["total"] = row["params"] + row["grads"] + row["optimizer"] + row["activations"]
        if accounting == "fused" and cfg is not None:  # the paper's rows stay as they were
            ws = loss_workspace(cfg, b, tp, accounting, cp, layout.chunked_loss,
                                _act_bytes(dtype)) if s == pp - 1 else 0
            row["loss_workspace"] = int(round(ws))
            row["grads"] = _minipar_grads(row["grads"], n, shard, zero, dtype,
                                          layout.grad_dtype, m)
            # Only ZeRO-1's full buffer lives across steps; the others are made in the
            # backward as it frees activations: one micro-batch holds the larger of the
            # two, with more the first's gradients wait through the next forwards (as
            # measured on 2 and 4 GPUs, docs/benchmarks.md) and a backward frees only one
            # of the micro-batches (chunks) in flight. Beside them, a
            # block's worth of buffers (``buffers_in_flight``, ``recompute_transient``):
            # fewer at a backward's start, where they follow the loss's workspace (the
            # first block's backward follows the loss's), than later in it.
            start, later = buffers_in_flight(cfg, layout, ne > 0)
            redo = int(recompute_transient(cfg, layout, s))
            start, later = start + redo, later + redo
            grads, acts, ws = row["grads"], row["activations"], row["loss_workspace"]
            # the loss's workspace beside what is held while the loss runs
            peak = max(int(round(at_loss)) + ws, acts + start)
            if zero != 1 and m == 1:
                held = max(peak, grads + later)
            else:
                kept = 1 - 1 / inflight(layout.schedule, pp, m, s, layout.virtual)
                held = grads + max(peak, int(acts * kept) + later)
            row["in_flight"] = later  # the most of those buffers at once
            moe = moe_layer_activations(cfg, b, layout.recompute, dtype, ep, tp, layout.sp, cp)
            row["moe_dispatch"] = int(moe.get("dispatch", 0))
            backward = row["params"] + row["optimizer"] + held + row["moe_dispatch"]
            # the step: states, the reduced gradients and the optimizer's temporary
            row["optimizer_step"] = 0 if layout.offload else optimizer_step_bytes(
                n, dp * cp, zero, dtype, optimizer, ne, ep, layout.optimizer_kernel)
            # (ZeRO-1 keeps its full-size buffer beside the reduced shard it steps with)
            step = (row["params"] + row["optimizer"] + row["optimizer_step"]
                    + (row["grads"] if zero != 2 or m == 1 else shard * 4)
                    + (shard * 4 if zero == 1 and pw < 4 else 0))
            row["total"] = max(backward, step)
        out.append(row)
    return out


def memory_breakdown(cfg: GPTConfig | str | None = None, layout: Layout = Layout(), *,
                     params: int | None = None, accounting: str = "korthikanti",
                     stage: int | None = None) -> dict:
    """Bytes on the most loaded device (or on ``stage``): keys ``params``, ``grads``,
    ``optimizer``, ``activations``, ``total``, plus ``stage`` and ``n_params``
    (and ``host`` with ``offload``: bytes in host memory, not in ``total``)
    (and with ``accounting="fused"``, counted in ``total`` where they meet the rest:
    ``loss_workspace``; ``in_flight``, the most that the data-parallel layer's
    block-sized buffers and recomputation hold at once in a backward,
    ``buffers_in_flight`` and ``recompute_transient``).

    With ``params=N`` and no config: model states only, N / (pp * tp) per rank.
    The most loaded stage is the first (most micro-batches in flight, the embedding)
    or the last (the head and its logits); middle stages hold no more than the first.
    Not counted: the CUDA context and allocator fragmentation: ``theory.card`` adds
    what a card holds beyond the tensors.
    """
    stages = sorted({0, layout.pp - 1}) if stage is None else [stage]
    rows = memory_per_stage(cfg, layout, params=params, accounting=accounting, stages=stages)
    return max(rows, key=lambda r: r["total"])


def memory_per_rank(cfg: GPTConfig | str | None = None, layout: Layout = Layout(), *,
                    params: int | None = None, accounting: str = "korthikanti") -> list[dict]:
    """``memory_per_stage`` laid out over the ranks of the layout's ``Mesh`` (its sizes
    and rank ``order``): one row per global rank, with its ``rank`` and mesh coordinates
    added (the shape the memory figure takes, beside what each rank of a run measures)."""
    mesh = Mesh(layout.dp, layout.pp, layout.tp, layout.order, cp=layout.cp)
    stages = memory_per_stage(cfg, layout, params=params, accounting=accounting)
    rows = []
    for r in range(mesh.world_size):
        c = mesh.coords(r)
        rows.append({"rank": r, "dp": c.dp, "pp": c.pp, "tp": c.tp, "cp": c.cp,
                     **stages[c.pp]})
    return rows
