"""The planner: what it keeps is possible, what it drops says why, and it ranks sensibly.

The syllabus's worked examples are the inputs. Where a text's layout is impossible
(the 1T model with tp = 16 on 8-GPU nodes) the planner must say so.
"""

from __future__ import annotations

import time

import pytest

from minipar.theory.card import card_bytes
from minipar.theory.clusters import CLUSTERS, calibrated, cluster, get_cluster
from minipar.theory.examples import EXAMPLES, get_model
from minipar.theory.layout import Layout
from minipar.theory.memory import memory_breakdown
from minipar.theory.params import head_layers_for
from minipar.theory.planner import TIE_SHARE, TIME_KEYS, evaluate, plan
from minipar.theory.rates import chunk_seconds
from minipar.theory.tables import render_plan


@pytest.fixture(scope="module")
def gpt3_plan():
    ex = EXAMPLES["175b-on-1024"]
    return plan(ex.model, ex.cluster, ex.global_batch)


def test_every_kept_layout_is_possible(gpt3_plan):
    cfg, cl = gpt3_plan.model, gpt3_plan.cluster
    assert len(gpt3_plan) > 10
    for est in gpt3_plan:
        lay = est.layout
        assert lay.tp * lay.pp * lay.dp * lay.cp == lay.gpus == cl.gpus
        assert lay.tp <= cl.gpus_per_node
        assert cfg.n_head % lay.tp == 0 and cfg.n_layer % lay.pp == 0
        assert lay.dp * lay.microbatch_size * lay.microbatches == gpt3_plan.global_batch
        assert est.memory["total"] <= 0.9 * cl.gpu_memory
        assert est.time["step"] == pytest.approx(sum(est.time[k] for k in TIME_KEYS))
        assert 0 < est.mfu <= 0.7 + 1e-9  # cannot beat the assumed matmul efficiency
    times = [lay.step_time for lay in gpt3_plan]  # sorted, but for ties (next test)
    assert all(later >= t / (1 + TIE_SHARE) for i, t in enumerate(times)
               for later in times[i + 1:])


def test_ties_within_the_error_go_to_the_layout_that_holds_less(gpt3_plan):
    best = gpt3_plan.best

    def shape(x: Layout) -> tuple:
        return x.tp, x.pp, x.dp, x.microbatch_size, x.schedule, x.virtual
    same_shape = [x for x in gpt3_plan if shape(x.layout) == shape(best.layout)]
    tied = [x for x in same_shape if x.step_time <= best.step_time * (1 + TIE_SHARE)]
    assert best.memory["process"] == min(x.memory["process"] for x in tied)


def test_memory_is_the_theory(gpt3_plan):
    best = gpt3_plan.best
    lay = best.layout
    again = memory_breakdown(gpt3_plan.model, lay, accounting="fused")
    again.update(card_bytes(again, lay, "cuda"))  # the card beyond the tensors
    assert again == best.memory


def test_rejections_are_counted_with_reasons(gpt3_plan):
    assert gpt3_plan.rejected["does not fit in memory"] > 0
    assert gpt3_plan.rejected["tp larger than a node"] > 0
    why = gpt3_plan.why()
    assert gpt3_plan.best.layout.label() in why and "does not fit in memory" in why
    assert "mostly" in why  # names the term that makes the runner-up slower


