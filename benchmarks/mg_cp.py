"""multigpu.py's ``cp`` section: context parallelism and ZeRO-Offload on N GPUs (issue 20).

    export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        NVSHMEM_DISABLE_NVLS=1
    python benchmarks/multigpu.py --sections calibrate,cp --out $OUT --budget-s 420
    # a dry run at tiny sizes anywhere (CPU, gloo; the torch CP row is refused there)
    python benchmarks/multigpu.py --device cpu --gpus 2 --sections cp --out /tmp/x

Rows of section ``cp`` (each one launch of N ranks, capped, errors recorded):

* ``minipar cpN seqL``: ``engine.build`` + ``train_step`` at cp = N (zig-zag ring
  attention, ``minipar.parallel.cp``), gpt-1.3b, one sequence of L = 8192 N tokens,
  bf16, ZeRO-0 (the weights replicated, gradients summed over the cp group); recompute
  only if ``minipar.theory.memory`` says it would not fit 80 GB otherwise.
* ``torch context_parallel cpN seqL``: the same model and tokens under
  ``torch.distributed.tensor.experimental.context_parallel`` (head-tail balancing,
  all-gather rotation, flash SDPA), bf16 weights + fp32 masters, DDP, AdamW
  (``peers.context_parallel_peer``). Refused on the CPU: torch CP has no CPU kernel.
* ``minipar 1 GPU seqL``: the same sequence on one GPU (flash SDPA): out of memory, or
  the peak it needs; the error is recorded as status ``oom``, with the peak reached.
* ``ring attention cpN seqL (one layer)``: ``cp_gpu._rank`` at the model's heads: the
  ring forward against the same blocks computed with no communication, per layout.
* ``minipar dpN zero{1,2}[ offload]``: gpt-1.3b, seq 2048, the speed rows' batch,
  ZeRO-1/2 with and without ``--offload``: step time, device peak, host<->device bytes
  per step (``out["offload"]``) against ``theory.offload.zero_offload_traffic``, and on
  CUDA one profiled step: the copies' busy time and how much of it overlaps kernels.
* ``cp summary``: minipar / torch tokens/s, peaks, the share of ring communication
  hidden (calibrated send bandwidth, if calibrate ran), offload savings and costs.

Estimated on 4 x H100: about 4 minutes (9 launches; a ring step of the 32k sequence
costs about 7 s: minipar's blocks are fp32 matmul-softmax, not a fused kernel).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from gpu import DATASHEET_TFLOPS, RandomTokens, _timed
from multigpu import GiB, _device_name, _local_device, minipar_spec, peer_spec, refused_or

from minipar.config import TrainConfig
from minipar.model import get_config
from minipar.theory.params import model_flops_per_token, param_count


@dataclass
class CpSizes:
    model: str = "gpt-1.3b"
    tokens_per_rank: int = 8192  # the long sequence is this times N
    heads: int = 32  # of the model (the ring row's q, k, v)
    head_dim: int = 64
    long_warmup: int = 1  # minipar's ring step is seconds long
    long_steps: int = 3
    warmup: int = 2
    steps: int = 5
    offload_warmup: int = 1
    offload_steps: int = 4
    ring_reps: int = 3
    ring_dtype: str = "bf16"
    cap_s: float = 200.0
    device_gib: float = 80.0


def cp_sizes(cuda: bool) -> CpSizes:
    if cuda:
        return CpSizes()
    return CpSizes(model="small", tokens_per_rank=64, heads=8, head_dim=16, long_steps=2,
                   steps=2, warmup=1, offload_steps=2, ring_reps=1, ring_dtype="fp32",
                   cap_s=120.0)


# --- on every rank ----------------------------------------------------------------------
def _rank(spec: dict) -> dict:
    """Build one configuration on this rank, time it; an out-of-memory error is returned
    (with the peak reached), not raised."""
    device = _local_device()
    cuda = device.type == "cuda"
    mc = get_config(spec["model"]).with_(**spec.get("overrides", {}))
    data = RandomTokens(mc.vocab_size, mc.seq_len, 0)
    rec: dict = {"device_name": _device_name(device), "offload": None}
    try:
        if spec["impl"] == "minipar":
            step_fn, rm, parts, cfg = _minipar(spec, data, rec)
        else:
            step_fn = _torch_cp(spec, mc, data, device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        losses, times = _timed(step_fn, spec["steps"], spec["warmup"], device)
        done = spec["steps"] + spec["warmup"]
        if spec.get("profile"):
            rec["copies"] = _profile_copies(step_fn, done, device)
            done += 1
    except torch.cuda.OutOfMemoryError as e:
        return {**rec, "oom": str(e).splitlines()[0][:400],
                "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else 0}
    if spec["impl"] == "minipar":
        rec["comm_wire_bytes_per_step"] = rm.log.total("wire_bytes") / done
        rec["cp_wire_bytes_per_step"] = rm.log.total("wire_bytes", dim="cp") / done
        # the model's count (ZeRO-3's module holds only this rank's shards)
        rec["n_params"] = param_count(mc)
    return {**rec, "times": times, "losses": losses,
            "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else 0}


def _minipar(spec: dict, data, rec: dict):
    from minipar.engine import build, train_step
    from minipar.mesh import Mesh

    cfg = TrainConfig(**spec["cfg"])
    rm = Mesh(cfg.dp, cfg.pp, cfg.tp, cfg.order, cp=cfg.cp).connect()
    parts = build(cfg, rm)

    def step_fn(s: int):
        out = train_step(cfg, rm, parts, data, s)
        rec["offload"] = out["offload"]  # host <-> device bytes of this step
        rm.log.end_step()  # the step's ops are done (its loss was read): bounded records
        return out["loss"]

    return step_fn, rm, parts, cfg


def _torch_cp(spec: dict, mc, data, device: torch.device):
    """torch's context parallelism on this rank, built as the overlap rows build it."""
    from multigpu import _speed_build

    return _speed_build(spec).step_fn


