"""Activation memory of one tensor-parallel layer, as minipar's layers keep it.

Korthikanti et al. 2022 (arXiv 2205.05198, eqs. 2 and 4) count what a transformer layer
keeps for backward with tensor and sequence parallelism. ``activation_elements_per_layer``
counts it for minipar's own layers (``minipar.parallel.tp``, fused attention, no
dropout); ``minipar.meter.saved_tensor_elements`` measures the same thing on a real layer,
and the tests hold the two equal. ``deferred_weight_grad_bytes``: what ZB-H1's split
backward keeps in addition, until a layer's weight-gradient pass. ``loss_workspace``:
the loss backward's fp32 transients on the last stage.
"""

from __future__ import annotations

from minipar.model import GPTConfig
from minipar.parallel.chunked_loss import CHUNK_BYTES
from minipar.theory.models import get_model

ACCOUNTINGS = ("korthikanti", "fused")


def activation_elements_per_layer(cfg: GPTConfig, batch: int, tp: int,
                                  sequence_parallel: bool) -> int:
    """Elements one layer keeps for backward on one tp rank, as minipar implements it
    (dropout = 0, SDPA attention); b = batch, s = seq_len, h, f = d_ff, a, t = tp:

    * outside the tensor-parallel regions: the two layer-norm inputs and outputs (the
      outputs are the qkv and fc inputs), 4sbh, and their mean and 1/std, 4sb;
      divided by t only with sequence parallelism;
    * inside (always divided by t): q, k, v (3sbh), the attention output (sbh, proj's
      input), GELU's input and output (2sbf), SDPA's logsumexp (asb).

    Korthikanti et al. (eqs. 2 and 4) count fp16 bytes: sbh(10 + 24/t + 5as/(ht))
    without SP, sbh(34/t + 5as/(ht)) with. Ours, in elements: sbh(4 + 12/t) vs 16sbh/t
    for f = 4h, plus the small sb terms. The differences: no dropout masks (the paper's
    2sbh bytes; none at dropout 0), and no s x s scores (the 5as/(ht) term): fused
    attention recomputes them in backward from the logsumexp.
    """
    b, s, h, f, a, t = batch, cfg.seq_len, cfg.d_model, cfg.d_ff, cfg.n_head, tp
    outside = 4 * s * b * h + 4 * s * b
    inside = 4 * s * b * h + 2 * s * b * f + a * s * b
    return (outside // t if sequence_parallel else outside) + inside // t


def deferred_weight_grad_bytes(cfg: GPTConfig | str, microbatch_size: int = 1, tp: int = 1,
                               sp: bool = False, dtype: str = "bf16") -> float:
    """Bytes one layer keeps per micro-batch between its B and W passes under ZB-H1:
    the gradient of each parameter-owning module's output (W multiplies a linear's by
    its stored input; a layer norm's weights need theirs too). Column-parallel outputs
    (q|k|v, the MLP's first) are split by tp; row-parallel ones (the attention
    projection, the MLP's second) and the two layer norms' only with sequence
    parallelism. ``theory.memory.stage_activations`` counts it with what the same W
    keeps of the forward."""
    cfg = get_model(cfg)
    e = 2 if dtype in ("bf16", "fp16") else 4
    h, f = cfg.d_model, cfg.d_ff
    width = (3 * h + f) / tp + 4 * h / (tp if sp else 1)
    return e * cfg.seq_len * microbatch_size * width


def loss_workspace(cfg: GPTConfig | str, microbatch_size: int = 1, tp: int = 1,
                   accounting: str = "korthikanti", cp: int = 1, chunked: bool = False,
                   dtype_bytes: int = 2) -> float:
    """Bytes the loss's backward allocates on the last stage while all activations live.

    ``minipar.model.GPT.loss`` is ``cross_entropy(logits.float())``: its forward stores
    the fp32 log-softmax (``edge_activations``' logits term), and its backward first
    makes the fp32 gradient of the log-probabilities (nll_loss's backward, dense), then
    from it the fp32 gradient of the logits: 3 x 4 s b V bytes exist at once, at the
    very start of the backward, when no activation has been freed yet. A transient
    (an activation meter that counts saved tensors does not see it), but it sets the
    peak: ``accounting="fused"`` counts the two gradients, 8 s b V / (t cp) bytes (the
    logits are split over tp by a vocabulary-parallel head; a cp rank's loss covers its
    s / cp tokens only, ``parallel.cp_plan``). The paper's accounting stops at what is
    stored: 0 there. ``chunked`` (``parallel/chunked_loss.py``): the gradient of the
    logits in their own dtype (``dtype_bytes``) and one chunk's three fp32 temporaries.
    """
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"accounting must be one of {ACCOUNTINGS}, got {accounting!r}")
    if accounting != "fused":
        return 0.0
    cfg = get_model(cfg)
    logits = (cfg.seq_len // cp) * microbatch_size * cfg.vocab_size / tp
    if chunked:
        return logits * dtype_bytes + 3 * min(CHUNK_BYTES, 4 * logits)
    return 2 * logits * 4
