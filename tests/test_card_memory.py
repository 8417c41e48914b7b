"""The memory model and the step-time model held to the card: every row measured on
4 x H100 80GB or 4 x H200 (``benchmarks/card_memory.py``, docs/benchmarks.md)
re-predicted by the planner's own functions. A change that moves a prediction away from
what the card held, or from the step it took, fails here.

Each row is predicted with the optimizer kernel it ran (its ``optimizer_kernel``:
torch's multi-tensor AdamW before 2026-11-28 i2, the fused kernel, the CUDA default,
since), which decides the step's temporary and how the allocator's cache fragments
(``theory.card.RESERVE_FITS``, one fit per kernel, ``benchmarks/reserve_fit.py``).
The reserve is the allocator's: the same on both cards while a run stays 6 GiB under
the capacity (the fit's domain); only the H100 rows say what fits an 80 GB card, and
only they are held to the step model's H100 preset, except the planner's top 5 under
the defaults, which ran on H200s (the device lent them for the 4 x H100 kind).

Bounds, from the recorded rows (2026-11-27 h1-h8, 2026-11-28 i2, j4, k1-k4, m3;
2026-12-05 p2 on one H100): with the fused kernel every 4-GPU row's predicted reserve
is within 4.3% of the measured peak (42 rows, median 1.7%), with the multi-tensor
kernel within 8.4% (48 rows, median 1.9%), the five one-H100 rows within 6.0%;
no row is under-predicted by more than 6.9%, under the planner's 7% margin (rows whose
reserve came within 6 GiB of the card are held by what ran, not by the reserve); every
layout that ran out of memory is predicted not to fit with the margin and every layout
the planner lets through with the margin ran. Step time: the planner's first three
under the defaults for each model within 9% of their step (on H200s: -7% .. +9%), every
planner row under the defaults within 12%, every data- and pipeline-parallel row on
H100 within 25%. Float8 (``rates.float8_seconds``): every recorded float8/bf16 speed at
13B's width within 0.05, what a block saves within 10%; at 1.3B's width not faster eager,
at most 0.12 too fast compiled.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from minipar.config import TrainConfig
from minipar.theory.card import FIT_OF_KERNEL, MEMORY_MARGIN, RESERVE_FITS
from minipar.theory.clusters import calibrated, cluster, load_calibration
from minipar.theory.planner import TIE_SHARE, evaluate, plan
from solutions.course import recompute_layers_runs

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
H100 = cluster(4, "H100-80GB", 4)
sys.path.insert(0, str(ROOT / "benchmarks"))
import reserve_fit  # noqa: E402  (benchmarks/reserve_fit.py: the rows and the fit)

sys.path.remove(str(ROOT / "benchmarks"))
ROWS = reserve_fit.recorded_rows()
FIELDS = set(TrainConfig.__dataclass_fields__)
MODELS = (("gpt-1.3b", 32), ("gpt-6.7b", 32), ("gpt-13b", 16))


def _predicted(r: reserve_fit.Row):
    """The planner's estimate of a recorded row's layout on the H100 preset of its size
    (4 GPUs, or one)."""
    n = r.layout.gpus
    return evaluate(r.model, H100 if n == 4 else cluster(n, "H100-80GB", n), r.layout)


def _h100_failures() -> list[dict]:
    """The H100 rows that stopped on an error, with their layout's estimate."""
    out = []
    for path in sorted(RESULTS.glob("card-memory-*4xH100-*.json")):
        for row in json.loads(path.read_text())["rows"]:
            if row.get("status") == "error" and "command" in row:
                model, lay = reserve_fit.layout_of(row)
                out.append((row, evaluate(model, H100, lay)))
    return out


def test_the_recorded_rows_are_there() -> None:
    assert len(ROWS) >= 85 and sum(r.card == "H200" for r in ROWS) >= 35
    assert sum(row.get("oom", False) for row, _ in _h100_failures()) >= 10


def test_the_reserve_constants_are_the_fit_of_the_recorded_rows() -> None:
    for name, fitted in reserve_fit.fit(ROWS).items():
        for field, value in vars(fitted).items():
            assert getattr(RESERVE_FITS[name], field) == pytest.approx(value, abs=1e-9), (
                name, field)


def test_the_reserve_is_predicted_within_the_measured_bounds() -> None:
    errors: dict[str, list[float]] = {"fused": [], "foreach": []}
    for r in (r for r in ROWS if r.in_domain):  # (nearer the capacity the cache shrinks)
        error = _predicted(r).memory["reserved"] / r.reserved - 1
        assert error > -MEMORY_MARGIN, (r.card, r.row["label"], error)  # the margin covers it
        if r.layout.gpus == 1:  # one H100's rows: within the margin (below)
            assert abs(error) < MEMORY_MARGIN, (r.row["label"], error)
            continue
        errors[FIT_OF_KERNEL[r.layout.optimizer_kernel]].append(error)
    for kernel, bound, rows in (("fused", 0.05, 35), ("foreach", 0.09, 45)):
        assert len(errors[kernel]) >= rows
        assert max(abs(e) for e in errors[kernel]) < bound, kernel
        assert statistics.median(abs(e) for e in errors[kernel]) < 0.025, kernel


def test_what_ran_out_of_memory_does_not_fit_and_what_fits_ran() -> None:
    budget = (1 - MEMORY_MARGIN) * H100.gpu_memory
    for row, est in _h100_failures():
        if row.get("oom"):
            assert est.memory["process"] > budget, row["label"]
    for r in ROWS:
        if r.card == "H100":
            assert _predicted(r).memory["process"] <= budget or r.row["status"] == "ok"


def _ran(kernel: str, compiled: bool) -> dict:
    return {(r.model, r.row["command"].replace(" --no-fused", "")): r for r in ROWS
            if (r.layout.optimizer_kernel, r.row["compiled"]) == (kernel, compiled)}


