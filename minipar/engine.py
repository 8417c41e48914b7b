"""Compose a GPT for a mesh and train it: the one training loop every layout shares.

Every rank runs ``rank_main``. It builds the single-device reference model on the meta
device (shapes, no storage), applies the techniques from the outside in this order, and
only then gives this rank's parameters their values, one at a time: the reference's
initial values by name and seed (``parallel/materialize.py``), so every layout starts
from the same weights without any rank holding the whole model:

1. tensor parallelism replaces submodules by sharded ones, following a printable plan
   (``parallel/tp.py``); context parallelism then replaces the attention cores by the
   ring, the position embedding and dropouts by their sequence-shard versions
   (``parallel/cp_plan.py``);
2. the pipeline gives each of this rank's chunks exactly its layers (``parallel/pp.py``);
   the rest of the reference model is dropped;
3. recomputation replaces blocks (``parallel/recompute.py``);
4. data parallelism, in one place (``data_parallel``): ZeRO 0-2 (``parallel/zero.py``,
   replicated or sharded optimizer states and gradients, bf16 weights with fp32
   masters) or ZeRO-3 (``parallel/zero3.py``, the weights sharded too).

A step: this replica's rows of the step's global batch (the same tokens whatever the
layout; only these rows are built) cut into micro-batches, and of each row this cp
rank's tokens; the schedule runs forward and backward of all of them (pp = 1: a
one-stage schedule, i.e. gradient accumulation); gradients are synchronised, clipped on
the true global norm, and the optimizer steps. Each micro-batch loss (a mean over
its tokens) is scaled by 1/(dp * cp * m) and the data-parallel reduction sums over dp x
cp, so the gradient is exactly that of the global batch's mean loss on one device.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from minipar import checkpoint
from minipar.config import (
    TrainConfig,
    device_for,
    lr_at,
    optimizer_class,
    optimizer_kwargs,
    validate,
)
from minipar.corpus import make_data, prepare_data
from minipar.data import TokenSource, local_batches
from minipar.evaluate import evaluate, reference_eval
from minipar.launch import launch, report_progress
from minipar.mesh import Mesh, RankMesh
from minipar.meter import ActivationMeter
from minipar.model import GPT, materialize
from minipar.reshard import ShardReader, load_optimizer_state

__all__ = ["TrainConfig", "validate", "train", "rank_main", "build", "Parts"]


@dataclass
class Parts:
    """What one rank trains, once composed."""

    model: torch.nn.Module  # StageLayers: this rank's (sharded) layers, reference names
    chunks: list  # this rank's pipeline chunks (PipelineStage modules, sharing them)
    optimizer: torch.optim.Optimizer  # steps on what data_parallel exposes
    executor: object  # the PipelineExecutor
    data_parallel: object  # ZeroOptimizer (ZeRO 0-2) or Zero3: the gradient sync
    precision: object | None  # MixedPrecision (bf16, ZeRO 0-2), for its loss scale
    names: list[str]  # reference names of this rank's trainable weights
    sp_names: list[str]  # weights whose gradient is also summed over tp (SP norms)
    tied_names: list[str]  # a tied embedding's copy, summed over the embedding group
    build_seconds: float = 0.0  # how long build took on this rank
    host_peak_bytes: int = 0  # the resident host memory build added at its peak


def build(cfg: TrainConfig, rm: RankMesh, resume=None) -> Parts:
    """Compose this rank's part: tp -> pp -> recompute on the meta device, then this
    rank's shards only (``parallel/materialize.py``), then data parallel (ZeRO 0-3).

    ``resume``: a ``reshard.ShardReader`` (or a checkpoint directory): the weights and
    optimizer states come from it, each rank reading only the shards it needs.
    Records ``build_seconds`` and ``host_peak_bytes`` (resident host memory growth).
    """
    import importlib

    from minipar.meter import HostPeak

    # imported before measuring: a module's first import costs seconds and tens of MB
    # that are not the build's (a torch optimizer's first construction imports dynamo)
    for module in ("torch._dynamo", "minipar.parallel.materialize", "minipar.parallel.pp",
                   "minipar.parallel.recompute", "minipar.parallel.zero3"):
        importlib.import_module(module)

    t0 = time.perf_counter()
    with HostPeak() as host:
        parts = _build(cfg, rm, resume)
    parts.build_seconds, parts.host_peak_bytes = time.perf_counter() - t0, host.peak
    return parts


def _build(cfg: TrainConfig, rm: RankMesh, resume) -> Parts:
    from minipar.parallel.materialize import init_values
    from minipar.parallel.pp import PipelineExecutor, StageLayers, build_stage
    from minipar.parallel.recompute import apply_recompute
    from minipar.parallel.schedules import make_schedule
    from minipar.parallel.tp import apply_tensor_parallel

    mcfg = cfg.model_config()
    full = GPT(mcfg, device="meta")  # shapes only: no rank ever holds the whole model
    if cfg.tp > 1:
        apply_tensor_parallel(full, rm.tp, sequence_parallel=cfg.sp)
    if cfg.cp > 1:  # after tp: the cp styles see (and keep) sequence parallelism's slice
        from minipar.parallel.cp_plan import apply_context_parallel

        apply_context_parallel(full, rm.cp)
    stage = build_stage(full, rm.coords.pp, cfg.pp, cfg.virtual)
    apply_recompute(stage, cfg.recompute)
    model = StageLayers(stage, full.cfg)  # what the optimizer and checkpoints see
    del full  # the layers no chunk took go with it
    device = device_for(cfg)
    if isinstance(resume, str):
        resume = ShardReader(resume, mcfg, rm.coords.tp, cfg.tp)
    # each weight's value, this rank's tp shard of it: the reference initialisation
    # (by name, from the seed) or the checkpoint's tensor, made one at a time
    values = resume.values(device) if resume is not None else \
        init_values(mcfg, cfg.seed, rm.coords.tp, cfg.tp, device)
    if cfg.zero != 3:  # ZeRO-3 makes each unit's shard inside its construction
        materialize(model, values)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # parameters whose gradient is summed over another group after the dp reduction:
    # sequence parallelism's replicated norms (over tp) and a tied embedding's two
    # copies on the first and last stage (over the embedding group)
    sp_names = [n for n, p in named if getattr(p, "sequence_parallel", False)]
    tied = ("tok_emb.weight", "head.weight") if model.cfg.tie_embeddings and rm.embed else ()
    tied_names = [n for n, _ in named if n in tied]
    sync, optimizer, precision = data_parallel(
        cfg, rm, model, [b for c in stage for b in c.blocks.values()], sp_names + tied_names,
        values if cfg.zero == 3 else None)
    actions = make_schedule(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual)
    # The data-parallel layer works through hooks, so the executor runs the chunks.
    # A synchronize after every action makes the GPU timeline true but stalls the host
    # (a few % of a small model's step): only when a trace is asked for.
    executor = PipelineExecutor(stage, rm.pp, actions,
                                synchronize=bool(cfg.trace) and device.type == "cuda")
    parts = Parts(model, stage, optimizer, executor, sync, precision, [n for n, _ in named],
                  sp_names, tied_names)
    if resume is not None:
        load_optimizer_state(rm, parts, resume)
        resume.close()
    return parts


def data_parallel(cfg: TrainConfig, rm: RankMesh, model: torch.nn.Module, units: list,
                  shared: list[str], materialize=None) -> tuple:
    """The one place that picks the data-parallel layout: (gradient sync, optimizer,
    precision). Every ZeRO stage offers the same calls to the step below:
    ``finish_gradient_sync``, ``grad_shards``, ``scale_grads``, ``all_reduce_grads``,
    ``zero_grad``, ``memory_bytes``, ``full_state_by_name`` (checkpoints).

    ZeRO 0-2 is one ``torch.optim.Optimizer`` (``parallel/zero.py``) with bf16 weights
    and fp32 master shards; ZeRO-3 a module whose parameters are the fp32 shards, under a
    plain torch optimizer (``parallel/zero3.py``), which makes each unit's shard from
    ``materialize(name, p)`` (the model is then still on the meta device). Gradients are
    summed, not averaged: the executor already divides each micro-batch loss by
    dp * cp * m (``loss_scale``). The group is dp x cp (``rm.dp_cp``, just dp when
    cp = 1): the weights are replicated over both, so their gradients are summed, and
    ZeRO shards, over both (as Megatron-Core's distributed optimizer does with context
    parallelism).
    """
    from minipar.parallel.precision import MixedPrecision
    from minipar.parallel.zero import ZeroOptimizer
    from minipar.parallel.zero3 import Zero3

    opt_cls, opt_kwargs = optimizer_class(cfg), optimizer_kwargs(cfg)
    bf16 = cfg.dtype == "bf16"
    if cfg.offload:  # ZeRO-Offload: the inner optimizer steps host copies of the shards
        from functools import partial

        from minipar.parallel.offload import OffloadOptimizer

        opt_cls = partial(OffloadOptimizer, optimizer_cls=opt_cls, overlap=False)
    if cfg.zero == 3:
        sync = Zero3(model, rm.dp_cp, units=units, param_dtype=torch.bfloat16 if bf16 else None,
                     shared=shared, average=False, materialize=materialize)
        optimizer = opt_cls(sync.parameters(), **opt_kwargs)
        sync.publish_after(optimizer)
        return sync, optimizer, None
    precision = MixedPrecision(model, torch.bfloat16) if bf16 else None
    bucket_mb = 25.0  # PyTorch DDP's default
    if cfg.zero == 2:  # a bucket per block: ZeRO-2 then holds one full-size bucket at most
        bucket_mb = max((sum(p.numel() * p.element_size() for p in u.parameters())
                         for u in units), default=bucket_mb * 2**20) / 2**20
    sync = ZeroOptimizer(model, opt_cls, stage=cfg.zero, comm=rm.dp_cp, precision=precision,
                         average=False, shared=shared, overlap=cfg.ddp == "overlapped",
                         bucket_mb=0 if cfg.ddp == "naive" else bucket_mb, **opt_kwargs)
    sync.backwards_per_step = cfg.microbatches  # reduce during the last one's backward
    return sync, sync, precision


def loss_scale(cfg: TrainConfig) -> float:
    """What each micro-batch loss is multiplied by: the dp x cp reduction sums, so the
    sum of dp * cp * m scaled losses is the global batch's mean loss. (A cp shard's loss
    is the mean over its tokens; every shard has seq_len / cp of them, so this equals
    its token sum over the global token count.)"""
    return 1.0 / (cfg.dp * cfg.cp * cfg.microbatches)


def clip_gradients(cfg: TrainConfig, rm: RankMesh, parts: Parts) -> torch.Tensor:
    """Scale the gradients so their global L2 norm is at most ``cfg.grad_clip``.

    The one gradient norm of every layout (``dp.global_grad_norm``): each element is
    counted once, on the rank that owns it: its ZeRO shard over dp x cp, tensor-parallel
    shards over tp (replicated parameters on tp rank 0 only), stages over pp. Returns
    the norm before clipping, as a 0-dim tensor on the compute device: the clip factor
    ``min(1, clip / norm)`` is computed and applied there too, as
    ``torch.nn.utils.clip_grad_norm_`` does (read the norm after the update).
    """
    from minipar.parallel.dp import global_grad_norm
    from minipar.parallel.pp import tied_copy
    from minipar.parallel.tp import tp_shard_dim

    def counted(name: str) -> bool:
        if tied_copy(name, parts.model.cfg):  # the last stage's copy of a tied embedding
            return False
        return rm.coords.tp == 0 or tp_shard_dim(name) is not None  # replicated: tp 0

    mine = [g for name, g in parts.data_parallel.grad_shards() if counted(name)]
    norm = global_grad_norm(mine, [rm.dp_cp, rm.tp, rm.pp], device=device_for(cfg))
    if cfg.grad_clip > 0:  # as torch.nn.utils.clip_grad_norm_: multiply by 1.0 if below
        parts.data_parallel.scale_grads((cfg.grad_clip / (norm + 1e-6)).clamp(max=1.0))
    return norm


def train_step(cfg: TrainConfig, rm: RankMesh, parts: Parts, data: TokenSource,
               step: int) -> dict:
    """One optimizer step on the global batch of ``step``. Returns loss and timeline."""
    from minipar.model import set_dropout_key
    from minipar.parallel.cp_plan import shard_batch

    lr = lr_at(step, cfg)
    for group in parts.optimizer.param_groups:
        group["lr"] = lr
    device = device_for(cfg)  # only this replica's rows are built (data.local_batches)
    micro = [tuple(t.to(device) for t in shard_batch(a, b, rm.cp)) for a, b in local_batches(
        data, step, cfg.batch_size, rm.coords.dp, cfg.dp, cfg.microbatches)]
    mb_size = cfg.batch_size // (cfg.dp * cfg.microbatches)

    def key_dropout(mb: int) -> None:  # masks by global sample: the reference's masks
        first = (rm.coords.dp * cfg.microbatches + mb) * mb_size
        for chunk in parts.chunks:
            set_dropout_key(chunk, cfg.seed, step, first)
    # the gradients are reduced over dp during the backwards (the last micro-batch's,
    # or each one's with ZeRO-3); the sync finishes what is still in flight
    result = parts.executor.step(micro, loss_scale=loss_scale(cfg),
                                 loss_as_tensor=True,  # read at the end of the step
                                 before_compute=key_dropout if parts.model.cfg.dropout
                                 else None)
    sync = parts.data_parallel
    sync.finish_gradient_sync()
    # sequence parallelism: layer-norm gradients summed over tp, on the shards
    sync.all_reduce_grads(parts.sp_names, rm.tp)
    if rm.embed is not None:  # a tied embedding: the first and last stage's copies
        sync.all_reduce_grads(parts.tied_names, rm.embed)
    norm = clip_gradients(cfg, rm, parts)
    parts.optimizer.step()
    # peaks of this step; parameters and optimizer states after the update
    held = sync.memory_bytes(parts.optimizer)
    # ZeRO-Offload: host <-> device bytes of this step (the inner OffloadOptimizer's)
    offload = getattr(getattr(parts.optimizer, "inner", None), "last_traffic", None)
    sync.zero_grad()
    loss = None
    if result.loss is not None:  # last stage: the mean over the dp replicas, cp shards
        t = result.loss.detach().to(torch.float64).reshape(1)
        rm.dp_cp.all_reduce(t)
        loss = float(t) / (cfg.dp * cfg.cp)  # the step's one wait for the GPU
    return {"loss": loss, "grad_norm": float(norm), "lr": lr, "timeline": result.timeline,
            "peak_in_flight": result.peak_in_flight, "memory": held, "offload": offload}


def _with_total(mem: dict) -> dict:
    mem["total"] = sum(mem[k] for k in ("params", "grads", "optimizer", "activations"))
    return mem


def rank_main(cfg: TrainConfig) -> dict:
    """Train on this rank (inside ``launch`` or torchrun); return this rank's record."""
    mesh = Mesh(cfg.dp, cfg.pp, cfg.tp, cfg.order, cp=cfg.cp)
    rm = mesh.connect()
    reader, start = None, 0
    if cfg.resume:  # each rank reads only the shards it needs
        reader = ShardReader(cfg.resume, cfg.model_config(), rm.coords.tp, cfg.tp)
        start = reader.step
    end = cfg.steps if cfg.stop_at is None else cfg.stop_at
    if start >= end:  # validate says so before launch; here for a direct caller
        raise ValueError(f"the checkpoint is at step {start} and the run ends at step "
                         f"{end}: nothing to train")
    parts = build(cfg, rm, reader)
    data = make_data(cfg, parts.model.cfg.vocab_size, parts.model.cfg.seq_len)
    reports_loss = (rm.coords.pp == cfg.pp - 1 and rm.coords.dp == 0 and rm.coords.tp == 0
                    and rm.coords.cp == 0)
    losses, norms, timeline, step_times, act_peak, evals = [], [], [], [], 0, []
    param_storages = [f.full for f in parts.data_parallel.flats]  # weights, not activations
    tokens_per_step = cfg.batch_size * parts.model.cfg.seq_len
    last_report = (start, time.time())
    for step in range(start, end):
        t0 = time.time()
        with ActivationMeter(exclude=param_storages) as meter:
            out = train_step(cfg, rm, parts, data, step)
        act_peak = max(act_peak, meter.peak)
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
        if cfg.save and cfg.save_every and done % cfg.save_every == 0 and done < end:
            _save(cfg, rm, parts, done)
        if reports_loss and (done % cfg.log_every == 0 or done == end):
            rate = tokens_per_step * (done - last_report[0]) / (time.time() - last_report[1])
            last_report = (done, time.time())
            report_progress(f"{done} {out['loss']:.6f} {rate:.1f} "
                            f"{evals[-1]['loss'] if evals else float('nan'):.6f}")
    if cfg.save:
        _save(cfg, rm, parts, end)
    last_step = [e for e in timeline if e["step"] == end - 1]
    return {
        "rank": rm.rank, "coords": rm.coords._asdict(), "first_step": start,
        "build_seconds": parts.build_seconds, "host_peak_bytes": parts.host_peak_bytes,
        "losses": losses, "eval": evals,
        "grad_norms": norms, "step_seconds": step_times,
        "memory": _with_total({**out["memory"], "activations": act_peak}),
        "peak_in_flight": out["peak_in_flight"] if end > start else 0,
        "comm": rm.log.summary(),
        "comm_bytes_per_step": rm.log.total("wire_bytes") / max(1, end - start),
        "offload_bytes": out["offload"] if end > start else None,  # last step, host<->device
        "timeline": last_step,
        "trace": {"timeline": timeline, "comm_records": rm.log.to_dicts()}
        if cfg.trace else None,
    }


