"""The command line: ``python -m minipar {train,memory,bubble,plan,doctor}``.

Every subcommand prints a readable table and, with ``--json PATH``, writes the same
facts as JSON. Invalid input is rejected with one line before any process starts.
"""

from __future__ import annotations

import argparse
import json
import sys

from minipar.engine import SCHEDULE_NAMES, TrainConfig


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
    p.add_argument("--json", help="write the run's record as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _cmd_train(args) -> int:
    from tqdm.auto import tqdm

    from minipar.engine import train_single, validate

    cfg = TrainConfig(
        model=args.model, dp=args.dp, pp=args.pp, tp=args.tp, zero=args.zero,
        schedule=args.schedule, virtual=args.virtual, microbatches=args.microbatches,
        sp=args.sp, recompute=args.recompute, dtype=args.dtype, steps=args.steps,
        seed=args.seed, backend=args.backend, batch_size=args.batch_size, lr=args.lr,
        order=args.order, save=args.save, resume=args.resume, trace=args.trace)
    validate(cfg)
    bar = tqdm(total=cfg.steps, desc="train", disable=args.quiet, leave=False)

    def progress(step: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")

    record = train_single(cfg, progress)
    bar.close()
    print(f"{'step':>5}  {'loss':>8}")
    for i, loss in enumerate(record["losses"]):
        print(f"{i:>5}  {loss:>8.4f}")
    _write_json(args.json, record)
    return 0


def _cmd_doctor(args) -> int:
    from minipar.doctor import run_doctor

    results = run_doctor()
    for r in results:
        print(f"{'OK  ' if r['ok'] else 'FIX '} {r['check']:<11} {r['message']}")
    _write_json(args.json, {"checks": results, "ok": all(r["ok"] for r in results)})
    return 0 if all(r["ok"] for r in results) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minipar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    d = sub.add_parser("doctor", help="check this machine for the course")
    d.add_argument("--json")
    return parser


COMMANDS = {"train": _cmd_train, "doctor": _cmd_doctor}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"minipar {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
