"""Mixture of experts on NCCL at parity with one process: moe-tiny's layouts on 2 and 4 GPUs.

Each row trains moe-tiny through ``minipar.engine.train`` (NCCL, one rank per GPU) and
compares it with ``engine.train_reference`` (one process, fp32, CPU: the yardstick the
tolerances were measured on) by ``minipar.parity.compare``: losses, per-step gradient
norms before clipping and final parameters (from a ``--save`` checkpoint), against
``parity.TOLERANCES``; ``audit`` names a simple factor when the gradient norm is one off.
The layouts: expert parallelism over dp (ep 2 and 4, experts with replicas), with pp, tp
(the experts' MLPs split too), ZeRO 0-3 and offload; dropless and with a capacity factor,
top-1 and top-2, plain SGD without clipping among them. bf16 rows run the experts as one
grouped GEMM (``torch._grouped_mm``), fp32 rows as a loop over experts. A row that fails
records its error and the rest go on; the JSON is rewritten after every row.

    PYTHONPATH=. python benchmarks/moe_parity_gpu.py --out $OUT/moe_parity.json   # 2-4 GPUs
    PYTHONPATH=. python benchmarks/moe_parity_gpu.py --device cpu --out /tmp/p.json  # dry run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import traceback

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # NVLink multicast off in every rank started here

import torch  # noqa: E402

from minipar.config import TrainConfig, validate  # noqa: E402
from minipar.engine import train, train_reference  # noqa: E402
from minipar.parity import TOLERANCES, audit, compare, final_parameters  # noqa: E402

STEPS = 3
SGD = dict(optimizer="sgd", grad_clip=0.0, lr=0.5, warmup=1)
MODEL_KNOBS = ("optimizer", "grad_clip", "lr", "warmup", "capacity_factor", "moe_top_k",
               "z_loss_coef")
BOTH, FP32 = ("fp32", "bf16"), ("fp32",)

# (name, layout, dtypes); the world size is dp * pp * tp
LAYOUTS = [
    ("dp2 ep2 sgd", dict(dp=2, ep=2, microbatches=2, **SGD), BOTH),
    ("dp2 ep2 capacity1 top1 zero1", dict(dp=2, ep=2, zero=1, capacity_factor=1.0,
                                          moe_top_k=1), BOTH),
    ("dp2 ep2 zero3 sgd", dict(dp=2, ep=2, zero=3, microbatches=2, **SGD), BOTH),
    ("dp2 ep2 zero2 offload", dict(dp=2, ep=2, zero=2, offload=True), FP32),
    ("dp4 ep4 sgd", dict(dp=4, ep=4, microbatches=2, **SGD), BOTH),
    ("dp4 ep2 zero1 z-loss", dict(dp=4, ep=2, zero=1, capacity_factor=1.25,
                                  z_loss_coef=1e-3), BOTH),
    ("dp4 ep2 zero3", dict(dp=4, ep=2, zero=3, capacity_factor=1.0), BOTH),
    ("dp2 ep2 pp2 zero1", dict(dp=2, ep=2, pp=2, zero=1, microbatches=2), BOTH),
    ("dp2 ep2 tp2 zero2 sgd", dict(dp=2, ep=2, tp=2, zero=2, **SGD), BOTH),
    ("dp2 ep2 pp2 zero3 offload", dict(dp=2, ep=2, pp=2, zero=3, offload=True,
                                       microbatches=2), FP32),
]


def world(layout: dict) -> int:
    return layout.get("dp", 1) * layout.get("pp", 1) * layout.get("tp", 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON written (after every row)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--gpus", type=int, default=None, help="default: every visible GPU")
    ap.add_argument("--only", default=None, help="comma-separated row names")
    ap.add_argument("--budget-s", type=float, default=540.0)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    gpus = args.gpus or (torch.cuda.device_count() if cuda else 4)
    report = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "gpus": gpus,
              "torch": torch.__version__, "model": "moe-tiny", "steps": STEPS,
              "reference": "engine.train_reference: one process, fp32, CPU",
              "grouped_mm": getattr(torch, "_grouped_mm", None) is not None, "rows": []}
    references: dict = {}
    t0 = time.time()
    only = set(args.only.split(",")) if args.only else None
    for name, layout, dtypes in LAYOUTS:
        for dtype in dtypes:
            row = {"name": f"{name} {dtype}", "layout": layout, "dtype": dtype}
            if (only and name not in only) or world(layout) > gpus:
                continue
            if time.time() - t0 > args.budget_s:
                row["status"] = "skipped (budget)"
            else:
                try:
                    row |= run_row(layout, dtype, cuda, references)
                except Exception as e:  # one failing row is recorded; the rest go on
                    row |= {"status": "error", "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()[-2000:]}
            report["rows"].append(row)
            print(row["name"], row["status"], row.get("brief", row.get("error", "")),
                  flush=True)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    statuses = [r["status"] for r in report["rows"]]
    report["summary"] = {s: statuses.count(s) for s in sorted(set(statuses))}
    report["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(report["summary"])


def run_row(layout: dict, dtype: str, cuda: bool, references: dict) -> dict:
    knobs = {k: v for k, v in layout.items() if k in MODEL_KNOBS}
    key = json.dumps(knobs, sort_keys=True)
    if key not in references:
        ref = train_reference(TrainConfig(model="moe-tiny", steps=STEPS, **knobs))
        references[key] = {"losses": ref["losses"], "grad_norms": ref["grad_norms"],
                           "params": {k: v.detach().float().clone()
                                      for k, v in ref["model"].state_dict().items()}}
    ref = references[key]
    cfg = TrainConfig(model="moe-tiny", steps=STEPS, dtype=dtype, timeout=180,
                      backend="nccl" if cuda else "gloo", **layout)
    try:
        validate(cfg)
    except ValueError as e:
        return {"status": "refused", "reason": str(e)}
    save = tempfile.mkdtemp(prefix="minipar-moe-parity-")
    try:
        cfg.save = save
        rec = train(cfg)
        params = {k: v.cpu() for k, v in final_parameters(save).items()}
    finally:
        shutil.rmtree(save, ignore_errors=True)
    p = compare(rec, ref, params, ref["params"])
    tol = TOLERANCES[dtype]
    sizes = {"dp": cfg.dp, "microbatches": cfg.microbatches, "pp": cfg.pp, "tp": cfg.tp}
    a2a = [r["comm"].get("ep", {}).get("all_to_all", {}) for r in rec["ranks"]]
    return {"status": "ok" if p.ok(tol) else "drift", "loss_diff": p.loss_diff,
            "grad_norm_rel": p.grad_norm_rel, "param_diff": p.param_diff,
            "grad_ratios": p.grad_ratios, "tolerance": vars(tol),
            "audit": audit(p.grad_ratios, sizes), "losses": rec["losses"],
            "reference_losses": ref["losses"], "brief": p.describe(),
            "all_to_all_bytes": [a.get("bytes", 0) for a in a2a]}


if __name__ == "__main__":
    main()
