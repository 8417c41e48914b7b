"""ZeRO-Offload (``minipar.parallel.zero.offload.OnHost``) against the same optimizer
with its masters on the device.

One rank, fp32: the data path is the plain one (the same gradients, accumulated in the
same order, the same torch optimizer on the same values), so parameters must be
bit-identical to a plain torch optimizer after every step. 16-bit weights: compared
with the mixed-precision recipe written out by hand (fp32 masters, gradients cast up,
the step, weights cast down), again bit-identical. With ZeRO 0-3 (``train --offload``):
the same ZeRO without offload is the reference, bit for bit; the engine's runs against
one device are in ``test_cp_engine.py`` and here (bf16, the traffic, a mutation). Bytes
moved are checked against ``minipar.theory.offload``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from minipar.comm import Comm
from minipar.config import TrainConfig, validate
from minipar.launch import launch
from minipar.model import GPT, GPTConfig
from minipar.parallel.zero import OnHost, Zero3, ZeroOptimizer
from minipar.parallel.zero import offload as offmod
from minipar.theory.offload import (
    offload_memory,
    offload_traffic,
    zero_offload_memory,
    zero_offload_traffic,
)

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)
STEPS, MICRO = 3, 2
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
              "sgd": (torch.optim.SGD, {"lr": 0.1})}


def _batches(step: int, micro: int = MICRO) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g),
             torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g))
            for _ in range(micro)]


def _loss(model, x, y) -> torch.Tensor:
    out = model(x, y)
    return out[1] if isinstance(out, tuple) else out


def _train(model, opt, hand_rolled_masters=None, micro: int = MICRO) -> list[dict]:
    """STEPS steps of ``micro`` micro-batches; the parameters after each step."""
    seen = []
    for step in range(STEPS):
        for x, y in _batches(step, micro):
            (_loss(model, x, y) / micro).backward()
        if hand_rolled_masters is not None:  # mixed precision by hand: grads up, step, down
            for p, m in zip(model.parameters(), hand_rolled_masters):
                m.grad = p.grad.float()
        opt.step()
        if hand_rolled_masters is not None:
            with torch.no_grad():
                for p, m in zip(model.parameters(), hand_rolled_masters):
                    p.copy_(m)
                    p.grad = None
        opt.zero_grad()
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return seen


def _one_rank(name: str, dtype: torch.dtype) -> dict:
    """The plain recipe (fp32: the torch optimizer; bf16: mixed precision by hand, one
    micro-batch) and ZeRO stage 0 with its masters on the host, from the same weights."""
    cls, kwargs = OPTIMIZERS[name]
    micro = MICRO if dtype == torch.float32 else 1  # (bf16 by hand would sum in bf16)
    torch.manual_seed(0)
    ref_model = GPT(CFG)
    model = GPT(CFG)
    model.load_state_dict(ref_model.state_dict())
    masters = [p.detach().clone() for p in ref_model.parameters()]
    initial = {n: m.clone() for (n, _), m in zip(ref_model.named_parameters(), masters)}
    ref_model.to(dtype)
    model.to(dtype)
    if dtype == torch.float32:
        want = _train(ref_model, cls(ref_model.parameters(), **kwargs), micro=micro)
    else:
        want = _train(ref_model, cls(masters, **kwargs), masters, micro=micro)
    host = OnHost()
    opt = ZeroOptimizer(model, cls, stage=0, comm=Comm(), bucket_mb=0, place=host,
                        **kwargs)
    if dtype != torch.float32:  # the masters from the fp32 weights, as by hand
        opt.load_full_state_by_name({}, initial)
    opt.backwards_per_step = micro
    got = _train(model, opt, micro=micro)
    return {"equal": [all(torch.equal(w[k], g[k]) for k in w) for w, g in zip(want, got)],
            "traffic": host.last_traffic, "n": sum(p.numel() for p in model.parameters()),
            "on_host": all(f.master.device.type == "cpu" for f in opt.flats),
            "memory": opt.memory_bytes()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_offload_on_one_rank_is_bit_identical_to_the_plain_recipe(name, dtype):
    out = launch(_one_rank, 1, args=(name, dtype), timeout=120)[0]
    assert out["equal"] == [True] * STEPS and out["on_host"]
    p = 4 if dtype == torch.float32 else 2  # the gradient sum crosses once, in fp32
    assert out["traffic"] == zero_offload_traffic(out["n"], dp=1, zero=0, param_bytes=p)
    assert out["memory"]["optimizer"] == 0 and out["memory"]["host_optimizer"] > 0


def test_theory_numbers():
    # the paper's accounting: 16-bit params and grads, one micro-batch: 4 bytes per param
    assert sum(offload_traffic(10**9).values()) == 4 * 10**9
    assert offload_traffic(8, microbatches=4, dp=2, zero=2) == {"to_host": 32,
                                                                 "to_device": 8}
    mem = offload_memory(10**9)
    assert mem["device"] == 2 * 10**9 and mem["host"] == 20 * 10**9
    assert offload_memory(10**9, dp=4, zero=3)["device"] == 5 * 10**8


# --- with ZeRO: no fp32 master on the device, 16-bit bytes back -------------------------
def _zero_run(stage: int, dtype: torch.dtype, offload: bool) -> dict:
    """STEPS steps of ZeRO over this rank's comm (bucket per parameter): what it held."""
    torch.manual_seed(0)
    model = GPT(CFG).to(dtype)
    host = OnHost() if offload else None
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, comm=Comm(), bucket_mb=0,
                        lr=1e-2, weight_decay=0.1, place=host)
    opt.backwards_per_step = MICRO
    during_backward, host_grads = [], []
    for step in range(STEPS):
        for x, y in _batches(step):
            (_loss(model, x, y) / MICRO).backward()
        if offload:  # buckets reduced (and shipped) while backward ran
            during_backward.append(host.traffic["to_host"])
        opt.step()
        memory = opt.memory_bytes()
        host_grads.append([f.master.grad.data_ptr() for i, f in enumerate(opt.flats)
                           if offload and f.master.grad is host._grads[i]])
        opt.zero_grad()
    out = {"weights": {k: v.clone() for k, v in model.state_dict().items()},
           "memory": memory, "shard": sum(f.hi - f.lo for f in opt.flats)}
    if offload:
        out.update(during_backward=during_backward, traffic=host.last_traffic,
                   host_grads=host_grads, landing=len(host._landing),
                   flats=len(opt.flats),
                   on_host=all(f.master.device.type == "cpu" for f in opt.flats),
                   apart=all(f.master.untyped_storage().data_ptr() !=
                             f.full.untyped_storage().data_ptr() for f in opt.flats))
    return out


