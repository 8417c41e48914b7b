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
Every part a technique may replace is a submodule (``attn.core``, ``loss_fn``, each
dropout), and dropout masks are keyed by position in the global batch
(``KeyedDropout``), so every layout draws the same masks as this one device.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
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

    def __post_init__(self) -> None:
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_head={self.n_head}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)

    def with_(self, **changes) -> GPTConfig:
        return replace(self, **changes)


# Presets. "tiny" trains visibly on 2 CPU cores in well under a minute and allows every
# layout up to 8 ranks (8 layers; heads, hidden, FFN and vocabulary divisible by 8).
# The large ones are for the theory and the planner (GPT-3 sizes from Brown et al. 2020,
# Table 2.1; the 1T config from Narayanan et al. 2021, Table 1).
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=64, seq_len=32, n_layer=8, n_head=8, d_model=64),
    "small": GPTConfig(vocab_size=256, seq_len=64, n_layer=8, n_head=8, d_model=128),
    "gpt2-125m": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12,
                           d_model=768, tie_embeddings=True),
    "gpt2-350m": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=24, n_head=16,
                           d_model=1024, tie_embeddings=True),
    "gpt-1.3b": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=24, n_head=32,
                          d_model=2048, tie_embeddings=True),
    "gpt-6.7b": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=32, n_head=32,
                          d_model=4096, tie_embeddings=True),
    "gpt-13b": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=40, n_head=40,
                         d_model=5120, tie_embeddings=True),
    "gpt3-175b": GPTConfig(vocab_size=51200, seq_len=2048, n_layer=96, n_head=96,
                           d_model=12288, tie_embeddings=True),
    "gpt-1t": GPTConfig(vocab_size=51200, seq_len=2048, n_layer=128, n_head=160,
                        d_model=25600, tie_embeddings=True),
}


def get_config(name_or_config: str | GPTConfig) -> GPTConfig:
    """A preset by name, or the config itself."""
    if isinstance(name_or_config, GPTConfig):
        return name_or_config
    try:
        return PRESETS[name_or_config]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name_or_config!r}; choose one of {sorted(PRESETS)}"
        ) from None


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
    """fc (d -> d_ff), GELU, proj (d_ff -> d). Megatron splits fc by columns, proj by rows."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff)
        self.proj = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """One pre-norm transformer layer: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig, index: int = 0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_head)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.d_ff)
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

    @classmethod
    def from_safetensors(cls, path: str, cfg: GPTConfig | str | None = None,
                         device: torch.device | str | None = None) -> GPT:
        """The model a ``python -m minipar export`` file holds (``minipar.export``)."""
        from minipar.export import load_gpt

        return load_gpt(path, cfg, device)

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
