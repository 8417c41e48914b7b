"""Train a GPT on any layout: the loop every rank runs, and the job around it.

``rank_main`` is what each rank runs (inside ``launch`` or torchrun): connect the mesh,
``step.build`` this rank's part (tensor, context, pipeline parallelism, recomputation,
data parallelism / ZeRO, in that order, from the meta device), then ``step.train_step``
for every step, with evaluation, checkpoints and bounded per-step records. ``train``
starts the ranks (or joins a torchrun job) and assembles their records;
``train_reference`` is the yardstick every layout is compared with: the plain
single-device loop, no minipar machinery at all.

A run never goes on silently wrong: a step whose global gradient norm (or loss) is not
finite stops every rank at that step (unless ``allow_nonfinite``), a checkpoint that
cannot be written stops it too, and ``train`` then raises ``RunStopped`` holding the
record of the steps done (no checkpoint is ever written from non-finite weights).
"""


from __future__ import annotations

import importlib
import math
import os
import sys
import time
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401 (the "fake" backend: rehearse)

from minipar import checkpoint, checks, trace
from minipar.config import (
    TrainConfig,
    device_for,
    lr_at,
    optimizer_class,
    optimizer_kernel,
    optimizer_kwargs,
    predicted_bytes,
    use_compile,
    uses_cuda,
    validate,
)
from minipar.corpus import make_data, prepare_data
from minipar.evaluate import evaluate, reference_eval
from minipar.hf import HFCheckpoint
from minipar.launch import LaunchError, default_start_method, heartbeat, launch, report_progress
from minipar.mesh import Mesh, RankMesh
from minipar.meter import ActivationMeter, cpu_allocations, record_allocations
from minipar.model import GPT, materialize, set_dropout_key
from minipar.parallel.compile import compile_stats
from minipar.reshard import ShardReader
from minipar.sample import write_run_card
from minipar.step import Parts, build, train_step
from minipar.theory import clusters
from minipar.theory.card import card_peak, runtime_bytes
from minipar.theory.planner import stage_compute

__all__ = ["TrainConfig", "validate", "train", "train_reference", "rank_main", "build",
           "train_step", "Parts", "RunStopped", "rehearse", "stage_ranks", "imagine_peers"]


class RunStopped(RuntimeError):
    """The run stopped early (a non-finite loss, a checkpoint not written); the message
    is one line, ``record`` holds what the steps before it produced."""

    def __init__(self, message: str, record: dict):
        super().__init__(message)
        self.record = record


def _with_total(mem: dict) -> dict:
    """``total``: the four kinds (activations: None, not counted, unless measured)."""
    mem["total"] = sum(mem[k] or 0 for k in ("params", "grads", "optimizer", "activations"))
    return mem