def _zero_both(stage: int, dtype: torch.dtype) -> tuple[dict, dict]:
    return _zero_run(stage, dtype, False), _zero_run(stage, dtype, True)


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_zero_offload_is_bit_identical_to_zero(stage, dtype):
    """dp 2: the same ZeroOptimizer with and without offload, every weight equal."""
    for want, got in launch(_zero_both, 2, args=(stage, dtype), timeout=120):
        for k, w in want["weights"].items():
            assert torch.equal(w, got["weights"][k]), k
        assert got["on_host"] and got["apart"]  # fp32 stage 0 too: the device keeps ``full``
        assert got["memory"]["optimizer"] == 0 and got["memory"]["host_optimizer"] > 0
        assert want["memory"]["optimizer"] > 0 or (stage == 0 and dtype == torch.float32)
        shard, p = got["shard"], 4 if dtype == torch.float32 else 2
        assert got["traffic"] == {"to_host": 4 * shard, "to_device": p * shard}
        if stage == 2:  # a bucket per parameter, two in flight: most left in backward
            assert all(b > 0 for b in got["during_backward"])
        # the host gradients are made once and reused (no multi-GB allocation a step);
        # one landing a step goes straight into them (no landing buffer made)
        assert len(got["host_grads"][0]) == got["flats"]
        assert all(ptrs == got["host_grads"][0] for ptrs in got["host_grads"])
        assert got["landing"] == 0


