"""A rehearsal holds what the real rank holds: ``engine.rehearse`` against ``train``.

A rehearsed rank runs alone, its peers imagined (torch's "fake" process group). What it
is for is memory and compute on the machine a layout is meant for, tried on one device;
so what it holds must be what the same rank holds in the real job. Each case below runs
the layout for real (every rank, gloo) and rehearses its ranks one at a time, then
compares, rank by rank: the model states' bytes (params, gradients, optimizer), the
activations the meter saw at their peak, the pipeline's micro-batches in flight, the
bytes every collective would have put on the wire, and the actions of the step. They are
equal, to the byte: a rehearsal runs the same code on the same shapes, only the wire is
missing. The mutation case tells a middle stage the wrong boundary and the comparison
catches it. Below those, what rehearsals on one H100 measured: the same rank's peaks as
on four H100s, and the planner's top layouts against the memory model; last, the memory
model against what rehearsed ranks allocate on the CPU, gpt-13b's shape scaled down.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minipar.__main__ import build_parser, train_config
from minipar.config import TrainConfig
from minipar.engine import rehearse, stage_ranks, train
from minipar.meter import cpu_allocations
from minipar.step import stage_boundary
from minipar.theory import memory as theory_memory
from minipar.theory.card import REHEARSED_RUNTIME_BYTES, card_peak, runtime_bytes
from minipar.theory.clusters import cluster
from minipar.theory.planner import evaluate, plan, stage_compute

LAYOUTS = {
    "dp2-zero3": dict(dp=2, zero=3),
    "pp2-zb": dict(pp=2, schedule="zb", microbatches=4),
    "pp2-tp2-sp-interleaved": dict(pp=2, tp=2, sp=True, schedule="interleaved", virtual=2,
                                   microbatches=2, layers=4),
    "cp2-zero1": dict(cp=2, dp=2, zero=1, batch_size=8),
}


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(steps=2, measure_activations=True, **kw)


def _held(r: dict) -> dict:
    """What a rank held and moved: equal between a rehearsal and the real job."""
    return {"coords": r["coords"], "memory": r["memory"],
            "peak_in_flight": r["peak_in_flight"],
            "comm_bytes_per_step": r["comm_bytes_per_step"],
            "actions": [(e["kind"], e["mb"], e["chunk"]) for e in r["timeline"]]}


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_rehearsed_rank_holds_what_the_real_rank_holds(name):
    cfg = _cfg(**LAYOUTS[name])
    real = {r["rank"]: r for r in train(cfg)["ranks"]}
    ranks = sorted({0, cfg.world_size - 1, *stage_ranks(cfg)})
    record = rehearse(cfg, ranks)
    assert [r["rank"] for r in record["ranks"]] == ranks
    for r in record["ranks"]:
        assert _held(r) == _held(real[r["rank"]]), f"rank {r['rank']}"
        assert r["memory"]["activations"] > 0
        assert r["predicted"]["live"] > 0 and r["runtime_bytes"] == 0  # (the CPU)


def test_the_default_ranks_are_the_first_of_each_stage():
    cfg = _cfg(dp=2, pp=2, tp=2, microbatches=2)
    assert stage_ranks(cfg) == [0, 4]  # megatron order: tp fastest, then dp, then pp
    record = rehearse(cfg)
    assert [r["coords"]["pp"] for r in record["ranks"]] == [0, 1]
    assert all(r["coords"]["dp"] == r["coords"]["tp"] == 0 for r in record["ranks"])


def test_a_wrong_boundary_is_caught(monkeypatch):
    """Mutation: a middle stage told that twice the micro-batch arrives. It runs (no
    loss there to refuse the shape), and its activations differ from the real rank's.
    (Told the wrong width or dtype instead, the stage's first layer refuses to run.)"""
    cfg = _cfg(pp=3, microbatches=2, layers=3)
    real = train(cfg)["ranks"][1]
    assert _held(rehearse(cfg, [1])["ranks"][0]) == _held(real)

    def doubled(cfg, mcfg):
        told = stage_boundary(cfg, mcfg)
        return lambda key: told((2 * key[0], *key[1:]))

    monkeypatch.setattr("minipar.step.stage_boundary", doubled)
    wrong = rehearse(cfg, [1])["ranks"][0]
    assert wrong["memory"]["activations"] > real["memory"]["activations"]
    assert _held(wrong) != _held(real)


@pytest.mark.parametrize("argv, says", [
    (["--dp", "2", "--ranks", "2"], "has ranks 0 to 1, got 2"),
    (["--dp", "2", "--ranks", "0,x"], "--ranks must be comma-separated integers"),
    (["--save", "somewhere"], "a rehearsal writes no checkpoint"),
    (["--memory-snapshot", "mem"], "--memory-snapshot records the CUDA caching allocator"),
])
def test_bad_input_is_one_line(argv, says, tmp_path):
    out = subprocess.run([sys.executable, "-m", "minipar", "rehearse", *argv],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_the_command_prints_each_rank_against_the_model(tmp_path):
    out = subprocess.run([sys.executable, "-m", "minipar", "rehearse", "--pp", "2",
                          "--microbatches", "2", "--steps", "2", "--json",
                          str(tmp_path / "r.json"), "--trace", str(tmp_path / "t.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}  # a lane for each rehearsed rank
    lines = out.stdout.splitlines()
    assert "2 ranks: each rank below ran alone on the CPU" in lines[0]
    rows = [line.split() for line in lines if line.split()[:1] in (["0"], ["1"])]
    assert [row[:5] for row in rows] == [["0", "0", "0", "0", "0"], ["1", "0", "1", "0", "0"]]
    record = json.loads((tmp_path / "r.json").read_text())
    for row, r in zip(rows, record["ranks"]):  # live MiB: the model's, then the measured
        assert float(row[6]) == round(r["cpu_peak_allocated"] / 2**20, 2), (row, r)
        assert r["cpu_peak_allocated"] > r["memory"]["total"]  # states, activations and more


def test_the_profiler_runs_one_rehearsed_rank(tmp_path):
    """``benchmarks/profile_train.py --rehearse R``: rank R of a layout alone in one
    process, its peers imagined, under torch's profiler; its record keeps each step's
    seconds and the share its peers' stand-ins took (``minipar.comm``)."""
    out = subprocess.run([sys.executable, "benchmarks/profile_train.py", "--rehearse", "1",
                          "--out", str(tmp_path / "p.json"), "--", "--dp", "2", "--zero",
                          "3", "--steps", "4"], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    record = json.loads((tmp_path / "p-rank1.json").read_text())
    assert record["rank"] == 1 and len(record["step_seconds"]) == 4
    assert all(0 < w < s for w, s in zip(record["stand_in_seconds"], record["step_seconds"]))


def test_the_cpu_allocations_are_counted_to_the_byte():
    """``meter.cpu_allocations``: the most bytes allocated at once inside the block (what
    ``rehearse`` reports as a CPU rank's measured live peak)."""
    with cpu_allocations() as found:
        a = torch.empty(1_000_000, dtype=torch.uint8)
        b = torch.empty(2_000_000, dtype=torch.uint8)
        del a
        c = torch.empty(500_000, dtype=torch.uint8)
        del b, c
    assert found["peak_allocated"] == 3_000_000


def test_a_rank_out_of_memory_is_a_result_not_a_failure(monkeypatch, capsys):
    """On a GPU a rehearsal is how one learns that a rank does not fit: the allocator's
    error becomes the rank's record (its first line), the other ranks still run, and the
    command prints it as a finding (exit 0). Here the step raises torch's own error."""
    import torch

    import minipar.engine as engine
    from minipar.__main__ import main

    def short_of_memory(cfg):
        if torch.distributed.get_rank() == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\n"
                                         "(GPU 0; 79.19 GiB total capacity)")
        return real_rank_main(cfg)

    real_rank_main = engine.rank_main
    monkeypatch.setattr(engine, "rank_main", short_of_memory)
    record = rehearse(_cfg(pp=2, microbatches=2))
    first, second = record["ranks"]
    assert "out_of_memory" not in first and len(first["step_seconds"]) == 2
    assert second["out_of_memory"] == "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert second["coords"]["pp"] == 1 and second["predicted"]["live"] > 0
    assert main(["rehearse", "--pp", "2", "--microbatches", "2", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank 1 ran out of memory: CUDA out of memory. Tried to allocate 2.00 GiB" in out


# --- on one H100 (benchmarks/card_memory.py --rehearse, 2026-12-05 r1, r2, r4) ----------
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
KERNEL_AND_COMPILE = ("--fused", "--no-fused", "--compile", "--no-compile")
STAND_INS = "rehearsal-stand-ins-1xH100-2026-12-06t1-t5.json"  # (calls t1-t5)


def _rows(name: str) -> list[dict]:
    return json.loads((RESULTS / name).read_text())["rows"]


def _flags(row: dict) -> tuple:
    return tuple(f for f in row["command"].split()[4:-2] if f not in KERNEL_AND_COMPILE)


def _layout(row: dict):
    cfg = train_config(build_parser().parse_args(["train", *row["command"].split()[4:-2]]))
    return cfg.model_config(), cfg.layout("cuda")


@pytest.mark.parametrize("rehearsed, ran", [
    ("rehearsal-1xH100-2026-12-05r1-rerun-h7-planner.json",
     "card-memory-4xH100-2026-11-27h7-planner.json"),
    ("rehearsal-1xH100-2026-12-05r4-rerun-h2-covering.json",
     "card-memory-4xH100-2026-11-27h2-covering.json")])
def test_on_one_h100_a_rehearsed_rank_held_what_it_held_among_four(rehearsed, ran):
    """Rows that ran on 4 x H100 80GB (2026-11-27 h7: the planner's picks then, dp with
    ZeRO-3, pp 2 interleaved and zb; h2: ZeRO-0, tp 4 with and without sp, cp 2),
    rehearsed on one H100 with the same command, kernel and compilation: 17 ranks. Their
    peak allocated bytes are the four-GPU rank's within 0.5% (measured -0.48% .. +0.01%:
    pp 2's last stage 48.32 GiB against 48.52), the allocator's peak reserve within 3%
    (-0.8% .. +2.7%, cp 2's the largest); what the real rank held outside the allocator
    beyond what the rehearsed one did, NCCL's buffers for its peers, is
    ``theory.card.runtime_bytes`` less ``REHEARSED_RUNTIME_BYTES`` within 0.5 GiB (data
    and tensor parallel 1.96, pp 2 3.17-3.19, cp 2 2.41 against 1.95 and 3.25)."""
    real = {_flags(r): r for r in _rows(ran) if r.get("status") == "ok"}
    seen = 0
    for row in _rows(rehearsed):
        assert row["status"] == "ok" and row["rehearsed"], row["label"]
        model, layout = _layout(row)
        peers = runtime_bytes(layout) - REHEARSED_RUNTIME_BYTES
        for rank in row["ranks"]:
            [twin] = [r for r in real[_flags(row)]["ranks"] if r["coords"] == rank["coords"]]
            alone, among = rank["device_memory"], twin["device_memory"]
            assert abs(alone["peak_allocated"] / among["peak_allocated"] - 1) < 0.005
            assert abs(alone["peak_reserved"] / among["peak_reserved"] - 1) < 0.03
            nccl = ((among["process_used"] - among["peak_reserved"])
                    - (alone["process_used"] - alone["peak_reserved"]))
            assert abs(nccl - peers) < 0.5 * 2**30, (row["label"], nccl / 2**30)
            seen += 1
    assert seen >= 4


def test_the_planners_top_5_rehearsed_on_one_h100():
    """The planner's top 5 on 4 x H100 for gpt-1.3b, gpt-6.7b and gpt-13b under the CUDA
    defaults (preset cluster, and the calibrated one's that differ: 17 layouts, each
    pipeline stage's first rank, 3 steps), rehearsed on one H100 (r2). Against each
    rank's measured peaks the memory model predicts live bytes within -5.3% .. +2.4%
    (bounds: -6% .. +3%) and the allocator's reserve within -4.8% .. +6.5% (-6% .. +7%);
    each fits the card with NCCL's buffers added (the largest, gpt-6.7b pp 2 dp 2 ZeRO-1
    zb: 72.62 GiB reserved + 4.0 = 76.6 of 79.2).

    One did not fit: gpt-13b tp 2 dp 2 ZeRO-2 sp, 30 of 40 blocks recomputed (the
    calibrated cluster's fourth): out of memory at 72.05 GiB allocated asking 602 MiB
    more (a block's fp32 gradient bucket), where the model says 67.55 GiB live. The
    model misses at least 7% there and the cause is not found yet (its ZeRO-3 twin, the
    preset's fourth, is predicted within 1.3%); this test holds the record as it is, so
    that the day the model predicts it the miss is seen."""
    rows = [r for r in _rows("rehearsal-1xH100-2026-12-05r2-planner.json")
            if r["status"] in ("ok", "oom")]
    assert len(rows) == 17 and {r["model"] for r in rows} == {"gpt-1.3b", "gpt-6.7b",
                                                                "gpt-13b"}
    ooms = [r["label"] for r in rows if r["status"] == "oom"]
    assert ooms == ["tp=2 pp=1 dp=2 zero=2 b=8 m=1 sp recompute=full recompute-layers=30"]
    for row in rows:
        model, layout = _layout(row)
        if layout.schedule == "zb":  # its split backward then held every module's output:
            continue                 # the next test's record measures the engine as it is
        for rank in row["ranks"]:
            predicted = card_peak(model, layout, stage=rank["coords"]["pp"])
            held = rank["device_memory"]
            if row["status"] == "oom":  # the model is short by more than the bounds
                assert predicted["total"] < 0.94 * held["peak_allocated"]
                continue
            live = predicted["total"] / held["peak_allocated"] - 1
            reserve = predicted["reserved"] / held["peak_reserved"] - 1
            assert -0.06 < live < 0.03 and -0.06 < reserve < 0.07, (row["label"], live)
            need = held["peak_reserved"] + runtime_bytes(layout)
            assert need < held["capacity"], row["label"]


def test_the_planners_13b_picks_and_zero_bubble_rehearsed_on_one_h100():
    """Rehearsed on one H100 (2026-12-06, torch 2.11): the planner's gpt-13b top 5 (preset
    and calibrated, r1) all fit now, the ZeRO-2 sp layout that ran out of memory among
    them (74.7 GiB reserved + 2.7 of NCCL's = 77.4 of 79.2); live within -1.3% .. +2.1%.
    ZB-H1 (r2), its split backward keeping graph nodes, not module outputs: gpt-6.7b pp 2
    dp 2 stage 0 holds 60.39 GiB (65.92 before), the model -0.4% / +3.6% on its two
    stages; gpt-1.3b pp 4 within -1.9% .. +3.7%; with cheap recomputation +0.3% and
    +3.0% (it was short by 4.8% and 6.4% while the model let the recipes free the inputs
    that each module's graph holds till W). Float8 ZeRO-3 (r3), its rescale no longer
    chaining graphs: gpt-1.3b 28.13 GiB at 3 steps and at 5 (it grew by 0.55 GiB a step),
    the model -0.2%; gpt-13b with full recomputation +2.2%. Interleaved balanced for the
    head (t4: gpt-6.7b pp 2 dp 2 ZeRO-2 v 2, head layers 1), -2.0% and +0.8%."""
    planner = [r for r in _rows("rehearsal-1xH100-2026-12-06r1-planner.json")
               if r.get("status") in ("ok", "oom")]
    assert len(planner) == 12 and all(r["status"] == "ok" for r in planner)
    zb = json.loads((RESULTS / "rehearsal-1xH100-2026-12-06r2-zb.json").read_text())["rows"]
    runs = [(r, (-0.03, 0.03)) for r in planner if r["model"] == "gpt-13b"] + [
        (zb[name], (-0.03, 0.05)) for name in ("zb67_z1", "zb67_z2", "zb13_pp4",
                                                "zb67_cheap")]
    fp8 = json.loads((RESULTS / "rehearsal-1xH100-2026-12-06r3-fp8.json").read_text())["rows"]
    runs += [(fp8[name], (-0.03, 0.03)) for name in ("fp8z3_s3", "fp8z3_s5", "fp8z3_13b")]
    stand_ins = json.loads((RESULTS / STAND_INS).read_text())
    runs += [(stand_ins["gpt-6.7b interleaved head-layers 1 (t4)"], (-0.03, 0.03))]
    held = [fp8[n]["ranks"][0]["device_memory"]["peak_allocated"] for n in ("fp8z3_s3",
                                                                            "fp8z3_s5")]
    assert held[1] == held[0]  # nothing grows from step to step
    for row, (low, high) in runs:
        model, layout = _layout(row) if "command" in row else _config_layout(row)
        for rank in row["ranks"]:
            held = rank["device_memory"]
            live = card_peak(model, layout, stage=rank["coords"]["pp"])["total"]
            assert low < live / held["peak_allocated"] - 1 < high, (layout.label(), rank)
            assert held["peak_reserved"] + runtime_bytes(layout) < held["capacity"]


def test_rehearsed_compute_answers_to_the_step_model_once_peers_send_values():
    """On one H100 (2026-12-06, calls t1-t5), a bf16 product of gpt-13b's MLP shape took
    2.43-2.45 ms on N(0, 1) values and 2.08-2.12 on zeros or mostly-zero operands
    (``benchmarks/gemm_values.py``): 17% faster. A rehearsal whose imagined peers left
    zeros in the gathered weights read gpt-13b's first pick (ZeRO-3, 22 of 40 blocks
    recomputed) at 1.121 s of compute, 60% MFU; with stand-ins (``minipar.comm``) it
    computes in 1.330 s, and the step model's compute and update (1.384 s) are within
    +2.0% .. +4.5% of every gpt-13b pick, within 6% of gpt-1.3b's dp 4 picks.

    Pipelines: each stage's compute (``planner.stage_compute``: its chunks over the
    micro-batches and its optimizer step) against gpt-1.3b pp 4's rehearsed stages, 32 x
    2048 in micro-batches of 2 (or 4): the model reads high by 5.9% .. 8.9% on every stage
    of every schedule, with and without the head balanced (``--head-layers 2``), so it ranks
    the stages as they ran: within one layout the errors spread by 1.9 points at most. The
    head costs its 2 layers' worth: the slowest stage falls from 0.377 s (the last, its 6
    blocks and the head) to 0.307 (zb, micro-batches of 4) .. 0.326 s. One run, t4's zb m 16
    with the head balanced, read 20-35% slow on stages 0-2 at steady steps; its rerun (t5)
    did not, and this pins the rerun."""
    record = json.loads((RESULTS / STAND_INS).read_text())
    products = {}
    for row in record["gemm_values_t4"]["rows"]:
        products.setdefault(row["case"], []).append(row["ms"])
    for case in ("zeros", "weights 3/4 zero", "inputs zero"):
        assert max(products[case]) * 1.12 < min(products["N(0, 1)"]), case
    h100 = cluster(4, "H100-80GB")
    for row in _rows("rehearsal-1xH100-2026-12-06t4-planner.json"):
        model, layout = _layout(row)
        computed = stage_compute(model, h100, layout)
        est = evaluate(model, h100, layout)  # the same compute the planner's step counts
        assert computed == pytest.approx(est.time["compute"] + est.time["update"])
        low, high = (0.01, 0.06) if row["model"] == "gpt-13b" else (-0.07, 0.07)
        assert low < computed / row["ranks"][0]["compute_seconds"] - 1 < high, row["label"]
    stages = {k: v for k, v in record["pp4_stage_compute"].items() if "(t4)" not in k
              or "m16" not in k or "interleaved" in k}
    assert len(stages) == 7
    for name, row in stages.items():
        cfg = TrainConfig(model="gpt-1.3b", pp=4, dtype="bf16", backend="nccl",
                          **row["config"])
        model, layout = cfg.model_config(), cfg.layout("cuda")
        errors = [stage_compute(model, h100, layout, rank["rank"]) / rank["compute_seconds"]
                  - 1 for rank in row["ranks"]]
        assert all(0.05 < e < 0.095 for e in errors), (name, errors)
        assert max(errors) - min(errors) < 0.03, (name, errors)
        slowest = max(rank["compute_seconds"] for rank in row["ranks"])
        assert (slowest > 0.37) == (layout.head_layers == 0), (name, slowest)


def _config_layout(record: dict):
    """A ``rehearse --json`` record's model and layout (as the planner states it)."""
    cfg = TrainConfig(**record["config"])
    return cfg.model_config(), cfg.layout("cuda")


# gpt-13b's shape at 1/32 of its width, sequence and vocabulary (8 blocks): activations
# over weights (batch x sequence / width) and logits over weights as at 1/16, which ran
# each bf16 rank's step in about 26 s on a CPU without bf16 instructions (AVX2: torch's
# bf16 products there are 50x slower than fp32); at 1/32 about 1 s, the errors the same
SCALED_13B = dict(model="gpt-13b", layers=8, hidden=160, heads=8, seq_len=64, vocab=1600,
                  batch_size=16, steps=2, dtype="bf16")
SCALED_LAYOUTS = {
    "dp4-zero3-full": dict(dp=4, zero=3, recompute="full"),
    "dp4-zero3-m2": dict(dp=4, zero=3, microbatches=2),
    "tp2-sp-dp2-zero2": dict(dp=2, tp=2, sp=True, zero=2),
    "pp2-dp2-zero1": dict(pp=2, dp=2, zero=1, microbatches=4),
    "pp2-dp2-zero1-zb": dict(pp=2, dp=2, zero=1, microbatches=4, schedule="zb"),
    "pp2-dp2-zero1-zb-cheap-first-2": dict(pp=2, dp=2, zero=1, microbatches=4, schedule="zb",
                                           recompute="cheap", recompute_layers=2),
    "pp2-dp2-zero1-interleaved-zb": dict(pp=2, dp=2, zero=1, microbatches=4,
                                         schedule="interleaved-zb", virtual=2),
    "cp2-dp2-zero1": dict(cp=2, dp=2, zero=1),
    "dp4-zero1": dict(dp=4, zero=1),
    "dp2-zero1-fp32": dict(dp=2, zero=1, dtype="fp32"),
    "dp2-zero2-fp32": dict(dp=2, zero=2, dtype="fp32"),
    "dp2-ep2-zero2-moe4": dict(dp=2, ep=2, zero=2, moe_experts=4),
    "dp2-ep2-zero3-moe4": dict(dp=2, ep=2, zero=3, moe_experts=4),
}


def _live_errors(layout: dict) -> list[float]:
    """Each rehearsed rank's live peak as the memory model predicts it, against the CPU
    allocator's (``meter.cpu_allocations``), as a relative error."""
    ranks = rehearse(TrainConfig(**{**SCALED_13B, **layout}))["ranks"]
    return [r["predicted"]["live"] / r["cpu_peak_allocated"] - 1 for r in ranks]


@pytest.mark.parametrize("name", SCALED_LAYOUTS)
def test_the_memory_model_holds_a_rehearsed_cpu_rank(name):
    """The planner's memory model (``card_peak``'s live peak) against what a rehearsed
    rank allocates on the CPU, gpt-13b's shape at 1/32 of its width in bf16: the terms
    a step holds are all there, whole buffers included (ZeRO-3's gathered units and unit
    gradients, ZeRO-2's buckets in flight, the block recomputation makes again, ZB-H1's
    inputs and output gradients waiting for W). Measured (2026-12-06, torch 2.13): -3.0% ..
    +0.0% on every rank, zb's two stages -4.4% and +2.2%, -2.1% and +3.4% with the
    first 2 blocks of each stage's 4 recomputed cheaply, interleaved zero bubble's -4.7%
    and +0.4% (the CPU's attention and loss
    kernels keep a little more than the GPU's, which the model follows, and it widens a
    weight gradient's operands to fp32, which the GPU's GEMM does not). In fp32, ZeRO-1
    and 2 within 0.01% (-6.0% and -6.9% while the engine kept an fp32 master shard beside
    fp32 weights; ``test_zero`` pins that it keeps none). Four experts a layer over ep 2,
    ZeRO 2 and 3: -2.3% and -2.5%. At 1/16 of the width, sequence and vocabulary (the
    size before, each bf16 step 50x slower) the same to 0.1 point but for the experts'
    -1.7% .. -2.3%. Band: 6%."""
    for error in _live_errors(SCALED_LAYOUTS[name]):
        assert abs(error) < 0.06, (name, error)


def test_a_model_without_the_buffers_in_flight_fails_the_cpu_rank(monkeypatch):
    """Mutation: without ``buffers_in_flight`` (ZeRO-3's units gathered and in flight, a
    tied head's waiting gradient) the model misses ZeRO-3 with full recomputation by
    20% on the same rank (16% at 1/16 of the width), outside the band above."""
    monkeypatch.setattr(theory_memory, "buffers_in_flight", lambda *a, **k: (0, 0))
    (error,) = _live_errors(SCALED_LAYOUTS["dp4-zero3-full"])
    assert error < -0.06, error


CHEAP = "rehearsal-1xH100-2026-12-06u1-u4.json"  # (calls u1-u4)


def test_cheap_recomputations_picks_rehearsed_as_the_planner_predicts():
    """The planner's picks once cheap recomputation is in its search, rehearsed on one
    H100 as ``plan`` prints them (2026-12-06, u2): gpt-13b dp 4 ZeRO-3 recomputing 10 of
    40 blocks in full and the rest cheaply computes a step in 1.213-1.219 s against 1.298
    for its 22-full pick (compiled) in the same call: -6.3%, the model said -7.1%. With
    the picks u4 added (every one among the first three), each row's compute is
    predicted within +0.3% .. +6.7% (``stage_compute``), its live peak within -1.3% ..
    +2.0%, its reserve within -4.3% .. +5.4%; gpt-6.7b's cheap pick holds 72.0 GiB, 74.7
    with its peers' NCCL buffers, of 79.2.

    And (u1) ZeRO-3's gradient slots written by their first product instead of zero-filled
    and added to: gpt-13b's 22-full pick, the engine before and after, alternating,
    computes 1.329 / 1.334 s before and 1.312 / 1.313 after (-1.3% .. -1.6%); gpt-1.3b's
    ZeRO-3 b 8 0.272 both; the same peaks.

    Float8 at each recipe's fit (u3, one call): gpt-13b recomputing 10 of 40 blocks in
    full with compiled float8 blocks computes in 0.991 s (rowwise) and 0.923 s
    (tensorwise) against the bf16 pick's 1.228: 1.24x and 1.33x, before the halved
    all-gather bytes; recomputing 9 (their fit once the reserve was refitted, u7) 0.978
    and 0.914 s, 1.26x and 1.34x."""
    h100 = cluster(4, "H100-80GB")
    record = json.loads((RESULTS / CHEAP).read_text())
    computes = {}
    for row in record["rows"]:
        model, layout = _layout(row)
        rank, = row["ranks"]
        measured = rank["compute_seconds"]
        computes.setdefault(row["label"], []).append(measured)
        assert 0.0 < stage_compute(model, h100, layout) / measured - 1 < 0.09, row["label"]
        held, predicted = rank["device_memory"], rank["predicted"]
        assert abs(predicted["live"] / held["peak_allocated"] - 1) < 0.03, row["label"]
        assert abs(predicted["reserved"] / held["peak_reserved"] - 1) < 0.07, row["label"]
    first = plan("gpt-13b", h100, 16).layouts[0].layout.label()
    full22 = "tp=1 pp=1 dp=4 zero=3 b=4 m=1 recompute=full recompute-layers=22"
    assert max(computes[first]) < 0.95 * computes[full22][0]
    for model, batch in (("gpt-13b", 16), ("gpt-6.7b", 32), ("gpt-1.3b", 32)):
        for est in plan(model, h100, batch).layouts[:3]:  # each cheap pick rehearsed
            layout = est.layout
            assert "cheap" not in (layout.recompute, layout.recompute_rest) or (
                layout.label() in computes), (model, layout.label())
    fill = {(r["model"], r["engine"][:5]): [] for r in record["zero_fill"]}
    for r in record["zero_fill"]:
        fill[r["model"], r["engine"][:5]].append(r["compute_seconds"])
    assert max(fill["gpt-13b", "after"]) < 0.99 * min(fill["gpt-13b", "befor"])
    assert record["meta"]["beta0_nan"]["finite"]
    fp8 = {r["name"]: r["compute_seconds"] for r in record["fp8_fit"]}
    assert fp8["bf16_c10"] / fp8["row_f10"] > 1.2 and fp8["bf16_c10"] / fp8["ten_f10"] > 1.3
    assert fp8["bf16_c10"] / fp8["row_f9"] > 1.2 and fp8["bf16_c10"] / fp8["ten_f9"] > 1.3


IZB = "rehearsal-1xH100-2026-12-06v1-izb.json"  # (call v1)


def test_interleaved_zero_bubble_rehearsed_on_one_h100():
    """Interleaved zero bubble (``schedules.interleaved_zero_bubble``), each stage rehearsed
    alone on one H100 (2026-12-06, v1): gpt-1.3b pp 4 b 4 m 8 with head layers 2 (the
    planner's pp 4 pick) beside zb in the same call, and gpt-6.7b pp 2 dp 2 ZeRO-2 v 2
    m 8 with head layers 1 (its third pick: 64.5 / 55.1 GiB live, 65.7 / 58.8 reserved,
    it fits). The live peak as ``card_peak`` predicts it, each chunk at its own size
    (``memory.split_moments``): -2.4% .. +1.5% on every stage (before, with a mean chunk
    size, the interleaved stages 0 and 1 read -6.0% and -8.0%; with the loss's workspace
    beside the fullest moment of any chunk, not of the head's, its last +6.1%; with the
    head's logits gradient counted twice while the loss runs, as the B's and as the
    workspace, zb's last +5.0%: the snapshots of both last stages, v2 and v3). The
    reserve: -4.0% .. +3.7%, but the interleaved last stage's at micro-batches of 4,
    -11.9%: 27.8 GiB reserved over 22.1 live, its blocks of many sizes (the fp32 logits
    and the loss's workspace, 1.5 GiB each, among 3-layer chunks' tensors) fragment the
    cache, and the fit is linear in the live peak. Not the card's binding stage. Compute
    (``stage_compute``) within +0.6% .. +9.3% of the measured. v1's interleaved stages 0
    and 1 computed 0.320 s against zb's 0.307 / 0.302; rerun alternating (v2, twice
    each) 0.312-0.313 / 0.306 against 0.310-0.311 / 0.301-0.303: within 1.3%, the same
    work; at micro-batches of 2 (v3, m 16, twice each, the fastest of each stage) 0.329,
    0.312, 0.265, 0.288 against zb's 0.328, 0.315, 0.273, 0.287, the live peaks within
    -1.6% .. +3.8%. The bubble it saves is what the 4-GPU step decides."""
    h100 = cluster(4, "H100-80GB")
    record = json.loads((RESULTS / IZB).read_text())
    fastest: dict[tuple, float] = {}  # (a call's first run can read 20-35% slow: t4, v3)
    for row in record["rows"]:
        for rank in row["ranks"]:
            key = (row["label"], rank["coords"]["pp"])
            fastest[key] = min(fastest.get(key, 1e9), rank["compute_seconds"])
    for row in record["rows"]:
        model, layout = _layout(row)
        last = layout.pp - 1
        for rank in row["ranks"]:
            stage = rank["coords"]["pp"]
            live = card_peak(model, layout, stage=stage)["total"]
            error = live / rank["device_memory"]["peak_allocated"] - 1
            low, high = (-0.03, 0.07) if stage == last and layout.pp > 2 else (-0.03, 0.03)
            assert low < error < high, (row["label"], stage, error)
            held = card_peak(model, layout, stage=stage)["reserved"]
            reserve = held / rank["device_memory"]["peak_reserved"] - 1
            low = -0.13 if stage == last and layout.virtual > 1 and layout.pp > 2 else -0.03
            assert low < reserve < 0.06, (row["label"], stage, reserve)
            ratio = stage_compute(model, h100, layout, stage) / fastest[row["label"], stage]
            assert 1.0 < ratio < 1.10, (row["label"], stage, ratio)
