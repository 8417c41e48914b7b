"""The cross-entropy without fp32 copies of the logits: they stay in the head's dtype,
and the backward recomputes the softmax a chunk of tokens at a time.

``model.CrossEntropy`` is ``F.cross_entropy(logits.float())``. For N tokens and a
vocabulary of V it keeps the fp32 log-softmax for its backward (4 N V bytes), and its
backward makes two more fp32 tensors of that size, the gradients of the log-probabilities
and of the logits, before the head's backward runs: 12 bytes a logit at the start of the
backward, when every activation of the micro-batch still lives. With gpt-1.3b's
vocabulary (50,304) and 8 sequences of 2,048 tokens that is 9.2 GiB, the largest tensors
of a step, and the blocks the allocator splits for smaller ones afterwards.

``ChunkedCrossEntropy`` keeps the logits as the head made them (they exist anyway) and
each token's log-sum-exp (4 N bytes). Its backward recomputes softmax - onehot in fp32
for ``CHUNK_BYTES`` of logits at a time and writes the gradient straight in the logits'
dtype: 2 + 2 bytes a bf16 logit, and one chunk's fp32 temporaries. The arithmetic is the
cross-entropy's own (an fp32 softmax, then one rounding to the logits' dtype), so the
losses and gradients are the same up to fp32 rounding order. Chunking the loss over the
vocabulary is what torchtune's chunked cross-entropy and Liger-Kernel's fused linear
cross-entropy do (Hsu et al. 2024, arXiv 2410.10989); the head's matmul is not fused in
here: the head stays a module of its own, which tensor parallelism, ZeRO-3 and the
weight-gradient fusion replace as before.

Applied from outside by replacing the last chunk's ``loss_fn`` (``--chunked-loss``).
Tensor parallelism has its own loss, over logits split by vocabulary (``parallel/tp.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from minipar.model import CrossEntropy

# One chunk's fp32 logits; its backward holds about three such temporaries at once
# (the fp32 copy, its softmax, the scaled gradient before the cast).
CHUNK_BYTES = 256 * 2**20


def chunk_tokens(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: ``chunk_bytes`` of fp32 logits over ``vocab`` classes."""
    return max(1, chunk_bytes // (4 * vocab))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of [N, V] logits against [N] targets; backward recomputes
    softmax(z) - onehot(target), scaled by the loss's gradient over N, chunk by chunk."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int):
        lse = torch.cat([torch.logsumexp(z.float(), dim=-1) for z in logits.split(chunk)])
        picked = logits.gather(1, targets.unsqueeze(1)).squeeze(1).float()
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk = chunk
        return (lse - picked).mean()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        scale = grad_loss.float() / logits.shape[0]
        grad = torch.empty_like(logits)
        for rows in range(0, logits.shape[0], ctx.chunk):
            z, t = logits[rows:rows + ctx.chunk], targets[rows:rows + ctx.chunk]
            p = torch.exp(z.float() - lse[rows:rows + ctx.chunk].unsqueeze(1))
            p.scatter_add_(1, t.unsqueeze(1), torch.full_like(p[:, :1], -1.0))
            grad[rows:rows + ctx.chunk] = p.mul_(scale)
        return grad, None, None


class ChunkedCrossEntropy(nn.Module):
    """``CrossEntropy``'s value and gradients, with the memory of the logits alone."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        super().__init__()
        self.chunk_bytes = chunk_bytes

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = logits.flatten(0, 1)
        return _ChunkedCrossEntropy.apply(flat, targets.flatten(),
                                          chunk_tokens(flat.shape[-1], self.chunk_bytes))

    def extra_repr(self) -> str:
        return f"chunks of {self.chunk_bytes / 2**20:g} MiB of fp32 logits"


def apply_chunked_loss(chunks: Iterable[nn.Module]) -> int:
    """Replace the ``CrossEntropy`` of every chunk that holds the loss (a pipeline's
    last) by a ``ChunkedCrossEntropy``. Returns how many were replaced."""
    replaced = 0
    for chunk in chunks:
        if type(getattr(chunk, "loss_fn", None)) is CrossEntropy:
            chunk.loss_fn = ChunkedCrossEntropy()
            replaced += 1
    return replaced
