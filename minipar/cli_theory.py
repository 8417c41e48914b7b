"""The command line's theory and machine subcommands: ``memory``, ``bubble``, ``plan``,
``doctor`` (no process is started by any of them), and the helpers they share with
``train`` (``--json`` output, model sizes from flags, parameter counts like ``7.5B``).
``minipar/__main__.py`` builds the parser and dispatches.
"""

from __future__ import annotations

import argparse
import json

from minipar.config import SCHEDULE_NAMES
from minipar.theory.memory import MEMORY_MARGIN


def _write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1, default=str)


def _cmd_doctor(args) -> int:
    from minipar.checks import output_file
    from minipar.doctor import fits_report, run_doctor

    output_file("json", args.json)
    results = run_doctor()
    payload: dict = {"checks": results}
    if args.model:
        fit = fits_report(args.model, dp=args.dp, tp=args.tp, pp=args.pp, zero=args.zero,
                          dtype=args.dtype)
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


def _model_from_args(args):
    """A preset, optionally with custom sizes (``--layers --hidden --heads ...``)."""
    from minipar import checks
    from minipar.model import get_config

    checks.output_file("json", args.json)
    checks.model_sizes(layers=args.layers, hidden=args.hidden, heads=args.heads,
                       vocab=args.vocab, seq_len=args.seq_len)
    if args.model is None and getattr(args, "params", None) is not None:
        return None
    from minipar.config import sized

    cfg = sized(get_config(args.model or "tiny"), args.layers, args.hidden, args.heads,
                args.ffn, args.vocab, args.seq_len)
    moe = {"n_expert": args.moe_experts, "moe_top_k": args.moe_top_k,
           "capacity_factor": args.capacity_factor}
    return cfg.with_(**{k: v for k, v in moe.items() if v is not None})


def _model_label(args) -> str:
    """What ``_model_from_args`` built, in words: the preset, and any sizes changed."""
    changed = [f"--{k.replace('_', '-')} {v}" for k in ("layers", "hidden", "heads", "vocab",
                                                        "seq_len", "moe_experts",
                                                        "moe_top_k", "capacity_factor")
               if (v := getattr(args, k)) is not None]
    return (args.model or "tiny") + (f" with {' '.join(changed)}" if changed else "")


def _gb(x: float) -> str:
    return f"{x / 2**30:9.2f} GiB"


def _cmd_memory(args) -> int:
    from minipar import checks
    from minipar.theory.memory import memory_breakdown

    cfg = _model_from_args(args)
    checks.positive("params", args.params)
    checks.positive("microbatch-size", args.microbatch_size)
    checks.positive("microbatches", args.microbatches)
    checks.layout(cfg, args.dp, args.pp, args.tp, args.virtual, args.sp)
    mem = memory_breakdown(cfg, args.dp, args.pp, args.tp, args.zero, args.dtype,
                           args.optimizer, args.microbatch_size, args.microbatches,
                           args.schedule, args.sp, args.recompute, params=args.params,
                           virtual=args.virtual, accounting=args.accounting, cp=args.cp,
                           offload=args.offload, ep=args.ep)
    what = _model_label(args) if cfg is not None else f"{args.params:,} parameters"
    cp = f" cp={args.cp}" if args.cp > 1 else ""
    cp += f" ep={args.ep}" if args.ep > 1 else ""
    print(f"per-device memory of {what}, dp={args.dp} pp={args.pp} tp={args.tp}{cp} "
          f"zero={args.zero}{' offload' if args.offload else ''} {args.dtype} "
          f"(stage {mem['stage']}, the most loaded)")
    for key in ("params", "grads", "optimizer", "activations", "loss_workspace",
                "moe_dispatch", "total", "host"):
        if key in mem:
            print(f"  {key:<12}{_gb(mem[key])}   {mem[key]:>18,} bytes")
    _write_json(args.json, mem)
    return 0


def _cmd_bubble(args) -> int:
    from minipar import checks
    from minipar.theory import bubble

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
    from minipar import checks
    from minipar.theory import clusters
    from minipar.theory.planner import plan

    cfg = _model_from_args(args)
    checks.cluster(args.gpus, args.gpu, args.gpus_per_node, args.batch, args.top,
                   args.memory_margin)
    calib = clusters.load_calibration(args.calibrate) if args.calibrate else None
    if args.gpus or calib:  # a calibrated machine: its GPUs, one node, unless told
        gpus = args.gpus or int(calib.get("gpus", 1))
        kind = args.gpu if args.gpus or not calib else clusters.gpu_for_device(
            str(calib.get("device", "")))
        where = clusters.cluster(gpus, kind, args.gpus_per_node if args.gpus else gpus)
    else:
        where = clusters.get_cluster(args.cluster)
    if calib:
        where = clusters.calibrated(where, calib)
        rates = ", ".join(f"{op} {bw / 1e9:.0f} GB/s + {lat * 1e6:.0f} us"
                          for op, lat, bw in where.links)
        print(f"calibrated ({args.calibrate}): matmul {where.matmul_rate / 1e12:.0f} TFLOP/s"
              f"; {rates}")
    result = plan(cfg, where, args.batch, offload=args.offload,
                  memory_margin=args.memory_margin)
    batch = result.global_batch
    model_flags = _model_flags(args)
    print(f"{'#':>3}  {'layout':<60} {'step s':>9} {'MFU':>6} {'GiB/GPU':>8}")
    for i, lay in enumerate(result.layouts[: args.top]):
        print(f"{i + 1:>3}  {lay.label():<60} {lay.step_time:>9.3g} {lay.mfu:>6.1%} "
              f"{lay.memory['process'] / 2**30:>8.1f}")
        print(f"     {lay.command(args.model, batch)}{model_flags}")
    print(f"(GiB/GPU: what the card holds, the allocator's reserve and the runtime included; "
          f"a layout fits within {1 - args.memory_margin:.0%} of the card's "
          f"{where.gpu_memory / 2**30:.1f} GiB: --memory-margin {args.memory_margin})")
    print()
    print(result.why())
    _write_json(args.json, {"best": result.best.to_dict() if result.best else None,
                            "layouts": [{**x.to_dict(), "command": x.command(args.model, batch)
                                         + model_flags} for x in result.layouts[: args.top]],
                            "rejected": dict(result.rejected), "why": result.why()})
    return 0


def _model_flags(args) -> str:
    """The model size flags given to ``plan``, for the ``train`` commands it prints."""
    sizes = ("layers", "hidden", "heads", "ffn", "vocab", "seq_len")
    return "".join(f" --{k.replace('_', '-')} {getattr(args, k)}" for k in sizes
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
    m.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
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
    p.add_argument("--calibrate", metavar="FILE", help="measured rates of a machine "
                   "(benchmarks/multigpu.py --sections calibrate) instead of the preset's")
