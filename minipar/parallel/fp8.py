"""Float8 training: the blocks' linear layers multiply in 8-bit floats.

Two formats (Micikevicius et al. 2022, arXiv 2209.05433): e4m3 (3 mantissa bits, max 448)
for the forward operands, input x and weight W; e5m2 (2 mantissa bits, max 57344: the
range gradients need) for the output gradient dy. Each operand is scaled into its
format's range, q = fp8(t * s), and the GEMM divides its fp32 sums by both scales
(``torch._scaled_mm``'s epilogue). s is the largest power of two with amax * s <= max:
exact, never overflowing, and moving only the exponent, so the rounding is the same
whatever s, except that values 2^17 below amax flush to zero. amax is taken fresh each
call over the whole tensor ("tensorwise") or per row ("rowwise": small rows keep their
range beside an outlier row). All three GEMMs run in float8, each as A B^T with both
scaled along the contraction: y = x W^T, dx = dy (W^T)^T, dW = dy^T (x^T)^T.
Tensor parallelism: an amax over a tp-split dimension is all-reduced (max), so every
layout quantises as one device (TransformerEngine reduces amax over tp too). ZeRO-3
may hand a linear its weight already in float8 (``weight8``: ``zero/gather.py`` gathers
it so, tensorwise). CPUs have no float8 GEMM: ``emulate`` makes the same casts and
multiplies in fp32 (the tests). An MoE layer's router stays in the compute dtype, as in
Megatron-Core, torchao and DeepSeek-V3: its top-k is a discrete choice that a 6% rounding
flips, and its E outputs are rarely the multiple of 16 ``torch._scaled_mm`` needs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from minipar.comm import Comm
from minipar.model import GPTConfig, MoE
from minipar.parallel.tp import ColumnParallelLinear, wanted

RECIPES = ("rowwise", "tensorwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class Scaled(NamedTuple):
    """A float8 tensor and the scale it was multiplied by (t ~ data / scale)."""

    data: torch.Tensor
    scale: torch.Tensor  # fp32: [] (tensorwise) or [rows, 1] (rowwise)


def scale_for(amax: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """The largest power of two s with amax * s <= the format's max (fp32)."""
    room = torch.finfo(fmt).max / amax.float().clamp(min=1e-30)
    return torch.exp2(torch.floor(torch.log2(room)))


def to_float8(t: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """fp8(t * scale), multiplied in ``t``'s dtype (exact: a power of two)."""
    return (t * scale.to(t.dtype)).to(fmt)


class Float8Matmul:
    """y = x W^T (+ b) with every GEMM in float8. ``comm``/``split``: the tp group and the
    feature ("in" or "out") it splits, whose amaxes are all-reduced over the group.
    ``weight8``: the weight already quantised (tensorwise), set by whoever delivers it in
    float8 (ZeRO-3's gathers); None: the weight is cast at each use."""

    def __init__(self, recipe: str = "rowwise", emulate: bool = False,
                 comm: Comm | None = None, split: str | None = None) -> None:
        if recipe not in RECIPES:
            raise ValueError(f"fp8 recipe must be one of {RECIPES}, got {recipe!r}")
        self.recipe, self.emulate, self.comm, self.split = recipe, emulate, comm, split
        self.weight8: Scaled | None = None

    def quantize(self, t: torch.Tensor, dims: tuple[str, str], fmt: torch.dtype) -> Scaled:
        """Row-major float8 copy of 2-d ``t`` (dims named: "tokens", "in", "out"),
        scaled per row over its last dim (rowwise) or as a whole (tensorwise)."""
        rowwise = self.recipe == "rowwise"
        amax = torch.linalg.vector_norm(t, float("inf"), dim=1 if rowwise else None,
                                        keepdim=rowwise, dtype=torch.float32)
        if self.comm is not None and self.split in (dims[1:] if rowwise else dims):
            self.comm.all_reduce(amax, op="max")  # the whole feature's amax, as one device
        scale = scale_for(amax, fmt)
        return Scaled(to_float8(t, scale, fmt).contiguous(), scale)

    def weight_operand(self, weight: torch.Tensor, transposed: bool = False,
                       scale: torch.Tensor | None = None) -> Scaled:
        """W [out, in] (``transposed``: W^T [in, out], the dx GEMM's) in e4m3: ``weight8``
        where the weight arrived in float8 (one tensorwise scale serves W and W^T alike),
        else cast from ``weight`` here, with ``scale`` where it is known (tensorwise)."""
        if self.weight8 is not None:
            return _transposed(self.weight8) if transposed else self.weight8
        if scale is not None:
            return Scaled(to_float8(weight.t() if transposed else weight, scale,
                                    E4M3).contiguous(), scale)
        return self.quantize(weight.t() if transposed else weight,
                             ("in", "out") if transposed else ("out", "in"), E4M3)

    def mm(self, a: Scaled, b: Scaled, out_dtype: torch.dtype,
           fast_accum: bool = False) -> torch.Tensor:
        """a.data b.data^T / (a.scale b.scale^T): [M, K] x [N, K] -> [M, N]."""
        if self.emulate:  # dividing by a power of two is exact: only the sums round
            return ((a.data.float() / a.scale) @ (b.data.float() / b.scale).t()).to(out_dtype)
        return torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale.reciprocal(),
                                scale_b=b.scale.reciprocal().t(), out_dtype=out_dtype,
                                use_fast_accum=fast_accum)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        # [..., in] -> [tokens, in] outside the function: its output is then no view
        y = _Float8Linear.apply(x.reshape(-1, x.shape[-1]), weight, self)
        y = y.unflatten(0, x.shape[:-1])
        return y if bias is None else y + bias

    def __repr__(self) -> str:
        tp = f", tp split {self.split}" if self.comm is not None else ""
        return f"Float8Matmul({self.recipe}{', emulated' if self.emulate else ''}{tp})"