# The layouts among the planner's first three that no call has run yet, each with the
# measured row nearest to it: an entry here is a device call owed (docs/benchmarks.md).
NOT_YET_RUN = {
    # ZB-H1's rows ran (4xH200-2026-11-28k1-planner: ZeRO-2, 66.6 GiB reserved, 1.271 s)
    # while its split backward held every module's output; the engine as it is now was
    # rehearsed on one H100 (rehearsal-1xH100-2026-12-06r2-zb: 61.2 GiB reserved)
    ("gpt-6.7b", "tp=1 pp=2 dp=2 zero=1 b=2 m=8 zb head-layers=1"),
    ("gpt-6.7b", "tp=1 pp=2 dp=2 zero=2 b=2 m=8 zb head-layers=1"),
    # interleaved, its last chunk balanced for the head (the planner balances every
    # schedule's stages now): rehearsed on one H100 (rehearsal-1xH100-2026-12-06t4)
    ("gpt-6.7b", "tp=1 pp=2 dp=2 zero=2 b=2 m=8 interleaved v=2 head-layers=1"),
    ("gpt-6.7b", "tp=1 pp=2 dp=2 zero=1 b=2 m=8 interleaved v=2 head-layers=1"),
    # interleaved with its weight passes deferred (``schedules.interleaved_zero_bubble``)
    ("gpt-6.7b", "tp=1 pp=2 dp=2 zero=2 b=2 m=8 interleaved-zb v=2 head-layers=1"),
    ("gpt-6.7b", "tp=1 pp=2 dp=2 zero=1 b=2 m=8 interleaved-zb v=2 head-layers=1"),
    # ZeRO-2 under sp, since its buckets reduce during the backward: rehearsed on one
    # H100 (rehearsal-1xH100-2026-12-06r1-planner: 74.2 GiB reserved, 77.4 with NCCL's)
    ("gpt-13b", "tp=2 pp=1 dp=2 zero=2 b=8 m=1 sp recompute=full recompute-layers=30"),
    # partial recomputation (the planner's bisection, ``fewest_recomputed``): recomputing
    # 32 and 36 of 40 blocks ran (test_partial_recomputation_within_the_reserve_band), all
    # 40 at 1.586 s and 56.2 GiB reserved (4xH200, speed-gpu m1); 23 and 18 rehearsed on
    # one H100 (rehearsal-1xH100-2026-12-05r2: 66.57 and 68.43 GiB reserved)
    ("gpt-13b", "tp=1 pp=1 dp=4 zero=3 b=4 m=1 recompute=full recompute-layers=22"),
    ("gpt-13b", "tp=1 pp=1 dp=4 zero=3 b=2 m=2 recompute=full recompute-layers=18"),
    # recomputing all 5 blocks of each chunk it ran at 1.799 s, 60.7 GiB (k2-covering)
    ("gpt-13b", "tp=1 pp=4 dp=1 zero=0 b=1 m=16 interleaved v=2 recompute=full "
                "recompute-layers=2"),
    # third since a pipeline's NCCL peers are counted (theory.card.runtime_bytes): on one
    # H100, rehearsed with 23 blocks recomputed (rehearsal-1xH100-2026-12-05r2), 64.62 GiB
    # allocated, 66.13 reserved
    ("gpt-13b", "tp=2 pp=1 dp=2 zero=3 b=8 m=1 sp recompute=full recompute-layers=21"),
    # cheap recomputation in the search: the first picks rehearsed on one H100
    # (rehearsal-1xH100-2026-12-06u1-u4: compute, live and reserved peaks as predicted)
    ("gpt-1.3b", "tp=1 pp=1 dp=4 zero=2 b=8 m=1 recompute=cheap"),
    ("gpt-1.3b", "tp=1 pp=1 dp=4 zero=1 b=8 m=1 recompute=cheap"),
    ("gpt-6.7b", "tp=1 pp=1 dp=4 zero=2 b=2 m=4 recompute=full recompute-layers=1 "
                 "recompute-rest=cheap"),
    ("gpt-6.7b", "tp=1 pp=1 dp=4 zero=2 b=2 m=4 recompute=cheap"),
    ("gpt-6.7b", "tp=1 pp=1 dp=4 zero=3 b=8 m=1 recompute=full recompute-layers=3 "
                 "recompute-rest=cheap"),
    ("gpt-13b", "tp=1 pp=1 dp=4 zero=3 b=4 m=1 recompute=full recompute-layers=10 "
                "recompute-rest=cheap"),
    ("gpt-13b", "tp=2 pp=1 dp=2 zero=3 b=8 m=1 sp recompute=full recompute-layers=8 "
                "recompute-rest=cheap"),
    ("gpt-13b", "tp=1 pp=1 dp=4 zero=3 b=2 m=2 recompute=full recompute-layers=3 "
                "recompute-rest=cheap"),
}


def test_partial_recomputation_within_the_reserve_band() -> None:
    """gpt-13b dp 4 ZeRO-3 b 4, recomputing the first 32, 36 and all 40 blocks
    (``benchmarks/speed_gpu.py``, 4 x H200, 8 steps): each predicted reserve within 5% of
    the measured one, and the step shorter as fewer blocks recompute. Measured: the
    allocated peak stays at 53.4 GiB in all three (the end of the backward, where the fp32
    gradient shards are whole; the blocks that keep their activations are the last, whose
    backward runs first), while the largest reserve over the ranks grows 56.2 -> 57.4 ->
    60.4 GiB (predicted 56.4, 56.4, 58.8); steps 1.586, 1.546 and 1.513 s (predicted on
    the H100 preset: 1.679, 1.643, 1.607 s)."""
    steps = {}
    for run in recompute_layers_runs():  # each run's own train --json (lesson 07 reads them)
        cfg = TrainConfig(**{k: v for k, v in run["config"].items() if k in FIELDS})
        est = evaluate(cfg.model, H100, cfg.layout("cuda"))
        assert abs(est.memory["reserved"] / run["reserved"] - 1) < 0.05, run["layers"]
        steps[run["layers"]] = (run["step_s"], est.step_time)
    assert sorted(steps) == [32, 36, 40]
    measured, predicted = ([steps[n][i] for n in (32, 36, 40)] for i in (0, 1))
    assert measured == sorted(measured) and predicted == sorted(predicted)


