"""ZeRO stages 0-3 against single-process training, and against the paper's accounting.

Parity uses the tolerances of ``test_dp.py`` (fp32: SGD max |difference| <= 1e-5,
AdamW max <= 1e-4 and relative update difference <= 1e-4; bf16: relative update
difference <= 1e-2 with SGD, 5e-2 with AdamW). ZeRO gives a parameter that no rank used
a zero gradient (one flat shard cannot hold "None" for part of itself), so on the
edge-case model the reference does the same.

Memory and communication are compared with the analytic values of Rajbhandari et al.
2019 (arXiv 1910.02054): a rank holds 1/N of the optimizer state (and of the gradients
from stage 2, of the weights in stage 3), up to the padding of each flat buffer to a
multiple of N (fewer than N elements per buffer); stages 1-2 move what an all-reduce
moves, 2(N-1)/N of the gradient bytes, and stage 3 1.5x that.
"""

from __future__ import annotations

import pytest
import torch
from test_dp import (
    GPT_CFG,
    STEPS,
    assert_close,
    check,
    initial,
    make_model,
    optimizer_kwargs,
    references,
    run_all,
    shard_loss,
)

from minipar.comm import Comm, CommLog
from minipar.launch import launch
from minipar.mesh import Mesh
from minipar.meter import HeldPeaks
from minipar.model import GPT
from minipar.parallel.precision import MixedPrecision
from minipar.parallel.zero import Zero3, ZeroOptimizer
from minipar.parallel.zero.shards import FlatParams


def build(spec: dict, comm: Comm):
    """A fresh model, its optimizer and its gradient sync, as ``spec`` says: stages 0-2
    one ZeroOptimizer; stage 3 a Zero3 module under a plain torch optimizer."""
    model = make_model(spec["model"])
    cls, kwargs = optimizer_kwargs(spec["opt"])
    units = [model.l1, model.body] if spec["model"] == "edge" else None
    bf16 = spec["dtype"] == "bf16"
    if spec["stage"] == 3:
        sync = Zero3(model, comm, units=units, param_dtype=torch.bfloat16 if bf16 else None,
                     prefetch=spec.get("prefetch", False), average=spec.get("average", True),
                     reduce_dtype=spec.get("reduce_dtype"))
        opt = cls(sync.parameters(), **kwargs)
        sync.publish_after(opt)
        return model, opt, sync
    mp = MixedPrecision(model, torch.bfloat16) if bf16 else None
    opt = ZeroOptimizer(model, cls, stage=spec["stage"], comm=comm, precision=mp,
                        bucket_mb=spec.get("bucket_mb", 0.002),
                        average=spec.get("average", True),
                        reduce_dtype=spec.get("reduce_dtype"), **kwargs)
    return model, opt, opt


def backward_step(spec: dict, model, sync, step: int, rank: int, world: int) -> None:
    """Forward and backward of every micro-batch of this rank, in the order ``spec``
    says: "plain" (forward, backward, forward, backward; all but the last in no_sync) or
    "pipeline" (every forward first, then the backwards in reverse order, with a
    gradient sync after each backward, or only at the end)."""
    micro, name = spec.get("micro", 1), spec["model"]
    scale = 1.0 / micro if spec.get("average", True) else 1.0 / (micro * world)
    if spec.get("order", "plain") == "plain":
        for i in range(micro):
            loss = shard_loss(model, name, step, rank, world, micro, i) * scale
            if i < micro - 1:
                with sync.no_sync():
                    loss.backward()
            else:
                loss.backward()
        return
    losses = [shard_loss(model, name, step, rank, world, micro, i) * scale
              for i in range(micro)]
    for loss in reversed(losses):
        if spec["sync"] == "each":
            loss.backward()
            sync.finish_gradient_sync()
        else:
            with sync.no_sync():
                loss.backward()


def norm_share(sync, keep=lambda name: True) -> float:
    """This rank's share of the squared gradient norm (its owned elements)."""
    return sum(float(g.pow(2).sum()) for n, g in sync.grad_shards() if keep(n))