def rank_main(cfg: TrainConfig) -> dict:
    """Train on this rank (inside ``launch`` or torchrun); return this rank's record."""
    mesh = Mesh(cfg.dp, cfg.pp, cfg.tp, cfg.order, cp=cfg.cp, ep=cfg.ep)
    rm = mesh.connect(separate_reductions=cfg.separate_reduce_group)
    reader, start = None, 0
    if cfg.resume:  # each rank reads only the shards it needs
        reader = ShardReader(cfg.resume, cfg.model_config(), rm.coords.tp, cfg.tp)
        start = reader.step
    end = _end(cfg)
    if start >= end:  # validate says so before launch; here for a direct caller
        raise ValueError(f"the checkpoint is at step {start} and the run ends at step "
                         f"{end}: nothing to train")
    parts = build(cfg, rm, reader)
    device = device_for(cfg)
    after_build = _device_allocated(device)
    data = make_data(cfg, parts.model.cfg.vocab_size, parts.model.cfg.seq_len)
    reports_loss = (rm.coords.pp == cfg.pp - 1 and rm.coords.dp == 0 and rm.coords.tp == 0
                    and rm.coords.cp == 0)
    losses, norms, timeline, step_times, evals = [], [], [], [], []
    # the activation meter's hooks run on every saved tensor: only when asked for
    meter = ActivationMeter(exclude=[f.full for f in parts.data_parallel.flats]) \
        if cfg.measure_activations else None  # (the weights are not activations)
    tokens_per_step = cfg.batch_size * parts.model.cfg.seq_len
    last_report, stopped = time.time(), None
    for step in range(start, end):
        t0 = time.time()
        with meter if meter is not None else nullcontext():
            out = train_step(cfg, rm, parts, data, step)
        heartbeat()  # progress: the launcher's timeout counts from here
        # (a rehearsed rank's values are not a model's: see ``rehearse``)
        if not (cfg.allow_nonfinite or rm.rehearsal or _finite(out, step)):  # all alike
            stopped = _nonfinite(out, step, losses)
            break
        step_times.append(time.time() - t0)
        losses.append(out["loss"])
        norms.append(out["grad_norm"])
        if not cfg.trace:  # bounded: the last step's detail only, unless traced
            timeline.clear()
        timeline.extend({"name": f"{r.kind}{r.mb}", "kind": r.kind, "mb": r.mb,
                         "chunk": r.chunk, "step": step, "start": r.start, "end": r.end,
                         "wait": r.wait} for r in out["timeline"])
        rm.log.end_step(keep=bool(cfg.trace))
        done = step + 1
        if cfg.eval_every and (done % cfg.eval_every == 0 or done == end):
            val = evaluate(cfg, rm, parts.chunks, data, device_for(cfg))
            if val is not None:
                evals.append({"step": done, "loss": val})
        if reports_loss:  # every step (``_launch`` keeps each), before its checkpoint
            rate = tokens_per_step / (time.time() - last_report)
            last_report = time.time()
            report_progress(f"{done} {out['loss']:.17g} {rate:.1f} "
                            f"{evals[-1]['loss'] if evals else float('nan'):.6f}")
        if cfg.save and cfg.save_every and done % cfg.save_every == 0 and done < end:
            stopped = _save(cfg, rm, parts, done)
            if stopped:
                break
    parts.data_parallel.finish_param_sync()  # (ZeRO-1/2: the last step's weight gathers)
    if cfg.save and stopped is None:
        stopped = _save(cfg, rm, parts, end)
    last_step = [e for e in timeline if e["step"] == start + len(losses) - 1]
    return {
        "rank": rm.rank, "coords": rm.coords._asdict(), "first_step": start,
        "build_seconds": parts.build_seconds, "host_peak_bytes": parts.host_peak_bytes,
        "losses": losses, "eval": evals,
        "grad_norms": norms, "step_seconds": step_times,
        "memory": _with_total({**out["memory"],
                               "activations": meter.peak if meter is not None else None}),
        "stopped": stopped,
        "peak_in_flight": out["peak_in_flight"] if end > start else 0,
        "comm": rm.log.summary(),
        "comm_bytes_per_step": rm.log.total("wire_bytes") / max(1, end - start),
        "offload_bytes": out["offload"] if end > start else None,  # last step, host<->device
        "device_peak_bytes": _device_peak(device),
        "device_memory": _device_memory(device, after_build),
        "predicted_peak_bytes": predicted_bytes(cfg, parts.model.cfg, stage=rm.coords.pp),
        "optimizer_kernel": optimizer_kernel(cfg),
        "compile": _compile_stats(parts) if use_compile(cfg) else None,
        "timeline": last_step,
        "trace": {"timeline": timeline, "comm_records": rm.log.to_dicts()}
        if cfg.trace else None,
        # a rehearsal's: each step's seconds writing its imagined peers' stand-ins
        **({"stand_in_seconds": list(rm.log.step_stand_in_seconds)} if rm.rehearsal else {}),
    }


def _end(cfg: TrainConfig) -> int:
    """The step this run ends at (``--stop-at``, else ``--steps``)."""
    return cfg.steps if cfg.stop_at is None else cfg.stop_at


def _compile_stats(parts: Parts) -> dict:
    """The compiled blocks, compile seconds and cache use (``parallel/compile.py``)."""
    return compile_stats(parts.chunks)


def _device_peak(device: torch.device) -> int | None:
    """The accelerator's peak allocated bytes over the whole run (None on the CPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _device_allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _device_memory(device: torch.device, after_build: int | None) -> dict | None:
    """What the card held (None on the CPU): tensors after ``build`` (the weights and
    their states), the peaks of tensors and of the caching allocator's reserve, and the
    whole process's share of the card (the reserve plus the CUDA context and NCCL's
    buffers, which live outside the allocator), as the driver reports it."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return {"after_build": after_build,
            "peak_allocated": torch.cuda.max_memory_allocated(device),
            "peak_reserved": torch.cuda.max_memory_reserved(device),
            "process_used": total - free, "capacity": total}


