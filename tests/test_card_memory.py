"""The memory model and the step-time model held to the card: every row measured on
4 x H100 80GB (``benchmarks/card_memory.py``, docs/benchmarks.md) re-predicted by the
planner's own functions. A change that moves a prediction away from what the card held,
or from the step it took, fails here.

Each row is predicted with the optimizer kernel it ran (its ``optimizer_kernel``:
torch's multi-tensor AdamW before 2026-11-28 i2, the fused kernel, the CUDA default,
since), which decides the step's temporary.

Bounds, from the recorded rows (2026-11-27, h1-h3 and h7): below 74 GiB of reserve (the
fit's domain; nearer the card's capacity the allocator frees its cache) the predicted
reserve is within 8.3% of the measured peak on every row and within 5% on the median
(32 of 42 rows); no row is under-predicted by more than 6.0%, under the planner's 7%
margin; every layout that ran out of memory is predicted not to fit with the margin and
every layout the planner lets through with the margin ran. Step time: the planner's top
5 for each model (h7) within 10% (worst -10%), every data- and pipeline-parallel row
within 25%.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from minipar.theory.clusters import cluster
from minipar.theory.layout import Layout
from minipar.theory.memory import MEMORY_MARGIN
from minipar.theory.planner import evaluate, plan

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
H100 = cluster(4, "H100-80GB", 4)


def _flags(command: str) -> dict:
    words, out, i = command.split()[3:], {}, 0
    while i < len(words):
        key = words[i][2:]
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            out[key], i = words[i + 1], i + 2
        else:
            out[key], i = True, i + 1
    return out


def _rows(pattern: str = "card-memory-*4xH100-*.json",
          dedup: bool = True) -> list[tuple[dict, dict, float]]:
    """(row, predicted memory, predicted step seconds) for each recorded run, once per
    command, optimizer kernel and compilation unless ``dedup`` is false, predicted with
    the kernel it ran (each row's ``optimizer_kernel``)."""
    rows, seen = [], set()
    for path in sorted(RESULTS.glob(pattern), reverse=True):  # the latest run of each
        for row in json.loads(path.read_text())["rows"]:
            key = (row.get("command"), row.get("optimizer_kernel"), row.get("compiled"))
            if "command" not in row or (dedup and key in seen):
                continue
            seen.add(key)
            f = _flags(row["command"])
            dp, pp, tp, cp = (int(f.get(k, 1)) for k in ("dp", "pp", "tp", "cp"))
            m, batch = int(f["microbatches"]), int(f["batch-size"])
            lay = evaluate(f["model"], H100, Layout(
                dp=dp, pp=pp, tp=tp, cp=cp, zero=int(f["zero"]), microbatch_size=batch // (dp * m),
                microbatches=m, schedule=f.get("schedule", "1f1b"),
                virtual=int(f.get("virtual", 1)), head_layers=int(f.get("head-layers", 0)),
                sp=bool(f.get("sp")), recompute=f.get("recompute", "none"),
                offload=bool(f.get("offload")), optimizer_kernel=row["optimizer_kernel"]))
            rows.append((row, lay.memory, lay.step_time))
    return rows


def test_the_recorded_rows_are_there() -> None:
    rows = _rows()
    assert sum(r["status"] == "ok" for r, _, _ in rows) >= 40
    assert sum(r.get("oom", False) for r, _, _ in rows) >= 10


def test_the_reserve_is_predicted_within_the_measured_bounds() -> None:
    errors = []
    for row, memory, _ in _rows():
        if row["status"] != "ok":
            continue
        reserved = max(r["device_memory"]["peak_reserved"] for r in row["ranks"])
        error = memory["reserved"] / reserved - 1
        assert error > -MEMORY_MARGIN, (row["label"], error)  # the margin covers it
        if reserved < 74 * 2**30:
            errors.append(error)
            assert abs(error) < 0.09, (row["label"], error)
    assert len(errors) >= 40
    assert statistics.median(abs(e) for e in errors) < 0.05


def test_what_ran_out_of_memory_does_not_fit_and_what_fits_ran() -> None:
    budget = (1 - MEMORY_MARGIN) * H100.gpu_memory
    for row, memory, _ in _rows():
        if row.get("oom"):
            assert memory["process"] > budget, row["label"]
        elif memory["process"] <= budget:
            assert row["status"] == "ok", row["label"]


def test_the_planners_top_five_ran_at_the_predicted_step() -> None:
    """Each layout the planner puts in its top 5 for gpt-1.3b, gpt-6.7b and gpt-13b on
    the 4 x H100 preset (which is also the calibrated answer: the calibration file is the
    preset's), priced with the optimizer kernel the recorded runs stepped with (torch's
    multi-tensor AdamW, eager blocks), has a recorded run of 6-10 steps under those
    settings, at a step within 12% of the predicted one. (The top 5 under today's CUDA
    defaults, fused and compiled, are listed by ``benchmarks/card_memory.py --list``
    with the runs they still lack.)"""
    ran = {(r["model"], r["command"], r["optimizer_kernel"], r["compiled"]): (r, step)
           for r, _, step in _rows() if r["status"] == "ok"}
    missing, off = [], []
    for model, batch in (("gpt-1.3b", 32), ("gpt-6.7b", 32), ("gpt-13b", 16)):
        for lay in plan(model, H100, batch, optimizer_kernel="foreach").layouts[:5]:
            # those runs predate --no-fused: their command ran the kernel without the flag
            command = lay.layout.command(model).replace(" --no-fused", "")
            key = (model, command, "foreach", False)
            if key not in ran:
                missing.append(command)
                continue
            row, predicted = ran[key]
            if abs(predicted / row["step_median"] - 1) >= 0.12:
                off.append(f"{command}: {predicted:.3f} s predicted, "
                           f"{row['step_median']:.3f} measured")
    assert not missing and not off, (
        "\n".join(["no recorded run (benchmarks/card_memory.py --sections planner "
                   "--skip-recorded runs them):", *missing, "steps off by 12% or more:", *off]))


def test_each_row_is_predicted_with_the_kernel_it_ran() -> None:
    """The rows that ran torch's fused AdamW (the CUDA default; gpt-13b pp 4 ZeRO-3 at
    dp 1, 2026-11-28 i2) held 60.9 and 61.6 GiB: booked with the multi-tensor kernel's
    temporary (a twelfth of the model's fp32 weights on each stage, 12.7 GiB) the model
    is 17% over; with the kernel they ran, within 3%."""
    fused = [(row, memory) for row, memory, _ in _rows() if row["optimizer_kernel"] == "fused"]
    assert len(fused) >= 2
    for row, memory in fused:
        reserved = max(r["device_memory"]["peak_reserved"] for r in row["ranks"])
        f = _flags(row["command"])
        m, batch = int(f["microbatches"]), int(f["batch-size"])
        lay = Layout(pp=int(f["pp"]), zero=int(f["zero"]), microbatch_size=batch // m,
                     microbatches=m, schedule=f["schedule"], virtual=int(f["virtual"]),
                     recompute=f["recompute"])
        foreach = evaluate(f["model"], H100, lay.with_(optimizer_kernel="foreach")).memory
        assert foreach["optimizer_step"] > 12 * 2**30 and memory["optimizer_step"] == 0
        assert abs(memory["reserved"] / reserved - 1) < 0.03, row["label"]
        assert foreach["reserved"] / reserved - 1 > 0.14, row["label"]


def test_data_and_pipeline_parallel_steps_within_a_quarter() -> None:
    for row, _, predicted in _rows():
        if row["status"] == "ok" and " tp=1 " in f" {row['label']} " and "cp=" not in \
                row["label"] and "zero=0 b=2" not in row["label"]:
            assert abs(predicted / row["step_median"] - 1) < 0.25, (row["label"], predicted)


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
    out what ran with the same kernel and compilation only (the i2 row of gpt-13b's
    planner top 5, fused and compiled), not what ran under another kernel."""
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
        assert compiled == (" tp=1 " in f" {label} " and "cp=" not in label
                            and " zb" not in label), r
        assert 0 < float(r[r.index("GiB") - 3]) < float(r[r.index("GiB") - 1]) < 100, r
    planner = _card_memory("--out", str(tmp_path), "--sections", "planner", "--models",
                           "gpt-13b", "--skip-recorded", "--list")
    assert planner.startswith("4 rows to run (of 5)")
    assert "zero=3 b=1 m=16 interleaved v=2 recompute=full" not in planner
    assert "zero=3 b=4 m=1 recompute=full" in planner  # ran, but foreach and eager


def test_a_dry_run_records_the_kernel_and_the_prediction(tmp_path) -> None:
    """On CPU ranks (gloo, 2 ranks, tiny): one covering row runs, and its record says
    the kernel torch stepped with (one tensor at a time, the CPU default), eager, and
    each rank's predicted peak beside its measurements."""
    _card_memory("--out", str(tmp_path), "--device", "cpu", "--gpus", "2", "--models",
                 "tiny", "--sections", "covering", "--match", "pp=2 .*1f1b", "--steps", "2",
                 "--budget-s", "200", timeout=260)
    report = json.loads((tmp_path / "card_memory.json").read_text())
    [row] = [r for r in report["rows"] if r["status"] != "invalid"]
    assert row["status"] == "ok", row
    assert (row["optimizer_kernel"], row["compiled"]) == ("fused", False)
    assert row["planned_reserved"] > 0 and len(row["step_seconds"]) == 2
    assert all(r["predicted_peak_bytes"] > 0 for r in row["ranks"])