def train_zero(spec: dict) -> dict:
    log = CommLog()
    comm = Comm(log=log)
    model, opt, sync = build(spec, comm)
    peaks = HeldPeaks()
    sync.observe(peaks)
    log.clear()  # the broadcast at construction is not part of a step
    norms = []
    for step in range(spec.get("steps", STEPS)):
        backward_step(spec, model, sync, step, comm.rank, spec["world"])
        if spec.get("sync") != "each":  # (each call reduces: never one too many)
            sync.finish_gradient_sync()
        if spec.get("clip") and step == 0:
            shares = (norm_share(sync), norm_share(sync, lambda name: "blocks" in name))
        if spec.get("clip"):
            norms.append(sync.clip_grad_norm_(spec["clip"]))
        opt.step()
        if step == 0:  # one whole step, the all-gather of the new weights included
            summary = log.summary()
            memory = peaks.with_peaks(sync.memory_bytes(opt))  # the step's peaks; Adam's
            # state exists now
        sync.zero_grad()
    units = getattr(sync, "units", [])
    return {"params": sync.full_state_by_name(opt)[0], "comm": summary, "memory": memory,
            "flats": len(sync.flats), "norm": norms[0] if norms else None,
            "shares": shares if norms else None,
            "unit_modules": [len(u.modules) for u in units],
            "unit_bytes": [sum(f.padded for f in u.flats) for u in units],
            "max_flat": max(f.padded for f in sync.flats)}


def specs_for(world: int, stages=(0, 1, 2, 3)) -> list[dict]:
    return [dict(stage=stage, model=model, opt=opt, dtype="fp32", world=world)
            for stage in stages for model, opt in (("gpt", "adamw"), ("edge", "sgd"),
                                                   ("edge", "adamw"))]


# --- parity -------------------------------------------------------------------------------
def test_parity_every_stage_two_ranks():
    specs = specs_for(2)
    specs += [dict(stage=s, model="gpt", opt="adamw", dtype="bf16", world=2,
                   reduce_dtype=torch.float32) for s in (1, 3)]
    specs += [dict(stage=2, model="edge", opt="sgd", dtype="bf16", world=2)]
    check(specs, launch(run_all, 2, args=(train_zero, specs), timeout=120))


def test_parity_four_ranks_and_one():
    for world, cases in ((4, ((1, "edge", "adamw"), (2, "gpt", "sgd"), (3, "edge", "sgd"),
                              (3, "gpt", "adamw"))), (1, ((3, "edge", "adamw"),))):
        specs = [dict(stage=s, model=m, opt=o, dtype="fp32", world=world) for s, m, o in cases]
        check(specs, launch(run_all, world, args=(train_zero, specs), timeout=120))


def test_stage3_pipeline_order_prefetch_and_accumulation():
    """ZeRO-3 as a pipeline runs it: all forwards, then the backwards in another order;
    weights gathered per unit per use, a sync after each backward or once at the end."""
    specs = [dict(stage=3, model=m, opt="sgd", dtype="fp32", world=2, micro=2,
                  order="pipeline", sync=sync, prefetch=pf)
             for m, sync, pf in (("gpt", "each", True), ("gpt", "end", False),
                                 ("edge", "each", False))]
    specs += [dict(stage=s, model="gpt", opt="sgd", dtype="fp32", world=2, micro=2,
                   average=False) for s in (1, 2)]
    results = launch(run_all, 2, args=(train_zero, specs), timeout=120)
    check(specs, results)
    for res, syncs in zip(results[0][:2], (2, 1)):
        # Per micro-batch a unit is gathered in the forward of each module that uses it
        # (the tied embedding: twice) and once for the backward; prefetching adds none.
        # One reduce-scatter per flat buffer per sync.
        per_micro = sum(res["unit_modules"]) + len(res["unit_modules"])
        assert res["comm"]["world"]["all_gather"]["calls"] == 2 * per_micro
        assert res["comm"]["world"]["reduce_scatter"]["calls"] == syncs * res["flats"]


