"""Context parallelism applied to a GPT: the plan a cp rank follows.

``parallel/cp.py`` holds the technique (the zig-zag split, the ring, the merge rule);
this file puts it into a model the way tensor parallelism is put in: a plan of
module-name patterns and styles, applied by ``tp.parallelize_module``, reference names
kept (Liu et al. 2023, arXiv 2310.01889; Megatron-Core's context parallelism, which
splits the sequence in 2C chunks for the causal balance). A cp rank holds ``seq_len /
cp`` tokens of every row (its two zig-zag chunks) for every layer. Composes with tensor
parallelism (heads by tp, sequence by cp) and with sequence parallelism (the cp-local
sequence is further cut by tp: the styles see the SP module they replace and look up
that slice). A shard's loss is the mean over its tokens; all shards have as many, so
the engine scales each micro-batch loss by 1/(dp * cp * m) and the data-parallel layer
sums the gradients over the dp x cp group (the weights are replicated over cp). An MoE
layer routes the rank's tokens, but decides what each expert keeps over the whole
sequence (``ShardQueues``), so a capacity drops the tokens one device drops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minipar.comm import Comm
from minipar.model import ExpertQueues, KeyedDropout
from minipar.parallel.cp import (
    RingAttention,
    check_cp,
    gather_sequence,
    positions,
    shard_sequence,
)
from minipar.parallel.tp import (
    ParallelStyle,
    SequenceParallelDropout,
    SequenceShardedEmbedding,
    parallelize_module,
)


class ShardPositions(nn.Module):
    """The position embedding of a cp rank: the full (replicated) table, looked up at
    this rank's global positions. Under sequence parallelism too (``sp``: the tp group),
    only this tp rank's slice of them. Keeps the name ``pos_emb.weight``."""

    def __init__(self, weight: nn.Parameter, global_positions: torch.Tensor,
                 sp: Comm | None = None) -> None:
        super().__init__()
        self.weight, self.sp = weight, sp
        # not a buffer: buffers are broadcast from rank 0 by the data-parallel layer,
        # and these differ by cp rank (a tensor of seq_len / cp integers)
        self.positions = global_positions

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        if self.positions.device != pos.device:
            self.positions = self.positions.to(pos.device)
        p = self.positions[pos]  # local index -> global position
        if self.sp is not None:
            p = p.chunk(self.sp.size)[self.sp.rank]
        return F.embedding(p, self.weight)


class ShardDropout(KeyedDropout):
    """Dropout of tokens at arbitrary global positions: the reference's mask for each.

    ``global_positions`` (the tokens this module sees, in local order) is cut into runs
    of consecutive positions (a zig-zag shard has two); each run is masked as the
    single device masks those positions (``KeyedDropout.keep_mask`` with its offset).
    """

    def __init__(self, p: float, site: int, global_positions: torch.Tensor) -> None:
        super().__init__(p, site)
        pos = global_positions.tolist()
        self.runs: list[tuple[int, int]] = []  # (length, first global position)
        for i, q in enumerate(pos):
            if i and q == pos[i - 1] + 1:
                self.runs[-1] = (self.runs[-1][0] + 1, self.runs[-1][1])
            else:
                self.runs.append((1, q))
        self.length = len(pos)

    def forward(self, x: torch.Tensor, position_offset: int = 0) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        b, s, h = x.shape
        if s != self.length:
            raise ValueError(f"a context-parallel shard of {self.length} tokens got {s}")
        keep = torch.cat([self.keep_mask(torch.Size((b, n, h)), first + position_offset,
                                         x.device) for n, first in self.runs], dim=1)
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}, runs={self.runs}"


