"""Cases for the dispatch-and-combine exercise (lesson 09).

On 2 and 4 ranks (8 experts: 4 or 2 on each), every rank makes random rows sorted by
expert, with random counts and one expert left empty; each row carries its source rank
and its index there in its first two features, so a misplaced row can be named. The
learner's ``dispatch`` must return, on every rank, the rows of its experts from every
rank, sorted by expert then source rank, and the counts per local expert; ``combine`` of
2 * rows + 1 must return 2 * x + 1 on every rank, in x's order.

Then the real thing: ``moe-tiny`` trained 3 steps (plain SGD, no clipping) on dp 2 with
ep 2, ``minipar.parallel.ep``'s ``dispatch`` and ``combine`` replaced by the learner's in
every rank (``ExpertParallel`` calls them), against one process: the losses and the
gradient norms of every step, within the engine's fp32 tolerances.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from minipar.comm import Comm
from minipar.config import TrainConfig
from minipar.engine import rank_main, train_reference
from minipar.launch import launch
from minipar.parallel import ep as epmod
from minipar.parity import TOLERANCES, compare

from ..check import CheckFailure, expect, launch_case

E, D = 8, 4  # experts; features per row (two tags, two values)
WORLDS = (2, 4)
RUN = dict(model="moe-tiny", dp=2, ep=2, steps=3, optimizer="sgd", grad_clip=0.0, lr=0.5,
           warmup=1)


def _inputs(rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    counts = torch.randint(0, 4, (E,), generator=g)
    counts[(rank + seed) % E] = 0  # an expert this rank sends nothing
    x = torch.randn(int(counts.sum()), D, generator=g)
    x[:, 0], x[:, 1] = rank, torch.arange(len(x))  # where the row came from
    return x, counts


def _expected(rank: int, ep: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = E // ep
    inputs = [_inputs(r, seed) for r in range(ep)]
    rows, counts = [], []
    for e in range(rank * local, (rank + 1) * local):
        for x, c in inputs:
            start = int(c[:e].sum())
            rows.append(x[start:start + int(c[e])])
        counts.append(sum(int(c[e]) for _, c in inputs))
    return torch.cat(rows), torch.tensor(counts)


class _SplitSizes(Exception):
    """Some rank's send sizes do not add up to its rows (the message: this rank's, or None
    when this rank's were right)."""


def _sized(comm: Comm, step: str) -> None:
    """Make ``comm.all_to_all`` (which ``all_to_all`` calls) refuse send sizes that do
    not add up to the rows it is given, on every rank at once (so that no rank waits in
    an exchange its partner left), naming the step and both numbers, where
    all_to_all_single would only say "Split sizes doesn't match total dim 0 size"."""
    a2a = type(comm).all_to_all

    def all_to_all(t, send_rows, recv_rows):
        sizes = [int(n) for n in send_rows]
        bad = torch.tensor([int(sum(sizes) != len(t))])
        dist.all_reduce(bad, group=comm.group)
        if bad.item():
            raise _SplitSizes(None if sum(sizes) == len(t) else
                              f"{step} sends {len(t)} rows with send sizes {sizes}, which "
                              f"add up to {sum(sizes)}")
        return a2a(comm, t, send_rows, recv_rows)
    comm.all_to_all = all_to_all


def _exchange_rank(impl: str, seed: int) -> dict:
    mod = importlib.import_module(f"{impl}.moe_dispatch")
    comm = Comm(dim="ep")
    x, counts = _inputs(comm.rank, seed)
    try:
        _sized(comm, "dispatch")
        rows, local_counts, plan = mod.dispatch(x.clone(), counts.clone(), comm)
        _sized(comm, f"combine (given {len(rows)} result rows, one per row dispatch "
                     "returned)")
        back = mod.combine(2 * rows + 1, plan, comm)
    except _SplitSizes as e:
        return {"split": e.args[0]}
    return {"rows": rows.detach(), "counts": torch.as_tensor(local_counts).detach(),
            "back": back.detach()}


def _name(row: torch.Tensor) -> str:
    return f"row {int(row[1])} of rank {int(row[0])}"


