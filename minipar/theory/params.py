"""How many parameters a GPT has, where they live, and how many FLOPs a token costs.

Everything here is arithmetic on a ``GPTConfig``; nothing builds a model. The counts are
exact for ``minipar.model.GPT`` (a test compares them with ``GPT(cfg).num_params()``
and with every parameter's shape), so the memory theory built on them can be compared
byte for byte with a real run.

Parameters of one transformer layer (h = d_model, f = d_ff):

    ln1, ln2            2 * 2h      (gain and bias)
    attn.qkv            3h*h + 3h
    attn.proj           h*h + h
    mlp.fc              f*h + f
    mlp.proj            h*f + h
    total               4h^2 + 2hf + 9h + f   = 12h^2 + 13h when f = 4h

which is the per-layer count of Narayanan et al. 2021 (arXiv 2104.04473, Sec. 5.1),
``12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))`` for the whole model with a tied head.
A mixture-of-experts block (``cfg.is_moe``) holds a router (hE) and E expert MLPs
(2hg + g + h each, g = ``expert_d_ff``) instead of the MLP; a token's matmuls use the
router and k experts (``theory.moe``). Neither is split by tp; ep splits the experts.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053) splits the
column-parallel ``qkv`` and ``fc`` (weight and bias) and the row-parallel ``proj``
weights across ``tp`` ranks, and keeps layer norms and the row-parallel biases whole on
every rank. The embedding and the head are split along the vocabulary; the position
embedding is small and stays whole. Pipeline parallelism puts the embeddings on the
first stage and the final norm and head on the last; a tied head then needs its own
copy of the embedding on the last stage (Megatron keeps one and all-reduces its
gradient with the first stage), so tying saves memory only when pp = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache

from minipar.model import GPTConfig
from minipar.parallel.pp import partition_layers  # the pipeline's own split rule
from minipar.parallel.recompute import check_recompute_layers
from minipar.theory.models import get_model

SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor: its name in ``GPT``, size, and how parallelism places it.

    ``where`` is ``"layer"`` (one per transformer block), ``"first"`` (first pipeline
    stage) or ``"last"`` (last stage). ``tp_split`` says whether tensor parallelism
    divides it by ``tp`` (otherwise every tp rank keeps the whole tensor).
    """

    name: str
    numel: int
    tp_split: bool
    where: str


def param_table(cfg: GPTConfig | str) -> tuple[ParamInfo, ...]:
    """Every parameter of ``GPT(cfg)``: the layer's once, then embeddings and head."""
    return _param_table(get_model(cfg))


@cache  # (a planner asks for the same model's table for every layout it prices)
def _param_table(cfg: GPTConfig) -> tuple[ParamInfo, ...]:
    h, f, v, s = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.seq_len
    layer = [
        ("ln1.weight", h, False), ("ln1.bias", h, False),
        ("attn.qkv.weight", 3 * h * h, True), ("attn.qkv.bias", 3 * h, True),
        ("attn.proj.weight", h * h, True), ("attn.proj.bias", h, False),
        ("ln2.weight", h, False), ("ln2.bias", h, False),
        ("mlp.fc.weight", f * h, True), ("mlp.fc.bias", f, True),
        ("mlp.proj.weight", h * f, True), ("mlp.proj.bias", h, False),
    ]
    table = [ParamInfo(n, k, split, "layer") for n, k, split in layer]
    table += [
        ParamInfo("tok_emb.weight", v * h, True, "first"),
        ParamInfo("pos_emb.weight", s * h, False, "first"),
        ParamInfo("ln_f.weight", h, False, "last"),
        ParamInfo("ln_f.bias", h, False, "last"),
        # With tied embeddings this is the same tensor as tok_emb on a single stage.
        ParamInfo("head.weight", v * h, True, "last"),
    ]
    return tuple(table)


def layer_params(cfg: GPTConfig | str) -> int:
    """Parameters of one transformer layer: 4h^2 + 2hf + 9h + f."""
    return sum(p.numel for p in param_table(cfg) if p.where == "layer")


