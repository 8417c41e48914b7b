"""Mixture of experts and expert parallelism at parity with one process, on gradients.

The MoE layer (``minipar.model.MoE``) routes per whole sequence, so every layout routes
and drops exactly the tokens one device does: dp, pp and ep never split a sequence; cp
decides the capacity over the gathered expert ids (``cp_plan.ShardQueues``) and sp runs
the layer on the gathered sequence (``tp.SequenceParallelMoE``). With ``--ep`` the
experts live on different ranks and tokens travel by all-to-all (``minipar.parallel.ep``).
Each layout below is compared with ``train_reference`` on losses, per-step gradient
norms before clipping and final parameters (through a checkpoint), including plain SGD
without clipping; mutations (the auxiliary loss not divided by the micro-batch count;
expert gradients summed over the wrong group; cp ranks routing their own chunks; the sp
gather's gradient summed over tp) must fail the check. Tolerances: ``TOLERANCES["fp32"]``.
Measured drift over this file's layouts (3 steps of moe-tiny, CPU/gloo): loss 9.5e-7,
gradient norm 2.9e-6 relative (dp 2 ep 2 cp 2, AdamW), parameters 1.2e-7 (SGD) and
1.4e-5 (AdamW, the same layout): inside the engine's bounds (2e-6, 2.5e-5, 8e-5), which
are set from its own covering set. The auxiliary loss 2x moves the first step's gradient
norm by 1.4e-3 relative, 56x the bound; summing expert gradients over the ep group (dp 4,
ep 2) moved it by 1.7e-2; cp ranks routing their own chunks by 1.6e-2 (loss 2.9e-3); the
sp gather's gradient summed over tp by 1.1e-1.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from functools import cache
from types import SimpleNamespace

import pytest
import torch

import minipar.mesh as mesh_module
import minipar.parallel.cp_plan as cp_plan
import minipar.parallel.tp as tp_module
import minipar.step as step_module
from minipar.__main__ import main
from minipar.config import TrainConfig, predicted_bytes
from minipar.engine import train, train_reference
from minipar.mesh import Mesh
from minipar.model import GPT, ExpertQueues, MoE, get_config, load_balancing_loss, route
from minipar.parallel.cp import shard_sequence
from minipar.parity import TOLERANCES, compare, final_parameters, run_grad_norms
from minipar.theory.card import reserve_fit
from minipar.theory.clusters import get_cluster
from minipar.theory.comm_volume import comm_volume
from minipar.theory.layout import Layout
from minipar.theory.memory import memory_per_stage
from minipar.theory.moe import all_to_all_bytes, dropped_share, moe_flops_per_token, moe_params
from minipar.theory.params import (
    model_flops_per_token,
    param_count,
    stage_expert_params,
    stage_params,
)
from minipar.theory.planner import evaluate, plan

STEPS = 3
FP32 = TOLERANCES["fp32"]
SGD = dict(optimizer="sgd", grad_clip=0.0, lr=0.5, warmup=1)
RECOMPUTE_3 = dict(recompute="full", recompute_layers=3)  # blocks 0-2 of 8: 1 MoE, 2 dense
# what changes the single device's run (the rest is layout)
MODEL_KNOBS = ("optimizer", "grad_clip", "lr", "warmup", "capacity_factor", "moe_top_k",
               "z_loss_coef", "aux_loss_coef", "moe_every")


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


# 2 and 4 ranks; dropless and with a capacity; top-1 and top-2; ZeRO 0-3, and offload
# (each group's masters on the host); tp (each expert's MLP split) with and without ep
LAYOUTS = [
    dict(dp=2, ep=2, microbatches=2),
    dict(dp=2, ep=2, pp=2, microbatches=2, capacity_factor=1.0, zero=1),
    dict(dp=2, ep=2, tp=2, capacity_factor=1.25, moe_top_k=1, zero=2),
    dict(dp=2, ep=2, pp=2, microbatches=2, zero=3),
    dict(dp=2, ep=2, microbatches=2, capacity_factor=1.0, zero=1, offload=True),
    dict(dp=2, ep=2, microbatches=2, zero=3, offload=True),
    dict(tp=2, microbatches=2, capacity_factor=1.0),  # the experts' MLPs split by tp
    dict(dp=2, ep=2, tp=2, zero=3),
]


# make test-full only: ep x tp with ZeRO-3 runs under AdamW with sp below (and ep x tp
# under plain SGD with ZeRO-2 above).
LAYOUTS_FULL_ONLY = [dict(dp=2, ep=2, tp=2, zero=3)]


@pytest.mark.parametrize("layout", [pytest.param(d, marks=pytest.mark.slow)
                                    if d in LAYOUTS_FULL_ONLY else d for d in LAYOUTS],
                         ids=lambda d: " ".join(f"{k}={v}" for k, v in d.items()))
def test_plain_sgd_no_clipping(layout: dict) -> None:
    run, parity, ref = run_and_compare(**SGD, **layout)
    assert parity.ok(FP32), (f"{layout}: {parity.describe()}; losses {run['losses']} vs "
                             f"{ref['losses']}; norms {run_grad_norms(run)} vs "
                             f"{ref['grad_norms']}")
    assert run["losses"][-1] < run["losses"][0] - 0.02, "the loss must move"


# a sequence split over ranks: cp (zig-zag chunks) and sp (tp ranks' slices), with and
# without ep, ZeRO 1 and 3, the zero-bubble schedule (its backward in two passes), each
# with a capacity that drops tokens (decided over the whole sequence)
SPLIT_LAYOUTS = [
    dict(cp=2, capacity_factor=1.0, microbatches=2, **SGD),
    dict(dp=2, ep=2, cp=2, capacity_factor=1.25, moe_top_k=1, zero=1, z_loss_coef=1e-3),
    dict(tp=2, sp=True, capacity_factor=1.0, **SGD),
    dict(dp=2, ep=2, tp=2, sp=True, capacity_factor=1.0, zero=3),
    dict(cp=2, tp=2, sp=True, capacity_factor=1.0, **SGD),
    dict(cp=2, pp=2, capacity_factor=1.0, schedule="zb", microbatches=2),
    dict(pp=2, tp=2, sp=True, capacity_factor=1.0, schedule="zb", microbatches=2, **SGD),
]


@pytest.mark.parametrize("layout", SPLIT_LAYOUTS, ids=lambda d: " ".join(
    f"{k}={v}" for k, v in d.items() if k not in SGD))
def test_a_sequence_split_over_ranks_routes_as_one_device(layout: dict) -> None:
    run, parity, ref = run_and_compare(**layout)
    assert parity.ok(FP32), (f"{layout}: {parity.describe()}; losses {run['losses']} vs "
                             f"{ref['losses']}")
    assert run["losses"][-1] < run["losses"][0] - 0.02, "the loss must move"
    if layout.get("cp", 1) > 1:  # the expert ids travel over cp: k integers a token
        assert all(r["comm"]["cp"]["all_gather"]["calls"] > 0 for r in run["ranks"])


def test_adamw_clipped_zero1_with_z_loss_and_replicated_experts() -> None:
    """dp 4 over ep 2: each expert has two replicas (the edp group) to reduce over."""
    run, parity, _ = run_and_compare(dp=4, ep=2, zero=1, capacity_factor=1.0,
                                     z_loss_coef=1e-3)
    assert parity.ok(FP32), parity.describe()
    assert run["losses"][-1] < run["losses"][0] - 0.2


def test_zero3_shards_experts_over_their_replicas() -> None:
    """dp 4, ep 2, ZeRO-3, AdamW clipped: at parity, and each rank's Adam moments are
    its dense weights over 4 ranks plus its E/ep experts over their 2 replicas (the
    theory's ``sharded``, to the flats' padding); experts sharded over dp would be
    half that, unsharded twice."""
    run, parity, _ = run_and_compare(dp=4, ep=2, zero=3, capacity_factor=1.0)
    assert parity.ok(FP32), parity.describe()
    model = TrainConfig(model="moe-tiny").model_config()
    got = run["ranks"][0]["memory"]["optimizer"]
    want = memory_per_stage(model, Layout(dp=4, zero=3, dtype="fp32", ep=2),
                            accounting="fused")[0]["optimizer"]
    experts = 2 * 4 * stage_expert_params(model, ep=2)  # Adam: 2 fp32 moments
    assert abs(got - want) < 0.01 * experts, (got, want, experts)


@pytest.mark.parametrize("zero", [1, 3])
def test_a_pipeline_stage_without_moe_blocks_under_ep(zero: int) -> None:
    """--moe-every 8: the one MoE block is on the last of two stages, so the first has
    no experts to split over ep and keeps one data-parallel wrapper (ZeRO 0-2 used to
    build a ZeroOptimizer of no weights, which torch refuses: "optimizer got an empty
    parameter list", raised by every rank of that stage after launch). At parity."""
    run, parity, ref = run_and_compare(dp=2, ep=2, pp=2, microbatches=2, moe_every=8,
                                       zero=zero, **SGD)
    assert parity.ok(FP32), f"{parity.describe()}; losses {run['losses']} vs {ref['losses']}"
    assert run["losses"][-1] < run["losses"][0] - 0.02, "the loss must move"


@pytest.mark.parametrize("zero", [1, 3])
def test_resume_splits_the_saved_experts_over_ep(tmp_path, zero: int) -> None:
    """A checkpoint holds each expert whole (gathered over ep): resumed at dp 2 ep 2 each
    rank takes its experts' weights and Adam moments, and the losses continue those of
    the run that was not stopped (bitwise: CPU, fp32, the same layout); resumed at ep 1
    (every rank with every expert) the same losses within 1e-5."""
    steps, half = 4, 2
    layout = dict(model="moe-tiny", dp=2, ep=2, zero=zero, steps=steps, timeout=240,
                  capacity_factor=1.0)
    full = train(TrainConfig(**layout))["losses"]
    stopped = train(TrainConfig(**layout, save=str(tmp_path), stop_at=half))["losses"]
    assert stopped == full[:half]
    resumed = train(TrainConfig(**layout, resume=str(tmp_path)))["losses"]
    assert resumed == full[half:]
    replicated = train(TrainConfig(**{**layout, "ep": 1}, resume=str(tmp_path)))["losses"]
    assert max(abs(a - b) for a, b in zip(replicated, full[half:])) < 1e-5


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
    for r in run["ranks"]:  # who sent what to whom: the row sums to the payload, and
        a2a = r["comm"]["ep"]["all_to_all"]  # what a rank sends itself never leaves it
        assert sum(a2a["sent_to"]) == a2a["bytes"]
        assert a2a["wire_bytes"] == a2a["bytes"] - a2a["sent_to"][r["coords"]["dp"] % cfg.ep]


def _engine_scalars(volume: dict, layout: Layout, stage: int) -> dict:
    """``volume`` plus the engine's own small all-reduces, which the theory leaves out:
    the gradient norm's fp32 squared sum over dp x cp, tp and pp (``step.clip_gradients``)
    and the last stage's fp64 loss over dp x cp (``step.train_step``)."""
    out = {d: {op: dict(x) for op, x in ops.items()} for d, ops in volume.items()}
    dp = "dp_cp" if layout.cp > 1 else "dp"
    last = stage == layout.pp - 1
    for dim, n, nbytes in ((dp, layout.dp * layout.cp, 4 + (8 if last else 0)),
                           ("tp", layout.tp, 4), ("pp", layout.pp, 4)):
        if n > 1:
            x = out.setdefault(dim, {}).setdefault("all_reduce", {"calls": 0, "bytes": 0})
            x["calls"] += 2 if dim == dp and last else 1
            x["bytes"] += nbytes
    return out


@pytest.mark.parametrize("layout", [dict(tp=2, sp=True), dict(cp=2, microbatches=2,
                                                               recompute="full"),
                                    dict(dp=2, ep=2, tp=2, sp=True),
                                    dict(dp=2, ep=2, cp=2),
                                    dict(pp=2, tp=2, sp=True, head_layers=2),
                                    dict(tp=2, sp=True, **RECOMPUTE_3),
                                    dict(dp=2, ep=2, zero=3, **RECOMPUTE_3),
                                    dict(pp=2, tp=2, sp=True, schedule="interleaved", virtual=2,
                                         microbatches=2, head_layers=1, recompute="full",
                                         recompute_layers=2)],
                         ids=lambda d: " ".join(f"{k}={v}" for k, v in d.items()))
def test_counted_bytes_equal_the_theory(layout: dict) -> None:
    """Every byte a real run counts (dropless, one step) is ``theory.comm_volume``'s: the
    experts' tp all-reduces of the routed rows, sp's gathers around the layer, cp's
    gather of the expert ids (full recomputation: again), the all-to-all, the experts'
    gradients over ``edp``, and with ``head_layers`` each stage's own layers. Summed over
    the ranks (a rank's all-to-all and the tp traffic of its experts depend on what the
    router sent it); calls per rank, except the dp reductions' (bucketed by the engine).
    ``recompute_layers`` N: only the first N blocks of each chunk run their forward
    collectives again (dense and MoE blocks alike; chunks of 3 and 2 or 2 and 1 blocks
    with ``head_layers``), and ZeRO-3 gathers nothing more for them; pricing every block
    as recomputed would not match. Not compared: pp's sends, which carry a shape header
    the first time (a few bytes)."""
    cfg = TrainConfig(model="moe-tiny", steps=1, timeout=240, **layout)
    run = train(cfg)
    lay = cfg.layout()
    measured: dict = {}
    predicted: dict = {}
    every: dict = {}  # the mutation: every block priced as recomputed
    for r in run["ranks"]:
        stage = r["coords"]["pp"]
        want = _engine_scalars(comm_volume(cfg.model_config(), lay, stage=stage), lay, stage)
        every_block = replace(lay, recompute_layers=None)
        wrong = _engine_scalars(comm_volume(cfg.model_config(), every_block, stage=stage),
                                lay, stage)
        assert set(r["comm"]) == set(want), (set(r["comm"]), set(want))
        for dim, ops in want.items():
            assert set(r["comm"][dim]) == set(ops), dim
            for op, x in ops.items():
                if dim == "pp" and op in ("send", "recv"):
                    continue
                got = r["comm"][dim][op]
                if dim not in ("dp", "dp_cp", "edp"):
                    assert got["calls"] == x["calls"], (r["coords"], dim, op, got, x)
                measured[dim, op] = measured.get((dim, op), 0) + got["bytes"]
                predicted[dim, op] = predicted.get((dim, op), 0) + x["bytes"]
                every[dim, op] = every.get((dim, op), 0) + wrong[dim][op]["bytes"]
    assert measured == predicted
    assert ("cp", "all_gather") in measured or lay.cp == 1
    assert (every != measured) == (lay.recompute_layers is not None)


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


@pytest.mark.parametrize("zero", [0, 3])
def test_expert_gradients_over_the_wrong_group_fail(monkeypatch, zero: int) -> None:
    """dp 2, ep 2: each expert lives once (edp = 1 rank); summing its gradient over dp
    adds the other rank's experts to it (ZeRO-3: and shards it there)."""
    monkeypatch.setattr(mesh_module.RankMesh, "edp",
                        property(lambda self: self.comms["dp_cp"]))
    _, broken, _ = run_and_compare(dp=2, ep=2, zero=zero, **SGD)
    assert not broken.ok(FP32), f"expert gradients summed over dp passed: {broken}"


@pytest.mark.parametrize("split", ["cp", "sp"])
def test_a_wrong_sequence_split_fails(monkeypatch, split: str) -> None:
    """cp: each rank deciding the capacity over its own two chunks, as if they were the
    sequence, drops other tokens than one device does. sp: the gathered sequence's
    gradient summed over tp (SP's usual f) though what consumed it ran replicated
    counts it tp times. The check fails on both."""
    if split == "cp":
        monkeypatch.setattr(cp_plan.ShardQueues, "forward", ExpertQueues.forward)
        layout = dict(cp=2, capacity_factor=1.0, **SGD)
    else:
        monkeypatch.setattr(tp_module._GatherWholeSequence, "backward", staticmethod(
            lambda ctx, grad: (ctx.comm.reduce_scatter(grad.contiguous(), dim=1), None)))
        layout = dict(tp=2, sp=True, capacity_factor=1.0, **SGD)
    _, broken, _ = run_and_compare(**layout)
    assert not broken.ok(FP32), f"the mutation under {split} passed: {broken}"


def test_shard_queues_decide_over_the_whole_sequence() -> None:
    """``ShardQueues`` on each cp rank's zig-zag shard (the all-gather played by a stub)
    keeps exactly the reference's assignments at that rank's positions, and returns the
    whole sequence's ids; the rule run on the shard alone would not."""
    torch.manual_seed(3)
    b, s, k, n = 3, 32, 2, 8
    expert = torch.randint(0, n, (b, s, k))
    queues = ExpertQueues(n, k, capacity_factor=1.0)
    want = queues(expert)[0]
    for cp in (2, 4):
        shards = [shard_sequence(expert, r, cp) for r in range(cp)]
        local_rule_differs = False
        for r in range(cp):
            comm = SimpleNamespace(rank=r, size=cp,
                                   all_gather=lambda x, dim, shards=shards: torch.cat(shards, dim))
            keep, whole = cp_plan.ShardQueues(queues, comm)(shards[r])
            assert torch.equal(keep, shard_sequence(want, r, cp))
            assert torch.equal(whole, expert)
            local_rule_differs |= not torch.equal(keep, queues(shards[r])[0])
        assert local_rule_differs


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


# --- the theory where a user acts on it: memory, the fit check, the planner ------------

@pytest.mark.parametrize("name", ["moe-tiny", "moe-1.3b"])
def test_stage_parameters_and_flops_count_the_experts(name: str) -> None:
    """``stage_params`` (what memory and the fit check multiply) holds the router and
    E/ep experts of each MoE block; the FLOPs count the active weights."""
    cfg = get_config(name)
    model = GPT(cfg, device="meta")
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert param_count(cfg) == stage_params(cfg) == model.num_params()
    assert stage_expert_params(cfg, ep=2) == experts // 2
    assert stage_params(cfg, ep=2) == model.num_params() - experts // 2
    halves = [stage_params(cfg, pp=2, stage=s) for s in range(2)]
    tied = cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0  # its copy on stage 1
    assert sum(halves) == model.num_params() + tied
    assert model_flops_per_token(cfg) == pytest.approx(moe_flops_per_token(cfg))


@pytest.mark.parametrize("capacity,tp,sp,cp", [(0.0, 1, False, 1), (1.0, 1, False, 1),
                                              (1.0, 2, False, 1), (1.0, 2, True, 1),
                                              (1.0, 1, False, 2), (0.0, 1, False, 2)])
def test_memory_prediction_holds_for_an_ep_run(capacity: float, tp: int, sp: bool,
                                               cp: int) -> None:
    """dp 2, ep 2 (fp32 AdamW, ZeRO-0, 1 step): weights, gradients and optimizer states
    as measured, byte for byte (each rank holds half the experts, with tp 2 half of
    each expert's MLP); the stored activations within 15%: measured over predicted
    1.072 dropless (routing is not balanced: a rank's experts receive more than k s
    rows), 0.988 with capacity 1; with tp 2 sp (the MoE layer keeps the gathered
    sequence) 1.020, with cp 2 (a rank's half of each sequence) 1.021 with capacity 1
    and 1.106 dropless (1.391 while a cp rank's MoE rows were divided by cp twice). The
    prediction that ignores ep (every rank with all the experts) must miss."""
    cfg = TrainConfig(model="moe-tiny", dp=2, ep=2, tp=tp, sp=sp, cp=cp, steps=1,
                      timeout=240, capacity_factor=capacity, measure_activations=True)
    got = train(cfg)["ranks"][0]["memory"]
    model = cfg.model_config()
    want, whole = (memory_per_stage(model, cfg.layout().with_(ep=ep), accounting="fused")[0]
                   for ep in (2, 1))
    for key in ("params", "grads", "optimizer"):
        assert got[key] == want[key], (key, got[key], want[key])
        assert got[key] < whole[key], key
    assert 0.85 < got["activations"] / want["activations"] < 1.15, (
        got["activations"] / want["activations"], got, want)
    assert want["moe_dispatch"] > 0 and whole["moe_dispatch"] == 0


def test_cheap_recomputation_in_moe_blocks() -> None:
    """An MoE block has no ``mlp.act`` (its experts apply GELU inside): cheap
    recomputation remakes its layer norms' outputs only, a dense block's GELU output too.
    dp 2 ep 2 (plain SGD): the same losses as keeping everything, and the bytes the meter
    no longer sees are the memory model's, exactly (measured: 2,097,152 of 12,762,548)."""
    runs, want = {}, {}
    for mode in ("none", "cheap"):
        cfg = TrainConfig(model="moe-tiny", dp=2, ep=2, steps=2, timeout=240, recompute=mode,
                          optimizer="sgd", grad_clip=0.0, measure_activations=True)
        runs[mode] = train(cfg)
        want[mode] = memory_per_stage(cfg.model_config(), cfg.layout(),
                                      accounting="fused")[0]["activations"]
    got = {m: r["ranks"][0]["memory"]["activations"] for m, r in runs.items()}
    assert runs["cheap"]["losses"] == runs["none"]["losses"]
    assert got["none"] - got["cheap"] == want["none"] - want["cheap"] > 0


def test_fit_check_and_memory_command_count_experts_by_ep(tmp_path, capsys) -> None:
    cfg = TrainConfig(model="moe-1.3b", dp=8, ep=8, zero=1, dtype="bf16", batch_size=8)
    split = predicted_bytes(cfg, cfg.model_config(), device="cuda")
    whole = predicted_bytes(cfg, cfg.model_config(), device="cuda", ep=1)
    # 7/8 of the experts' 16-bit weights and fp32 gradient sums leave (the Adam shard
    # stays 1/8 of them), less the all-to-all's buffers; times the allocator's reserve
    experts = moe_params("moe-1.3b")["experts"]
    fit = reserve_fit("fused")  # CUDA's kernel: the reserve's slope (its constant
    factor, grads = fit.factor, fit.factor + fit.zero1_share  # cancels), ZeRO-1's share
    assert whole - split == pytest.approx(experts * 7 / 8 * (2 * factor + 4 * grads),
                                          rel=0.01)
    out = tmp_path / "m.json"
    assert main(["memory", "--model", "moe-tiny", "--dp", "4", "--ep", "2",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["n_experts"] == stage_expert_params("moe-tiny", ep=2)
    assert main(["memory", "--model", "tiny", "--dp", "2", "--ep", "2"]) == 2
    assert "needs a mixture-of-experts model" in capsys.readouterr().err


def test_planner_enumerates_ep_and_prices_the_all_to_all() -> None:
    """Every ep dividing dp and the experts is tried, with every ZeRO stage; the ep term is
    the theory's all-to-all bytes at the cluster's link: a calibrated all-to-all when
    given, else the all-gather's."""
    result = plan("moe-1.3b", "dgx-a100", 64, recomputes=("none",), schedules=("1f1b",))
    eps = {(x.layout.ep, x.layout.zero) for x in result}
    assert {e for e, _ in eps} == {1, 2, 4, 8} and {z for e, z in eps if e > 1} == {0, 1, 2, 3}
    assert {x.layout.ep for x in plan("gpt-1.3b", "dgx-a100", 64, recomputes=("none",))} == {1}
    where = get_cluster("dgx-a100")
    layout = Layout(dp=8, ep=8, zero=1, microbatch_size=8)  # batch 64
    lay = evaluate("moe-1.3b", where, layout)
    a2a = all_to_all_bytes("moe-1.3b", 8 * 2048, 8, "bf16")
    assert lay.traffic["ep"] == pytest.approx(a2a["wire_bytes"])
    assert lay.time["ep"] == pytest.approx(a2a["wire_bytes"] / where.intra_bw
                                           + a2a["calls"] * where.latency)
    slow = where.with_(links=(("all_gather", 1e-5, where.intra_bw),
                              ("all_to_all", 1e-5, where.intra_bw / 4)))
    assert evaluate("moe-1.3b", slow, layout).time["ep"] > 3.9 * lay.time["ep"]
    assert "--ep 8" in " ".join(layout.train_flags("moe-1.3b"))


def test_planner_places_a_long_moe_sequence_with_cp_and_sp(tmp_path, monkeypatch) -> None:
    """At 32k tokens a sequence, moe-1.3b (top-1) on 4 x H100: the planner's candidates
    include cp > 1 and tp sp layouts, with and without ep, and cp wins (each rank keeps
    16k tokens: the ring hides); each is priced with ``comm_volume``'s MoE traffic (the
    expert ids over cp, the sequence under sp). Every layout ``plan`` prints validates on
    the planned card and its command parses back to it."""
    from minipar.__main__ import build_parser, train_config
    from minipar.config import validate
    from minipar.theory.clusters import cluster
    from minipar.theory.comm_volume import total_wire_bytes
    from minipar.theory.models import get_model

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "moe-1.3b", "--seq-len", "32768", "--moe-top-k", "1",
                 "--gpus", "4", "--gpu", "H100-80GB", "--gpus-per-node", "4", "--batch", "4",
                 "--top", "1000", "--json", str(out)]) == 0
    printed = json.loads(out.read_text())["layouts"]
    assert printed[0]["cp"] > 1
    kinds = {(x["cp"] > 1, x["sp"] and x["tp"] > 1, x["ep"] > 1) for x in printed}
    assert {(True, False, True), (True, True, False), (False, True, True)} <= kinds

    long = get_model("moe-1.3b").with_(seq_len=32768, moe_top_k=1)
    where = cluster(4, "H100-80GB", 4)
    fields = set(Layout.__dataclass_fields__)
    layouts = [Layout(**{k: v for k, v in x.items() if k in fields}) for x in printed]
    both = next(lay for lay in layouts if lay.cp > 1 and lay.sp)
    est, vol = evaluate(long, where, both), comm_volume(long, both)
    assert vol["cp"]["all_gather"]["calls"] == long.n_moe_layers * both.microbatches
    assert vol["tp"]["all_gather"]["calls"] > 0
    for dim in ("tp", "cp"):
        assert est.traffic[dim] == total_wire_bytes(vol, dim), dim
    assert est.time["cp"] > 0  # the ring hides; the gather of the ids does not

    monkeypatch.setattr("minipar.config.machine_memory",  # validate as on the planned card
                        lambda cfg: ("memory per GPU", where.gpu_memory, 1))
    for x, want in zip(printed, layouts):
        argv = x["command"].replace("--backend nccl", "--backend gloo").split()[3:]
        cfg = train_config(build_parser().parse_args(argv))
        validate(cfg)
        # the planner's Adam is the train default AdamW: the same states
        assert (want.optimizer, cfg.optimizer) == ("adam", "adamw")
        assert cfg.layout("cuda") == want.with_(optimizer="adamw")  # (as on the GPUs planned)
        assert cfg.model_config() == long


def test_a_resized_model_keeps_its_experts_share_of_the_mlp():
    """``--hidden`` (or ``--ffn``) resizes the MLP, and the experts with it: gpt-13b at
    1/16 of its width with experts has experts as wide as its MLP (1,280), not the
    preset's 20,480; moe-1.3b's experts stay half its MLP."""
    from minipar.config import sized
    from minipar.model import get_config

    narrow = sized(get_config("gpt-13b"), hidden=320)
    assert narrow.d_ff == narrow.expert_d_ff == 1280
    half = sized(get_config("moe-1.3b"), hidden=256)
    assert (half.d_ff, half.expert_d_ff) == (1024, 512)
    assert sized(get_config("moe-1.3b"), ffn=1000).expert_d_ff == 500
    assert sized(get_config("moe-1.3b"), layers=4) == get_config("moe-1.3b").with_(n_layer=4)
