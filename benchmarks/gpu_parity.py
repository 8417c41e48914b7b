"""Does the engine give the same losses on a GPU as the single-process CPU reference?

Every layout the engine supports is run on CUDA tensors and its per-step losses are
compared with ``minipar.engine.train_reference`` (one process, fp32, on the CPU). Two
ways onto a GPU:

* ``--backend nccl``: one rank per GPU (here: world size 1, on a one-GPU machine);
* ``--backend gloo --device cuda``: any number of ranks sharing the GPU (NCCL refuses
  two ranks on one device). gloo moves host memory, so ``minipar.comm`` stages CUDA
  tensors through the host; the arithmetic stays on the GPU.

Tolerances are on the largest relative loss difference over the steps. fp32 on the GPU
(TF32 off, torch's default for matmuls) differs from the CPU only in the order of
floating-point sums: 1e-3. bf16 rounds every weight and activation to 8 bits of
mantissa, so a bf16 run is compared with the fp32 reference at 2e-2 (the lessons show
the same gap on the CPU).

    python benchmarks/gpu_parity.py                       # on a CUDA machine
    python benchmarks/gpu_parity.py --device cpu --only dp2   # a dry run anywhere

The "resumed" layouts stop halfway, save, and resume from the checkpoint: their losses
are the two runs' together.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace

import torch

from minipar.config import TrainConfig
from minipar.engine import train, train_reference

TOLERANCE = {"fp32": 1e-3, "bf16": 2e-2}

# name -> the layout's fields; the rest comes from the base config below
LAYOUTS: dict[str, dict] = {
    "nccl world 1": dict(backend="nccl"),
    "nccl world 1 bf16": dict(backend="nccl", dtype="bf16"),
    "dp2": dict(dp=2),
    "dp2 zero3": dict(dp=2, zero=3),
    "tp2 sp": dict(tp=2, sp=True),
    "pp2 1f1b": dict(pp=2, schedule="1f1b", microbatches=4),
    "pp2 zb": dict(pp=2, schedule="zb", microbatches=4),
    "dp2 pp2 tp2 zero1": dict(dp=2, pp=2, tp=2, zero=1, microbatches=2),
    "dp2 pp2 tp2 zero1 bf16": dict(dp=2, pp=2, tp=2, zero=1, microbatches=2, dtype="bf16"),
    # stopped halfway and resumed from the checkpoint: the fused AdamW's step count must
    # come back onto the GPU, where the kernel reads it
    "nccl world 1 resumed": dict(backend="nccl", resume_at=True),
    "dp2 zero3 resumed": dict(dp=2, zero=3, resume_at=True),
}


def layout_config(name: str, device: str, steps: int) -> TrainConfig:
    """The base run (tiny GPT, batch 16, fp32) with the layout's fields; gloo layouts
    put their tensors on ``device``. On a CPU-only machine nccl layouts fall back to
    gloo on the CPU, so the script can be tried anywhere."""
    fields = {k: v for k, v in LAYOUTS[name].items() if k != "resume_at"}
    if fields.get("backend") == "nccl" and device == "cpu":
        fields["backend"] = "gloo"
    fields.setdefault("device", device if fields.get("backend", "gloo") == "gloo" else "auto")
    return TrainConfig(model="tiny", steps=steps, batch_size=16, timeout=90, **fields)


def _train(cfg: TrainConfig, resumed: bool) -> list[float]:
    """The run's losses; ``resumed``: stopped (and saved) halfway, then resumed."""
    if not resumed:
        return train(cfg)["losses"]
    with tempfile.TemporaryDirectory() as save:
        first = train(replace(cfg, stop_at=cfg.steps // 2, save=save))["losses"]
        return first + train(replace(cfg, resume=save))["losses"]


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def run(names: list[str], device: str, steps: int) -> list[dict]:
    reference = train_reference(TrainConfig(model="tiny", steps=steps, batch_size=16))
    ref = reference["losses"]
    rows = []
    for name in names:
        cfg = layout_config(name, device, steps)
        t0 = time.time()
        try:
            losses, error = _train(cfg, LAYOUTS[name].get("resume_at", False)), None
        except Exception as e:  # report every layout, not just the first failure
            losses, error = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        diff = max_rel_diff(losses, ref) if losses else float("nan")
        tol = TOLERANCE[cfg.dtype]
        rows.append({"layout": name, "ranks": cfg.world_size, "backend": cfg.backend,
                     "device": cfg.device, "dtype": cfg.dtype, "max_rel_diff": diff,
                     "tolerance": tol, "ok": error is None and diff <= tol,
                     "seconds": time.time() - t0, "losses": losses, "error": error})
        print(f"{name:<24} {'ok' if rows[-1]['ok'] else 'FAIL'}  max rel diff {diff:.2e}"
              f"  ({rows[-1]['seconds']:.1f} s){'  ' + error if error else ''}", flush=True)
    return [{"reference": ref}, *rows]


def table(rows: list[dict]) -> str:
    ref = rows[0]["reference"]
    lines = ["| layout | ranks | backend | device | dtype | first loss | last loss | "
             "max rel. diff vs CPU ref. | tolerance | ok |", "|---" * 10 + "|",
             f"| CPU reference | 1 | - | cpu | fp32 | {ref[0]:.6f} | {ref[-1]:.6f} | - | - "
             "| - |"]
    for r in rows[1:]:
        first, last = (f"{r['losses'][0]:.6f}", f"{r['losses'][-1]:.6f}") if r["losses"] \
            else ("-", "-")
        lines.append(f"| {r['layout']} | {r['ranks']} | {r['backend']} | {r['device']} | "
                     f"{r['dtype']} | {first} | {last} | {r['max_rel_diff']:.2e} | "
                     f"{r['tolerance']:.0e} | {'yes' if r['ok'] else '**no**'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=("cuda", "cpu"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", nargs="*", choices=list(LAYOUTS), help="a subset of layouts")
    ap.add_argument("--json", help="write the rows (with every loss) here")
    args = ap.parse_args()
    rows = run(args.only or list(LAYOUTS), args.device, args.steps)
    print(f"\ntorch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["ok"] for r in rows[1:]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
