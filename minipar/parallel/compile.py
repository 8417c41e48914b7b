"""Compile each transformer block with ``torch.compile``: the same block, its kernels fused.

TorchDynamo captures a block's forward as a graph, AOTAutograd derives its backward, and
TorchInductor fuses what eager PyTorch runs as separate kernels (layer norms, residual
adds, GELU, casts, dropout) into a few generated ones (Ansel et al. 2024, "PyTorch 2",
ASPLOS, doi:10.1145/3620665.3640366). Per block, as torchtitan does: every block has the
same shapes, so one compilation serves them all, and the machinery between blocks
(ZeRO-3's gathers, the pipeline's sends) stays eager, outside the graphs.

Applied from outside by replacing submodules, last before data parallelism: each block
becomes a ``CompiledBlock`` that adopts its children (the same objects, under the same
names) and runs the block's computation, ``Block.forward``, through ``torch.compile``. A
``RecomputedBlock``'s checkpoint stays outside, around the graph: dynamo takes a
checkpoint whole (one higher-order op whose body must trace without a break), and the
fused weight-gradient linear (``wgrad_fusion.py``) breaks every graph it is in, so a
checkpoint inside would leave the whole block eager. Hooks that data parallelism later
puts on the block run eagerly around the graph, never inside it. Compilation happens at
the first step; ``compile_stats`` says how many graphs it made, how long it took and how
often torch's on-disk caches (``TORCHINDUCTOR_CACHE_DIR``) spared it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from minipar.model import Block
from minipar.parallel.recompute import RecomputedBlock

BACKENDS = ("inductor", "aot_eager", "eager")  # aot_eager: graphs and AOTAutograd, no codegen


class CompiledBlock(Block):
    """``block`` compiled: its children adopted, its class's ``forward`` compiled."""

    def __init__(self, block: Block, backend: str = "inductor") -> None:
        nn.Module.__init__(self)  # not Block.__init__: adopt, do not create, the layers
        for name, child in block.named_children():
            self.add_module(name, child)
        self.compiled_from = type(block).__name__
        self.recomputed = isinstance(block, RecomputedBlock)
        # the unbound function: called with this module, whose children are the block's
        self._forward = torch.compile(Block.forward, backend=backend, dynamic=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recomputed:  # backward runs the compiled forward again
            return checkpoint(self._forward, self, x, use_reentrant=False)
        return self._forward(self, x)

    def extra_repr(self) -> str:
        return f"compiled {self.compiled_from}"


def apply_compile(stages: Iterable[nn.Module], backend: str = "inductor") -> int:
    """Replace every block of ``stages`` (modules with a ``blocks`` container) by its
    ``CompiledBlock``. Returns the number of blocks compiled."""
    if backend not in BACKENDS:
        raise ValueError(f"compile backend must be one of {BACKENDS}, got {backend!r}")
    n = 0
    for stage in stages:
        for key, block in list(stage.blocks.named_children()):
            stage.blocks[key] = CompiledBlock(block, backend)
            n += 1
    return n


def compile_stats(stages: Iterable[nn.Module]) -> dict:
    """The blocks of ``stages`` that run compiled, the graphs dynamo captured for them,
    the seconds this process spent compiling (graph capture and code generation, forward
    and backward: the first step's extra time) and the hits and misses of torch's
    compiled-graph caches."""
    # (torch._dynamo takes seconds to import: only a run that compiles pays for it)
    from torch._dynamo.utils import compilation_time_metrics, counters

    blocks = sum(isinstance(b, CompiledBlock) for s in stages for b in s.blocks.values())
    graphs = counters["stats"]["unique_graphs"]  # 0: every block ran eagerly after all
    seconds = {k: round(sum(compilation_time_metrics.get(m, [])), 3) for k, m in (
        ("forward", "_compile.compile_inner"), ("backward", "backward._backward_impl"))}
    cache = {k: v for k, v in {**counters["inductor"], **counters["aot_autograd"]}.items()
             if "cache" in k}
    return {"blocks": blocks, "graphs": graphs, "seconds": round(sum(seconds.values()), 3),
            **seconds, "cache": cache, "graph_breaks": sum(counters["graph_break"].values())}