def _moe_block(cfg: GPTConfig, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(parameters an MoE block holds on one rank beyond a dense block's tp share, of
    which expert weights): the router and E/ep experts, each its MLP's tp share (the
    ``proj`` bias whole), less the dense MLP's tp share."""
    h, f, g = cfg.d_model, cfg.d_ff, cfg.expert_d_ff
    experts = cfg.n_expert // ep * ((2 * h * g + g) // tp + h)
    mlp = (2 * h * f + f) // tp + h
    return h * cfg.n_expert + experts - mlp, experts


def stage_moe_layers(cfg: GPTConfig | str, pp: int = 1, stage: int = 0, virtual: int = 1,
                     head_layers: int = 0) -> int:
    """Mixture-of-experts blocks held by pipeline ``stage`` (``stage_layers``' rule)."""
    cfg = get_model(cfg)
    if not cfg.n_expert:
        return 0
    chunks = partition_layers(cfg.n_layer, pp * virtual, head_layers)
    return sum(cfg.is_moe(i) for c in range(stage, pp * virtual, pp) for i in chunks[c])


def stage_recomputed_layers(cfg: GPTConfig | str, pp: int = 1, stage: int = 0,
                            virtual: int = 1, head_layers: int = 0,
                            recompute_layers: int | None = None) -> tuple[int, int]:
    """(blocks, MoE blocks among them) of pipeline ``stage`` that recompute: the first
    ``recompute_layers`` N of each of its chunks, every block with N None (the rule of
    ``parallel.recompute.apply_recompute``, Megatron's ``--recompute-num-layers``); an N
    ``train`` refuses is refused here too (``check_recompute_layers``). The memory and
    the communication theory both ask here."""
    return _stage_recomputed_layers(get_model(cfg), pp, stage, virtual, head_layers,
                                    recompute_layers)


@lru_cache(maxsize=4096)  # (asked for every stage of every layout a planner prices)
def _stage_recomputed_layers(cfg: GPTConfig, pp: int, stage: int, virtual: int,
                             head_layers: int, recompute_layers: int | None) -> tuple[int, int]:
    check_recompute_layers(recompute_layers, cfg.n_layer, pp, virtual, head_layers)
    chunks = partition_layers(cfg.n_layer, pp * virtual, head_layers)
    redone = [i for c in range(stage, pp * virtual, pp) for i in chunks[c][:recompute_layers]]
    return len(redone), sum(cfg.is_moe(i) for i in redone) if cfg.n_expert else 0


def param_count(cfg: GPTConfig | str) -> int:
    """Parameters of the whole model, a tied head counted once (= ``GPT.num_params()``)."""
    cfg = get_model(cfg)
    total = cfg.n_layer * layer_params(cfg) + cfg.n_moe_layers * _moe_block(cfg)[0]
    total += sum(p.numel for p in param_table(cfg) if p.where != "layer")
    if cfg.tie_embeddings:
        total -= cfg.vocab_size * cfg.d_model
    return total


def check_divisible(cfg: GPTConfig | str, tp: int = 1) -> None:
    """Raise ValueError unless tensor parallelism can split the model ``tp`` ways: heads,
    FFN width and vocabulary divisible by tp (``minipar.parallel.tp.check_tp``'s rule)."""
    cfg = get_model(cfg)
    for name in ("n_head", "d_ff", "vocab_size"):
        if getattr(cfg, name) % tp:
            raise ValueError(f"{name}={getattr(cfg, name)} is not divisible by tp={tp}")


def head_layers_for(cfg: GPTConfig | str, recompute: str = "none") -> int:
    """The ``head_layers`` that balances a pipeline: the head's FLOPs a token (forward
    and backward, ``head_flops_per_token``) in layers' (``layer_flops_per_token``)."""
    cfg = get_model(cfg)
    return round(head_flops_per_token(cfg) / layer_flops_per_token(cfg, recompute))


