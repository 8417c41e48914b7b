"""The command line: ``python -m minipar {train,sample,export,memory,bubble,plan,doctor}``.

Every subcommand prints a readable table and, with ``--json PATH``, writes the same
facts as JSON. Invalid input is rejected with one line before any process starts.
"""

from __future__ import annotations

import argparse
import sys

from minipar.cli_theory import (
    _add_theory,
    _cmd_bubble,
    _cmd_doctor,
    _cmd_memory,
    _cmd_plan,
    _write_json,
    parse_count,
)
from minipar.config import SCHEDULE_NAMES, TrainConfig

__all__ = ["build_parser", "main", "parse_count", "train_config"]


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train the GPT on 1 or dp*pp*tp*cp ranks")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per layer")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel ranks per sequence (ring attention, zig-zag)")
    p.add_argument("--zero", type=int, default=0, choices=range(4), help="ZeRO stage")
    p.add_argument("--offload", action="store_true",
                   help="ZeRO-Offload: fp32 masters, optimizer states and step on the host")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULE_NAMES)
    p.add_argument("--virtual", type=int, default=1, help="chunks per rank (interleaved)")
    p.add_argument("--head-layers", type=int, default=0,
                   help="the last pipeline chunk holds K layers fewer: its head and loss "
                        "cost about K layers (gpt-1.3b: 2; `theory.params.head_layers_for`)")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    p.add_argument("--recompute-layers", type=int, metavar="N",
                   help="recompute only the first N blocks of each pipeline chunk (default: "
                        "all); the others keep their activations")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile each transformer block (default: on CUDA devices; "
                        "--no-compile runs them eagerly; parallel/compile.py)")
    p.add_argument("--compile-backend", default="inductor",
                   choices=("inductor", "aot_eager", "eager"),
                   help="aot_eager: the graphs without generated code (tests, CPUs)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--grad-dtype", default="fp32", choices=("fp32", "bf16"),
                   help="where bf16 gradients are summed and reduced: fp32 (exact, default) "
                        "or bf16 (half the bytes and traffic, as torch's peers do)")
    p.add_argument("--wgrad-fusion", action=argparse.BooleanOptionalAction, default=True,
                   help="add each linear weight gradient to its fp32 sum in the GEMM that "
                        "makes it (default on; parallel/wgrad_fusion.py)")
    p.add_argument("--overlap-param-gather", action=argparse.BooleanOptionalAction,
                   default=True, help="ZeRO-1/2: gather each bucket's new weights during the "
                   "next forward, not after the step (default on; parallel/param_gather.py)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--model", default="tiny", help="preset name (see minipar.model.PRESETS)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the preset's "
                   "published one, 3e-3 for the small presets; config.RECIPES)")
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
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                   help="torch's fused optimizer kernel (default: on CUDA devices)")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"),
                   help="sgd: plain SGD, no momentum (parity checks see a gradient's scale)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a rank may make no progress (no step, no collective "
                   "finished) before the run counts as hung and each rank's place is shown")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="train on past a NaN/inf loss (default: stop there, exit 1)")
    # data, model sizes and long runs
    p.add_argument("--data", default="markov",
                   help="markov (generated), pystdlib (Python's own sources), a text file, "
                   "a directory of text files, or a .bin token file")
    p.add_argument("--tokenizer", help="for text: byte (vocab 256, the default), bpe "
                   "(trained to the model's vocab) or a tokenizer.json file (--init-from: "
                   "the directory's, when it has one)")
    p.add_argument("--data-cache", help="where tokenised text is kept (~/.cache/minipar)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="validation loss every N steps and at the end (0: never)")
    p.add_argument("--eval-batches", type=int, default=4,
                   help="held-out global batches per evaluation")
    for flag, what in (("layers", "n_layer"), ("hidden", "d_model"), ("heads", "n_head"),
                       ("ffn", "d_ff"), ("vocab", "vocab_size"), ("seq-len", "seq_len")):
        p.add_argument(f"--{flag}", type=int, help=f"override the preset's {what}")
    p.add_argument("--warmup", type=int, help="linear warm-up steps (default: the preset's "
                   "recipe, at most a tenth of the run; 5 for the small presets)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global norm (0: off)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--save-every", type=int, default=0, help="also --save every N steps")
    p.add_argument("--keep", type=int, default=0, help="keep the last K checkpoints (0: all)")
    p.add_argument("--log-every", type=int, default=1, help="progress every N steps")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="dropout probability (masks keyed by position: every layout alike)")
    p.add_argument("--init-from", help="start from a GPT-2 transformers directory (its sizes "
                   "and weights; its tokenizer.json tokenises text data)")
    p.add_argument("--text-field", default="text",
                   help="the text column of JSON Lines, Parquet or datasets --data")
    # mixture of experts (model.MoE) and expert parallelism (parallel/ep.py)
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks (inside dp): each MoE layer's experts split")
    p.add_argument("--moe-experts", type=int, help="experts per MoE layer (0: dense)")
    p.add_argument("--moe-top-k", type=int, help="experts per token (1 or 2)")
    p.add_argument("--moe-every", type=int, help="every N-th block is MoE (2: every other)")
    p.add_argument("--capacity-factor", type=float,
                   help="expert slots per sequence over k*seq/E (0: dropless)")
    p.add_argument("--aux-loss-coef", type=float, help="load-balancing loss weight")
    p.add_argument("--z-loss-coef", type=float, help="router z-loss weight")
    p.add_argument("--fp8", choices=("rowwise", "tensorwise"),
                   help="the blocks' linear layers multiply in float8, scaled per row or "
                        "per tensor (GPUs of compute capability 8.9+; parallel/fp8.py)")
    p.add_argument("--fp8-emulate", action="store_true",
                   help="with --fp8: float8 casts, fp32 matmuls, on any device (for tests: "
                        "the same numbers, no speed)")


