"""Mixture of experts and expert parallelism at parity with one process, on gradients.

The MoE layer (``minipar.model.MoE``) routes per sequence, so every layout routes and
drops exactly the tokens one device does; with ``--ep`` the experts live on different
ranks and tokens travel by all-to-all (``minipar.parallel.ep``). Each layout below is
compared with ``train_reference`` on losses, per-step gradient norms before clipping and
final parameters (through a checkpoint), including plain SGD without clipping; two
mutations (the auxiliary loss not divided by the micro-batch count; expert gradients
summed over the wrong group) must fail the check. Tolerances: ``TOLERANCES["fp32"]``.
Measured drift over this file's layouts (3 steps of moe-tiny, CPU/gloo): loss 9.5e-7,
gradient norm 2.3e-7 relative, parameters 6.0e-8 (SGD) and 2.2e-6 (AdamW): inside the
engine's bounds (2e-6, 2.5e-5, 8e-5), which are set from its own covering set. The
auxiliary loss 2x moves the first step's gradient norm by 1.4e-3 relative, 56x the
bound; summing expert gradients over the ep group (dp 4, ep 2) moved it by 1.7e-2.
"""

from __future__ import annotations

import tempfile
from functools import cache

import pytest
import torch

import minipar.mesh as mesh_module
import minipar.step as step_module
from minipar.config import TrainConfig
from minipar.engine import train, train_reference
from minipar.mesh import Mesh
from minipar.model import GPT, MoE, get_config, load_balancing_loss, route
from minipar.parity import TOLERANCES, compare, final_parameters, run_grad_norms
from minipar.theory.moe import all_to_all_bytes, dropped_share, moe_params

STEPS = 3
FP32 = TOLERANCES["fp32"]
SGD = dict(optimizer="sgd", grad_clip=0.0, lr=0.5, warmup=1)
# what changes the single device's run (the rest is layout)
MODEL_KNOBS = ("optimizer", "grad_clip", "lr", "warmup", "capacity_factor", "moe_top_k",
               "z_loss_coef", "aux_loss_coef")


@cache
def _reference(knobs: tuple) -> dict:
    ref = train_reference(TrainConfig(model="moe-tiny", steps=STEPS, **dict(knobs)))
    return {"losses": ref["losses"], "grad_norms": ref["grad_norms"],
            "params": {k: v.detach().float() for k, v in ref["model"].state_dict().items()}}


def reference(layout: dict) -> dict:
    return _reference(tuple(sorted((k, v) for k, v in layout.items() if k in MODEL_KNOBS)))


def run_and_compare(**layout):
    with tempfile.TemporaryDirectory() as save:
        run = train(TrainConfig(model="moe-tiny", steps=STEPS, timeout=240, save=save,
                                **layout))
        params = final_parameters(save)
    ref = reference(layout)
    return run, compare(run, ref, params, ref["params"]), ref


LAYOUTS = [  # 2 and 4 ranks; dropless and with a capacity; top-1 and top-2; every ZeRO 0-2
    dict(dp=2, ep=2, microbatches=2),
    dict(dp=2, ep=2, pp=2, microbatches=2, capacity_factor=1.0, zero=1),
    dict(dp=2, ep=2, tp=2, capacity_factor=1.25, moe_top_k=1, zero=2),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: " ".join(f"{k}={v}"
                                                                  for k, v in d.items()))
def test_plain_sgd_no_clipping(layout: dict) -> None:
    run, parity, ref = run_and_compare(**SGD, **layout)
    assert parity.ok(FP32), (f"{layout}: {parity.describe()}; losses {run['losses']} vs "
                             f"{ref['losses']}; norms {run_grad_norms(run)} vs "
                             f"{ref['grad_norms']}")
    assert run["losses"][-1] < run["losses"][0] - 0.02, "the loss must move"


def test_adamw_clipped_zero1_with_z_loss_and_replicated_experts() -> None:
    """dp 4 over ep 2: each expert has two replicas (the edp group) to reduce over."""
    run, parity, _ = run_and_compare(dp=4, ep=2, zero=1, capacity_factor=1.0,
                                     z_loss_coef=1e-3)
    assert parity.ok(FP32), parity.describe()
    assert run["losses"][-1] < run["losses"][0] - 0.2


def test_all_to_all_bytes_equal_the_theory() -> None:
    """Dropless: the payload an ep group sends is fixed (every routed row goes out and
    comes back, forward and backward), whichever expert each row chose."""
    cfg = TrainConfig(model="moe-tiny", steps=2, dp=2, ep=2, microbatches=2, timeout=240)
    run = train(cfg)
    sent = sum(r["comm"]["ep"]["all_to_all"]["bytes"] for r in run["ranks"])
    tokens = cfg.batch_size // cfg.dp * cfg.model_config().seq_len
    per_rank = all_to_all_bytes(cfg.model_config(), tokens, cfg.ep, "fp32",
                                microbatches=cfg.microbatches)
    assert sent == cfg.dp * cfg.steps * per_rank["bytes"]
    calls = {r["comm"]["ep"]["all_to_all"]["calls"] for r in run["ranks"]}
    assert calls == {cfg.steps * per_rank["calls"]}


