"""Activation recomputation: keep less for backward, compute it again when needed.

A layer's backward needs tensors from its forward. Keeping them all costs
sbh(34 + 5as/h) bytes per layer in fp16 (Korthikanti et al. 2022, arXiv 2205.05198, eq. 1);
recomputing trades that memory for extra forward FLOPs:

* ``full``: keep only each block's input; run the block's forward again during backward
  (Chen et al. 2016, arXiv 1604.06174). About 2sbh bytes per layer remain, for one extra
  forward per block (33% more compute for a forward + backward of 3 units).
* ``selective``: recompute only the attention core (softmax(QK^T/sqrt(d)) V), whose saved
  tensors grow with s^2 but which costs little to recompute (the paper's section 5).
  With a fused attention kernel (SDPA, flash) the s^2 scores are never stored anyway, so
  selective recomputation saves little here: the lessons measure exactly how little.
* ``cheap``: recompute only what a pass over memory makes: the two layer norms' outputs
  and GELU's, which the next linear keeps for its weight gradient (dW = dy^T x). Their
  inputs are kept anyway (the layer norms' and GELU's own backward need them), so each is
  made again from those when the linear's backward reads it; no matrix product is redone.
  12 of the 32 bytes a token and hidden unit a block keeps (``theory.memory``), for the
  memory-bound passes of two layer norms and one GELU in the backward. Megatron-LM's
  ``--recompute-modules layernorm`` recomputes the layer norms so (and ``moe_act`` an
  MoE expert's activation).

Applied from outside, like every technique, by replacing submodules: each block by a
``RecomputedBlock`` (or a ``CheaplyRecomputedBlock``) that adopts the block's children (so
every parameter keeps its name, and with it tensor parallelism and checkpoints), or each
attention core (no parameters) by ``Recompute(core)``. Dropout masks are keyed by
position, not drawn from a generator, so the recomputed forward drops exactly what the
first one dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from minipar.model import Block
from minipar.parallel.pp import partition_layers  # the pipeline's own split rule

MODES = ("none", "selective", "cheap", "full")


class Recompute(nn.Module):
    """Run ``module`` without keeping its activations; run it again in backward."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        # use_reentrant=False: works with inputs that need no grad and with hooks
        return checkpoint(self.module, *args, use_reentrant=False)


class RecomputedBlock(Block):
    """A transformer block that recomputes itself in backward. It takes over the given
    block's submodules (the same objects, under the same names), so it holds no copy."""

    def __init__(self, block: Block) -> None:
        nn.Module.__init__(self)  # not Block.__init__: adopt, do not create, the layers
        for name, child in block.named_children():
            self.add_module(name, child)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(Block.forward, self, x, use_reentrant=False)


class _Recipe(NamedTuple):
    """How to make a saved tensor again: ``module`` on ``source`` (which is kept anyway),
    seen as the saved view (size, stride, offset)."""

    module: nn.Module
    source: torch.Tensor
    view: tuple


