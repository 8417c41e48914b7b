"""The single-device GPT: the reference every parallel layout must reproduce.

This file knows nothing of parallelism. Tensor, pipeline and data parallelism are
applied from outside (``minipar.parallel``), by replacing submodules following a plan,
giving each pipeline stage its own layers, or wrapping the whole module, the way
torchtitan's ``parallelize`` functions treat an untouched model. Keeping it plain is
what makes it a fair reference.

The architecture is a pre-norm GPT-2 style decoder:

    tokens -> token embedding + position embedding -> dropout
           -> n_layer x [x + dropout(attn(ln1(x))),  x + dropout(mlp(ln2(x)))]
           -> final layer norm -> linear head (optionally tied to the embedding)
           -> cross-entropy against the next token (a small module, ``loss_fn``)

Attention goes through ``scaled_dot_product_attention`` (flash attention on GPUs).
With ``n_expert > 0`` every ``moe_every``-th block's MLP is a mixture of experts
(``MoE``: a router and E expert MLPs, GShard / Switch Transformer).
Every part a technique may replace is a submodule (``attn.core``, ``loss_fn``, each
dropout), and dropout masks are keyed by position in the global batch
(``KeyedDropout``), so every layout draws the same masks as this one device.
"""

from __future__ import annotations

import difflib
import hashlib
import math
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT. ``d_ff`` defaults to 4 * d_model, as in GPT-2 and GPT-3."""

    vocab_size: int = 64
    seq_len: int = 32
    n_layer: int = 8
    n_head: int = 8
    d_model: int = 64
    d_ff: int = 0  # 0 means 4 * d_model
    dropout: float = 0.0
    tie_embeddings: bool = False
    # mixture of experts (``MoE``); n_expert = 0: every block dense
    n_expert: int = 0  # experts per MoE layer
    moe_top_k: int = 2  # experts per token (1: Switch, 2: GShard)
    moe_every: int = 1  # block i is MoE when (i + 1) % moe_every == 0 (2: every other)
    expert_d_ff: int = 0  # an expert's hidden size; 0 means d_ff
    capacity_factor: float = 0.0  # slots per expert per sequence over k*s/E; 0: dropless
    aux_loss_coef: float = 0.01  # the load-balancing loss's weight (Switch: 0.01)
    z_loss_coef: float = 0.0  # the router z-loss's weight (ST-MoE: 0.001)

    def __post_init__(self) -> None:
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.expert_d_ff == 0:
            object.__setattr__(self, "expert_d_ff", self.d_ff)
        if self.n_expert < 0:
            raise ValueError(f"--moe-experts must be 0 (dense) or a positive integer, "
                             f"got {self.n_expert}")
        if self.n_expert and not 1 <= self.moe_top_k <= self.n_expert:
            raise ValueError(f"--moe-top-k must be between 1 and --moe-experts "
                             f"({self.n_expert}), got {self.moe_top_k}")
        if self.moe_every < 1:
            raise ValueError(f"--moe-every must be a positive integer, got {self.moe_every}")
        for flag, value in (("capacity-factor", self.capacity_factor),
                            ("aux-loss-coef", self.aux_loss_coef),
                            ("z-loss-coef", self.z_loss_coef)):
            if not 0 <= value < math.inf:
                raise ValueError(f"--{flag} must be a finite number >= 0, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_head={self.n_head}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def is_moe(self, index: int) -> bool:
        """Whether block ``index``'s MLP is a mixture of experts."""
        return self.n_expert > 0 and (index + 1) % max(1, self.moe_every) == 0

    @property
    def n_moe_layers(self) -> int:
        if self.n_expert == 0:  # (the planner asks this thousands of times a plan)
            return 0
        return self.n_layer // max(1, self.moe_every)  # blocks k-1, 2k-1, ... (is_moe)

    def to_dict(self) -> dict:
        return asdict(self)

    def with_(self, **changes) -> GPTConfig:
        return replace(self, **changes)


