"""What one transformer block keeps for its backward, tensor by tensor, eager and compiled.

The memory model (``minipar.theory.memory.layer_activations``) lists what a block keeps;
this counts what it does keep. Every tensor the forward saves for the backward (through
``torch.autograd.graph.saved_tensors_hooks``: autograd's own saves, a custom function's
and a compiled graph's alike), the weights and their views aside, once per storage, in
bytes a token and hidden unit. Compiled, the kept set is the partitioner's choice
(AOTAutograd's min-cut with inductor's fusion rules), which differs from eager's: with
float8 linears it recomputes the layer norms' and GELU's outputs in the backward instead
of keeping them.

    python benchmarks/block_saved.py                  # CPU (inductor generates C++)
    python benchmarks/block_saved.py --hidden 5120 --heads 40 --tokens 8192 --device cuda

On CUDA the float8 GEMMs are real (``torch._scaled_mm``); on a CPU they are emulated,
with the same casts and therefore the same saved tensors.

``--recompute cheap`` (eager): the block saves recipes in place of the layer norms' and
GELU's outputs and hands every other saved tensor on to the hooks around it, so the same
count reads what it keeps.

    python benchmarks/block_saved.py --recompute none,cheap

``--memory-budgets 0.8,0.5``: the compiled bf16 block again, its partitioner told to keep
that share of what it would (AOTAutograd's ``activation_memory_budget``): it then
recomputes too, by its own choice.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch._functorch.config as functorch_config
from torch import nn

from minipar.model import Block, get_config
from minipar.parallel.compile import CompiledBlock
from minipar.parallel.fp8 import apply_fp8
from minipar.parallel.recompute import apply_recompute


def saved_bytes(hidden: int, heads: int, tokens: int, recipe: str | None, compiled: bool,
                device: str = "cpu", recompute: str = "none",
                memory_budget: float = 1.0) -> dict:
    """The bytes one bf16 block of ``hidden`` units (a GPT block, d_ff = 4 hidden) keeps
    for a sequence of ``tokens``, its linears in float8 (``recipe``) or not, compiled by
    inductor (its partitioner told to keep ``memory_budget`` of what it would: AOTAutograd's
    ``activation_memory_budget``) or eager, ``recompute`` applied: the total, per token
    and hidden unit, and each tensor kept."""
    torch.manual_seed(0)
    cfg = get_config("tiny").with_(d_model=hidden, n_head=heads, d_ff=4 * hidden,
                                   seq_len=tokens, dropout=0.0)
    holder = nn.Module()
    holder.blocks = nn.ModuleDict({"0": Block(cfg).to(device, torch.bfloat16)})
    apply_recompute([holder], recompute)
    if recipe:
        apply_fp8([holder], recipe, emulate=device == "cpu")
    block = holder.blocks["0"]
    run = CompiledBlock(block, "inductor") if compiled else block
    kept: dict[int, tuple] = {}
    weights = {w.untyped_storage().data_ptr() for w in block.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:  # (a linear saves its weight, or a view)
            kept[storage.data_ptr()] = (list(t.shape), str(t.dtype), storage.nbytes())
        return t

    x = torch.randn(1, tokens, hidden, device=device, dtype=torch.bfloat16,
                    requires_grad=True)
    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
          functorch_config.patch(activation_memory_budget=memory_budget)):
        run(x)  # (what the forward saves is all: the backward need not run)
    if compiled:
        torch._dynamo.reset()
    total = sum(n for *_, n in kept.values())
    return {"recipe": recipe, "compiled": compiled, "recompute": recompute,
            "memory_budget": memory_budget, "bytes": total,
            "per_token_hidden": total / (tokens * hidden),
            "tensors": sorted(kept.values(), key=lambda k: -k[2])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--recompute", default="none",
                   help="comma-separated modes, each run eagerly (none: also compiled)")
    p.add_argument("--memory-budgets", default="",
                   help="comma-separated: also the compiled bf16 block under each budget")
    p.add_argument("--out", help="write the rows as JSON here")
    a = p.parse_args()
    rows = [saved_bytes(a.hidden, a.heads, a.tokens, recipe, compiled, a.device, mode)
            for mode in a.recompute.split(",")
            for compiled in ((False, True) if mode == "none" else (False,))
            for recipe in (None, "rowwise", "tensorwise")]
    rows += [saved_bytes(a.hidden, a.heads, a.tokens, None, True, a.device,
                         memory_budget=float(b)) for b in a.memory_budgets.split(",") if b]
    for r in rows:
        how = "compiled" if r["compiled"] else "eager"
        how += f" (budget {r['memory_budget']})" if r["memory_budget"] != 1.0 else ""
        print(f"{how:>8} {r['recipe'] or 'bf16':>10} recompute {r['recompute']:<6}: "
              f"{r['per_token_hidden']:6.2f} bytes a token and hidden unit, "
              f"{len(r['tensors'])} tensors")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