def test_plain_tp8_pp16_without_recompute_does_not_fit():
    """The syllabus's GPT-3 layout fits only with help: without sequence parallelism and
    recomputation the first stage's activations alone (~56 GB, Korthikanti's formula)
    plus 16 bytes/param of model states overflow 80 GB."""
    ex = EXAMPLES["175b-on-1024"]
    bare = ex.layout.with_(microbatches=ex.global_batch // ex.layout.dp)
    helped = bare.with_(zero=1, sp=True, recompute="selective")
    bare = evaluate(ex.model, ex.cluster, bare, accounting="korthikanti")
    helped = evaluate(ex.model, ex.cluster, helped, accounting="korthikanti")
    assert not bare.fits and helped.fits


def test_one_point_three_b_on_8_gpus_is_data_parallel():
    # the syllabus's answer: the model fits on one GPU, so use all 8 for data
    ex = EXAMPLES["1.3b-on-8"]
    best = plan(ex.model, ex.cluster, ex.global_batch).best
    assert (best.layout.tp, best.layout.pp, best.layout.dp) == (1, 1, 8)


def test_plan_keeps_the_degrees_asked_for():
    """``degrees``: the best pipelines of four stages for gpt-1.3b on 4 x H100 are all
    pp 4, every schedule's stages balanced for the head (the interleaved ones' too: the
    last chunk's rank runs the head), the zero-bubble ones first, interleaved and not;
    degrees no layout has are refused, with the rule."""
    result = plan("gpt-1.3b", cluster(4, "H100-80GB"), 32, degrees={"pp": 4})
    assert result.layouts and all(e.layout.pp == 4 for e in result.layouts)
    assert all(e.layout.head_layers == head_layers_for("gpt-1.3b", e.layout.recompute) > 0
               for e in result.layouts)
    assert {"zb", "interleaved-zb"} <= {e.layout.schedule for e in result.layouts[:5]}
    with pytest.raises(ValueError, match="no layout of 4 GPUs has pp=3: dp x pp x tp"):
        plan("gpt-1.3b", cluster(4, "H100-80GB"), 32, degrees={"pp": 3})
    with pytest.raises(ValueError, match=r"\['ep'\] are not dp, pp, tp or cp"):
        plan("gpt-1.3b", cluster(4, "H100-80GB"), 32, degrees={"ep": 2})


def test_syllabus_1t_layout_is_rejected():
    ex = EXAMPLES["1t-on-4096"]
    assert ex.layout.tp > ex.cluster.gpus_per_node
    result = plan(ex.model, ex.cluster, ex.global_batch, zero_stages=(1,),
                  recomputes=("selective",), schedules=("1f1b",))
    assert "tp=16 > 8" in result.examples["tp larger than a node"]
    assert result.best.layout.tp <= 8


def test_nothing_fits_is_explained():
    result = plan("gpt-1t", cluster(8, "A100-80GB"), 8)
    assert len(result) == 0 and result.best is None
    assert "No layout" in result.why() and "smallest needs" in result.why()


def test_faster_network_never_slows_a_layout():
    ex = EXAMPLES["13b-on-64"]
    lay = Layout(tp=2, pp=4, dp=8, zero=1, microbatches=ex.global_batch // 8)
    slow = evaluate(ex.model, ex.cluster, lay)
    gpu = ex.cluster.gpu.__class__(**{**ex.cluster.gpu.__dict__, "network": 100e9})
    fast = evaluate(ex.model, ex.cluster.with_(gpu=gpu), lay)
    assert fast.step_time < slow.step_time
    assert fast.time["compute"] == slow.time["compute"]


def test_more_microbatches_shrink_the_bubble():
    """The last stage also runs the head, so it paces the m micro-batches (compute) and
    1F1B's warm-up and cool-down cross the p - 1 other stages once (the bubble): p - 1 of
    their forward + backward. The closed form's compute x (p-1)/m charged those at the
    last stage's pace, the head twice (4 x H200, gpt-1.3b pp 4: +15% over measured)."""
    ex = EXAMPLES["13b-on-64"]
    few = Layout(tp=4, pp=4, dp=4, zero=1, microbatch_size=8, microbatches=32)
    many = few.with_(microbatch_size=1, microbatches=256)
    few, many = (evaluate(ex.model, ex.cluster, lay) for lay in (few, many))
    assert many.time["bubble"] < few.time["bubble"]
    chunks = chunk_seconds(get_model(ex.model), get_cluster(ex.cluster), few.layout, 0.7)
    assert chunks[0] == chunks[1] == chunks[2] < chunks[3]  # 10 layers each, + the head
    assert few.time["compute"] == pytest.approx(32 * chunks[3])
    assert few.time["bubble"] == pytest.approx(3 * chunks[0], rel=0.005)  # (rounded weights)
    assert few.time["bubble"] < few.time["compute"] * 3 / 32


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("zb", 1), ("interleaved", 2)])
def test_a_pipeline_is_priced_as_its_schedule_runs(schedule: str, virtual: int) -> None:
    """compute + bubble is the makespan of the schedule's own timeline (``simulate``)
    with each chunk at its seconds: a heavier last chunk (a vocabulary twice as large)
    raises the price by what the timeline says, and ``head_layers`` (the last chunk 2
    layers fewer, the first ones more) lowers it, as measured on 4 x H200 (gpt-1.3b pp 4:
    1F1B 0.472 -> 0.413 s, ZB 0.419 -> 0.396 s). Equal chunks give the closed forms. (The
    planner simulates the chunks' seconds rounded to a hundredth of the largest, so that
    one run serves many layouts: measured within 0.15% of the exact timeline here.)"""
    from minipar.theory.bubble import (
        bubble_ratio_formula,
        bubble_stats,
        make_schedule,
        pipeline_seconds,
        simulate,
    )
    from minipar.theory.memory import memory_per_stage

    base, cl = get_model("gpt-1.3b"), cluster(4, "H100-80GB", gpus_per_node=4)

    layout = Layout(pp=4, microbatch_size=2, microbatches=16, schedule=schedule,
                    virtual=virtual)

    def priced(cfg, head_layers: int = 0) -> tuple[float, float]:
        lay = evaluate(cfg, cl, layout.with_(head_layers=head_layers))
        chunks = chunk_seconds(cfg, cl, lay.layout, 0.7)
        timeline = simulate(make_schedule(schedule, 4, 16, virtual),
                            chunk_weight=[c / 3 for c in chunks])  # F + B = 3 units
        return lay.time["compute"] + lay.time["bubble"], bubble_stats(timeline)["step_time"]

    even, heavy, split = priced(base), priced(base.with_(vocab_size=2 * 50304)), \
        priced(base, head_layers=2)
    for price, simulated in (even, heavy, split):
        assert price == pytest.approx(simulated, rel=0.005)
    assert heavy[0] > even[0] > split[0]
    busy, step = pipeline_seconds(schedule, 4, 16, virtual, (1.0,) * 4 * virtual)
    assert busy == pytest.approx(16 * virtual) and step / busy - 1 == pytest.approx(
        bubble_ratio_formula(schedule, 4, 16, virtual))
    # past 4 pp micro-batches the idle time stops growing: 64 are priced from 16's run
    odd = [1.3, 0.7, 1.1, 0.9, 1.2, 0.8, 1.0, 1.4][:4 * virtual]
    timeline = simulate(make_schedule(schedule, 4, 64, virtual),
                        chunk_weight=[w / 3 for w in odd])
    assert pipeline_seconds(schedule, 4, 64, virtual, odd)[1] == pytest.approx(
        bubble_stats(timeline)["step_time"], rel=0.005)
    # memory: the split's stages (the first holds 7 layers of 24, the last 4)
    lay = evaluate(base, cl, layout.with_(head_layers=2))
    rows = memory_per_stage(base, layout.with_(head_layers=2), accounting="fused")
    assert "head-layers=2" in lay.layout.label()
    assert lay.memory["total"] == max(rows[0]["total"], rows[3]["total"])


def test_tensor_parallel_inside_a_node_uses_nvlink():
    cl = CLUSTERS["a100x64"]
    inside = evaluate("gpt-13b", cl, Layout(tp=8, dp=8, zero=3, microbatches=8))
    assert inside.traffic["tp"] > 0
    assert inside.time["tp"] < inside.traffic["tp"] / cl.inter_bw  # NVLink, not network
    with pytest.raises(ValueError, match="GPUs"):
        evaluate("gpt-13b", cl, Layout(tp=8, dp=4))


@pytest.mark.parametrize("name", ["llama3-8b-on-8", "llama3-70b-on-64", "13b-on-64"])
def test_modern_and_syllabus_examples_plan_quickly(name):
    ex = EXAMPLES[name]
    t0 = time.process_time()  # this process's CPU time: a loaded machine does not count
    result = plan(get_model(ex.model), ex.cluster, ex.global_batch, **ex.settings)
    assert time.process_time() - t0 < 5
    assert result.best is not None
    table = render_plan(result, top=3)
    assert result.best.layout.label() in table and "Best:" in table


# --- a calibrated machine: measured rates replace the data sheet's -------------------
CALIBRATION = {  # hand-written, in the shape benchmarks/multigpu.py writes
    "device": "NVIDIA H100 80GB HBM3", "gpus": 4, "memory_bytes": 79 * 2**30,
    "matmul_tflops": 500.0,
    "collectives": {"all_reduce": {"latency_s": 40e-6, "bus_bandwidth": 100e9},
                    "all_gather": {"latency_s": 30e-6, "bus_bandwidth": 120e9},
                    "reduce_scatter": {"latency_s": 30e-6, "bus_bandwidth": 120e9},
                    "send": {"latency_s": 20e-6, "bus_bandwidth": 50e9}},
}


def test_calibration_replaces_the_presets_rates(tmp_path) -> None:
    import json

    from minipar.theory.clusters import calibrated, load_calibration

    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(CALIBRATION))
    base = cluster(4, "H100-80GB", gpus_per_node=4, measured=False)  # the data sheet
    cal = calibrated(base, load_calibration(str(path)))
    assert cal.matmul_rate == 500e12 and cal.peak_flops == base.peak_flops
    assert cal.gpu_memory == 79 * 2**30
    assert cal.link("all_reduce", False) == (100e9, 40e-6)
    assert cal.link("recv", False) == (50e9, 20e-6)
    assert cal.link("all_reduce", True) == (base.inter_bw, base.latency)  # not measured
    layout = Layout(tp=4, microbatch_size=8, sp=True)
    before = evaluate("gpt-1.3b", base, layout)
    after = evaluate("gpt-1.3b", cal, layout)
    # compute scales with the rate; tp collectives are slower on the measured links
    assert after.time["compute"] == pytest.approx(before.time["compute"] * 989 / 500)
    assert after.time["tp"] > before.time["tp"]
    assert after.mfu < before.mfu