def _save(cfg: TrainConfig, rm: RankMesh, parts: Parts, step: int) -> None:
    """A checkpoint (collective), then on rank 0: the run card ``sample`` reads (model
    sizes, data, tokenizer) and pruning to the last ``--keep`` checkpoints."""
    from minipar import checkpoint
    from minipar.sample import write_run_card

    checkpoint.save(cfg.save, step, cfg, rm, parts)
    if rm.rank == 0:
        write_run_card(cfg.save, cfg, parts.model.cfg)
        if cfg.keep:
            checkpoint.prune(cfg.save, cfg.keep)


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ)


def _assemble(cfg: TrainConfig, ranks: list[dict], seconds: float) -> dict:
    from minipar.trace import write_chrome_trace

    ranks = sorted(ranks, key=lambda r: r["rank"])
    last = Mesh(cfg.dp, cfg.pp, cfg.tp, cfg.order, cp=cfg.cp).rank(dp=0, pp=cfg.pp - 1)
    record = {"config": cfg.to_dict(), "losses": ranks[last]["losses"],
              "first_step": ranks[last].get("first_step", 0),
              "eval": ranks[last].get("eval", []), "seconds": seconds,
              "world_size": cfg.world_size, "ranks": ranks}
    if cfg.trace:
        try:  # a trace that cannot be written must not lose the run's record
            write_chrome_trace(cfg.trace, [{**r, **r["trace"]} for r in ranks])
        except OSError as e:
            record["trace_error"] = f"--trace {cfg.trace}: not written ({e.strerror or e})"
    for r in ranks:
        r.pop("trace", None)
    return record


