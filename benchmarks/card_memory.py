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

Each row records the optimizer kernel its run stepped with and whether its blocks ran
compiled (``optimizer_kernel``, ``compiled``: the CUDA defaults are fused AdamW and
compiled blocks, ``config.optimizer_kernel`` and ``config.use_compile``);
``--skip-recorded`` skips a layout only where a recorded row ran it with the same
kernel and compilation. ``--list`` prints the rows it would run, each with its
predicted reserve / process GiB and seconds, and runs none (no GPU needed).

A dry run on CPU (gloo, 2 ranks, tiny models): ``--device cpu --gpus 2 --models tiny``.

``--rehearse`` runs each row as ``python -m minipar rehearse`` instead: on the one GPU
of this machine, each pipeline stage's first rank alone, its peers imagined
(``engine.rehearse``). Its rows hold per rank what the card held and the compute-only
step (``compute_seconds``), never the job's step time; they do not count as recorded
for ``--skip-recorded``. ``--rerun FILE`` takes its rows from the commands of FILE's
finished rows (a recorded 4-GPU run, to hold the rehearsal to it, or a rehearsal).
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

from minipar.__main__ import build_parser, train_config  # noqa: E402
from minipar.config import optimizer_kernel, use_compile  # noqa: E402
from minipar.theory import clusters  # noqa: E402
from minipar.theory.layout import Layout  # noqa: E402
from minipar.theory.planner import Estimate, evaluate, plan  # noqa: E402

MODELS = {"gpt-1.3b": 32, "gpt-6.7b": 32, "gpt-13b": 16}  # global batch (sequences)
# The covering rows of the big models take a smaller global batch: what a rank holds
# depends on the micro-batch size and the micro-batches in flight, not on how many a
# step has (8 fill pp 4's warm-up, interleaved v 2 included), and a step is 2-4x shorter.
COVERING_BATCH = 8
# Seconds a row costs beyond its steps (spawn, build, the first step's warm-up), eager
# and compiled (h1-h8: 16-24 s eager; i2: 28-36 s compiled), and how much slower than the
# planner's step a tensor-parallel one ran (h1-h8: 1.2-1.7x).
ROW_OVERHEAD_S, TP_SLOWER = {False: 22.0, True: 36.0}, 1.7
KERNEL_FLAGS = ("--fused", "--no-fused")  # in a row's key as its ``optimizer_kernel``