def test_a_measured_block_pace_and_per_size_times_replace_the_fits() -> None:
    """With ``block_rates`` a layer's FLOPs go at the measured pace of its micro-batch
    (interpolated in log tokens, clamped at the ends); the head stays at matmul rate x
    efficiency. With per-size times each call takes the bandwidth measured at its
    payload; sp's extra launches are the host's (``HOST_LAYER_EXTRA``), not GPU seconds,
    whatever ``tp_blocks`` says. (The formulas, on
    hand-written numbers; the 4 x H100 tests below pin the planner to measurements.)"""
    from minipar.theory.clusters import calibrated
    from minipar.theory.params import layer_flops_per_token
    from minipar.theory.rates import interp_log

    assert interp_log(4096, [2048, 8192], [1.0, 3.0]) == pytest.approx(2.0)
    assert interp_log(1, [2048, 8192], [1.0, 3.0]) == 1.0
    flat = [100e9] * 3
    calib = {**CALIBRATION, "block_rates": [
        {"hidden": 2048, "tokens": t, "tp": 4, "tflops": 200.0} for t in (2048, 16384)],
        "tp_blocks": [{"hidden": 2048, "tokens": 16384, "tp": 4, "sp": sp, "seconds": s}
                      for sp, s in ((False, 0.004), (True, 0.007))]}
    calib["collectives"] = {op: {**row, "bytes": [2**10, 2**20, 2**30],
                                 "bus_bandwidth_per_size": flat}
                            for op, row in CALIBRATION["collectives"].items()}
    cal = calibrated(cluster(4, "H100-80GB", gpus_per_node=4, measured=False), calib)
    plain = evaluate("gpt-1.3b", cal, Layout(tp=4, microbatch_size=8))
    sp = evaluate("gpt-1.3b", cal, Layout(tp=4, microbatch_size=8, sp=True))
    layers = layer_flops_per_token("gpt-1.3b") * 24 * 16384 / 4 / 200e12
    head = 6 * 50304 * 2048 * 16384 / 4 / (500e12 * 0.7)
    assert plain.time["compute"] == pytest.approx(layers + head)
    # 4 all-reduces of b*s*h bf16 per layer + the embedding's and the head's, at 100 GB/s
    # bus bandwidth (the loss's three small ones are in the tolerance)
    each = 2 * 3 / 4 * 16384 * 2048 * 2 / 100e9
    assert plain.time["tp"] == pytest.approx((24 * 4 + 2) * each, rel=0.01)
    # sp moves 5/4 of the bytes (the column linears' inputs gathered again in backward);
    # the 3 ms per layer its isolated block measured more are host launches, not GPU time
    assert sp.time["tp"] == pytest.approx(1.25 * plain.time["tp"], rel=0.02)


def test_one_slow_size_in_a_measured_curve_does_not_price_the_calls_near_it() -> None:
    """4 x H200's calibration read all_reduce at 67 MB at 49 GB/s, between 258 (16 MB)
    and 326 (268 MB): noise in a few timed iterations. tp 4's layer all-reduces (gpt-1.3b,
    8 x 2048 tokens) are 67 MB; read as measured they cost 5x, the step 0.28 s against
    0.13 s measured. A curve is read as its running maximum (``clusters.rising``)."""
    from minipar.theory.clusters import calibrated, rising

    assert rising([1.0, 258.0, 49.0, 326.0, 300.0]) == (1.0, 258.0, 258.0, 326.0, 326.0)
    sizes = [2**10, 2**24, 2**26, 2**28]

    def tp4(bandwidths: list[float]) -> float:
        calib = {**CALIBRATION, "collectives": {**CALIBRATION["collectives"], "all_reduce": {
            **CALIBRATION["collectives"]["all_reduce"], "bytes": sizes,
            "bus_bandwidth_per_size": [b * 1e9 for b in bandwidths]}}}
        cal = calibrated(cluster(4, "H200-141GB", gpus_per_node=4), calib)
        return evaluate("gpt-1.3b", cal, Layout(tp=4, microbatch_size=8)).time["tp"]

    noisy, clean = tp4([1.0, 258.0, 49.0, 326.0]), tp4([1.0, 258.0, 258.0, 326.0])
    assert noisy == pytest.approx(clean)
    # ~100 calls, each 2 x 3/4 x 64 MiB on the wire at 258 GB/s
    assert noisy == pytest.approx(101 * 1.5 * 2**26 / 258e9, rel=0.05)


def test_a_measured_head_optimizer_and_accumulation_join_the_step() -> None:
    """With ``head_rates`` the head and loss go at their measured pace (interpolated in
    log tokens like a block's); with ``grad_accumulate`` every micro-batch adds this
    rank's parameters' gradients into the fp32 buffer (only those the hook adds,
    ``hook_params``: the linear weights' sums are made in their GEMMs); with
    ``optimizer_step`` the step
    runs over this rank's parameters, 1/dp of them from ZeRO-1 on, none with offload
    (the host steps). A file without them prices none of it (formulas, on hand-written
    numbers)."""
    import math

    from minipar.model import get_config
    from minipar.theory.clusters import calibrated
    from minipar.theory.params import hook_params, layer_flops_per_token

    calib = {**CALIBRATION,
             "block_rates": [{"hidden": 2048, "tokens": t, "tp": 1, "tflops": 400.0}
                             for t in (2048, 16384)],
             "head_rates": [{"hidden": 2048, "tokens": t, "tp": 1, "tflops": f}
                            for t, f in ((2048, 100.0), (16384, 300.0))],
             "optimizer_step": {"params": 2**26, "seconds_per_param": 20e-12},
             "grad_accumulate": {"params": 2**26, "seconds_per_param": 4e-12}}
    base = cluster(4, "H100-80GB", gpus_per_node=4)
    cal, old = calibrated(base, calib), calibrated(base, CALIBRATION)
    assert (old.step_s_per_param, old.accumulate_s_per_param, old.head_rates) == (0, 0, ())
    dp4 = Layout(dp=4, microbatch_size=4, microbatches=2)  # batch 32
    lay = evaluate("gpt-1.3b", cal, dp4)
    n = lay.memory["n_params"]
    assert 1.3e9 < n < 1.35e9  # the whole model on each dp rank (tp = pp = 1)
    tokens = 4 * 2048  # per micro-batch: the head's pace halfway (in log) 100 -> 300
    head_rate = (100 + 200 * math.log(4) / math.log(8)) * 1e12
    layers = layer_flops_per_token("gpt-1.3b") * 24 / 400e12
    blocks = tokens * (layers + 6 * 50304 * 2048 / head_rate)
    hooked = hook_params("gpt-1.3b")  # embeddings, norms, biases: 2048 * (50304 + ...)
    assert 1e8 < hooked < 1.1e8
    assert lay.time["compute"] == pytest.approx(2 * (blocks + hooked * 4e-12))  # m = 2
    assert lay.time["update"] == pytest.approx(n * 20e-12)
    for zero in (1, 2, 3):
        z = evaluate("gpt-1.3b", cal, dp4.with_(zero=zero))
        assert z.time["update"] == pytest.approx(math.ceil(n / 4) * 20e-12)
        # (the head is the tied embedding here: hooked at every stage)
        assert z.time["compute"] == pytest.approx(2 * (blocks + hooked * 4e-12))
    untied = get_config("gpt-1.3b").with_(tie_embeddings=False)
    assert hook_params(untied, zero=3) - hook_params(untied) == 50304 * 2048  # ZeRO-3's
    # head gathers its own weight in its call: left unfused
    off = evaluate("gpt-1.3b", cal, dp4.with_(zero=1, offload=True))
    assert off.time["update"] == 0 and off.time["offload"] > 0
    before = evaluate("gpt-1.3b", old, dp4)
    assert before.time["update"] == 0


