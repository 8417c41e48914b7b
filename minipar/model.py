"""The single-device GPT: the reference every parallel layout must reproduce.

This file knows nothing of parallelism. Tensor, pipeline and data parallelism are
applied from outside (``minipar.parallel``), by swapping layers, cutting the list of
blocks into stages, or wrapping the whole module, the way torchtitan's ``parallelize``
functions treat an untouched model. Keeping it plain is what makes it a fair reference.

The architecture is a pre-norm GPT-2 style decoder:

    tokens -> token embedding + position embedding -> dropout
           -> n_layer x [x + attn(ln1(x)),  x + mlp(ln2(x))]
           -> final layer norm -> linear head (optionally tied to the embedding)
           -> cross-entropy against the next token

Attention goes through ``scaled_dot_product_attention`` (flash attention on GPUs).
The forward pass is split into ``embed``, ``blocks`` and ``head_loss`` so pipeline
stages can run a part of it without copying code.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

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


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused q|k|v projection.

    ``qkv.weight`` has shape (3 * d_model, d_model): rows [0, d) make q, [d, 2d) make k,
    [2d, 3d) make v, and inside each, head h owns rows [h*hd, (h+1)*hd). Tensor
    parallelism relies on that layout to hand each rank whole heads.
    ``n_head`` is the number of heads *this module* computes, so a tensor-parallel copy
    with fewer heads runs the same forward code.
    """

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        width = self.n_head * self.head_dim  # local width (all of d_model on one device)
        q, k, v = qkv.split(width, dim=2)
        # (b, t, heads * hd) -> (b, heads, t, hd)
        q, k, v = (z.view(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, width))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(hd)) v, causal: the part selective recomputation redoes."""
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


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

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_head, cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.d_ff)
        self.resid_drop1 = nn.Dropout(cfg.dropout)
        self.resid_drop2 = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_drop1(self.attn(self.ln1(x)))
        x = x + self.resid_drop2(self.mlp(self.ln2(x)))
        return x


class GPT(nn.Module):
    """A decoder-only transformer. ``forward(idx, targets)`` returns the mean loss."""

    def __init__(self, cfg: GPTConfig | str = "tiny") -> None:
        super().__init__()
        cfg = get_config(cfg)
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)  # layer-norm gains
            else:
                std = 0.02
                if name.endswith("proj.weight"):
                    std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
                p.normal_(0.0, std)

    # The three parts of the forward pass; pipeline stages call a subset of them.
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(h))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        logits = self.logits(h)
        return logits if targets is None else self.loss(logits, targets)

    def num_params(self) -> int:
        """Parameters counted once (a tied head is not counted twice)."""
        return sum(p.numel() for p in self.parameters())