def test_clipping_by_the_global_norm():
    specs = [dict(stage=s, model="gpt", opt="sgd", dtype="fp32", world=2, clip=0.05)
             for s in (0, 2, 3)]
    results = launch(run_all, 2, args=(train_zero, specs), timeout=120)
    norm, blocks = launch(_first_norms, 1, args=(None,), timeout=60)[0]
    for i in range(len(specs)):
        assert results[0][i]["norm"] == pytest.approx(norm, rel=1e-5)
        # grad_norm_sq: each rank's share; summed over dp, every element counted once
        shares = [r[i]["shares"] for r in results]
        assert sum(s[0] for s in shares) == pytest.approx(norm**2, rel=1e-5)
        assert sum(s[1] for s in shares) == pytest.approx(blocks, rel=1e-5)
    key = ("gpt", "sgd", "fp32", 2, False, 0.05)
    refs = references([key])[key]
    for spec, res in zip(specs, results[0]):
        assert_close(res["params"], refs, initial("gpt"), "sgd", "fp32", str(spec))


def _first_norms(_: None) -> tuple[float, float]:
    """The reference's first gradient norm, and the squared norm of its blocks' part."""
    model = make_model("gpt")
    (sum(shard_loss(model, "gpt", 0, r, 2) for r in range(2)) / 2).backward()
    blocks = sum(float(p.grad.pow(2).sum()) for n, p in model.named_parameters()
                 if "blocks" in n)
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)), blocks


# --- memory and communication against the paper -------------------------------------------
def test_memory_and_communication_match_theory():
    """Memory at its peak within a step, against the paper's 1/N shares. Gradients are
    accumulated and reduced in fp32 (4 bytes) whatever the weights' width w: stages 0-1
    hold the full fp32 gradient, stage 2 its fp32 shard plus the few buckets in flight,
    stage 3 the shards plus the units in flight (each gathered and freed in turn)."""
    world = 4
    specs = [dict(stage=s, model=m, opt="adamw", dtype=d, world=world)
             for s in (0, 1, 2, 3) for m, d in (("gpt", "fp32"), ("gpt", "bf16"),
                                                ("edge", "fp32"))]
    results = launch(run_all, world, args=(train_zero, specs), timeout=120)[0]
    wire, held = {}, {}
    for spec, res in zip(specs, results):
        s, n, mem = spec["stage"], world, res["memory"]
        model = make_model(spec["model"])
        psi = sum(p.numel() for p in model.parameters() if p.requires_grad)  # tied: once
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        w = 2 if spec["dtype"] == "bf16" else 4
        pad = res["flats"] * (n - 1)  # at most n-1 padding elements per flat buffer
        shard = psi if s == 0 else psi / n
        held[spec["model"], spec["dtype"], s] = mem
        # the fp32 master is separate unless it *is* the weights (fp32: its slot of them)
        master = 0 if w == 4 else 4 * shard
        assert 8 * shard + master <= mem["optimizer"] <= 8 * shard + master + pad * 12, spec
        flight = 3 * 4 * res["max_flat"]  # buckets/units being reduced at once
        if s <= 1:
            assert psi * 4 <= mem["grads"] <= psi * 4 + 4 * shard * (s == 1) + pad * 8, spec
        else:
            assert 4 * shard <= mem["grads"] <= 4 * shard + flight + pad * 8, spec
        if s < 3:
            assert mem["params"] == (psi + frozen) * w + (pad * w if s else 0) or \
                psi * w <= mem["params"] <= (psi + frozen + pad) * w, spec
        else:  # its shard, the frozen layer, and at most a few units gathered at once
            assert shard * w + frozen * w <= mem["params"] <= \
                shard * w + frozen * w + 3 * w * res["max_flat"] + pad * w, spec
        ops = res["comm"]["world"]
        wire[spec["model"], spec["dtype"], s] = sum(o["wire_bytes"] for o in ops.values())
        if s == 0:
            assert ops["all_reduce"]["bytes"] == psi * 4
        elif s < 3:  # fp32 gradients reduce-scattered, the new weights all-gathered
            assert psi * 4 <= ops["reduce_scatter"]["bytes"] <= (psi + pad) * 4
            assert ops["all_gather"]["bytes"] == ops["reduce_scatter"]["bytes"] * w // 4
        else:  # each unit gathered for the forward of every module using it, and again for
            # the backward (the tied embedding of the GPT: 3 times, the rest twice)
            assert ops["reduce_scatter"]["bytes"] == 4 * sum(res["unit_bytes"])
            assert ops["all_gather"]["bytes"] == w * sum(
                (m + 1) * b for m, b in zip(res["unit_modules"], res["unit_bytes"]))
    for (m, d, s), value in wire.items():
        w = 2 if d == "bf16" else 4
        psi = sum(p.numel() for p in make_model(m).parameters() if p.requires_grad)
        assert wire[m, d, 0] == pytest.approx(2 * (world - 1) / world * psi * 4, abs=100)
        if 0 < s < 3:  # a reduce-scatter (fp32) and an all-gather (w): what an all-reduce
            # of fp32 gradients moves when w = 4
            assert value == pytest.approx((world - 1) / world * psi * (4 + w), rel=0.02)
        elif s == 3 and m == "gpt":  # weights twice (+ the tied embedding), gradients once
            assert value == pytest.approx((world - 1) / world * psi * (4 + 2 * w), rel=0.05)
    for m, d in (("gpt", "fp32"), ("gpt", "bf16")):  # each stage holds less than the last
        total = [sum(held[m, d, s].values()) for s in (0, 1, 2, 3)]
        # (a toy of two blocks, each half the model: ZeRO-3 gathers a block at a time, so
        # it beats ZeRO-2 only on deeper models: tests/test_engine.py measures that)
        assert total[0] > total[1] > total[2] and total[3] < total[1], (m, d, total)