def test_zero_offload_traffic_theory():
    n = 10**9
    assert zero_offload_traffic(n, dp=4, zero=2) == {"to_host": 10**9, "to_device": 5 * 10**8}
    assert zero_offload_traffic(n, dp=4, zero=1, param_bytes=4)["to_device"] == 10**9
    assert zero_offload_traffic(n, dp=4, zero=0)["to_host"] == 4 * n  # not sharded


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_engine_offload_bytes_equal_the_theory(dtype):
    """The host <-> device bytes of a real step (``rank["offload_bytes"]``) are
    ``zero_offload_traffic``'s, up to the flat buffers' padding (a few elements)."""
    from minipar.config import TrainConfig
    from minipar.engine import train

    cfg = TrainConfig(steps=1, timeout=240, offload=True, dp=2, zero=2, microbatches=2,
                      dtype=dtype)
    run = train(cfg)
    n = GPT(cfg.model_config()).num_params()
    want = zero_offload_traffic(n, dp=2, zero=2, param_bytes=2 if dtype == "bf16" else 4)
    for r in run["ranks"]:
        for k in ("to_host", "to_device"):
            assert r["offload_bytes"][k] == pytest.approx(want[k], rel=2e-3)
        assert r["memory"]["optimizer"] == 0  # no fp32 master on the device


@pytest.mark.parametrize("zero, grad_dtype", [(0, "fp32"), (2, "fp32"), (3, "fp32"),
                                              (1, "bf16")])
def test_engine_host_bytes_equal_the_theory(zero, grad_dtype):
    """What ``OnHost`` holds after real steps (masters, their gradients, AdamW's moments,
    any landing buffer; ``rank["memory"]["host_optimizer"]``) is
    ``zero_offload_memory``'s host bytes, up to the flat buffers' padding: 16 bytes a
    parameter of the shard in fp32 reductions (the shard lands once a step, straight in
    its gradient), 18 where a bf16 shard lands in a buffer first. On a GPU the pinned
    16-bit upload buffer adds p bytes (``upload``); a CPU run casts into its weights.
    The planner's host figure is the GPU's: gpt-6.7b on one GPU holds 18 bytes a
    parameter on the host, 112 GiB, not the 136 it once booked."""
    from minipar.config import TrainConfig
    from minipar.engine import train
    from minipar.theory.memory import memory_per_stage

    cfg = TrainConfig(steps=2, timeout=240, offload=True, dp=2, zero=zero, microbatches=2,
                      dtype="bf16", grad_dtype=grad_dtype)
    run = train(cfg)
    n = GPT(cfg.model_config()).num_params()
    want = zero_offload_memory(n, 2, 8, 2, zero, grad_bytes=2 if grad_dtype == "bf16" else 4,
                               upload=False)["host"]
    for r in run["ranks"]:
        assert r["memory"]["host_optimizer"] == pytest.approx(want, rel=1e-4)
    gpu = memory_per_stage("gpt-6.7b", cfg.layout("cuda").with_(dp=1, zero=0,
                                                                grad_dtype="fp32"))[0]
    assert gpu["host"] == 18 * gpu["n_params"]


def test_engine_mutation_step_before_the_gradients_land_fails(monkeypatch):
    """The CPU step runs before the copies landed (a classic offload race: the host
    reads its buffer while the device is still writing it): the check must fail."""
    from test_engine import FP32, SGD, reference

    from minipar.config import TrainConfig
    from minipar.engine import train
    from minipar.parity import compare

    cfg = TrainConfig(steps=3, timeout=240, offload=True, dp=2, zero=2, microbatches=2,
                      **SGD)
    ref = {k: v[:3] for k, v in reference(**SGD).items() if k in ("losses", "grad_norms")}
    assert compare(train(cfg), ref).ok(FP32)
    monkeypatch.setattr(offmod.OnHost, "land_all", lambda self: None)
    broken = compare(train(cfg), ref)
    assert not broken.ok(FP32), broken.describe()


