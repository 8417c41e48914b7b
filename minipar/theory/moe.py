"""Mixture of experts: parameters (total and active), FLOPs, memory with experts split by
ep, all-to-all bytes, and the tokens a capacity factor drops.

An MoE layer (``minipar.model.MoE``, h = d_model, g = an expert's hidden size, E
experts, top-k) replaces the dense MLP (2hf + f + h parameters) by a router (hE) and E
expert MLPs (2hg + g + h each): every token *uses* the router and k experts only. So a
model's total parameters grow with E, its FLOPs per token with k (Switch Transformer,
Fedus et al. 2021, arXiv 2101.03961, Sec. 2; GShard, Lepikhin et al. 2020, arXiv
2006.16668). Expert parallelism (``parallel/ep.py``) splits each layer's experts over ep
ranks of dp: dense states are ZeRO-sharded over dp, expert states over dp/ep (their
replicas). Each MoE layer moves every routed row out and back by all-to-all, forward
and backward. Capacity: expert i takes at most C = ceil(c k s / E) of a sequence's
assignments; with independent tokens its load is Binomial(s, k p_i) (p_i its share of
the assignments), and what exceeds C is dropped.
"""

from __future__ import annotations

import math
from functools import cache

from minipar.model import GPTConfig
from minipar.theory.memory import model_states
from minipar.theory.models import get_model
from minipar.theory.params import model_flops_per_token, param_count

COUNT_BYTES = 8  # the row counts exchanged before each dispatch (int64, one per expert)


def _dense(cfg: GPTConfig) -> GPTConfig:
    return cfg.with_(n_expert=0)


def moe_params(cfg: GPTConfig | str) -> dict[str, int]:
    """Parameters: ``total`` (= ``GPT(cfg).num_params()``), ``active`` (what one token
    uses: the router and k experts of each MoE layer), ``experts`` (all expert weights,
    the part ep splits) and ``dense`` (the rest, replicated over dp)."""
    cfg = get_model(cfg)
    h, f, g, e, k = cfg.d_model, cfg.d_ff, cfg.expert_d_ff, cfg.n_expert, cfg.moe_top_k
    base = param_count(_dense(cfg))
    n_moe = cfg.n_moe_layers
    mlp, expert = 2 * h * f + f + h, 2 * h * g + g + h
    experts = n_moe * e * expert
    dense = base - n_moe * mlp + n_moe * h * e  # the routers are dense weights
    return {"total": dense + experts, "active": dense + n_moe * k * expert,
            "experts": experts, "dense": dense}


def moe_flops_per_token(cfg: GPTConfig | str) -> float:
    """Training FLOPs per token (forward + backward, 6 per active matmul weight, PaLM's
    count as ``params.model_flops_per_token``): the router and k experts per MoE layer
    instead of the dense MLP. The numerator of an MoE run's MFU."""
    cfg = get_model(cfg)
    h, f, g, e, k = cfg.d_model, cfg.d_ff, cfg.expert_d_ff, cfg.n_expert, cfg.moe_top_k
    n_moe = cfg.n_moe_layers
    return (model_flops_per_token(_dense(cfg))
            + 6.0 * n_moe * (k * 2 * h * g + h * e - 2 * h * f))


