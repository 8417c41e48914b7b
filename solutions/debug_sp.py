"""Lesson 03 debugging lab: sequence parallelism whose replicated gradients are partial.

Two ranks run the tiny GPT with tensor and sequence parallelism (tp = 2, sp on). The
loss agrees with one process, the gradient norm is close, and the audit of lesson 04
finds no factor of the layout in it. And yet some parameters do not get the gradient
one process gives them. Under sequence parallelism a rank runs the layer norms (and
everything else outside the tensor-parallel regions) on *its part of the sequence*
only, so the gradient of a parameter used there, replicated on every tp rank, holds
only that part's contribution. Something must add the parts.

``gradient_audit()`` compares every parameter's gradient with one process and lists
those that differ. Find what they have in common, fix the line marked below, and
``check("debug_sp")``.
"""

from __future__ import annotations

import torch

from minipar.comm import Comm
from minipar.data import MarkovData
from minipar.model import GPT, get_config
from minipar.parallel.tp import (
    apply_tensor_parallel,
    gather_tensor,
    sync_sequence_parallel_grads,
)

CFG = get_config("tiny").with_(n_layer=2)
BATCH = 4


def finish_gradients(model: torch.nn.Module, comm: Comm) -> None:
    """After the backward, before the optimizer: complete the gradients on this rank."""
    ### BEGIN SOLUTION
    # HINT: a replicated parameter used on a sequence shard (marked p.sequence_parallel)
    # has only this rank's tokens' part of its gradient: sum the parts over the tp group,
    # sync_sequence_parallel_grads(model, comm).
    sync_sequence_parallel_grads(model, comm)
    ### PLANTED BUG
    # pass  # the tensor-parallel layers' own collectives did all that is needed
    ### END SOLUTION


def sp_step() -> dict:
    """One forward and backward at tp = 2 with sp; the loss and every full gradient."""
    comm = Comm()
    torch.manual_seed(0)
    model = apply_tensor_parallel(GPT(CFG), comm, sequence_parallel=True)
    x, y = MarkovData(CFG.vocab_size, CFG.seq_len).batch(0, BATCH)
    loss = model(x, y)
    loss.backward()
    finish_gradients(model, comm)
    grads = {name: gather_tensor(name, p.grad, comm) for name, p in model.named_parameters()}
    marked = [name for name, p in model.named_parameters()
              if getattr(p, "sequence_parallel", False)]
    return {"loss": float(loss.detach()), "grads": grads, "marked": marked}


def reference_step() -> dict:
    """The same step in one process: the loss and every gradient."""
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = MarkovData(CFG.vocab_size, CFG.seq_len).batch(0, BATCH)
    loss = model(x, y)
    loss.backward()
    return {"loss": float(loss.detach()),
            "grads": {name: p.grad for name, p in model.named_parameters()}}


def differing(run: dict, ref: dict, tol: float = 1e-5) -> dict[str, float]:
    """Parameters whose gradient differs from one process: name -> relative error."""
    out = {}
    for name, g_ref in ref["grads"].items():
        err = float((run["grads"][name] - g_ref).abs().max() / g_ref.abs().max())
        if err > tol:
            out[name] = err
    return out


def _norm(grads: dict) -> float:
    return sum(float(g.double().pow(2).sum()) for g in grads.values()) ** 0.5


def gradient_audit() -> None:
    """Run tp = 2 with sp and one process; print losses, norms, audit, differing grads."""
    from minipar.launch import launch
    from minipar.parity import audit

    ref = reference_step()
    run = launch(sp_step, 2, timeout=60)[0]
    ratio = _norm(run["grads"]) / _norm(ref["grads"])
    print(f"loss:          one process {ref['loss']:.5f}   tp=2 sp {run['loss']:.5f}")
    print(f"gradient norm: one process {_norm(ref['grads']):.5f}   tp=2 sp "
          f"{_norm(run['grads']):.5f}   ratio {ratio:.4f}")
    if abs(ratio - 1) < 1e-4:
        print("audit: the gradient norms agree")
    else:
        print("audit:", audit([ratio], {"tp": 2}) or "no size of the layout explains the ratio")
    off = differing(run, ref)
    print(f"parameters whose gradient differs from one process: {len(off)} of "
          f"{len(ref['grads'])}")
    for name, err in off.items():
        print(f"  {name:<28} off by {err:.0%}")
