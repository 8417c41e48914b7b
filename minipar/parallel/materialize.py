"""Sharded initialisation: build on the meta device, then make only this rank's shard.

Building the whole single-device model on every rank and then keeping a slice costs
host memory O(whole model) per rank (a 13B model: 52 GB of fp32 per rank). Like
torchtitan, FSDP2 and Megatron, minipar builds the model on PyTorch's ``meta`` device
(shapes, no storage); the tensor-parallel plan, the pipeline split and recomputation
work on shapes alone. Only then does each parameter a rank kept get its value, one at
a time (``model.materialize(values)``): the reference's value of the full tensor
(``init_parameter``), this rank's slice of it as the plan splits it (``tp_split``), the
rest freed. Parity survives because the reference initialisation is a function of the
parameter's *name* (a counter-based generator keyed by (seed, name)), not of how many
numbers were drawn before it. ZeRO-3 calls the same ``values`` unit by unit and keeps
only its dp shard. Resuming is the same with the checkpoint's ``values``, which cut
each rank's slice from the overlapping saved shards (``reshard``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minipar.model import GPTConfig, init_parameter
from minipar.parallel.tp import shard_tensor, tp_split

Values = Callable[[str, nn.Parameter], torch.Tensor]


def full_shape(name: str, local: tuple[int, ...] | torch.Size, tp: int) -> tuple[int, ...]:
    """The single-device shape of parameter ``name`` whose tp shard has shape ``local``."""
    shape = list(local)
    dim = tp_split(name).dim
    if dim is not None and tp > 1:
        shape[dim] *= tp  # (q|k|v: each third is split, so the rows add up the same way)
    return tuple(shape)


def init_values(cfg: GPTConfig, seed: int, tp_rank: int = 0, tp: int = 1,
                device: torch.device | str | None = None) -> Values:
    """``values(name, p)`` for ``model.materialize``: this rank's tp shard of the
    reference's initial value of ``name``, generated on ``device`` (fast on a GPU)."""
    def values(name: str, p: nn.Parameter) -> torch.Tensor:
        full = init_parameter(name, full_shape(name, p.shape, tp), cfg, seed, device)
        if tp == 1 or tp_split(name).dim is None:
            return full
        return shard_tensor(name, full, tp_rank, tp).clone()  # the rest is freed here
    return values


def reshard(name: str, pieces: dict[int, torch.Tensor], saved_tp: int, tp_rank: int,
            tp: int) -> torch.Tensor:
    """Rank ``tp_rank`` of ``tp``'s shard of ``name`` from the overlapping shards of a
    layout with ``saved_tp`` ranks (``pieces``: saved rank -> its shard; only those
    ``overlapping`` returns need be there). No full tensor is assembled."""
    split = tp_split(name)
    dim, qkv = split.dim, split.parts > 1
    first = next(iter(pieces.values()))
    if dim is None or first.dim() == 0:
        return pieces[min(pieces)]  # replicated (or a scalar state): any copy
    if saved_tp == tp:
        return pieces[tp_rank]

    def blocks(t: torch.Tensor) -> torch.Tensor:  # q|k|v: split inside each part
        return t.reshape(split.parts, t.shape[0] // split.parts, *t.shape[1:]) if qkv else t
    axis = 1 if qkv else dim
    n_saved = blocks(first).shape[axis]  # rows per saved shard (block rows for qkv)
    total = n_saved * saved_tp
    lo, hi = tp_rank * total // tp, (tp_rank + 1) * total // tp
    out = []
    for s in overlapping(saved_tp, tp_rank, tp):
        a, b = max(lo, s * n_saved), min(hi, (s + 1) * n_saved)
        out.append(blocks(pieces[s]).narrow(axis, a - s * n_saved, b - a))
    t = torch.cat(out, axis) if len(out) > 1 else out[0].clone()
    return t.reshape(-1, *t.shape[2:]) if qkv else t


def overlapping(saved_tp: int, tp_rank: int, tp: int) -> list[int]:
    """The saved tp ranks whose shard overlaps rank ``tp_rank`` of ``tp``'s."""
    return [s for s in range(saved_tp)
            if s * tp < (tp_rank + 1) * saved_tp and (s + 1) * tp > tp_rank * saved_tp]
