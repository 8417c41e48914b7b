"""Rank functions for the launcher tests that must live in an importable module.

``spawn`` starts a fresh interpreter per rank, which imports ``fn`` by name: a function
defined in a test body, a lambda or a notebook cell cannot travel that way. pytest puts
``tests/`` on ``sys.path`` and multiprocessing hands that path to spawned ranks, so
these functions import fine there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def token_sum(token: int) -> tuple[float, float]:
    """All-reduce ``[token, rank]``: (world * token, sum of ranks).

    Two jobs that shared a rendezvous would mix their tokens and ranks (or fail to
    start), so the sums prove each launch got a job of its own.
    """
    t = torch.tensor([float(token), float(dist.get_rank())])
    dist.all_reduce(t)
    return t[0].item(), t[1].item()

