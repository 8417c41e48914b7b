"""Pipeline parallelism: cut the GPT into stages, and run any schedule over them.

**Stages.** ``build_stage(model, pp_rank, pp, virtual)`` splits the ``n_layer`` blocks
into ``pp * virtual`` chunks of consecutive layers (uneven counts: the first chunks take
one more; ``head_layers`` k gives the last chunk, which also runs the head and the loss,
k layers fewer: ``partition_layers``), and gives rank ``r`` the chunks
``r, r + pp, ...`` (Megatron's virtual stages, arXiv 2104.04473). Each chunk is a
``PipelineStage``: an ``nn.Module`` that owns exactly its layers, under the reference
model's names (``blocks.5.mlp.fc.weight``: ``blocks`` is keyed by the global layer
index), so checkpoints, tensor-parallel slicing and ZeRO find every parameter by the
name it has on one device. The first chunk also embeds the tokens; the last applies the
final norm, the head and the model's loss.

**Tied embeddings** (Megatron's way, 1909.08053 section 3): with pp > 1 the first stage
holds the token embedding and the last the head, each a copy of the one shared weight
(identical at initialisation, since both come from the same reference model). After the
backward their gradients are summed in the *embedding group* (the first and last pp
ranks of one dp/tp coordinate, ``RankMesh.embed``), so both copies take the same step.

**Running a schedule** over the chunks is ``PipelineExecutor``'s job
(``minipar.parallel.executor``, re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from minipar.comm import Comm
from minipar.model import GPT, embed_tokens
from minipar.parallel.executor import ActionRecord, PipelineExecutor, StepResult
from minipar.parallel.schedules import rank_of

__all__ = ["partition_layers", "split_report", "PipelineStage", "build_stage",
           "StageLayers", "tied_copy", "tied_parameters", "sync_tied_grads",
           "PipelineExecutor", "ActionRecord", "StepResult"]


# --- stages --------------------------------------------------------------------------


def partition_layers(n_layer: int, n_chunks: int, head_layers: int = 0) -> list[range]:
    """Consecutive layer ranges of ``n_chunks`` pipeline chunks; the first chunks take the
    rest. ``head_layers`` k: the last chunk's final norm, LM head and loss count as k
    layers, so the split is even over ``n_layer + k`` and the last chunk holds k fewer
    (Megatron's ``account_for_loss_in_pipeline_split``, torchtitan's output weight): a
    stage with the head is otherwise the pipeline's slowest."""
    if n_chunks < 1:
        raise ValueError(f"need at least one chunk, got {n_chunks}")
    base, extra = divmod(n_layer + head_layers, n_chunks)
    sizes = [base + (1 if i < extra else 0) for i in range(n_chunks)]
    sizes[-1] -= head_layers
    if head_layers < 0 or sizes[-1] < 0:
        raise ValueError(f"--head-layers {head_layers} must be 0 or more and leave the last "
                         f"of {n_chunks} chunks 0 or more of the {n_layer} layers")
    starts = [sum(sizes[:i]) for i in range(n_chunks)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


def split_report(n_layer: int, pp: int, virtual: int = 1, head_layers: int = 0) -> str:
    """Which layers each rank holds, e.g. ``rank 0: chunk 0 = embed + layers 0-2``."""
    ranges = partition_layers(n_layer, pp * virtual, head_layers)
    last = pp * virtual - 1
    lines = []
    for r in range(pp):
        parts = []
        for c in range(r, pp * virtual, pp):
            layers = ranges[c]
            what = [f"layers {layers.start}-{layers.stop - 1}" if len(layers) > 1 else
                    f"layer {layers.start}" if layers else "no layers"]
            if c == 0:
                what.insert(0, "embed")
            if c == last:
                what.append("head + loss")
            parts.append(f"chunk {c} = " + " + ".join(what))
        lines.append(f"rank {r}: " + ", ".join(parts))
    return "\n".join(lines)


class PipelineStage(nn.Module):
    """Chunk ``index`` of ``n_chunks``: its blocks, plus embedding (first) or final norm,
    head and loss (last), taken from ``model`` under the same names.

    ``forward(x, targets=None)``: token ids in for the first chunk, hidden states
    otherwise; the mean loss out of the last chunk, hidden states otherwise.
    """

    def __init__(self, model: GPT, index: int, n_chunks: int, layers: range) -> None:
        super().__init__()
        self.index, self.n_chunks, self.layers = index, n_chunks, layers
        self.is_first, self.is_last = index == 0, index == n_chunks - 1
        if self.is_first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if self.is_last:
            self.ln_f, self.head, self.loss_fn = model.ln_f, model.head, model.loss_fn

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = embed_tokens(self.tok_emb, self.pos_emb, self.drop, x) if self.is_first else x
        for block in self.blocks.values():
            h = block(h)
        if not self.is_last:
            return h
        if targets is None:
            raise ValueError("the last pipeline chunk needs the targets")
        return self.loss_fn(self.head(self.ln_f(h)), targets)

    def extra_repr(self) -> str:
        return f"chunk {self.index} of {self.n_chunks}, layers {list(self.layers)}"


def build_stage(model: GPT, pp_rank: int, pp: int, virtual: int = 1,
                head_layers: int = 0) -> list[PipelineStage]:
    """This rank's chunks (local order; ``head_layers``: see ``partition_layers``).
    ``model`` is left as it was: once the caller drops it, the layers no chunk took are
    freed."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank {pp_rank} is outside 0..{pp - 1}")
    if virtual < 1:
        raise ValueError(f"virtual must be >= 1, got {virtual}")
    n_chunks = pp * virtual
    ranges = partition_layers(len(model.blocks), n_chunks, head_layers)
    return [PipelineStage(model, c, n_chunks, ranges[c])
            for c in range(n_chunks) if rank_of(c, pp) == pp_rank]


class StageLayers(nn.Module):
    """Every layer of this rank's chunks in one module, under the reference names: what
    the optimizer, checkpoints and the gradient norm see. The chunks are what runs."""

    def __init__(self, chunks: Sequence[PipelineStage], cfg) -> None:
        super().__init__()
        self.cfg = cfg
        for chunk in chunks:
            for name, child in chunk.named_children():
                if name != "blocks":
                    self.add_module(name, child)
                elif "blocks" in self._modules:
                    self.blocks.update(child)
                else:
                    self.blocks = nn.ModuleDict(child)


def tied_copy(name: str, cfg) -> bool:
    """Is parameter ``name`` the last stage's copy of a tied embedding? (Counted once
    in a gradient norm: under the first stage's name, ``tok_emb.weight``.)"""
    return bool(getattr(cfg, "tie_embeddings", False)) and name.split(".")[-2:] == [
        "head", "weight"]


def tied_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The tied embedding weight as this rank holds it (first or last stage), or []."""
    if not getattr(model.cfg, "tie_embeddings", False):
        return []
    named = dict(model.named_parameters())
    return [p for n, p in named.items() if n in ("tok_emb.weight", "head.weight")]


def sync_tied_grads(model: nn.Module, comm: Comm | None) -> None:
    """Sum the tied embedding's gradient over the embedding group (first and last
    stage), so both copies step alike. Nothing at pp = 1 (one weight, one gradient)."""
    params = [p for p in tied_parameters(model) if p.grad is not None]
    if comm is None or comm.size == 1 or not params:
        return
    comm.all_reduce(params[0].grad)