# Presets. "tiny" trains visibly on 2 CPU cores in well under a minute and allows every
# layout up to 8 ranks (8 layers; heads, hidden, FFN and vocabulary divisible by 8).
# "gpt-10m" (10.1M parameters, byte-level: vocabulary 256, 256-byte context) is the
# capstone's: the size of nanoGPT's character-level "baby GPT", small enough to learn
# Python's look from its standard library on a laptop's CPU in under an hour, and it
# too allows every layout up to 8 ranks (8 layers, 8 heads of 40).
# The large ones are for the theory and the planner (GPT-3 sizes from Brown et al. 2020,
# Table 2.1; the 1T config from Narayanan et al. 2021, Table 1).
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=64, seq_len=32, n_layer=8, n_head=8, d_model=64),
    "small": GPTConfig(vocab_size=256, seq_len=64, n_layer=8, n_head=8, d_model=128),
    "gpt-10m": GPTConfig(vocab_size=256, seq_len=256, n_layer=8, n_head=8, d_model=320),
    "gpt2-125m": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12,
                           d_model=768, tie_embeddings=True),
    "gpt2-350m": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=24, n_head=16,
                           d_model=1024, tie_embeddings=True),
    "gpt-1.3b": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=24, n_head=32,
                          d_model=2048, tie_embeddings=True),
    # mixtures of experts: "tiny" with 8 experts (ep up to 8) in every other block, and
    # gpt-1.3b's active parameters (top-2 of 8 experts of half its FFN: 2.5B in all)
    "moe-tiny": GPTConfig(vocab_size=64, seq_len=32, n_layer=8, n_head=8, d_model=64,
                          n_expert=8, moe_top_k=2, moe_every=2),
    "moe-1.3b": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=24, n_head=32,
                          d_model=2048, tie_embeddings=True, n_expert=8, moe_top_k=2,
                          moe_every=2, expert_d_ff=4096),
    "gpt-6.7b": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=32, n_head=32,
                          d_model=4096, tie_embeddings=True),
    "gpt-13b": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=40, n_head=40,
                         d_model=5120, tie_embeddings=True),
    "gpt3-175b": GPTConfig(vocab_size=51200, seq_len=2048, n_layer=96, n_head=96,
                           d_model=12288, tie_embeddings=True),
    "gpt-1t": GPTConfig(vocab_size=51200, seq_len=2048, n_layer=128, n_head=160,
                        d_model=25600, tie_embeddings=True),
}


def did_you_mean(name: str, known: Collection[str]) -> str:
    """`` (did you mean 'small'?)`` after "unknown ... 'smal'", letter case aside: the
    names of ``known`` that ``name`` begins (``h200``: ``H200-141GB``), else difflib's
    closest three, the closest first; "" when none is close, or too many begin so (the
    list of every name follows it)."""
    typed, by_lower = str(name).lower(), {k.lower(): k for k in known}
    close = sorted(k for low, k in by_lower.items() if typed and low.startswith(typed)) or [
        by_lower[low] for low in difflib.get_close_matches(typed, by_lower, n=3)]  # best first
    if not close or len(close) > 3:
        return ""
    return f" (did you mean {' or '.join(repr(k) for k in close)}?)"


def get_config(name_or_config: str | GPTConfig) -> GPTConfig:
    """A preset by name, or the config itself."""
    if isinstance(name_or_config, GPTConfig):
        return name_or_config
    try:
        return PRESETS[name_or_config]
    except KeyError:
        raise ValueError(f"unknown model preset {name_or_config!r}"
                         f"{did_you_mean(name_or_config, PRESETS)}; choose one of "
                         f"{sorted(PRESETS)}") from None