def test_the_planners_first_three_under_the_defaults_ran_at_the_predicted_step() -> None:
    """The planner's first three for each model under the CUDA defaults (fused AdamW,
    compiled blocks) ran 8-10 steps (4 x H200: the H100 preset's step is the same model;
    the H200's faster memory moved the measured steps -7% .. +9% from it), each within
    5% of its predicted reserve and 9% of its predicted step (a tp layout: 25%, the band
    of ``test_tensor_and_context_parallel_steps_within_a_quarter``; gpt-13b tp 4 sp
    b 4 m 4 ran at 1.615 s against 1.794), but those in
    ``NOT_YET_RUN``, which must not have run (then they belong here). Its fourth and
    fifth have run where ``benchmarks/card_memory.py --sections planner --top 5
    --skip-recorded --list`` says so."""
    ran = _ran("fused", True) | _ran("fused", False)
    for model, batch in MODELS:
        for est in plan(model, H100, batch).layouts[:3]:
            command = est.layout.command(model)
            if (model, est.layout.label()) in NOT_YET_RUN:
                assert (model, command) not in ran, command
                continue
            assert (model, command) in ran, command
            r = ran[model, command]
            band = 0.25 if est.layout.tp > 1 or est.layout.cp > 1 else 0.09
            assert abs(est.step_time / r.row["step_median"] - 1) < band, command
            assert abs(est.memory["reserved"] / r.reserved - 1) < 0.05, command


def test_the_planners_layouts_under_the_defaults_ran_within_their_predictions() -> None:
    """The planner rows run under the CUDA defaults on 4 x H200 (2026-11-28, k1-k4: its
    top 5 for each model before recomputation that saves no memory was dropped, and
    gpt-13b's two pipeline layouts that the refitted reserve let in): every one ran 8-10
    steps without running out of memory, within 5% of its predicted reserve and 12% of
    its predicted step (measured: -3.6% .. +3.3%, and -6.6% .. +11.9%). The planner
    lets a layout through where its process held the 80 GB card's budget (less the
    margin) by more than 2 GiB (the reserve's error band at this size), and keeps out
    one that did not hold it: gpt-13b's interleaved pp 2 dp 2 ZeRO-3 held 74.56 GiB of
    the process, over the budget's 74.07 (its pipeline peers' NCCL buffers,
    ``runtime_bytes``); its 1F1B twin, 73.58, is in the band and kept out."""
    rows = [r for r in ROWS if r.row.get("source", "").startswith("preset")
            and r.row["status"] == "ok" and r.layout.optimizer_kernel == "fused"
            and r.card == "H200"]
    assert len(rows) >= 16 and {r.model for r in rows} == {m for m, _ in MODELS}
    budget = (1 - MEMORY_MARGIN) * H100.gpu_memory
    over = []
    for r in rows:
        est = _predicted(r)
        held = max(x["device_memory"]["process_used"] for x in r.row["ranks"])
        if held > budget or held < budget - 2 * 2**30:
            assert est.fits == (held <= budget), (r.row["label"], held / 2**30)
        over += [r.row["label"]] if held > budget else []
        assert abs(est.memory["reserved"] / r.reserved - 1) < 0.05, r.row["label"]
        assert abs(est.step_time / r.row["step_median"] - 1) < 0.12, r.row["label"]
    assert over == ["tp=1 pp=2 dp=2 zero=3 b=1 m=8 interleaved v=2"]


def test_the_planner_and_the_fit_check_price_a_layout_alike() -> None:
    """The planner's estimate and ``train``'s fit check are one function
    (``theory.card.card_peak``): each of the planner's first 20 layouts for each model,
    run as its printed command, is predicted the same bytes by the command line."""
    from minipar.__main__ import build_parser, train_config
    from minipar.config import predicted_bytes

    for model, batch in MODELS:
        for est in plan(model, H100, batch).layouts[:20]:
            cfg = train_config(build_parser().parse_args(est.layout.command(model).split()[3:]))
            assert predicted_bytes(cfg, cfg.model_config(), device="cuda") == \
                est.memory["process"], est.layout.label()


def test_each_row_is_predicted_with_the_kernel_it_ran() -> None:
    """The rows that ran torch's fused AdamW on H100 (gpt-13b pp 4 ZeRO-3 at dp 1,
    2026-11-28 i2) held 60.9 and 61.6 GiB: booked with the multi-tensor kernel's
    temporary (a twelfth of the model's fp32 weights on each stage, 12.7 GiB) and its
    fragmentation the model is 14-15% over; with the kernel they ran, within 5%."""
    fused = [r for r in ROWS if r.card == "H100" and r.layout.optimizer_kernel == "fused"
             and r.layout.gpus == 4]
    assert len(fused) >= 2
    for r in fused:
        memory = _predicted(r).memory
        foreach = evaluate(r.model, H100, r.layout.with_(optimizer_kernel="foreach")).memory
        assert foreach["optimizer_step"] > 12 * 2**30 and memory["optimizer_step"] == 0
        assert abs(memory["reserved"] / r.reserved - 1) < 0.05, r.row["label"]
        assert foreach["reserved"] / r.reserved - 1 > 0.12, r.row["label"]


