"""The command line:
``python -m minipar {train,rehearse,sample,export,memory,bubble,plan,doctor}``.

Every subcommand prints a readable table and, with ``--json PATH``, writes the same
facts as JSON. Invalid input is rejected with one line before any process starts.
``train``'s flags are built from ``config.TrainConfig``'s fields (``_add_train``); the
theory and machine subcommands (``memory``, ``bubble``, ``plan``, ``doctor``) start no
process at all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import Field, fields

import torch
from tqdm.auto import tqdm

from minipar import checkpoint, checks
from minipar.config import (
    RECOMPUTE,
    SCHEDULE_NAMES,
    TrainConfig,
    sized,
    uses_cuda,
    validate,
)
from minipar.doctor import fits_report, run_doctor
from minipar.engine import RunStopped, rehearse, train
from minipar.export import export, export_hf
from minipar.launch import LaunchError
from minipar.model import get_config
from minipar.parallel.fp8 import RECIPES as FP8_RECIPES
from minipar.parallel.schedules import check_schedule
from minipar.parity import check_run
from minipar.sample import sample
from minipar.startup import release_interrupts
from minipar.theory import bubble, clusters
from minipar.theory.card import MEMORY_MARGIN
from minipar.theory.layout import Layout
from minipar.theory.memory import memory_breakdown
from minipar.theory.params import mfu
from minipar.theory.planner import (
    HOST_SHORT,
    RECOMPUTES,
    against_bf16,
    as_run,
    fp8_refusal,
    plan,
)

# run as the program, a Ctrl-C since the package's first line was kept while all the
# above loaded (``minipar/startup.py``): now it ends the program in one line
release_interrupts()

__all__ = ["build_parser", "main", "parse_count", "train_config"]


def _write_json(path: str | None, payload: dict) -> None:
    """``--json PATH``: the facts a command printed, as JSON (nothing without a path). A
    file is replaced whole or not at all (a full disk leaves the one before); a write
    that fails names the path."""
    if not path:
        return
    text = json.dumps(payload, indent=1, default=str)
    regular = not os.path.exists(path) or os.path.isfile(path)  # (not /dev/stdout, a pipe)
    target = f"{path}.tmp-{os.getpid()}" if regular else path
    try:
        with open(target, "w") as f:
            f.write(text)
        if regular:
            os.replace(target, path)
    except OSError as e:
        if regular and os.path.exists(target):
            os.remove(target)
        raise OSError(e.errno, e.strerror, path) from None


# --- train ------------------------------------------------------------------------------

def _train_fields() -> list[Field]:
    """The ``TrainConfig`` fields that are ``train`` flags (those declared with a help)."""
    return [f for f in fields(TrainConfig) if "help" in f.metadata]


def _add_train(sub) -> None:
    """``train``'s flags, then the command line's own: where the record goes, the
    progress bar, the comparison with one process."""
    p = sub.add_parser("train", help="train the GPT on 1 or dp*pp*tp*cp ranks")
    _add_train_flags(p)
    p.add_argument("--json", help="write the run's record as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--compare", action="store_true",
                   help="also train the single-process reference and print both")


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ``TrainConfig`` option (``--batch-size`` is ``batch_size``: its type,
    default, help and choices)."""
    for f in _train_fields():
        kind = str(f.type).split(" | ")[0]  # "int | None": an int, or not given
        if kind == "bool":  # a switch; one on by default (or decided by the machine:
            # None) also has its --no- form
            how = {"action": argparse.BooleanOptionalAction if f.default is not False
                   else "store_true"}
        else:
            how = {"type": {"int": int, "float": float, "str": str}[kind],
                   "choices": f.metadata["choices"]}
        p.add_argument("--" + f.name.replace("_", "-"), default=f.default,
                       help=f.metadata["help"], **how)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` a parsed ``train`` command line asks for (flag -> field)."""
    return TrainConfig(**{f.name: getattr(args, f.name) for f in _train_fields()})


def _cmd_train(args) -> int:
    cfg = train_config(args)
    validate(cfg)
    checks.output_file("json", args.json)
    checks.distinct({"json": args.json, "trace": cfg.trace, "save": cfg.save},
                    {"data": cfg.data, "resume": cfg.resume})
    checks.not_inside({"json": args.json}, "save", cfg.save, checkpoint.SAVE_NAMES)
    notes = [checks.oversubscription(cfg.world_size)] + (
        checkpoint.resume_notes(cfg.resume, cfg) if cfg.resume else [])
    for note in filter(None, notes):
        print(f"minipar train: note: {note}", file=sys.stderr)
    bar = tqdm(total=cfg.steps, desc="train", disable=args.quiet, leave=False)
    peak, model_cfg = _peak_flops(cfg), cfg.model_config()

    def report(r: dict) -> None:
        bar.update(r["step"] - bar.n)
        shown = {"loss": f"{r['loss']:.4f}", "tok/s": f"{r['tokens_per_s']:,.0f}"}
        if r["val_loss"] == r["val_loss"]:  # not NaN: an evaluation has run
            shown["val"] = f"{r['val_loss']:.4f}"
        if peak:
            shown["MFU"] = f"{mfu(r['tokens_per_s'], model_cfg, cfg.world_size, peak):.1%}"
        bar.set_postfix(shown)

    stopped = None
    try:
        record = train(cfg, report=report)
    except RunStopped as e:  # the steps done are kept: printed and written as JSON
        record, stopped = e.record, str(e)
    except LaunchError as e:  # a rank failed, died or hung: the steps before it are kept
        _keep_steps_done(args.json, e)
        raise
    finally:
        bar.close()
    if record is None:  # a torchrun rank other than 0
        return 0
    compared = None  # the one-process reference comes second: cut short, it loses nothing
    if args.compare and not stopped:  # the reference's steps first..last, as resumed
        try:
            record.update(check_run(cfg, record))
        except KeyboardInterrupt:
            compared = "interrupted while training the one-process reference"
    _print_run(cfg, record)  # printed first: a failing output below loses nothing
    for e in record.get("eval", []):
        # (the table above numbers steps from 0; an evaluation counts the steps done)
        print(f"validation loss after {e['step']} steps: {e['loss']:.4f}")
    _write_json(args.json, record)
    if compared:
        print(f"minipar train: {compared} (the run's record is kept)", file=sys.stderr)
        return 130
    errors = [e for e in (stopped, record.get("trace_error")) if e]
    if errors:
        print(f"minipar train: error: {errors[0]}", file=sys.stderr)
        return 1
    return 0


def _keep_steps_done(path: str | None, error: LaunchError) -> None:
    """A run that failed after some steps: how far it got printed, and with ``--json``
    every step's loss written beside the failure (``error.record``; its checkpoints,
    ``--save-every``, are on disk already)."""
    done = (error.record or {}).get("progress")
    if not done:
        return
    first, last = done[0], done[-1]
    print(f"the run reached step {last['step']} before the failure: loss "
          f"{first['loss']:.4f} at step {first['step']}, {last['loss']:.4f} at step "
          f"{last['step']}")
    _write_json(path, {**error.record, "error": _without_traceback(str(error))})


def _peak_flops(cfg) -> float | None:
    """Dense bf16 FLOP/s of this GPU, for MFU (None on CPU, unknown cards, or several
    ranks per GPU under gloo)."""
    if cfg.backend != "nccl" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    for key, gpu in clusters.GPUS.items():
        if key.split("-")[0] in name:
            return gpu.peak_flops
    return None


def _print_run(cfg, record: dict) -> None:
    ref, ref_norms = record.get("reference_losses"), record.get("reference_grad_norms")
    norms = record["ranks"][0]["grad_norms"]
    head = f"{'step':>5}  {'loss':>9}  {'grad norm':>9}"
    if ref:
        head += f"  {'1 process':>9}  {'diff':>8}  {'grad norm':>9}  {'rel diff':>8}"
    print(f"dp={cfg.dp} pp={cfg.pp} tp={cfg.tp} {f'cp={cfg.cp} ' if cfg.cp > 1 else ''}"
          f"zero={cfg.zero} {'offload ' if cfg.offload else ''}"
          f"{'schedule=' + cfg.schedule + ' ' if cfg.pp > 1 else ''}"
          f"microbatches={cfg.microbatches} {cfg.dtype}: {record['world_size']} ranks")
    print(head)
    for i, loss in enumerate(record["losses"]):
        line = f"{record.get('first_step', 0) + i:>5}  {loss:>9.5f}  {norms[i]:>9.4f}"
        if ref:
            rel = abs(norms[i] / ref_norms[i] - 1) if ref_norms[i] else abs(norms[i])
            line += (f"  {ref[i]:>9.5f}  {abs(loss - ref[i]):>8.1e}  {ref_norms[i]:>9.4f}"
                     f"  {rel:>8.1e}")
        print(line)
    if ref and record["parity"]["param_diff"] is not None:
        print(f"final parameters: max |diff| {record['parity']['param_diff']:.1e} "
              "against one process")
    if record.get("audit"):
        print(record["audit"])
    print()
    steps = max(1, len(record["losses"]))
    # with cp: a cp column, and the ring's bytes and dp x cp's gradient sums (dp_cp)
    dims = ("dp", "pp", "tp", "cp", "dp_cp") if cfg.cp > 1 else ("dp", "pp", "tp")
    coords = ("dp", "pp", "tp", "cp") if cfg.cp > 1 else ("dp", "pp", "tp")
    print(f"{'rank':>4} " + " ".join(f"{d:>3}" for d in coords) + f" {'params':>9} "
          f"{'grads':>9} {'optim':>9} {'activ':>9}   sent per step on: "
          + " ".join(f"{d:>9}" for d in dims) + f"  {'build':>6} {'host+':>8}")
    for r in record["ranks"]:
        m, c = r["memory"], r["coords"]
        kib = [f"{m[k] / 1024:>8.0f}K" if m[k] is not None else f"{'-':>9}"
               for k in ("params", "grads", "optimizer", "activations")]
        sent = [sum(o["wire_bytes"] for o in r["comm"].get(d, {}).values()) / steps / 1024
                for d in dims]
        print(f"{r['rank']:>4} " + " ".join(f"{c[d]:>3}" for d in coords) + f" {' '.join(kib)}"
              f"{'':>19}" + " ".join(f"{x:>8.1f}K" for x in sent)
              + f"  {r.get('build_seconds', 0):>5.2f}s"
              f" {r.get('host_peak_bytes', 0) / 2**20:>7.1f}M")
    print("(bytes this rank held at their peak within a step; "
          "bytes sent as a ring algorithm puts them on the wire; build: seconds to\n"
          " compose this rank's shards, host+: the host memory that added at its peak;"
          " activ: - unless --measure-activations)")


# --- rehearse ---------------------------------------------------------------------------

def _add_rehearse(sub) -> None:
    p = sub.add_parser("rehearse", help="try a layout's ranks one at a time on this "
                       "machine's one device, their peers imagined: memory and compute")
    _add_train_flags(p)
    p.add_argument("--ranks", help="comma-separated ranks (default: the first rank of "
                   "each pipeline stage)")
    p.add_argument("--json", help="write the ranks' records as JSON")
    p.add_argument("--memory-snapshot", metavar="PREFIX", help="on CUDA: each rank's "
                   "allocations, written as PREFIX.rankR.pickle (pytorch.org/memory_viz)")


def _cmd_rehearse(args) -> int:
    cfg = train_config(args)
    checks.output_file("json", args.json)
    checks.distinct({"json": args.json, "trace": cfg.trace}, {"data": cfg.data})
    ranks = None
    if args.ranks:
        try:
            ranks = [int(r) for r in args.ranks.split(",")]
        except ValueError:
            raise ValueError(f"--ranks must be comma-separated integers, got "
                             f"{args.ranks!r}") from None
    record = rehearse(cfg, ranks, args.memory_snapshot)
    # GiB for a model that needs a GPU, MiB for one a laptop rehearses
    big = max(r["predicted"]["live"] for r in record["ranks"]) >= 2**30
    unit, name = (2**30, "GiB") if big else (2**20, "MiB")
    device = torch.cuda.get_device_name(0) if uses_cuda(cfg) else "the CPU"
    print(f"{cfg.layout_name()} {cfg.dtype}, {cfg.world_size} ranks: each rank below ran "
          f"alone on {device}, its peers imagined (no wire, no waiting)")
    print(f"{'rank':>4} {'dp':>3} {'pp':>3} {'tp':>3} {'cp':>3}  {'live ' + name:>17}  "
          f"{'reserved ' + name:>17}  {'compute s':>17}")
    print(f"{'':>20}  {'model':>8} {'measured':>8}  {'model':>8} {'measured':>8}  "
          f"{'model':>8} {'measured':>8}")
    notes = []
    for r in record["ranks"]:
        c, p, dev = r["coords"], r["predicted"], r["device_memory"] or {}
        live = dev.get("peak_allocated", r.get("cpu_peak_allocated"))
        held = dev.get("peak_reserved")
        shown = (f"{_opt(live, unit):>8}", f"{_opt(held, unit):>8}",
                 f"{_opt(p.get('compute_seconds'), 1, 3):>8}",
                 f"{_opt(r.get('compute_seconds'), 1, 3):>8}")
        print(f"{r['rank']:>4} {c['dp']:>3} {c['pp']:>3} {c['tp']:>3} {c['cp']:>3}  "
              f"{p['live'] / unit:>8.2f} {shown[0]}  {p['reserved'] / unit:>8.2f} "
              f"{shown[1]}  {shown[2]} {shown[3]}")
        if r.get("out_of_memory"):
            notes.append(f"rank {r['rank']} ran out of memory: {r['out_of_memory']}")
        elif dev:
            need = held + r["runtime_bytes"]
            verdict = "fits" if need <= dev["capacity"] else "does NOT fit"
            notes.append(f"rank {r['rank']} {verdict}: its allocator's peak, {held / 2**30:.1f} "
                         f"GiB, and what a rank of the job holds outside it (the CUDA "
                         f"context, NCCL's buffers for its peers: "
                         f"{r['runtime_bytes'] / 2**30:.1f}) make {need / 2**30:.1f} of "
                         f"{dev['capacity'] / 2**30:.1f} GiB")
    print("\n".join(notes))
    print("(live: the peak of tensors, on the CPU as torch's profiler counts them; "
          "reserved: the caching allocator's peak; model: "
          "theory.card.card_peak, the planner's; compute: the median step, the first left "
          "out, without communication, and on a GPU the planner's step model of it)")
    _write_json(args.json, record)
    if record.get("trace_error"):
        print(f"minipar rehearse: {record['trace_error']}", file=sys.stderr)
        return 1
    return 0


def _opt(x: float | None, unit: float, digits: int = 2) -> str:
    return "-" if x is None else f"{x / unit:.{digits}f}"


# --- sample and export ------------------------------------------------------------------

def _cmd_sample(args) -> int:
    print(sample(args.resume, args.prompt, args.tokens, args.temperature, args.seed,
                 progress=True))
    return 0


def _cmd_export(args) -> int:
    checks.output_file("json", args.json)
    checks.distinct({"out": args.out, "json": args.json}, {"resume": args.resume})
    if args.format == "hf":
        checks.not_inside({"json": args.json}, "out", args.out)
    out = (export_hf if args.format == "hf" else export)(args.resume, args.out)
    print(f"wrote {out['path']}: {out['tensors']} tensors, {out['bytes'] / 2**20:.1f} MiB, "
          f"step {out['step']}")
    _write_json(args.json, out)
    return 0


# --- the theory and machine subcommands --------------------------------------------------

# doctor's layout flags for --model, at their defaults
DOCTOR_LAYOUT = {"dp": 1, "pp": 1, "tp": 1, "zero": 0, "dtype": "fp32"}


def _cmd_doctor(args) -> int:
    checks.output_file("json", args.json)
    layout = [f"--{k} {v}" for k, v in (("dp", args.dp), ("pp", args.pp), ("tp", args.tp),
                                         ("zero", args.zero), ("dtype", args.dtype))
              if v != DOCTOR_LAYOUT[k]]
    if layout and not args.model:
        raise ValueError(f"{' '.join(layout)} is the layout of --model: give --model NAME "
                         "too (doctor checks it fits this machine)")
    # the model's fit first: pure arithmetic, so a bad --model or size is refused before
    # the checks start processes
    fit = fits_report(args.model, dp=args.dp, tp=args.tp, pp=args.pp, zero=args.zero,
                      dtype=args.dtype) if args.model else None
    results = run_doctor()
    payload: dict = {"checks": results}
    if fit is not None:
        payload["model"] = fit
        results = results + fit["checks"]
    for r in results:
        print(f"{'OK  ' if r['ok'] else 'FIX '} {r['check']:<11} {r['message']}")
    payload["ok"] = all(r["ok"] for r in results)
    _write_json(args.json, payload)
    return 0 if payload["ok"] else 1


def parse_count(text: str) -> int:
    """A parameter count: ``7500000000``, ``7.5e9``, ``7.5B``, ``350M``, ``1.2T``."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    t = str(text).strip().replace("_", "").replace(",", "")
    try:
        value = float(t[:-1]) * scale[t[-1].upper()] if t and t[-1].upper() in scale \
            else float(t)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a parameter count (e.g. 7.5e9, 7.5B, 350M)")
    return int(round(value))


# the model flags beside --model (``_add_model_args``)
MODEL_SIZES = ("layers", "hidden", "heads", "ffn", "vocab", "seq_len", "moe_experts",
               "moe_top_k", "capacity_factor")


def _model_from_args(args):
    """A preset, optionally with custom sizes (``--layers --hidden --heads ...``)."""
    checks.output_file("json", args.json)
    checks.model_sizes(layers=args.layers, hidden=args.hidden, heads=args.heads,
                       vocab=args.vocab, seq_len=args.seq_len)
    if getattr(args, "params", None) is not None:
        given = [f"--{k.replace('_', '-')} {v}" for k in ("model", *MODEL_SIZES)
                 if (v := getattr(args, k)) is not None]
        if given:
            raise ValueError(f"--params counts a model's states from its size alone: give "
                             f"it without --model and the sizes, or drop it (got "
                             f"{' '.join(given)} too)")
        return None
    cfg = sized(get_config(args.model or "tiny"), args.layers, args.hidden, args.heads,
                args.ffn, args.vocab, args.seq_len)
    moe = {"n_expert": args.moe_experts, "moe_top_k": args.moe_top_k,
           "capacity_factor": args.capacity_factor}
    return cfg.with_(**{k: v for k, v in moe.items() if v is not None})


def _model_label(args) -> str:
    """What ``_model_from_args`` built, in words: the preset, and any sizes changed."""
    changed = [f"--{k.replace('_', '-')} {v}" for k in MODEL_SIZES
               if (v := getattr(args, k)) is not None]
    return (args.model or "tiny") + (f" with {' '.join(changed)}" if changed else "")


def _gb(x: float) -> str:
    return f"{x / 2**30:9.2f} GiB"


def _cmd_memory(args) -> int:
    cfg = _model_from_args(args)
    checks.positive("params", args.params)
    checks.positive("microbatch-size", args.microbatch_size)
    checks.positive("microbatches", args.microbatches)
    checks.layout(cfg, args.dp, args.pp, args.tp, args.virtual, args.sp)
    check_schedule(args.schedule, args.pp, args.microbatches, args.virtual, zero=args.zero,
                   recompute=args.recompute)  # the layouts train and bubble refuse
    layout = Layout(dp=args.dp, pp=args.pp, tp=args.tp, cp=args.cp, ep=args.ep,
                    zero=args.zero, microbatch_size=args.microbatch_size,
                    microbatches=args.microbatches, schedule=args.schedule,
                    virtual=args.virtual, sp=args.sp, recompute=args.recompute,
                    offload=args.offload, dtype=args.dtype, optimizer=args.optimizer,
                    fp8=args.fp8)
    if args.fp8:  # as train runs it on a GPU: the rules it checks, its blocks' compilation
        if cfg is None:
            raise ValueError("--fp8 changes what a model's blocks keep: give --model (or "
                             "its sizes), not --params")
        if refused := fp8_refusal(cfg, layout):
            raise ValueError(refused)
        layout = as_run(layout)
    mem = memory_breakdown(cfg, layout, params=args.params, accounting=args.accounting)
    what = _model_label(args) if cfg is not None else f"{args.params:,} parameters"
    cp = f" cp={args.cp}" if args.cp > 1 else ""
    cp += f" ep={args.ep}" if args.ep > 1 else ""
    precision = args.dtype + (f" fp8={args.fp8} ({'compiled' if layout.compiled else 'eager'}"
                              " blocks)" if args.fp8 else "")
    print(f"per-device memory of {what}, dp={args.dp} pp={args.pp} tp={args.tp}{cp} "
          f"zero={args.zero}{' offload' if args.offload else ''} {precision} "
          f"(stage {mem['stage']}, the most loaded)")
    for key in ("params", "grads", "optimizer", "activations", "loss_workspace",
                "moe_dispatch", "in_flight", "total", "host"):
        if key in mem:
            print(f"  {key:<12}{_gb(mem[key])}   {mem[key]:>18,} bytes")
    _write_json(args.json, mem)
    return 0


def _cmd_bubble(args) -> int:
    checks.output_file("json", args.json)
    shape = (args.schedule, args.pp, args.microbatches, args.virtual)
    if checks.bubble(*shape):
        rep = bubble.bubble_report(*shape)
        print(rep["table"] if args.pp <= 32 and len(rep["table"]) <= 20_000 else
              "(table omitted: too wide to read; --json holds the timeline)")
    else:  # simulating 10^10 actions would take hours and all the memory: closed forms
        ratio = bubble.bubble_ratio_formula(*shape)
        rep = {"schedule": args.schedule, "pp": args.pp, "microbatches": args.microbatches,
               "virtual": args.virtual, "bubble_fraction": ratio / (1 + ratio),
               "bubble_ratio": ratio, "bubble_fraction_formula": ratio / (1 + ratio),
               "bubble_ratio_formula": ratio, "simulated": False}
        print(f"(no table: {args.pp * args.microbatches * args.virtual:,} pipeline actions "
              f"exceed {checks.BUBBLE_TABLE_CELLS:,}; the figures are the closed forms)")
    print(f"bubble fraction (idle share of the step): {rep['bubble_fraction']:.4f}"
          f"   formula {rep['bubble_fraction_formula']:.4f}")
    print(f"bubble ratio (idle over ideal time):      {rep['bubble_ratio']:.4f}"
          f"   formula {rep['bubble_ratio_formula']:.4f}")
    if "peak_in_flight" in rep:
        print(f"peak micro-batches in flight per rank: {rep['peak_in_flight']}")
    _write_json(args.json, rep)
    return 0


def _cmd_plan(args) -> int:
    cfg = _model_from_args(args)
    checks.cluster(args.gpus, args.gpu, args.gpus_per_node, args.batch, args.top,
                   args.memory_margin, clusters.GPUS, args.host_memory)
    calib = clusters.load_calibration(args.calibrate) if args.calibrate else None
    if args.gpus or calib:  # a calibrated machine: its GPUs, one node, unless told
        gpus = args.gpus or int(calib.get("gpus", 1))
        kind = args.gpu if args.gpus or not calib else clusters.gpu_for_device(
            str(calib.get("device", "")))
        where = clusters.cluster(gpus, kind, args.gpus_per_node if args.gpus else gpus)
    else:
        where = clusters.get_cluster(args.cluster)
    if args.fp8:
        clusters.check_fp8_card(where)
    if calib:
        where = clusters.calibrated(where, calib)
        rates = ", ".join(f"{op} {bw / 1e9:.0f} GB/s + {lat * 1e6:.0f} us"
                          for op, lat, bw in where.links)
        print(f"calibrated ({args.calibrate}): matmul {where.matmul_rate / 1e12:.0f} TFLOP/s"
              f"; {rates}")
    if args.host_memory:
        where = where.with_(host_memory=int(args.host_memory * 2**30))
    modes = tuple(args.recompute_modes.split(","))
    checks.choices("recompute-modes", modes, RECOMPUTE)
    degrees = {d: getattr(args, d) for d in ("dp", "pp", "tp", "cp")
               if getattr(args, d) is not None}
    for dim, n in degrees.items():
        checks.positive(dim, n)
    search = dict(offload=args.offload, memory_margin=args.memory_margin, recomputes=modes,
                  degrees=degrees, separate_reduce_group=args.separate_reduce_group)
    result = plan(cfg, where, args.batch, fp8=args.fp8, **search)
    model_flags = _model_flags(args)
    shown = result.layouts[: args.top]
    wide = max([60] + [len(est.layout.label()) for est in shown])  # the layout column
    print(f"{'#':>3}  {'layout':<{wide}} {'step s':>9} {'MFU':>6} {'GiB/GPU':>8}")
    for i, est in enumerate(shown):
        print(f"{i + 1:>3}  {est.layout.label():<{wide}} {est.step_time:>9.3g} {est.mfu:>6.1%} "
              f"{est.memory['process'] / 2**30:>8.1f}")
        print(f"     {est.layout.command(args.model)}{model_flags}")
    print(f"(GiB/GPU: what the card holds, the allocator's reserve and the runtime included; "
          f"a layout fits within {1 - args.memory_margin:.0%} of the card's "
          f"{where.gpu_memory / 2**30:.1f} GiB: --memory-margin {args.memory_margin}; "
          "'rehearse' in place of 'train' tries a command's ranks on one GPU first)")
    print()
    print(result.why())
    bf16 = plan(cfg, where, args.batch, **search) if args.fp8 else None
    if bf16 is not None:
        print(against_bf16(result, bf16))
    if not result.layouts and not args.offload:
        _offload_hint(cfg, where, args, model_flags, degrees)
    _write_json(args.json, {"best": result.best.to_dict() if result.best else None,
                            "layouts": [{**x.to_dict(), "command": x.layout.command(args.model)
                                         + model_flags} for x in result.layouts[: args.top]],
                            "rejected": dict(result.rejected), "why": result.why(),
                            **({"bf16_best": bf16.best and bf16.best.to_dict(),
                                "against_bf16": against_bf16(result, bf16)} if bf16 else {})})
    return 0


def _offload_hint(cfg, where, args, model_flags: str, degrees: dict[str, int]) -> None:
    """Where nothing fits, whether ZeRO-Offload (the fp32 states and the step on the
    host) would, and what it would cost: the first such layout and its command."""
    spilled = plan(cfg, where, args.batch, offload=True, memory_margin=args.memory_margin,
                   degrees=degrees, fp8=args.fp8)
    if not spilled.layouts:
        if HOST_SHORT in spilled.examples:
            print(f"\nNor does --offload fit: its host states exceed the node's "
                  f"{where.host_memory / 2**30:.0f} GiB (e.g. {spilled.examples[HOST_SHORT]})")
        return
    est = spilled.best
    print(f"\nWith --offload {len(spilled.layouts)} layouts fit (ZeRO-Offload: the fp32 "
          "weights, gradients and optimizer states on the host,\nwhich steps them); the "
          "first:\n"
          f"  {est.layout.label()}: {est.step_time:.3g} s a step, "
          f"{est.memory['process'] / 2**30:.1f} GiB per GPU, "
          f"{est.memory['host'] / 2**30:.0f} GiB of host memory per rank"
          + (f" (x {where.gpus_per_node} a node)" if where.gpus_per_node > 1 else "")
          + ("" if where.host_memory else ", not checked against a host: --host-memory GIB")
          + f"\n  {est.layout.command(args.model)}{model_flags}")


def _model_flags(args) -> str:
    """The model flags given to ``plan`` (sizes, experts), for the ``train`` commands it
    prints."""
    return "".join(f" --{k.replace('_', '-')} {getattr(args, k)}" for k in MODEL_SIZES
                   if getattr(args, k, None) is not None)


def _add_model_args(p, default: str | None) -> None:
    p.add_argument("--model", default=default, help="preset name (minipar.model.PRESETS)")
    p.add_argument("--layers", type=int, help="override n_layer")
    p.add_argument("--hidden", type=int, help="override d_model")
    p.add_argument("--heads", type=int, help="override n_head")
    p.add_argument("--ffn", type=int, help="override d_ff")
    p.add_argument("--vocab", type=int, help="override vocab_size")
    p.add_argument("--seq-len", type=int, help="override seq_len")
    p.add_argument("--moe-experts", type=int, help="experts per MoE layer (0: dense)")
    p.add_argument("--moe-top-k", type=int, help="experts per token")
    p.add_argument("--capacity-factor", type=float,
                   help="expert slots per sequence over k*seq/E (0: dropless)")
    p.add_argument("--json")


def _add_theory(sub) -> None:
    m = sub.add_parser("memory", help="per-device memory breakdown (theory)")
    _add_model_args(m, None)
    m.add_argument("--params", type=parse_count,
                   help="parameter count alone (7.5e9, 7.5B): model states only")
    for dim in ("dp", "pp", "tp", "cp", "ep"):
        m.add_argument(f"--{dim}", type=int, default=1)
    m.add_argument("--zero", type=int, default=0, choices=range(4))
    m.add_argument("--offload", action="store_true",
                   help="ZeRO-Offload: optimizer states on the host (reported as host)")
    m.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    m.add_argument("--optimizer", default="adam", choices=("adam", "adamw", "sgd"))
    m.add_argument("--microbatch-size", type=int, default=1)
    m.add_argument("--microbatches", type=int, default=1)
    m.add_argument("--schedule", default="1f1b", choices=SCHEDULE_NAMES)
    m.add_argument("--virtual", type=int, default=1)
    m.add_argument("--sp", action="store_true")
    m.add_argument("--recompute", default="none", choices=RECOMPUTE)
    m.add_argument("--fp8", choices=FP8_RECIPES,
                   help="the blocks' linears in float8, as train --fp8 runs them on a GPU "
                   "(a compiled float8 block keeps fewer activations; train's float8 rules "
                   "checked)")
    m.add_argument("--accounting", default="korthikanti", choices=("korthikanti", "fused"),
                   help="activations: the paper's (attention scores stored) or a fused-"
                   "attention run's (what minipar's GPT keeps, plus the loss's workspace)")
    b = sub.add_parser("bubble", help="pipeline schedule table and bubble figures")
    b.add_argument("--schedule", default="1f1b", choices=SCHEDULE_NAMES)
    b.add_argument("--pp", type=int, default=4)
    b.add_argument("--microbatches", type=int, default=8)
    b.add_argument("--virtual", type=int, default=1)
    b.add_argument("--json")
    p = sub.add_parser("plan", help="rank layouts of a model on a cluster")
    _add_model_args(p, "gpt-1.3b")
    p.add_argument("--cluster", default="dgx-a100", help="cluster preset")
    p.add_argument("--gpus", type=int, help="custom cluster: number of GPUs")
    p.add_argument("--gpu", default="A100-80GB", help="custom cluster: GPU kind")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--batch", type=int, help="global batch (sequences); default = GPUs")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--offload", action="store_true",
                   help="try ZeRO-Offload where a layout does not fit without it")
    p.add_argument("--memory-margin", type=float, default=MEMORY_MARGIN,
                   help="share of each GPU's memory a layout leaves free (default "
                   f"{MEMORY_MARGIN}: the largest under-prediction measured on 4 x H100)")
    p.add_argument("--recompute-modes", default=",".join(RECOMPUTES), metavar="MODES",
                   help="the recomputation modes to try, comma-separated (default "
                   f"{','.join(RECOMPUTES)})")
    p.add_argument("--host-memory", type=float, metavar="GIB", help="host memory of a node "
                   "(GiB), which --offload's states must fit (default: the named clusters' "
                   "data sheet; not checked for --gpus)")
    p.add_argument("--calibrate", metavar="FILE", help="measured rates of a machine "
                   "(benchmarks/multigpu.py --sections calibrate) instead of the preset's")
    p.add_argument("--separate-reduce-group", action="store_true",
                   help="ZeRO-3 layouts reduce on a second communicator (train's flag): "
                   "its buffers counted")
    p.add_argument("--fp8", choices=FP8_RECIPES,
                   help="plan a float8 run (train --fp8): every layout's blocks multiply "
                   "their linears in float8, on GPUs that have float8 matmuls; layouts "
                   "train would refuse are rejected. The same search runs in bf16 too, and "
                   "a last line compares the two bests: float8 pays on wide compiled blocks, "
                   "little on narrow ones, and costs on eager ones (pipelines, tp)")
    for dim in ("dp", "pp", "tp", "cp"):
        p.add_argument(f"--{dim}", type=int, help=f"only layouts with this {dim} degree")


# --- the parser and the dispatch ----------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minipar", description="Train a GPT on any layout of data, tensor, pipeline, "
        "context and expert parallelism, and plan, price and check layouts before a run. "
        "Each subcommand's --help lists its flags; invalid input is refused in one line "
        "before any process starts.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_rehearse(sub)
    _add_theory(sub)
    d = sub.add_parser("doctor", help="check this machine for the course")
    d.add_argument("--json")
    d.add_argument("--model", help="also check this preset fits here (host and GPU memory)")
    for dim in ("dp", "pp", "tp"):
        d.add_argument(f"--{dim}", type=int, default=DOCTOR_LAYOUT[dim],
                       help="layout for --model")
    d.add_argument("--zero", type=int, default=DOCTOR_LAYOUT["zero"], choices=range(4))
    d.add_argument("--dtype", default=DOCTOR_LAYOUT["dtype"], choices=("fp32", "bf16"))
    s = sub.add_parser("sample", help="text generated by a checkpoint of any layout")
    s.add_argument("--resume", required=True, help="checkpoint directory (train --save)")
    s.add_argument("--prompt", default="", help="text to continue")
    s.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    s.add_argument("--temperature", type=float, default=0.8, help="0: the likeliest token")
    s.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("export", help="the full model of a checkpoint, as safetensors")
    e.add_argument("--resume", required=True, help="checkpoint directory (train --save)")
    e.add_argument("--out", required=True,
                   help="the .safetensors file to write (--format hf: a directory)")
    e.add_argument("--format", default="minipar", choices=("minipar", "hf"),
                   help="hf: a directory transformers loads (GPT2LMHeadModel, AutoTokenizer)")
    e.add_argument("--json")
    return parser


COMMANDS = {"train": _cmd_train, "rehearse": _cmd_rehearse, "memory": _cmd_memory,
            "bubble": _cmd_bubble, "plan": _cmd_plan, "doctor": _cmd_doctor,
            "sample": _cmd_sample, "export": _cmd_export}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; every failure ends as one line on stderr and an exit status
    (2: bad input, 1: the run failed, 130: interrupted), never as a traceback."""
    args = build_parser().parse_args(argv)
    say = f"minipar {args.command}: error:"
    try:
        return COMMANDS[args.command](args)
    except ValueError as e:  # bad input: one clear line
        print(f"{say} {e}", file=sys.stderr)
        return 2
    except LaunchError as e:  # a rank failed, died or hung: what and where, no traceback
        print(f"{say} {_without_traceback(str(e))}", file=sys.stderr)
        return 1
    except OSError as e:  # a disk full, a file gone: the path and the reason
        where = f" {e.filename}:" if e.filename else ""
        print(f"{say}{where} {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the launcher has stopped every rank by now
        print(f"minipar {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug of ours: still one line, and how to see more
        print(f"{say} {type(e).__name__}: {e} (an internal error: call minipar from Python "
              "to see its traceback, and please report it)", file=sys.stderr)
        return 1


def _without_traceback(report: str) -> str:
    """A rank's report up to its traceback or log tail, its "(rank 1 was: ...)" on the
    same line; a timeout keeps its line per rank (where each one was)."""
    return report.split("\n--- ", 1)[0].rstrip().replace("\n  (", " (")


if __name__ == "__main__":
    sys.exit(main())