class KeyedDropout(nn.Module):
    """Dropout whose mask is a function of *where* an element sits, not of who draws it.

    The mask of element (sample n, position t, feature j) at dropout site ``site`` is a
    hash of (seed, step, site, n, t, j): counter-based, like Philox in cuRAND (Salmon et
    al. 2011, "Parallel random numbers: as easy as 1, 2, 3"). A rank that holds samples
    [n0, n0 + b) or positions [t0, t0 + s) of the global batch draws exactly the mask one
    device draws for them, whatever the layout (data, micro-batch, pipeline or sequence
    split), and a recomputed forward draws it again. ``set_dropout_key`` sets (seed, step,
    first global sample) for a forward; without one, a random key is taken from torch's
    generator, so the module also behaves as plain dropout in any training loop.
    """

    def __init__(self, p: float, site: int) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.site = p, site
        self.key: tuple[int, int, int] | None = None  # (seed, step, first global sample)

    def forward(self, x: torch.Tensor, position_offset: int = 0) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = self.keep_mask(x.shape, position_offset, x.device)
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))

    def keep_mask(self, shape: torch.Size, position_offset: int,
                  device: torch.device) -> torch.Tensor:
        """Boolean [b, s, h] mask: True where the element is kept."""
        if self.key is None:
            key = int(torch.randint(0, _MASK32, ()))  # a random key, as plain dropout
            seed, step, sample = key, 0, 0
        else:
            seed, step, sample = self.key
        b, s, h = shape
        ix = partial(torch.arange, device=device, dtype=torch.int64)
        k = _mix(torch.tensor(((seed * 1_000_003 + step) * 8191 + self.site) & _MASK32,
                              device=device))
        k = _mix(k ^ (sample + ix(b)).view(b, 1, 1))
        k = _mix(k ^ (position_offset + ix(s)).view(1, s, 1) * 0x2545F491)
        k = _mix(k ^ ix(h).view(1, 1, h) * 0x165667B1)
        return k >= int(self.p * 2**32)  # kept with probability 1 - p


_MASK32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (a classic multiply-xorshift), in int64 so it runs anywhere."""
    return _mix_(x & _MASK32)  # (a new tensor: ``x`` is left as it was)


def set_dropout_key(module: nn.Module, seed: int, step: int, first_sample: int) -> None:
    """Key every ``KeyedDropout`` in ``module`` for the next forward: the run's seed, the
    step, and the global index of the batch's first sample (a micro-batch's offset)."""
    for m in module.modules():
        if isinstance(m, KeyedDropout):
            m.key = (seed, step, first_sample)


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(hd)) v, causal, through ``scaled_dot_product_attention``.

    A module of its own (without parameters) so that selective recomputation can wrap
    exactly this part. No attention dropout: its mask would have to be drawn per head
    and position pair to stay layout-independent (LLaMA and most recent models use none).
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused q|k|v projection.

    ``qkv.weight`` has shape (3 * d_model, d_model): rows [0, d) make q, [d, 2d) make k,
    [2d, 3d) make v, and inside each, head h owns rows [h*hd, (h+1)*hd). Tensor
    parallelism relies on that layout to hand each rank whole heads. The number of heads
    computed is read off the width ``qkv`` returns, so with a tensor-parallel ``qkv``
    (fewer output rows) the same forward runs on this rank's heads.
    """

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.head_dim = d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.core = AttentionCore()
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, t, _ = qkv.shape  # t: the full sequence even if x is a shard of it (SP)
        width = qkv.shape[-1] // 3  # all of d_model on one device, a shard under TP
        heads = width // self.head_dim
        q, k, v = qkv.split(width, dim=2)
        # (b, t, heads * hd) -> (b, heads, t, hd)
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, width))


class MLP(nn.Module):
    """fc (d -> d_ff), GELU, proj (d_ff -> d). Megatron splits fc by columns, proj by rows.
    GELU is a module of its own (without parameters) so that recomputation can reach it."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


# --- mixture of experts ----------------------------------------------------------------

def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor
                   ) -> torch.Tensor:
    """Rows of ``x`` sorted by expert times each expert's ``weight[e]^T`` ([E, out, in],
    ``nn.Linear``'s layout per expert); ``counts[e]`` rows belong to expert e. One grouped
    GEMM (``torch._grouped_mm``) on a GPU in bf16, else a loop over the experts (never
    over tokens). Every expert's weight is read, so each gets a gradient (zero if idle)."""
    if getattr(torch, "_grouped_mm", None) is not None and x.is_cuda \
            and x.dtype == torch.bfloat16:
        offsets = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    pieces = x.split(counts.tolist())
    return torch.cat([xe @ weight[e].t() for e, xe in enumerate(pieces)])