def stage_layers(n_layer: int, pp: int = 1, stage: int = 0, virtual: int = 1,
                 head_layers: int = 0) -> int:
    """Transformer layers held by pipeline ``stage``: it holds chunks stage, stage + pp,
    ... of ``pp * virtual`` chunks (``partition_layers``, the pipeline's own rule)."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is outside 0..{pp - 1}")
    chunks = partition_layers(n_layer, pp * virtual, head_layers)
    return sum(len(chunks[c]) for c in range(stage, pp * virtual, pp))


def block_params(cfg: GPTConfig | str, tp: int = 1, ep: int = 1, moe: bool = False) -> int:
    """Parameters of one block on one rank after the tp split; ``moe``: an MoE block's
    (its router and E/ep experts in place of the MLP)."""
    return _block_params(get_model(cfg), tp, ep, moe)


@cache  # (asked for every layout and stage a planner prices)
def _block_params(cfg: GPTConfig, tp: int, ep: int, moe: bool) -> int:
    n = sum(_share(p, tp) for p in param_table(cfg) if p.where == "layer")
    return n + (_moe_block(cfg, tp, ep)[0] if moe else 0)


def _share(p: ParamInfo, tp: int) -> int:
    """A rank's elements of ``p`` after the tp split (a replicated weight: all)."""
    return p.numel // tp if p.tp_split else p.numel


def stage_params(cfg: GPTConfig | str, pp: int = 1, tp: int = 1, stage: int = 0,
                 virtual: int = 1, head_layers: int = 0, ep: int = 1) -> int:
    """Parameters held by one rank of pipeline stage ``stage`` after a tp-way split (and
    an ep-way split of the experts: ``stage_expert_params`` of them are expert weights).

    With ``virtual`` chunks per stage (interleaved schedule) a stage holds about the
    same number of layers, only not consecutive ones.
    """
    return _stage_params(get_model(cfg), pp, tp, stage, virtual, head_layers, ep)


@lru_cache(maxsize=4096)  # (asked for every stage of every layout a planner prices)
def _stage_params(cfg: GPTConfig, pp: int, tp: int, stage: int, virtual: int,
                  head_layers: int, ep: int) -> int:
    check_divisible(cfg, tp)
    layers = stage_layers(cfg.n_layer, pp, stage, virtual, head_layers)
    table = param_table(cfg)
    n = layers * block_params(cfg, tp)
    if cfg.n_expert:
        n += stage_moe_layers(cfg, pp, stage, virtual, head_layers) * _moe_block(cfg, tp, ep)[0]
    if stage == 0:
        n += sum(_share(p, tp) for p in table if p.where == "first")
    if stage == pp - 1:
        n += sum(_share(p, tp) for p in table if p.where == "last")
        if cfg.tie_embeddings and pp == 1:
            n -= cfg.vocab_size * cfg.d_model // tp  # the head is the embedding
    return n


def stage_expert_params(cfg: GPTConfig | str, pp: int = 1, stage: int = 0,
                        virtual: int = 1, head_layers: int = 0, ep: int = 1,
                        tp: int = 1) -> int:
    """Of ``stage_params``, the expert weights (E/ep experts of each MoE block, their tp
    share): the part whose gradients reduce, and whose ZeRO shards split, over dp / ep
    replicas."""
    cfg = get_model(cfg)
    if not cfg.n_expert:
        return 0
    return stage_moe_layers(cfg, pp, stage, virtual, head_layers) * _moe_block(cfg, tp, ep)[1]


def hook_params(cfg: GPTConfig | str, pp: int = 1, tp: int = 1, stage: int = 0,
                virtual: int = 1, head_layers: int = 0, zero: int = 0) -> int:
    """Of ``stage_params``, those whose micro-batch gradient the optimizer's hook adds to
    the fp32 sum when each linear weight's gradient is fused into its GEMM
    (``parallel/wgrad_fusion.py``, plain ``nn.Linear`` only: none under tp): the
    embeddings, norms and biases, a head tied to the embedding on the same rank, and
    under ZeRO-3 the head (its own call gathers its weight: it stays unfused)."""
    cfg = get_model(cfg)
    n = stage_params(cfg, pp, tp, stage, virtual, head_layers)
    if tp > 1:
        return n
    n -= stage_layers(cfg.n_layer, pp, stage, virtual, head_layers) * layer_matmul_params(cfg)
    if cfg.n_expert:  # an MoE block fuses its router; its experts are no nn.Linear
        n += stage_moe_layers(cfg, pp, stage, virtual, head_layers) * cfg.d_model * (
            2 * cfg.d_ff - cfg.n_expert)
    if stage == pp - 1 and not (cfg.tie_embeddings and pp == 1) and zero < 3:
        n -= cfg.vocab_size * cfg.d_model
    return n


