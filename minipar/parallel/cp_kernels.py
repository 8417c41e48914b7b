"""Ring-attention blocks on PyTorch's fused flash-attention kernels (CUDA, fp16/bf16).

``minipar.parallel.cp`` computes a block as matmul, softmax, matmul: the lesson, and the
path on CPUs. On a GPU that is slow for a plain reason: the (t, t) score matrix is
written to and read back from GPU memory several times (scores, mask, exp, product),
while the arithmetic is cheap. FlashAttention (Dao et al. 2022, arXiv 2205.14135) keeps
each tile of scores in on-chip memory and never writes the matrix: the same result in
a few times less time and O(t) memory. Its forward already returns what the ring needs,
the per-row log-sum-exp, and its backward takes the *final* (out, lse) and recomputes
the probabilities, exactly what ``block_backward`` does by hand.

These are the calls torch's own context parallelism makes per block
(``torch/distributed/tensor/experimental/_context_parallel/_attention.py``):
``aten._scaled_dot_product_flash_attention`` on (batch, heads, t, hd) returns
(out, lse (batch, heads, t) fp32, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused,
debug_mask), and ``aten._scaled_dot_product_flash_attention_backward`` returns
(dq, dk, dv) in the input dtype. The kernel takes no mask, only ``is_causal``: every
block of ``block_plan`` is a whole chunk against a whole chunk, either fully visible or
causal on its diagonal, so no block needs one.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten  # a module attribute, so a test can stand a CPU kernel in for it

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def flash_supported(device_type: str, dtype: torch.dtype, head_dim: int,
                    capability: tuple[int, int] | None = None) -> bool:
    """Whether the fused flash kernel can run a block: CUDA (sm80+), fp16/bf16, hd <= 256."""
    if device_type != "cuda" or dtype not in FLASH_DTYPES or head_dim > FLASH_MAX_HEAD_DIM:
        return False
    return capability is None or capability >= (8, 0)


def flash_available(q: torch.Tensor) -> bool:
    """``flash_supported`` for this tensor on this machine (and torch built with flash)."""
    if q.device.type != "cuda":
        return False
    built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
    cap = torch.cuda.get_device_capability(q.device)
    return built and flash_supported("cuda", q.dtype, q.shape[-1], cap)


def _last_dim_dense(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels take any strides but a unit one on the head dim (chunk views pass)."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in ts)


def flash_block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        causal: bool) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(out fp32, lse fp32, aux) of q over one key block; aux is what the backward needs.

    The output comes back in q's dtype and is widened for the fp32 merge, as torch's
    ring does (``convert_to_f32``).
    """
    q, k, v = _last_dim_dense(q, k, v)
    out, lse, cum_q, cum_k, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p=0.0, is_causal=causal, return_debug_mask=False, scale=scale)
    return out.float(), lse, (cum_q, cum_k, seed, offset)


def flash_block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                         aux: tuple, scale: float, causal: bool):
    """(dq, dk, dv) of one block from the merged out and lse (q's dtype, as the inputs).

    ``out`` and ``dout`` are the whole row's output and its gradient, in q's dtype; the
    kernel computes delta = rowsum(dout * out) itself. ``lse`` must be contiguous: the
    kernel indexes it from its shape, and a chunk of the rank's lse is a strided view.
    """
    cum_q, cum_k, seed, offset = aux
    q, k, v, out, dout = _last_dim_dense(q, k, v, out, dout)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, q.shape[2], k.shape[2], 0.0,
        causal, seed, offset, scale=scale)
    return dq, dk, dv