# --- checkpoints: save shards, reassemble, load elsewhere ------------------------------------
def save_and_resume(spec: dict, full: dict | None) -> dict:
    """Either train 2 steps and return this rank's shard (after checking a same-layout
    reload), or load ``full`` into a fresh optimizer and train the third step."""
    comm = Comm()
    model, opt, sync = build(spec, comm)
    if full is None:
        for step in range(2):
            backward_step(spec, model, sync, step, comm.rank, spec["world"])
            opt.step()
            sync.zero_grad()
        sd = opt.state_dict()
        model2, opt2, sync2 = build(spec, comm)
        opt2.load_state_dict(sd)
        weights, states = opt.full_state_by_name()
    else:
        sync.load_full_state_by_name(full["state"], full["params"], opt)
        model2, opt2, sync2, sd, weights, states = model, opt, sync, None, None, None
    backward_step(spec, model2, sync2, 2, comm.rank, spec["world"])
    opt2.step()
    sync2.zero_grad()
    return {"params": sync2.full_state_by_name(opt2)[0], "shard": sd, "weights": weights,
            "states": states}


def test_sharded_state_dict_reshards_to_another_layout():
    save = dict(stage=2, model="gpt", opt="adamw", dtype="fp32", world=2, bucket_mb=0.005)
    saved = launch(save_and_resume, 2, args=(save, None), timeout=120)
    key = ("gpt", "adamw", "fp32", 2)
    ref = references([key])[key]
    assert_close(saved[0]["params"], ref, initial("gpt"), "adamw", "fp32", "reload")
    assert all(torch.equal(t, saved[1]["weights"][n]) for n, t in saved[0]["weights"].items())
    full = {"params": saved[0]["weights"], "state": saved[0]["states"]}
    load = dict(save, stage=3, world=4)  # the same global batch, cut in four
    resumed = launch(save_and_resume, 4, args=(load, full), timeout=120)
    for r in resumed:
        assert_close(r["params"], ref, initial("gpt"), "adamw", "fp32", "resharded")


# --- composition ----------------------------------------------------------------------------
def _different_start(stage: int) -> dict[str, torch.Tensor]:
    comm = Comm()
    model = GPT(GPT_CFG, seed=comm.rank)  # every rank starts from other weights
    if stage == 3:
        return Zero3(model, comm, param_dtype=torch.bfloat16).full_parameters()
    mp = MixedPrecision(model, torch.bfloat16)
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=stage, comm=comm, precision=mp, lr=0.1)
    return opt.full_parameters()


def test_masters_broadcast_from_rank_zero():
    rank0 = dict(GPT(GPT_CFG, seed=0).named_parameters())
    for stage in (1, 3):
        for result in launch(_different_start, 2, args=(stage,), timeout=60):
            assert all(torch.equal(result[n], rank0[n]) for n in result)  # the fp32 values