def covering(model: str, n: int) -> list[dict]:
    """Hand-picked layouts that isolate each term of the memory model: every ZeRO stage,
    tp with and without sp, cp 2, pp n with each schedule, offload, recompute."""
    if model == "gpt-1.3b":
        rows = [dict(dp=n, zero=3, recompute="full", b=8),
                dict(dp=n, zero=3, recompute="selective", b=4)]
        rows += [dict(dp=n, zero=z, b=2) for z in (0, 1, 2, 3)]
        rows += [dict(tp=n, sp=True, b=4), dict(tp=n, b=4, recompute="selective"),
                 dict(dp=n // 2, cp=2, zero=1, b=4),
                 dict(dp=n, zero=2, offload=True, b=2)]
        rows += [dict(pp=n, schedule=s, b=2, m=8) for s in ("gpipe", "1f1b", "zb")]
        rows += [dict(pp=n, schedule="interleaved", virtual=2, b=2, m=8)]
        rows += [dict(pp=2, dp=n // 2, zero=1, schedule="1f1b", b=2, m=4)]
        return rows
    small = dict(batch=COVERING_BATCH)
    rows = [dict(dp=n, zero=3, recompute="full", b=4),
            dict(dp=n, zero=3, recompute="selective", b=2)]
    # (tp's steps are the slowest: half the batch, 2 micro-batches, holds the same)
    rows += [dict(tp=n, b=2, batch=COVERING_BATCH // 2),
             dict(tp=n, sp=True, b=2, batch=COVERING_BATCH // 2)]
    rows += [dict(dp=n // 2, cp=2, zero=3, b=1 if model == "gpt-13b" else 2, **small)]
    # gpt-13b's quarter fits only without its 16-bit copy and gradient sum: ZeRO-3 over
    # dp 1 with full recompute (the planner's top 5 has these shapes); ZeRO-3 refuses
    # ZB's deferred weight gradients, so ZB runs ZeRO-0 (predicted not to fit)
    big = dict(zero=3, recompute="full", **small) if model == "gpt-13b" else small
    rows += [dict(pp=n, schedule=s, b=1, **(big if s != "zb" else small),
                  **({"virtual": 2} if s == "interleaved" else {}))
             for s in ("1f1b", "interleaved", "zb", "gpipe")]
    # the host's AdamW steps 0.29e9 parameters/s per rank (docs/benchmarks.md, h7): a
    # quarter of gpt-6.7b takes ~6 s, of gpt-13b ~11 s, so offload rows step 4 times
    # (the peak is reached in the second), and come last
    rows += [dict(dp=n, zero=3 if model == "gpt-13b" else 2, offload=True, b=1, steps=4,
                  **small)]
    return rows


def layout_of(spec: dict, n: int, batch: int) -> Layout:
    batch = spec.get("batch", batch)
    tp, pp, cp = spec.get("tp", 1), spec.get("pp", 1), spec.get("cp", 1)
    dp = spec.get("dp", n // (tp * pp * cp))
    b = spec.get("b", 1)
    m = spec.get("m", batch // (dp * b))
    return Layout(tp=tp, pp=pp, dp=dp, zero=spec.get("zero", 0), microbatch_size=batch //
                  (dp * m), microbatches=m, schedule=spec.get("schedule", "1f1b"),
                  virtual=spec.get("virtual", 1), sp=spec.get("sp", False),
                  recompute=spec.get("recompute", "none"), cp=cp,
                  offload=spec.get("offload", False))


def how_it_runs(model: str, lay: Layout, backend: str, flags: list[str] | None = None
                ) -> tuple[list[str], str, bool]:
    """The ``train`` flags of ``lay`` (or ``flags`` as given), and the optimizer kernel
    and compilation that command runs with (the command line's own defaults for this
    device)."""
    flags = lay.train_flags(model) if flags is None else flags
    cfg = train_config(build_parser().parse_args(["train", *flags, "--backend", backend]))
    return flags, optimizer_kernel(cfg), use_compile(cfg)


def row_key(model: str, flags, kernel: str, compiled: bool) -> tuple:
    """What makes two rows the same run: the model, the flags (less the kernel's), the
    optimizer kernel and whether the blocks ran compiled."""
    return model, tuple(f for f in flags if f not in KERNEL_FLAGS), kernel, compiled


def estimate_s(est: Estimate, steps: int, compiled: bool) -> float:
    """Seconds a row should take: its overhead and its steps at the planner's pace (a
    layout predicted not to fit stops in its first step)."""
    step = est.step_time * (TP_SLOWER if est.layout.tp > 1 else 1.0)
    return ROW_OVERHEAD_S[compiled] + (steps if est.fits else 1) * step


def run_one(flags: list[str], steps: int, timeout: float, backend: str,
            rehearsal: bool = False) -> dict:
    command = "rehearse" if rehearsal else "train"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        cmd = [sys.executable, "-m", "minipar", command, *flags, "--backend", backend,
               "--steps", str(steps), "--json", out, "--timeout", str(timeout)]
        cmd += [] if rehearsal else ["--quiet"]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60)
        rec = {"command": " ".join([f"python -m minipar {command}", *flags, "--backend",
                                    backend]),
               "wall_s": round(time.monotonic() - t0, 1), "rc": proc.returncode}
        if proc.returncode or not os.path.exists(out):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            rec.update(status="error", error=" | ".join(tail)[-600:],
                       oom="out of memory" in (proc.stderr + proc.stdout).lower())
            return rec
        with open(out) as f:
            run = json.load(f)
    ranks = run["ranks"]
    if rehearsal:
        return {**rec, **rehearsed_row(ranks)}
    times = [max(r["step_seconds"][i] for r in ranks) for i in range(steps)]
    rec.update(optimizer_kernel=ranks[0].get("optimizer_kernel"),
               compiled=ranks[0].get("compile") is not None)
    rec.update(status="ok", losses=run["losses"], step_seconds=times,
               step_median=sorted(times[2:] or times)[len(times[2:] or times) // 2],
               ranks=[{"rank": r["rank"], "coords": r["coords"],
                       "device_memory": r.get("device_memory"),
                       "predicted_peak_bytes": r.get("predicted_peak_bytes"),
                       "memory": r.get("memory")} for r in ranks])
    return rec


def rehearsed_row(ranks: list[dict]) -> dict:
    """A rehearsal's row: per rank what the card held, the model's prediction, the
    median compute-only step after the first, or the out-of-memory line."""
    out = []
    for r in ranks:
        out.append({"rank": r["rank"], "coords": r["coords"],
                    "device_memory": r.get("device_memory"), "predicted": r["predicted"],
                    "compute_seconds": r["compute_seconds"],
                    "out_of_memory": r.get("out_of_memory"),
                    "compiled": r.get("compile") is not None,
                    "optimizer_kernel": r.get("optimizer_kernel")})
    oom = any(r["out_of_memory"] for r in out)
    return {"status": "oom" if oom else "ok", "oom": oom, "rehearsed": True, "ranks": out,
            "optimizer_kernel": out[0]["optimizer_kernel"], "compiled": out[0]["compiled"]}


def _compute(rec: dict) -> float:
    """A rehearsed row's slowest rank's compute-only step (0: none)."""
    return max([r.get("compute_seconds") or 0.0 for r in rec.get("ranks", [])] or [0.0])


def rerun_rows(path: str) -> list[tuple[str, str, list[str]]]:
    """(model, source, train flags) of every finished row of a recorded file (run or
    rehearsed), with the optimizer kernel and compilation it ran with made explicit (the
    defaults move)."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    return [(r["model"], r.get("source", ""), [
        *(f for f in r["command"].split()[4:-2] if f not in (*KERNEL_FLAGS, "--compile",
                                                             "--no-compile")),
        "--fused" if r.get("optimizer_kernel", "foreach") == "fused" else "--no-fused",
        "--compile" if r.get("compiled") else "--no-compile"])
        for r in rows if r.get("status") == "ok"]


def recorded(results: str) -> set:
    """The keys (``row_key``) of every row recorded on H100s (the card planned for; a
    row from another card is kept but does not count) that finished or ran out of
    memory."""
    seen = set()
    for name in sorted(os.listdir(results)):
        if name.startswith("card-memory-") and "xH100-" in name and name.endswith(".json"):
            with open(os.path.join(results, name)) as f:
                seen |= {row_key(r["model"], r["command"].split()[4:-2],
                                 r.get("optimizer_kernel", "foreach"), r.get("compiled", False))
                         for r in json.load(f)["rows"]
                         if (r.get("status") == "ok" or r.get("oom"))
                         and not r.get("rehearsed")}
    return seen


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
    ap.add_argument("--match", default="", help="only the rows whose label has this regex "
                    "(with --rerun: 'MODEL LABEL')")
    ap.add_argument("--skip-recorded", action="store_true",
                    help="skip what benchmarks/results/card-memory-*.json ran (or ran out of "
                         "memory in) with the same optimizer kernel and compilation")
    ap.add_argument("--rehearse", action="store_true",
                    help="each row's ranks one at a time on this machine's one GPU, their "
                         "peers imagined (python -m minipar rehearse)")
    ap.add_argument("--rerun", metavar="FILE",
                    help="the rows: the commands of FILE's finished rows")
    ap.add_argument("--list", action="store_true",
                    help="print the rows to run, each with its prediction, and run none")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "card_memory.json")
    cuda = args.device == "cuda"
    backend = "nccl" if cuda else "gloo"
    meta = {"argv": sys.argv, "gpus": args.gpus, "rehearsal": args.rehearse}
    if cuda and not args.list:
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
    seen = recorded(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
                    ) if args.skip_recorded else set()
    todo: list[tuple[str, str, clusters.Cluster, Estimate, dict]] = []
    for model, source, flags in rerun_rows(args.rerun) if args.rerun else []:
        cfg = train_config(build_parser().parse_args(["train", *flags, "--backend", backend]))
        est = evaluate(model, preset, cfg.layout(args.device))
        if re.search(args.match, f"{model} {est.layout.label()}"):
            todo.append((model, f"rerun {source}", preset, est, {"flags": flags}))
    for model in args.models.split(",") if not args.rerun else []:
        batch = MODELS.get(model, 4 * args.gpus)
        if "planner" in args.sections:
            for name, cl in where.items():
                for rank, est in enumerate(plan(model, cl, batch).layouts[: args.top]):
                    if re.search(args.match, est.layout.label()):
                        todo.append((model, f"{name} #{rank + 1}", cl, est, {}))
        if "covering" in args.sections:
            for spec in covering(model, args.gpus):
                try:
                    est = evaluate(model, preset, layout_of(spec, args.gpus, batch)
                                   .with_batch(spec.get("batch", batch)))
                except ValueError as e:
                    report["rows"].append({"model": model, "source": "covering",
                                           "status": "invalid", "error": str(e)})
                    continue
                if re.search(args.match, est.layout.label()):
                    todo.append((model, "covering", preset, est, spec))
    todo.sort(key=lambda row: row[3].layout.offload)  # the slow host steps last
    rows = []
    for model, source, cl, est, spec in todo:
        flags, kernel, compiled = how_it_runs(model, est.layout, backend, spec.get("flags"))
        if kernel != est.layout.optimizer_kernel:  # priced as the command will run
            est = evaluate(model, cl, est.layout.with_(optimizer_kernel=kernel))
        key = row_key(model, flags, kernel, compiled)
        steps = min(args.steps, spec.get("steps", args.steps))
        rows.append((model, source, est, flags, key, kernel, compiled, steps, key in seen))
        seen.add(key)
    planned = [r for r in rows if not r[-1]]
    report["meta"]["estimate_s"] = round(sum(estimate_s(r[2], r[7], r[6]) for r in planned))
    print(f"{len(planned)} rows to run (of {len(rows)}), estimated "
          f"{report['meta']['estimate_s']} s at the planner's pace", flush=True)
    if args.list:
        for model, source, est, _, _, kernel, compiled, steps, _ in planned:
            print(f"  {model:<9} {source:<12} {est.layout.label():<62} "
                  f"{est.memory['reserved'] / 2**30:5.1f} / {est.memory['process'] / 2**30:5.1f}"
                  f" GiB fits {est.fits!s:<5} {kernel:<7} "
                  f"{'compiled' if compiled else 'eager':<8} {steps:>2} steps "
                  f"{estimate_s(est, steps, compiled):4.0f} s")
        return 0
    for model, source, est, flags, _, kernel, compiled, steps, dup in rows:
        lay = est.layout
        rec = {"model": model, "source": source, "label": lay.label(),
               "planned_bytes": est.memory.get("total"), "planned_step_s": est.step_time,
               "planned_reserved": est.memory.get("reserved"),
               "planned_process": est.memory.get("process"), "steps": steps,
               "estimate_s": round(estimate_s(est, steps, compiled), 1),
               "optimizer_kernel": kernel, "compiled": compiled}
        if dup:
            rec["status"] = "duplicate"
        elif time.monotonic() - t0 > args.budget_s - 20:
            rec["status"] = "skipped"
        else:
            left = args.budget_s - (time.monotonic() - t0)
            try:
                rec.update(run_one(flags, steps, max(30.0, min(240.0, left)), backend,
                                   args.rehearse))
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
                  f"{rec.get('step_median') or _compute(rec):.3f} s "
                  f"{rec.get('error', '')[-160:]}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