def test_data_and_pipeline_parallel_steps_within_a_quarter() -> None:
    for r in ROWS:
        label = f" {r.row['label']} "
        if r.card == "H100" and " tp=1 " in label and "cp=" not in label \
                and "zero=0 b=2" not in label:
            predicted = _predicted(r).step_time
            assert abs(predicted / r.row["step_median"] - 1) < 0.25, (label, predicted)


def test_zero3_over_one_rank_is_priced_by_its_copies(monkeypatch) -> None:
    """ZeRO-3 at dp 1 (pp 4, gpt-13b) gathers and reduces every unit each micro-batch as
    copies in the GPU's memory. Priced at ``ZERO3_LOCAL_BYTES`` a parameter (H200 rows:
    the H100's measured paces with the H200's memory bandwidth), the five recorded rows
    are within 4% of their step (measured: -3.5% .. +3.8%); priced as free, as the
    collectives of a group of one are, they were 10-24% too fast, and this fails."""
    import dataclasses

    import minipar.theory.planner as planner

    h200 = dataclasses.replace(H100, gpu=dataclasses.replace(
        H100.gpu, memory_bandwidth=cluster(4, "H200-141GB", 4).gpu.memory_bandwidth))
    rows = [r for r in ROWS if r.layout.zero == 3 and r.layout.dp * r.layout.cp == 1
            and r.layout.gpus == 4]
    assert len(rows) >= 5

    def errors() -> list[float]:
        return [evaluate(r.model, h200 if r.card == "H200" else H100, r.layout).step_time
                / r.row["step_median"] - 1 for r in rows]
    assert max(abs(e) for e in errors()) < 0.04
    monkeypatch.setattr(planner, "ZERO3_LOCAL_BYTES", 0)
    assert min(errors()) < -0.09


# The H200's own measured paces (its block, collectives and optimizer; the H100 file's
# host): the card a tensor- or context-parallel row ran on prices it
H200 = calibrated(H100, load_calibration(str(RESULTS / "calibration-4xH200-2026-11-26e4.json")))


def test_tensor_and_context_parallel_steps_within_a_quarter() -> None:
    """Every eager tp and cp row is predicted within 25% of its measured step, each on its
    own card's paces (measured: -24% .. +23%; H200 rows on the H100 preset: up to +26%,
    gpt-13b tp 4 at 0.538 s against 0.428, the H200's block and optimizer 6% and 20%
    faster). tp and cp collectives keep their calibrated seconds; the host's launches set
    a floor per layer pass (``planner.HOST_LAYER_EXTRA``). The model that multiplied every
    tp and cp call by a host slowdown of 4 (and added sp's isolated extra as GPU time)
    missed these rows by +44% .. +121% on H200 (gpt-6.7b tp 4 0.440 s against 0.244, sp
    0.662 against 0.418; gpt-13b tp 4 0.762 against 0.428, sp 1.056 against 0.477; dp 2
    cp 2 ZeRO-3 0.775 against 0.538 and 2.411 against 1.330).

    Left out, and counted so that none is dropped silently: gpt-13b tp 2 dp 2 ZeRO-3 sp
    (4xH100-2026-11-27h1/h2, 2.9-5.7 s), predicted 38-59% under. ZeRO-3 then gathered
    and reduced each weight that sp leaves replicated over tp in a call of its own
    (3,248 all-gathers and 1,136 fp32 reduce-scatters a step, profiles-4xH100-
    2026-11-27h6: latency- and host-bound); it now keeps them in one flat per unit
    (``tests/test_engine.py``), not yet run on a GPU."""
    rows = [r for r in ROWS if (r.layout.tp > 1 or r.layout.cp > 1) and not r.row["compiled"]]
    gathered_per_tensor = [r for r in rows if r.card == "H100" and r.layout.tp > 1
                           and r.layout.zero == 3]
    assert len(rows) == 14 and len(gathered_per_tensor) == 4
    for r in rows:
        if r in gathered_per_tensor:
            continue
        est = evaluate(r.model, H200 if r.card == "H200" else H100, r.layout)
        assert abs(est.step_time / r.row["step_median"] - 1) < 0.25, (r.row["label"], est.time)