def _transposed(q: Scaled) -> Scaled:
    """q^T, row-major, under the same scale: exact, and 1 byte an element to move."""
    return Scaled(q.data.t().contiguous(), q.scale)


class _Float8Linear(torch.autograd.Function):
    """[tokens, in] x W^T forward; dy W and dy^T x backward, each GEMM's operands in
    float8 (e5m2 for dy, e4m3 for x and W; always the left one for dy).

    Rowwise, each GEMM scales its operands along its own contraction: x per token in the
    forward, per feature for dW, so every operand is cast again for each GEMM, from the
    saved 16-bit tensor. Tensorwise, one scale serves a tensor and its transpose: x is
    cast once, in the forward, and kept in float8 for dW (half the bytes saved); dy is
    cast once for both backward GEMMs; W is cast again for dx with the forward's scale
    (its amax is not read twice), not kept, so that ZeRO-3 can free a gathered weight
    after the forward. The transposes move float8 bytes. Both give the same numbers as
    casting each operand afresh (tensorwise's amax is the same over any layout)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, f8: Float8Matmul):
        x8, w8 = f8.quantize(x, ("tokens", "in"), E4M3), f8.weight_operand(weight)
        ctx.f8, ctx.dtype = f8, x.dtype
        if f8.recipe == "tensorwise":
            ctx.save_for_backward(x8.data, x8.scale, weight, w8.scale)
        else:
            ctx.save_for_backward(x, weight)
        return f8.mm(x8, w8, x.dtype, fast_accum=True)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        f8, dx, dw = ctx.f8, None, None
        # dx = dy W = dy (W^T)^T: contraction over "out";
        # dW = dy^T x = dy^T (x^T)^T: contraction over the tokens
        if f8.recipe == "tensorwise":
            x8_data, x8_scale, weight, w_scale = ctx.saved_tensors
            dy8 = f8.quantize(dy, ("tokens", "out"), E5M2)  # once, for both GEMMs
            if wanted(ctx, 0):
                dx = f8.mm(dy8, f8.weight_operand(weight, True, scale=w_scale), ctx.dtype)
            if wanted(ctx, 1):
                dw = f8.mm(_transposed(dy8), _transposed(Scaled(x8_data, x8_scale)),
                           weight.dtype)
            return dx, dw, None
        x, weight = ctx.saved_tensors
        if wanted(ctx, 0):
            dx = f8.mm(f8.quantize(dy, ("tokens", "out"), E5M2),
                       f8.weight_operand(weight, transposed=True), ctx.dtype)
        if wanted(ctx, 1):
            dw = f8.mm(f8.quantize(dy.t(), ("out", "tokens"), E5M2),
                       f8.quantize(x.t(), ("in", "tokens"), E4M3), weight.dtype)
        return dx, dw, None


class Float8Linear(nn.Module):
    """``linear``'s very parameters (same names) multiplied in float8."""

    def __init__(self, linear: nn.Linear, matmul: Float8Matmul) -> None:
        super().__init__()
        self.weight, self.bias, self.matmul = linear.weight, linear.bias, matmul
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.matmul!r}")


