"""Lesson 04 debugging lab: one step of tensor and sequence parallelism, beside one process.

Two ranks run one forward and backward of the tiny GPT (2 layers) with tensor
parallelism over both (tp = 2) and sequence parallelism on; one process runs the same
step on the same batch. ``sp_step`` is the whole step on a rank: build the model, apply
the plan, forward, backward, complete the gradients, gather every gradient from its
shards. ``gradient_audit()`` prints the two losses, the two gradient norms, the audit of
lesson 01 (is the norm off by a size of the layout?) and every parameter whose gradient
differs from one process's.

Your copy has one bug. Run the audit and read its list: what do the parameters it names
have in common, that the ones it does not name lack? What does a rank compute for them
under sequence parallelism? Then find the code in this file that is meant to handle
them, fix it, and ``check("debug_sp")``.
"""

from __future__ import annotations

import torch

from minipar.comm import Comm
from minipar.data import MarkovData
from minipar.model import GPT, get_config
from minipar.parallel.tp import apply_tensor_parallel, gather_tensor

CFG = get_config("tiny").with_(n_layer=2)
BATCH = 4


def finish_gradients(model: torch.nn.Module, comm: Comm) -> None:
    """After the backward, before the optimizer: complete the gradients on this rank.

    A sharded parameter's gradient is complete: its layer's collectives saw to it. A
    parameter marked ``p.sequence_parallel`` is replicated but used on this rank's part of
    the sequence only, so its gradient holds that part's contribution: sum the parts over
    the tp group, in one flat all-reduce.
    """
    partial = [p.grad for p in model.parameters()
               ### BEGIN SOLUTION
               # HINT: the filter keeps only the matrices (p.dim() > 1), but the layer
               # norms' weights and biases and the row layers' biases are vectors and
               # are marked too: keep every marked parameter,
               # if getattr(p, "sequence_parallel", False) and p.grad is not None]
               if getattr(p, "sequence_parallel", False) and p.grad is not None]
               ### PLANTED BUG
               # if getattr(p, "sequence_parallel", False) and p.dim() > 1]
               ### PLANTED BUG 4
               # HINT(4): the filter is inverted: it sums the sharded parameters' gradients,
               # HINT(4): which were complete, and not the marked ones. Keep the marked ones:
               # HINT(4): if getattr(p, "sequence_parallel", False) and p.grad is not None]
               # if not getattr(p, "sequence_parallel", False) and p.grad is not None]
               ### END SOLUTION
    if comm.size == 1 or not partial:
        return
    flat = torch.cat([g.reshape(-1) for g in partial])
    ### BEGIN SOLUTION
    comm.all_reduce(flat)
    ### PLANTED BUG 2
    # HINT(2): the parts are flattened and copied back, but nothing adds them across the
    # HINT(2): tp group: comm.all_reduce(flat) after the torch.cat.
    # flat = flat.contiguous()
    ### PLANTED BUG 3
    # HINT(3): the parts of a sum must be added, not averaged: drop flat /= comm.size.
    # comm.all_reduce(flat)
    # flat /= comm.size
    ### END SOLUTION
    offset = 0
    for g in partial:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


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
        found = audit([ratio], {"tp": 2})
        print("audit:", found.split(";")[0] if found
              else "no size of the layout explains the ratio")
    off = differing(run, ref)
    print(f"parameters whose gradient differs from one process: {len(off)} of "
          f"{len(ref['grads'])}")
    for name, err in off.items():
        print(f"  {name:<28} {_shape(ref['grads'][name]):>8}  off by {err:.0%}")
    same = [name for name in ref["grads"] if name not in off]
    print(f"and the {len(same)} that agree:")
    for name in same:
        print(f"  {name:<28} {_shape(ref['grads'][name]):>8}")


def _shape(t: torch.Tensor) -> str:
    return " x ".join(map(str, t.shape))
