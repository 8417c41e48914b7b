"""multigpu.py's ``overlap`` section: how much communication the computation hides,
read from the profiler's device kernels.

On each rank, a configuration of the speed rows (the same construction code,
``multigpu._speed_build``) is warmed up, then each of a few steps runs under
``torch.profiler.profile(activities=[CPU, CUDA])``. From the device events of a step:

* communication: the NCCL kernels (a name containing ``nccl``), as a union of intervals;
* compute: every other kernel (copies and memsets are device work, not compute);
* overlapped: the communication intervals that a compute kernel on another stream of
  the same device covers (interval-union arithmetic: ``union``, ``intersect``);
* exposed: communication that no compute covers (what the step waits for);
* busy: the union of all device work; hidden share = overlapped / communication.

Configurations: gpt-1.3b at the speed rows' sizes, minipar dp N with ZeRO-1, 2 and 3
(and ZeRO-3 with ``--separate-reduce-group``: its reduce-scatters beside the gathers),
torch DDP and FSDP2 at dp N (per-GPU batch ``Sizes.per_gpu_batch``), minipar tp N with
sequence parallelism against DTensor tp N sp (global batch ``Sizes.tp_batch``), and
moe-1.3b at dp N with ep 1 and N (ZeRO-1, one sequence a micro-batch): ``a2a_s`` the
all-to-all's kernels, ``a2a_exposed_s_max`` the part no compute hides (worst rank). An
NCCL kernel's time includes waiting for the slowest peer, so part of "exposed" is rank
skew, not wire time. Rank 0's first profiled step of minipar dp N ZeRO-2 is written as a
gzipped Chrome trace under --out (Perfetto opens it). On CPU (gloo) there are no device
kernels: the rows record the CPU side (events, collectives seen) and are 'refused'.

    export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        NVSHMEM_DISABLE_NVLS=1
    # about 4 min on 4 x H100 (7 launches of about 30-35 s each)
    python benchmarks/multigpu.py --sections overlap --out $OUT --budget-s 330
    python benchmarks/multigpu.py --device cpu --gpus 2 --sections overlap --out /tmp/x \\
        --budget-s 200   # the dry run
"""

from __future__ import annotations

import gzip
import json
import os
import statistics
import time

Interval = tuple[float, float]
Kernel = tuple[str, float, float, int]  # name, start s, end s, stream

WARMUP, PROFILED = 2, 2  # steps before profiling; profiled steps (one profile each)
TRACE_LIMIT = 10 * 2**20  # bytes of the gzipped trace
DEVICE_WORK = {3, 4, 5}  # libkineto ActivityType GPU_MEMCPY, GPU_MEMSET, CONCURRENT_KERNEL
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}