def _card_memory(*args: str, timeout: float = 120) -> str:
    """``benchmarks/card_memory.py`` with ``args``, run as the lead runs it; its stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "card_memory.py"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_the_covering_rows_are_listed_with_their_kernel_and_prediction(tmp_path) -> None:
    """``--list`` (no GPU): the big models' covering rows, each with its predicted GiB,
    the kernel and compilation its command runs with on CUDA; ``--skip-recorded`` leaves
    out only what ran on an H100 with the same kernel and compilation (gpt-13b's top 5
    under the defaults ran on H200s, and the first also under another kernel: all five
    are listed)."""
    out = _card_memory("--out", str(tmp_path), "--sections", "covering", "--models",
                       "gpt-6.7b,gpt-13b", "--steps", "10", "--skip-recorded", "--list")
    rows = [line.split() for line in out.splitlines()[1:]]
    head = out.split()  # "N rows to run (of M), ..."
    to_run, of = int(head[0]), int(head[5].strip("),"))
    assert of == 20 and len(rows) == to_run >= 18  # less what ran under the same settings
    assert {r[0] for r in rows} == {"gpt-6.7b", "gpt-13b"}
    labels = [" ".join(r[2:r.index("GiB") - 3]) for r in rows]
    for model in ("gpt-6.7b", "gpt-13b"):
        mine = [label for r, label in zip(rows, labels) if r[0] == model]
        assert sum(label.startswith("tp=4 ") for label in mine) == 2
        assert any(label.startswith("tp=4 ") and label.endswith(" sp") for label in mine)
        assert sum(" cp=2 " in label for label in mine) == 1
        assert {s for label in mine for s in ("1f1b", "interleaved", "zb", "gpipe")
                if label.startswith("tp=1 pp=4 ") and f" {s}" in label} == {
            "1f1b", "interleaved", "zb", "gpipe"}
        assert sum(label.endswith("offload") for label in mine) == 1
    for r, label in zip(rows, labels):
        kernel, compiled = r[r.index("GiB") + 3], r[r.index("GiB") + 4] == "compiled"
        assert kernel == ("host" if "offload" in label else "fused"), r
        assert compiled == (" tp=1 pp=1 " in f" {label} " and "cp=" not in label), r
        assert 0 < float(r[r.index("GiB") - 3]) < float(r[r.index("GiB") - 1]) < 100, r
    planner = _card_memory("--out", str(tmp_path), "--sections", "planner", "--models",
                           "gpt-13b", "--skip-recorded", "--list")
    assert planner.startswith("5 rows to run (of 5)")  # H200 rows do not count: the
    assert "zero=3 b=4 m=1 recompute=full" in planner  # 80 GB card's runs are wanted


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> Path:
    """One covering row run on CPU ranks (gloo, 2 ranks, tiny), as the lead runs it: the
    folder of its ``card_memory.json`` (the next test reads it, the one after reruns it)."""
    out = tmp_path_factory.mktemp("real")
    _card_memory("--out", str(out), "--device", "cpu", "--gpus", "2", "--models",
                 "tiny", "--sections", "covering", "--match", "pp=2 .*1f1b", "--steps", "2",
                 "--budget-s", "200", timeout=260)
    return out


def test_a_dry_run_records_the_kernel_and_the_prediction(dry_run) -> None:
    """On CPU ranks (gloo, 2 ranks, tiny): one covering row runs, and its record says
    the kernel torch stepped with (one tensor at a time, the CPU default), eager, and
    each rank's predicted peak beside its measurements."""
    report = json.loads((dry_run / "card_memory.json").read_text())
    [row] = [r for r in report["rows"] if r["status"] != "invalid"]
    assert row["status"] == "ok", row
    assert (row["optimizer_kernel"], row["compiled"]) == ("fused", False)
    assert row["planned_reserved"] > 0 and len(row["step_seconds"]) == 2
    assert all(r["predicted_peak_bytes"] > 0 for r in row["ranks"])


def test_a_dry_run_rehearses_a_recorded_files_commands(dry_run, tmp_path) -> None:
    """``--rehearse --rerun FILE`` on the CPU: the finished row of the dry run above is
    rehearsed rank by rank (each pipeline stage's first rank alone), with the kernel and
    compilation it ran with made explicit; the row says it was rehearsed, and each rank
    carries the memory model's prediction and its compute-only step."""
    again = tmp_path / "rehearsed"
    _card_memory("--out", str(again), "--device", "cpu", "--gpus", "2", "--rehearse",
                 "--rerun", str(dry_run / "card_memory.json"), "--steps", "2", timeout=260)
    [row] = json.loads((again / "card_memory.json").read_text())["rows"]
    assert row["status"] == "ok" and row["rehearsed"], row
    assert row["command"].startswith("python -m minipar rehearse ")
    assert "--fused" in row["command"] and "--no-compile" in row["command"]
    assert [r["coords"]["pp"] for r in row["ranks"]] == [0, 1]
    assert all(r["predicted"]["live"] > 0 and r["compute_seconds"] > 0 for r in row["ranks"])


def test_the_planner_on_one_h100() -> None:
    """The planner's top 5 for gpt-1.3b on one H100 80GB (batch 32 x 2048, the CUDA
    defaults, cheap recomputation in the search; ``card_memory.py --gpus 1``, 2026-12-06
    u3), re-predicted now: each ran 10 steps, the planner's first is the measured fastest
    or ties with it holding less (ZeRO-0 recomputing cheaply, 1.147 s and 49.9 GiB
    reserved, against keeping everything, 1.101 s and 61.6), every step within 9% of its
    prediction (measured +2.2% .. +7.1%), and no process under-predicted by the planner's
    margin (measured -3.9% .. +4.1%). The live tensors are predicted to 0.2%."""
    one = cluster(1, "H100-80GB", 1)
    path = RESULTS / "card-memory-defaults-1xH100-2026-12-06u3-planner.json"
    rows = json.loads(path.read_text())["rows"]
    best = plan("gpt-1.3b", one, 32).layouts[:5]
    ran = {r["label"]: r for r in rows}
    assert sorted(ran) == sorted(e.layout.label() for e in best)
    assert all(r["status"] == "ok" for r in rows)
    fastest, first = min(rows, key=lambda r: r["step_median"]), ran[best[0].layout.label()]
    # the first is the measured fastest, or ties with it (``planner.TIE_SHARE``) holding
    # less: cheap recomputation, 4.2% slower than keeping everything and 11.7 GiB lighter
    assert first is fastest or (
        first["step_median"] <= fastest["step_median"] * (1 + TIE_SHARE)
        and _reserved(first) < _reserved(fastest))
    for est in best:
        r = ran[est.layout.label()]
        assert est.layout.command("gpt-1.3b") == r["command"]
        assert abs(est.step_time / r["step_median"] - 1) < 0.09, r["label"]
        held = max(x["device_memory"]["process_used"] for x in r["ranks"])
        assert est.memory["process"] / held - 1 > -MEMORY_MARGIN, r["label"]
        allocated = max(x["device_memory"]["peak_allocated"] for x in r["ranks"])
        assert abs(est.memory["total"] / allocated - 1) < 0.01, r["label"]


