"""Mixed precision: compute in bf16, keep fp32 master weights for the update.

Why: 16-bit weights, activations and gradients halve memory and use the fast matrix
units, but an update ``w - lr * g`` is often smaller than the spacing of 16-bit numbers
near ``w`` (bf16 has 8 bits of mantissa), so 16-bit weights stop learning. Micikevicius
et al. 2018 ("Mixed Precision Training", arXiv 1710.03740) keep an fp32 *master* copy
of every weight: forward and backward run on the 16-bit copy, the optimizer updates the
fp32 master (with fp32 optimizer states), and the result is copied back into the model.
Per parameter that is 2 (weights) + 2 (gradients) + 4 (master) + 8 (Adam's two moments)
bytes: the "2 + 2 + 12" the ZeRO paper counts (Rajbhandari et al. 2020, section 3.1).
bf16 has fp32's exponent range, so no loss scaling is needed (fp16 would need it).

Use (one process)::

    mp = MixedPrecision(model, torch.bfloat16)         # model now holds bf16 weights
    opt = torch.optim.AdamW(mp.parameters(), lr=1e-3)  # the optimizer sees fp32 masters
    model(x, y).backward()
    mp.step(opt)                                       # grads -> masters, step, copy back
    mp.zero_grad()

With ZeRO, pass it on: ``ZeroOptimizer(model, AdamW, stage=2, precision=mp)`` takes the
fp32 values from here, keeps only its shard of them, and ``release()``s the full copies.
"""

from __future__ import annotations

import torch
from torch import nn


class MixedPrecision:
    """Cast ``model`` to ``dtype`` in place and keep fp32 master copies of its weights.
    Frozen parameters are cast but get no master."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16, *,
                 master_dtype: torch.dtype = torch.float32):
        self.model, self.dtype, self.master_dtype = model, dtype, master_dtype
        self.params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            # The masters are taken before the cast: exactly the fp32 reference weights.
            self._masters = {id(p): nn.Parameter(p.detach().to(master_dtype, copy=True))
                             for p in self.params}
            for p in model.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(dtype)

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

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Model gradients -> fp32 master gradients, one update on the masters, and the
        result rounded into the model's 16-bit weights."""
        for p in self.params:
            self.master(p).grad = None if p.grad is None else p.grad.to(self.master_dtype)
        optimizer.step()
        self.copy_to_model()
        for m in self.parameters():
            m.grad = None  # fp32 gradients live only during the step

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
