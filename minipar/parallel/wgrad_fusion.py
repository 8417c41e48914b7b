"""Weight-gradient accumulation fusion: each micro-batch's weight gradient is added to the
fp32 sum in the same matrix multiply that computes it.

A linear layer y = x W^T + b has the weight gradient dW = dy^T x. Under bf16 with fp32
gradient sums (the default, ``grad_dtype``), the plain route is two kernels per
micro-batch: autograd's matrix multiply writes dW in bf16 (rounded), then the optimizer's
hook reads it back and adds it to the fp32 sum, 2 + 4 + 4 bytes an element. The fused
route is one: ``addmm(sum, dy^T, x, out_dtype=fp32)`` reads the sum into the GEMM's
epilogue and writes it back, ``sum += dy^T x`` with fp32 accumulation and no bf16 copy.
Megatron-LM does the same (its ``gradient_accumulation_fusion``, a CUDA kernel
``wgrad_gemm_accum_fp32``; Narayanan et al. 2021, arXiv 2104.04473, the code's
``LinearWithGradAccumulationAndAsyncCommunication``). On one H100, a pipeline stage of
gpt-1.3b (6 layers, 4,096 tokens a micro-batch): 4.69 ms for matmul + add, 3.66 ms fused,
and 4.04 ms for matmul + add all in bf16 (``benchmarks/accum_probe.py``). The sum is also
more exact: no micro-batch's gradient is rounded to bf16 first.

Applied from outside by replacing submodules: each ``nn.Linear`` whose weight the
optimizer's flat buffers hold becomes a ``FusedWgradLinear`` holding the same parameters
under the same names. Its backward hands (dy, x) to a *sink*, ``ZeroOptimizer`` or
``Zero3`` (``accumulate_product``), which adds the product to the weight's slot and
counts the arrival as its gradient hook would. The weight then gets no ``.grad`` at all;
the bias still goes through autograd and the hook.

The zero-bubble pipeline splits a backward into B (input gradients) and W (weight
gradients) and runs each through the engine with only what it wants (``pp.PipelineExecutor``).
Autograd's own matrix multiplies skip the product nobody asked for; a custom function
must ask the engine which of its inputs the running backward will reach
(``torch._C._will_engine_execute_node``). ``torch.autograd.grad`` cannot answer for a
leaf: the engine only calls it for activations (B), never for weights, so there the
input gradient is computed and the weight's is not.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class ProductSink(Protocol):
    """Where fused weight gradients go (``ZeroOptimizer``, ``Zero3``)."""

    def fusable(self, linear: nn.Linear) -> bool: ...
    def accumulate_product(self, p: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None: ...


def _will_run(node, in_autograd_grad: bool) -> bool:
    """Will the running backward execute ``node`` (an input's gradient edge)?"""
    if node is None:  # the input needs no gradient
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # a leaf under autograd.grad: the caller's rule decides
        return in_autograd_grad


class _LinearIntoSum(torch.autograd.Function):
    """y = x W^T + b; backward: dx = dy W, db = sum dy, and dy^T x into the sink."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                accumulate: Callable) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.accumulate, ctx.param = accumulate, weight  # (saved tensors: new objects)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        # one edge per tensor input: x, weight, and the bias if there is one
        x_node, w_node, b_node = [n for n, _ in ctx.next_functions] + [None] * (
            3 - len(ctx.next_functions))
        dx = dy @ weight if _will_run(x_node, in_autograd_grad=True) else None
        dy2 = dy.reshape(-1, dy.shape[-1])  # [tokens, out]
        if _will_run(w_node, in_autograd_grad=False):
            ctx.accumulate(ctx.param, dy2, x.reshape(-1, x.shape[-1]))
        db = dy2.sum(0) if _will_run(b_node, in_autograd_grad=False) else None
        return dx, None, db, None


class FusedWgradLinear(nn.Module):
    """``linear`` (its very parameters, under the same names) with a fused weight
    gradient: backward calls ``accumulate(weight, dy, x)`` (a sink's
    ``accumulate_product``; kept as a function, so a sink that is a module, ``Zero3``,
    does not become a submodule of its own model)."""

    def __init__(self, linear: nn.Linear, accumulate: Callable) -> None:
        super().__init__()
        self.weight, self.bias, self.accumulate = linear.weight, linear.bias, accumulate
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @torch._disable_dynamo  # eager inside a compiled block: a graph would lose the sink
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearIntoSum.apply(x, self.weight, self.bias, self.accumulate)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight gradient into the fp32 sum")


def _weights(m: nn.Module) -> list[torch.Tensor]:
    """What ``m`` itself holds: its parameters, or the plain leaves ZeRO-3 put there."""
    return [*m.parameters(recurse=False),
            *(v for v in vars(m).values() if isinstance(v, torch.Tensor))]


def fuse_weight_gradients(chunks: Iterable[nn.Module], sink: ProductSink) -> int:
    """Replace every ``nn.Linear`` of ``chunks`` that ``sink`` can take (it holds the
    weight's gradient sum) and whose weight no other module uses (a head tied to the
    embedding on the same rank would arrive twice a backward) by a
    ``FusedWgradLinear``. Returns how many were replaced."""
    chunks = list(chunks)
    uses = Counter(id(t) for c in chunks for m in c.modules() for t in _weights(m))
    replaced = 0
    for chunk in chunks:
        for parent in list(chunk.modules()):
            for name, child in list(parent.named_children()):
                if (type(child) is nn.Linear and uses[id(child.weight)] == 1
                        and sink.fusable(child)):
                    setattr(parent, name, FusedWgradLinear(child, sink.accumulate_product))
                    replaced += 1
    return replaced