def train_config(args) -> TrainConfig:
    """The ``TrainConfig`` a parsed ``train`` command line asks for (flag -> field)."""
    from minipar.hf import default_tokenizer

    return TrainConfig(
        model=args.model, dp=args.dp, pp=args.pp, tp=args.tp, zero=args.zero,
        schedule=args.schedule, virtual=args.virtual, head_layers=args.head_layers,
        microbatches=args.microbatches, sp=args.sp, recompute=args.recompute,
        recompute_layers=args.recompute_layers, compile=args.compile,
        compile_backend=args.compile_backend,
        dtype=args.dtype, grad_dtype=args.grad_dtype, wgrad_fusion=args.wgrad_fusion,
        overlap_param_gather=args.overlap_param_gather,
        steps=args.steps, seed=args.seed,
        backend=args.backend, batch_size=args.batch_size, lr=args.lr,
        order=args.order, save=args.save, resume=args.resume, trace=args.trace,
        ddp=args.ddp, device=args.device, stop_at=args.stop_at, fused=args.fused,
        optimizer=args.optimizer, data=args.data,
        tokenizer=args.tokenizer or default_tokenizer(args.init_from),
        data_cache=args.data_cache, eval_every=args.eval_every,
        eval_batches=args.eval_batches, layers=args.layers, hidden=args.hidden,
        heads=args.heads, ffn=args.ffn, vocab=args.vocab, seq_len=args.seq_len,
        warmup=args.warmup, grad_clip=args.grad_clip, weight_decay=args.weight_decay,
        save_every=args.save_every, keep=args.keep, log_every=args.log_every,
        timeout=args.timeout, dropout=args.dropout, cp=args.cp, offload=args.offload,
        init_from=args.init_from, text_field=args.text_field,
        ep=args.ep, moe_experts=args.moe_experts, moe_top_k=args.moe_top_k,
        moe_every=args.moe_every, capacity_factor=args.capacity_factor,
        aux_loss_coef=args.aux_loss_coef, z_loss_coef=args.z_loss_coef,
        fp8=args.fp8, fp8_emulate=args.fp8_emulate,

        allow_nonfinite=args.allow_nonfinite)