def _finite(out: dict, step: int) -> bool:
    """Whether step ``step`` stayed finite. The gradient norm is global (every rank
    holds the same), so every rank stops at the same step; a loss that alone is not
    finite (known only on the last stage) raises here, and the launcher stops the rest."""
    if not math.isfinite(out["grad_norm"]):
        return False
    if out["loss"] is not None and not math.isfinite(out["loss"]):
        raise FloatingPointError(f"the loss at step {step} is {out['loss']} (gradient norm "
                                 f"{out['grad_norm']:.4g}): the run stopped")
    return True


def _nonfinite(out: dict, step: int, losses: list) -> dict:
    """Why the run stops at ``step``: its loss and norm, the last finite loss (on the
    rank that reports the loss)."""
    return {"why": "nonfinite", "step": step, "loss": out["loss"],
            "grad_norm": out["grad_norm"],
            "last_finite": [step - 1, losses[-1]] if losses else None}


def _save(cfg: TrainConfig, rm: RankMesh, parts: Parts, step: int) -> dict | None:
    """A checkpoint (collective), then on rank 0: the run card ``sample`` reads (model
    sizes, data, tokenizer) and pruning to the last ``--keep`` checkpoints. Returns
    None, or (on every rank alike) why it was not written: the run then stops."""
    def then() -> None:
        write_run_card(cfg.save, cfg, parts.model.cfg)
        if cfg.keep:
            checkpoint.prune(cfg.save, cfg.keep)

    try:
        checkpoint.save(cfg.save, step, cfg, rm, parts, then=then)
    except checkpoint.SaveError as e:
        return {"why": "save", "step": step, "error": str(e), "own": e.own}
    return None


def _why_stopped(cfg: TrainConfig, ranks: list[dict], last: int) -> str | None:
    """The one line saying why the run stopped early, or None."""
    stops = [r["stopped"] for r in ranks if r.get("stopped")]
    if not stops:
        return None
    if stops[0]["why"] == "save":
        own = [s for s in stops if s["own"]] or stops
        return f"--save {cfg.save}: {own[0]['error']}"
    s = ranks[last].get("stopped") or stops[0]
    before = (f"last finite loss {s['last_finite'][1]:.6g} at step {s['last_finite'][0]}"
              if s["last_finite"] else "no finite loss before it in this run")
    return (f"the loss is not finite at step {s['step']} (loss {s['loss']}, gradient norm "
            f"{s['grad_norm']}; {before}): the run stopped there and wrote no "
            "checkpoint from these weights; lower --lr, or --allow-nonfinite to go on")


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# What a run's start-up (a spawned rank's imports, joining, the build, a first step that
# may compile) is given before a rank's first progress when --timeout is shorter: a
# --timeout of a second, meant for a hang mid-run, must not call a starting run hung.
STARTUP_S = 120.0


def startup_allowance(cfg: TrainConfig) -> float:
    return max(cfg.timeout, STARTUP_S)



def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ)


def _assemble(cfg: TrainConfig, ranks: list[dict], seconds: float) -> dict:
    ranks = sorted(ranks, key=lambda r: r["rank"])
    last = Mesh(cfg.dp, cfg.pp, cfg.tp, cfg.order, cp=cfg.cp,
                ep=cfg.ep).rank(dp=0, pp=cfg.pp - 1)
    stopped = _why_stopped(cfg, ranks, last)
    record = {"config": cfg.to_dict(), "losses": ranks[last]["losses"],
              "first_step": ranks[last].get("first_step", 0),
              "eval": ranks[last].get("eval", []), "seconds": seconds,
              "world_size": cfg.world_size, "ranks": ranks}
    _write_trace(cfg, ranks, record)
    if stopped:
        record["stopped"] = stopped
    return record


def _write_trace(cfg: TrainConfig, ranks: list[dict], record: dict) -> None:
    """``--trace``: the ranks' timelines as one Chrome trace (a rank without one, out of
    memory in a rehearsal, left out); then each rank's record drops its trace."""
    if cfg.trace:
        try:  # a trace that cannot be written must not lose the run's record
            trace.write_chrome_trace(cfg.trace, [{**r, **r["trace"]} for r in ranks
                                                 if r.get("trace")])
        except OSError as e:
            record["trace_error"] = f"--trace {cfg.trace}: not written ({e.strerror or e})"
    for r in ranks:
        r.pop("trace", None)