def tp_style_sum(spec: dict) -> dict:
    """all_reduce_grads over another group: ZeRO on a dp group of one, gradients summed
    over the 'tp' group afterwards, equals data parallelism over both ranks."""
    rm = Mesh(dp=1, tp=2).connect()
    model, opt, sync = build(spec, rm.dp)
    for step in range(STEPS):
        (shard_loss(model, "gpt", step, rm.tp.rank, 2) / 2).backward()
        sync.finish_gradient_sync()
        sync.all_reduce_grads([n for n, _ in sync.grad_shards()], rm.tp)
        opt.step()
        sync.zero_grad()
    return {"params": sync.full_state_by_name(opt)[0]}


def test_all_reduce_grads_over_another_group():
    spec = dict(stage=1, model="gpt", opt="sgd", dtype="fp32", world=2)
    results = launch(tp_style_sum, 2, args=(spec,), timeout=60)
    key = ("gpt", "sgd", "fp32", 2)
    ref = references([key])[key]
    for r in results:
        assert_close(r["params"], ref, initial("gpt"), "sgd", "fp32", "tp-style sum")


# --- the full cross product (run with --full) -----------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_full_matrix(world):
    specs = [dict(stage=stage, model=model, opt=opt, dtype=dtype, world=world,
                  prefetch=stage == 3 and opt == "sgd")
             for stage in (0, 1, 2, 3) for model in ("gpt", "edge")
             for opt in ("adamw", "sgd") for dtype in ("fp32", "bf16")]
    check(specs, launch(run_all, world, args=(train_zero, specs), timeout=300))


# --- the gradient-memory accounting's own cost ------------------------------------------------
def held_bytes_checked(specs: list[dict]) -> list[dict]:
    """Train a few steps; at every report the observer's running total must equal a
    recount of every flat's buffers, while reports read only the changed flat's."""
    class Checked(HeldPeaks):
        def __init__(self, sync) -> None:
            super().__init__()
            self.sync, self.reads = sync, 0

        def held(self, kind, key, tensors, peak=True) -> None:
            tensors = list(tensors)
            self.reads += len(tensors)
            super().held(kind, key, tensors, peak)
            if peak:  # (zero_grad's recount is only complete at its end)
                assert self._held[kind].total == self.sync.memory_bytes()["grads"]

    out = []
    for spec in specs:
        comm = Comm()
        model, opt, sync = build(spec, comm)
        checked = Checked(sync)
        sync.observe(checked)
        reads = []
        for step in range(3):
            checked.reads = 0
            backward_step(spec, model, sync, step, comm.rank, spec["world"])
            sync.finish_gradient_sync()
            opt.step()
            peak = checked.peak["grads"]
            sync.zero_grad()
            reads.append(checked.reads)
        out.append({"flats": len(sync.flats), "reads": reads, "peak": peak})
    return out


def test_held_gradient_bytes_are_counted_one_flat_at_a_time():
    """A bucket's gradient buffers change -> only that bucket is recounted: O(flats) a
    step, not O(flats^2) (gpt-1.3b tp2 sp has ~220 flats: ~50 ms of Python a step on the
    H100 hosts). The running total equals a full recount at every report."""
    specs = [dict(stage=s, model=m, opt="adamw", dtype=d, world=2, bucket_mb=0, micro=mb)
             for s in (0, 1, 2) for m, d, mb in (("gpt", "fp32", 1), ("gpt", "bf16", 2),
                                                 ("edge", "fp32", 1))]
    for spec, res in zip(specs, launch(held_bytes_checked, 2, args=(specs,), timeout=120)[0]):
        assert res["flats"] >= 7 and res["peak"] > 0, spec
        # each flat: reported on its first gradient and once reduced (2 tensors each),
        # then recounted once in zero_grad: at most 6 tensors per flat and step
        assert max(res["reads"]) <= 6 * res["flats"], (spec, res)


def _first_arrival_copies() -> dict:
    """Three accumulated bf16 backwards into ZeRO's fp32 buffers (1 rank, stage 1, two
    steps): which arrivals found their slot unwritten, and the gradients against fp32
    sums."""
    firsts, slot = [], FlatParams._slot

    def recorded(self, k, dtype, device):
        out = slot(self, k, dtype, device)
        firsts.append(out[2])
        return out

    FlatParams._slot = recorded
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).bfloat16()
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=1, comm=Comm(), lr=0.1,
                        grad_dtype=torch.float32)
    out = {"firsts": [], "equal": []}
    for step in range(2):
        firsts.clear()
        want = {n: torch.zeros(p.shape) for n, p in model.named_parameters()}
        for i in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + i))
            grads = torch.autograd.grad(model(x.bfloat16()).sum(), list(model.parameters()))
            for (n, _), g in zip(model.named_parameters(), grads):
                want[n] += g.float()
            with opt.no_sync():
                model(x.bfloat16()).sum().backward()
        opt.finish_gradient_sync()
        out["firsts"].append(list(firsts))
        out["equal"].append(all(torch.equal(g.view(want[n].shape), want[n])
                                for n, g in opt.grad_shards()))
        opt.step()
        opt.zero_grad()
    FlatParams._slot = slot
    return out