def test_moe_on_one_h100_trains_at_its_recipe_rate_as_planned() -> None:
    """The planner's first two for moe-1.3b on one H100 (batch 8 x 2048), run with no
    ``--lr`` or ``--warmup`` (the DeepSpeed-MoE recipe's 1.2e-4) for 20 and 10 steps
    (``benchmarks/results/moe-rate-1xH100-2026-12-07z1``): the loss falls (11.240 to
    10.974 at best), each step is within 9% of its prediction (measured -3.9%, -4.0%),
    the process is under-predicted by less than the margin (-3.0%, -2.9%), the live
    tensors within 3% (-2.5%, -2.4%: the experts' dispatch holds a little the model does
    not count) and the reserved peak within 5% (-1.1% both)."""
    one = cluster(1, "H100-80GB", 1)
    folder = RESULTS / "moe-rate-1xH100-2026-12-07z1"
    for est, name in zip(plan("moe-1.3b", one, 8).layouts[:2], ("pick1", "pick2")):
        run = json.loads((folder / f"moe_{name}.json").read_text())
        rank, memory = run["ranks"][0], run["ranks"][0]["device_memory"]
        assert run["config"]["lr"] is None and run["config"]["warmup"] is None
        assert min(run["losses"]) < run["losses"][0] - 0.1, name
        assert math.isfinite(run["losses"][-1]) and run["losses"][-1] < run["losses"][0]
        assert est.layout.command("moe-1.3b") in (folder / "plan.txt").read_text()
        step = statistics.median(rank["step_seconds"][2:])
        assert abs(est.step_time / step - 1) < 0.09, name
        assert est.memory["process"] / memory["process_used"] - 1 > -MEMORY_MARGIN, name
        assert abs(est.memory["total"] / memory["peak_allocated"] - 1) < 0.03, name
        assert rank["predicted_peak_bytes"] == pytest.approx(est.memory["process"], rel=1e-3)
        assert abs(rank["predicted_peak_bytes"] / memory["peak_reserved"] - 1) < 0.05, name


def _reserved(row: dict) -> int:
    return max(x["device_memory"]["peak_reserved"] for x in row["ranks"])


def _run_of(command: str) -> tuple:
    """A recorded ``python -m minipar train ...`` command as ``train`` parses it: its
    config, model and layout on the GPU."""
    from minipar.__main__ import build_parser, train_config

    cfg = train_config(build_parser().parse_args(command.split()[3:]))
    return cfg, cfg.model_config(), cfg.layout("cuda")


def test_float8_blocks_are_predicted_at_the_measured_peak() -> None:
    """Compiled blocks whose linears multiply in float8 keep 12 bytes a token and hidden
    unit fewer than 16-bit ones (``theory.memory.layer_activations``, ``float8_compiled``):
    every float8 row and its bf16 twin on one H100 (gpt-1.3b, and gpt-13b's first 6 of 40
    blocks at full width; ``benchmarks/fp8_gpu.py --sections speed1``), the live-tensor
    peak against ``max_memory_allocated``. Measured within -0.15%; checked at 0.5%. Counted
    as the 16-bit block (the mutation), the float8 rows are 6-13% over."""
    from minipar.theory.card import card_peak

    rows = [r for path in sorted(RESULTS.glob("fp8-*1xH100-*.json"))
            for r in json.loads(path.read_text())["sections"].get("speed1", {}).get("rows", [])
            if r.get("status") == "ok"]
    assert len(rows) == 9 and sum(r["fp8"] is not None for r in rows) == 6
    for r in rows:
        cfg, model, layout = _run_of(r["command"])
        assert layout.compiled and layout.fp8 == r["fp8"]
        live = card_peak(model, layout)["total"] / 2**30
        assert live == pytest.approx(r["peak_gib"], rel=5e-3), r["name"]
        as_bf16 = card_peak(model, layout.with_(fp8=None))["total"] / 2**30
        assert (as_bf16 / r["peak_gib"] - 1 > 0.05) == (r["fp8"] is not None), r["name"]


def _speeds(path: str, section: str) -> dict[str, tuple]:
    """A recorded file's runs by name: (step seconds, model, layout as ``train`` ran it)."""
    rows = json.loads((RESULTS / path).read_text())["sections"][section]["rows"]
    return {r["name"]: (r["step_s"], *_run_of(r["command"])[1:]) for r in rows
            if r.get("step_s")}


def _predicted_step(model, layout, gpus: int = 1) -> float:
    return evaluate(model, cluster(gpus, "H100-80GB", gpus), layout).step_time


# gpt-13b's first 6 blocks at full width on one H100, blocks compiled, bf16 against float8
# (run name of bf16, of float8): full recomputation, 4 x 2048 a step (p1: rowwise; p6:
# tensorwise cast once a step, as the engine casts it now); no recomputation, 8 x 2048 in
# 2 micro-batches (p3, p5)
SLICE_13B = {
    ("speed-gpu-slice-13b-1xH100-2026-12-05p1.json", "slice"): [
        ("minipar gpt-13b x6 full recompute compiled",
         "minipar gpt-13b x6 full recompute compiled rowwise")],
    ("speed-gpu-slice-13b-tensorwise-once-1xH100-2026-12-05p6.json", "slice"): [
        ("minipar gpt-13b x6 full recompute compiled",
         "minipar gpt-13b x6 full recompute compiled tensorwise")],
    ("fp8-slice-13b-1xH100-2026-12-05p3.json", "speed1"): [
        ("gpt-13b x6 bf16 microbatches=2", "gpt-13b x6 rowwise microbatches=2")],
    ("fp8-slice-13b-tensorwise-once-1xH100-2026-12-05p5.json", "speed1"): [
        ("gpt-13b x6 bf16 microbatches=2", "gpt-13b x6 rowwise microbatches=2"),
        ("gpt-13b x6 bf16 microbatches=2", "gpt-13b x6 tensorwise microbatches=2")],
}