@pytest.mark.parametrize("zero", [2, 3])
def test_engine_offload_checkpoint_resumes(tmp_path, zero):
    """Saved from host shards, resumed with offload (bitwise, same layout) and without
    (another layout: the states by name)."""
    from minipar.config import TrainConfig
    from minipar.engine import train

    def run(**kw) -> list[float]:
        return train(TrainConfig(steps=4, timeout=240, dp=2, microbatches=2, **kw))["losses"]

    layout = dict(offload=True, zero=zero)
    full = run(**layout)
    assert run(**layout, save=str(tmp_path), stop_at=2) == full[:2]
    assert run(**layout, resume=str(tmp_path)) == full[2:]
    other = run(zero=1, resume=str(tmp_path))
    assert max(abs(a - b) for a, b in zip(other, full[2:])) < 1e-4


# --- ZeRO-3 + offload: host masters, a 16-bit device shard gathered from ------------------
ZERO3 = [dict(dp=2, zero=3, microbatches=2), dict(dp=2, zero=3, microbatches=2, pp=2)]


@pytest.mark.parametrize("layout", ZERO3, ids=lambda d: " ".join(f"{k}={v}" for k, v in
                                                                 d.items()))
def test_engine_zero3_offload_matches_single_device(layout):
    """fp32 and plain SGD without clipping against one process (the fp32 tolerances);
    bf16 against the fp32 reference with bf16's."""
    from test_engine import BF16, SGD, assert_parity

    for knobs in (dict(), SGD, dict(dtype="bf16", tol=BF16)):
        run = assert_parity(**knobs, offload=True, **layout)
        for r in run["ranks"]:
            assert r["memory"]["optimizer"] == 0 and r["memory"]["host_optimizer"] > 0


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_engine_zero3_offload_bytes_equal_the_theory(dtype):
    """The micro-batches' fp32 gradient shards add up on the device and cross once
    (during the last one's backward); the 16-bit shard comes back once per step."""
    from minipar.config import TrainConfig
    from minipar.engine import train

    cfg = TrainConfig(steps=1, timeout=240, offload=True, dp=2, zero=3, microbatches=2,
                      dtype=dtype)
    run = train(cfg)
    n = GPT(cfg.model_config()).num_params()
    want = zero_offload_traffic(n, dp=2, zero=3, param_bytes=2 if dtype == "bf16" else 4)
    for r in run["ranks"]:
        for k in ("to_host", "to_device"):  # (padding: a few elements per unit)
            assert r["offload_bytes"][k] == pytest.approx(want[k], rel=5e-3)


def _zero3_run(dtype: torch.dtype, offload: bool, per_step: int = 1) -> dict:
    torch.manual_seed(0)
    host = OnHost() if offload else None
    sync = Zero3(GPT(CFG), Comm(), param_dtype=dtype, place=host)
    sync.backwards_per_step = per_step  # MICRO: the shards add up on the device first
    opt = torch.optim.AdamW(sync.parameters(), lr=1e-2, weight_decay=0.1)
    sync.publish_after(opt)
    host_grads = []
    for step in range(STEPS):
        for x, y in _batches(step):
            (_loss(sync, x, y) / MICRO).backward()
        sync.finish_gradient_sync()
        opt.step()
        memory = sync.memory_bytes(opt)
        host_grads.append([f.master.grad.data_ptr() for i, f in enumerate(sync.flats)
                           if offload and f.master.grad is host._grads[i]])
        sync.zero_grad()
    weights, _ = sync.full_state_by_name(opt)
    return {"weights": weights, "memory": memory, "host_grads": host_grads,
            "flats": len(sync.flats), "landing": len(host._landing) if offload else 0,
            "traffic": host.last_traffic if offload else None,
            "shard": sum(f.hi - f.lo for f in sync.flats),
            "on_host": all(f.master.device.type == "cpu" for f in sync.flats)}