def _profile_copies(step_fn, step: int, device: torch.device) -> dict:
    """One step under the profiler: host<->device copies' busy time on the GPU, and how
    much of it runs while a compute kernel runs (hidden behind the forward, backward or
    the update; NCCL kernels do not count). On the CPU there are no such events."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step_fn(step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    gpu = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
           if e.device_type == DeviceType.CUDA]
    copies = [(a, b, n) for a, b, n in gpu if "Memcpy" in n and ("DtoH" in n or "HtoD" in n)]
    union: list[list[float]] = []  # the compute kernels' busy intervals, merged (not
    for a, b, _ in sorted((a, b, n) for a, b, n in gpu  # copies, memsets or NCCL's)
                          if "Mem" not in n and "nccl" not in n.lower()):
        if union and a <= union[-1][1]:
            union[-1][1] = max(union[-1][1], b)
        else:
            union.append([a, b])
    starts = [u[0] for u in union]

    def covered(a: float, b: float) -> float:
        i, tot = max(0, bisect.bisect_right(starts, a) - 1), 0.0
        while i < len(union) and union[i][0] < b:
            tot += max(0.0, min(b, union[i][1]) - max(a, union[i][0]))
            i += 1
        return tot

    busy = {k: sum(b - a for a, b, n in copies if k in n) / 1e6 for k in ("DtoH", "HtoD")}
    total = sum(busy.values())
    hidden = sum(covered(a, b) for a, b, _ in copies) / 1e6
    return {"d2h_busy_s": busy["DtoH"], "h2d_busy_s": busy["HtoD"], "copies": len(copies),
            "copy_busy_s": total, "copy_overlapped_s": hidden,
            "copy_hidden_share": hidden / total if total else None,
            "kernel_busy_s": sum(b - a for a, b in union) / 1e6}


# --- rows --------------------------------------------------------------------------------
def _measure(run, spec: dict, cap: float) -> dict:
    """Launch one configuration; one row: the slowest rank's median step, peaks."""
    import statistics

    res = list(run.launch(_rank, spec["world"], spec, cap=cap))
    peak = max(r["peak_bytes"] for r in res) / GiB
    oom = [r["oom"] for r in res if "oom" in r]
    if oom:
        return {"status": "oom", "error": oom[0], "peak_gib": peak,
                "brief": f"out of memory at a peak of {peak:.1f} GiB"}
    per_step = [max(r["times"][i] for r in res) for i in range(len(res[0]["times"]))]
    step = statistics.median(per_step)
    mc = get_config(spec["model"]).with_(**spec.get("overrides", {}))
    tokens = spec["batch"] * mc.seq_len
    flops = model_flops_per_token(mc, "kaplan")  # the causal half of attention
    row = {"step_s": step, "step_s_all": per_step, "tokens_per_step": tokens,
           "tokens_per_s": tokens / step, "peak_gib": peak,
           "mfu_causal": tokens / step * flops / (spec["world"] * DATASHEET_TFLOPS * 1e12),
           "peak_gib_per_rank": [r["peak_bytes"] / GiB for r in res],
           "loss_first": res[0]["losses"][0], "loss_last": res[0]["losses"][-1],
           "device_name": res[0]["device_name"]}
    for key in ("comm_wire_bytes_per_step", "cp_wire_bytes_per_step", "n_params",
                "offload", "copies"):
        if res[0].get(key) is not None:
            row[key] = res[0][key]
    row["brief"] = (f"{1e3 * step:.0f} ms, {row['tokens_per_s']:,.0f} tok/s, MFU "
                    f"{100 * row['mfu_causal']:.1f}% (causal), peak {peak:.1f} GiB")
    return row


