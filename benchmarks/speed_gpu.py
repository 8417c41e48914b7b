"""Compiled blocks, partial recomputation and the memory they take, against FSDP2, on GPUs.

Run from the repository root with ``PYTHONPATH=.``; one JSON (``--out FILE``), rewritten
after every row; a row failing records its error and the run goes on; rows starting
past ``--budget-s`` are recorded as skipped. Sections (``--sections``):

* ``speed``: ``python -m minipar train ... --json`` itself (what a user types; step =
  the slowest rank, median of 6 after 2 warm-ups, the first of which compiles), per row
  the command, step time, MFU over 989 TFLOP/s, peak memory, compile seconds and cache
  hits: gpt-1.3b dp N ZeRO-3, 8 sequences per GPU, eager / compiled / compiled without
  weight-gradient fusion / compiled with ``--separate-reduce-group``; gpt-13b dp N ZeRO-3
  full recompute, 4 per GPU, eager / compiled / compiled with ``--recompute-layers`` 36
  and 32 of 40, the planner's first pick with and without ``--separate-reduce-group``
  (planned with it: its buffers counted), with ``--grad-dtype bf16`` (half the
  reduce-scatters' bytes) and under ``NCCL_MAX_CTAS`` 8 and 16 (NCCL's
  kernels on fewer SMs, the overlapped blocks on more); and the FSDP2 peer
  (``benchmarks/peers.fsdp2``: ``fully_shard`` per block, bf16 parameters, fp32
  reduction, meta-device init, ``checkpoint_wrapper`` per block for 13B; torch's AdamW,
  and at 13B fused AdamW too, as minipar steps) in the same job; the planner's first
  data-parallel pick beside FSDP2 at its own fit (fused AdamW, checkpointing the first N
  blocks, N the fewest whole blocks the planner's pick without cheap recomputation
  recomputes, and N + 4; at N + 4 also with FSDP2's own separate reduce-scatter group,
  where the torch has it).
* ``memory``: one rank's allocations over build + 2 steps (``torch.cuda.memory.
  _record_memory_history``), replayed to the peak: the live bytes there grouped by the
  allocating call site (innermost frame in minipar, the benchmarks, torch.distributed,
  checkpoint, optim or autograd), the largest first; minipar (eager and compiled) and
  FSDP2 + checkpointing (torch's AdamW, and fused), gpt-13b dp N (``--memory-model`` to
  change). The raw snapshot is written beside the JSON only when ``--keep-snapshots`` and
  it is under 8 MB.
  With ``--rehearse`` each runs rank 0 alone on one GPU, its ``--gpus`` peers imagined
  (torch's fake process group: ``minipar rehearse``'s way): a 4-GPU rank's memory from
  one GPU; NCCL's buffers aside.
* ``slice`` (one GPU, ~8 min on an H100): 6 of gpt-13b's blocks at full width, eager,
  compiled and compiled in float8 (both recipes), and the peak memory of bf16 against
  rowwise named block by block; one gpt-1.3b pipeline stage's work (6 blocks, 16
  micro-batches of 2) eager and compiled, with and without weight-gradient fusion.

    export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        NVSHMEM_DISABLE_NVLS=1
    python benchmarks/speed_gpu.py --only 1.3b --out $OUT/speed_small.json --budget-s 540
    python benchmarks/speed_gpu.py --only '13b (eager|compiled$)|FSDP2 gpt-13b' \\
        --out $OUT/speed_big.json --budget-s 540
    python benchmarks/speed_gpu.py --only 'recompute-layers' --out $OUT/speed_rl.json
    python benchmarks/speed_gpu.py --sections memory --out $OUT/memory.json --budget-s 540
    python benchmarks/speed_gpu.py --sections memory --rehearse --gpus 4 --out $OUT/m.json
    python benchmarks/speed_gpu.py --sections slice --gpus 1 --out $OUT/slice.json
    python benchmarks/speed_gpu.py --device cpu --gpus 2 --out /tmp/speed.json  # dry run
"""

from __future__ import annotations

import os

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"})  # NVLink multicast off, in every rank

import argparse  # noqa: E402
import pickle  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from contextlib import nullcontext  # noqa: E402

