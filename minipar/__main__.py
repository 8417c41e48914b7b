"""The command line: ``python -m minipar {train,memory,bubble,plan,doctor}``.

Every subcommand prints a readable table and, with ``--json PATH``, writes the same
facts as JSON. Invalid input is rejected with one line before any process starts.
"""

from __future__ import annotations

import argparse
import json
import sys

from minipar.config import SCHEDULE_NAMES, TrainConfig


def _write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1, default=str)


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train the GPT on 1 or dp*pp*tp ranks")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per layer")
    p.add_argument("--zero", type=int, default=0, choices=range(4), help="ZeRO stage")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULE_NAMES)
    p.add_argument("--virtual", type=int, default=1, help="chunks per rank (interleaved)")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--model", default="tiny", help="preset name (see minipar.model.PRESETS)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--order", default="megatron", choices=("megatron", "pp-inside-dp"))
    p.add_argument("--save", help="checkpoint directory to write at the end")
    p.add_argument("--resume", help="checkpoint directory to start from")
    p.add_argument("--trace", help="write a Chrome trace (open in Perfetto)")
    p.add_argument("--stop-at", type=int, help="stop (and --save) after this step")
    p.add_argument("--json", help="write the run's record as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--compare", action="store_true",
                   help="also train the single-process reference and print both")
    p.add_argument("--ddp", default="overlapped", choices=("naive", "bucketed", "overlapped"))
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--fused", action="store_true", help="fused AdamW kernel (GPU speed)")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"),
                   help="sgd: plain SGD, no momentum (parity checks see a gradient's scale)")