def _exchange(impl: str, ep: int, timeout: float) -> None:
    seed = ep
    res = launch_case(_exchange_rank, ep, args=(impl, seed), timeout=timeout)
    split = [(rank, got["split"]) for rank, got in enumerate(res) if got.get("split")]
    if split:
        rank, said = split[0]
        raise CheckFailure(
            f"{ep} ranks: on rank {rank}, {said}: all_to_all's send sizes must add up to "
            "the rows sent", "combine sends back with the split sizes of dispatch swapped"
            if said.startswith("combine") else "send[j] = my rows for rank j's experts: "
            "counts summed over each rank's experts")
    for rank, got in enumerate(res):
        want_rows, want_counts = _expected(rank, ep, seed)
        local = E // ep
        experts = f"experts {rank * local}-{(rank + 1) * local - 1}"
        expect(got["counts"].tolist() == want_counts.tolist(),
               f"{ep} ranks: rank {rank} ({experts}) returned local_counts "
               f"{got['counts'].tolist()}; expected {want_counts.tolist()}",
               "local_counts[i]: rows every rank sent to my i-th expert, summed over "
               "the source ranks (after exchanging the counts)")
        rows = got["rows"]
        expect(tuple(rows.shape) == tuple(want_rows.shape),
               f"{ep} ranks: rank {rank} ({experts}) returned {rows.shape[0]} rows of "
               f"width {rows.shape[1] if rows.dim() > 1 else 0}; expected "
               f"{want_rows.shape[0]} of width {D}",
               "send[j] = my rows for rank j's experts, recv[j] = rows rank j has for "
               "mine: both from the exchanged counts")
        bad = (rows != want_rows).any(1).nonzero()
        if len(bad):
            i = int(bad[0])
            same_set = sorted(map(tuple, rows.tolist())) == sorted(map(tuple,
                                                                      want_rows.tolist()))
            raise CheckFailure(
                f"{ep} ranks: rank {rank} ({experts}), returned row {i}: expected "
                f"{_name(want_rows[i])}, got {_name(rows[i])}",
                "the right rows arrived in the wrong order: they come by source rank, "
                "then expert; sort them by expert, then source rank (a stable sort)"
                if same_set else
                "these rows belong to another rank's experts: rank j's share of x is "
                "the rows of experts j*E/ep to (j+1)*E/ep - 1, counts.view(ep, E // ep)")
        x, _ = _inputs(rank, seed)
        back = got["back"]
        expect(tuple(back.shape) == tuple(x.shape),
               f"{ep} ranks: combine returned {tuple(back.shape)} on rank {rank}; "
               f"expected {tuple(x.shape)}, one result per row of x",
               "combine sends back with the split sizes of dispatch swapped")
        bad = (back != 2 * x + 1).any(1).nonzero()
        if len(bad):
            i = int(bad[0])
            got_from = (back[i] - 1) / 2
            raise CheckFailure(
                f"{ep} ranks: combine on rank {rank}, result {i}: expected that of "
                f"{_name(x[i])}, got that of {_name(got_from)}",
                "undo dispatch's sort before sending back: the inverse permutation, "
                "back[order] = arange")


def _ep_rank(impl: str, cfg: TrainConfig) -> dict:
    mod = importlib.import_module(f"{impl}.moe_dispatch")
    epmod.dispatch, epmod.combine = mod.dispatch, mod.combine  # this rank's process only
    return rank_main(cfg)


def ep_run(impl: str, timeout: float = 120.0) -> dict:
    """``moe-tiny`` on dp 2, ep 2 with ``impl``'s dispatch and combine, and one process:
    ``{"losses", "grad_norms", "reference_losses", "reference_grad_norms", "ok"}``."""
    cfg = TrainConfig(timeout=timeout, **RUN)
    ranks = launch(_ep_rank, cfg.world_size, args=(impl, cfg), timeout=timeout)
    ref = train_reference(cfg)
    run = {"losses": ranks[0]["losses"], "ranks": ranks}
    parity = compare(run, ref)
    return {"losses": ranks[0]["losses"], "grad_norms": ranks[0]["grad_norms"],
            "reference_losses": ref["losses"], "reference_grad_norms": ref["grad_norms"],
            "ok": parity.ok(TOLERANCES["fp32"]), "parity": parity.describe()}


def run(impl: str, timeout: float) -> str:
    for ep in WORLDS:
        _exchange(impl, ep, timeout)
    res = ep_run(impl, max(timeout, 60.0))
    if not res["ok"]:
        off = [i for i, (a, b) in enumerate(zip(res["grad_norms"],
                                                res["reference_grad_norms"]))
               if abs(a / b - 1) > TOLERANCES["fp32"].grad_rel]
        step = off[0] if off else 0
        raise CheckFailure(
            f"moe-tiny on dp 2, ep 2 with your dispatch and combine: step {step} gradient "
            f"norm expected {res['reference_grad_norms'][step]:.6f} (one process), got "
            f"{res['grad_norms'][step]:.6f} ({res['parity']})",
            "the exchanges passed: look at what the real run adds, the backward (use "
            "all_to_all from minipar.parallel.ep, which sends the gradients back)")
    return (f"dispatch and combine on {' and '.join(map(str, WORLDS))} ranks place every "
            "row; moe-tiny on dp 2, ep 2 through them equals one process (losses and "
            f"gradient norms over {RUN['steps']} steps)")