def _zero3_both(dtype: torch.dtype, per_step: int) -> tuple[dict, dict]:
    return _zero3_run(dtype, False, per_step), _zero3_run(dtype, True, per_step)


def test_zero3_offload_saves_the_states_less_the_16_bit_shard_it_adds():
    """Without offload ZeRO-3's gathers cast from the fp32 master shard; with it the
    master leaves and a 16-bit device shard takes its place: the weights and optimizer
    bytes ``Zero3.memory_bytes`` reports fall by what ``theory.memory`` says."""
    from minipar.theory.layout import Layout
    from minipar.theory.memory import memory_breakdown

    n = GPT(CFG).num_params()
    theory = [memory_breakdown(params=n, layout=Layout(dp=2, zero=3, offload=o))
              for o in (False, True)]
    saved = theory[0]["total"] - theory[1]["total"]
    for base, off in launch(_zero3_both, 2, args=(torch.bfloat16, MICRO), timeout=120):
        held = [r["memory"]["params"] + r["memory"]["optimizer"] for r in (base, off)]
        assert held[0] - held[1] == pytest.approx(saved, rel=1e-2)  # (padding, step counts)
        assert off["memory"]["params"] - base["memory"]["params"] == 2 * off["shard"]


@pytest.mark.parametrize("per_step", [1, MICRO], ids=["host sums", "device sums"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_zero3_offload_is_bit_identical_to_zero3(dtype, per_step):
    """The micro-batches' gradient shards summed on the host (each crosses) or, told how
    many backwards make a step, on the device (one crossing): the same values."""
    for want, got in launch(_zero3_both, 2, args=(dtype, per_step), timeout=120):
        crossings = MICRO if per_step == 1 else 1
        assert got["traffic"]["to_host"] == 4 * got["shard"] * crossings
        assert got["landing"] == (got["flats"] if per_step == 1 else 0)  # 2nd buffers
        assert got["on_host"] and got["memory"]["optimizer"] == 0
        for k, w in want["weights"].items():
            assert torch.equal(w, got["weights"][k]), k
        # each micro-batch's shard adds into the same host gradients, step after step
        assert len(got["host_grads"][0]) == got["flats"]
        assert all(ptrs == got["host_grads"][0] for ptrs in got["host_grads"])


def test_host_optimizer_is_the_fused_adamw():
    """AdamW is torch's fused kernel on the host (``--offload``) and everywhere else by
    default, so the reference and every layout step with the same kernel; the host keeps
    it under ``--no-fused``; plain SGD (one pass already) stays torch's default on CPUs."""
    from minipar.config import TrainConfig, optimizer_kwargs

    cfg = TrainConfig(offload=True)
    assert optimizer_kwargs(cfg, host=True)["fused"] is True
    assert optimizer_kwargs(cfg)["fused"] is True
    assert "fused" not in optimizer_kwargs(TrainConfig(fused=False))
    assert optimizer_kwargs(TrainConfig(offload=True, fused=False), host=True)["fused"]
    assert "fused" not in optimizer_kwargs(TrainConfig(offload=True, optimizer="sgd"),
                                           host=True)


def test_the_readme_names_every_zero_stage_train_offloads() -> None:
    """The README's range of ``--offload``'s ZeRO stages is the range ``train`` takes."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    said = re.search(r"step on the host \(ZeRO 0-(\d)\)", readme.replace("\n", " "))
    assert said is not None
    for zero in range(4):
        validate(TrainConfig(dp=2, zero=zero, offload=True))
    assert int(said.group(1)) == 3