def moe_model_states(cfg: GPTConfig | str, dp: int = 1, ep: int = 1, zero: int = 0,
                     dtype: str = "bf16", optimizer: str = "adam") -> dict[str, int]:
    """Bytes of weights, gradients and optimizer state per rank (pp = tp = 1): the dense
    part as ``memory.model_states`` over dp, this rank's E/ep experts over their dp/ep
    replicas (ZeRO shards each group's states over its own ranks)."""
    if dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp}")
    p = moe_params(cfg)
    dense = model_states(p["dense"], dp, zero, dtype, optimizer)
    experts = model_states(p["experts"] // ep, dp // ep, zero, dtype, optimizer)
    return {k: dense[k] + experts[k] for k in dense}


def all_to_all_bytes(cfg: GPTConfig | str, tokens: int, ep: int, dtype: str = "bf16",
                     kept: float = 1.0, recompute: bool = False,
                     microbatches: int = 1, layers: int | None = None) -> dict[str, float]:
    """All-to-all bytes one rank sends in a step that routes ``tokens`` of its own, in
    ``microbatches`` forwards, through ``layers`` MoE layers (None: all the model's).

    Per MoE layer and micro-batch: the row counts (E integers), then four exchanges of
    the routed rows
    (h values each, k rows a token times the share ``kept`` that is not dropped):
    dispatch and combine in the forward, their gradients in the backward (``recompute``:
    the forward's two again). ``bytes`` is the payload (``CommLog``'s ``bytes``: exact
    summed over an ep group, whose ranks send what they receive); ``wire_bytes`` the
    share leaving the rank under uniform routing, (ep - 1) / ep of it."""
    cfg = get_model(cfg)
    if ep == 1:
        return {"calls": 0, "bytes": 0.0, "wire_bytes": 0.0}
    width = {"bf16": 2, "fp32": 4}[dtype]
    rows = tokens * cfg.moe_top_k * kept
    forwards = 2 if recompute else 1
    exchanges = 2 * forwards + 2
    counts = microbatches * forwards * cfg.n_expert * COUNT_BYTES
    layers = cfg.n_moe_layers if layers is None else layers
    payload = layers * (exchanges * rows * cfg.d_model * width + counts)
    calls = layers * microbatches * (exchanges + forwards)
    return {"calls": calls, "bytes": payload,
            "wire_bytes": payload * (ep - 1) / ep}


@cache
def kept_share(cfg: GPTConfig) -> float:
    """The expected share of the k s assignments an expert keeps under uniform routing,
    1 - ``dropped_share`` (cached: the planner asks once per layout)."""
    return 1.0 - dropped_share(cfg)


def capacity(cfg: GPTConfig | str) -> int:
    """Slots per expert per sequence, ceil(c k s / E) (0: dropless)."""
    cfg = get_model(cfg)
    if cfg.capacity_factor <= 0:
        return 0
    return math.ceil(cfg.capacity_factor * cfg.moe_top_k * cfg.seq_len / cfg.n_expert)


def dropped_share(cfg: GPTConfig | str, load: list[float] | None = None) -> float:
    """Expected share of the k s assignments of a sequence that the capacity drops.

    ``load``: each expert's share of the assignments (sums to 1; None: uniform, 1/E).
    Tokens route independently, so expert i's load is Binomial(s, k load_i) (it is one
    of a token's k distinct choices with that probability) and it drops
    E[max(0, L_i - C)] of them."""
    cfg = get_model(cfg)
    cap, s, k, e = capacity(cfg), cfg.seq_len, cfg.moe_top_k, cfg.n_expert
    if cap == 0:
        return 0.0
    load = [1.0 / e] * e if load is None else list(load)
    if len(load) != e or abs(sum(load) - 1.0) > 1e-6 or min(load) < 0:
        raise ValueError(f"load must be {e} non-negative shares summing to 1")
    dropped = 0.0
    for share in load:
        q = min(1.0, k * share)
        if q >= 1.0 or q <= 0.0:  # always or never chosen
            dropped += max(0, s - cap) if q >= 1.0 else 0.0
            continue
        dropped += sum((n - cap) * _binomial_pmf(s, n, q) for n in range(cap + 1, s + 1))
    return dropped / (k * s)


def _binomial_pmf(s: int, n: int, q: float) -> float:
    """P(Binomial(s, q) = n), in logs (C(2048, 1024) overflows a float)."""
    return math.exp(math.lgamma(s + 1) - math.lgamma(n + 1) - math.lgamma(s - n + 1)
                    + n * math.log(q) + (s - n) * math.log1p(-q))