def _cmd_train(args) -> int:
    from tqdm.auto import tqdm

    from minipar import checks
    from minipar.checkpoint import SAVE_NAMES
    from minipar.checks import oversubscription
    from minipar.engine import RunStopped, train, validate

    cfg = train_config(args)
    validate(cfg)
    checks.output_file("json", args.json)
    checks.distinct({"json": args.json, "trace": cfg.trace, "save": cfg.save},
                    {"data": cfg.data, "resume": cfg.resume})
    checks.not_inside({"json": args.json}, "save", cfg.save, SAVE_NAMES)
    note = oversubscription(cfg.world_size)
    if note:
        print(f"minipar train: note: {note}", file=sys.stderr)
    bar = tqdm(total=cfg.steps, desc="train", disable=args.quiet, leave=False)
    peak, model_cfg = _peak_flops(cfg), cfg.model_config()

    def report(r: dict) -> None:
        bar.update(r["step"] - bar.n)
        shown = {"loss": f"{r['loss']:.4f}", "tok/s": f"{r['tokens_per_s']:,.0f}"}
        if r["val_loss"] == r["val_loss"]:  # not NaN: an evaluation has run
            shown["val"] = f"{r['val_loss']:.4f}"
        if peak:
            from minipar.theory.params import mfu

            shown["MFU"] = f"{mfu(r['tokens_per_s'], model_cfg, cfg.world_size, peak):.1%}"
        bar.set_postfix(shown)

    stopped = None
    try:
        record = train(cfg, report=report)
    except RunStopped as e:  # the steps done are kept: printed and written as JSON
        record, stopped = e.record, str(e)
    finally:
        bar.close()
    if record is None:  # a torchrun rank other than 0
        return 0
    if args.compare and not stopped:  # the reference's steps first..last, as resumed
        from minipar.parity import check_run

        record.update(check_run(cfg, record))
    _print_run(cfg, record)  # printed first: a failing output below loses nothing
    for e in record.get("eval", []):
        print(f"validation loss after step {e['step']:>6}: {e['loss']:.4f}")
    _write_json(args.json, record)
    errors = [e for e in (stopped, record.get("trace_error")) if e]
    if errors:
        print(f"minipar train: error: {errors[0]}", file=sys.stderr)
        return 1
    return 0


def _peak_flops(cfg) -> float | None:
    """Dense bf16 FLOP/s of this GPU, for MFU (None on CPU, unknown cards, or several
    ranks per GPU under gloo)."""
    import torch

    from minipar.theory.clusters import GPUS

    if cfg.backend != "nccl" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    for key, gpu in GPUS.items():
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
        kib = [f"{m[k] / 1024:>8.0f}K" for k in ("params", "grads", "optimizer", "activations")]
        sent = [sum(o["wire_bytes"] for o in r["comm"].get(d, {}).values()) / steps / 1024
                for d in dims]
        print(f"{r['rank']:>4} " + " ".join(f"{c[d]:>3}" for d in coords) + f" {' '.join(kib)}"
              f"{'':>19}" + " ".join(f"{x:>8.1f}K" for x in sent)
              + f"  {r.get('build_seconds', 0):>5.2f}s"
              f" {r.get('host_peak_bytes', 0) / 2**20:>7.1f}M")
    print("(bytes this rank held at their peak within a step; "
          "bytes sent as a ring algorithm puts them on the wire; build: seconds to\n"
          " compose this rank's shards, host+: the host memory that added at its peak)")


def _cmd_sample(args) -> int:
    from minipar.sample import sample

    print(sample(args.resume, args.prompt, args.tokens, args.temperature, args.seed))
    return 0


def _cmd_export(args) -> int:
    from minipar import checks
    from minipar.export import export
    from minipar.hf import export_hf

    checks.output_file("json", args.json)
    checks.distinct({"out": args.out, "json": args.json}, {"resume": args.resume})
    if args.format == "hf":
        checks.not_inside({"json": args.json}, "out", args.out)
    out = (export_hf if args.format == "hf" else export)(args.resume, args.out)
    print(f"wrote {out['path']}: {out['tensors']} tensors, {out['bytes'] / 2**20:.1f} MiB, "
          f"step {out['step']}")
    _write_json(args.json, out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minipar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_theory(sub)
    d = sub.add_parser("doctor", help="check this machine for the course")
    d.add_argument("--json")
    d.add_argument("--model", help="also check this preset fits here (host and GPU memory)")
    for dim in ("dp", "pp", "tp"):
        d.add_argument(f"--{dim}", type=int, default=1, help="layout for --model")
    d.add_argument("--zero", type=int, default=0, choices=range(4))
    d.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
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


COMMANDS = {"train": _cmd_train, "memory": _cmd_memory, "bubble": _cmd_bubble,
            "plan": _cmd_plan, "doctor": _cmd_doctor, "sample": _cmd_sample,
            "export": _cmd_export}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; every failure ends as one line on stderr and an exit status
    (2: bad input, 1: the run failed, 130: interrupted), never as a traceback."""
    from minipar.launch import LaunchError

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
