"""Mixed precision: compute in bf16 (or fp16), keep fp32 master weights for the update.

16-bit weights, activations and gradients halve memory and use the fast matrix units,
but an update ``w - lr * g`` is often smaller than the spacing of 16-bit numbers near
``w`` (bf16 has 8 bits of mantissa), so 16-bit weights stop learning. Micikevicius et
al. 2018 ("Mixed Precision Training", arXiv 1710.03740) keep an fp32 *master* copy of
every weight: forward and backward run on the 16-bit copy, the optimizer updates the
fp32 master, and the result is copied back. Per parameter that is 2 (weights) + 2
(gradients) + 4 (master) + 8 (Adam's two moments) bytes: the "2 + 2 + 12" the ZeRO
paper counts (Rajbhandari et al. 2019, section 3.1). fp16 also needs *loss scaling*
(its narrow range underflows small gradients); bf16 has fp32's range and needs none.
The engine computes in bf16 (no loss scale); fp16 is for direct use of the class.
With ZeRO, pass it on: ``ZeroOptimizer(model, AdamW, stage=2, precision=mp)`` takes the
fp32 values from here, keeps only its shard, and ``release()``s the full copies.
"""

from __future__ import annotations

import torch
from torch import nn

from minipar.meter import storage_bytes


class MixedPrecision:
    """Cast ``model`` to ``dtype`` in place and keep fp32 master copies of its weights.

    ``loss_scale``: None (no scaling, the default for bf16), a number (static), or
    "dynamic" (the default for fp16). Frozen parameters are cast but get no master.

    Loss scaling multiplies the loss by S before backward (all gradients grow by S) and
    divides the gradients by S in fp32. The division must match a multiplication that
    happened: ``unscale_factor`` refuses to divide by S when ``scale_loss`` was not
    called since the last step (a caller who scaled nothing would otherwise train with
    gradients 65536x too small, silently). With dynamic scaling S halves when a gradient
    overflows (that step is skipped) and doubles after ``growth_interval`` good steps.

    Use (replicated optimizer, with or without ``DataParallel``)::

        mp = MixedPrecision(model, torch.bfloat16)         # model now holds bf16 weights
        opt = torch.optim.AdamW(mp.parameters(), lr=1e-3)  # the optimizer: fp32 masters
        mp.scale_loss(model(x, y)).backward()
        ddp.finish_gradient_sync()                         # if data parallel
        mp.step(opt)                                       # grads -> masters, step, back
        mp.zero_grad()
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16, *,
                 loss_scale: float | str | None = "auto", master_dtype: torch.dtype =
                 torch.float32, growth_interval: int = 1000):
        if loss_scale == "auto":
            loss_scale = "dynamic" if dtype == torch.float16 else None
        self.model, self.dtype, self.master_dtype = model, dtype, master_dtype
        self.dynamic = loss_scale == "dynamic"
        self.scale = 2.0**16 if self.dynamic else float(loss_scale or 1.0)
        self.growth_interval, self._good_steps = growth_interval, 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            # The masters are taken before the cast: exactly the fp32 reference weights.
            self._masters = {id(p): nn.Parameter(p.detach().to(master_dtype, copy=True))
                             for p in self.params}
            for p in model.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
        self.skipped_steps = 0
        self._unscaled, self._finite, self._loss_scaled = False, True, False

    # --- masters ------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """The fp32 masters, in the model's parameter order: build the optimizer on them."""
        return [self.master(p) for p in self.params]

    def master(self, p: nn.Parameter) -> nn.Parameter:
        """The fp32 master of model parameter ``p``."""
        try:
            return self._masters[id(p)]
        except KeyError:
            raise RuntimeError("no master for this parameter: it is frozen, or the masters "
                               "were released to a ZeRO optimizer") from None

    def release(self) -> None:
        """Drop the full master copies (ZeRO keeps its own shard of them)."""
        self._masters.clear()

    # --- loss scaling -------------------------------------------------------------
    @property
    def scaling(self) -> bool:
        return self.scale != 1.0 or self.dynamic

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``; backward on this gives gradients scaled by S."""
        self._loss_scaled = True
        return loss * self.scale if self.scaling else loss

    def unscale_factor(self) -> float:
        """1/S, the factor that turns this step's gradients back into true ones."""
        if not self.scaling:
            return 1.0
        if not self._loss_scaled:
            raise RuntimeError(f"loss scaling is on (S = {self.scale:g}) but scale_loss() was "
                               "not called: backward on mp.scale_loss(loss), or build "
                               "MixedPrecision(..., loss_scale=None)")
        return self.inv_scale

    def update_scale(self, found_inf: bool) -> None:
        """After a step: halve S on overflow, double it after enough good steps."""
        self._loss_scaled = False  # the next step's backward must scale again
        if not self.dynamic:
            return
        if found_inf:
            self.scale, self._good_steps = max(self.scale / 2, 1.0), 0
            return
        self._good_steps += 1
        if self._good_steps % self.growth_interval == 0:
            self.scale *= 2

    # --- the step (replicated optimizer) ------------------------------------------
    def unscale_grads(self) -> bool:
        """Model gradients -> fp32 master gradients, divided by S; True if all finite.

        ``step`` calls it if needed; call it yourself before clipping (the norm must be
        taken on the unscaled fp32 gradients: ``dp.global_grad_norm``, ``scale_grads``).
        """
        finite, factor = True, self.unscale_factor()
        for p in self.params:
            m = self.master(p)
            if p.grad is None:
                m.grad = None
                continue
            m.grad = p.grad.to(self.master_dtype, copy=True)
            if self.scaling:
                m.grad.mul_(factor)
                finite = finite and bool(torch.isfinite(m.grad).all())
        self._unscaled, self._finite = True, finite
        return finite

    def scale_grads(self, factor: float) -> None:
        # One foreach call, not a kernel launch per tensor (GPU speed; same values).
        torch._foreach_mul_([m.grad for m in self.parameters() if m.grad is not None],
                            factor)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """One update on the masters, copied into the model. False if skipped (overflow).

        With data parallelism the gradients are identical on every dp rank after the
        sync, so every rank takes the same decision. (Under pipeline or tensor
        parallelism an overflow on one stage must skip all: use bf16 there.)
        """
        if not self._unscaled:
            self.unscale_grads()
        finite, self._unscaled = self._finite, False
        if finite:
            optimizer.step()
            self.copy_to_model()
        else:
            self.skipped_steps += 1
        self.update_scale(not finite)
        for m in self.parameters():
            m.grad = None  # fp32 gradients live only during the step
        return finite

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the fp32 masters into the model's 16-bit weights."""
        # One foreach call, not a kernel launch per tensor (GPU speed; same values).
        torch._foreach_copy_(self.params, self.parameters())

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self._masters.values():
            m.grad = None

    def master_bytes(self) -> int:
        return storage_bytes(self._masters.values())
