"""Validation loss, the same number in every layout: a forward pass with no backward.

Evaluation reads ``eval_batches`` held-out global batches (``split="val"`` of the data:
the same rows whatever the layout, as for training). Each replica runs its rows, cut in
the same micro-batches as a training step, through its pipeline chunks in order, with
no gradient and no schedule: a chunk's output goes to the rank that owns the next chunk
(``Comm.send``/``recv``, so the bytes are counted like any other). Tensor-parallel
layers and ZeRO-3's just-in-time gathers work as in training (their hooks fire on the
forward). The mean over micro-batches, batches and replicas is the mean loss over the
held-out tokens, which is what ``reference_eval`` computes on one device.

Dropout is switched off while evaluating (``module.eval()``) and back on afterwards.
"""

from __future__ import annotations

import torch

from minipar.comm import Comm
from minipar.data import TokenSource, local_batches
from minipar.parallel.cp_plan import shard_batch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def forward_only(chunks: list, pp: Comm, x: torch.Tensor, y: torch.Tensor
                 ) -> torch.Tensor | None:
    """The loss of one micro-batch through every pipeline chunk (global chunk ``c`` lives
    on pp rank ``c % pp``, as ``build_stage`` places them); ``None`` off the last stage."""
    n_chunks = len(chunks) * pp.size
    out = None
    for c in range(n_chunks):
        if c % pp.size != pp.rank:
            continue
        chunk = chunks[c // pp.size]
        if c == 0:
            h = x
        elif pp.size == 1:
            h = out
        else:  # a small header first: the hidden state's dtype and shape
            header = pp.recv(torch.empty(4, dtype=torch.long, device=x.device),
                             (c - 1) % pp.size).tolist()
            h = pp.recv(torch.empty(header[1:], dtype=_DTYPES[header[0]], device=x.device),
                        (c - 1) % pp.size)
        out = chunk(h, y) if c == n_chunks - 1 else chunk(h)
        if c < n_chunks - 1 and pp.size > 1:
            code = torch.tensor([_DTYPES.index(out.dtype), *out.shape], device=x.device)
            pp.send(code, (c + 1) % pp.size)
            pp.send(out.contiguous(), (c + 1) % pp.size)
    return out if (n_chunks - 1) % pp.size == pp.rank else None


@torch.no_grad()
def evaluate(cfg, rm, chunks: list, data: TokenSource, device: torch.device) -> float | None:
    """Mean validation loss over ``cfg.eval_batches`` held-out global batches.

    Collective over the whole mesh. Returns the loss on the last pipeline stage (every
    dp and tp rank there), ``None`` elsewhere.
    """
    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    try:
        for i in range(cfg.eval_batches):
            for x, y in local_batches(data, i, cfg.batch_size, rm.coords.dp, cfg.dp,
                                      cfg.microbatches, split="val"):
                x, y = shard_batch(x, y, rm.cp)  # this cp rank's tokens of each row
                loss = forward_only(chunks, rm.pp, x.to(device), y.to(device))
                if loss is not None:
                    total += loss.double()
                count += 1
    finally:
        for c, mode in zip(chunks, modes):
            c.train(mode)
    # every replica's rows, every cp shard: equal counts, so the mean of means
    rm.dp_cp.all_reduce(total)
    if rm.coords.pp != cfg.pp - 1:
        return None
    return float(total) / (count * cfg.dp * cfg.cp)


@torch.no_grad()
def reference_eval(model, data: TokenSource, batch_size: int, batches: int) -> float:
    """The same number on one device: the whole global batch in one forward."""
    mode = model.training
    model.eval()
    try:
        losses = [float(model(*data.rows(i, range(batch_size), split="val")))
                  for i in range(batches)]
    finally:
        model.train(mode)
    return sum(losses) / len(losses)