import multigpu  # noqa: E402
import torch  # noqa: E402

from minipar.engine import imagine_peers  # noqa: E402
from minipar.meter import record_allocations  # noqa: E402
from minipar.model import get_config  # noqa: E402
from minipar.theory.clusters import cluster  # noqa: E402
from minipar.theory.planner import plan  # noqa: E402

SECTIONS = ("speed", "memory", "slice")
GiB = 2**30
WHERE = ("minipar/", "benchmarks/", "torch/distributed/", "torch/utils/checkpoint",
         "torch/optim/", "torch/autograd/")  # call sites a memory block is charged to


# --- speed: the command line's own JSON -------------------------------------------------
def cli_row(run: multigpu.Run, name: str, model: str, batch: int, flags: list[str],
            layers: int | None = None, section: str = "speed",
            env: dict[str, str] | None = None) -> None:
    """One ``python -m minipar train ... --json`` run; ``layers``: the preset's width with
    this many blocks (``--layers``), for a one-GPU slice of a model too big for one;
    ``env``: environment variables of that run alone (recorded in the row)."""
    s = run.sizes
    if layers:
        flags = flags + ["--layers", str(layers)]
    path = os.path.join(run.args.out, "train_" + "".join(c if c.isalnum() else "_"
                                                         for c in name) + ".json")
    cmd = [sys.executable, "-m", "minipar", "train", "--model", model, "--backend",
           run.backend, "--dtype", "bf16", "--batch-size", str(batch), "--steps",
           str(s.warmup + s.steps), "--json", path, "--quiet", "--lr", "3e-4"] + flags
    if run.cuda:
        cmd.append("--fused")
    else:  # the inductor's C++ build takes minutes on a CPU: graphs only
        cmd += ["--compile-backend", "aot_eager"]

    def go() -> dict:
        cap = run.timeout(540.0 if "13b" in model else 300.0)
        mc = get_config(model).with_(**({"n_layer": layers} if layers else {}))
        done = multigpu.train_json(run, cmd + ["--timeout", str(int(cap - 10))], path, cap,
                                   mc, batch, env)
        if "error" in done:
            return done
        rec, ranks, step, mfu, tokens = (done[k] for k in ("record", "ranks", "step_s",
                                                             "mfu", "tokens"))
        per_step = done["step_s_all"]
        peaks = [r.get("device_peak_bytes") or 0 for r in ranks]
        held = [r.get("device_memory") or {} for r in ranks]  # the allocator's, the process's
        comp = ranks[0].get("compile")
        command = " ".join([f"{k}={v}" for k, v in (env or {}).items()] + ["python"]
                           + cmd[1:])
        return {"command": command, "step_s": step,
                "step_s_all": per_step, "tokens_per_s": tokens / step, "mfu": mfu,
                "peak_gib": max(peaks) / GiB,
                "reserved_gib": max(h.get("peak_reserved", 0) for h in held) / GiB,
                "process_gib": max(h.get("process_used", 0) for h in held) / GiB,
                "predicted_peak_gib": max(r["predicted_peak_bytes"] for r in ranks) / GiB,
                "compile": comp, "first_step_s": per_step[0],
                "build_seconds": max(r["build_seconds"] for r in ranks),
                "losses": rec["losses"], "wall_s": rec["seconds"],
                "brief": f"{1e3 * step:.0f} ms, MFU {100 * mfu:.1f}%, peak "
                         f"{max(peaks) / GiB:.1f} GiB"
                         + (f", compile {comp['seconds']:.0f} s" if comp else "")}

    run.row(section, name, go, model=model, batch=batch, flags=flags)


def peer_row(run: multigpu.Run, name: str, model: str, batch: int, recompute: bool | int,
             fused: bool = False, separate_reduce_group: bool = False) -> None:
    spec = multigpu.peer_spec(run, "fsdp2", model, run.n, batch, recompute=recompute,
                              fused=fused, separate_reduce_group=separate_reduce_group)
    run.row("speed", name, lambda: multigpu._measure(run, spec, run.timeout(540.0)),
            model=model, batch=batch, impl="fsdp2", recompute=recompute, fused=fused,
            separate_reduce_group=separate_reduce_group)


