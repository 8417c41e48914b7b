"""Deterministic training data, and the one place that splits a batch.

**The contract every data source keeps.** Row ``r`` of the global batch of step ``s``
depends on (seed, s, r) only, never on the layout. ``rows(step, row_indices)`` builds
just the rows asked for, so a data-parallel rank builds only its own slice; ``batch(step,
batch_size)`` builds them all (the single-device reference, the lessons). Both return
``(inputs, targets)``, targets shifted by one token.

**The generated corpus** (``MarkovData``, no download) is a walk on a fixed random Markov
chain in which every token has ``branching`` successors with skewed probabilities, so
the loss starts near ln(vocab) and clearly falls as the model learns the transitions.
Real text lives in ``minipar.corpus``; it keeps the same contract.

``split_batch`` is the single mapping from a global batch to this rank's data-parallel
shard and its micro-batches; ``dp_rows`` says which global rows that shard holds, and
``local_batches`` builds only those rows and cuts them the same way. The engine, the
tests and the lessons all go through these.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import torch

# --- counter-based randomness: a number per (seed, step, row, position) ------------
# A generator object per row would be a Python loop over rows and would make a row
# depend on how many rows were drawn before it. A hash of the counters does neither:
# splitmix64's finaliser (Steele, Lea & Flood 2014) turns consecutive integers into
# independent-looking 64-bit values, vectorised by numpy (uint64 arithmetic wraps).
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def counter_hash(seed: int, stream: int, step: int, rows: np.ndarray,
                 width: int) -> np.ndarray:
    """uint64 array (len(rows), width): one independent value per (row, position)."""
    key = _mix(np.array([(seed * 1_000_003 + stream) % 2**64], dtype=np.uint64))
    key = _mix(key ^ (np.array([step % 2**64], dtype=np.uint64) * _GOLDEN))
    per_row = _mix(key ^ (np.asarray(rows, dtype=np.uint64) + np.uint64(1)) * _GOLDEN)
    cols = np.arange(width, dtype=np.uint64)
    return _mix(per_row[:, None] + cols[None, :] * _GOLDEN)


def uniform01(h: np.ndarray) -> np.ndarray:
    """Floats in [0, 1) from the top 53 bits of hashed counters."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


SPLITS = ("train", "val")


class TokenSource(Protocol):
    """What the engine needs from a data source (``MarkovData``, ``corpus.TokenData``)."""

    vocab_size: int
    seq_len: int

    def rows(self, step: int, row_indices, split: str = "train"
             ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]: ...


MARKOV_BRANCHING = 3  # successors of each token in the generated chain


class MarkovData:
    """Batches of (inputs, targets) from a seeded sparse Markov chain over the vocabulary.

    The chain: token v moves to one of ``branching`` successors
    ``successors[v] = perm[(pos[v] + offsets) % V]`` with probabilities ``weights``
    (the same skewed weights for every token). Tokens sit on a random cycle (``perm``);
    a step jumps ahead by one of a few fixed offsets. Two consequences, both chosen:

    * the table is O(vocab x branching) (the first version held a dense vocab x vocab
      matrix: 9.4 GiB at GPT-2's 50,304 tokens);
    * the choice of successor does not depend on the token, so a whole sequence is a
      cumulative sum of random offsets: every row, every position at once, no loop over
      tokens (the first version sampled token by token: about 40 s per 8 x 2048 batch).

    The loss floor is the entropy of ``weights`` (``entropy()``): the chain is doubly
    stochastic, so every token is equally frequent and the floor is exact.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0,
                 branching: int = MARKOV_BRANCHING):
        if not 1 <= branching < vocab_size:
            raise ValueError(f"branching must be in 1..vocab_size-1, got {branching}")
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        rng = np.random.default_rng(10_000 + seed)
        self.perm = rng.permutation(vocab_size)  # the cycle: position -> token
        self.pos = np.argsort(self.perm)  # token -> position
        self.offsets = 1 + rng.choice(vocab_size - 1, branching, replace=False)
        w = 1.0 / np.arange(1, branching + 1) ** 2  # skewed (Zipf-like): learnable fast
        self.weights = w / w.sum()
        self._cumulative = np.cumsum(self.weights)
        self._cumulative[-1] = 1.0  # exactly: a uniform draw never falls past the end

    @property
    def successors(self) -> np.ndarray:
        """(vocab, branching) table of successor tokens (built on demand; for reading)."""
        return self.perm[(self.pos[:, None] + self.offsets[None, :]) % self.vocab_size]

    def entropy(self) -> float:
        """Loss floor in nats: the entropy of the next token given the current one."""
        return float(-(self.weights * np.log(self.weights)).sum())

    def rows(self, step: int, row_indices, split: str = "train"
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``row_indices`` of the global batch of ``step`` (any subset, any order).
        ``split="val"``: held-out walks (another random stream), for evaluation."""
        rows = np.asarray(row_indices, dtype=np.int64).reshape(-1)
        h = counter_hash(self.seed, SPLITS.index(split), step, rows, self.seq_len + 1)
        start = (h[:, 0] % np.uint64(self.vocab_size)).astype(np.int64)
        choice = np.searchsorted(self._cumulative, uniform01(h[:, 1:]), side="right")
        jumps = self.offsets[np.minimum(choice, len(self.offsets) - 1)]
        where = np.empty((len(rows), self.seq_len + 1), dtype=np.int64)
        where[:, 0] = start
        np.cumsum(jumps, axis=1, out=where[:, 1:])
        where[:, 1:] += start[:, None]
        tokens = torch.from_numpy(self.perm[where % self.vocab_size])
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: the same tokens whatever the layout."""
        return self.rows(step, range(batch_size))


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


def dp_rows(global_batch: int, dp_rank: int, dp: int) -> range:
    """The global rows replica ``dp_rank`` trains on: [r*B/dp, (r+1)*B/dp)."""
    local = global_batch // dp
    return range(dp_rank * local, (dp_rank + 1) * local)


def split_batch(
    inputs: torch.Tensor, targets: torch.Tensor, dp_rank: int, dp: int, microbatches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This replica's contiguous slice of the global batch, cut into micro-batches.

    Replica r gets rows [r*B/dp, (r+1)*B/dp) (``dp_rows``); those are cut into
    ``microbatches`` equal consecutive pieces. Every loss is a mean over tokens, so the
    engine weighs each micro-batch by 1/(dp*microbatches) to recover the global mean.
    """
    check_batch_split(inputs.shape[0], dp, microbatches)
    rows = dp_rows(inputs.shape[0], dp_rank, dp)
    x, y = inputs[rows.start:rows.stop], targets[rows.start:rows.stop]
    size = len(rows) // microbatches
    return [(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size])
            for i in range(microbatches)]


def local_batches(data: TokenSource, step: int, global_batch: int, dp_rank: int, dp: int,
                  microbatches: int, split: str = "train"
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``split_batch(*data.batch(step, B), dp_rank, dp, m)``, building only this
    replica's rows: the same tensors, 1/dp of the work and memory."""
    check_batch_split(global_batch, dp, microbatches)
    x, y = data.rows(step, dp_rows(global_batch, dp_rank, dp), split=split)
    return split_batch(x, y, 0, 1, microbatches)


def initial_loss(vocab_size: int) -> float:
    """The loss of a uniform guess, ln(vocab): where an untrained model starts."""
    return math.log(vocab_size)