# --- interval arithmetic (pure) -----------------------------------------------------------
def union(intervals) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points (empty ones dropped)."""
    out: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals) -> float:
    """Total time the intervals cover (overlaps counted once)."""
    return sum(b - a for a, b in union(intervals))


def intersect(xs, ys) -> list[Interval]:
    """The points covered by both sets of intervals, as a union."""
    xs, ys = union(xs), union(ys)
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def is_comm(name: str) -> bool:
    return "nccl" in name.lower()


def is_copy(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset"))


def is_all_to_all(name: str) -> bool:
    """NCCL runs ``all_to_all_single`` as grouped sends and receives (pp's too: an MoE
    row has no pp)."""
    return is_comm(name) and ("sendrecv" in name.lower() or "alltoall" in name.lower())


def _hidden(comm: list[Kernel], compute: list[Kernel]) -> list[Interval]:
    """Where a compute kernel on another stream runs beside the communication."""
    hidden: list[Interval] = []
    for stream in {k[3] for k in comm}:
        mine = [(a, b) for _, a, b, s in comm if s == stream]
        others = [(a, b) for _, a, b, s in compute if s != stream]
        hidden += intersect(mine, others)
    return hidden


def overlap_stats(kernels: list[Kernel]) -> dict:
    """Communication, overlapped, exposed and busy seconds of one device's events.
    A communication interval counts as overlapped where a compute kernel on another
    stream runs at the same time (kernels of one stream never overlap anyway).
    ``a2a_s`` / ``a2a_exposed_s``: the same for the all-to-all kernels alone (MoE)."""
    comm = [k for k in kernels if is_comm(k[0])]
    compute = [k for k in kernels if not is_comm(k[0]) and not is_copy(k[0])]
    hidden = _hidden(comm, compute)
    a2a = [k for k in comm if is_all_to_all(k[0])]
    a2a_s = length((a, b) for _, a, b, _ in a2a)
    comm_s, hidden_s = length((a, b) for _, a, b, _ in comm), length(hidden)
    return {"kernels": len(kernels), "nccl_kernels": len(comm), "a2a_s": a2a_s,
            "a2a_exposed_s": a2a_s - length(_hidden(a2a, compute)),
            "comm_s": comm_s, "comm_sum_s": sum(b - a for _, a, b, _ in comm),
            "overlapped_s": hidden_s, "exposed_s": comm_s - hidden_s,
            "compute_s": length((a, b) for _, a, b, _ in compute),
            "busy_s": length((a, b) for _, a, b, _ in kernels),
            "hidden_share": hidden_s / comm_s if comm_s > 0 else None}


def kernel_totals(kernels: list[Kernel], top: int = 30) -> dict:
    """Where one step's device time goes: per kind (NCCL, matmul, attention, copies, the
    rest) and the ``top`` kernel names by total time, as [name, ms, calls]."""
    def kind(name: str) -> str:
        low = name.lower()
        if is_comm(name):
            return "nccl"
        if is_copy(name):
            return "copy"
        if "flash" in low or "fmha" in low or "attention" in low:
            return "attention"
        if "gemm" in low or "cutlass" in low or "sm90_xmma" in low or "nvjet" in low:
            return "matmul"
        return "other"

    per_name: dict[str, list[float]] = {}
    per_kind: dict[str, float] = {}
    for name, a, b, _ in kernels:
        rec = per_name.setdefault(name[:100], [0.0, 0])
        rec[0] += b - a
        rec[1] += 1
        per_kind[kind(name)] = per_kind.get(kind(name), 0.0) + b - a
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"kinds_ms": {k: round(1e3 * v, 3) for k, v in per_kind.items()},
            "top": [[n, round(1e3 * t, 3), c] for n, (t, c) in ranked]}


def mean_stats(steps: list[dict]) -> dict:
    """Per-step means of ``overlap_stats`` records (the hidden share from the sums)."""
    keys = ("comm_s", "comm_sum_s", "overlapped_s", "exposed_s", "compute_s", "busy_s",
            "a2a_s", "a2a_exposed_s")
    out = {k: statistics.fmean(s[k] for s in steps) for k in keys}
    out.update(kernels=statistics.fmean(s["kernels"] for s in steps),
               nccl_kernels=statistics.fmean(s["nccl_kernels"] for s in steps),
               hidden_share=out["overlapped_s"] / out["comm_s"] if out["comm_s"] > 0
               else None)
    return out


# --- the profiler's events -----------------------------------------------------------------
def device_events(prof) -> tuple[list[Kernel], dict]:
    """(GPU kernels, copies and memsets as ``Kernel`` tuples; CPU-side counts) from a
    finished ``torch.profiler.profile``, through its Kineto events (torch 2.11-2.13)."""
    from torch.autograd import DeviceType

    kernels: list[Kernel] = []
    cpu = {"cpu_events": 0, "cpu_comm_ops": 0, "devices": set()}
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if e.device_type() != DeviceType.CUDA:
            cpu["cpu_events"] += 1
            cpu["cpu_comm_ops"] += name.startswith(("gloo:", "nccl:", "c10d::"))
            continue
        if not _device_work(e, name):
            continue  # a record_function range drawn on the GPU, a sync: not work
        start = e.start_ns() * 1e-9
        kernels.append((name, start, start + e.duration_ns() * 1e-9,
                        int(e.device_resource_id())))
        cpu["devices"].add(int(e.device_index()))
    cpu["devices"] = sorted(cpu["devices"])
    return kernels, cpu


def _device_work(e, name: str) -> bool:
    """A kernel, copy or memset (Kineto's activity types 5, 3, 4: fixed since 2021)."""
    kind = getattr(e, "activity_type", None)
    if kind is not None:
        return int(kind()) in DEVICE_WORK
    annotation = getattr(e, "is_user_annotation", None)
    return not (annotation() if annotation else name.startswith(
        ("nccl:", "gloo:", "c10d:", "Profiler", "cuda", "##")))


def write_trace(prof, path: str, limit: int = TRACE_LIMIT) -> dict:
    """``export_chrome_trace`` then gzip at ``path``; over ``limit`` bytes, the host's
    runtime calls and flow arrows go, then every host event (GPU timeline only)."""
    raw = path[:-3] if path.endswith(".gz") else path
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as f:
        text = f.read()
    os.remove(raw)
    try:
        trace = json.loads(text)
    except ValueError:  # not JSON the standard library reads: kept as it is
        with open(path, "wb") as f:
            f.write(gzip.compress(text, compresslevel=6))
        return {"trace": os.path.basename(path), "trace_bytes": os.path.getsize(path),
                "trace_kept": "all (unparsed)"}
    levels = [("all", None),
              ("no runtime calls", lambda e: e.get("cat") not in (
                  "cuda_runtime", "cuda_driver", "ac2g", "python_function")),
              ("gpu only", lambda e: e.get("ph") == "M" or e.get("cat") in GPU_CATS)]
    for level, keep in levels:
        kept = level
        if keep is not None:
            trace["traceEvents"] = [e for e in trace.get("traceEvents", []) if keep(e)]
        data = gzip.compress(json.dumps(trace).encode(), compresslevel=6)
        if len(data) <= limit:
            break
    with open(path, "wb") as f:
        f.write(data)
    return {"trace": os.path.basename(path), "trace_bytes": len(data), "trace_kept": kept}


# --- one configuration on one rank ----------------------------------------------------------
def _overlap_rank(spec: dict, profiled: int, trace: str | None) -> dict:
    """Build (``multigpu._speed_build``), warm up, then ``profiled`` steps, one profile
    each; returns per-step overlap records, CPU-side counts, losses and wall times."""
    import multigpu as mg
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    b = mg._speed_build(spec)
    device = b.device
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    warm = spec["warmup"]
    rec: dict = {"rank": dist.get_rank(), "steps": [], "cpu": [], "wall_s": [],
                 "losses": []}
    with mg._attention_context(device):
        for s in range(warm):
            rec["losses"].append(b.step_fn(s))
        for i in range(profiled):
            mg._sync(device)
            dist.barrier()
            mg._sync(device)
            with profile(activities=acts) as prof:
                t0 = time.perf_counter()
                rec["losses"].append(b.step_fn(warm + i))
                mg._sync(device)
                rec["wall_s"].append(time.perf_counter() - t0)
            kernels, cpu = device_events(prof)
            rec["steps"].append(overlap_stats(kernels))
            if i == 0:
                rec["kernel_totals"] = kernel_totals(kernels)
            rec["cpu"].append(cpu)
            if trace and i == 0 and (rec["rank"] == 0 or "{rank}" in trace):
                try:
                    rec.update(write_trace(prof, trace.format(rank=rec["rank"])))
                except Exception as e:  # the numbers matter more than the picture
                    rec["trace_error"] = f"{type(e).__name__}: {e}"
    rec["mean"] = mean_stats(rec["steps"])
    rec["peak_bytes"] = torch.cuda.max_memory_allocated(device) if cuda else 0
    return rec


def _reduce(res: list[dict]) -> dict:
    """One row from the ranks' records: the worst rank's exposed time, everyone's."""
    means = [r["mean"] for r in res]
    wall = max(statistics.median(r["wall_s"]) for r in res)
    row = {"per_rank": [{"rank": r["rank"], **r["mean"], "wall_s": r["wall_s"],
                         "cpu": r["cpu"], "kernel_totals": r.get("kernel_totals")}
                        for r in res],
           "step_s": wall, "losses": next((r["losses"] for r in res if r["losses"] and
                                            r["losses"][-1] is not None), []),
           "peak_gib": max(r["peak_bytes"] for r in res) / 2**30}
    row.update({k: r.get(k) for r in res for k in ("trace", "trace_bytes", "trace_kept",
                                                   "trace_error") if r.get(k) is not None})
    if not any(m["kernels"] for m in means):
        row.update(status="refused", reason="no device kernels on cpu",
                   cpu_events=[r["cpu"][0]["cpu_events"] for r in res],
                   cpu_comm_ops=[r["cpu"][0]["cpu_comm_ops"] for r in res])
        return row
    worst = max(means, key=lambda m: m["exposed_s"])
    comm = statistics.fmean(m["comm_s"] for m in means)
    hidden = statistics.fmean(m["overlapped_s"] for m in means)
    row.update(comm_s=comm, overlapped_s=hidden, hidden_share=hidden / comm if comm else None,
               exposed_s_max=worst["exposed_s"],
               exposed_s_mean=statistics.fmean(m["exposed_s"] for m in means),
               busy_s=statistics.fmean(m["busy_s"] for m in means),
               busy_share=statistics.fmean(m["busy_s"] for m in means) / wall,
               exposed_share=worst["exposed_s"] / wall,
               a2a_s=statistics.fmean(m["a2a_s"] for m in means),
               a2a_exposed_s_max=max(m["a2a_exposed_s"] for m in means))
    share = f"{100 * row['hidden_share']:.0f}%" if row["hidden_share"] is not None else "-"
    row["brief"] = (f"NCCL {1e3 * comm:.1f} ms/step, {share} hidden, exposed "
                    f"{1e3 * worst['exposed_s']:.1f} ms (worst rank; "
                    f"{100 * row['exposed_share']:.1f}% of {1e3 * wall:.0f} ms), GPU busy "
                    f"{1e3 * row['busy_s']:.0f} ms")
    return row


def section_overlap(run) -> None:
    import multigpu as mg

    s, n, model = run.sizes, run.n, run.sizes.speed_model
    b = s.per_gpu_batch
    rows = [(f"minipar dp{n} zero{z}", "dp", mg.minipar_spec(run, model, n, b * n, dp=n,
                                                             zero=z)) for z in (1, 2, 3)]
    rows += [(f"minipar dp{n} zero3 separate reduce group", "dp", mg.minipar_spec(
        run, model, n, b * n, dp=n, zero=3, separate_reduce_group=True))]
    rows += [(f"torch DDP dp{n}", "dp", mg.peer_spec(run, "ddp", model, n, b * n)),
             (f"torch FSDP2 dp{n}", "dp", mg.peer_spec(run, "fsdp2", model, n, b * n)),
             (f"minipar tp{n} sp", "tp", mg.minipar_spec(run, model, n, s.tp_batch, tp=n,
                                                         sp=True)),
             (f"torch DTensor tp{n} sp", "tp", mg.peer_spec(run, "dtensor", model, n,
                                                             s.tp_batch, sp=True)),
             (f"minipar tp{n}", "tp", mg.minipar_spec(run, model, n, s.tp_batch, tp=n)),
             (f"torch DTensor tp{n}", "tp", mg.peer_spec(run, "dtensor", model, n,
                                                          s.tp_batch, sp=False))]
    seq = (getattr(run.args, "cp_tokens", None) or (8192 if run.cuda else 64)) * n
    cp_model = "gpt-1.3b" if run.cuda else model
    rows += [(f"minipar cp{n} seq{seq}", "cp", mg.minipar_spec(
                 run, cp_model, n, 1, {"seq_len": seq}, cp=n)),
             (f"torch context_parallel cp{n} seq{seq}", "cp", mg.peer_spec(
                 run, "torch-cp", cp_model, n, 1, {"seq_len": seq}))]
    b, m = s.per_gpu_batch * n, s.per_gpu_batch * n // s.pp_micro  # the speed rows' pp
    for sched in ("1f1b", "zb"):
        ov = mg._untied_if_needed(run, model, pp=n, microbatches=m, schedule=sched)
        rows += [(f"minipar pp{n} {sched}", "pp", mg.minipar_spec(
                     run, model, n, b, ov, pp=n, microbatches=m, schedule=sched)),
                 (f"torch pipelining pp{n} {sched}", "pp", mg.peer_spec(
                     run, "torch-pp", model, n, b, ov, schedule=sched, microbatches=m))]
    moe = "moe-1.3b" if run.cuda else "moe-tiny"  # gpt-1.3b's active parameters
    rows += [(f"minipar {moe} dp{n} ep{e}", "ep", mg.minipar_spec(
        run, moe, n, b * n, dp=n, ep=e, zero=1, microbatches=b)) for e in (1, n)]
    for name, group, spec in rows:
        spec.update(warmup=min(WARMUP, s.warmup), steps=PROFILED)
        trace = os.path.join(run.args.out, f"overlap_trace_dp{n}_zero2_rank0.json.gz") \
            if name == f"minipar dp{n} zero2" else None
        if name in (f"minipar tp{n} sp", f"minipar pp{n} 1f1b",
                    f"torch pipelining pp{n} 1f1b"):  # every rank's: where steps wait
            tag = name.split()[0] + "_" + "_".join(name.split()[-2:])
            trace = os.path.join(run.args.out, f"overlap_trace_{tag}_rank{{rank}}.json.gz")

        def go(spec=spec, trace=trace) -> dict:
            if n < 2:
                return {"status": "refused", "reason": "overlap needs 2 or more ranks"}
            if spec["impl"] == "torch-cp" and not run.cuda:
                return {"status": "refused", "reason": "torch's context_parallel has no "
                        "CPU kernel"}
            if spec["impl"] == "minipar":
                try:
                    mg.validate(mg.TrainConfig(**spec["cfg"]))
                except ValueError as e:
                    return {"status": "refused", "reason": str(e)}
            res = run.launch(_overlap_rank, n, spec, PROFILED, trace,
                             cap=min(s.cap_s, 180.0))
            return _reduce(list(res))

        run.row("overlap", name, go, group=group, impl=spec["impl"], world=n, model=model,
                batch=spec["batch"], warmup=spec["warmup"], profiled=PROFILED)