def test_plan_command_reads_a_calibration(tmp_path, capsys) -> None:
    import json

    from minipar.__main__ import main

    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(CALIBRATION))
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-1.3b", "--calibrate", str(path), "--batch", "32",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "calibrated" in text and "matmul 500 TFLOP/s" in text
    best = json.loads(out.read_text())["best"]
    assert best["tp"] * best["pp"] * best["dp"] == 4
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"collectives": {}}))
    assert main(["plan", "--calibrate", str(bad)]) == 2


def test_planner_considers_context_parallelism_for_long_sequences():
    """cp > 1 is enumerated only where each rank keeps min_cp_tokens of a sequence; it
    divides the activations and books the ring under cp."""
    from minipar.theory.memory import memory_breakdown
    from minipar.theory.models import get_model
    from minipar.theory.planner import evaluate, plan

    long = get_model("gpt-1.3b").with_(seq_len=32768)
    result = plan(long, "dgx-a100", schedules=("1f1b",), zero_stages=(1, 3))
    cps = {x.layout.cp for x in result}
    assert max(cps) > 1 and all(32768 // c >= 4096 for c in cps)
    short = plan("gpt-1.3b", "dgx-a100", schedules=("1f1b",), zero_stages=(1, 3))
    assert {x.layout.cp for x in short} == {1}
    one = memory_breakdown(long, Layout(dp=2, tp=4, zero=1))
    two = memory_breakdown(long, Layout(dp=1, tp=4, cp=2, zero=1))
    from minipar.theory.context import ring_kept_bytes
    from minipar.theory.params import stage_layers

    kept = ring_kept_bytes(1, 32768, long.d_model // 4, 2) * stage_layers(long.n_layer, 1, 0)
    # half the activations, plus the k|v block each layer's ring keeps for its backward
    assert two["activations"] == pytest.approx(one["activations"] / 2 + kept, rel=1e-6)
    assert two["optimizer"] == one["optimizer"]  # ZeRO shards over dp x cp = 2 either way
    lay = evaluate(long, "dgx-a100", Layout(tp=4, cp=2, zero=1, microbatches=8))
    assert lay.traffic["cp"] > 0 and "cp=2" in lay.layout.label()


def test_memory_model_with_offload_moves_the_states_to_the_host():
    from minipar.theory.memory import memory_breakdown

    on = memory_breakdown("gpt-1.3b", Layout(dp=8, zero=2, offload=True))
    off = memory_breakdown("gpt-1.3b", Layout(dp=8, zero=2))
    assert on["optimizer"] == 0 < off["optimizer"] and on["host"] > 0  # all 12 B moved
    assert on["total"] < off["total"]
    fp32 = memory_breakdown("tiny", Layout(dtype="fp32", offload=True))
    assert fp32["optimizer"] == 0  # fp32, stage 0: the master is the weights


def _h100x4():
    """The 4 x H100 machine as calibrated on it (benchmarks/results/, docs/benchmarks.md)."""
    import pathlib

    from minipar.theory.clusters import calibrated, load_calibration

    path = (pathlib.Path(__file__).parents[1] / "benchmarks" / "results"
            / "calibration-4xH100-2026-11-26b.json")
    return calibrated(cluster(4, "H100-80GB", gpus_per_node=4), load_calibration(str(path)))


def _h100x2():
    """The 2 x H100 machine as calibrated on it (2026-11-26, with block rates)."""
    import pathlib

    from minipar.theory.clusters import calibrated, load_calibration

    path = (pathlib.Path(__file__).parents[1] / "benchmarks" / "results"
            / "calibration-2xH100-blocks-2026-11-26c.json")
    # (a host of its own: the data sheet's base, not the 4 x H100 host's measured engine)
    base = cluster(2, "H100-80GB", gpus_per_node=2, measured=False)
    return calibrated(base, load_calibration(str(path)))


def test_the_planner_against_gpt_13b_on_four_h100s():
    """Measured on 4 x H100 (docs/benchmarks.md, gpt-13b, batch 16 x 2048): dp 4 ZeRO-3
    with 4 micro-batches of 1 took 1.99 s and 1.865 s in two calls (the planner had said
    1.23 s: it hid all of ZeRO-3's traffic), with full recomputation and 1 micro-batch
    1.59-1.66 s (1.653 in h7); pp 4 ZB-H1 with 16 micro-batches ran out of 80 GB."""
    h100 = cluster(4, "H100-80GB", gpus_per_node=4)  # the card's shipped paces
    dp4 = Layout(dp=4, zero=3, microbatches=4)  # batch 16
    m4 = evaluate("gpt-13b", h100, dp4, accounting="fused")
    full = evaluate("gpt-13b", h100, dp4.with_(microbatch_size=4, microbatches=1,
                                               recompute="full"), accounting="fused")
    assert m4.step_time == pytest.approx(1.93, rel=0.10)
    assert full.step_time == pytest.approx(1.66, rel=0.10)
    zb = evaluate("gpt-13b", h100, Layout(pp=4, microbatches=16, schedule="zb"),
                  accounting="fused")
    assert not zb.fits


def test_partial_recomputation_recomputes_the_fewest_blocks_that_fit():
    """gpt-13b dp 4 ZeRO-3 b 4 on 4 x H100 fits with all 40 blocks recomputed and not with
    none: the planner keeps the first N of 40 that still fit (N - 1 does not), whose step
    lies between the two, and it ranks it above full recomputation. A chunk's cost grows
    linearly in its recomputed blocks: N = 0 costs what no recomputation does, N = all
    what full recomputation does."""
    h100 = cluster(4, "H100-80GB", gpus_per_node=4)
    full = Layout(dp=4, zero=3, microbatch_size=4, microbatches=1, recompute="full")
    none = evaluate("gpt-13b", h100, full.with_(recompute="none"))
    every = evaluate("gpt-13b", h100, full)
    assert every.fits and not none.fits
    best = plan("gpt-13b", h100, 16, recomputes=("none", "selective", "full")).layouts[0]
    n = best.layout.recompute_layers
    # (its blocks compiled, as ``train`` runs data parallelism alone on a GPU)
    assert best.layout == full.with_(recompute_layers=n, compiled=True) and 0 < n < 40
    assert not evaluate("gpt-13b", h100, full.with_(recompute_layers=n - 1)).fits
    assert none.step_time < best.step_time < every.step_time
    cfg = get_model("gpt-13b")
    chunks = {k: chunk_seconds(cfg, h100, full.with_(recompute_layers=k), 0.7)[0]
              for k in (0, 10, 20, 40)}
    assert chunks[0] == pytest.approx(chunk_seconds(cfg, h100, none.layout, 0.7)[0])
    assert chunks[40] == pytest.approx(chunk_seconds(cfg, h100, full, 0.7)[0])
    assert chunks[20] - chunks[10] == pytest.approx(chunks[10] - chunks[0])


def test_the_planner_against_the_fused_engine_on_four_h100s():
    """Measured on 4 x H100 with weight-gradient fusion (f2 in docs/benchmarks.md,
    gpt-1.3b, batch 32 x 2048, bf16), against the planner on that call's calibration:
    pp 4 1F1B / interleaved v2 / ZB-H1 (16 micro-batches of 2) 464.0 / 450.9 / 430.0 ms,
    peaks 13.1 / 15.6 / 18.2 GiB; dp 4 ZeRO 0-3 (8 a GPU) 335.1 / 324.2 / 312.5 / 324.0 ms,
    50.6 / 44.5 / 39.6 / 37.1 GiB. Predicted (after pricing the fusion): within 2% on the
    pp steps (it read +9..+17% while it charged every weight's accumulation), -6..-11% on
    the dp steps, memory within 3%. The target is 15% and 10%."""
    import pathlib

    from minipar.theory.clusters import calibrated, load_calibration

    path = (pathlib.Path(__file__).parents[1] / "benchmarks" / "results"
            / "calibration-4xH100-2026-11-27f2.json")
    h100 = calibrated(cluster(4, "H100-80GB", gpus_per_node=4), load_calibration(str(path)))
    for (schedule, v), step, gib in ((("1f1b", 1), 0.4640, 13.1),
                                     (("interleaved", 2), 0.4509, 15.6),
                                     (("zb", 1), 0.4300, 18.2)):
        lay = evaluate("gpt-1.3b", h100, Layout(pp=4, microbatch_size=2, microbatches=16,
                                                schedule=schedule, virtual=v), accounting="fused")
        assert lay.step_time == pytest.approx(step, rel=0.05), schedule
        assert lay.memory["total"] / 2**30 == pytest.approx(gib, rel=0.05), schedule
    for zero, step, gib in ((0, 0.3351, 50.6), (1, 0.3242, 44.5), (2, 0.3125, 39.6),
                            (3, 0.3240, 37.1)):
        lay = evaluate("gpt-1.3b", h100, Layout(dp=4, zero=zero, microbatch_size=8),
                       accounting="fused")
        assert lay.step_time == pytest.approx(step, rel=0.15), zero
        assert lay.memory["total"] / 2**30 == pytest.approx(gib, rel=0.05), zero


def test_zero_bubble_stages_hold_the_deferred_weight_gradients_inputs():
    """Rehearsed on one H100 (gpt-1.3b, pp 4, 16 micro-batches of 2, bf16, each stage's
    rank alone; rehearsal-1xH100-2026-12-06r2-zb): live peaks 13.61 / 12.05 / 12.40 /
    17.61 GiB per stage; the model: 13.44 / 11.82 / 12.19 / 18.26 (-1.9% .. +3.7%;
    ``memory.split_in_flight``: before the B that finds stage s fullest, s micro-batches wait
    for their W with what it reads and their output gradients, beside p - s whole ones;
    the first stage's W makes the embedding's gradient, the last's reads the logits').
    The model it replaced (every stage holding p whole micro-batches and s + 1 W passes'
    output gradients) read 13.72 / 12.77 / 13.61 / 18.61: +0.8% .. +9.7%."""
    import json
    import pathlib

    from minipar.theory.memory import memory_per_stage

    path = (pathlib.Path(__file__).parents[1] / "benchmarks" / "results"
            / "rehearsal-1xH100-2026-12-06r2-zb.json")
    ranks = json.loads(path.read_text())["rows"]["zb13_pp4"]["ranks"]
    measured = {r["coords"]["pp"]: r["device_memory"]["peak_allocated"] for r in ranks}
    layout = Layout(pp=4, microbatch_size=2, microbatches=16, schedule="zb")
    rows = memory_per_stage("gpt-1.3b", layout, accounting="fused")
    assert sorted(measured) == [0, 1, 2, 3]
    for row in rows:
        assert -0.03 < row["total"] / measured[row["stage"]] - 1 < 0.05, row["stage"]


def test_the_planner_offloads_only_what_does_not_fit_and_prices_it():
    """``plan(offload=True)`` retries a misfit with ZeRO-Offload, never a layout that fits.
    Its time (host AdamW + PCIe, ``theory.offload.offload_seconds``) against the 2 x H100
    measurement (gpt-1.3b dp 2 ZeRO-1, batch 16: 0.876 s with offload, 0.326 s without;
    benchmarks/results/multigpu-2xH100-offload-sp-2026-11-26c.json)."""
    h100 = _h100x4()
    plain = plan("gpt-13b", h100, 16, accounting="fused")
    both = plan("gpt-13b", h100, 16, accounting="fused", offload=True)
    offloaded = [x for x in both if x.layout.offload]
    assert offloaded and not any(x.layout.offload for x in plain)
    assert {x.layout for x in plain} <= {x.layout for x in both}
    assert all(x.time["offload"] > 0 and x.fits for x in offloaded)
    lay = evaluate("gpt-1.3b", _h100x2(), Layout(dp=2, zero=1, microbatch_size=8,
                                                 offload=True), accounting="fused")
    assert lay.step_time == pytest.approx(0.876, rel=0.15)
    assert lay.memory["optimizer"] == 0 and lay.memory["host"] > 0


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("zb", 1),
                                               ("interleaved", 2)])
