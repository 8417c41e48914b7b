"""Lesson 05 debugging lab: a pipeline step whose loss is right.

Two ranks run one step of the tiny GPT (4 layers) as a 2-stage 1F1B pipeline over ``m``
micro-batches, the way the engine does it: build this rank's stage, make the schedule,
split the batch, let the executor run the forwards and backwards (each micro-batch's
loss times ``loss_scale`` before its backward; the executor's docstring says what it
expects), then measure the gradient norm over both stages. One process runs the same
batch. The loss each rank reports agrees with one process to float rounding.

Your copy has one bug. ``gradient_audit()`` prints the two losses, the two gradient norms
and their ratio, and names the size of the layout that explains the ratio, if one does.
Try it at more than one ``m``: how does the ratio move? Is it the gradients that are
wrong, or the way they are measured? Find the line, fix it, and
``check("debug_pipeline")``.
"""

from __future__ import annotations

import torch

from minipar.comm import Comm
from minipar.data import MarkovData, split_batch
from minipar.model import GPT, get_config
from minipar.parallel.pp import PipelineExecutor, build_stage
from minipar.parallel.schedules import make_schedule

CFG = get_config("tiny").with_(n_layer=4)
BATCH = 8


def grad_norm(chunks) -> float:
    """The gradient norm over every rank's parameters (an all-reduce of the squares)."""
    comm = Comm()
    sq = sum(float(p.grad.double().pow(2).sum()) for c in chunks for p in c.parameters()
             if p.grad is not None)
    total = torch.tensor([sq], dtype=torch.float64)
    ### BEGIN SOLUTION
    comm.all_reduce(total)
    ### PLANTED BUG 3
    # HINT(3): each rank sums the squares of its own stage only; the norm of the whole
    # HINT(3): model needs them added over the stages: comm.all_reduce(total).
    # total = total.clone()
    ### END SOLUTION
    return float(total.sqrt())


def pipeline_step(microbatches: int) -> dict:
    """One 1F1B step on every rank of the job; the loss and the global gradient norm."""
    comm = Comm()
    torch.manual_seed(0)
    chunks = build_stage(GPT(CFG), comm.rank, comm.size)
    schedule = make_schedule("1f1b", comm.size, microbatches)
    ex = PipelineExecutor(chunks, comm, schedule)
    x, y = MarkovData(CFG.vocab_size, CFG.seq_len).batch(0, BATCH)
    parts = split_batch(x, y, 0, 1, microbatches)  # every stage gets the same list
    ### BEGIN SOLUTION
    # HINT: the step's gradient must be that of the mean loss over the batch, and the
    # executor adds the m micro-batch gradients: scale each by 1 / m, not by 1 / (the
    # number of stages): loss_scale = 1.0 / len(parts)
    loss_scale = 1.0 / len(parts)
    ### PLANTED BUG
    # loss_scale = 1.0 / comm.size
    ### PLANTED BUG 2
    # HINT(2): each micro-batch's loss is a mean over its tokens, and the executor adds
    # HINT(2): m of them: scale each by 1 / m, loss_scale = 1.0 / len(parts)
    # loss_scale = 1.0
    ### PLANTED BUG 4
    # HINT(4): each micro-batch's loss is already a mean over its own sequences; the m
    # HINT(4): of them are added, so the scale is 1 / m, not 1 / (the batch's sequences):
    # HINT(4): loss_scale = 1.0 / len(parts)
    # loss_scale = 1.0 / BATCH
    ### END SOLUTION
    res = ex.step(parts, broadcast_loss=True, loss_scale=loss_scale)
    return {"loss": res.loss, "grad_norm": grad_norm(chunks)}


def reference_step() -> dict:
    """The same step in one process on the whole batch: the loss and gradient norm."""
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = MarkovData(CFG.vocab_size, CFG.seq_len).batch(0, BATCH)
    loss = model(x, y)
    loss.backward()
    norm = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()
               if p.grad is not None) ** 0.5
    return {"loss": float(loss.detach()), "grad_norm": norm}


def gradient_audit(microbatches: int = 4) -> None:
    """Run the pipeline and one process; print losses, gradient norms and the audit."""
    from minipar.launch import launch
    from minipar.parity import audit

    ref = reference_step()
    out = launch(pipeline_step, 2, args=(microbatches,), timeout=60)[0]
    ratio = out["grad_norm"] / ref["grad_norm"]
    print(f"m = {microbatches}")
    print(f"loss:          one process {ref['loss']:.5f}   pipeline {out['loss']:.5f}")
    print(f"gradient norm: one process {ref['grad_norm']:.5f}   pipeline "
          f"{out['grad_norm']:.5f}   ratio {ratio:.4f}")
    found = audit([ratio], {"microbatches": microbatches, "pp": 2})
    print("audit:", found.split(";")[0] if found else "the gradients agree with one process")
