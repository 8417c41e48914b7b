"""Deterministic training data, and the one place that splits a batch.

No download: the corpus is generated. Each sequence is a walk on a fixed random Markov
chain over the vocabulary in which every token has only a few likely successors, so
the loss starts near ln(vocab) and clearly falls as the model learns the transitions.
The batch of a step depends only on (seed, step), never on the layout, which is what
lets every parallel run consume exactly the tokens the single-device run consumes.

``split_batch`` is the single mapping from a global batch to this rank's data-parallel
shard and its micro-batches; the engine, the tests and the lessons all go through it.
"""

from __future__ import annotations

import math

import torch


class MarkovData:
    """Batches of (inputs, targets) from a seeded Markov chain over ``vocab_size`` tokens."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, branching: int = 3):
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        g = torch.Generator().manual_seed(10_000 + seed)
        # Each token moves to one of `branching` successors, with skewed probabilities.
        successors = torch.stack([torch.randperm(vocab_size, generator=g)[:branching]
                                  for _ in range(vocab_size)])
        weights = torch.softmax(torch.randn(vocab_size, branching, generator=g) * 2, dim=1)
        self.transition = torch.zeros(vocab_size, vocab_size)
        self.transition.scatter_(1, successors, weights)

    def entropy(self) -> float:
        """Loss floor in nats: the mean entropy of the next token (stationary weighting
        is ignored; this is a reference line for plots, not a bound used in tests)."""
        p = self.transition
        h = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(1)
        return float(h.mean())

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: the same tokens whatever the layout."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (batch_size,), generator=g)
        for t in range(self.seq_len):
            probs = self.transition[tokens[:, t]]
            tokens[:, t + 1] = torch.multinomial(probs, 1, generator=g).squeeze(1)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def check_batch_split(global_batch: int, dp: int, microbatches: int) -> None:
    """Raise a clear error if a global batch cannot be split evenly."""
    if global_batch % dp:
        raise ValueError(f"global batch {global_batch} is not divisible by dp={dp}")
    local = global_batch // dp
    if local % microbatches:
        raise ValueError(
            f"per-replica batch {local} (global {global_batch} / dp {dp}) is not divisible "
            f"by microbatches={microbatches}"
        )


def split_batch(
    inputs: torch.Tensor, targets: torch.Tensor, dp_rank: int, dp: int, microbatches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This replica's contiguous slice of the global batch, cut into micro-batches.

    Replica r gets rows [r*B/dp, (r+1)*B/dp); those are cut into ``microbatches`` equal
    consecutive pieces. Every loss is a mean over tokens, so the engine weighs each
    micro-batch by 1/(dp*microbatches) to recover the global-batch mean.
    """
    check_batch_split(inputs.shape[0], dp, microbatches)
    local = inputs.shape[0] // dp
    rows = slice(dp_rank * local, (dp_rank + 1) * local)
    x, y = inputs[rows], targets[rows]
    size = local // microbatches
    return [(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size])
            for i in range(microbatches)]


def initial_loss(vocab_size: int) -> float:
    """The loss of a uniform guess, ln(vocab): where an untrained model starts."""
    return math.log(vocab_size)