@pytest.mark.parametrize("last, others", [(1.0, 0.8), (1.0, 1.0), (0.5, 1.0)])
def test_the_closed_form_past_the_simulated_pipelines_agrees_with_the_simulation(
        schedule: str, virtual: int, last: float, others: float) -> None:
    """Past ``SIMULATED_PP`` stages the idle time is the closed form's: equal to the
    simulated timeline's when the last stage is the busiest (the head), at most 6% above
    it when a lighter last stage lets the others overlap their cool-downs."""
    from minipar.theory import bubble

    pp = 2 * bubble.SIMULATED_PP
    seconds = [others] * (pp * virtual - 1) + [last]
    busy, step = bubble.pipeline_seconds(schedule, pp, 4 * pp, virtual, seconds)
    simulated = bubble._idle(schedule, pp, pp, virtual, tuple(seconds))
    assert simulated * (1 - 1e-9) <= step - busy <= 1.06 * simulated
    if last >= others:
        assert step - busy == pytest.approx(simulated)


def test_every_example_plans_in_seconds() -> None:
    """``plan`` answers at once for every example, 1t on 4096 GPUs included (measured:
    under 2 s each on 2 cores; the bound leaves room for a loaded machine)."""
    import time

    from minipar.theory.examples import EXAMPLES

    for name, ex in EXAMPLES.items():
        t0 = time.process_time()
        plan(ex.model, ex.cluster, ex.global_batch)
        assert time.process_time() - t0 < 6, name