def _cmd_train(args) -> int:
    from tqdm.auto import tqdm

    from minipar.engine import train, train_reference, validate

    cfg = TrainConfig(
        model=args.model, dp=args.dp, pp=args.pp, tp=args.tp, zero=args.zero,
        schedule=args.schedule, virtual=args.virtual, microbatches=args.microbatches,
        sp=args.sp, recompute=args.recompute, dtype=args.dtype, steps=args.steps,
        seed=args.seed, backend=args.backend, batch_size=args.batch_size, lr=args.lr,
        order=args.order, save=args.save, resume=args.resume, trace=args.trace,
        ddp=args.ddp, device=args.device, stop_at=args.stop_at, fused=args.fused,
        optimizer=args.optimizer)
    validate(cfg)
    bar = tqdm(total=cfg.steps, desc="train", disable=args.quiet, leave=False)

    def progress(step: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")

    record = train(cfg, progress)
    bar.close()
    if record is None:  # a torchrun rank other than 0
        return 0
    ref = None
    if args.compare:
        ref = train_reference(cfg)["losses"]
        record["reference_losses"] = ref
    _print_run(cfg, record, ref)
    _write_json(args.json, record)
    return 0


def _print_run(cfg, record: dict, ref: list | None) -> None:
    head = f"{'step':>5}  {'loss':>9}" + (f"  {'1 process':>9}  {'diff':>8}" if ref else "")
    print(f"dp={cfg.dp} pp={cfg.pp} tp={cfg.tp} zero={cfg.zero} "
          f"{'schedule=' + cfg.schedule + ' ' if cfg.pp > 1 else ''}"
          f"microbatches={cfg.microbatches} {cfg.dtype}: {record['world_size']} ranks")
    print(head)
    for i, loss in enumerate(record["losses"]):
        line = f"{i:>5}  {loss:>9.5f}"
        if ref:
            line += f"  {ref[i]:>9.5f}  {abs(loss - ref[i]):>8.1e}"
        print(line)
    print()
    steps = max(1, len(record["losses"]))
    print(f"{'rank':>4} {'dp':>3} {'pp':>3} {'tp':>3} {'params':>9} {'grads':>9} "
          f"{'optim':>9} {'activ':>9}   sent per step on:  {'dp':>9} {'pp':>9} {'tp':>9}")
    for r in record["ranks"]:
        m, c = r["memory"], r["coords"]
        kib = [f"{m[k] / 1024:>8.0f}K" for k in ("params", "grads", "optimizer", "activations")]
        sent = [sum(o["wire_bytes"] for o in r["comm"].get(d, {}).values()) / steps / 1024
                for d in ("dp", "pp", "tp")]
        print(f"{r['rank']:>4} {c['dp']:>3} {c['pp']:>3} {c['tp']:>3} {' '.join(kib)}"
              f"{'':>20}{sent[0]:>8.1f}K {sent[1]:>8.1f}K {sent[2]:>8.1f}K")
    print("(bytes this rank held at their peak within a step; "
          "bytes sent as a ring algorithm puts them on the wire)")


def _cmd_doctor(args) -> int:
    from minipar.doctor import run_doctor

    results = run_doctor()
    for r in results:
        print(f"{'OK  ' if r['ok'] else 'FIX '} {r['check']:<11} {r['message']}")
    _write_json(args.json, {"checks": results, "ok": all(r["ok"] for r in results)})
    return 0 if all(r["ok"] for r in results) else 1


def _model_from_args(args):
    """A preset, optionally with custom sizes (``--layers --hidden --heads ...``)."""
    from minipar.model import get_config

    if args.model is None and args.params is not None:
        return None
    cfg = get_config(args.model or "tiny")
    sizes = {"n_layer": args.layers, "d_model": args.hidden, "n_head": args.heads,
             "vocab_size": args.vocab, "seq_len": args.seq_len}
    return cfg.with_(**{k: v for k, v in sizes.items() if v is not None})


def _gb(x: float) -> str:
    return f"{x / 2**30:9.2f} GiB"


def _cmd_memory(args) -> int:
    from minipar.theory.memory import memory_breakdown

    cfg = _model_from_args(args)
    mem = memory_breakdown(cfg, args.dp, args.pp, args.tp, args.zero, args.dtype,
                           args.optimizer, args.microbatch_size, args.microbatches,
                           args.schedule, args.sp, args.recompute, params=args.params,
                           virtual=args.virtual, accounting=args.accounting)
    what = f"{args.model or 'custom'}" if cfg is not None else f"{args.params:,} parameters"
    print(f"per-device memory of {what}, dp={args.dp} pp={args.pp} tp={args.tp} "
          f"zero={args.zero} {args.dtype} (stage {mem['stage']}, the most loaded)")
    for key in ("params", "grads", "optimizer", "activations", "loss_workspace", "total"):
        if key in mem:
            print(f"  {key:<12}{_gb(mem[key])}   {mem[key]:>18,} bytes")
    _write_json(args.json, mem)
    return 0


def _cmd_bubble(args) -> int:
    from minipar.theory.bubble import bubble_report

    rep = bubble_report(args.schedule, args.pp, args.microbatches, args.virtual)
    print(rep["table"])
    print(f"bubble fraction (idle share of the step): {rep['bubble_fraction']:.4f}"
          f"   formula {rep['bubble_fraction_formula']:.4f}")
    print(f"bubble ratio (idle over ideal time):      {rep['bubble_ratio']:.4f}"
          f"   formula {rep['bubble_ratio_formula']:.4f}")
    print(f"peak micro-batches in flight per rank: {rep['peak_in_flight']}")
    _write_json(args.json, rep)
    return 0


def _cmd_plan(args) -> int:
    from minipar.theory.clusters import cluster, get_cluster
    from minipar.theory.planner import plan

    cfg = _model_from_args(args)
    if args.gpus:
        where = cluster(args.gpus, args.gpu, args.gpus_per_node)
    else:
        where = get_cluster(args.cluster)
    result = plan(cfg, where, args.batch)
    print(f"{'#':>3}  {'layout':<60} {'step s':>9} {'MFU':>6} {'GiB/GPU':>8}")
    for i, lay in enumerate(result.layouts[: args.top]):
        print(f"{i + 1:>3}  {lay.label():<60} {lay.step_time:>9.3g} {lay.mfu:>6.1%} "
              f"{lay.memory['total'] / 2**30:>8.1f}")
    print()
    print(result.why())
    _write_json(args.json, {"best": result.best.to_dict() if result.best else None,
                            "layouts": [x.to_dict() for x in result.layouts[: args.top]],
                            "rejected": dict(result.rejected), "why": result.why()})
    return 0


def _add_model_args(p, default: str | None) -> None:
    p.add_argument("--model", default=default, help="preset name (minipar.model.PRESETS)")
    p.add_argument("--layers", type=int, help="override n_layer")
    p.add_argument("--hidden", type=int, help="override d_model")
    p.add_argument("--heads", type=int, help="override n_head")
    p.add_argument("--vocab", type=int, help="override vocab_size")
    p.add_argument("--seq-len", type=int, help="override seq_len")
    p.add_argument("--json")


def _add_theory(sub) -> None:
    m = sub.add_parser("memory", help="per-device memory breakdown (theory)")
    _add_model_args(m, None)
    m.add_argument("--params", type=int, help="parameter count alone: model states only")
    for dim in ("dp", "pp", "tp"):
        m.add_argument(f"--{dim}", type=int, default=1)
    m.add_argument("--zero", type=int, default=0, choices=range(4))
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minipar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_theory(sub)
    d = sub.add_parser("doctor", help="check this machine for the course")
    d.add_argument("--json")
    return parser


COMMANDS = {"train": _cmd_train, "memory": _cmd_memory, "bubble": _cmd_bubble,
            "plan": _cmd_plan, "doctor": _cmd_doctor}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"minipar {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