# --- mutations: the check must fail ----------------------------------------------------

def test_aux_loss_not_averaged_over_microbatches_fails(monkeypatch) -> None:
    layout = dict(microbatches=2, **SGD)
    _, healthy, _ = run_and_compare(**layout)
    assert healthy.ok(FP32), healthy.describe()
    original = step_module.set_moe_loss_scale
    monkeypatch.setattr(step_module, "set_moe_loss_scale",
                        lambda module, scale: original(module, scale * 2))
    _, broken, _ = run_and_compare(**layout)
    assert not broken.ok(FP32), f"an auxiliary loss 2x too heavy passed: {broken}"


def test_expert_gradients_over_the_wrong_group_fail(monkeypatch) -> None:
    """dp 2, ep 2: each expert lives once (edp = 1 rank); summing its gradient over dp
    adds the other rank's experts to it."""
    monkeypatch.setattr(mesh_module.RankMesh, "edp",
                        property(lambda self: self.comms["dp_cp"]))
    _, broken, _ = run_and_compare(dp=2, ep=2, **SGD)
    assert not broken.ok(FP32), f"expert gradients summed over dp passed: {broken}"


# --- the layer and the theory, in one process -------------------------------------------

def test_aux_loss_gradient_is_that_of_the_loss_plus_aux() -> None:
    """The auxiliary loss enters the backward with the layer's ``loss_scale`` (its
    micro-batch's weight), as if added to the loss."""
    cfg = get_config("moe-tiny").with_(aux_loss_coef=0.5, z_loss_coef=0.1,
                                       capacity_factor=1.0)
    torch.manual_seed(0)
    x = torch.randn(3, cfg.seq_len, cfg.d_model)
    layer = GPT(cfg).blocks[1].mlp
    layer.loss_scale = 0.25
    (layer(x).square().sum() * 0.25).backward()
    got = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    layer.aux_loss_coef = layer.z_loss_coef = 0.0
    logits = layer.router(x)
    _, expert, _, probs = route(logits, cfg.moe_top_k, layer.capacity(cfg.seq_len))
    aux = 0.5 * load_balancing_loss(probs, expert) \
        + 0.1 * logits.logsumexp(-1).square().mean()
    ((layer(x).square().sum() + aux) * 0.25).backward()
    for g, p in zip(got, layer.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)


def test_routing_is_per_sequence() -> None:
    """A sequence routes and drops the same whatever else is in its batch."""
    torch.manual_seed(1)
    logits = torch.randn(6, 32, 8)
    batch = route(logits, 2, capacity=6)
    for i in range(6):
        alone = route(logits[i:i + 1], 2, capacity=6)
        for a, b in zip(batch, alone):
            assert torch.equal(a[i:i + 1], b)
    expert, keep = batch[1], batch[2]
    assert not keep.all()  # the capacity dropped some
    kept = (torch.nn.functional.one_hot(expert, 8) * keep[..., None]).sum((1, 2))
    assert int(kept.max()) == 6  # [sequence, expert]: full, never over


@pytest.mark.parametrize("k,factor", [(1, 1.0), (2, 1.0), (2, 1.25)])
def test_dropped_share_matches_random_routing(k: int, factor: float) -> None:
    """Independent tokens (random router logits): the share the capacity drops is the
    binomial expectation of ``theory.moe.dropped_share``."""
    cfg = get_config("moe-tiny").with_(moe_top_k=k, capacity_factor=factor)
    torch.manual_seed(2)
    n_seq = 2000
    keep = route(torch.randn(n_seq, cfg.seq_len, cfg.n_expert), k,
                 MoE(cfg).capacity(cfg.seq_len))[2]
    measured = 1.0 - keep.float().mean().item()
    expected = dropped_share(cfg)
    assert measured > 0.01
    assert measured == pytest.approx(expected, abs=0.005), (measured, expected)


@pytest.mark.parametrize("name", ["moe-tiny", "moe-1.3b"])
def test_parameter_counts(name: str) -> None:
    cfg = get_config(name)
    model = GPT(cfg, device="meta")
    counts = moe_params(cfg)
    assert counts["total"] == model.num_params()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert counts["experts"] == experts
    if name == "moe-1.3b":  # gpt-1.3b's active parameters, plus the routers (and the
        dense = GPT("gpt-1.3b", device="meta").num_params()  # second expert's output bias)
        assert counts["active"] == dense + cfg.n_moe_layers * cfg.d_model * (cfg.n_expert + 1)


def test_the_mesh_splits_dp_into_ep_and_its_replicas() -> None:
    mesh = Mesh(dp=4, pp=1, tp=2, ep=2)
    assert mesh.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        Mesh(dp=4, ep=3)