def test_the_printed_command_runs_the_planned_layout(tmp_path) -> None:
    """``plan`` prints, for each layout, the ``train`` command with every setting it
    priced; run (on CPU ranks) it trains exactly that layout."""
    import json
    import shlex
    import subprocess
    import sys

    from minipar.__main__ import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "tiny", "--gpus", "2", "--gpu", "H100-80GB",
                 "--gpus-per-node", "2", "--batch", "4", "--top", "3",
                 "--json", str(out)]) == 0
    planned = json.loads(out.read_text())["layouts"]
    pipelined = next((x for x in planned if x["pp"] > 1), planned[0])
    command = shlex.split(pipelined["command"].replace("--backend nccl", "--backend gloo"))
    assert command[:4] == ["python", "-m", "minipar", "train"]
    run = tmp_path / "run.json"
    subprocess.run([sys.executable, *command[1:], "--steps", "1", "--quiet", "--json",
                    str(run)], check=True, capture_output=True, timeout=120)
    config = json.loads(run.read_text())["config"]
    for key in ("dp", "pp", "tp", "cp", "zero", "microbatches", "schedule", "virtual", "sp",
                "recompute", "offload", "head_layers"):
        assert config[key] == pipelined[key], key
    assert config["batch_size"] == 4


def test_plan_says_what_offload_would_fit_where_nothing_does(capsys) -> None:
    """gpt-6.7b on one 80 GB card: no layout fits (its fp32 states alone are 107 GB), and
    ``plan`` says so, then what ``--offload`` would fit, with the command to run it; the
    command runs the layout it names. gpt-13b fits neither way; one H100 and gpt-1.3b
    fits without, and ``plan`` says nothing of offload."""
    from minipar.__main__ import build_parser, main, train_config

    assert main(["plan", "--model", "gpt-6.7b", "--gpus", "1", "--gpu", "H100-80GB",
                 "--batch", "8"]) == 0
    text = capsys.readouterr().out
    assert "No layout of this model fits" in text and "With --offload" in text
    command = text.rstrip().splitlines()[-1].split()
    cfg = train_config(build_parser().parse_args(command[3:]))
    assert cfg.offload and cfg.model == "gpt-6.7b" and cfg.batch_size == 8
    label = text.rstrip().splitlines()[-2].split(":")[0].strip()
    assert cfg.layout("cuda").label() == label
    for model in ("gpt-13b", "gpt-1.3b"):
        assert main(["plan", "--model", model, "--gpus", "1", "--gpu", "H100-80GB",
                     "--batch", "8"]) == 0
        assert "With --offload" not in capsys.readouterr().out


def test_offload_layouts_fit_the_node_s_host_memory(capsys) -> None:
    """An offload layout keeps each rank's fp32 states on the host (``card_peak``'s
    ``host``: the busiest stage's, here the head's); the planner takes it only where every
    rank of a node fits the node's memory (``card.host_fit``, ``train``'s test too), and
    says why it left the others out. gpt-6.7b on one H100: 112 GiB of host states, so a
    128 GiB host fits it and a 100 GiB one does not, which ``plan`` says in one line.
    The named DGX clusters carry their data sheet's 2 TB."""
    from minipar.__main__ import main
    from minipar.theory.card import card_peak, host_fit
    from minipar.theory.planner import HOST_SHORT

    one = cluster(1, "H100-80GB")
    assert one.host_memory == 0 and get_cluster("dgx-h100").host_memory == 2 * 10**12
    lay = Layout(pp=2, microbatches=4, offload=True, optimizer_kernel="host")
    stages = [card_peak("gpt-6.7b", lay, stage=s)["host"] for s in (0, 1)]
    assert card_peak("gpt-6.7b", lay)["host"] == max(stages) and stages[0] != stages[1]
    assert host_fit(10, 4, 40) and not host_fit(10, 4, 39) and host_fit(10**15, 8, 0)

    roomy = plan("gpt-6.7b", one.with_(host_memory=128 * 2**30), 32, offload=True)
    short = plan("gpt-6.7b", one.with_(host_memory=100 * 2**30), 32, offload=True)
    assert roomy.layouts and all(112 * 2**30 > x.memory["host"] > 111 * 2**30
                                 for x in roomy.layouts[:1])
    assert not short.layouts and short.rejected[HOST_SHORT] == 32
    assert "112 GiB a rank x 1" in short.examples[HOST_SHORT]
    assert main(["plan", "--model", "gpt-6.7b", "--gpus", "1", "--gpu", "H100-80GB",
                 "--batch", "32", "--host-memory", "100"]) == 0
    text = capsys.readouterr().out
    assert "With --offload" not in text
    assert text.rstrip().splitlines()[-1].startswith(
        "Nor does --offload fit: its host states exceed the node's 100 GiB (e.g. tp=1")