def _predicted_gib(mc, **layout) -> float:
    from minipar.theory.layout import Layout
    from minipar.theory.memory import memory_breakdown

    return memory_breakdown(mc, Layout(dtype="bf16", **layout), accounting="fused")["total"] / GiB


def memory_predictions(report: dict) -> list[dict]:
    """The theory's peak beside every measured minipar row of the cp section, recomputed
    from the row's layout with the current theory (``predicted_gib`` in a row is what
    the theory said when it ran): the report tool's check of the memory model."""
    out = []
    for r in report["sections"].get("cp", {}).get("rows", []):
        if r.get("impl") != "minipar" or r.get("status") != "ok" or not r.get("peak_gib"):
            continue
        lay = dict(r["layout"])
        mc = get_config(r["model"]).with_(**r["spec"].get("overrides", {}))
        pred = _predicted_gib(mc, microbatch_size=r["batch"] // lay.get("dp", 1), **lay)
        row = {"name": r["name"], "predicted_gib": pred, "measured_gib": r["peak_gib"],
               "memory_error": pred / r["peak_gib"] - 1}
        base = [b for b in out if b["name"] + " offload" == r["name"]]
        if base:  # what --offload saved: the row before it, without offload
            row["saved_gib"] = (base[-1]["predicted_gib"] - pred,
                                base[-1]["measured_gib"] - r["peak_gib"])
        out.append(row)
    return out


def _row(run, name: str, spec: dict, cap: float, **fields) -> dict | None:
    def go() -> dict:
        return refused_or(spec, lambda: _measure(run, spec, cap))

    return run.row("cp", name, go, impl=spec["impl"], world=spec["world"],
                   model=spec["model"], batch=spec["batch"],
                   spec={k: v for k, v in spec.items() if k != "cfg"}, **fields)


def section_cp(run) -> None:
    c, n = cp_sizes(run.cuda), run.n
    if getattr(run.args, "cp_tokens", None):
        c.tokens_per_rank = run.args.cp_tokens
    seq = c.tokens_per_rank * n
    ov = {"seq_len": seq}
    mc = get_config(c.model).with_(**ov)
    rows: dict = {}
    recompute = "none"  # recompute only if the theory says it would not fit (it errs a
    if _predicted_gib(mc, cp=n) > 0.9 * c.device_gib:  # little high: 56.9 vs 55.9 GiB at 32k)
        recompute = "full"

    def steps(spec: dict, warmup: int, count: int) -> dict:
        spec.update(warmup=warmup, steps=count)
        if "cfg" in spec:
            spec["cfg"]["steps"] = warmup + count + 2
        return spec

    # 1. context parallelism: minipar's ring against torch's, same tokens per step
    spec = steps(minipar_spec(run, c.model, n, 1, ov, cp=n, recompute=recompute),
                 c.long_warmup, c.long_steps)
    rows["minipar"] = _row(run, f"minipar cp{n} seq{seq}", spec, c.cap_s,
                           layout={"cp": n, "recompute": recompute},
                           predicted_gib=_predicted_gib(mc, cp=n, recompute=recompute))
    spec = steps(minipar_spec(run, c.model, n, 1, ov, cp=n, zero=1, recompute=recompute),
                 c.long_warmup, c.long_steps)  # the master shards split over the cp group
    rows["minipar zero1"] = _row(run, f"minipar cp{n} zero1 seq{seq}", spec, c.cap_s,
                                 layout={"cp": n, "zero": 1, "recompute": recompute})
    spec = steps(peer_spec(run, "torch-cp", c.model, n, 1, ov), c.warmup, c.steps)
    name = f"torch context_parallel cp{n} seq{seq}"
    if run.cuda:
        rows["torch"] = _row(run, name, spec, c.cap_s, layout={"cp": n})
    else:
        rows["torch"] = run.row("cp", name, lambda: {
            "status": "refused", "reason": "torch's context_parallel dispatches SDPA's CUDA "
            "kernels only (flash, efficient, cuDNN): no CPU path"}, impl="torch-cp")
    spec = steps(minipar_spec(run, c.model, 1, 1, ov, recompute=recompute), c.long_warmup,
                 c.long_steps)
    rows["one"] = _row(run, f"minipar 1 GPU seq{seq}", spec, c.cap_s,
                       layout={"recompute": recompute},
                       predicted_gib=_predicted_gib(mc, recompute=recompute))
    rows["ring"] = run.row("cp", f"ring attention cp{n} seq{seq} (one layer)",
                           lambda: _ring(run, c, seq), impl="minipar-ring")
    # 2. ZeRO-Offload: the speed rows' batch, with and without
    b = run.sizes.per_gpu_batch * n
    smc = get_config(c.model)
    for z in (1, 2, 3):
        for off in (False, True):
            spec = minipar_spec(run, c.model, n, b, dp=n, zero=z, offload=off)
            spec = steps(spec, c.offload_warmup if off else c.warmup,
                         c.offload_steps if off else c.steps)
            spec["profile"] = off
            rows[(z, off)] = _row(
                run, f"minipar dp{n} zero{z}" + (" offload" if off else ""), spec,
                c.cap_s, layout={"dp": n, "zero": z, "offload": off},
                predicted_gib=_predicted_gib(smc, dp=n, zero=z, offload=off,
                                             microbatch_size=run.sizes.per_gpu_batch))
    run.row("cp", "cp summary", lambda: cp_summary(run, rows, n), impl="summary")


def _ring(run, c: CpSizes, seq: int) -> dict:
    """``cp_gpu._rank`` on every rank: ring forward vs its blocks with no communication."""
    from cp_gpu import _rank as ring_rank

    res = list(run.launch(ring_rank, run.n, seq, c.heads, c.head_dim, c.ring_dtype,
                          "cuda" if run.cuda else "cpu", c.ring_reps, cap=c.cap_s))
    out = {"ranks": res, "heads": c.heads, "head_dim": c.head_dim, "dtype": c.ring_dtype}
    for layout in ("zigzag", "contiguous"):
        fwd = max(r[layout]["forward_seconds"] for r in res)
        compute = max(r[layout]["forward_compute_seconds"] for r in res)
        out[layout] = {"forward_s": fwd, "compute_s": compute,
                       "exposed_s": max(0.0, fwd - compute),
                       "fwd_bwd_s": max(r[layout]["seconds"] for r in res),
                       "max_err_out": max(r[layout]["max_err_out"] for r in res)}
    from minipar.theory.context import ring_bytes

    item = 2 if c.ring_dtype == "bf16" else 4
    kv = ring_bytes(1, seq, c.heads * c.head_dim, run.n, item)["forward"]
    out["ring_forward_bytes"] = kv["bytes"]
    send = ((run.calibration or {}).get("collectives") or {}).get("send")
    if send:  # the transfers alone, from the calibrated send-recv (latency + bandwidth)
        msg = kv["bytes"] / max(1, kv["calls"])
        comm = kv["calls"] * (send["latency_s"] + msg / send["bus_bandwidth"])
        z = out["zigzag"]
        out["comm_alone_s"] = comm
        out["hidden_share"] = max(0.0, min(1.0, 1 - z["exposed_s"] / comm)) if comm else None
    z = out["zigzag"]
    out["brief"] = (f"zig-zag forward {1e3 * z['forward_s']:.1f} ms vs compute "
                    f"{1e3 * z['compute_s']:.1f} ms (exposed {1e3 * z['exposed_s']:.1f} ms)")
    return out


def cp_summary(run, rows: dict, n: int) -> dict:
    """The figures issue 20 asks for, from this call's rows (missing ones left out)."""
    from minipar.theory.offload import zero_offload_traffic

    def ok(r):
        return r if r and r.get("status") == "ok" else None

    out: dict = {}
    mine, peer, one, ring = (ok(rows[k]) for k in ("minipar", "torch", "one", "ring"))
    if mine and peer:
        out["minipar_over_torch_tokens_per_s"] = mine["tokens_per_s"] / peer["tokens_per_s"]
        out["minipar_over_torch_peak"] = mine["peak_gib"] / peer["peak_gib"] \
            if peer["peak_gib"] else None
    if mine:
        out["minipar_cp_peak_gib"] = mine["peak_gib"]
    r1 = rows["one"] or {}
    out["one_gpu"] = {"status": r1.get("status"), "peak_gib": r1.get("peak_gib"),
                      "predicted_gib": r1.get("predicted_gib"),
                      "error": (r1.get("error") or "")[:300] or None}
    if ring:
        out["ring_exposed_share_of_forward"] = ring["zigzag"]["exposed_s"] / \
            ring["zigzag"]["forward_s"]
        out["ring_hidden_share"] = ring.get("hidden_share")
    offload = []
    for z in (1, 2, 3):
        base, off = ok(rows[(z, False)]), ok(rows[(z, True)])
        if not (base and off):
            continue
        rec = {"zero": z, "peak_saved_gib": base["peak_gib"] - off["peak_gib"],
               "step_cost": off["step_s"] / base["step_s"],
               "predicted_saved_gib": base["predicted_gib"] - off["predicted_gib"]}
        if off.get("offload") and off.get("n_params"):
            theory = zero_offload_traffic(off["n_params"], n, z)
            rec.update(bytes_per_step=off["offload"], theory_bytes_per_step=theory,
                       bytes_over_theory=(off["offload"]["to_host"] + off["offload"][
                           "to_device"]) / (theory["to_host"] + theory["to_device"]))
        if off.get("copies"):
            rec["copies"] = off["copies"]
        offload.append(rec)
    out["offload"] = offload
    bits = []
    if "minipar_over_torch_tokens_per_s" in out:
        bits.append(f"cp tok/s minipar/torch {out['minipar_over_torch_tokens_per_s']:.2f}")
    bits.append(f"1 GPU: {out['one_gpu']['status']}")
    bits += [f"offload z{o['zero']}: -{o['peak_saved_gib']:.1f} GiB, x{o['step_cost']:.2f}"
             for o in offload]
    out["brief"] = "; ".join(bits)
    return out