def test_float8_at_13b_width_is_priced_at_its_measured_speed() -> None:
    """The step model prices float8 (``rates.float8_seconds``): the blocks' linear GEMMs at
    the card's float8 rate times the matmul efficiency, their casts' bytes at its memory
    bandwidth. At 13B's width on one H100, compiled, every recorded float8/bf16 speed is
    predicted within 0.05 (measured: rowwise 1.227 with full recomputation, 1.162 and
    1.185 without; tensorwise 1.249 and 1.248; predicted 1.190, 1.196, 1.196, 1.213,
    1.228), and with full recomputation what float8 saves a block within 10% (8.3 ms
    rowwise, 8.9 tensorwise; predicted 8.0 and 8.7). p1's tensorwise row, 1.201, ran the
    engine's earlier tensorwise, which cast each operand afresh for each GEMM."""
    for (path, section), pairs in SLICE_13B.items():
        runs = _speeds(path, section)
        for bf16, float8 in pairs:
            (b, model, lay16), (f, _, lay8) = runs[bf16], runs[float8]
            assert lay8 == lay16.with_(fp8=lay8.fp8) and lay8.compiled, float8
            p16, p8 = _predicted_step(model, lay16), _predicted_step(model, lay8)
            assert abs(p16 / p8 - b / f) < 0.05, (float8, p16 / p8, b / f)
            if lay8.recompute == "full":
                saved, measured = (p16 - p8) / model.n_layer, (b - f) / model.n_layer
                assert abs(saved / measured - 1) < 0.10, (float8, saved, measured)


def test_the_planners_float8_pick_computes_as_rehearsed() -> None:
    """gpt-13b on 4 x H100 (batch 16): ``plan(fp8=...)``'s first layout for each recipe is
    dp 4 ZeRO-3 b 4 recomputing 9 of 40 blocks in full, the fit rehearsed on one H100
    beside the bf16 pick (10 of 40 in full, the rest cheaply): each rank's compute
    (``stage_compute``) predicted within +2% .. +6% (measured: rowwise 0.978 s, tensorwise
    0.914, bf16 1.228; predicted +3.6%, +4.5%, +4.7%), and float8's speed over bf16's
    within 0.05 (measured 1.26x and 1.34x, with 10 blocks in full 1.24x and 1.33x;
    predicted 1.27x and 1.35x, 1.26x and 1.34x)."""
    from minipar.theory.planner import stage_compute

    h100 = cluster(4, "H100-80GB")
    rows = json.loads((RESULTS / "rehearsal-1xH100-2026-12-06u1-u4.json").read_text())
    computes = {}
    for row in rows["fp8_fit"]:
        _, model, layout = _run_of(row["command"].replace(" rehearse ", " train "))
        predicted = stage_compute(model, h100, layout)
        assert 0.02 < predicted / row["compute_seconds"] - 1 < 0.06, row["name"]
        computes[row["name"]] = (row["compute_seconds"], predicted, layout)
    bf16, predicted_bf16, _ = computes.pop("bf16_c10")
    for name, (measured, predicted, layout) in computes.items():
        assert abs(predicted_bf16 / predicted - bf16 / measured) < 0.05, name
        if layout.recompute_layers == 9:  # (the theory's "adam" is train's adamw)
            first = plan("gpt-13b", H100, 16, fp8=layout.fp8).layouts[0].layout
            assert first == layout.with_(optimizer="adam"), name


def test_float8_does_not_pay_where_its_casts_outweigh_its_gemms() -> None:
    """Eager, each cast is several kernels over strided operands: one gpt-13b MLP linear's
    forward and backward on one H100 took 8.89 ms rowwise and 7.63 tensorwise against
    7.46 in bf16 (p5), which ``rates.FLOAT8_EAGER_CASTS`` is fitted to (predicted within
    3%: 8.83 and 7.68 ms). gpt-1.3b dp 4 ZeRO-3 on 4 x H100, blocks eager (h3, before the
    engine compiled them): float8 ran at 0.63x (rowwise) and 0.64x (tensorwise, then cast
    afresh for each GEMM) of bf16's speed; predicted not faster (0.71x rowwise, within
    0.1; 0.84x tensorwise). Compiled, gpt-1.3b gains little: rowwise ran at 0.97x of bf16
    on one H100 (j3, 8 x 2048 in 2 micro-batches); the model says 1.07x: it prices no
    cast kernel's fixed cost, which weighs most on narrow blocks (held within 0.12)."""
    from minipar.theory.rates import FLOAT8_EAGER_CASTS, float8_cast_bytes

    one = cluster(1, "H100-80GB", 1)
    kernel, = json.loads((RESULTS / "fp8-slice-13b-tensorwise-once-1xH100-2026-12-05p5.json"
                          ).read_text())["sections"]["kernel"]["rows"]
    m, k, n = kernel["linear_shape"]
    gemms = 6 * m * k * n * (1 / (one.gpu.fp8_flops * 0.7) - 1 / one.matmul_rate)
    for recipe in ("rowwise", "tensorwise"):
        casts = FLOAT8_EAGER_CASTS * float8_cast_bytes(recipe, m, ((k, n),))
        predicted = kernel["linear_bf16_ms"] + 1e3 * (gemms + casts / one.gpu.memory_bandwidth)
        assert abs(predicted / kernel[f"linear_{recipe}_ms"] - 1) < 0.03, recipe

    runs = _speeds("fp8-4xH100-2026-11-27h3.json", "speed")
    b, model, lay16 = runs["gpt-1.3b bf16 dp=4 zero=3"]
    eager = lay16.with_(compiled=False)
    for recipe, measured in (("rowwise", 0.63), ("tensorwise", 0.64)):
        step, _, lay8 = runs[f"gpt-1.3b {recipe} dp=4 zero=3"]
        assert b / step == pytest.approx(measured, abs=0.01)
        speed = _predicted_step(model, eager, 4) / _predicted_step(
            model, lay8.with_(compiled=False), 4)
        assert speed < 1, recipe
        if recipe == "rowwise":
            assert abs(speed - measured) < 0.1

    runs = _speeds("fp8-peer-1xH100-2026-11-28j3.json", "speed1")
    (b, model, lay16), (f, _, lay8) = (runs[f"gpt-1.3b {x} microbatches=2"]
                                       for x in ("bf16", "rowwise"))
    speed = _predicted_step(model, lay16) / _predicted_step(model, lay8)
    assert lay8.compiled and 0 < speed - b / f < 0.12