def train(cfg: TrainConfig, progress=None, report=None) -> dict:
    """Run a training job: spawn dp*pp*tp*cp local ranks, or join a torchrun job.

    ``progress(step, loss)`` and ``report({step, loss, tokens_per_s, val_loss})`` are
    called here every ``log_every`` steps. A ``LaunchError`` (a rank failed, died or
    hung) holds in ``record`` the config and ``progress``: every step done before it,
    ``{step, loss, tokens_per_s}``. Returns the run's record: ``losses`` (one
    per step, mean over the global batch), ``eval`` (``{step, loss}``), the config, and
    per rank its coordinates, memory, communication and last step's timeline;
    ``first_step`` (not 0 after ``resume``); ``trace_error`` when ``cfg.trace`` could not
    be written (the record is returned all the same: a trace must not cost the run).
    Raises ``RunStopped`` (with the record) when the run stopped early.

    ``cfg.save`` is held (``checkpoint.locked``) from its check to the last write: a
    second run into the same directory is refused however the two interleave.
    """
    t0 = time.time()
    if _under_torchrun():
        return _join_torchrun(cfg, t0)
    validate(cfg)
    with checkpoint.locked(cfg.save) if cfg.save else nullcontext():  # one run per --save
        if cfg.save:  # again, now that it is ours: a run may have finished there since
            checkpoint.check_save(cfg.save, cfg.resume)
        record = _launch(cfg, progress, report, t0)
    if record.get("stopped"):
        raise RunStopped(record["stopped"], record)
    return record


def _launch(cfg: TrainConfig, progress, report, t0: float) -> dict:
    prepare_data(cfg)  # tokenise text once, here, before any rank starts
    done: list[dict] = []  # every step, as the rank reporting the loss ends it

    def on_progress(rank: int, text: str) -> None:
        if not text:
            return
        step, loss, rate, val = text.split()
        r = {"step": int(step), "loss": float(loss), "tokens_per_s": float(rate),
             "val_loss": float(val)}
        done.append({k: r[k] for k in ("step", "loss", "tokens_per_s")})
        if r["step"] % cfg.log_every and r["step"] != _end(cfg):
            return
        if progress is not None:
            progress(r["step"] - 1, r["loss"])
        if report is not None:
            report(r)

    # On a CUDA build, forking a process whose autograd already ran (a reference run, a
    # notebook cell) fails in the child ("Unable to handle autograd's threading in
    # combination with fork-based multiprocessing"): spawn there; rank_main is importable.
    method = "spawn" if torch.cuda.is_available() else default_start_method()
    if method == "fork":
        # every rank's optimizer imports torch._dynamo (seconds of CPU); imported here
        # once, forked ranks inherit it instead of each importing it again
        importlib.import_module("torch._dynamo")
    try:
        ranks = launch(rank_main, cfg.world_size, args=(cfg,), backend=cfg.backend,
                       timeout=cfg.timeout, startup=startup_allowance(cfg),
                       on_progress=on_progress, start_method=method)
    except LaunchError as e:  # the steps before the failure are kept with it
        e.record = {"config": cfg.to_dict(), "progress": done}
        raise
    return _assemble(cfg, list(ranks), time.time() - t0)


def _join_torchrun(cfg: TrainConfig, t0: float) -> dict | None:
    """Under torchrun every process runs this; rank 0 gathers and returns the record."""
    try:
        world = int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} in the environment is "
                         "not a number; unset it to train on this machine alone") from None
    validate(cfg, world_size=world)
    prepare_data(cfg)  # every process: the first tokenises, the rest find the cache
    device = None
    if cfg.backend == "nccl":
        device = device_for(cfg)
        torch.cuda.set_device(device)
    env = " ".join(f"{k}={os.environ[k]}" for k in TORCHRUN_ENV if k in os.environ)
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # set by hand, or left over: say so
        print(f"minipar train: note: joining the job that {env} describe (waiting up to "
              f"--timeout {cfg.timeout:g} s for its ranks); unset them to train here alone",
              file=sys.stderr)
    try:
        dist.init_process_group(cfg.backend, device_id=device,
                                timeout=timedelta(seconds=cfg.timeout))
    except Exception as e:  # no peers in time, a port in use, MASTER_PORT missing
        raise LaunchError(f"could not join the job that {env} describe "
                          f"({type(e).__name__}: {str(e).strip().splitlines()[0][:160]}); "
                          "unset them to train on this machine alone") from None
    try:
        mine = rank_main(cfg)
        everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, everyone, dst=0)
    finally:
        dist.destroy_process_group()
    record = _assemble(cfg, everyone, time.time() - t0) if everyone else None
    if record and record.get("stopped"):
        raise RunStopped(record["stopped"], record)
    return record