def test_a_first_arrival_is_copied_into_the_buffer_bit_for_bit():
    """The first gradient of a parameter in a step is copied into its slot, not added
    to zeros (no fill, no fp32 read); later ones add. Every step (stage 1 keeps its
    buffer: restarted, not zeroed), and the sums are exactly the fp32 sums of the bf16
    gradients."""
    out = launch(_first_arrival_copies, 1, timeout=60)[0]
    assert out["firsts"] == [[True] * 4 + [False] * 8] * 2  # 4 parameters, 3 backwards
    assert out["equal"] == [True, True]


def _poisoned_buffers(specs: list[dict], skip_zeroing: bool) -> list[dict]:
    """``train_zero`` with every new gradient buffer made of NaN instead of whatever
    the allocator held: a slot read before its first gradient wrote it (an add, a GEMM
    with beta 1), padding sent unzeroed or an unused weight's slot left unfilled turns
    the run's weights into NaN. ``skip_zeroing``: the mutation, ``reduced_grad`` leaves
    the unwritten slots as they are."""
    slot, reduced = FlatParams._slot, FlatParams.reduced_grad

    def poisoned_slot(self, k, dtype, device):
        empty = torch.empty
        torch.empty = lambda *a, **kw: empty(*a, **kw).fill_(float("nan"))
        try:
            return slot(self, k, dtype, device)
        finally:
            torch.empty = empty

    def unzeroed(self, dtype, device):
        self._unwritten.clear()
        return reduced(self, dtype, device)

    FlatParams._slot = poisoned_slot
    if skip_zeroing:
        FlatParams.reduced_grad = unzeroed
    return run_all(train_zero, specs)


POISON_SPECS = [dict(stage=s, model=m, opt="sgd", dtype=d, world=2, micro=mb)
                for s in (0, 1, 2, 3) for m, d, mb in (("edge", "fp32", 2),
                                                       ("gpt", "bf16", 2))]


def test_gradient_buffers_are_written_before_they_are_read():
    """A gradient buffer is made unfilled: each slot is written by its parameter's first
    gradient (a copy, a GEMM with beta 0), the padding and the slots of weights no
    gradient reached (the edge model's unused ones) are zeroed before the reduction.
    Poisoned with NaN, every stage still trains to the reference (tolerances of
    ``test_dp.py``, plain SGD, no clipping), two micro-batches accumulated."""
    check(POISON_SPECS, launch(_poisoned_buffers, 2, args=(POISON_SPECS, False), timeout=120))


def test_the_padding_goes_out_as_zeros(monkeypatch):
    """Five weights in two shards of three: the sixth element is padding, which no
    gradient writes and the reduce-scatter sends; a new buffer made of NaN sends it as
    zero, and the unused second weight's slot too."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))]
    f = FlatParams(params, ["a", "b"], 0, [p.detach() for p in params], 0, 2, torch.float32)
    f.add_grad(0, torch.ones(3), torch.float32)
    assert torch.equal(f.reduced_grad(torch.float32, torch.device("cpu")),
                       torch.tensor([1.0, 1, 1, 0, 0, 0]))


def test_an_unzeroed_unused_slot_fails_the_poisoned_check():
    """Mutation: the unwritten slots sent as they were made (NaN here, stale bytes on a
    GPU). The edge model's unused weights carry it into every stage's result."""
    specs = [s for s in POISON_SPECS if s["model"] == "edge"]
    results = launch(_poisoned_buffers, 2, args=(specs, True), timeout=120)
    for spec, res in zip(specs, results[0]):
        assert any(torch.isnan(v).any() for v in res["params"].values()), spec