class ShardQueues(ExpertQueues):
    """An MoE layer's ``queues`` on a cp rank: what each expert keeps is decided over the
    whole sequence, as on one device. The ranks' expert ids (k small integers a token,
    no activations) are all-gathered over the cp group and put back in sequence order
    (``gather_sequence``); every rank runs the reference's rule (``keep_under_capacity``)
    on them and keeps its own tokens' answers. The whole sequence's ids also give the
    balance loss its f (``model.load_balancing_loss``): each rank's loss is then the
    whole's f with its own tokens' P, and the engine's 1/cp weight averages them."""

    def __init__(self, queues: ExpertQueues, comm: Comm, layout: str = "zigzag") -> None:
        super().__init__(queues.n_expert, queues.k, queues.capacity_factor)
        self.comm, self.layout = comm, layout

    def forward(self, expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        whole = gather_sequence(expert.contiguous(), self.comm, self.layout)
        keep, _ = super().forward(whole)
        return shard_sequence(keep, self.comm.rank, self.comm.size, self.layout), whole


def _sp_slice(pos: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """The part of the cp shard's positions that a sequence-parallel module sees."""
    comm = module.comm
    return pos.chunk(comm.size)[comm.rank]


@dataclass(frozen=True)
class RingAttentionCore(ParallelStyle):
    """``attn.core`` -> ``RingAttention`` over the cp group."""

    layout: str = "zigzag"

    def apply(self, module: nn.Module, comm: Comm) -> nn.Module:
        return RingAttention(comm, self.layout)


@dataclass(frozen=True)
class ShardedPositions(ParallelStyle):
    """``pos_emb`` (plain or sequence-parallel) -> ``ShardPositions``."""

    seq_len: int
    layout: str = "zigzag"

    def apply(self, module: nn.Module, comm: Comm) -> nn.Module:
        pos = positions(self.seq_len, comm.rank, comm.size, self.layout)
        sp = module.comm if isinstance(module, SequenceShardedEmbedding) else None
        return ShardPositions(module.weight, pos, sp)


@dataclass(frozen=True)
class ShardedDropout(ParallelStyle):
    """A ``KeyedDropout`` (plain or sequence-parallel) -> ``ShardDropout``."""

    seq_len: int
    layout: str = "zigzag"

    def apply(self, module: nn.Module, comm: Comm) -> nn.Module:
        pos = positions(self.seq_len, comm.rank, comm.size, self.layout)
        if isinstance(module, SequenceParallelDropout):
            pos = _sp_slice(pos, module)
        return ShardDropout(module.p, module.site, pos)


@dataclass(frozen=True)
class SequenceQueues(ParallelStyle):
    """An MoE layer's ``ExpertQueues`` -> ``ShardQueues`` over the cp group."""

    layout: str = "zigzag"

    def apply(self, module: nn.Module, comm: Comm) -> nn.Module:
        return ShardQueues(module, comm, self.layout)


def context_parallel_plan(seq_len: int, layout: str = "zigzag") -> dict[str, ParallelStyle]:
    """The cp plan of a ``GPT``, as module-name pattern -> style (``describe_plan``).

    * ``blocks.*.attn.core`` becomes ``RingAttention``: the only layer that needs the
      other tokens (keys and values travel around the cp ring).
    * ``pos_emb`` looks up the rank's *global* positions (``ShardPositions``).
    * each dropout (``drop``, ``blocks.*.resid_drop*``) draws the single device's mask
      for those global positions (``ShardDropout``): the mask is a hash of the position,
      so a shard of two separate chunks is masked chunk by chunk.
    * an MoE layer's ``queues`` decide the capacity over the whole sequence
      (``ShardQueues``): a token is dropped or kept as on one device.

    Everything else is token-wise and runs unchanged on the local tokens.
    """
    return {"pos_emb": ShardedPositions(seq_len, layout),
            "drop": ShardedDropout(seq_len, layout),
            "blocks.*.resid_drop*": ShardedDropout(seq_len, layout),
            "blocks.*.attn.core": RingAttentionCore(layout),
            "blocks.*.mlp.queues": SequenceQueues(layout)}


def apply_context_parallel(model: nn.Module, comm: Comm, layout: str = "zigzag") -> nn.Module:
    """Give ``model`` (a full ``GPT``, after tensor parallelism if any) to the cp group
    ``comm``, in place. Its forward then takes this rank's shard of each row
    (``shard_batch``) and returns the mean loss over those tokens."""
    check_cp(model.cfg.seq_len, comm.size)
    return parallelize_module(model, comm, context_parallel_plan(model.cfg.seq_len, layout))


def shard_batch(x: torch.Tensor, y: torch.Tensor, comm: Comm, layout: str = "zigzag"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """This cp rank's tokens of a micro-batch: inputs and targets (already shifted by
    one on the full sequence, so a target is still the token after its input)."""
    if comm.size == 1:
        return x, y
    return (shard_sequence(x, comm.rank, comm.size, layout),
            shard_sequence(y, comm.rank, comm.size, layout))
