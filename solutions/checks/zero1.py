"""Cases for the ZeRO-1 exercise (lesson 02).

``shard_range`` is checked here against the rule. Then 2 and 3 ranks (3 does not divide
the parameter count, so padding matters) train a small MLP for three steps: each rank
backpropagates its own batch, the learner's ``Zero1`` steps, and every rank compares its
weights with a single-process AdamW stepping on the mean of all ranks' gradients (each
rank can compute every rank's batch, so it builds the reference alone). The log must
show one reduce-scatter and one all-gather per step and nothing else; Adam's states
must be 1/N of the model.
"""

from __future__ import annotations

import importlib
import math

import torch
from torch import nn

from minipar.comm import Comm

from ..check import expect, launch_case

WORLDS = (2, 3)
STEPS = 3
TOL = 1e-6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))  # 68 parameters


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def _check_ranges(mod) -> None:
    for numel, world in ((12, 4), (10, 4), (68, 3), (3, 4)):
        got = [mod.shard_range(numel, world, r) for r in range(world)]
        size = math.ceil(numel / world)
        want = [(r * size, (r + 1) * size) for r in range(world)]
        expect([tuple(g) for g in got] == want,
               f"shard_range({numel}, {world}, r) for r = 0..{world - 1} gave {got}; "
               f"expected {want}",
               "every shard has ceil(numel / world) elements, rank r starts at r * size")


def _rank_cases(impl: str) -> dict:
    mod = importlib.import_module(f"{impl}.zero1")
    comm = Comm()
    n, rank = comm.size, comm.rank
    model, ref = _model(), _model()
    zero = mod.Zero1(model.parameters(), comm, lr=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    facts = {"steps": []}
    full = sum(p.numel() for p in model.parameters())
    for step in range(STEPS):
        comm.log.clear()
        _loss(model, *_batch(step, rank)).backward()
        zero.step()
        got = zero.shard.grad  # what the inner optimizer stepped on
        got = None if got is None else got.detach().clone()
        zero.zero_grad()
        for r in range(n):  # the reference: the mean gradient of all ranks' batches
            (_loss(ref, *_batch(step, r)) / n).backward()
        mean = torch.zeros(zero.padded)
        mean[:full] = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        want = mean[zero.lo:zero.hi]
        ratio = (float(got.norm() / want.norm())
                 if got is not None and got.shape == want.shape and want.norm() > 0
                 else None)
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(float((p - q).abs().max()) for p, q in zip(model.parameters(),
                                                                 ref.parameters()))
        facts["steps"].append({"worst": worst, "ratio": ratio,
                               "ops": [(r.op, r.nbytes) for r in comm.log.records]})
    facts["state_bytes"] = zero.state_bytes()
    facts["full_state_bytes"] = 2 * 4 * full  # exp_avg and exp_avg_sq, fp32, whole model
    facts["padded_bytes"] = 4 * math.ceil(full / n) * n
    return facts


def _judge(n: int, rank: int, f: dict) -> None:
    where = f"on {n} ranks, rank {rank}"
    for step, s in enumerate(f["steps"]):
        ops = [op for op, _ in s["ops"]]
        expect(ops == ["reduce_scatter", "all_gather"],
               f"step {step} {where} communicated {ops or 'nothing'}; ZeRO-1 needs "
               "exactly ['reduce_scatter', 'all_gather']",
               "one self.comm.reduce_scatter of the flat gradients, then one "
               "self.comm.all_gather of the updated shard")
        expect(all(b == f["padded_bytes"] for _, b in s["ops"]),
               f"step {step} {where}: payloads {[b for _, b in s['ops']]} bytes; both ops "
               f"should move the padded flat vector ({f['padded_bytes']} bytes)",
               "reduce-scatter self.flatten(grads), all-gather the shard (1/N of it)")
        ratio = s["ratio"]
        if ratio is not None:
            named = (f"exactly {ratio:.1f}x the mean gradient's = world size ({n})"
                     if abs(ratio - n) < 1e-3 else f"{ratio:.3g}x the mean gradient's")
            expect(abs(ratio - 1) < 1e-4,
                   f"step {step} {where}: the gradient your optimizer stepped on "
                   f"(self.shard.grad) has a norm {named}; the weights end up off by "
                   f"{s['worst']:.3g} (Adam's update divides by the gradient's own size, "
                   "which hides most of a constant factor)",
                   "each rank's gradient is of its own batch: divide the reduce-scattered "
                   "sum by comm.size to get the mean")
        expect(s["worst"] < TOL,
               f"after step {step} {where} the weights differ from single-process AdamW "
               f"on the mean gradient by {s['worst']:.3g}",
               "divide the reduce-scattered sum by comm.size before the optimizer step, "
               "and copy the all-gathered vector back with unflatten_into_params")
    shard_states = 2 * f["padded_bytes"] // n
    expect(f["state_bytes"] == shard_states,
           f"Adam holds {f['state_bytes']} bytes of state {where}; a 1/{n} shard needs "
           f"{shard_states} (the whole model: {f['full_state_bytes']})",
           "the inner optimizer must see only self.shard")


def run(impl: str, timeout: float) -> str:
    """Ranges here; then three steps on 2 and 3 ranks against single-process AdamW."""
    _check_ranges(importlib.import_module(f"{impl}.zero1"))
    for n in WORLDS:
        for rank, facts in enumerate(launch_case(_rank_cases, n, args=(impl,), timeout=timeout)):
            _judge(n, rank, facts)
    return (f"{STEPS} AdamW steps on {' and '.join(map(str, WORLDS))} ranks equal one "
            "process; one reduce-scatter + one all-gather per step; states 1/N")