class GroupedLinear(nn.Module):
    """E linear maps side by side: ``weight`` [E, out, in], ``bias`` [E, out]. The input's
    rows are sorted by expert, ``counts[e]`` of them for expert e."""

    def __init__(self, n: int, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, d_out, d_in))
        self.bias = nn.Parameter(torch.empty(n, d_out))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        bias = self.bias.repeat_interleave(counts, dim=0, output_size=x.shape[0])
        return grouped_matmul(x, self.weight, counts) + bias


class Experts(nn.Module):
    """E MLPs (fc, GELU, proj), computed together on rows sorted by expert. Expert
    parallelism replaces this submodule (``parallel/ep.py``): same call, some of the
    experts here and the rest on other ranks, tokens moved by all-to-all."""

    def __init__(self, n: int, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc = GroupedLinear(n, d_model, d_ff)
        self.proj = GroupedLinear(n, d_ff, d_model)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x, counts), approximate="tanh"), counts)


class _AuxLossGrad(torch.autograd.Function):
    """Identity on the layer's output; its backward also starts the auxiliary loss's
    backward with gradient ``scale`` (Megatron-Core's ``MoEAuxLossAutoScaler``). So the
    auxiliary loss reaches the weights wherever the layer runs (any pipeline stage)
    without travelling to the loss, scaled as the micro-batch's loss is."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def route(logits: torch.Tensor, k: int, capacity: int) -> tuple[torch.Tensor, ...]:
    """Top-k routing of [b, s, E] router logits, decided per sequence.

    Returns (gate [b, s, k], expert [b, s, k], keep [b, s, k] bool, probs [b, s, E] fp32).
    Gates are the softmax probabilities of the chosen experts, renormalised over the k
    for k > 1 (GShard). ``capacity`` > 0: an expert takes at most that many of one
    sequence's assignments (``keep_under_capacity``); the rest are dropped (their tokens
    pass by the residual only).
    """
    probs = logits.float().softmax(-1)
    gate, expert = probs.topk(k, dim=-1)
    if k > 1:
        gate = gate / gate.sum(-1, keepdim=True)
    return gate, expert, keep_under_capacity(expert, logits.shape[-1], capacity), probs


def keep_under_capacity(expert: torch.Tensor, n_expert: int, capacity: int) -> torch.Tensor:
    """Which of a sequence's assignments ([b, s, k] expert ids) their expert keeps: each
    expert takes at most ``capacity`` of them (0: all), first choices before second ones,
    earlier positions first (GShard's order). [b, s, k] bool."""
    if capacity <= 0:
        return torch.ones_like(expert, dtype=torch.bool)
    b, s, k = expert.shape
    order = expert.transpose(1, 2).reshape(b, k * s)  # choice-major: all 1st choices first
    onehot = F.one_hot(order, n_expert)
    slot = (onehot.cumsum(1) * onehot).sum(-1) - 1  # place in its expert's queue
    return (slot < capacity).view(b, k, s).transpose(1, 2)


def load_balancing_loss(probs: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """E * sum_i f_i P_i per sequence, averaged over sequences (Switch Transformer, Fedus
    et al. 2021, eq. 4; per sequence as DeepSeek-V3's sequence-wise balance loss, arXiv
    2412.19437): f_i the share of the sequence's k*s assignments (``expert``) routed to
    expert i (before dropping), P_i the mean router probability over the tokens of
    ``probs``. 1 when perfectly balanced. ``probs`` may hold part of the sequence's
    tokens (a context-parallel rank's): each part's loss is then the whole's f with its
    own tokens' P, and the mean of the parts' losses is the whole's."""
    n_expert = probs.shape[-1]
    f = F.one_hot(expert.flatten(1), n_expert).float().mean(1)  # [b, E]
    return n_expert * (f * probs.mean(1)).sum(-1).mean()


class ExpertQueues(nn.Module):
    """Which assignments each expert keeps under its capacity, decided over a sequence.

    ``forward(expert)``: the [b, s, k] expert ids of the layer's tokens -> (keep [b, s, k]
    bool, the expert ids of the whole sequences [b, S, k], for the balance loss). Here
    the tokens are the whole sequences. A module (without weights) so that context
    parallelism, which gives a rank two pieces of every sequence, can put in its place
    one that decides over the whole sequence (``parallel/cp_plan.py``).
    """

    def __init__(self, n_expert: int, k: int, capacity_factor: float) -> None:
        super().__init__()
        self.n_expert, self.k, self.capacity_factor = n_expert, k, capacity_factor

    def capacity(self, seq_len: int) -> int:
        """Slots per expert for one sequence (0: dropless)."""
        if self.capacity_factor <= 0:
            return 0
        # an expert takes each token of a sequence at most once: seq_len slots are all
        return min(seq_len, math.ceil(self.capacity_factor * self.k * seq_len / self.n_expert))

    def forward(self, expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return keep_under_capacity(expert, self.n_expert, self.capacity(expert.shape[1])), expert


class MoE(nn.Module):
    """A mixture-of-experts MLP (GShard, Lepikhin et al. 2020, arXiv 2006.16668; Switch
    Transformer, Fedus et al. 2021, arXiv 2101.03961): a router (a linear map to E
    logits) sends each token to its top-k experts; the output is the gate-weighted sum
    of theirs.

    Routing is decided per *sequence* (``route``, ``ExpertQueues``): capacity, dropping
    and the load-balancing loss look at one whole sequence only, so every layout routes
    and drops exactly as one device does. Capacity per expert per sequence:
    ceil(capacity_factor * k * s / E), at most s; 0 is dropless. The auxiliary loss
    (``aux_loss_coef`` x load balance + ``z_loss_coef`` x the router z-loss, ST-MoE, Zoph
    et al. 2022, arXiv 2202.08906) is a mean over the layer's sequences and tokens; it
    enters the gradients, not the reported loss, with ``loss_scale`` as its weight (1
    here; ``set_moe_loss_scale``: the micro-batch's). ``last_counts`` / ``last_dropped``:
    the last forward's assignments per expert and the dropped ones (detached, for the
    lessons).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg, self.n_expert, self.k = cfg, cfg.n_expert, cfg.moe_top_k
        self.aux_loss_coef, self.z_loss_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        self.router = nn.Linear(cfg.d_model, cfg.n_expert, bias=False)
        self.queues = ExpertQueues(cfg.n_expert, cfg.moe_top_k, cfg.capacity_factor)
        self.experts = Experts(cfg.n_expert, cfg.d_model, cfg.expert_d_ff)
        self.loss_scale = 1.0
        self.last_counts: torch.Tensor | None = None
        self.last_dropped: torch.Tensor | None = None

    def capacity(self, seq_len: int) -> int:
        """Slots per expert for one sequence (0: dropless)."""
        return self.queues.capacity(seq_len)

    # The kept tokens per expert are data: every step a new shape. A compiled block
    # (``parallel/compile.py``) would recompile for each, so this layer stays eager.
    # (``torch._disable_dynamo`` is ``torch.compiler.disable`` applied at the first call:
    # the compiler takes a second to import, which a run that never compiles, and every
    # rank it spawns, should not pay.)
    @torch._disable_dynamo
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        logits = self.router(x)
        gate, expert, _, probs = route(logits, self.k, 0)  # the choices; then the capacity
        keep, whole = self.queues(expert)
        # the kept assignments, sorted by expert (stable: token order inside each)
        token = torch.arange(b * s, device=x.device).repeat_interleave(self.k)
        expert, gate, keep = expert.flatten(), gate.flatten(), keep.flatten()
        order = torch.sort(torch.where(keep, expert, self.n_expert), stable=True)[1]
        order = order[:int(keep.sum())]
        counts = torch.bincount(expert[order], minlength=self.n_expert)
        y = self.experts(x.reshape(b * s, d)[token[order]], counts)
        y = y * gate[order, None].to(y.dtype)
        out = torch.zeros_like(x.reshape(b * s, d)).index_add(0, token[order], y)
        self.last_counts = torch.bincount(expert, minlength=self.n_expert).detach()
        self.last_dropped = (~keep).sum().detach()
        if torch.is_grad_enabled():
            aux = self.aux_loss_coef * load_balancing_loss(probs, whole)
            if self.z_loss_coef:
                aux = aux + self.z_loss_coef * logits.float().logsumexp(-1).square().mean()
            out = _AuxLossGrad.apply(out, aux, self.loss_scale)
        return out.view(b, s, d)


def set_moe_loss_scale(module: nn.Module, scale: float) -> None:
    """The weight of every ``MoE`` auxiliary loss in ``module``: the factor its
    micro-batch's loss is multiplied by before the backward (``step.loss_scale``)."""
    for m in module.modules():
        if isinstance(m, MoE):
            m.loss_scale = scale


class Block(nn.Module):
    """One pre-norm transformer layer: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig, index: int = 0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_head)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MoE(cfg) if cfg.is_moe(index) else MLP(cfg.d_model, cfg.d_ff)
        self.resid_drop1 = KeyedDropout(cfg.dropout, site=1 + 2 * index)
        self.resid_drop2 = KeyedDropout(cfg.dropout, site=2 + 2 * index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_drop1(self.attn(self.ln1(x)))
        x = x + self.resid_drop2(self.mlp(self.ln2(x)))
        return x


class CrossEntropy(nn.Module):
    """Mean next-token cross-entropy of [b, s, V] logits against [b, s] targets.

    A module, not a function call, so that tensor parallelism can replace it with the
    vocabulary-parallel loss, which takes logits split by vocabulary.
    """

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def embed_tokens(tok_emb: nn.Module, pos_emb: nn.Module, drop: nn.Module,
                 idx: torch.Tensor) -> torch.Tensor:
    """Token plus position embedding, then dropout: the first part of the forward, shared
    by ``GPT`` and a pipeline's first stage."""
    t = idx.shape[1]
    if t > pos_emb.weight.shape[0]:
        raise ValueError(f"sequence length {t} exceeds the model's seq_len "
                         f"{pos_emb.weight.shape[0]}")
    pos = torch.arange(t, device=idx.device)
    return drop(tok_emb(idx) + pos_emb(pos))


def init_parameter(name: str, shape: tuple[int, ...] | torch.Size, cfg: GPTConfig,
                   seed: int = 0, device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The initial value of parameter ``name`` (a reference name, full shape): GPT-2's
    initialisation (Radford et al. 2019): N(0, 0.02), residual projections (``proj``)
    scaled by 1/sqrt(2 L), layer-norm gains 1, biases 0.

    The random values come from a counter-based generator keyed by (seed, name): element
    i of the flattened tensor is a hash of (key, i) turned into a normal by the inverse
    CDF. So a weight's value depends on neither which other weights exist nor the order
    they are made in, nor (up to rounding of erfinv) the device: a rank that builds only
    its shard of some weights gets exactly the single device's values. A tied head is the
    token embedding (same name, same values).
    """
    if cfg.tie_embeddings and name.split(".")[-2:] == ["head", "weight"]:
        name = name[:-len("head.weight")] + "tok_emb.weight"
    shape = tuple(shape)
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype, device=device)  # layer-norm gains
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("proj.weight") else 0.02
    # a 32-bit key from (seed, name), the same in every process (not Python's hash)
    key = int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=4).digest(),
                         "little")
    return keyed_normal(key, shape, std, device, dtype)


def keyed_normal(key: int, shape: tuple[int, ...], std: float = 1.0,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32, chunk: int | None = None) -> torch.Tensor:
    """N(0, std^2) values, element i a function of (key, i) only (as ``KeyedDropout``'s
    masks): a 32-bit hash to a uniform, ``erfinv`` to a normal (in float64, so devices
    agree). ``chunk`` elements at a time (values independent of it): small on the host
    (its allocator then reuses them; large ones fragment its heap), large on a GPU."""
    numel = math.prod(shape)
    if chunk is None:
        chunk = 1 << 16 if torch.device(device or "cpu").type == "cpu" else 1 << 24
    out = torch.empty(numel, dtype=dtype, device=device)
    for start in range(0, numel, chunk):
        h = torch.arange(start, min(numel, start + chunk), dtype=torch.int64, device=device)
        hi = h >> 32  # (tensors over 2^32 elements: the high bits mixed in too)
        h = _mix_(_mix_(h.bitwise_xor_(key)).bitwise_xor_(hi.mul_(0x2545F491)))
        u = h.to(torch.float64).add_(0.5).mul_(2.0**-31).sub_(1.0)  # in (-1, 1)
        out[start:start + len(u)] = u.erfinv_().mul_(std * math.sqrt(2.0))
    return out.view(shape)


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """``_mix`` in place (fewer temporaries; constants < 2^31: no int64 overflow)."""
    x.bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 16).mul_(0x45D9F3B).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 16).mul_(0x45D9F3B).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def materialize(module: nn.Module,
                values: Callable[[str, nn.Parameter], torch.Tensor]) -> nn.Module:
    """Give every parameter of ``module`` (on the meta device, or anywhere) the value
    ``values(name, parameter)``, one parameter at a time. A parameter held by several
    modules (a tied weight) is made once and stays shared; its attributes are kept."""
    new: dict[int, nn.Parameter] = {}
    names = {id(q): n for n, q in module.named_parameters()}  # a tied weight: first name
    for m in module.modules():
        for local, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in new:
                with torch.no_grad():
                    value = values(names[id(p)], p)
                q = nn.Parameter(value, requires_grad=p.requires_grad)
                q.__dict__.update(p.__dict__)  # e.g. sequence_parallel marks
                new[id(p)] = q
            m._parameters[local] = new[id(p)]
    return module


class GPT(nn.Module):
    """A decoder-only transformer. ``forward(idx, targets)`` returns the mean loss."""

    def __init__(self, cfg: GPTConfig | str = "tiny", seed: int = 0,
                 device: torch.device | str | None = None) -> None:
        """``seed`` fixes every weight (``init_parameter``: by name, not by the order of
        creation). ``device="meta"``: shapes only, no storage (``materialize`` later)."""
        super().__init__()
        cfg = get_config(cfg)
        self.cfg = cfg
        with torch.device("meta"):  # shapes first; values below, one tensor at a time
            # (``_weight``: no init of a meta table; torch's normal_ on meta would import
            # its Python reference ops, ~100 MB and seconds in every rank)
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model,
                                        _weight=torch.empty(cfg.vocab_size, cfg.d_model))
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model,
                                        _weight=torch.empty(cfg.seq_len, cfg.d_model))
            self.drop = KeyedDropout(cfg.dropout, site=0)
            self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.loss_fn = CrossEntropy()
        if torch.device(device or "cpu").type != "meta":
            self.reset_parameters(seed, device)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0, device: torch.device | str | None = None
                         ) -> None:
        """GPT-2 initialisation (``init_parameter``), every weight from (seed, its name)."""
        device = device or next((p.device for p in self.parameters()
                                 if p.device.type != "meta"), torch.device("cpu"))
        materialize(self, lambda name, p: init_parameter(name, p.shape, self.cfg, seed,
                                                         device))

    # The parts of the forward pass, for learners who run them one at a time.
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return embed_tokens(self.tok_emb, self.pos_emb, self.drop, idx)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(h))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits, targets)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        logits = self.logits(h)
        return logits if targets is None else self.loss(logits, targets)

    def num_params(self) -> int:
        """Parameters counted once (a tied head is not counted twice)."""
        return sum(p.numel() for p in self.parameters())