def test_cheap_recomputation_is_planned_and_can_be_left_out(capsys) -> None:
    """The default search tries cheap recomputation (its picks rehearsed on one H100:
    ``test_rehearse``): gpt-13b on 4 x H100 puts first a layout recomputing fewer blocks
    in full, the rest cheaply, faster than the same layout recomputing the rest not at
    all; ``plan`` prints the command that runs it, and ``--recompute-modes`` without
    cheap leaves it out."""
    from minipar.__main__ import main
    from minipar.theory.planner import RECOMPUTES

    h100 = cluster(4, "H100-80GB", 4)
    assert "cheap" in RECOMPUTES
    found = plan("gpt-13b", h100, 16)
    assert found.layouts[0].layout.recompute_rest == "cheap"
    partial = {x.layout.recompute_rest: x for x in found.layouts
               if x.layout.recompute_layers and x.layout.with_(  # (cheap ones run eager)
                   recompute_layers=None, recompute_rest="none", compiled=False)
               == found.layouts[0].layout.with_(recompute_layers=None, recompute_rest="none",
                                                compiled=False)}
    assert partial["cheap"].layout.recompute_layers < partial["none"].layout.recompute_layers
    assert partial["cheap"].step_time < partial["none"].step_time
    without = plan("gpt-13b", h100, 16, recomputes=("none", "selective", "full"))
    assert not any("cheap" in (x.layout.recompute, x.layout.recompute_rest)
                   for x in without.layouts)
    assert main(["plan", "--model", "gpt-13b", "--gpus", "4", "--gpu", "H100-80GB",
                 "--batch", "16", "--top", "3"]) == 0
    assert "--recompute-rest cheap" in capsys.readouterr().out
    assert main(["plan", "--model", "gpt-13b", "--gpus", "4", "--gpu", "H100-80GB",
                 "--batch", "16", "--top", "3", "--recompute-modes", "none,full"]) == 0
    out = capsys.readouterr().out  # (a refusal's advice may name it: not a layout)
    assert not any("cheap" in line for line in out.splitlines() if "Rejected" not in line)


def test_a_calibration_file_knows_its_nodes_host_memory() -> None:
    """``benchmarks/multigpu.py --sections calibrate`` records the host's memory
    (``host_memory_bytes``); the calibrated cluster checks offload layouts against it.
    Files written before keep the base cluster's (unknown for ``--gpus``, not checked)."""
    base = cluster(1, "H100-80GB", measured=False)
    calib = {"matmul_tflops": 700.0, "collectives": {}}
    assert calibrated(base, calib).host_memory == 0
    node = calibrated(base, {**calib, "host_memory_bytes": 100 * 2**30})
    assert node.host_memory == 100 * 2**30
    assert not plan("gpt-6.7b", node, 32, offload=True).layouts
    assert plan("gpt-6.7b", node.with_(host_memory=128 * 2**30), 32, offload=True).layouts


def test_the_host_s_launch_floor_runs_through_the_pipeline_s_schedule() -> None:
    """A pipeline's stages wait for each other's launches as for their kernels: with one
    micro-batch 1F1B launches stage after stage, so a host-bound pp 2 step is the whole
    model's launches, not half of them (the floor used to take the busiest stage alone,
    and ranked a pipeline of a tiny model ahead of data parallelism for nothing). With
    many micro-batches the stages launch side by side and the floor nears one stage's
    share plus the fill; without a pipeline it is every layer's launches."""
    from minipar.theory.planner import host_seconds

    h100 = cluster(4, "H100-80GB")
    per_layer = h100.host_s_per_layer
    n = get_model("small").n_layer
    assert per_layer > 0
    plain = host_seconds(get_model("small"), h100, Layout(dp=4))
    assert plain == pytest.approx(n * per_layer)
    one = host_seconds(get_model("small"), h100, Layout(pp=2, dp=2, schedule="1f1b"))
    assert one == pytest.approx(n * per_layer)  # stage 0's launches, then stage 1's
    many = host_seconds(get_model("small"), h100,
                        Layout(pp=2, dp=2, microbatches=8, schedule="1f1b"))
    # 8 micro-batches of half the layers each, and the fill: one stage's F + B once more
    assert many == pytest.approx((8 + 1) * n / 2 * per_layer)


def test_the_order_of_the_recompute_modes_asked_for_does_not_change_the_plan() -> None:
    """Partial recomputation pairs a layout recomputing every block with its twin
    recomputing none, of the same expert-parallel size: the plan is the same whichever
    order ``plan --recompute-modes`` names the modes in, for a dense model and for an
    MoE one (whose layouts differ by ep too)."""
    for model, cl, batch, micro in (("gpt-13b", "dgx-h100", 32, 4),
                                    ("moe-1.3b", cluster(4, "A100-40GB", 4), 32, 8)):
        plans = [plan(model, cl, batch, zero_stages=(3,), schedules=("1f1b",),
                      recomputes=modes, degrees={"pp": 1}, max_microbatch_size=micro)
                 for modes in (("none", "full"), ("full", "none"))]
        first, second = ([(e.layout, round(e.step_time, 9)) for e in p.layouts]
                         for p in plans)
        assert first == second, model
        partial = {e.layout.ep for e in plans[0].layouts if e.layout.recompute_layers}
        assert partial == ({1} if model == "gpt-13b" else {1, 2, 4}), (model, partial)


def test_the_host_s_extra_launches_follow_one_h100_s_host() -> None:
    """Host-bound gpt2-125m on one H100 (micro-batches of one sequence, 8 a step; each
    configuration run twice, alternating: benchmarks/results/host-bound-1xH100-2026-12-06x7
    .json). Against the eager step recomputing nothing (the mean of the eager runs that
    recompute nothing or cheaply, 0.160 s) the steps measured: compiled 1.38-1.60x, full
    recomputation 1.79-1.82x (compiled 2.72-2.97x), selective 1.37-1.44x (compiled
    1.69-1.80x); a zero-bubble stage (rehearsed, pp 2) 1.35x a 1F1B one's. The host
    floor's ratios (``HOST_LAYER_EXTRA``, ``HOST_COMPILED_FACTOR``; 1.0 each while the
    model priced none of it) are within 20% of each: 1.5, 1.6 (2.4), 1.3 (1.5), 1.2."""
    import json
    import pathlib
    import statistics

    from minipar.theory.planner import host_seconds

    path = (pathlib.Path(__file__).parents[1] / "benchmarks" / "results"
            / "host-bound-1xH100-2026-12-06x7.json")
    measured = json.loads(path.read_text())
    runs = [r for r in measured["train"] if r["model"] == "gpt2-125m"]

    def steps(recompute: str, compiled: bool) -> list[float]:
        return [r["step_median"] for r in runs
                if r["recompute"] == recompute and r["compiled"] == compiled]
    eager = statistics.mean(steps("none", False) + steps("cheap", False))
    one = cluster(1, "H100-80GB", 1)
    cfg, plain = get_model("gpt2-125m"), Layout(microbatches=8)
    for changes in (dict(compiled=True), dict(recompute="full"), dict(recompute="selective"),
                    dict(recompute="full", compiled=True),
                    dict(recompute="selective", compiled=True)):
        ratio = statistics.mean(steps(changes.get("recompute", "none"),
                                      changes.get("compiled", False))) / eager
        model = host_seconds(cfg, one, plain.with_(**changes)) / host_seconds(cfg, one, plain)
        assert abs(model / ratio - 1) < 0.2, (changes, model, ratio)
    stage = {s: statistics.mean(max(r["compute_seconds"]) for r in measured["rehearse"]
                                if r["schedule"] == s) for s in ("1f1b", "zb")}
    piped = {s: host_seconds(cfg, one, Layout(pp=2, microbatches=8, schedule=s))
             for s in ("1f1b", "zb")}
    assert abs(piped["zb"] / piped["1f1b"] / (stage["zb"] / stage["1f1b"]) - 1) < 0.2


