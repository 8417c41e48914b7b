"""The multi-GPU benchmark's dry run (CPU, gloo, 2 ranks) keeps working in CI.

``benchmarks/multigpu.py`` runs on GPU machines CI does not have; its ``--device cpu``
mode runs the same code at tiny sizes. Here: calibration (written in the shape
``python -m minipar plan --calibrate`` reads) and a few parity rows, including one the
engine refuses (recorded with its reason, not raised) and one cut by the budget.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_dry_run_calibrate_and_parity(tmp_path) -> None:
    out = tmp_path / "out"
    only = "calibrate|dp2 zero1 fp32|pp2 zb fp32|tp2 sp bf16|tied embeddings fp32"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "multigpu.py"), "--device", "cpu",
         "--gpus", "2", "--sections", "calibrate,parity", "--only", only,
         "--out", str(out), "--budget-s", "100"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "multigpu.json").read_text())
    rows = {r["name"]: r for r in report["sections"]["parity"]["rows"]}
    assert set(rows) == {"dp2 zero1 fp32", "pp2 zb fp32", "tp2 sp bf16",
                         "pp2 1f1b tied embeddings fp32"}
    for name in ("dp2 zero1 fp32", "pp2 zb fp32", "tp2 sp bf16"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["param_diff"] is not None
    tied = rows["pp2 1f1b tied embeddings fp32"]
    assert tied["status"] in ("ok", "refused") and (tied["status"] == "ok"
                                                    or "tie" in tied["reason"])
    assert report["meta"]["multicast_off"]["NCCL_NVLS_ENABLE"] == "0"

    from minipar.theory.clusters import calibrated, cluster, load_calibration

    calib = load_calibration(str(out / "calibration.json"))
    assert set(calib["collectives"]) == {"all_reduce", "all_gather", "reduce_scatter", "send"}
    assert calibrated(cluster(2, "H100-80GB"), calib).links
    assert (out / "summary.md").exists() and len(list(out.iterdir())) <= 8

    # --report merges JSONs on any machine; predictions need only the calibration
    merged = tmp_path / "merged"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "multigpu.py"), "--report",
         str(out / "multigpu.json"), "--out", str(merged)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(json.loads((merged / "multigpu.json").read_text())["sections"]["parity"]
               ["rows"]) == 4


def test_budget_spent_rows_are_skipped_not_lost(tmp_path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "multigpu.py"), "--device", "cpu",
         "--gpus", "2", "--sections", "parity", "--only", "dp2 zero1",
         "--out", str(out), "--budget-s", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((out / "multigpu.json").read_text())["sections"]["parity"]["rows"]
    assert rows and all(r["status"] == "skipped" for r in rows)


def test_dry_run_context_parallel_and_offload(tmp_path) -> None:
    """``--sections cp`` at tiny sizes: every minipar row runs (cp2 ring, one rank, the
    ring alone, ZeRO-1 with and without offload; ZeRO-2's pair left out for time);
    torch's CP is refused on the CPU with its reason; offload moves exactly the
    theory's bytes; the summary row and ``--report`` work on the result."""
    out = tmp_path / "out"
    calib = tmp_path / "calibration.json"  # the send link, for the ring's hidden share
    calib.write_text(json.dumps({"device": "cpu", "gpus": 2, "matmul_tflops": 0.05,
                                 "memory_bytes": 0, "collectives": {"send": {
                                     "latency_s": 1e-4, "bus_bandwidth": 1e9}}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "multigpu.py"), "--device", "cpu",
         "--gpus", "2", "--sections", "cp", "--calibration", str(calib),
         "--only", "^cp (?!minipar dp2 zero2)",
         "--out", str(out), "--budget-s", "150"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["name"]: r for r in
            json.loads((out / "multigpu.json").read_text())["sections"]["cp"]["rows"]}
    torch_cp = rows.pop("torch context_parallel cp2 seq128")
    assert torch_cp["status"] == "refused" and "CPU" in torch_cp["reason"]
    assert all(r["status"] == "ok" for r in rows.values()), rows
    assert rows["minipar cp2 seq128"]["cp_wire_bytes_per_step"] > 0
    ring = rows["ring attention cp2 seq128 (one layer)"]
    assert ring["zigzag"]["max_err_out"] < 1e-4 and ring["hidden_share"] is not None
    summary = rows["cp summary"]
    assert [o["zero"] for o in summary["offload"]] == [1]
    assert all(o["bytes_over_theory"] == 1.0 for o in summary["offload"])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "multigpu.py"), "--report",
         str(out / "multigpu.json"), "--out", str(tmp_path / "merged")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