def section_speed(run: multigpu.Run) -> None:
    n = run.n
    small, big = ("gpt-1.3b", "gpt-13b") if run.cuda else ("tiny", "small")
    zero3 = ["--dp", str(n), "--zero", "3"]
    for what, extra in (("eager", ["--no-compile"]), ("compiled", ["--compile"]),
                        ("compiled, no wgrad fusion", ["--compile", "--no-wgrad-fusion"])):
        cli_row(run, f"minipar {small} dp{n} zero3 {what}", small, 8 * n, zero3 + extra)
    cli_row(run, f"minipar {small} dp{n} zero3 compiled, separate reduce group", small, 8 * n,
            zero3 + ["--compile", "--separate-reduce-group"])
    peer_row(run, f"FSDP2 {small} dp{n}", small, 8 * n, recompute=False)
    full = zero3 + ["--recompute", "full"]
    layers = get_config(big).n_layer
    for what, extra in (("eager", ["--no-compile"]), ("compiled", ["--compile"])):
        cli_row(run, f"minipar {big} dp{n} zero3 full recompute {what}", big, 4 * n,
                full + extra)
    peer_row(run, f"FSDP2 {big} dp{n} + checkpointing", big, 4 * n, recompute=True)
    peer_row(run, f"FSDP2 {big} dp{n} + checkpointing, fused AdamW", big, 4 * n,
             recompute=True, fused=True)
    for k in (layers - layers // 10, layers - layers // 5):  # 36 and 32 of 40
        cli_row(run, f"minipar {big} dp{n} zero3 compiled recompute-layers {k}", big, 4 * n,
                full + ["--compile", "--recompute-layers", str(k)])
    cli_row(run, f"minipar {big} dp{n} the planner's pick", big, 4 * n,
            planner_flags(big, n, 4 * n))
    # the reduce-scatters on a second communicator (its buffers counted by the planner)
    cli_row(run, f"minipar {big} dp{n} the planner's pick, separate reduce group", big, 4 * n,
            planner_flags(big, n, 4 * n, separate_reduce_group=True))
    # the gradients summed and reduce-scattered in bf16 (half the reduction's bytes, as
    # FSDP2 does with its default reduce dtype; the peer here reduces in fp32)
    cli_row(run, f"minipar {big} dp{n} the planner's pick, bf16 gradient sums", big, 4 * n,
            planner_flags(big, n, 4 * n) + ["--grad-dtype", "bf16"])
    # fewer thread blocks per NCCL kernel: fewer SMs taken from the overlapped compute
    for ctas in (8, 16):
        cli_row(run, f"minipar {big} dp{n} the planner's pick, NCCL_MAX_CTAS={ctas}", big,
                4 * n, planner_flags(big, n, 4 * n), env={"NCCL_MAX_CTAS": str(ctas)})
    # the peer at its own fit: FSDP2 has no cheap recomputation, so its fastest layout on
    # the card checkpoints the fewest whole blocks that fit, as the planner's pick without
    # cheap recomputation does (and 4 more, should the peer hold more than minipar)
    k = fewest_recomputed(big, n, 4 * n)
    for first in sorted({k, min(k + 4, layers)}):
        peer_row(run, f"FSDP2 {big} dp{n} + checkpointing the first {first}, fused AdamW",
                 big, 4 * n, recompute=first, fused=True)
    # the peer's own opt-in twin of --separate-reduce-group (torch 2.13 has it)
    peer_row(run, f"FSDP2 {big} dp{n} + checkpointing the first {min(k + 4, layers)}, "
             "fused AdamW, separate reduce-scatter group", big, 4 * n,
             recompute=min(k + 4, layers), fused=True, separate_reduce_group=True)


def planner_flags(model: str, n: int, batch: int, separate_reduce_group: bool = False
                  ) -> list[str]:
    """The ``train`` flags of the planner's first data-parallel layout of ``model`` on n
    80 GB H100s (its recomputation, ZeRO stage, micro-batches), less those ``cli_row``
    sets itself."""
    first = plan(model, cluster(n, "H100-80GB", n), batch, degrees={"dp": n},
                 separate_reduce_group=separate_reduce_group).layouts[0]
    flags = first.layout.train_flags(model)
    mine = {i for i, f in enumerate(flags) if f in ("--model", "--batch-size", "--dtype")}
    return [f for i, f in enumerate(flags) if i not in mine and i - 1 not in mine]


def fewest_recomputed(model: str, n: int, batch: int) -> int:
    """The blocks the planner's first data-parallel layout recomputes in full when cheap
    recomputation is left out (on n 80 GB H100s; every block where it recomputes all)."""
    first = plan(model, cluster(n, "H100-80GB", n), batch, degrees={"dp": n},
                 recomputes=("none", "selective", "full")).layouts[0].layout
    if first.recompute != "full":
        return 0
    return first.recompute_layers or get_config(model).n_layer


# --- slice: one GPU, a model's blocks at full width ----------------------------------------
def section_slice(run: multigpu.Run) -> None:
    """Questions about a block, asked where no collective is in the way: 6 blocks of
    gpt-13b at full width (4 sequences, full recomputation: one rank's share of the dp 4
    ZeRO-3 rows) eager, compiled (with and without weight-gradient fusion), and compiled
    in float8, each recipe (whose linears have no fused weight gradient); the memory those
    hold at their peak; and one gpt-1.3b pipeline stage's work (6 blocks, 16 micro-batches
    of 2: pp 4's) eager and compiled, with and without weight-gradient fusion, whose
    ``torch._disable_dynamo`` splits a compiled block at every linear."""
    big, small = ("gpt-13b", "gpt-1.3b") if run.cuda else ("small", "tiny")
    emulate = [] if run.cuda else ["--fp8-emulate"]  # float8 matmuls need sm 89+
    for what, extra in (("eager", ["--no-compile"]), ("compiled", ["--compile"]),
                        ("compiled, no wgrad fusion", ["--compile", "--no-wgrad-fusion"]),
                        ("compiled rowwise", ["--compile", "--fp8", "rowwise", *emulate]),
                        ("compiled tensorwise", ["--compile", "--fp8", "tensorwise", *emulate])):
        cli_row(run, f"minipar {big} x6 full recompute {what}", big, 4,
                ["--recompute", "full", *extra], layers=6, section="slice")
    for what, extra in (("eager", ["--no-compile"]), ("compiled", ["--compile"]),
                        ("compiled, no wgrad fusion", ["--compile", "--no-wgrad-fusion"]),
                        ("eager, no wgrad fusion", ["--no-compile", "--no-wgrad-fusion"])):
        cli_row(run, f"minipar {small} x6 m16 {what}", small, 32,
                ["--microbatches", "16", *extra], layers=6, section="slice")
    if not run.cuda:
        run.row("slice", "snapshots", lambda: {"status": "skipped", "reason": "needs CUDA"})
        return
    for recipe in (None, "rowwise"):
        spec = multigpu.minipar_spec(run, big, 1, 4, overrides={"n_layer": 6}, compile=True,
                                     recompute="full", fp8=recipe)
        snapshot_row(run, "slice", f"memory {big} x6 full recompute compiled "
                     f"{recipe or 'bf16'}", spec, 300.0)


# --- memory: one rank's allocations replayed to the peak --------------------------------
def _site(frames: list[dict]) -> str:
    """The innermost frame of interest (``WHERE``), else the innermost Python frame."""
    for f in frames:
        if any(w in f["filename"] for w in WHERE) and f["filename"].endswith(".py"):
            return f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
    py = [f for f in frames if f["filename"].endswith(".py")]
    return f"{py[0]['filename']}:{py[0]['line']} {py[0]['name']}" if py else "(no Python)"


def peak_summary(snapshot: dict, top: int = 15) -> dict:
    """Replay the trace: live bytes at the peak, grouped by allocating call site."""
    live: dict[int, tuple[int, str]] = {}
    now = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for ev in (e for trace in snapshot["device_traces"] for e in trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], _site(ev.get("frames", [])))
            now += ev["size"]
            if now > peak:
                peak, at_peak = now, dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            now -= live.pop(ev["addr"])[0]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in at_peak.values():
        groups[site][0] += size
        groups[site][1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"peak_gib": peak / GiB, "blocks_at_peak": len(at_peak),
            "largest": [{"site": k, "gib": round(v[0] / GiB, 3), "count": v[1]}
                        for k, v in rows[:top]],
            "rest_gib": round(sum(v[0] for _, v in rows[top:]) / GiB, 3)}


