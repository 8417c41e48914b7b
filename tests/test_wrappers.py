"""The data-parallel wrappers from a plain PyTorch loop, on a model that is not minipar's.

A small MLP with a tied embedding/head and a LayerNorm trains on 2 ranks with each
wrapper, in the loop a PyTorch user writes (forward, backward, step, zero_grad), and
must match one process on the whole batch: losses, gradient norms (before the step),
final parameters, with plain SGD (no momentum, no clipping) and with AdamW:

* ``ZeroOptimizer`` (stages 0, i.e. data parallelism, 1 and 2): a
  ``torch.optim.Optimizer`` over the user's parameters, two parameter groups (one added
  with ``add_param_group``);
* ``Zero3``: an ``nn.Module`` whose parameters are fp32 shards (each gradient has its
  shard's shape) under a plain ``torch.optim`` optimizer, norms left replicated.

Tolerances (fp32, CPU): losses and gradient norms 1e-5 relative, parameters 1e-5 (SGD)
and 1e-4 (AdamW); the differences are sums taken in another order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minipar.comm import Comm
from minipar.launch import launch
from minipar.mesh import Mesh
from minipar.parallel.zero import Zero3, ZeroOptimizer

STEPS, BATCH, WORLD = 3, 8, 2


class TiedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 12)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(12, 20), nn.GELU(),
                                                  nn.Linear(20, 12)) for _ in range(2))
        self.norm = nn.LayerNorm(12)
        self.out = nn.Linear(12, 16, bias=False)
        self.out.weight = self.emb.weight  # tied

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = h + layer(h)
        return F.cross_entropy(self.out(self.norm(h)), y)


def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randint(16, (BATCH,), generator=g), torch.randint(16, (BATCH,), generator=g)
    n = BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def make(opt: str, params) -> torch.optim.Optimizer:
    groups = [{"params": [p for n, p in params if not n.startswith("norm")]}]
    cls = torch.optim.SGD if opt == "sgd" else torch.optim.AdamW
    optimizer = cls(groups, lr=0.5 if opt == "sgd" else 1e-2)
    optimizer.add_param_group({"params": [p for n, p in params if n.startswith("norm")]})
    return optimizer


def reference(opt: str) -> dict:
    torch.manual_seed(0)
    model = TiedMLP()
    optimizer = make(opt, list(model.named_parameters()))
    losses, norms = [], []
    for step in range(STEPS):
        loss = model(*batch(step))
        loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def plain_loop(kind: str, opt: str) -> dict:
    """What a PyTorch user writes, with one minipar wrapper."""
    comm = Comm()
    torch.manual_seed(0)
    model = TiedMLP()
    facts = {}
    if kind != "zero3":
        net = model
        inner = make(opt, list(model.named_parameters()))  # the same groups, ZeRO'd
        groups = [{"params": g["params"]} for g in inner.param_groups]
        optimizer = ZeroOptimizer(groups[:1], type(inner), stage=int(kind[-1]), comm=comm,
                                  module=model, bucket_mb=0.001, lr=inner.defaults["lr"])
        optimizer.add_param_group(groups[1])
        facts["is_optimizer"] = isinstance(optimizer, torch.optim.Optimizer)
        facts["user_params"] = all(any(p is q for q in model.parameters())
                                   for g in optimizer.param_groups for p in g["params"])
    else:
        net = Zero3(model, comm, replicate=(nn.LayerNorm,))
        optimizer = make(opt, [(n, p) for n, p in zip(
            ["w"] * (len(net.masters) - 1) + ["norm"], net.parameters())])
        net.publish_after(optimizer)
    losses, norms = [], []
    for step in range(STEPS):
        loss = net(*batch(step, comm.rank, WORLD))
        loss.backward()
        if kind == "zero3":
            facts["shard_grads"] = all(p.grad.shape == p.shape for p in net.parameters())
        norm = (optimizer if kind != "zero3" else net).clip_grad_norm_(float("inf"))
        optimizer.step()
        optimizer.zero_grad()
        t = loss.detach().reshape(1)
        comm.all_reduce(t)
        losses.append(float(t) / WORLD)
        norms.append(norm)
    params = (optimizer.full_parameters() if kind != "zero3"
              else net.full_state_by_name(optimizer)[0])
    return {"losses": losses, "norms": norms, "params": params, "facts": facts}


def _all(cases: list[tuple[str, str]]) -> list[dict]:
    return [plain_loop(kind, opt) for kind, opt in cases]


def _references(opts: list[str]) -> dict:
    return {opt: reference(opt) for opt in opts}


def test_each_wrapper_in_a_plain_pytorch_loop_matches_one_process() -> None:
    cases = [(k, o) for k in ("zero0", "zero1", "zero2", "zero3") for o in ("sgd", "adamw")]
    results = launch(_all, WORLD, args=(cases,), timeout=180)
    refs = launch(_references, 1, args=(["sgd", "adamw"],), timeout=60)[0]
    for (kind, opt), res in zip(cases, results[0]):
        ref, what = refs[opt], f"{kind} {opt}"
        assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5), what
        assert res["norms"] == pytest.approx(ref["norms"], rel=1e-5), what
        assert res["params"].keys() == ref["params"].keys(), what
        diff = max(float((res["params"][n] - p).abs().max()) for n, p in ref["params"].items())
        assert diff <= (1e-5 if opt == "sgd" else 1e-4), f"{what}: {diff:.2e}"
        assert all(res["facts"].values()), (what, res["facts"])
    for other in results[1:]:  # every rank ends with the same weights
        for mine, theirs in zip(results[0], other):
            assert all(torch.equal(mine["params"][n], theirs["params"][n])
                       for n in mine["params"])


def _shared_across_stages(stage: int) -> dict:
    """Two pipeline stages (pp 2) of two replicas each (dp 2): each stage holds its own
    module (of other sizes, so a shared weight would fall at other offsets of one flat
    buffer) and one weight ``s`` that both use, whose gradient is summed over pp."""
    rm = Mesh(dp=2, pp=2).connect()

    def part(pp_rank: int) -> nn.Module:
        torch.manual_seed(0)
        m = nn.Module()
        m.s = nn.Parameter(torch.randn(5))
        torch.manual_seed(1 + pp_rank)
        m.body = nn.Linear(3, 2) if pp_rank == 0 else nn.Linear(1, 1)
        return m

    def loss(m: nn.Module, pp_rank: int, dp_rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(10 * pp_rank + dp_rank)
        x = torch.randn(4, m.body.in_features, generator=g)
        return m.body(x).square().mean() * m.s.square().sum()

    mine = part(rm.coords.pp)
    opt = ZeroOptimizer(mine, torch.optim.SGD, stage=stage, comm=rm.dp, shared=[["s"]], lr=1.0)
    loss(mine, rm.coords.pp, rm.coords.dp).backward()
    opt.finish_gradient_sync()
    opt.all_reduce_grads(["s"], rm.pp)
    opt.step()
    expected = part(0).s.detach().clone()
    for pp_rank in range(2):  # the one-process answer: mean over dp, summed over pp
        for dp_rank in range(2):
            m = part(pp_rank)
            (loss(m, pp_rank, dp_rank) / 2).backward()
            expected -= m.s.grad
    return {"got": opt.full_parameters()["s"], "expected": expected}


@pytest.mark.parametrize("stage", [1, 2])
def test_all_reduce_grads_of_a_weight_shared_by_different_stages(stage: int) -> None:
    for r in launch(_shared_across_stages, 4, args=(stage,), timeout=120):
        assert torch.allclose(r["got"], r["expected"], atol=1e-6), r


def _both_wrappers(_: None) -> str:
    model = TiedMLP()
    ZeroOptimizer(model, torch.optim.SGD, stage=0, comm=Comm(), lr=0.1)
    try:
        ZeroOptimizer(model, torch.optim.SGD, stage=1, comm=Comm(), lr=0.1)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_two_synchronisers_on_one_model_are_refused() -> None:
    """Both would reduce the same gradient, silently twice."""
    assert "already synchronised by ZeroOptimizer" in launch(_both_wrappers, 1,
                                                             args=(None,), timeout=60)[0]
