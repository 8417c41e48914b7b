# Your copy of this exercise, generated from solutions/attention_merge.py by tools/make_exercises.py.
# Fill in the blanks (each raises NotImplementedError), then check your work with
#     from exercises.check import check; check("attention_merge")
"""Lesson 08 exercise: merge two partial attention results into one.

Ring attention (Liu, Zaharia & Abbeel 2023, arXiv 2310.01889) never holds a whole
sequence's keys: a rank computes its queries against one block of keys at a time, as the
blocks travel round the ring. Each block gives a *partial* answer, attention over that
block's keys only, as two tensors:

* ``out_x`` (..., t, hd): softmax over the keys of X only, times their values;
* ``lse_x`` (..., t): log sum_{k in X} exp(score(q, k)), the log of that softmax's
  denominator.

The contract: from (out_a, lse_a) and (out_b, lse_b) alone, return exactly what attention
over the union of A's and B's keys would give, in the same two tensors, so that the
result can itself be merged with a third part. How the two parts' outputs combine is
for you to derive from what a softmax's denominator is (the lesson's § 4 and
``hint("attention_merge", 1)``); FlashAttention (Dao et al. 2022, arXiv 2205.14135)
does the same tile by tile.

What the check tests: your merge against attention over both key sets for ordinary
scores, for scores in the hundreds (anything that exponentiates a log-sum-exp itself
overflows fp32 there), and for a part with no keys (lse = -inf); then
``minipar.parallel.cp.RingAttention`` on 2 and 4 ranks with your merge in place of the
engine's, forward and backward (the backward recomputes the probabilities from your
lse, so a wrong lse shows in the gradients), against one device.
"""

from __future__ import annotations

import torch


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over key sets A and B from the two partial results: ``(out, lse)``.

    ``out_a``, ``out_b``: (..., t, hd); ``lse_a``, ``lse_b``: (..., t). Returns the
    output (..., t, hd) and log-sum-exp (..., t) of attention over both key sets, finite
    wherever either part has keys. A part with no keys has lse = -inf and must change
    nothing.
    """
    # YOUR CODE HERE
    raise NotImplementedError(
        'merge_attention in exercises/attention_merge.py is not implemented yet. '
        "Hint: ask for one with hint('attention_merge', 1) (a nudge), 2 (the "
        'method) or 3 (the answer), from exercises.course')