def _snapshot_rank(spec: dict, keep: str | None) -> dict:
    import torch.distributed as dist

    if spec.get("rehearse"):  # launched alone: rank 0 of an imagined world (engine.rehearse)
        imagine_peers(0, spec["world"])
    mine = dist.get_rank() == 0 and torch.cuda.is_available()
    with record_allocations(max_entries=2_000_000) if mine else nullcontext():
        b = multigpu._speed_build(spec)
        for s in range(2):
            b.step_fn(s)
        if not mine:
            return {}
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    out = {**peak_summary(snap), "max_allocated_gib": torch.cuda.max_memory_allocated() / GiB}
    data = pickle.dumps(snap)
    out["snapshot_mb"] = len(data) / 2**20
    if keep and len(data) < 8 * 2**20:
        with open(keep, "wb") as f:
            f.write(data)
        out["snapshot_file"] = keep
    return out


def section_memory(run: multigpu.Run) -> None:
    if not run.cuda:
        run.row("memory", "snapshots", lambda: {"status": "skipped", "reason": "needs CUDA"})
        return
    model, n = run.args.memory_model, run.n
    layout = dict(dp=n, zero=3, recompute="full")
    specs = [("minipar eager", multigpu.minipar_spec(run, model, n, 4 * n, compile=False,
                                                     **layout)),
             ("minipar compiled", multigpu.minipar_spec(run, model, n, 4 * n, compile=True,
                                                        **layout)),
             ("FSDP2 + checkpointing", multigpu.peer_spec(run, "fsdp2", model, n, 4 * n,
                                                          recompute=True)),
             ("FSDP2 + checkpointing, fused AdamW", multigpu.peer_spec(
                 run, "fsdp2", model, n, 4 * n, recompute=True, fused=True))]
    for name, spec in specs:
        snapshot_row(run, "memory", f"{name} {model} dp{n} zero3 full recompute", spec, 540.0,
                     keep=name)