def apply_fp8(chunks: Iterable[nn.Module], recipe: str, emulate: bool = False) -> int:
    """Replace in every chunk's blocks each ``nn.Linear`` by a ``Float8Linear`` and each
    tensor-parallel linear by one whose local GEMMs run in float8 (not the embeddings,
    not the head, not an MoE layer's router). Returns how many were replaced."""
    replaced = 0
    for chunk in chunks:
        for parent in list(chunk.blocks.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(parent, MoE) and name == "router":
                    continue
                if type(child) is nn.Linear:
                    new = Float8Linear(child, Float8Matmul(recipe, emulate))
                elif isinstance(child, ColumnParallelLinear):  # (and its row subclass)
                    matmul = Float8Matmul(recipe, emulate, child.comm, child.split)
                    new = type(child)(child.weight, child.bias, child.comm,
                                      child.sequence_parallel, linear=matmul)
                else:
                    continue
                setattr(parent, name, new)
                replaced += 1
    return replaced


def float8_weights(model: nn.Module) -> dict[str, Float8Matmul]:
    """Name of every weight a ``Float8Matmul`` multiplies (in ``model.named_parameters``)
    -> that matmul: a ``Float8Linear``'s or a tensor-parallel linear's local product."""
    by_weight = {}
    for m in model.modules():
        f8 = getattr(m, "matmul", getattr(m, "linear", None))
        if isinstance(f8, Float8Matmul):
            by_weight[id(m.weight)] = f8
    return {n: by_weight[id(p)] for n, p in model.named_parameters() if id(p) in by_weight}


def fp8_supported(device: torch.device) -> bool:
    """Whether ``device`` multiplies in float8: a CUDA GPU of compute capability 8.9+."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def gemm_sizes(cfg: GPTConfig, tp: int, tokens: int) -> dict[str, int]:
    """The GEMM dimensions a rank's float8 linears see, by name: the hidden size, its
    and the FFN's tp shares, and ``tokens``, a micro-batch's on the rank."""
    return {"hidden": cfg.d_model, "hidden / tp": cfg.d_model // tp,
            "ffn / tp": cfg.d_ff // tp, "tokens per micro-batch": tokens}


def check_fp8(recipe: str | None, emulate: bool, device: torch.device | None, dtype: str,
              sequence_parallel: bool, sizes: dict[str, int],
              cheap_recompute: bool = False) -> None:
    """Raise ValueError (one line) if ``--fp8 recipe`` cannot run here. ``sizes``: the
    GEMM dimensions a rank sees (``gemm_sizes``); ``cheap_recompute``: some blocks
    recompute cheaply. ``device`` None: a GPU that has float8 matmuls (the planner's,
    whose card ``theory.clusters.check_fp8_card`` checks): ``train`` and ``plan`` refuse
    a layout by these same rules."""
    if recipe is None:
        if emulate:
            raise ValueError("--fp8-emulate needs --fp8 rowwise or --fp8 tensorwise")
        return
    if recipe not in RECIPES:
        raise ValueError(f"--fp8 must be one of {', '.join(RECIPES)}, got {recipe!r}")
    if sequence_parallel:
        raise ValueError("--fp8 with --sp is not supported: use --fp8 with tp alone")
    if not emulate:
        _check_kernels(recipe, device, dtype, sizes)
    if cheap_recompute and recipe == "tensorwise":
        raise ValueError("--recompute cheap with --fp8 tensorwise saves nothing: tensorwise "
                         "keeps float8 copies of the inputs it would recompute; use "
                         "--fp8 rowwise or another --recompute")


def _check_kernels(recipe: str, device: torch.device | None, dtype: str,
                   sizes: dict[str, int]) -> None:
    """What ``torch._scaled_mm`` needs: a GPU that has it, bf16 outputs for rowwise
    scales, every GEMM size a multiple of 16."""
    if device is not None and not fp8_supported(device):
        where = "CPUs" if device.type == "cpu" else torch.cuda.get_device_name(device)
        raise ValueError(f"--fp8 needs float8 matmuls (a GPU of compute capability 8.9 or "
                         f"newer: Ada, Hopper); {where} have none: --fp8-emulate emulates "
                         f"them in fp32 (for tests: same numbers, no speed)")
    if recipe == "rowwise" and dtype != "bf16":
        raise ValueError("--fp8 rowwise needs --dtype bf16 (torch._scaled_mm's rowwise "
                         "kernels write bf16)")
    for what, n in sizes.items():
        if n % 16:
            raise ValueError(f"--fp8 needs GEMM sizes divisible by 16 (torch._scaled_mm); "
                             f"{what} is {n}")


__all__ = ["RECIPES", "Scaled", "scale_for", "to_float8", "Float8Matmul", "Float8Linear",
           "apply_fp8", "float8_weights", "fp8_supported", "gemm_sizes", "check_fp8"]