def stage_ranks(cfg: TrainConfig) -> list[int]:
    """The first rank of each pipeline stage: the ranks a rehearsal tries by default (a
    stage's dp, tp and cp ranks hold the same shapes; stages differ: the embedding, the
    head, the micro-batches a schedule keeps in flight)."""
    mesh = Mesh(cfg.dp, cfg.pp, cfg.tp, cfg.order, cp=cfg.cp, ep=cfg.ep)
    return [mesh.rank(dp=0, pp=stage) for stage in range(cfg.pp)]


def rehearse(cfg: TrainConfig, ranks: list[int] | None = None,
             snapshot: str | None = None) -> dict:
    """Try ranks of ``cfg``'s layout one at a time, each alone on this machine's first
    device (or its CPU), its peers imagined: torch's "fake" process group completes every
    collective at once and moves nothing (torchtitan estimates memory the same way). What
    the rank holds and computes is real: its shards, activations, buffers and kernels.
    Its values are not: what a peer would send is a stand-in (a copy of the rank's own
    shard, N(0, 1) for what a neighbouring stage sends: ``comm``), so the losses mean
    nothing and a non-finite one stops nothing. The stand-ins keep the kernels' work
    real (a GPU multiplies zeros faster than values), and its step is compute alone:
    no wire, no waiting. So a layout meant for four GPUs can be tried on one, each
    rank's peak held against the card and the memory model before the GPUs are rented.
    NCCL's buffers for its peers are the one part a rehearsal cannot hold: each rank's
    ``runtime_bytes`` is what a rank of the job holds outside the caching allocator
    (``theory.card.runtime_bytes``), to add to the rehearsal's reserve; a rehearsed rank
    itself holds ``REHEARSED_RUNTIME_BYTES`` there.

    ``ranks``: default ``stage_ranks``. Each runs in a process of its own (a fresh
    allocator, a fresh peak) under ``launch``'s deadline. Returns {"config", "ranks"}:
    per rank ``rank_main``'s record, or, when it ran out of device memory, its coords and
    ``out_of_memory`` (the allocator's first line), with ``device_memory`` either way
    (on the CPU ``cpu_peak_allocated`` instead, ``meter.cpu_allocations``'s count);
    and ``predicted`` (``card_peak``'s live, reserved and process bytes; on a GPU the
    step model's compute, ``planner.stage_compute``, on a cluster of the job's GPUs of
    this GPU's kind; None for float8 blocks, whose pace it does not hold),
    ``runtime_bytes`` and ``compute_seconds`` (``_compute_seconds``).

    ``cfg.trace``: the rehearsed ranks' actions as one Chrome trace, a lane per rank,
    each on its own clock (they ran one after another).

    ``snapshot``: on CUDA, each rank's allocations are recorded from the build to the
    end (or to running out of memory) and written as ``{snapshot}.rank{R}.pickle``, for
    https://pytorch.org/memory_viz (``torch.cuda.memory._dump_snapshot``).
    """
    validate(cfg, rehearsal=True)
    if cfg.save:
        raise ValueError("a rehearsal writes no checkpoint (its peers are imagined: its "
                         "weights are not trained); drop --save")
    if snapshot is not None:
        if not uses_cuda(cfg):
            raise ValueError("--memory-snapshot records the CUDA caching allocator: it "
                             "needs --backend nccl (or --device cuda)")
        checks.output_file("memory-snapshot", f"{snapshot}.rank0.pickle")
    ranks = stage_ranks(cfg) if ranks is None else list(ranks)
    for rank in ranks:
        if not (isinstance(rank, int) and 0 <= rank < cfg.world_size):
            raise ValueError(f"--ranks: the layout {cfg.layout_name()} has ranks 0 to "
                             f"{cfg.world_size - 1}, got {rank!r}")
    prepare_data(cfg)
    method = "spawn" if torch.cuda.is_available() else None  # (as in train)
    records = [launch(_rehearse_rank, 1, args=(cfg, rank, snapshot), timeout=cfg.timeout,
                      startup=startup_allowance(cfg), start_method=method)[0]
               for rank in ranks]
    device = "cuda" if uses_cuda(cfg) else "cpu"
    model, layout = cfg.model_config(), cfg.layout(device)
    # the planner's cluster of this job's GPUs, of this one's kind: its step model prices
    # a rank's compute on a GPU (not float8's, whose pace it does not hold)
    where = clusters.cluster(cfg.world_size, clusters.gpu_for_device(
        torch.cuda.get_device_name(0)), cfg.world_size) if (
        device == "cuda" and layout.fp8 is None) else None
    for r in records:  # what the planner's models say of the same rank
        stage = r["coords"]["pp"]
        row = card_peak(model, layout, device=device, stage=stage)
        r["predicted"] = {"live": row["total"], "reserved": row["reserved"],
                          "process": row["process"], "compute_seconds": None if where is None
                          else stage_compute(model, where, layout, stage)}
        # what a rank of the job holds outside the allocator (CUDA, NCCL's peers)
        r["runtime_bytes"] = runtime_bytes(layout) if device == "cuda" else 0
        r["compute_seconds"] = _compute_seconds(r)
    result = {"config": cfg.to_dict(), "world_size": cfg.world_size, "ranks": records}
    _write_trace(cfg, records, result)  # each rank alone: its own lanes, its own clock
    return result