def snapshot_row(run: multigpu.Run, section: str, name: str, spec: dict, cap: float,
                 keep: str | None = None) -> None:
    """One row of rank 0's snapshot replayed to its peak (``_snapshot_rank``); the raw
    snapshot kept as ``keep``.pickle beside the JSON with ``--keep-snapshots``."""
    path = (os.path.join(run.args.out, keep.replace(" ", "_") + ".pickle")
            if keep and run.args.keep_snapshots else None)

    rehearse = run.args.rehearse
    spec = {**spec, "rehearse": rehearse}

    def go() -> dict:
        res = run.launch(_snapshot_rank, 1 if rehearse else spec["world"], spec, path,
                         cap=run.timeout(cap))
        return {**next(r for r in res if r), "rehearsed": rehearse}

    run.row(section, name, go)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--sections", default="speed", help=f"from {', '.join(SECTIONS)}")
    p.add_argument("--gpus", type=int, default=None, help="ranks (default: every GPU)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="rows starting after this many seconds are recorded as skipped")
    p.add_argument("--only", help="regular expression on 'section row-name'")
    p.add_argument("--memory-model", default="gpt-13b")
    p.add_argument("--keep-snapshots", action="store_true")
    p.add_argument("--rehearse", action="store_true",
                   help="memory and slice snapshots: rank 0 alone on one GPU, its --gpus "
                        "peers imagined (torch's fake process group, as engine.rehearse)")
    args = p.parse_args()
    sections = args.sections.split(",")
    for s in sections:
        if s not in SECTIONS:
            p.error(f"unknown section {s!r}; choose from {', '.join(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here; --device cpu for a dry run")
    run = multigpu.Run.for_script(args, "speed_gpu")
    for name in SECTIONS:
        if name in sections:
            globals()[f"section_{name}"](run)
    run.save()
    print(f"wrote {run.path} in {time.monotonic() - run.t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
