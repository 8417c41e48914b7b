"""The planner: every layout of a model on a cluster, filtered, timed, ranked, explained.

A layout (``theory.layout.Layout``) is a choice of tensor (tp), pipeline (pp), data (dp)
and context (cp) parallel sizes with tp * pp * dp * cp = GPUs (cp > 1 only for sequences
long enough that each rank keeps ``min_cp_tokens`` or more), a ZeRO stage, a micro-batch
size (which fixes the number of micro-batches m = global batch / (dp * b)), a pipeline
schedule, sequence parallelism and activation recomputation. The planner enumerates
them, drops the impossible ones (with the reason), estimates (``evaluate``: an
``Estimate``) the step time of the rest, sorts them.

The step-time model is deliberately simple, so that every term can be read and argued
with (Narayanan et al. 2021, arXiv 2104.04473, Sec. 3, reason the same way):

    compute  = the busiest GPU's FLOPs (recomputation included) over a rate: a layer's
               and the head's at their measured paces at this micro-batch's tokens and
               tp share when calibrated (``theory.rates``), else at the matmul rate
               (data sheet or measured) times ``matmul_efficiency``; plus each micro-
               batch's gradients added into the fp32 buffer, when measured
    bubble   = the schedule's timeline with each chunk at its own seconds (the last runs
               the head; pp > 1 splits ``head_layers_for``), less the busiest's compute
    tp, pp   = every call exposed (tp collectives, each micro-batch's send and recv):
               its measured time at its payload, else wire bytes / bandwidth +
               latency (sp's extra launches are the host's, below)
    dp       = the same (gradients reduced in fp32, as minipar does), minus what hides
               behind compute (``_exposed_dp``): stages 0-2 reduce during the last
               micro-batch's backward and all-gather the new weights after the step;
               ZeRO-3 gathers during each forward and gathers + reduce-scatters during
               each backward. Overlapped, NCCL gets only ``OVERLAP_BANDWIDTH`` of its
               calibrated bandwidth (compute kernels hold the SMs and memory) and what
               is left once compute ends runs at full bandwidth; ZeRO-3 leaves at least
               ``ZERO3_EXPOSED_SHARE`` of its seconds exposed
    ep       = a mixture of experts' all-to-all (dispatch and combine, forward and
               backward; ``theory.moe.all_to_all_bytes``), every call exposed, at the
               calibrated all-to-all pace, else the all-gather's link (the experts'
               gradients, reduced over their replicas, count with dp)
    cp       = the ring's time, exposed only when a rank's s / cp tokens are too few to
               hide a ring step (``theory.context.min_local_tokens_to_hide_ring``); an
               MoE layer's gather of the expert ids, always
    update   = the optimizer step over this rank's (ZeRO: sharded) parameters, when measured
    host     = what the host's kernel launches add where they take longer than the rest
               (``host_seconds``: a floor per layer pass, higher with tp, sp and cp, on a
               cluster whose host was measured with this engine)
    step     = compute + bubble + tp + ep + exposed cp + pp + exposed dp + update + host

A mixture-of-experts model also enumerates ep (dividing dp and the experts; its
compute counts the active weights, its memory E/ep experts per rank and, under sp, the
gathered sequence), and cp and sp as a dense one: ``comm_volume`` prices an MoE layer's
gathers there (the sequence under sp, in tp; the expert ids over cp, in cp).

Bandwidth per dimension comes from where its group lives: inside one node (NVLink) or
across nodes (network), read off the rank layout (``minipar.mesh.Mesh``). What it
leaves out: network contention between groups, the embedding, and, without a
calibration, the optimizer and kernel efficiency changing with matrix sizes. Use it to
rank and to reason, not to promise a number.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import cache, lru_cache

from minipar.mesh import Mesh
from minipar.model import GPTConfig
from minipar.parallel.fp8 import check_fp8, gemm_sizes
from minipar.parallel.schedules import SPLIT_BACKWARD, VIRTUAL_STAGES, check_schedule
from minipar.theory.bubble import partition_layers, pipeline_seconds
from minipar.theory.card import MEMORY_MARGIN, card_peak, host_fit
from minipar.theory.clusters import Cluster, check_fp8_card, get_cluster
from minipar.theory.comm_volume import comm_volume
from minipar.theory.context import min_local_tokens_to_hide_ring
from minipar.theory.layout import Layout
from minipar.theory.models import get_model
from minipar.theory.offload import offload_seconds
from minipar.theory.params import (
    head_layers_for,
    model_flops_per_token,
    stage_layers,
    stage_params,
    stage_recomputed_layers,
)
from minipar.theory.rates import call_seconds, chunk_seconds, optimizer_seconds

# The recomputation modes the search tries unless told (``plan --recompute-modes``).
# Cheap recomputation (``parallel/recompute.py``) redoes only the elementwise work between
# the products; its cost is ``rates.cheap_recompute_seconds``
RECOMPUTES = ("none", "selective", "cheap", "full")
RECOMPUTE_ORDER = {"none": 0, "cheap": 1, "selective": 2, "full": 3}  # by what they redo
# The rejection of a ZeRO-Offload layout whose host states do not fit the node
HOST_SHORT = "offload's host states exceed the node's memory"
TIME_KEYS = ("compute", "bubble", "tp", "ep", "cp", "pp", "dp", "offload", "update", "host")
# NCCL's share of its calibrated bandwidth while compute kernels run beside it: halved,
# as gpt-13b ZeRO-3 at micro-batches of 1 measured on 4 x H100 (its per-layer backward
# transfers then outlast the layer's backward; docs/benchmarks.md, the four-GPU results).
OVERLAP_BANDWIDTH = 0.5
# ZeRO-3 overlaps its per-unit gathers and reductions with compute, yet about half of
# their full-bandwidth seconds stays on the critical path: each unit's fp32
# reduce-scatter contends with the backward's kernels and waits for the slowest rank.
# Fitted to the gpt-6.7b and gpt-13b rows profiled on 4 x H100 (benchmarks/profile_train.py;
# docs/benchmarks.md, "The step model, after").
ZERO3_EXPOSED_SHARE = 0.55
# ZeRO-3 over a data-parallel group of one rank (pp or tp alone, to drop the 16-bit copy
# of the weights) still gathers and reduces every unit each micro-batch, as work in the
# GPU's own memory that no collective curve prices: the cast of the fp32 master into the
# unit's buffer and its copy onto itself (forward and backward), the gradient's scaling,
# copy and accumulation into the master's. Bytes per parameter and micro-batch at the
# data sheet's memory bandwidth, fitted to gpt-13b pp 4 dp 1 ZeRO-3 with full
# recomputation on H100 and H200 (docs/benchmarks.md, `planner.ZERO3_LOCAL_BYTES`).
ZERO3_LOCAL_BYTES = 32
# Layouts of one shape whose predicted steps differ by less than this share rank by
# memory (the spread of repeated measurements of one layout: ZeRO-1 against ZeRO-2 at
# one micro-batch size).
TIE_SHARE = 0.05
# The first layouts of a plan found exactly, partial recomputation's included (the plan
# command and the dashboards show at most this many).
EXACT_TOP = 20
# What a layer pass costs the host beyond an eager data-parallel one, in
# ``host_s_per_layer``s: tp's collectives and split kernels, sp's extra gathers and
# scatters, cp's ring (fitted to the host-bound rows of benchmarks/results/card-memory-*:
# gpt-1.3b tp 4 with and without sp, gpt-6.7b tp 4, gpt-1.3b dp 2 cp 2, and the
# calibration's isolated tp block with and without sp); a zero-bubble schedule's weight
# gradients, launched apart from the input gradients ("split"); the forward run again for
# a recomputed block ("full", times the share recomputed) or attention's core again
# ("selective", eager blocks). The last three are the ratios measured on one H100's host
# (host-bound blocks, eager), scaled as far down as the recorded four-GPU rows need:
# their base pass, fitted to data-parallel rows, is the heavier one (docs/benchmarks.md,
# `planner.HOST_LAYER_EXTRA`).
HOST_LAYER_EXTRA = {"tp": 0.47, "sp": 0.7, "cp": 1.5, "split": 0.3, "full": 0.6,
                    "selective": 0.3}
# A compiled block costs the host this many eager blocks' launches: its graphs (split at
# the fused linears) each check their guards and run an autograd node of their own.
# The low end of what one H100's host measured, which the recorded four-GPU compiled
# rows bound (docs/benchmarks.md, `planner.HOST_COMPILED_FACTOR`).
HOST_COMPILED_FACTOR = 1.5


@dataclass
class Estimate:
    """One layout with its memory (bytes), step time (seconds) and traffic (wire bytes
    per step, per dimension): what ``evaluate`` predicts."""

    layout: Layout
    memory: dict = field(default_factory=dict)
    time: dict = field(default_factory=dict)
    traffic: dict = field(default_factory=dict)
    mfu: float = 0.0
    fits: bool = True

    @property
    def step_time(self) -> float:
        return self.time.get("step", float("inf"))

    def to_dict(self) -> dict:
        return {**asdict(self.layout), "memory": self.memory, "time": self.time,
                "traffic": self.traffic, "mfu": self.mfu, "fits": self.fits,
                "step_time": self.step_time, "label": self.layout.label()}


@lru_cache(maxsize=4096)
def _group_spans_nodes(dp: int, pp: int, tp: int, dim: str, order: str,
                       gpus_per_node: int, cp: int = 1, ep: int = 1) -> bool:
    """Does rank 0's group along ``dim`` cross a node boundary? (All groups of one
    dimension have the same shape, so rank 0's answers for all.)"""
    mesh = Mesh(dp, pp, tp, order, cp=cp, ep=ep)
    special = {"ep": mesh.ep_ranks, "edp": mesh.edp_ranks}
    ranks = (mesh.dp_cp_ranks(0) if dim == "dp" and cp > 1 else special[dim](0)
             if dim in special else mesh.group_ranks(dim, 0))
    return len({r // gpus_per_node for r in ranks}) > 1


def _op_seconds(op: str, x: dict, cluster: Cluster, spans_nodes: bool, group: int,
                bytes_scale: float = 1.0) -> float:
    """One op's calls (payloads times ``bytes_scale``): inside a node with measured
    per-size times, each call at the bandwidth measured at its mean payload; else wire
    bytes over the bandwidth plus a latency per call."""
    each = x["calls"] and not spans_nodes and call_seconds(
        cluster.curves, op, bytes_scale * x["bytes"] / x["calls"], group)
    if each:
        return x["calls"] * each
    bandwidth, latency = cluster.link(op, spans_nodes)
    return bytes_scale * x["wire_bytes"] / bandwidth + x["calls"] * latency


def _comm_seconds(volume: dict, dim: str, cluster: Cluster, spans_nodes: bool,
                  group: int) -> float:
    return sum(_op_seconds(op, x, cluster, spans_nodes, group)
               for op, x in volume.get(dim, {}).items())


def evaluate(cfg: GPTConfig | str, cluster: Cluster | str, layout: Layout, *,
             matmul_efficiency: float = 0.7, memory_margin: float = MEMORY_MARGIN,
             accounting: str = "fused", overlap: bool = True) -> Estimate:
    """Memory and step-time estimate of ``layout`` on ``cluster`` (raises ValueError if
    it cannot be built at all: sizes that do not divide). Its global batch is dp x
    micro-batch size x micro-batches. ``memory`` is ``card.card_peak``: the busiest
    stage's ``memory_per_stage`` row plus what the card holds beyond the tensors
    (``reserved``, ``process``), as ``train``'s fit check prices it; ``fits`` says
    whether ``process`` stays under the GPU's memory less ``memory_margin`` of it.
    Experts split over ep ranks of dp have their all-to-all priced as the ``ep`` term,
    their gradients' reduction over their replicas (``edp``) with the data-parallel
    one."""
    cfg, cluster = get_model(cfg), get_cluster(cluster)
    if layout.gpus != cluster.gpus:
        raise ValueError(f"tp*pp*dp*cp = {layout.gpus} is not the cluster's "
                         f"{cluster.gpus} GPUs")
    if layout.sp and layout.tp == 1:
        layout = layout.with_(sp=False)  # sequence parallelism splits over the tp group
    tp, pp, dp, cp, ep, zero = (layout.tp, layout.pp, layout.dp, layout.cp, layout.ep,
                                layout.zero)
    m, virtual, recompute, dtype = (layout.microbatches, layout.virtual, layout.recompute,
                                    layout.dtype)
    global_batch = layout.global_batch
    mem, fits = card_fit(cfg, cluster, layout, memory_margin=memory_margin,
                         accounting=accounting)
    # the busiest rank for communication: a stage with both neighbours when pp > 2
    vol = comm_volume(cfg, layout, stage=min(1, pp - 1))
    vol["dp"] = vol.pop("dp_cp", vol.get("dp", {}))  # the gradient sums over dp x cp

    chunks = chunk_seconds(cfg, cluster, layout, matmul_efficiency)
    compute, step = pipeline_seconds(layout.schedule, pp, m, virtual, tuple(chunks))
    bubble = step - compute  # the busiest rank's idle time in the simulated schedule
    # pp: a send-recv pair; edp: an expert's replicas
    group = {"dp": dp * cp, "pp": 2, "tp": tp, "cp": cp, "ep": ep, "edp": dp * cp // ep}

    def spans(dim: str) -> bool:
        n = {"dp": dp * cp, "pp": pp, "tp": tp, "cp": cp, "ep": ep, "edp": dp * cp // ep}[dim]
        return n > 1 and _group_spans_nodes(dp, pp, tp, dim, layout.order,
                                            cluster.gpus_per_node, cp, ep)

    t = {d: _comm_seconds(vol, d, cluster, spans(d), group[d]) for d in ("tp", "ep", "cp", "pp")}
    fp32_grads = 2.0 if dtype == "bf16" else 1.0  # the volume counts 16-bit gradients
    dp_ops: dict[str, float] = {}  # the dense weights' over dp x cp, the experts' over edp
    for d in ("dp", "edp"):
        for op, x in vol.get(d, {}).items():
            dp_ops[op] = dp_ops.get(op, 0.0) + _op_seconds(
                op, x, cluster, spans(d), group[d],
                fp32_grads if op in ("all_reduce", "reduce_scatter") else 1.0)
    # the forwards a step runs per micro-batch: one, and again for each recomputed block
    forwards = 1.0 + (recompute == "full") * recomputed_share(cfg, layout)
    t["dp"] = _exposed_dp(dp_ops, compute, m, zero, forwards) if overlap else sum(dp_ops.values())
    if cp > 1:  # the ring hides behind the block compute once the local shard is long
        bw = cluster.link("send", spans("cp"))[0]
        e = 2 if dtype == "bf16" else 4
        if cfg.seq_len // cp >= min_local_tokens_to_hide_ring(cluster.matmul_rate, bw, e):
            # (an MoE layer's gather of the expert ids waits before its routing)
            ids = {"cp": {op: x for op, x in vol.get("cp", {}).items() if op == "all_gather"}}
            t["cp"] = _comm_seconds(ids, "cp", cluster, spans("cp"), cp)
    if zero == 3 and dp * cp == 1:  # its gathers and reductions are local copies
        t["dp"] += zero3_local_seconds(mem["n_params"], m, cluster)
    n, shards = mem["n_params"], dp * cp  # offload: the host steps (its own pricing)
    t["offload"] = offload_seconds(n, shards, zero, dtype, m, compute,
                                   cluster.host_adam_params_per_s) if layout.offload else 0.0
    t["update"] = update_seconds(cluster, layout, n)
    time = {"compute": compute, "bubble": bubble, **t, "host": 0.0}
    busy = sum(time[k] for k in TIME_KEYS)
    time["host"] = max(0.0, host_seconds(cfg, cluster, layout, busy) - busy)
    time["step"] = busy + time["host"]
    mfu = (model_flops_per_token(cfg) * global_batch * cfg.seq_len / time["step"]
           / (cluster.gpus * cluster.peak_flops))
    traffic = {d: sum(x["wire_bytes"] for x in vol.get(d, {}).values())
               for d in ("tp", "ep", "cp", "pp", "dp")}
    traffic["dp"] += sum(x["wire_bytes"] for x in vol.get("edp", {}).values())
    return Estimate(layout, memory=mem, time=time, traffic=traffic, mfu=mfu, fits=fits)


def stage_compute(cfg: GPTConfig | str, cluster: Cluster | str, layout: Layout,
                  stage: int = 0, matmul_efficiency: float = 0.7) -> float:
    """Seconds a rank of pipeline ``stage`` computes a step, as ``evaluate`` prices it:
    its chunks over the micro-batches (``rates.chunk_seconds``) and its optimizer step,
    with no communication and no bubble: what a rehearsed rank measures alone
    (``engine.rehearse``'s ``compute_seconds``)."""
    cfg, cluster = get_model(cfg), get_cluster(cluster)
    chunks = chunk_seconds(cfg, cluster, layout, matmul_efficiency)
    held = stage_params(cfg, layout.pp, layout.tp, stage, layout.virtual, layout.head_layers,
                        layout.ep)
    return sum(chunks[stage::layout.pp]) * layout.microbatches + update_seconds(
        cluster, layout, held)


def update_seconds(cluster: Cluster, layout: Layout, n_params: int) -> float:
    """The optimizer step of a rank holding ``n_params`` (its shard over dp x cp under
    ZeRO), on the GPU; 0 under ZeRO-Offload, whose host steps (``offload_seconds``)."""
    return 0.0 if layout.offload else optimizer_seconds(
        cluster, n_params, layout.dp * layout.cp, layout.zero)


def card_fit(cfg: GPTConfig, cluster: Cluster, layout: Layout, *,
             memory_margin: float = MEMORY_MARGIN, accounting: str = "fused",
             **_: object) -> tuple[dict, bool]:
    """(``card.card_peak`` of ``layout``, whether its ``process`` bytes stay under the
    GPU's memory less ``memory_margin`` of it and, under offload, its host states under
    the node's: ``card.host_fit``): ``evaluate``'s memory and fit test. Other
    ``evaluate`` settings are accepted and ignored."""
    mem = card_peak(cfg, layout, accounting=accounting)
    fits = mem["process"] <= (1 - memory_margin) * cluster.gpu_memory
    if layout.offload:
        fits = fits and host_fit(mem["host"], cluster.gpus_per_node, cluster.host_memory)
    return mem, fits


def zero3_local_seconds(n_params: int, microbatches: int, cluster: Cluster) -> float:
    """ZeRO-3 over one rank: ``ZERO3_LOCAL_BYTES`` a parameter and micro-batch through
    the GPU's memory (0 where its bandwidth is not known)."""
    bandwidth = cluster.gpu.memory_bandwidth
    return n_params * microbatches * ZERO3_LOCAL_BYTES / bandwidth if bandwidth else 0.0


def host_seconds(cfg: GPTConfig, cluster: Cluster, layout: Layout, busy: float = 0.0) -> float:
    """The least a step takes when the host launches every kernel: each chunk's layers at
    the host's measured seconds per layer, more with tensor parallelism's, sp's and cp's
    extra launches, a split backward's and recomputation's (``HOST_LAYER_EXTRA``), and
    compiled blocks' (``HOST_COMPILED_FACTOR``), run through the schedule like the GPU's work
    (a pipeline's stages wait for each other's launches as for their kernels: with one
    micro-batch, pp stages launch one after another); 0 where the host was not measured.
    A collective waits for every rank's host only while the host is behind the GPU: the
    step is the larger of this and the GPU's work, never their sum, and the collectives
    keep their calibrated seconds. Where even every micro-batch's launches stage after
    stage, (m + p - 1) of the slowest stage's, stay under ``busy`` (the GPU's step), that
    bound is returned and the schedule is not simulated."""
    if not cluster.host_s_per_layer:
        return 0.0
    extra = HOST_LAYER_EXTRA
    # recomputation's launches: the forward again for each recomputed block, or attention's
    # core again (selective; a compiled block runs it inside its graphs: no launch more)
    if layout.recompute == "full":
        redone = extra["full"] * recomputed_share(cfg, layout)
    elif layout.recompute == "selective" and not layout.compiled:
        redone = extra["selective"]
    else:
        redone = 0.0
    per_layer = cluster.host_s_per_layer * (
        1.0 + (layout.tp > 1) * extra["tp"] + layout.sp * extra["sp"]
        + (layout.cp > 1) * extra["cp"] + (layout.schedule in SPLIT_BACKWARD) * extra["split"]
        + redone) * (HOST_COMPILED_FACTOR if layout.compiled else 1.0)
    chunks = tuple(len(layers) * per_layer for layers in partition_layers(
        cfg.n_layer, layout.pp * layout.virtual, layout.head_layers))
    pp, m = layout.pp, layout.microbatches
    slowest = max(sum(chunks[r::pp]) for r in range(pp))
    if (m + pp - 1) * slowest <= busy:  # under the GPU's step even launched stage by stage
        return (m + pp - 1) * slowest
    return pipeline_seconds(layout.schedule, pp, m, layout.virtual, chunks)[1]


def recomputed_share(cfg: GPTConfig, layout: Layout) -> float:
    """The share of the busiest stage's blocks that recompute (``recompute_layers`` N: the
    first N of each chunk; else all of them)."""
    if layout.recompute_layers is None:
        return 1.0
    redone, _ = stage_recomputed_layers(cfg, layout.pp, 0, layout.virtual,
                                        layout.head_layers, layout.recompute_layers)
    return redone / stage_layers(cfg.n_layer, layout.pp, 0, layout.virtual, layout.head_layers)


def _exposed_dp(seconds: dict[str, float], compute: float, m: int, zero: int,
                forwards: float) -> float:
    """Data-parallel seconds left on the critical path, from each op's seconds at full
    bandwidth. A forward is one of the compute's 2 + ``forwards`` parts (a backward is
    two; full recomputation runs a block's forward twice); while it overlaps compute a
    transfer runs at ``OVERLAP_BANDWIDTH``, what is left after at full bandwidth."""
    forward = compute / (2 + forwards)
    backward = compute - forward
    reduce = seconds.get("all_reduce", 0.0) + seconds.get("reduce_scatter", 0.0)
    gather = seconds.get("all_gather", 0.0)
    slow = 1 / OVERLAP_BANDWIDTH
    if zero == 3:  # half the gathers in forwards, half (+ every reduction) in backwards
        hidden = (max(0.0, gather / 2 - forward / slow)
                  + max(0.0, (gather / 2 + reduce) - backward / slow))
        return max(hidden, ZERO3_EXPOSED_SHARE * (gather + reduce))
    # the last micro-batch's backward hides the reduction, the next step's first forward
    # ZeRO-1/2's weight gather (zero/param_gather.py): slowed while they overlap, then whole
    return max(0.0, reduce * slow - backward / m) + max(0.0, gather - forward / m / slow)


@dataclass
class Plan:
    """Ranked feasible layouts (fastest first), and what was rejected and why."""

    model: GPTConfig
    cluster: Cluster
    global_batch: int
    layouts: list[Estimate]
    rejected: Counter
    examples: dict[str, str]
    smallest_misfit: Estimate | None = None
    fp8: str | None = None  # every layout's float8 recipe (``plan(fp8=...)``)

    def __len__(self) -> int:
        return len(self.layouts)

    def __iter__(self):
        return iter(self.layouts)

    def __getitem__(self, i):
        return self.layouts[i]

    @property
    def best(self) -> Estimate | None:
        return self.layouts[0] if self.layouts else None

    @property
    def time_keys(self) -> tuple[str, ...]:
        """The step-time terms to show: ``TIME_KEYS``, ``ep`` only when a layout has it."""
        return tuple(k for k in TIME_KEYS if k != "ep" or any(x.layout.ep > 1 for x in self))

    def why(self) -> str:
        """A short text: the winner, its time budget, and why the alternatives lose."""
        return explain(self)


def _powers_of_two(limit: int) -> list[int]:
    return [2**k for k in range(limit.bit_length())]  # 1, 2, 4, ... <= limit


def plan(cfg: GPTConfig | str, cluster: Cluster | str, global_batch: int | None = None,
         *, zero_stages: tuple[int, ...] = (0, 1, 2, 3),
         recomputes: tuple[str, ...] = RECOMPUTES,
         schedules: tuple[str, ...] = ("1f1b", "interleaved", "zb", "interleaved-zb"),
         max_microbatch_size: int = 8, sp: bool = True, min_cp_tokens: int = 4096,
         offload: bool = False, dtype: str = "bf16", optimizer: str = "adam",
         optimizer_kernel: str = "fused", order: str = "megatron",
         degrees: dict[str, int] | None = None, separate_reduce_group: bool = False,
         fp8: str | None = None, **settings) -> Plan:
    """Enumerate, filter and rank the layouts of ``cfg`` on ``cluster``.

    Rejected (and counted by reason): tp above the GPUs of one node (its collectives
    would cross the network every layer), tp not dividing heads / FFN / vocabulary,
    pp not dividing the layers, a batch that does not split over dp, and layouts that
    do not fit in memory. ``sp=True`` turns on sequence parallelism wherever tp > 1
    (same traffic, less memory). Context parallelism: cp = 2, 4, ... while each rank
    keeps at least ``min_cp_tokens`` tokens of a sequence (seq_len / cp; below that
    the ring cannot hide behind the blocks' compute), within a node with tp.
    ``offload=True``: a layout that does not fit is tried again with ZeRO-Offload.
    A mixture-of-experts model: also every ep (a power of two dividing dp and the
    experts).
    Every layout trains in ``dtype`` with ``optimizer`` stepped by ``optimizer_kernel``
    (torch's fused kernel, the CUDA default; ZeRO-Offload's on the host), its ranks in
    ``order``; ``degrees`` keeps only the layouts with these degrees (``{"pp": 4}``:
    the best pipelines of four stages; keys dp, pp, tp, cp);
    ``separate_reduce_group``: ZeRO-3 over more than one rank reduces on a communicator
    of its own (its buffers counted; its step priced as the shared one's);
    ``fp8`` ("rowwise" or "tensorwise"): every layout's blocks multiply their linears in
    float8, as ``train --fp8`` runs them (a card without float8 matmuls: ValueError,
    before any layout); tensor parallelism runs without sp, and a layout ``train`` would
    refuse (``parallel.fp8.check_fp8``: GEMM sizes, cheap recomputation under tensorwise)
    is rejected under its line;
    ``settings`` go to ``evaluate`` (matmul_efficiency, memory_margin, accounting,
    overlap).
    """
    cfg, cluster = get_model(cfg), get_cluster(cluster)
    if fp8 is not None:  # what holds for every layout: the card, the recipe, the dtype
        check_fp8_card(cluster)
        check_fp8(fp8, emulate=False, device=None, dtype=dtype, sequence_parallel=False,
                  sizes={})
    gpus = cluster.gpus
    fixed = dict(degrees or {})
    unknown = set(fixed) - {"dp", "pp", "tp", "cp"}
    if unknown:
        raise ValueError(f"degrees: {sorted(unknown)} are not dp, pp, tp or cp")

    shapes = 0  # (tp, pp, cp, dp) that divide the GPUs and the model, with ``degrees``

    def allowed(**dims: int) -> bool:
        return all(fixed.get(name, n) == n for name, n in dims.items())
    global_batch = gpus if global_batch is None else global_batch
    rejected: Counter = Counter()
    examples: dict[str, str] = {}
    layouts: list[Estimate] = []
    smallest: Estimate | None = None
    # (recomputing no block, recomputing all) of a layout that fits only with the latter
    partial_candidates: list[tuple[Estimate, Estimate]] = []

    def reject(reason: str, example: str) -> None:
        rejected[reason] += 1
        examples.setdefault(reason, example)

    def keep(est: Estimate) -> None:
        """A layout that fits joins the ranking; one that does not is counted (and the
        smallest such remembered, for the message when nothing fits)."""
        nonlocal smallest
        if est.fits:
            layouts.append(est)
        elif est.layout.offload and not host_fit(est.memory["host"], cluster.gpus_per_node,
                                                 cluster.host_memory):
            reject(HOST_SHORT, f"{est.layout.label()}: {est.memory['host'] / 2**30:.0f} GiB a "
                               f"rank x {cluster.gpus_per_node}")
        else:
            reject("does not fit in memory", est.layout.label())
            if smallest is None or est.memory["process"] < smallest.memory["process"]:
                smallest = est

    for tp in _powers_of_two(min(gpus, 64)):
        if gpus % tp or not allowed(tp=tp):
            continue
        if tp > cluster.gpus_per_node:
            reject("tp larger than a node", f"tp={tp} > {cluster.gpus_per_node} GPUs per node")
            continue
        bad = [n for n in ("n_head", "d_ff", "vocab_size") if getattr(cfg, n) % tp]
        if bad:
            reject("tp does not divide the model", f"tp={tp} does not divide {bad[0]}="
                   f"{getattr(cfg, bad[0])}")
            continue
        cps = [c for c in _powers_of_two(gpus // tp) if c == 1 or (
            cfg.seq_len % (2 * c) == 0 and cfg.seq_len // c >= min_cp_tokens
            and tp * c <= cluster.gpus_per_node)]
        for pp, cp in ((p, c) for c in cps for p in range(1, cfg.n_layer + 1)):
            if (gpus // (tp * cp)) % pp or not allowed(
                    pp=pp, cp=cp, dp=gpus // (tp * cp) // pp):
                continue
            if cfg.n_layer % pp:
                if cp == 1:
                    reject("pp does not divide the layers", f"pp={pp}, {cfg.n_layer} layers")
                continue
            dp = gpus // (tp * pp * cp)
            shapes += 1
            if global_batch % dp:
                reject("batch does not split over dp", f"batch {global_batch}, dp={dp}")
                continue
            local = global_batch // dp
            for b in _powers_of_two(min(max_microbatch_size, local)):
                if local % b:
                    continue
                m = local // b
                for schedule, v in _schedules(schedules, cfg, pp, m):
                    for zero in zero_stages:
                        if refused := _refusal(schedule, pp, m, v, zero, "none"):
                            reject(refused, f"zero={zero} with {schedule}, pp={pp}")
                            continue
                        if zero in (1, 2) and dp * cp == 1:  # shards of one: ZeRO-0
                            reject("ZeRO-1/2 over one rank is ZeRO-0", f"zero={zero}, dp=1")
                            continue
                        for ep in _eps(cfg, dp):
                            # "none" first: a layout that fits only recomputing every
                            # block is paired with its twin recomputing none (below)
                            kept: Estimate | None = None  # that twin, of this ep
                            for rc in sorted(recomputes, key=RECOMPUTE_ORDER.__getitem__):
                                if refused := _refusal(schedule, pp, m, v, zero, rc):
                                    reject(refused, f"recompute={rc} with {schedule}, pp={pp}")
                                    continue
                                # pp: stages balanced for the head (interleaved: the
                                # last chunk, whose rank runs the head)
                                k = head_layers_for(cfg, rc) if pp > 1 else 0
                                lay = Layout(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep, zero=zero,
                                             microbatch_size=b, microbatches=m,
                                             schedule=schedule, virtual=v, head_layers=k,
                                             sp=sp and tp > 1, recompute=rc, dtype=dtype,
                                             optimizer=optimizer,
                                             optimizer_kernel=optimizer_kernel, order=order,
                                             separate_reduce_group=separate_reduce_group
                                             and zero == 3 and dp * cp > 1, fp8=fp8)
                                lay = as_run(lay)
                                if fp8 is not None:
                                    lay = lay.with_(sp=False)  # float8 refuses sp
                                    if refused := fp8_refusal(cfg, lay):
                                        reject(refused, lay.label())
                                        continue
                                est = _priced(cfg, cluster, lay, offload, settings)
                                if rc == "none":
                                    kept = est
                                elif rc == "full" and est.fits and kept and not kept.fits:
                                    partial_candidates.append((kept, est))
                                if not est.fits and offload:
                                    est = evaluate(cfg, cluster, lay.with_(
                                        offload=True, optimizer_kernel="host"), **settings)
                                keep(est)
    if fixed and not shapes:
        asked = ", ".join(f"{k}={v}" for k, v in fixed.items())
        raise ValueError(f"no layout of {gpus} GPUs has {asked}: dp x pp x tp x cp must "
                         f"make {gpus}, pp divide the {cfg.n_layer} layers, tp the heads, "
                         f"FFN and vocabulary; tp and cp are powers of two, tp x cp within "
                         f"a node of {cluster.gpus_per_node}, and cp leaves each rank "
                         f"{min_cp_tokens} or more of the {cfg.seq_len} tokens of a sequence "
                         f"(in 2*cp equal chunks)")
    rests = ("none", "cheap") if "cheap" in recomputes else ("none",)
    layouts += _partial_recomputation(cfg, cluster, partial_candidates, layouts, settings,
                                      rests)
    idle = {id(est): est for est in _idle_recomputation(layouts)}
    for est in idle.values():
        reject("recomputation saves no memory", est.layout.label())
    layouts = [est for est in layouts if id(est) not in idle]
    layouts.sort(key=lambda x: (x.step_time, sum(x.traffic.values()), x.memory["process"]))
    return Plan(cfg, cluster, global_batch, _ties_by_memory(layouts), rejected, examples,
                smallest, fp8)



def as_run(layout: Layout) -> Layout:
    """``layout`` as ``train`` runs the command ``plan`` prints for it on a GPU: its blocks
    compiled where that is the default (``Layout.compiled_by_default``)."""
    return layout.with_(compiled=layout.compiled_by_default())


def _priced(cfg: GPTConfig, cluster: Cluster, layout: Layout, offload: bool,
            settings: dict) -> Estimate:
    """``layout`` priced, the memory first: one that recomputes something and does not fit
    is not priced (``fits`` False, its memory only). One recomputing nothing always is:
    partial recomputation interpolates from its step. Under ``offload`` every layout is
    priced, since the plan retries what does not fit with ZeRO-Offload. Where the host
    sets a compiled layout's step, its eager twin (``--no-compile``) launches less and is
    priced instead."""
    if layout.recompute != "none" and not offload:
        memory, fits = card_fit(cfg, cluster, layout, **settings)
        if not fits:
            return Estimate(layout, memory=memory, fits=False)
    est = evaluate(cfg, cluster, layout, **settings)
    if layout.compiled and est.time["host"] > 0:
        eager = evaluate(cfg, cluster, layout.with_(compiled=False), **settings)
        est = eager if eager.step_time < est.step_time else est
    return est


def _partial_recomputation(cfg: GPTConfig, cluster: Cluster,
                           candidates: list[tuple[Estimate, Estimate]],
                           layouts: list[Estimate], settings: dict,
                           rests: tuple[str, ...] = ("none",)) -> list[Estimate]:
    """For each candidate (the layout recomputing no block, which does not fit, and the
    same recomputing all, which does) and each way the other blocks may go (``rests``:
    keep everything, or recompute cheaply), the fewest recomputed blocks that fit
    (``fewest_recomputed``), priced where it may rank among the first ``EXACT_TOP``
    layouts: its step lies between the two, about linearly in the share of blocks
    recomputed, and one whose so interpolated step is slower than the ``EXACT_TOP``-th
    layout found (with ``TIE_SHARE`` to spare) is not priced. A plan's top is exact; its
    tail may lack them."""
    steps = sorted(est.step_time for est in layouts)
    found: list[Estimate] = []
    for (kept, full), rest in itertools.product(
            sorted(candidates, key=lambda c: c[0].step_time), rests):
        if fp8_refusal(cfg, full.layout.with_(recompute_rest=rest)):
            continue  # (float8's rules, counted where the search met them)
        n = fewest_recomputed(cfg, cluster, full.layout.with_(recompute_rest=rest), settings)
        if n is None:
            continue
        lay = as_run(full.layout.with_(recompute_layers=n, recompute_rest=rest))
        guess = kept.step_time + (full.step_time - kept.step_time) * recomputed_share(cfg, lay)
        if len(steps) >= EXACT_TOP and guess > steps[EXACT_TOP - 1] * (1 + TIE_SHARE):
            continue
        est = evaluate(cfg, cluster, lay, **settings)
        found.append(est)
        bisect.insort(steps, est.step_time)
    return found


def fewest_recomputed(cfg: GPTConfig, cluster: Cluster, full: Layout,
                      settings: dict) -> int | None:
    """Partial recomputation (Megatron's ``--recompute-num-layers``; Korthikanti et al.
    2022, arXiv 2205.05198) for a layout that fits with every block recomputed and not
    with none: the fewest recomputed blocks, the first N of each chunk, that still fit
    (None: not one fewer than all). Bisection on N, on the memory alone (``evaluate``'s
    fit test): the memory only grows as N falls, and the step only shortens."""
    longest = max(len(c) for c in partition_layers(cfg.n_layer, full.pp * full.virtual,
                                                   full.head_layers))
    best, low, high = None, 1, longest - 1
    while low <= high:
        n = (low + high) // 2
        if card_fit(cfg, cluster, full.with_(recompute_layers=n), **settings)[1]:
            best, high = n, n - 1
        else:
            low = n + 1
    return best


def _idle_recomputation(layouts: list[Estimate]) -> list[Estimate]:
    """The layouts whose recomputation buys nothing: the same layout recomputing less
    (its stages balanced for that) fits in no more memory and is no slower. Selective
    recomputation under a fused attention kernel is the usual case: the kernel keeps no
    score matrix, so recomputing attention frees nothing and costs its time."""
    def without_recompute(est: Estimate) -> Layout:
        return est.layout.with_(recompute="none", recompute_layers=None,
                                recompute_rest="none", head_layers=0, compiled=False)
    same: dict[Layout, list[Estimate]] = {}
    for est in layouts:
        same.setdefault(without_recompute(est), []).append(est)
    return [est for est in layouts if any(
        RECOMPUTE_ORDER[x.layout.recompute] < RECOMPUTE_ORDER[est.layout.recompute]
        and x.memory["process"] <= est.memory["process"] and x.step_time <= est.step_time
        for x in same[without_recompute(est)])]


def fp8_refusal(cfg: GPTConfig, layout: Layout) -> str | None:
    """Why ``train`` would refuse ``layout``'s float8 on a GPU that has float8 matmuls
    (``parallel.fp8.check_fp8``'s line, the check ``train`` runs), or None."""
    if layout.fp8 is None:
        return None
    tokens = layout.microbatch_size * cfg.seq_len // layout.cp  # a rank's micro-batch
    return _fp8_refusal(cfg, layout.fp8, layout.dtype, layout.sp, layout.tp, tokens,
                        layout.cheap_recompute)


@cache
def _fp8_refusal(cfg: GPTConfig, recipe: str, dtype: str, sp: bool, tp: int, tokens: int,
                 cheap: bool) -> str | None:
    try:
        check_fp8(recipe, emulate=False, device=None, dtype=dtype, sequence_parallel=sp,
                  sizes=gemm_sizes(cfg, tp, tokens), cheap_recompute=cheap)
    except ValueError as e:
        return str(e)
    return None


@cache
def _refusal(schedule: str, pp: int, microbatches: int, virtual: int, zero: int,
             recompute: str) -> str | None:
    """Why ``train`` would refuse the schedule with these settings (``check_schedule``'s
    line), or None."""
    try:
        check_schedule(schedule, pp, microbatches, virtual, zero=zero, recompute=recompute)
    except ValueError as e:
        return str(e)
    return None


def _ties_by_memory(layouts: list[Estimate]) -> list[Estimate]:
    """Layouts sorted by time, but a layout of the same shape as a faster one (the same
    sizes, schedule and micro-batches; ZeRO stage, recomputation or sp apart) that holds
    less memory and lies within ``TIE_SHARE`` of its time goes first: a prediction cannot
    tell them apart, and the one with room to spare is the safer answer."""
    by_shape: dict[tuple, list[Estimate]] = {}
    for lay in layouts:
        by_shape.setdefault(_shape(lay), []).append(lay)
    out, placed = [], set()
    for lay in layouts:
        if id(lay) in placed:
            continue
        tied = [lay] + [x for x in by_shape[_shape(lay)] if id(x) not in placed
                        and x is not lay and x.memory["process"] < lay.memory["process"]
                        and x.step_time <= lay.step_time * (1 + TIE_SHARE)]
        tied.sort(key=lambda x: (x.memory["process"], x.step_time))
        out += tied
        placed.update(id(x) for x in tied)
    return out


def _shape(est: Estimate) -> tuple:
    """What a tie keeps equal; the head layers follow the recomputation (a pipeline's
    stages are balanced for it, ``head_layers_for``), so they may differ."""
    lay = est.layout
    return (lay.tp, lay.pp, lay.dp, lay.cp, lay.ep, lay.microbatch_size, lay.schedule,
            lay.virtual, lay.offload)


def _eps(cfg: GPTConfig, dp: int) -> list[int]:
    """The expert-parallel sizes worth trying: 1, and for an MoE model each power of two
    dividing dp and the experts."""
    if not cfg.n_expert:
        return [1]
    return [e for e in _powers_of_two(dp) if cfg.n_expert % e == 0]


def _schedules(names: tuple[str, ...], cfg: GPTConfig, pp: int, m: int):
    """(schedule, virtual) pairs worth trying for this pp and m."""
    if pp == 1:
        yield "1f1b", 1  # no pipeline: m is plain gradient accumulation
        return
    for name in names:
        if name in VIRTUAL_STAGES:
            if m % pp == 0 and cfg.n_layer % (2 * pp) == 0:
                yield name, 2
        else:
            yield name, 1


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f} GiB"


def against_bf16(float8: Plan, bf16: Plan) -> str:
    """One line: what float8 buys, the best layout of a float8 plan against the best of
    the same search in bf16 (``bf16``: ``plan`` without ``fp8``), as a speed ratio."""
    recipe = f"float8 {float8.fp8}"
    if bf16.best is None:
        return (f"{recipe}: no bf16 layout fits; float8 does" if float8.best
                else f"{recipe}: neither float8 nor bf16 fits")
    base = bf16.best
    named = f"the best bf16 layout ({base.layout.label()}, {base.step_time:.3g} s a step)"
    if float8.best is None:
        return f"{recipe}: no layout fits; {named} does"
    speed = base.step_time / float8.best.step_time
    verdict = "; bf16 is faster here: drop --fp8" if speed < 1 else ""
    return f"{recipe}: {speed:.2f}x the speed of {named}{verdict}"


def explain(result: Plan) -> str:
    """Why the best layout wins: its budget, what could not fit, what is slower and by
    which term of the step time."""
    if not result.layouts:
        lines = [f"No layout of this model fits on {result.cluster.describe()}."]
        if result.smallest_misfit is not None:
            s = result.smallest_misfit
            lines.append(f"The smallest needs {_gib(s.memory['process'])} per GPU "
                         f"({s.layout.label()}).")
        lines += [f"  rejected, {r}: {n} (e.g. {result.examples[r]})"
                  for r, n in result.rejected.most_common()]
        return "\n".join(lines)
    best = result.best
    t = best.time
    lines = [
        f"Best: {best.layout.label()}",
        f"  {t['step']:.3g} s per step, estimated MFU {best.mfu:.0%}, "
        f"{_gib(best.memory['process'])} of {_gib(result.cluster.gpu_memory)} per GPU.",
        "  step = " + " + ".join(f"{k} {t[k]:.3g}" for k in result.time_keys) + " s",
    ]
    for reason, n in result.rejected.most_common():
        lines.append(f"  Rejected {n} layout{'s' if n != 1 else ''}: {reason} "
                     f"(e.g. {result.examples[reason]}).")

    def shape(x: Estimate) -> tuple[int, int]:
        return x.layout.tp, x.layout.pp

    # the best layout of each other (tp, pp) shape, and what makes it slower
    seen = {shape(best)}
    for est in result.layouts[1:]:
        if shape(est) in seen:
            continue
        seen.add(shape(est))
        worst = max(result.time_keys, key=lambda k: est.time[k] - best.time[k])
        lines.append(f"  vs {est.layout.label()}: {est.step_time / best.step_time - 1:+.1%} "
                     f"time, mostly {worst} ({est.time[worst]:.3g} s vs "
                     f"{best.time[worst]:.3g} s).")
        if len(seen) > 3:
            break
    same = [x for x in result.layouts[1:] if shape(x) == shape(best)]
    if same:
        nxt = same[0]
        lines.append(f"  Same shape, next best: {nxt.layout.label()} "
                     f"({nxt.step_time / best.step_time - 1:+.1%}).")
    return "\n".join(lines)
