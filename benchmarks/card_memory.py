"""The planner's layouts run on the card they were planned for: memory and step time.

For each model (gpt-1.3b, gpt-6.7b, gpt-13b at the batches below) this takes the
planner's top layouts (preset cluster and, with ``--calibration``, the calibrated one)
plus a covering set of layouts (every ZeRO stage, tp, each pipeline schedule, cp,
offload, recompute), runs each as ``python -m minipar train ... --backend nccl --json``
for ``--steps`` steps, and records per rank what the card held (``device_memory``:
after build, peak allocated, peak reserved, the process's share of the card), the step
times, the losses, or the out-of-memory line. One JSON (``--out DIR``/card_memory.json),
rewritten after every row; rows past ``--budget-s`` are recorded as skipped.

    export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        NVSHMEM_DISABLE_NVLS=1
    python benchmarks/card_memory.py --out $OUT --budget-s 540 \\
        --calibration benchmarks/results/calibration-4xH100-2026-11-27f2.json

A dry run on CPU (gloo, 2 ranks, tiny models): ``--device cpu --gpus 2``.
"""

from __future__ import annotations

import os

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"})

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from minipar.theory import clusters  # noqa: E402
from minipar.theory.layout import Layout  # noqa: E402
from minipar.theory.planner import Estimate, evaluate, plan  # noqa: E402

MODELS = {"gpt-1.3b": 32, "gpt-6.7b": 32, "gpt-13b": 16}  # global batch (sequences)