def test_the_plan_prices_the_blocks_compiled_as_its_command_runs_them() -> None:
    """``train`` compiles a data-parallel run's blocks on a GPU unless told
    (``Layout.compiled_by_default``), so ``plan`` prices each layout that way, and where
    the host sets the step, the eager twin, which launches less, with ``--no-compile``: a
    model far below the card (every layout host-bound) is planned eager, recomputing
    nothing or cheaply (which launches no more: 0.141 s against 0.152-0.206 measured; the
    model priced neither compilation's launches nor recomputation's, and put full
    recomputation first for a few MiB). Each layout's printed command, parsed as ``train``
    parses it, is the layout priced; gpt-13b's first runs as the default has it."""
    from minipar.__main__ import build_parser, train_config

    found = plan("small", cluster(2, "H100-80GB", 2), 8)
    first = found.layouts[0].layout
    assert first.recompute in ("none", "cheap") and not first.compiled
    data_parallel = [e.layout for e in found.layouts if e.layout.pp == 1
                     and e.layout.recompute == "none"]
    assert data_parallel and not any(lay.compiled for lay in data_parallel)
    assert "--no-compile" in data_parallel[0].command("small")
    big = plan("gpt-13b", cluster(4, "H100-80GB", 4), 16).layouts[0].layout
    assert "compile" not in " ".join(big.command("gpt-13b"))  # GPU-bound: the default
    for est in found.layouts[:20]:
        cfg = train_config(build_parser().parse_args(est.layout.command("small").split()[3:]))
        # (the theory's "adam" is train's adamw: the same states and step)
        assert cfg.layout("cuda").with_(optimizer="adam") == est.layout, est.layout.label()


def test_a_float8_plan_prints_what_train_accepts_on_a_float8_gpu(monkeypatch) -> None:
    """``plan(fp8=...)`` puts every layout's blocks in float8 (``train --fp8``): each
    printed command, parsed as ``train`` parses it, is the layout priced, and passes
    ``train``'s checks (``config.validate``; the GPU's ``fp8_supported`` answered yes, the
    ranks on gloo). Tensor parallelism runs without sp, which float8 refuses; tensorwise
    recomputes nothing cheaply, and ``hidden / tp`` off a multiple of 16 refuses tp 2:
    each counted under ``train``'s own line. Without ``fp8`` the same search is bf16's."""
    import minipar.parallel.fp8 as fp8
    from minipar.__main__ import build_parser, train_config
    from minipar.config import TrainConfig, validate

    monkeypatch.setattr(fp8, "fp8_supported", lambda device: True)
    two = cluster(2, "H100-80GB", 2)
    for recipe in ("rowwise", "tensorwise"):
        found = plan("small", two, 8, fp8=recipe)
        assert found.fp8 == recipe and len(found.layouts) > 20
        assert all(e.layout.fp8 == recipe and not e.layout.sp for e in found.layouts)
        assert any(e.layout.tp == 2 for e in found.layouts)
        assert any(e.layout.cheap_recompute for e in found.layouts) == (recipe == "rowwise")
        for est in found.layouts[:20]:
            command = est.layout.command("small").split()[3:]
            cfg = train_config(build_parser().parse_args(command))
            assert cfg.layout("cuda").with_(optimizer="adam") == est.layout, est.layout.label()
            validate(TrainConfig(**{**cfg.to_dict(), "backend": "gloo"}))
    assert not any(e.layout.fp8 for e in plan("small", two, 8).layouts)

    odd = get_model("small").with_(d_model=144, d_ff=576)  # hidden / tp 2 = 72
    refused = plan(odd, two, 8, fp8="tensorwise").rejected
    for refusal in ({"tp": 2}, {"recompute": "cheap"}):
        with pytest.raises(ValueError) as line:
            validate(TrainConfig(model="small", hidden=144, ffn=576, batch_size=8,
                                 fp8="tensorwise", dtype="bf16", **refusal))
        assert refused[str(line.value)] > 0, str(line.value)


def test_plan_fp8_says_what_float8_buys_and_refuses_a_card_without_it(capsys) -> None:
    """``plan --fp8`` plans the bf16 search too and says in one line how fast float8's
    best runs against bf16's: gpt-13b on 4 x H100, 1.2x or more (its blocks wide and
    compiled); gpt-1.3b in pipelines of 4 (eager blocks: its casts outweigh its GEMMs),
    slower, which the line says. On a card without float8 matmuls (the A100 cluster
    ``plan`` takes by default) it refuses in one line, before any layout."""
    from minipar.__main__ import main

    assert main(["plan", "--model", "gpt-13b", "--gpus", "4", "--gpu", "H100-80GB",
                 "--batch", "16", "--top", "1", "--fp8", "rowwise"]) == 0
    out = capsys.readouterr().out
    assert "--fp8 rowwise --dtype bf16 --backend nccl" in out
    line = out.rstrip().splitlines()[-1]
    assert line.startswith("float8 rowwise: ") and float(line.split()[2][:-1]) > 1.2
    assert main(["plan", "--model", "gpt-1.3b", "--gpus", "4", "--gpu", "H100-80GB",
                 "--batch", "32", "--top", "1", "--pp", "4", "--fp8", "tensorwise"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("bf16 is faster here: drop --fp8")
    assert main(["plan", "--fp8", "rowwise"]) == 2
    out, err = capsys.readouterr()
    assert not out and err.strip() == (
        "minipar plan: error: --fp8 needs GPUs with float8 matmuls: A100-80GB has none "
        "(H100-80GB, H200-141GB, B200 have them); plan without --fp8")


def test_memory_fp8_counts_what_train_s_float8_blocks_keep(tmp_path, capsys) -> None:
    """``memory --fp8`` prices a layout as ``train --fp8`` runs it on a GPU: blocks
    compiled where ``train`` compiles them (data parallelism), which keep 20 bytes a token
    and hidden unit against bf16's 32 (``layer_activations(float8_compiled=)``); eager
    under tensor parallelism, as many as bf16's."""
    import json

    from minipar.__main__ import main

    def activations(*flags: str) -> int:
        out = tmp_path / "m.json"
        assert main(["memory", "--model", "gpt-1.3b", "--accounting", "fused", *flags,
                     "--json", str(out)]) == 0
        return json.loads(out.read_text())["activations"]

    assert 0.6 < activations("--fp8", "rowwise") / activations() < 0.7
    assert "bf16 fp8=rowwise (compiled blocks)" in capsys.readouterr().out
    assert activations("--tp", "2", "--fp8", "tensorwise") == activations("--tp", "2")
