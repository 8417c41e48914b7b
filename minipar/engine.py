"""Compose a GPT for a mesh and train it: the one training loop every layout shares.

(Interim version: one process. The 3-D composition lands with the parallel parts.)
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from minipar.data import MarkovData, check_batch_split, split_batch
from minipar.model import GPT, get_config

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb")


@dataclass
class TrainConfig:
    """Everything a run needs; the command line's flags map one to one onto it."""

    model: str = "tiny"
    dp: int = 1
    pp: int = 1
    tp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    virtual: int = 1
    microbatches: int = 1
    sp: bool = False
    recompute: str = "none"
    dtype: str = "fp32"
    steps: int = 20
    seed: int = 0
    backend: str = "gloo"
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    order: str = "megatron"
    save: str | None = None
    resume: str | None = None
    trace: str | None = None
    timeout: float = 600.0
    overrides: dict = field(default_factory=dict)  # model config fields to change

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def to_dict(self) -> dict:
        return asdict(self)


def validate(cfg: TrainConfig) -> None:
    """Every invalid combination fails here, with one clear line, before any process starts."""
    model_cfg = get_config(cfg.model).with_(**cfg.overrides)
    for name in ("dp", "pp", "tp", "steps", "microbatches", "virtual", "batch_size"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(cfg, name)}")
    if cfg.zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero must be 0, 1, 2 or 3, got {cfg.zero}")
    if cfg.schedule not in SCHEDULE_NAMES:
        raise ValueError(f"--schedule must be one of {', '.join(SCHEDULE_NAMES)}, "
                         f"got {cfg.schedule!r}")
    if cfg.dtype not in ("fp32", "bf16"):
        raise ValueError(f"--dtype must be fp32 or bf16, got {cfg.dtype!r}")
    if cfg.recompute not in ("none", "selective", "full"):
        raise ValueError(f"--recompute must be none, selective or full, got {cfg.recompute!r}")
    check_batch_split(cfg.batch_size, cfg.dp, cfg.microbatches)
    del model_cfg


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``cfg.lr``, then cosine decay to a tenth of it."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_single(cfg: TrainConfig, progress=None) -> dict:
    """The reference: one process, gradient accumulation over the micro-batches."""
    validate(cfg)
    model_cfg = get_config(cfg.model).with_(**cfg.overrides)
    torch.manual_seed(cfg.seed)
    model = GPT(model_cfg)
    data = MarkovData(model_cfg.vocab_size, model_cfg.seq_len, seed=cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    losses = []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = data.batch(step, cfg.batch_size)
        total = 0.0
        for mx, my in split_batch(x, y, 0, 1, cfg.microbatches):
            loss = model(mx, my) / cfg.microbatches
            loss.backward()
            total += loss.item()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        if progress is not None:
            progress(step, total)
    return {"config": cfg.to_dict(), "losses": losses, "seconds": time.perf_counter() - t0,
            "ranks": [{"rank": 0, "coords": {"dp": 0, "pp": 0, "tp": 0}}]}
