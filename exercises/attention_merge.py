# Your copy of this exercise, generated from solutions/attention_merge.py by tools/make_exercises.py.
# Fill in the blanks (each raises NotImplementedError), then check your work with
#     from exercises.check import check; check("attention_merge")
"""Lesson 07 exercise: merge two partial attention results by their log-sum-exps.

Ring attention (Liu, Zaharia & Abbeel 2023, arXiv 2310.01889) never holds a whole
sequence's keys: a rank computes its queries against one block of keys at a time, as the
blocks travel round the ring. Each block gives a *partial* answer, attention over that
block's keys only. To combine two of them into attention over both key sets, each part
must bring two things:

* ``out_x`` (..., t, hd): softmax over the keys of X only, times their values;
* ``lse_x`` (..., t): log sum_{k in X} exp(score(q, k)), the log of the softmax's
  denominator over X (its "mass").

The softmax over the union A + B has denominator e^lse_a + e^lse_b. Part A's output
was divided by e^lse_a only; multiplied by its share of the total mass,
e^lse_a / (e^lse_a + e^lse_b), it becomes exactly A's contribution to the whole. So

    lse = log(e^lse_a + e^lse_b)
    out = e^(lse_a - lse) * out_a + e^(lse_b - lse) * out_b

This is the online softmax (Milakov & Gimelshein 2018, arXiv 1805.02867) that
FlashAttention (Dao et al. 2022, arXiv 2205.14135) applies tile by tile. Scores can be
large: e^lse must never be computed directly (e^89 already overflows fp32). Only
differences of log-sum-exps may be exponentiated.

You write ``merge_attention``. The check compares it with attention over both key sets
(random, large and empty ones), then runs ``minipar.parallel.cp.RingAttention`` on 2 and
4 ranks with your merge in place of the engine's and compares with one device.
"""

from __future__ import annotations

import torch


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over key sets A and B from the two partial results: ``(out, lse)``.

    ``out_a``, ``out_b``: (..., t, hd); ``lse_a``, ``lse_b``: (..., t). Returns the
    merged output (..., t, hd) and log-sum-exp (..., t). A part with no keys has
    lse = -inf (and contributes nothing).
    """
    # YOUR CODE HERE
    raise NotImplementedError(
        'merge_attention in exercises/attention_merge.py is not implemented yet. '
        "Hint: ask for one with hint('attention_merge', 1) (a nudge), 2 (the "
        'idea) or 3 (the formula), from exercises.course')