def covering(model: str, n: int) -> list[dict]:
    """Hand-picked layouts that isolate each term of the memory model."""
    big = model != "gpt-1.3b"
    rows = [dict(dp=n, zero=3, recompute="full", b=4 if big else 8),
            dict(dp=n, zero=3, recompute="selective", b=2 if big else 4)]
    if not big:
        rows += [dict(dp=n, zero=z, b=2) for z in (0, 1, 2, 3)]
        rows += [dict(tp=n, sp=True, b=4), dict(tp=n, b=4, recompute="selective"),
                 dict(dp=n // 2, cp=2, zero=1, b=4),
                 dict(dp=n, zero=2, offload=True, b=2)]
        rows += [dict(pp=n, schedule=s, b=2, m=8) for s in ("gpipe", "1f1b", "zb")]
        rows += [dict(pp=n, schedule="interleaved", virtual=2, b=2, m=8)]
        rows += [dict(pp=2, dp=n // 2, zero=1, schedule="1f1b", b=2, m=4)]
    return rows


def layout_of(spec: dict, n: int, batch: int) -> Layout:
    tp, pp, cp = spec.get("tp", 1), spec.get("pp", 1), spec.get("cp", 1)
    dp = spec.get("dp", n // (tp * pp * cp))
    b = spec.get("b", 1)
    m = spec.get("m", batch // (dp * b))
    return Layout(tp=tp, pp=pp, dp=dp, zero=spec.get("zero", 0), microbatch_size=batch //
                  (dp * m), microbatches=m, schedule=spec.get("schedule", "1f1b"),
                  virtual=spec.get("virtual", 1), sp=spec.get("sp", False),
                  recompute=spec.get("recompute", "none"), cp=cp,
                  offload=spec.get("offload", False))


def run_one(flags: list[str], steps: int, timeout: float, backend: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        cmd = [sys.executable, "-m", "minipar", "train", *flags, "--backend", backend,
               "--steps", str(steps), "--quiet", "--json", out, "--timeout", str(timeout)]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60)
        rec = {"command": " ".join(["python -m minipar train", *flags, "--backend", backend]),
               "wall_s": round(time.monotonic() - t0, 1), "rc": proc.returncode}
        if proc.returncode or not os.path.exists(out):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            rec.update(status="error", error=" | ".join(tail)[-600:],
                       oom="out of memory" in (proc.stderr + proc.stdout).lower())
            return rec
        with open(out) as f:
            run = json.load(f)
    ranks = run["ranks"]
    times = [max(r["step_seconds"][i] for r in ranks) for i in range(steps)]
    rec.update(status="ok", losses=run["losses"], step_seconds=times,
               step_median=sorted(times[2:] or times)[len(times[2:] or times) // 2],
               ranks=[{"rank": r["rank"], "coords": r["coords"],
                       "device_memory": r.get("device_memory"),
                       "predicted_peak_bytes": r.get("predicted_peak_bytes"),
                       "memory": r.get("memory")} for r in ranks])
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--calibration")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--sections", default="planner,covering")
    ap.add_argument("--match", default="", help="covering rows whose label has this regex")
    ap.add_argument("--skip-recorded", action="store_true",
                    help="skip commands that benchmarks/results/card-memory-*.json ran")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "card_memory.json")
    cuda = args.device == "cuda"
    backend = "nccl" if cuda else "gloo"
    meta = {"argv": sys.argv, "gpus": args.gpus}
    if cuda:
        import torch
        meta.update(torch=torch.__version__, device=torch.cuda.get_device_name(0),
                    capacity=torch.cuda.get_device_properties(0).total_memory)
    report: dict = {"meta": meta, "rows": []}
    t0 = time.monotonic()
    preset = clusters.cluster(args.gpus, "H100-80GB", args.gpus)
    where = {"preset": preset}
    if args.calibration:
        with open(args.calibration) as f:
            where["calibrated"] = clusters.calibrated(preset, json.load(f))
    seen: set = set()
    if args.skip_recorded:  # (model, flags) of every recorded run that finished
        results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
        for name in sorted(os.listdir(results)):
            if name.startswith("card-memory-") and name.endswith(".json"):
                with open(os.path.join(results, name)) as f:
                    seen |= {(r["model"], tuple(r["command"].split()[4:-2]))
                             for r in json.load(f)["rows"] if r.get("status") == "ok"}
    todo: list[tuple[str, str, int, Estimate, dict]] = []
    for model in args.models.split(","):
        batch = MODELS.get(model, 4 * args.gpus)
        if "planner" in args.sections:
            for name, cl in where.items():
                for rank, est in enumerate(plan(model, cl, batch).layouts[: args.top]):
                    todo.append((model, f"{name} #{rank + 1}", batch, est, {}))
        if "covering" in args.sections:
            for spec in covering(model, args.gpus):
                try:
                    est = evaluate(model, preset, layout_of(spec, args.gpus, batch)
                                   .with_batch(batch))
                except ValueError as e:
                    report["rows"].append({"model": model, "source": "covering",
                                           "status": "invalid", "error": str(e)})
                    continue
                if re.search(args.match, est.layout.label()):
                    todo.append((model, "covering", batch, est, spec))
    for model, source, _, est, _ in todo:
        lay = est.layout
        flags = lay.train_flags(model)
        key = (model, tuple(flags))
        dup = key in seen
        seen.add(key)
        rec = {"model": model, "source": source, "label": lay.label(),
               "planned_bytes": est.memory.get("total"), "planned_step_s": est.step_time}
        if dup:
            rec["status"] = "duplicate"
        elif time.monotonic() - t0 > args.budget_s - 20:
            rec["status"] = "skipped"
        else:
            left = args.budget_s - (time.monotonic() - t0)
            try:
                rec.update(run_one(flags, args.steps, max(30.0, min(240.0, left)), backend))
            except subprocess.TimeoutExpired:
                rec.update(status="timeout")
        report["rows"].append(rec)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        if rec["status"] not in ("duplicate", "skipped"):
            peak = max((r["device_memory"] or {}).get("peak_reserved") or 0
                       for r in rec.get("ranks", [{"device_memory": None}]))
            print(f"[{time.monotonic() - t0:5.0f} s] {model:<9} {source:<14} "
                  f"{lay.label():<58} {rec['status']:<6} reserved {peak / 2**30:5.1f} GiB "
                  f"{rec.get('step_median', 0):.3f} s {rec.get('error', '')[-160:]}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