# --- FLOPs ---------------------------------------------------------------------------
def matmul_params(cfg: GPTConfig | str) -> int:
    """Weights that take part in a token's matrix multiplies: every layer's four weight
    matrices and the head (V x h, tied or not); an MoE block's router and the k experts
    a token uses instead of its MLP (the *active* weights). Embedding lookups, biases and
    norms cost no matmul FLOPs. This is the N of "6N FLOPs per token" (Kaplan et al.
    2020)."""
    cfg = get_model(cfg)
    h = cfg.d_model
    moe = h * cfg.n_expert + cfg.moe_top_k * 2 * h * cfg.expert_d_ff - 2 * h * cfg.d_ff
    return (cfg.n_layer * layer_matmul_params(cfg) + cfg.n_moe_layers * moe
            + cfg.vocab_size * h)


def layer_matmul_params(cfg: GPTConfig | str) -> int:
    """One layer's four weight matrices: 4 h^2 (q|k|v, projection) + 2 h f (the MLP)."""
    cfg = get_model(cfg)
    return 4 * cfg.d_model ** 2 + 2 * cfg.d_model * cfg.d_ff


def float8_linears(cfg: GPTConfig | str, tp: int = 1, moe: bool = False
                   ) -> tuple[tuple[int, int], ...]:
    """(in, out) features, on one tp rank, of the linears ``--fp8`` multiplies in float8
    in a block (``parallel.fp8.apply_fp8``): a dense block's four (q|k|v and fc split
    along their outputs, the two projections along their inputs); an MoE block's two of
    attention (its router stays in the compute dtype, its experts' grouped GEMMs in
    16 bits). Not the embeddings, not the head."""
    cfg = get_model(cfg)
    h, f = cfg.d_model, cfg.d_ff
    attention = ((h, 3 * h // tp), (h // tp, h))
    return attention if moe else attention + ((h, f // tp), (f // tp, h))


def attention_flops_per_token(cfg: GPTConfig | str, count: str = "full") -> float:
    """Forward FLOPs per token of the two attention products (Q K^T and softmax . V).

    ``count="full"``: 2 * 2 * s * h per layer, as Narayanan et al. (2104.04473, Sec. 5.1,
    the 4 B s^2 h term) and PaLM (Chowdhery et al. 2022, App. B, ``12 L H Q T`` for
    forward + backward) count it, ignoring the causal mask.
    ``count="kaplan"``: half that, 2 * s * h per layer (Kaplan et al. 2020, arXiv
    2001.08361, Table 1, "Attention: Mask" 2 n_layer n_ctx d_attn); numerically the same
    as counting only the unmasked half of a causal attention.
    """
    cfg = get_model(cfg)
    per_layer = {"full": 4, "kaplan": 2}
    if count not in per_layer:
        raise ValueError(f"count must be one of {list(per_layer)}, got {count!r}")
    return per_layer[count] * cfg.n_layer * cfg.seq_len * cfg.d_model


def model_flops_per_token(cfg: GPTConfig | str, attention: str = "full") -> float:
    """Training FLOPs per token the model needs: forward + backward = 3 x forward.

    ``6N + 12 L s h`` with N = ``matmul_params`` (PaLM, App. B; the no-recompute form of
    Narayanan's count). This is the numerator of model FLOPs utilisation (MFU): it does
    not grow when a run recomputes activations.
    """
    cfg = get_model(cfg)
    return 6.0 * matmul_params(cfg) + 3.0 * attention_flops_per_token(cfg, attention)


def hardware_flops_per_token(cfg: GPTConfig | str, recompute: str = "none",
                             attention: str = "full") -> float:
    """Training FLOPs per token the hardware executes, recomputation included.

    ``full`` recomputation runs every layer's forward again in the backward pass (not the
    head): + 2 N_layers + the attention forward. ``selective`` (Korthikanti et al. 2022,
    arXiv 2205.05198, Sec. 5) recomputes only the attention products. With full
    recomputation and d_ff = 4h this equals Narayanan's ``96 B s l h^2 (1 + s/(6h) +
    V/(16 l h))`` per batch exactly (a test checks it). ``cheap`` recomputation redoes no
    product (its cost is memory traffic: ``rates.cheap_recompute_seconds``).
    """
    cfg = get_model(cfg)
    base = model_flops_per_token(cfg, attention)
    attn = attention_flops_per_token(cfg, attention)
    layers = matmul_params(cfg) - cfg.vocab_size * cfg.d_model
    extra = {"none": 0.0, "selective": attn, "cheap": 0.0, "full": 2.0 * layers + attn}
    if recompute not in extra:
        raise ValueError(f"recompute must be one of {list(extra)}, got {recompute!r}")
    return base + extra[recompute]


def head_flops_per_token(cfg: GPTConfig | str) -> float:
    """Training FLOPs per token of the head: the V x h matmul, 2 V h forward and twice
    that backward (input and weight gradient). Recomputation never repeats it, and the
    final norm and the loss add no matmul FLOPs (their cost is memory traffic)."""
    cfg = get_model(cfg)
    return 6.0 * cfg.vocab_size * cfg.d_model


def layer_flops_per_token(cfg: GPTConfig | str, recompute: str = "none",
                          attention: str = "full") -> float:
    """Training FLOPs per token of one transformer layer (``hardware_flops_per_token``
    without the head, over the layers): what a calibrated block rate is measured in."""
    cfg = get_model(cfg)
    head = head_flops_per_token(cfg)
    return (hardware_flops_per_token(cfg, recompute, attention) - head) / cfg.n_layer


def narayanan_flops(cfg: GPTConfig | str, batch: int, recompute: bool = True) -> float:
    """FLOPs of one training iteration of ``batch`` sequences, Narayanan et al. 2021
    (arXiv 2104.04473, Sec. 5.1, eq. for F):

        with recomputation:     96 B s l h^2 (1 + s/(6h) + V/(16 l h))
        without recomputation:  72 B s l h^2 (1 + s/(6h) + V/(12 l h))

    The paper assumes d_ff = 4h and counts matmuls only (no biases or norms).
    """
    cfg = get_model(cfg)
    b, s, l_, h, v = batch, cfg.seq_len, cfg.n_layer, cfg.d_model, cfg.vocab_size
    if recompute:
        return 96.0 * b * s * l_ * h * h * (1 + s / (6 * h) + v / (16 * l_ * h))
    return 72.0 * b * s * l_ * h * h * (1 + s / (6 * h) + v / (12 * l_ * h))


def training_days(n_params: float, tokens: float, gpus: int, flops_per_gpu: float,
                  recompute: bool = True) -> float:
    """End-to-end training time in days, ``8 T P / (n X)`` (Narayanan et al. 2021,
    Sec. 5.1; 6 instead of 8 without recomputation): T tokens, P parameters, n GPUs
    each sustaining X FLOP/s. Their examples: GPT-3 175B, 300B tokens, 1024 A100s at
    140 TFLOP/s: 34 days; 1T, 450B tokens, 3072 A100s at 163 TFLOP/s: 84 days."""
    factor = 8.0 if recompute else 6.0
    return factor * tokens * n_params / (gpus * flops_per_gpu) / SECONDS_PER_DAY


def mfu(tokens_per_second: float, cfg: GPTConfig | str, gpus: int,
        peak_flops: float) -> float:
    """Model FLOPs utilisation from a measured throughput (Chowdhery et al. 2022, PaLM,
    App. B): the FLOPs the model needs per second over what the GPUs could do.
    Recomputation does not count (use ``hfu`` for the hardware's view)."""
    return tokens_per_second * model_flops_per_token(cfg) / (gpus * peak_flops)


def hfu(tokens_per_second: float, cfg: GPTConfig | str, gpus: int, peak_flops: float,
        recompute: str = "none") -> float:
    """Hardware FLOPs utilisation: like ``mfu`` but counting recomputed FLOPs too."""
    return (tokens_per_second * hardware_flops_per_token(cfg, recompute)
            / (gpus * peak_flops))
