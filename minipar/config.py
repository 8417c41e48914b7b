"""What a training run is asked to do, and every check made before a process starts.

``TrainConfig`` declares each option once: a field with its default, its help text and,
where it has them, its choices. ``python -m minipar train`` builds its flags from these
fields (``--batch-size`` is ``batch_size``), so a new flag is one field plus its check.
``validate`` turns every invalid combination into one clear ``ValueError`` line,
*before* any rank is spawned: a typo must never cost a room of laptops a hung kernel.
``docs/errors.md`` lists each message; ``tests/test_errors.py`` tries each.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields, replace

import torch

from minipar import checkpoint, checks, doctor
from minipar.corpus import (
    check_source,
    data_vocab,
    held_out_rows,
    open_tokens,
    sidecar,
    split_sizes,
    token_count,
    tokenizer_vocab,
)
from minipar.data import MARKOV_BRANCHING, check_batch_split
from minipar.hf import check_init_from, default_tokenizer, read_config
from minipar.launch import check_timeout
from minipar.mesh import ORDERS
from minipar.model import GPTConfig, get_config
from minipar.parallel.compile import BACKENDS
from minipar.parallel.ep import check_ep
from minipar.parallel.fp8 import RECIPES as FP8_RECIPES
from minipar.parallel.fp8 import check_fp8, gemm_sizes
from minipar.parallel.pp import partition_layers
from minipar.parallel.recompute import MODES as RECOMPUTE
from minipar.parallel.recompute import check_recompute_layers
from minipar.parallel.schedules import SCHEDULES, SPLIT_BACKWARD, check_schedule
from minipar.parallel.tp import check_tp  # the rules of tensor parallelism live there
from minipar.theory import clusters
from minipar.theory.card import card_peak, host_fit
from minipar.theory.layout import Layout
from minipar.theory.planner import plan

SCHEDULE_NAMES = tuple(SCHEDULES)
DTYPES = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "sgd")


def option(default, help: str, choices: tuple | None = None):
    """A ``TrainConfig`` field that is also a ``train`` flag: ``--`` and its name with
    dashes, of its annotation's type (a bool is a switch), ``help`` and ``choices`` for
    the command line; ``validate`` checks the choices for the Python API too."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class TrainConfig:
    """Everything a run needs; each field with a ``help`` is a ``train`` flag."""

    model: str = option("tiny", "preset name (see minipar.model.PRESETS)")
    dp: int = option(1, "data-parallel replicas")
    pp: int = option(1, "pipeline stages")
    tp: int = option(1, "tensor-parallel ranks per layer")
    zero: int = option(0, "ZeRO stage", choices=(0, 1, 2, 3))
    schedule: str = option("1f1b", "pipeline schedule", choices=SCHEDULE_NAMES)
    virtual: int = option(1, "chunks per rank (interleaved)")
    head_layers: int = option(0, "the last pipeline chunk holds K layers fewer: its head "
                              "and loss cost about K layers (gpt-1.3b: 2; "
                              "`theory.params.head_layers_for`)")
    microbatches: int = option(1, "micro-batches per step")
    sp: bool = option(False, "sequence parallelism (needs --tp > 1)")
    recompute: str = option("none", "activations recomputed in the backward pass",
                            choices=RECOMPUTE)
    recompute_layers: int | None = option(None, "recompute only the first N blocks of each "
                                          "pipeline chunk (default: all); the others keep "
                                          "their activations")
    recompute_rest: str = option("none", "what the blocks past --recompute-layers do: keep "
                                 "everything (none) or recompute cheaply (cheap)",
                                 choices=("none", "cheap"))
    chunked_loss: bool = option(False, "the loss keeps no fp32 copy of the logits: its "
                                "backward recomputes the softmax a chunk of tokens at a "
                                "time (parallel/chunked_loss.py; not with --tp > 1)")
    compile: bool | None = option(None, "torch.compile each transformer block (default: on "
                                  "CUDA devices under data parallelism alone, without tp, "
                                  "cp or a pipeline; --no-compile runs them eagerly; "
                                  "parallel/compile.py)")
    compile_backend: str = option("inductor", "aot_eager: the graphs without generated code "
                                  "(tests, CPUs)", choices=BACKENDS)
    dtype: str = option("fp32", "the blocks' compute dtype", choices=DTYPES)
    grad_dtype: str = option("fp32", "where bf16 gradients are summed and reduced: fp32 "
                             "(exact, default) or bf16 (half the bytes and traffic, as "
                             "torch's peers do)", choices=DTYPES)
    separate_reduce_group: bool = option(False, "ZeRO-3: reduce-scatter gradients on a "
                                         "second communicator over the dp ranks, beside "
                                         "the weights' all-gathers instead of queued "
                                         "behind them (one more communicator's buffers; "
                                         "minipar.mesh)")
    wgrad_fusion: bool = option(True, "add each linear weight gradient to its fp32 sum in "
                                "the GEMM that makes it (default on; "
                                "parallel/wgrad_fusion.py)")
    overlap_param_gather: bool = option(True, "ZeRO-1/2: gather each bucket's new weights "
                                        "during the next forward, not after the step "
                                        "(default on; parallel/param_gather.py)")
    steps: int = option(20, "training steps")
    seed: int = option(0, "seed of the initial weights and the data")
    backend: str = option("gloo", "torch.distributed backend", choices=("gloo", "nccl"))
    device: str = option("auto", "cpu, cuda, or auto (cuda with nccl, else cpu)",
                         choices=("auto", "cpu", "cuda"))
    batch_size: int = option(16, "global batch (sequences)")
    lr: float | None = option(None, "peak learning rate (default: the preset's published "
                              "one, 3e-3 for the small presets; config.RECIPES)")
    warmup: int | None = option(None, "linear warm-up steps (default: the preset's recipe, "
                                "at most a tenth of the run; 5 for the small presets)")
    weight_decay: float = option(0.0, "the optimizer's weight decay")
    grad_clip: float = option(1.0, "global norm (0: off)")
    ddp: str = option("overlapped", "ZeRO 0's gradient sync",
                      choices=("naive", "bucketed", "overlapped"))
    fused: bool | None = option(None, "torch's fused optimizer kernel (default: AdamW "
                                "everywhere, SGD on CUDA devices)")
    optimizer: str = option("adamw", "sgd: plain SGD, no momentum (parity checks see a "
                            "gradient's scale)", choices=OPTIMIZERS)
    order: str = option("megatron", "how ranks map to mesh coordinates (minipar.mesh)",
                        choices=tuple(ORDERS))
    save: str | None = option(None, "checkpoint directory to write at the end")
    resume: str | None = option(None, "checkpoint directory to start from")
    trace: str | None = option(None, "write a Chrome trace (open in Perfetto)")
    measure_activations: bool = option(False, "measure the activation memory each step "
                                       "(saved-tensor hooks on every op: a slower step)")
    stop_at: int | None = option(None, "stop (and --save) after this step")
    timeout: float = option(600.0, "seconds a rank may make no progress (no step, no "
                            "collective finished) before the run counts as hung and each "
                            "rank's place is shown; counted from every rank's first "
                            "progress (start-up gets at least 120 s)")
    overrides: dict = field(default_factory=dict)  # model config fields (Python API only)
    # --- data, model sizes, long runs ---
    data: str = option("markov", "markov (generated), pystdlib (Python's own sources), a "
                       "text file, a directory of text files, or a .bin token file")
    tokenizer: str | None = option(None, "for text: byte (vocab 256, the default), bpe "
                                   "(trained to the model's vocab) or a tokenizer.json file "
                                   "(--init-from: the directory's, when it has one)")
    data_cache: str | None = option(None, "where tokenised text is kept (~/.cache/minipar)")
    eval_every: int = option(0, "validation loss every N steps and at the end (0: never)")
    eval_batches: int = option(4, "held-out global batches per evaluation")
    layers: int | None = option(None, "override the preset's n_layer")
    hidden: int | None = option(None, "override the preset's d_model")
    heads: int | None = option(None, "override the preset's n_head")
    ffn: int | None = option(None, "override the preset's d_ff")
    vocab: int | None = option(None, "override the preset's vocab_size")
    seq_len: int | None = option(None, "override the preset's seq_len")
    save_every: int = option(0, "also --save every N steps")
    keep: int = option(0, "keep the last K checkpoints (0: all)")
    log_every: int = option(1, "progress every N steps")
    dropout: float = option(0.0, "dropout probability (masks keyed by position: every "
                            "layout alike)")
    # --- context parallelism and ZeRO-Offload ---
    cp: int = option(1, "context-parallel ranks per sequence (ring attention, zig-zag)")
    offload: bool = option(False, "ZeRO-Offload: fp32 masters, optimizer states and step "
                           "on the host")
    # --- the Hugging Face ecosystem (minipar/hf.py) ---
    init_from: str | None = option(None, "start from a GPT-2 transformers directory (its "
                                   "sizes and weights; its tokenizer.json tokenises text "
                                   "data)")
    text_field: str = option("text", "the text column of JSON Lines, Parquet or datasets "
                             "--data")
    # --- mixture of experts and expert parallelism (parallel/ep.py) ---
    ep: int = option(1, "expert-parallel ranks (inside dp): each MoE layer's experts split")
    moe_experts: int | None = option(None, "experts per MoE layer (0: dense)")
    moe_top_k: int | None = option(None, "experts per token (1 or 2)")
    moe_every: int | None = option(None, "every N-th block is MoE (2: every other)")
    capacity_factor: float | None = option(None, "expert slots per sequence over k*seq/E "
                                           "(0: dropless)")
    aux_loss_coef: float | None = option(None, "load-balancing loss weight")
    z_loss_coef: float | None = option(None, "router z-loss weight")
    fp8: str | None = option(None, "the blocks' linear layers multiply in float8, scaled "
                             "per row or per tensor (GPUs of compute capability 8.9+; "
                             "parallel/fp8.py)", choices=FP8_RECIPES)
    fp8_emulate: bool = option(False, "with --fp8: float8 casts, fp32 matmuls, on any "
                               "device (for tests: the same numbers, no speed)")
    allow_nonfinite: bool = option(False, "train on past a NaN/inf loss (default: stop "
                                   "there, exit 1)")

    def __post_init__(self) -> None:
        if self.tokenizer is None:  # --init-from's tokenizer.json, when it has one
            self.tokenizer = default_tokenizer(self.init_from)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    def layout_name(self) -> str:
        """``dp=2 x pp=2 x tp=2`` (and ``x cp=C`` when cp > 1)."""
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        return f"dp={self.dp} x pp={self.pp} x tp={self.tp}{cp}"

    def layout(self, device: str | None = None) -> Layout:
        """What the theory prices of this run (``theory.layout.Layout``): its sizes, ZeRO
        stage, batch split (a micro-batch is batch / (dp x microbatches) sequences),
        schedule, recomputation, offload, precision, compilation and the optimizer's
        kernel on ``device`` ("cuda" or "cpu"; default: the run's, ``optimizer_kernel``,
        ``use_compile``)."""
        on_cuda = uses_cuda(self) if device is None else device == "cuda"
        layout = Layout(dp=self.dp, pp=self.pp, tp=self.tp, cp=self.cp, ep=self.ep,
                        zero=self.zero,
                        microbatch_size=max(1, self.batch_size // (self.dp * self.microbatches)),
                        microbatches=self.microbatches, schedule=self.schedule,
                        virtual=self.virtual, head_layers=self.head_layers, sp=self.sp,
                        recompute=self.recompute, recompute_layers=self.recompute_layers,
                        recompute_rest=self.recompute_rest,
                        offload=self.offload, dtype=self.dtype, optimizer=self.optimizer,
                        grad_dtype=self.grad_dtype, fp8=self.fp8, order=self.order,
                        separate_reduce_group=self.separate_reduce_group,
                        chunked_loss=self.chunked_loss,
                        optimizer_kernel=optimizer_kernel(self, on_cuda))
        compiled = self.compile if self.compile is not None else (
            on_cuda and layout.compiled_by_default(self.dropout))
        return layout.with_(compiled=compiled)

    def model_config(self) -> GPTConfig:
        """The preset (``init_from``: the directory's sizes), with ``overrides``, the size
        flags, and the data's vocabulary."""
        base = read_config(self.init_from) if self.init_from else get_config(self.model)
        cfg = sized(base.with_(**self.overrides), self.layers,
                    self.hidden, self.heads, self.ffn, self.vocab, self.seq_len)
        moe = {"n_expert": self.moe_experts, "moe_top_k": self.moe_top_k,
               "moe_every": self.moe_every, "capacity_factor": self.capacity_factor,
               "aux_loss_coef": self.aux_loss_coef, "z_loss_coef": self.z_loss_coef}
        cfg = cfg.with_(**{k: v for k, v in moe.items() if v is not None})
        if self.vocab is None and not self.init_from:
            vocab = data_vocab(self.data, self.tokenizer, cfg.vocab_size)
            if vocab is not None:
                cfg = cfg.with_(vocab_size=vocab)
        return cfg.with_(dropout=self.dropout) if self.dropout else cfg

    def to_dict(self) -> dict:
        return asdict(self)


def sized(cfg: GPTConfig, layers: int | None = None, hidden: int | None = None,
          heads: int | None = None, ffn: int | None = None, vocab: int | None = None,
          seq_len: int | None = None) -> GPTConfig:
    """``cfg`` with the sizes given (``--layers --hidden --heads --ffn --vocab
    --seq-len``); a new hidden size without ``--ffn`` gets the usual 4 x hidden, and an
    expert's hidden size keeps its share of the MLP's (a preset's experts as wide as its
    MLP stay so)."""
    sizes = {"n_layer": layers, "d_model": hidden, "n_head": heads, "d_ff": ffn,
             "vocab_size": vocab, "seq_len": seq_len}
    for flag, value in sizes.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            name = {"n_layer": "layers", "d_model": "hidden", "n_head": "heads",
                    "d_ff": "ffn", "vocab_size": "vocab", "seq_len": "seq-len"}[flag]
            raise ValueError(f"--{name} must be a positive integer, got {value!r}")
    if hidden is not None and ffn is None:
        sizes["d_ff"] = 0  # GPTConfig makes it 4 * d_model
    out = cfg.with_(**{k: v for k, v in sizes.items() if v is not None})
    if out.d_ff == cfg.d_ff:
        return out
    return out.with_(expert_d_ff=max(1, cfg.expert_d_ff * out.d_ff // cfg.d_ff))


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,),
          "dict": (dict,), "None": (type(None),)}


def check_types(cfg: TrainConfig) -> None:
    """Every field of the type its annotation names (``lr="0.1"``, ``save=5``,
    ``data=None`` from the Python API): one ``ValueError`` naming the flag, not a
    ``TypeError`` from deep inside. A bool is not an int here, nor an int a bool."""
    for f in fields(cfg):
        kinds = [k.strip() for k in str(f.type).split("|")]
        if not all(k in _TYPES for k in kinds):
            continue  # an annotation this check does not read
        value = getattr(cfg, f.name)
        ok = any(isinstance(value, _TYPES[k]) and not (
            isinstance(value, bool) and k in ("int", "float")) for k in kinds)
        if not ok:
            raise ValueError(f"--{f.name.replace('_', '-')} must be "
                             f"{' or '.join(kinds)}, got {value!r}")


def _choice(flag: str, value, allowed) -> None:
    if value not in allowed:
        shown = ", ".join(str(a) for a in allowed)
        raise ValueError(f"--{flag} must be one of {shown}, got {value!r}")


def validate(cfg: TrainConfig, world_size: int | None = None,
             rehearsal: bool = False) -> None:
    """Raise ``ValueError`` (one line) for anything that cannot run. ``world_size``: the
    size of a job started by torchrun, which the layout must fill exactly. ``rehearsal``
    (``engine.rehearse``: one rank at a time on one device): neither one GPU per rank nor
    a predicted fit is asked for (whether a rank fits is what a rehearsal measures)."""
    check_types(cfg)
    for name in ("dp", "pp", "tp", "cp", "ep", "steps", "microbatches", "virtual",
                 "batch_size"):
        checks.positive(name.replace("_", "-"), getattr(cfg, name))
    for f in fields(cfg):  # the choices a field declares (None: not given, when allowed)
        allowed, value = f.metadata.get("choices"), getattr(cfg, f.name)
        if allowed and not (value is None and f.default is None):
            _choice(f.name.replace("_", "-"), value, allowed)
    if cfg.grad_dtype == "bf16" and cfg.dtype != "bf16":
        raise ValueError("--grad-dtype bf16 needs --dtype bf16 (fp32 weights get fp32 gradients)")
    if world_size is not None and world_size != cfg.world_size:
        raise ValueError(f"layout {cfg.layout_name()} = {cfg.world_size} "
                         f"ranks does not match the job's world size {world_size}")
    check_source(cfg.data, cfg.tokenizer, cfg.text_field)  # before model_config reads it
    model = cfg.model_config()
    check_tp(model, cfg.tp, cfg.sp)
    checks.layout(model, cfg.dp, cfg.pp, cfg.tp, cfg.virtual, cfg.sp)
    check_schedule(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual, zero=cfg.zero,
                   recompute=cfg.recompute)
    if not isinstance(cfg.head_layers, int) or cfg.head_layers < 0:
        raise ValueError(f"--head-layers must be 0 or a positive integer, got "
                         f"{cfg.head_layers!r}")
    partition_layers(model.n_layer, cfg.pp * cfg.virtual, cfg.head_layers)  # (or says why)
    if cfg.head_layers and cfg.pp == 1:
        raise ValueError(f"--head-layers {cfg.head_layers} balances a pipeline's stages "
                         "for the head the last one runs: it needs --pp 2 or more")
    if cfg.chunked_loss and cfg.tp > 1:
        raise ValueError("--chunked-loss with --tp > 1 is not supported: tensor parallelism "
                         "has its own loss over logits split by vocabulary")
    if cfg.separate_reduce_group and (cfg.zero != 3 or cfg.dp * cfg.cp == 1):
        raise ValueError("--separate-reduce-group needs --zero 3 over more than one "
                         "data-parallel rank: it moves ZeRO-3's reduce-scatters to a "
                         "second communicator")
    if not (isinstance(cfg.dropout, (int, float)) and 0.0 <= cfg.dropout < 1.0):
        raise ValueError(f"--dropout must be in [0, 1), got {cfg.dropout!r}")
    check_batch_split(cfg.batch_size, cfg.dp, cfg.microbatches)
    _check_cp_and_offload(cfg, model)
    check_ep(cfg, model)
    if cfg.stop_at is not None and not 0 < cfg.stop_at <= cfg.steps:
        raise ValueError(f"--stop-at must be between 1 and --steps ({cfg.steps}), "
                         f"got {cfg.stop_at}")
    if cfg.lr is not None and (cfg.lr <= 0 or not math.isfinite(cfg.lr)):
        raise ValueError(f"--lr must be a positive number, got {cfg.lr}")
    checks.seed(cfg.seed)
    check_timeout(cfg.timeout)
    _check_device(cfg, rehearsal)
    _check_fp8(cfg, model)
    _check_compile(cfg)
    _check_recompute(cfg, model)
    _check_data_and_knobs(cfg, model)
    _check_files(cfg)
    if cfg.init_from is not None:
        check_init_from(cfg, model)
    if not rehearsal:
        check_fits(cfg, model)
    if cfg.data != "markov":  # last: it may tokenise, once every cheaper check has passed
        _check_corpus_size(cfg, model)


def _check_cp_and_offload(cfg: TrainConfig, model: GPTConfig) -> None:
    """Context parallelism cuts each sequence into 2 * cp equal chunks (zig-zag), and
    sequence parallelism then cuts a cp shard by tp; offload composes with ZeRO 0-3."""
    if cfg.cp > 1:
        if model.seq_len % (2 * cfg.cp):
            raise ValueError(f"--cp {cfg.cp} needs a sequence length divisible by 2*cp="
                             f"{2 * cfg.cp} (the zig-zag split's chunks); seq_len is "
                             f"{model.seq_len}")
        if cfg.sp and (model.seq_len // cfg.cp) % cfg.tp:
            raise ValueError(f"--sp with --cp {cfg.cp} needs seq_len/cp="
                             f"{model.seq_len // cfg.cp} divisible by --tp {cfg.tp}")


def _check_recompute(cfg: TrainConfig, model: GPTConfig) -> None:
    n = cfg.recompute_layers
    if cfg.recompute_rest != "none" and (cfg.recompute != "full" or n is None):
        raise ValueError("--recompute-rest cheap needs --recompute full --recompute-layers N "
                         "(the rest: the blocks past the first N)")
    if n is None:
        return
    if cfg.recompute == "none":
        raise ValueError("--recompute-layers needs --recompute full, cheap or selective "
                         "(which blocks to recompute, and how)")
    check_recompute_layers(n, model.n_layer, cfg.pp, cfg.virtual, cfg.head_layers)


def use_compile(cfg: TrainConfig) -> bool:
    """Whether the run's blocks run compiled: ``--compile`` / ``--no-compile``, else on
    CUDA devices where the layout compiles by default (``Layout.compiled_by_default``)."""
    return cfg.layout().compiled


def cheap_recompute(cfg: TrainConfig) -> bool:
    """Whether some blocks recompute cheaply (``--recompute cheap``, or the rest of
    ``--recompute-layers`` with ``--recompute-rest cheap``)."""
    return cfg.recompute == "cheap" or cfg.recompute_rest == "cheap"


def _check_compile(cfg: TrainConfig) -> None:
    if not cfg.compile:
        return
    if cfg.schedule in SPLIT_BACKWARD:
        raise ValueError(f"--compile with --schedule {cfg.schedule} is not supported: its "
                         "split weight gradient (W) needs each linear's own backward; use "
                         "--no-compile")
    if cfg.dropout:
        raise ValueError("--compile with --dropout recompiles the blocks at every step (the "
                         "masks' keys change); use --no-compile")
    if cheap_recompute(cfg):
        raise ValueError("--compile with --recompute cheap is not supported: it notes the "
                         "layer norms' outputs as the block runs, which a graph does not; "
                         "use --no-compile")


def _check_fp8(cfg: TrainConfig, model: GPTConfig) -> None:
    """The rules of float8 live in ``parallel/fp8.py``; here, the GEMM sizes a rank sees."""
    tokens = cfg.batch_size // (cfg.dp * cfg.microbatches) * (model.seq_len // cfg.cp)
    check_fp8(cfg.fp8, cfg.fp8_emulate, device_for(cfg), cfg.dtype, cfg.sp,
              gemm_sizes(model, cfg.tp, tokens), cheap_recompute(cfg))


def _check_files(cfg: TrainConfig) -> None:
    """Outputs that can be written, a checkpoint that can be resumed: before any rank."""
    checks.output_file("trace", cfg.trace)
    checks.output_dir("save", cfg.save)
    checks.output_dir("data-cache", cfg.data_cache)
    checks.distinct({"trace": cfg.trace, "save": cfg.save, "data-cache": cfg.data_cache},
                    {"data": cfg.data, "resume": cfg.resume})
    checks.not_inside({"trace": cfg.trace}, "save", cfg.save, checkpoint.SAVE_NAMES)
    if cfg.resume is not None:
        checkpoint.require_directory(cfg.resume)
        checkpoint.check_resume(cfg.resume, cfg)
    if cfg.save is not None:
        checkpoint.check_save(cfg.save, cfg.resume)


def predicted_bytes(cfg: TrainConfig, model: GPTConfig, stage: int | None = None,
                    device: str | None = None, **changes) -> int:
    """Bytes a rank of ``cfg`` (with ``changes`` to its fields) holds on its device, on
    pipeline stage ``stage`` or the most loaded one: the live tensors
    (``theory.memory.memory_per_stage`` of ``TrainConfig.layout``: model states by ZeRO
    stage, activations by recompute and sp, the pipeline's micro-batches in flight, the
    loss workspace, the temporary of the optimizer kernel it runs on ``device`` (default:
    its own; ``optimizer_kernel``); experts split by ep, the all-to-all's
    buffers) and what the device holds beyond them (``card_bytes``: the caching
    allocator's reserve and the runtime): ``theory.card.card_peak``, the function the
    planner prices layouts with."""
    device = device or ("cuda" if uses_cuda(cfg) else "cpu")
    layout = replace(cfg, **changes).layout(device)
    return card_peak(model, layout, device=device, stage=stage)["process"]


def _local_ranks(cfg: TrainConfig) -> int:
    """The ranks this machine runs: torchrun's ``LOCAL_WORLD_SIZE``, else all of them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", cfg.world_size))


def machine_memory(cfg: TrainConfig) -> tuple[str, int, int]:
    """(what, bytes, ranks sharing it): one GPU's memory under CUDA (ranks spread over
    the GPUs), else the host's physical memory, which every local rank shares."""
    local = _local_ranks(cfg)
    if device_for(cfg).type == "cuda":
        gpus = torch.cuda.device_count()
        size = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))
        return "memory per GPU", size, -(-local // gpus)
    return "host memory", doctor.host_memory()[0], local


def check_fits(cfg: TrainConfig, model: GPTConfig) -> None:
    """Refuse, before launch, a run whose predicted memory exceeds this machine's: per
    GPU under CUDA, the whole host's for CPU ranks (they share it). The prediction is
    ``predicted_bytes``, the planner's own; only a run predicted not to fit at all is
    refused (the planner keeps a margin on top: ``theory.card.MEMORY_MARGIN``). The
    message names the numbers and a layout of the same ranks that fits: on GPUs the
    planner's first choice for this card."""
    what, have, sharing = machine_memory(cfg)
    device = "cuda" if what == "memory per GPU" else "cpu"
    per_rank = predicted_bytes(cfg, model, device=device)
    if device == "cuda" and cfg.offload:
        _check_host_fits(cfg, model)
    if per_rank * sharing <= have:
        return
    gib = 2**30
    fix = _planned_layout(cfg, model, have) if device == "cuda" else None
    fix = fix or _fitting_layout(cfg, model, have // sharing, device)
    raise ValueError(
        f"this run does not fit: {cfg.model} dp={cfg.dp} pp={cfg.pp} tp={cfg.tp} "
        + (f"cp={cfg.cp} " if cfg.cp > 1 else "")
        + f"zero={cfg.zero} {cfg.dtype} needs {per_rank / gib:.1f} GiB per rank"
        + (f" x {sharing} ranks = {per_rank * sharing / gib:.1f} GiB" if sharing > 1 else "")
        + f" of {what}, which has {have / gib:.1f} GiB; "
        + (f"{fix[0]} would need {fix[1] / gib:.1f} GiB per rank" if fix else
           f"no layout of {cfg.world_size} ranks fits: use more machines or a smaller model"))


def _check_host_fits(cfg: TrainConfig, model: GPTConfig) -> None:
    """``--offload`` on GPUs: what the host keeps for every rank of this machine (fp32
    master, gradient and AdamW moments of each rank's shard, the upload buffer:
    ``theory.card.card_peak``'s ``host``) must fit its physical memory
    (``theory.card.host_fit``, the planner's test), or the kernel's out-of-memory killer
    ends a rank mid-step. Refused in one line, with the numbers."""
    per_rank = card_peak(model, cfg.layout("cuda"))["host"]
    local, have = _local_ranks(cfg), doctor.host_memory()[0]
    if host_fit(per_rank, local, have):
        return
    gib = 2**30
    raise ValueError(
        f"this run does not fit the host: --offload keeps {per_rank / gib:.1f} GiB per rank "
        "on the host (fp32 weights, gradients and AdamW moments of its shard)"
        + (f" x {local} ranks = {per_rank * local / gib:.1f} GiB" if local > 1 else "")
        + f", and the host has {have / gib:.1f} GiB; shard them over more ranks "
        "(--zero 1-3 with a larger --dp) or use more machines")


def _planned_layout(cfg: TrainConfig, model: GPTConfig, capacity: int) -> tuple | None:
    """The planner's first choice for this model, batch and number of GPUs, on a card of
    ``capacity`` bytes: its flags and its predicted bytes per rank, or None."""
    kind = clusters.gpu_for_device(torch.cuda.get_device_name(0)
                                   if torch.cuda.is_available() else "")
    gpu = replace(clusters.GPUS[kind], memory=capacity)
    where = clusters.cluster(cfg.world_size, gpu, cfg.world_size)
    best = plan(model, where, cfg.batch_size, dtype=cfg.dtype,
                optimizer_kernel=optimizer_kernel(cfg, on_cuda=True, host=False)).best
    if best is None:
        return None
    flags = " ".join(best.layout.train_flags(cfg.model)[2:])
    return flags, best.memory["process"]


def _fitting_layout(cfg: TrainConfig, model: GPTConfig, budget: int,
                    device: str = "cpu") -> tuple | None:
    """The first layout of the same world size that fits ``budget`` bytes per rank, in
    the order: least ZeRO, least model parallelism (tp * pp), fewest micro-batches; or
    None. Flags for it, and its bytes per rank."""
    world, found = cfg.world_size, []
    for tp in (t for t in range(1, world + 1) if world % t == 0):
        for pp in (p for p in range(1, world // tp + 1) if (world // tp) % p == 0):
            dp = world // (tp * pp)
            if dp % cfg.ep:
                continue
            for m in sorted({cfg.microbatches, *(2**k for k in range(12))}):
                try:
                    check_tp(model, tp, cfg.sp)
                    checks.layout(model, dp, pp, tp, 1, cfg.sp)
                    check_batch_split(cfg.batch_size, dp, m)
                except ValueError:
                    continue
                for zero in range(4):
                    need = predicted_bytes(cfg, model, device=device, dp=dp, pp=pp, tp=tp,
                                           zero=zero, microbatches=m, virtual=1,
                                           schedule="1f1b")
                    if need <= budget:
                        found.append(((zero, tp * pp, m), dp, pp, tp, zero, m, need))
    if not found:
        return None
    _, dp, pp, tp, zero, m, need = min(found, key=lambda f: f[0])
    return f"--dp {dp} --pp {pp} --tp {tp} --zero {zero} --microbatches {m}", need


def _check_data_and_knobs(cfg: TrainConfig, model: GPTConfig) -> None:
    for name in ("eval_every", "save_every", "keep", "warmup"):
        value = getattr(cfg, name)
        if name == "warmup" and value is None:
            continue  # the preset's recipe
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be 0 or a positive integer, "
                             f"got {value!r}")
    for name in ("log_every", "eval_batches"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, "
                             f"got {value!r}")
    for name in ("grad_clip", "weight_decay"):
        value = getattr(cfg, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a number >= 0, "
                             f"got {value!r}")
    if cfg.save_every and not cfg.save:
        raise ValueError("--save-every needs --save DIR (where to write the checkpoints)")
    if cfg.data == "markov" and model.vocab_size <= MARKOV_BRANCHING:
        raise ValueError(f"--vocab {model.vocab_size} is too small for the generated Markov "
                         f"corpus (each token has {MARKOV_BRANCHING} successors): pass "
                         f"--vocab {MARKOV_BRANCHING + 1} or more")
    if cfg.data != "markov" and cfg.tokenizer == "byte" and model.vocab_size < 256 \
            and not cfg.data.endswith(".bin"):
        raise ValueError(f"--vocab {model.vocab_size} is too small for the byte tokenizer "
                         "(256 tokens)")
    if cfg.data != "markov" and cfg.tokenizer == "bpe" and model.vocab_size < 512:
        raise ValueError(f"--tokenizer bpe needs a vocabulary of 512 or more (the 256 bytes "
                         f"plus merges), got {model.vocab_size}: pass --vocab")
    if cfg.data != "markov" and cfg.tokenizer.endswith(".json"):  # a tokenizer.json
        need = tokenizer_vocab(cfg.tokenizer)
        if need > model.vocab_size:
            raise ValueError(f"--tokenizer {cfg.tokenizer} has {need} tokens: the model's "
                             f"vocabulary ({model.vocab_size}) is too small")
    if cfg.data.endswith(".bin"):
        open_tokens(cfg.data, model.vocab_size)  # whole tokens of the dtype it holds
        known = sidecar(cfg.data).get("vocab_size")
        if known is not None and known > model.vocab_size:
            raise ValueError(f"--data {cfg.data} holds tokens up to {known - 1}: --vocab "
                             f"{model.vocab_size} is too small")


def _check_corpus_size(cfg: TrainConfig, model: GPTConfig) -> None:
    """The corpus against the sequence length and the evaluation, before any rank starts:
    text is tokenised here to count its tokens (the cache keeps them for the ranks)."""
    n_tokens = token_count(cfg, model.vocab_size)  # (its own errors name --data)
    try:
        _, n_val = split_sizes(n_tokens, model.seq_len)
    except ValueError as e:
        raise ValueError(f"--data {cfg.data}: {e}") from None
    # more rows than the held-out split's distinct sequences only re-reads them, and a
    # large --eval-batches would evaluate for minutes
    rows = held_out_rows(n_val, model.seq_len)
    most = max(1, rows // cfg.batch_size)
    if cfg.eval_every and cfg.eval_batches > most:
        raise ValueError(f"--eval-batches {cfg.eval_batches} reads "
                         f"{cfg.eval_batches * cfg.batch_size:,} held-out sequences "
                         f"({cfg.batch_size} a batch); the held-out split of --data "
                         f"{cfg.data} (its last {n_val:,} tokens) has {rows:,}: pass "
                         f"--eval-batches {most} or fewer")


def _check_device(cfg: TrainConfig, rehearsal: bool = False) -> None:
    if cfg.backend == "nccl" or cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--backend nccl and --device cuda need a CUDA GPU; this machine "
                             "has none: use --backend gloo")
    if cfg.backend == "nccl" and "LOCAL_WORLD_SIZE" not in os.environ and not rehearsal:
        if cfg.world_size > torch.cuda.device_count():
            raise ValueError(f"--backend nccl runs one rank per GPU: {cfg.world_size} ranks "
                             f"but {torch.cuda.device_count()} GPU(s); use --backend gloo "
                             "--device cuda to share a GPU")
    if cfg.backend == "nccl" and cfg.device == "cpu":
        raise ValueError("--backend nccl moves CUDA tensors only: drop --device cpu")


def uses_cuda(cfg: TrainConfig) -> bool:
    """Whether the ranks compute on CUDA devices: ``--device cuda``, or ``auto`` on NCCL."""
    return cfg.device == "cuda" or (cfg.device == "auto" and cfg.backend == "nccl")


def device_for(cfg: TrainConfig):
    """The torch device this rank computes on."""
    if uses_cuda(cfg):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")


def optimizer_class(cfg: TrainConfig) -> type:
    """The torch optimizer every layout (and the reference) steps with.

    Plain SGD (no momentum) is in the parity set because it has no normalisation: a
    gradient 2x too large moves the weights 2x too far, where AdamW would divide it away.
    """
    return torch.optim.SGD if cfg.optimizer == "sgd" else torch.optim.AdamW


def optimizer_kernel(cfg: TrainConfig, on_cuda: bool | None = None,
                     host: bool | None = None) -> str:
    """Which torch kernel steps the optimizer (``theory.memory.OPTIMIZER_KERNELS``; the
    memory model books its temporary): ``host`` where it steps on the CPU (``host``,
    default ``--offload``), ``fused`` with ``--fused``, and unless ``--no-fused`` for
    AdamW anywhere and SGD on CUDA (``on_cuda``, default the run's device), else torch's
    own choice: ``foreach`` (multi-tensor) on CUDA, ``forloop`` (a tensor at a time) on
    the CPU (``optimizer_kwargs`` says why AdamW is fused on the CPU too)."""
    if cfg.offload if host is None else host:
        return "host"
    on_cuda = uses_cuda(cfg) if on_cuda is None else on_cuda
    if cfg.fused or (cfg.fused is None and (on_cuda or cfg.optimizer != "sgd")):
        return "fused"
    return "foreach" if on_cuda else "forloop"


def optimizer_kwargs(cfg: TrainConfig, host: bool = False) -> dict:
    """Keyword arguments for ``optimizer_class(cfg)`` (the learning rate is set per step),
    for ``optimizer_kernel(cfg, host=host)``.

    AdamW steps with torch's fused kernel unless ``--no-fused``: one pass over each
    tensor, where torch's default per-tensor loop makes about eight (a new tensor for the
    denominator among them). ZeRO steps flat buffers, each larger than a CPU's cache, so
    on the CPU the loop's passes stream from memory where a per-parameter optimizer's
    stay in cache (``benchmarks/bench_dp.py`` measures both kernels against DDP); on CUDA
    the fused kernel is one launch for every parameter. ``host`` (ZeRO-Offload's CPU
    step) keeps it even under ``--no-fused`` (``benchmarks/offload_host.py``). Plain SGD
    is one pass already: the fused kernel only on CUDA, or when ``--fused`` asks."""
    kwargs = {"lr": learning_rate(cfg), "weight_decay": cfg.weight_decay}
    kernel = optimizer_kernel(cfg, host=host)
    if kernel == "fused" or (kernel == "host" and (cfg.fused or cfg.optimizer != "sgd")):
        kwargs["fused"] = True
    return kwargs


# The published recipes the presets copy: peak learning rate and warm-up tokens. GPT-3
# (Brown et al. 2020, arXiv 2005.14165, Table 2.1 and Appendix B: Adam, warm-up over the
# first 375M tokens, cosine decay to 10%); the GPT-2 sizes take GPT-3's rate for the
# same size (nanoGPT does the same). gpt-1t has no published run: 175B's rate. gpt-10m
# takes nanoGPT's recipe for its character-level baby GPT of the same size
# (config/train_shakespeare_char.py: 1e-3, 100 warm-up iterations of 64 x 256 tokens,
# decay to a tenth). moe-1.3b takes DeepSpeed-MoE's rate for its 1.3B+MoE-128
# (Rajbhandari et al. 2022, arXiv 2201.05596; Megatron-DeepSpeed's
# ds_pretrain_gpt_1.3B_MoE128.sh: 1.2e-4, below the dense base's 2e-4, which they found
# less stable with experts) and GPT-3's warm-up. Presets not listed (tiny, small,
# moe-tiny) keep the small models' 3e-3 and 5 steps.
RECIPES: dict[str, tuple[float, float]] = {
    "gpt-10m": (1.0e-3, 100 * 64 * 256),
    "gpt2-125m": (6.0e-4, 375e6), "gpt2-350m": (3.0e-4, 375e6),
    "gpt-1.3b": (2.0e-4, 375e6), "moe-1.3b": (1.2e-4, 375e6),
    "gpt-6.7b": (1.2e-4, 375e6), "gpt-13b": (1.0e-4, 375e6),
    "gpt3-175b": (0.6e-4, 375e6), "gpt-1t": (0.6e-4, 375e6),
}
SMALL_MODEL_LR, SMALL_MODEL_WARMUP = 3e-3, 5


def learning_rate(cfg: TrainConfig) -> float:
    """``--lr``, else the preset's published peak rate (``RECIPES``)."""
    if cfg.lr is not None:
        return cfg.lr
    return RECIPES.get(cfg.model, (SMALL_MODEL_LR, 0))[0]


def warmup_steps(cfg: TrainConfig) -> int:
    """``--warmup``, else the recipe's warm-up tokens in this run's steps, at most a tenth
    of the run (a 20-step trial still reaches its rate; a long run warms up as published)."""
    if cfg.warmup is not None:
        return cfg.warmup
    if cfg.model not in RECIPES:
        return SMALL_MODEL_WARMUP
    tokens_per_step = cfg.batch_size * cfg.model_config().seq_len
    return max(1, min(math.ceil(RECIPES[cfg.model][1] / tokens_per_step), cfg.steps // 10))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to the peak rate, then cosine decay to a tenth of it."""
    lr, warmup = learning_rate(cfg), warmup_steps(cfg)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