class CheaplyRecomputedBlock(Block):
    """A transformer block that keeps neither layer norm's output nor GELU's for its
    backward: where a linear saves one, a recipe is saved instead, and the backward makes
    the tensor again from the producer's input when it reads it. It takes over the given
    block's submodules (the same objects, under the same names).

    How: the block's forward runs under ``torch.autograd.graph.saved_tensors_hooks`` (what
    ``checkpoint`` is built on), and a forward hook on each producer notes its output and
    input. A saved tensor that is (a view of the whole of) a noted output becomes a
    recipe. Recomputing calls the producer's ``forward`` directly: the same kernels on the
    same input, so the same values, bit for bit. Every other saved tensor goes on to the
    hooks that were active around the block (``meter.ActivationMeter``'s, say): only the
    innermost pair would see it otherwise."""

    PRODUCERS = ("ln1", "ln2", "mlp.act")  # an MoE block has no mlp.act: its layer norms

    def __init__(self, block: Block) -> None:
        nn.Module.__init__(self)  # not Block.__init__: adopt, do not create, the layers
        for name, child in block.named_children():
            self.add_module(name, child)
        # address of an output's data -> (its producer, the output, its input): filled by
        # the hooks and read while the same forward saves tensors, emptied at its end (a
        # recipe then keeps the input; the output, held till then, leaves its address to
        # no other tensor meanwhile)
        self._made: dict[int, tuple] = {}
        for name in self.PRODUCERS:
            try:
                producer = self.get_submodule(name)
            except AttributeError:  # an MoE block's experts apply their GELU inside
                continue
            producer.register_forward_hook(self._note)

    def _note(self, producer: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if torch.is_grad_enabled() and out.requires_grad:  # (nothing is saved otherwise)
            self._made[out.data_ptr()] = (producer, out, args[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pack, unpack = recipe_hooks(self._made)
        # the hooks around this block (None: none) get what is kept as it is (torch lets
        # only the innermost pair see a save, and has no public way to read it)
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer or (_same, _same)

        def pack_on(t: torch.Tensor) -> object:
            packed = pack(t)
            return _Kept(outer_pack(t)) if packed is t else packed

        def unpack_on(saved: object) -> torch.Tensor:
            return outer_unpack(saved.value) if isinstance(saved, _Kept) else unpack(saved)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack_on, unpack_on):
                return Block.forward(self, x)
        finally:
            self._made.clear()


def recipe_hooks(noted: dict[int, tuple]) -> tuple[Callable, Callable]:
    """The saved-tensor hooks of one block's forward. ``noted``: the data address of each
    output a producer made in this forward -> (the producer, the output, its input).
    ``pack``: a saved tensor that is a noted output, or a view of the whole of one,
    becomes a recipe; any other comes back as it is. ``unpack`` (of a recipe): its tensor
    made again: the producer's ``forward`` on the kept input (the module's hooks skipped:
    nothing to note in the backward), seen as the saved view."""
    def pack(t: torch.Tensor) -> object:
        producer, out, source = noted.get(t.data_ptr(), (None, None, None))
        if out is None or t.numel() != out.numel() or t.dtype != out.dtype:
            return t
        return _Recipe(producer, source, (t.size(), t.stride(), t.storage_offset()))

    def unpack(recipe: _Recipe) -> torch.Tensor:  # (only recipes: the block sees to it)
        with torch.no_grad():
            return recipe.module.forward(recipe.source).as_strided(*recipe.view)

    return pack, unpack


class _Kept(NamedTuple):
    """A saved tensor as the hooks around the block packed it."""

    value: object


def _same(x: object) -> object:
    return x


def check_recompute_layers(layers, n_layer: int, pp: int = 1, virtual: int = 1,
                           head_layers: int = 0) -> None:
    """``layers`` N (``--recompute-layers``): the first N blocks of each pipeline chunk
    recompute (``apply_recompute``), so N is 0 up to the blocks of the largest chunk
    (``partition_layers``); one line otherwise. More would silently mean every block,
    which leaving it out (None) says."""
    if layers is None:
        return
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
        raise ValueError(f"--recompute-layers must be 0 or a positive integer, got {layers!r}")
    most = max(len(c) for c in partition_layers(n_layer, pp * virtual, head_layers))
    if layers > most:
        split = [f"--pp {pp}"] + [f"--virtual {virtual}"] * (virtual > 1) + [
            f"--head-layers {head_layers}"] * (head_layers > 0)
        where = (f"the largest of the {pp * virtual} pipeline chunks of {n_layer} layers "
                 f"({' '.join(split)})" if pp * virtual > 1
                 else f"the model ({n_layer} layers)")
        raise ValueError(f"--recompute-layers {layers} is more than the {most} blocks of "
                         f"{where}: give at most {most}, or leave it out to recompute "
                         "every block")


def apply_recompute(stages: Iterable[nn.Module], mode: str, layers: int | None = None,
                    rest: str = "none") -> None:
    """Replace, in every module of ``stages`` with a ``blocks`` container, each block
    (``full``, ``cheap``) or each block's attention core (``selective``). ``layers`` N:
    only the first N blocks of each chunk (Megatron's partial recomputation,
    ``--recompute-num-layers``): the rest keep their activations and skip the extra
    forward, for the memory a card has to spare, or (``rest="cheap"``) recompute
    cheaply: the fewer blocks then recompute everything."""
    for m in (mode, rest):
        if m not in MODES:
            raise ValueError(f"recompute must be one of {MODES}, got {m!r}")
    for stage in stages:
        for i, (key, block) in enumerate(list(stage.blocks.named_children())):
            how = mode if layers is None or i < layers else rest
            if how == "full":
                stage.blocks[key] = RecomputedBlock(block)
            elif how == "cheap":
                stage.blocks[key] = CheaplyRecomputedBlock(block)
            elif how == "selective":
                block.attn.core = Recompute(block.attn.core)