def train(cfg: TrainConfig, progress=None, report=None) -> dict:
    """Run a training job: spawn dp*pp*tp*cp local ranks, or join a torchrun job.

    ``progress(step, loss)`` and ``report({step, loss, tokens_per_s, val_loss})`` are
    called here every ``log_every`` steps. Returns the run's record: ``losses`` (one
    per step, mean over the global batch), ``eval`` (``{step, loss}``), the config, and
    per rank its coordinates, memory, communication and last step's timeline;
    ``first_step`` (not 0 after ``resume``); ``trace_error`` when ``cfg.trace`` could not
    be written (the record is returned all the same: a trace must not cost the run).
    """
    t0 = time.time()
    if _under_torchrun():
        return _join_torchrun(cfg, t0)
    validate(cfg)
    prepare_data(cfg)  # tokenise text once, here, before any rank starts

    def on_progress(rank: int, text: str) -> None:
        if not text:
            return
        step, loss, rate, val = text.split()
        if progress is not None:
            progress(int(step) - 1, float(loss))
        if report is not None:
            report({"step": int(step), "loss": float(loss), "tokens_per_s": float(rate),
                    "val_loss": float(val)})

    # On a CUDA build, forking a process whose autograd already ran (a reference run, a
    # notebook cell) fails in the child ("Unable to handle autograd's threading in
    # combination with fork-based multiprocessing"): spawn there; rank_main is importable.
    method = "spawn" if torch.cuda.is_available() else None
    with checkpoint.locked(cfg.save) if cfg.save else nullcontext():  # one run per --save
        ranks = launch(rank_main, cfg.world_size, args=(cfg,), backend=cfg.backend,
                       timeout=cfg.timeout, on_progress=on_progress, start_method=method)
    return _assemble(cfg, list(ranks), time.time() - t0)


def _join_torchrun(cfg: TrainConfig, t0: float) -> dict | None:
    """Under torchrun every process runs this; rank 0 gathers and returns the record."""
    import torch.distributed as dist

    validate(cfg, world_size=int(os.environ["WORLD_SIZE"]))
    prepare_data(cfg)  # every process: the first tokenises, the rest find the cache
    device = None
    if cfg.backend == "nccl":
        device = device_for(cfg)
        torch.cuda.set_device(device)
    dist.init_process_group(cfg.backend, device_id=device)
    try:
        mine = rank_main(cfg)
        everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, everyone, dst=0)
    finally:
        dist.destroy_process_group()
    return _assemble(cfg, everyone, time.time() - t0) if everyone else None


def train_reference(cfg: TrainConfig, progress=None) -> dict:
    """The yardstick: the plain single-device loop, no minipar machinery at all.

    One process, the whole global batch in one forward (its mean loss equals the mean of
    equal micro-batch means), ``clip_grad_norm_``, AdamW, the same learning-rate
    schedule. Every layout's losses are compared with these.
    """
    from minipar.model import set_dropout_key

    torch.manual_seed(cfg.seed)  # (the weights: from the seed by name, init_parameter)
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
