"""What a training run is asked to do, and every check made before a process starts.

``TrainConfig`` mirrors the command line (``python -m minipar train``) one flag to one
field. ``validate`` turns every invalid combination into one clear ``ValueError`` line,
*before* any rank is spawned: a typo must never cost a room of laptops a hung kernel.
``docs/errors.md`` lists each message; ``tests/test_errors.py`` tries each.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

from minipar.data import check_batch_split
from minipar.model import GPTConfig, get_config

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb")
RECOMPUTE = ("none", "selective", "full")
DTYPES = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "sgd")


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
    device: str = "auto"  # cpu, cuda, or auto (cuda with nccl, else cpu)
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ddp: str = "overlapped"  # naive, bucketed, overlapped (ZeRO 0)
    fused: bool = False  # torch's fused AdamW kernel (one launch for all parameters; GPUs)
    optimizer: str = "adamw"  # adamw, or sgd (plain, no momentum: a scale error cannot hide)
    order: str = "megatron"
    save: str | None = None
    resume: str | None = None
    trace: str | None = None
    stop_at: int | None = None  # end (and save) after this step, as if interrupted
    timeout: float = 600.0
    overrides: dict = field(default_factory=dict)  # model config fields to change

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def model_config(self) -> GPTConfig:
        return get_config(self.model).with_(**self.overrides)

    def to_dict(self) -> dict:
        return asdict(self)


def _choice(flag: str, value, allowed) -> None:
    if value not in allowed:
        shown = ", ".join(str(a) for a in allowed)
        raise ValueError(f"--{flag} must be one of {shown}, got {value!r}")


def validate(cfg: TrainConfig, world_size: int | None = None) -> None:
    """Raise ``ValueError`` (one line) for anything that cannot run. ``world_size``: the
    size of a job started by torchrun, which the layout must fill exactly."""
    from minipar.parallel.tp import check_tp  # the rules of tensor parallelism live there

    for name in ("dp", "pp", "tp", "steps", "microbatches", "virtual", "batch_size"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, "
                             f"got {value!r}")
    _choice("zero", cfg.zero, (0, 1, 2, 3))
    _choice("schedule", cfg.schedule, SCHEDULE_NAMES)
    _choice("dtype", cfg.dtype, DTYPES)
    _choice("recompute", cfg.recompute, RECOMPUTE)
    _choice("backend", cfg.backend, ("gloo", "nccl"))
    _choice("device", cfg.device, ("auto", "cpu", "cuda"))
    _choice("order", cfg.order, ("megatron", "pp-inside-dp"))
    _choice("ddp", cfg.ddp, ("naive", "bucketed", "overlapped"))
    _choice("optimizer", cfg.optimizer, OPTIMIZERS)
    if world_size is not None and world_size != cfg.world_size:
        raise ValueError(f"layout dp={cfg.dp} x pp={cfg.pp} x tp={cfg.tp} = {cfg.world_size} "
                         f"ranks does not match the job's world size {world_size}")
    model = cfg.model_config()
    check_tp(model, cfg.tp, cfg.sp)
    if cfg.sp and cfg.tp == 1:
        raise ValueError("--sp (sequence parallelism) splits along tp: it needs --tp > 1")
    chunks = cfg.pp * cfg.virtual
    if model.n_layer < chunks:
        raise ValueError(f"{model.n_layer} layers cannot fill pp={cfg.pp} x "
                         f"virtual={cfg.virtual} = {chunks} pipeline chunks")
    if cfg.virtual > 1 and cfg.schedule != "interleaved":
        raise ValueError(f"--virtual {cfg.virtual} needs --schedule interleaved "
                         f"(got {cfg.schedule})")
    if cfg.schedule == "interleaved" and cfg.pp > 1:
        if cfg.virtual < 2:
            raise ValueError("--schedule interleaved needs --virtual 2 or more "
                             "(chunks per rank)")
        if cfg.microbatches % cfg.pp:
            raise ValueError(f"--schedule interleaved needs --microbatches divisible by "
                             f"--pp ({cfg.microbatches} % {cfg.pp} != 0)")
    if cfg.zero == 3 and cfg.schedule == "zb":  # at every pp: W runs at pp = 1 too
        raise ValueError("--zero 3 with --schedule zb is not supported: the split weight "
                         "gradient (W) runs after ZeRO-3 has freed the layer's weights")
    if cfg.pp > 1 and model.tie_embeddings:
        raise ValueError(f"model {cfg.model!r} ties its embeddings, which pp > 1 does not "
                         "support (the first and last stage would share a weight)")
    check_batch_split(cfg.batch_size, cfg.dp, cfg.microbatches)
    if cfg.stop_at is not None and not 0 < cfg.stop_at <= cfg.steps:
        raise ValueError(f"--stop-at must be between 1 and --steps ({cfg.steps}), "
                         f"got {cfg.stop_at}")
    if cfg.lr <= 0 or not math.isfinite(cfg.lr):
        raise ValueError(f"--lr must be a positive number, got {cfg.lr}")
    _check_device(cfg)
    if cfg.resume is not None and not os.path.isdir(cfg.resume):
        raise ValueError(f"--resume {cfg.resume}: no such checkpoint directory")


def _check_device(cfg: TrainConfig) -> None:
    import torch

    if cfg.backend == "nccl" or cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--backend nccl and --device cuda need a CUDA GPU; this machine "
                             "has none: use --backend gloo")
    if cfg.backend == "nccl" and "LOCAL_WORLD_SIZE" not in os.environ:
        if cfg.world_size > torch.cuda.device_count():
            raise ValueError(f"--backend nccl runs one rank per GPU: {cfg.world_size} ranks "
                             f"but {torch.cuda.device_count()} GPU(s); use --backend gloo "
                             "--device cuda to share a GPU")
    if cfg.backend == "nccl" and cfg.device == "cpu":
        raise ValueError("--backend nccl moves CUDA tensors only: drop --device cpu")


def device_for(cfg: TrainConfig):
    """The torch device this rank computes on."""
    import torch

    if cfg.device == "cuda" or (cfg.device == "auto" and cfg.backend == "nccl"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")


def optimizer_class(cfg: TrainConfig) -> type:
    """The torch optimizer every layout (and the reference) steps with.

    Plain SGD (no momentum) is in the parity set because it has no normalisation: a
    gradient 2x too large moves the weights 2x too far, where AdamW would divide it away.
    """
    import torch

    return torch.optim.SGD if cfg.optimizer == "sgd" else torch.optim.AdamW


def optimizer_kwargs(cfg: TrainConfig) -> dict:
    """Keyword arguments for ``optimizer_class(cfg)`` (the learning rate is set per step)."""
    kwargs = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    if cfg.fused:  # only when asked: the default path stays exactly what it was
        kwargs["fused"] = True
    return kwargs


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``cfg.lr``, then cosine decay to a tenth of it."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