def _compute_seconds(record: dict) -> float | None:
    """A rehearsed rank's compute: the median step after the first (compilation, the
    allocator's first fill), less the time it spent writing its imagined peers'
    stand-ins (``comm``: a real collective writes its output on its own stream)."""
    steps = record.get("step_seconds", [])
    stand_ins = record.get("stand_in_seconds") or [0.0] * len(steps)
    computed = [s - w for s, w in zip(steps, stand_ins)]
    later = sorted(computed[1:] or computed)
    return later[len(later) // 2] if later else None


def imagine_peers(rank: int, world_size: int) -> None:
    """Leave this process's one-rank job (``launch``'s) for rank ``rank`` of a world of
    ``world_size`` imagined ranks: torch's "fake" process group, whose collectives
    complete at once and move nothing (from no job at all, too: a profiler's process)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank,
                            world_size=world_size)


def _rehearse_rank(cfg: TrainConfig, rank: int, snapshot: str | None = None) -> dict:
    """One rehearsed rank (inside ``launch``'s one-rank job)."""
    imagine_peers(rank, cfg.world_size)
    device = device_for(cfg)
    # what measures the rank: the CUDA caching allocator (and its record, when a snapshot
    # is asked for), or on the CPU, which keeps no counters, the profiler
    measure = (cpu_allocations() if device.type == "cpu" else
               record_allocations() if snapshot is not None else nullcontext({}))
    try:
        with measure as allocated:
            try:
                record = rank_main(cfg)
            except torch.OutOfMemoryError as e:
                mesh = Mesh(cfg.dp, cfg.pp, cfg.tp, cfg.order, cp=cfg.cp, ep=cfg.ep)
                return {"rank": rank, "coords": mesh.coords(rank)._asdict(),
                        "out_of_memory": str(e).strip().splitlines()[0],
                        "device_memory": _device_memory(device, None)}
            finally:  # (the moment it ran out of memory included)
                if snapshot is not None:
                    torch.cuda.memory._dump_snapshot(f"{snapshot}.rank{rank}.pickle")
        if device.type == "cpu":
            record["cpu_peak_allocated"] = allocated["peak_allocated"]
        return record
    finally:
        dist.destroy_process_group()


def train_reference(cfg: TrainConfig, progress=None) -> dict:
    """The yardstick: the plain single-device loop, no minipar machinery at all.

    One process, the whole global batch in one forward (its mean loss equals the mean of
    equal micro-batch means), ``clip_grad_norm_``, AdamW, the same learning-rate
    schedule. Every layout's losses are compared with these.
    """
    torch.manual_seed(cfg.seed)  # (the weights: from the seed by name, init_parameter)
    if cfg.init_from:  # or a transformers GPT-2 directory's
        model = materialize(GPT(cfg.model_config(), device="meta"),
                            HFCheckpoint(cfg.init_from).values())
    else:
        model = GPT(cfg.model_config(), seed=cfg.seed)
    prepare_data(cfg)
    data = make_data(cfg, model.cfg.vocab_size, model.cfg.seq_len)
    opt = optimizer_class(cfg)(model.parameters(), **optimizer_kwargs(cfg))
    losses, norms, evals = [], [], []
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = data.batch(step, cfg.batch_size)
        set_dropout_key(model, cfg.seed, step, 0)  # the masks every layout draws
        loss = model(x, y)
        loss.backward()
        # the global gradient norm before clipping: what every layout must reproduce
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                              cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        norms.append(float(norm))
        if progress is not None:
            progress(step, losses[-1])
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            evals.append({"step": step + 1, "loss": reference_eval(
                model, data, cfg.batch_size, cfg.eval_batches)})
    return {"config": cfg.to_dict(), "losses": losses, "grad_norms": norms, "eval": evals,
            "model": model}