def test_float8_speed_by_width_on_one_h100() -> None:
    """Compiled blocks, 8 x 2048 in 2 micro-batches, one H100, bf16 and both recipes in
    one job (``fp8_gpu.py --sections speed1``, 2026-12-07 z2): float8's speed over bf16's
    measured / predicted: gpt-1.3b (width 2,048) rowwise 0.984 / 1.072, tensorwise
    1.066 / 1.119; gpt-6.7b's first 8 blocks (4,096) 1.145 / 1.176 and 1.203 / 1.213.
    Held within 0.1, and never below the measurement. What it gets wrong
    (``fp8_gemm_rates.py`` in the same call): the blocks' GEMMs run at 655-690 TFLOP/s in
    bf16 and 1,090-1,221 in float8, not the 772 and 1,385 of 8192^3, and their casts
    take 1.3-1.9x their bytes at the data sheet's bandwidth (docs/benchmarks.md)."""
    folder = "fp8-width-1xH100-2026-12-07z2"
    measured = {("gpt-1.3b", "rowwise"): 0.984, ("gpt-1.3b", "tensorwise"): 1.066,
                ("gpt-6.7b x8", "rowwise"): 1.145, ("gpt-6.7b x8", "tensorwise"): 1.203}
    for width in ("w2048", "w4096"):
        runs = _speeds(f"{folder}/{width}.json", "speed1")
        (model_name,) = {name.split(" bf16")[0] for name in runs if " bf16 " in name}
        b, model, lay16 = runs[f"{model_name} bf16 microbatches=2"]
        for recipe in ("rowwise", "tensorwise"):
            f, _, lay8 = runs[f"{model_name} {recipe} microbatches=2"]
            assert lay8 == lay16.with_(fp8=recipe) and lay8.compiled
            assert b / f == pytest.approx(measured[model_name, recipe], abs=5e-4)
            speed = _predicted_step(model, lay16) / _predicted_step(model, lay8)
            assert 0 <= speed - b / f < 0.1, (model_name, recipe, speed, b / f)


def test_cheap_recomputation_and_the_chunked_loss_on_one_h100() -> None:
    """``benchmarks/results/recompute-cheap-1xH100-*`` (2026-12-05, calls q1-q2): the live
    peak of every row (gpt-13b's first 6 blocks and gpt-1.3b, kept, cheaply recomputed,
    3 blocks in full with the rest cheap or not, the chunked loss) predicted within 0.5%
    (measured: -0.16% .. -0.12%); counted as keeping everything, the cheap and chunked
    rows are 6% to 19% over. Cheap recomputation's extra step (against the same run
    eager, keeping everything) is ``rates.cheap_recompute_seconds`` per token and layer:
    measured 3.6 ms and 28 ms against 3.6 and 23 predicted; held within 25%."""
    from minipar.theory.card import card_peak
    from minipar.theory.rates import cheap_recompute_seconds

    rows = {(r["set"], r["name"]): r for path in sorted(RESULTS.glob(
        "recompute-cheap-1xH100-*.json")) for r in json.loads(path.read_text())["rows"]}
    assert len(rows) == 10 and not any("error" in r for r in rows.values())
    for key, r in rows.items():
        cfg, model, layout = _run_of(r["command"])
        live = card_peak(model, layout)["total"] / 2**30
        assert live == pytest.approx(r["peak_gib"], rel=5e-3), key
        kept = layout.with_(recompute="none", recompute_layers=None, recompute_rest="none",
                            chunked_loss=False)
        saves = layout.recompute == "cheap" or layout.chunked_loss
        if saves:
            assert card_peak(model, kept)["total"] / 2**30 > 1.05 * r["peak_gib"], key
        if layout.recompute == "cheap":
            eager = rows[key[0], "none eager"]
            extra = cheap_recompute_seconds(model, cluster(1, "H100-80GB", 1), "bf16",
                                            "cheap") * cfg.batch_size * model.seq_len
            measured = r["step_s"] - eager["step_s"]
            assert extra * model.n_layer == pytest.approx(measured, rel=0.25), key


def test_a_second_communicator_is_counted_where_a_run_asks_for_it() -> None:
    """``--separate-reduce-group`` opens one more NCCL communicator over the dp ranks: the
    fit check counts its buffers (a rank's first communicator with peers, measured: what
    a dp run held above a lone rank), and the planner's command carries the flag."""
    from minipar.theory.card import (
        CUDA_RUNTIME_ALONE_BYTES,
        CUDA_RUNTIME_BYTES,
        runtime_bytes,
    )
    from minipar.theory.layout import Layout

    shared = TrainConfig(model="gpt-13b", dp=4, zero=3, batch_size=16, dtype="bf16",
                         backend="nccl")
    twin = TrainConfig(**{**shared.to_dict(), "separate_reduce_group": True}).layout("cuda")
    assert twin == shared.layout("cuda").with_(separate_reduce_group=True)
    assert runtime_bytes(twin) - runtime_bytes(shared.layout("cuda")) == (
        CUDA_RUNTIME_BYTES - CUDA_RUNTIME_ALONE_BYTES)
    assert "--separate-reduce-group" in twin.train_flags("gpt-13b")
    assert runtime_bytes(Layout(dp=4, zero=3)) == CUDA_RUNTIME_BYTES
