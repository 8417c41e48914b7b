"""Mixture of experts on NCCL at parity with one process: moe-tiny's layouts on 2 and 4 GPUs.

Each row trains moe-tiny through ``minipar.engine.train`` (NCCL, one rank per GPU) and
compares it with ``engine.train_reference`` (one process, fp32, CPU: the yardstick the
tolerances were measured on) by ``minipar.parity.compare``: losses, per-step gradient
norms before clipping and final parameters (from a ``--save`` checkpoint), against
``parity.TOLERANCES``; ``audit`` names a simple factor when the gradient norm is one off.
The layouts: expert parallelism over dp (ep 2 and 4, experts with replicas), with pp, tp
(the experts' MLPs split too), ZeRO 0-3 and offload; a sequence split over ranks (cp,
tp with sp), with and without ep, where a capacity must drop the reference's tokens;
dropless and with a capacity factor, top-1 and top-2, plain SGD without clipping among
them. ``minipar.parity.parity_row`` runs each row as ``benchmarks/multigpu.py`` does.
bf16 rows run the experts as one grouped GEMM (``torch._grouped_mm``), fp32 rows as a
loop over experts. A row that fails records its error and the rest go on; the JSON is
rewritten after every row.

    PYTHONPATH=. python benchmarks/moe_parity_gpu.py --out $OUT/moe_parity.json   # 2-4 GPUs
    PYTHONPATH=. python benchmarks/moe_parity_gpu.py --device cpu --out /tmp/p.json  # dry run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # NVLink multicast off in every rank started here

import torch  # noqa: E402

from minipar.config import TrainConfig  # noqa: E402
from minipar.parity import parity_row, reference_record  # noqa: E402

STEPS = 3
SGD = dict(optimizer="sgd", grad_clip=0.0, lr=0.5, warmup=1)
MODEL_KNOBS = ("optimizer", "grad_clip", "lr", "warmup", "capacity_factor", "moe_top_k",
               "z_loss_coef")
BOTH, FP32 = ("fp32", "bf16"), ("fp32",)

# (name, layout, dtypes); the world size is dp * pp * tp * cp
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
    ("cp2 capacity1 sgd", dict(cp=2, capacity_factor=1.0, microbatches=2, **SGD), BOTH),
    ("tp2 sp capacity1 sgd", dict(tp=2, sp=True, capacity_factor=1.0, **SGD), BOTH),
    ("dp2 ep2 cp2 capacity1.25 top1 zero1", dict(dp=2, ep=2, cp=2, capacity_factor=1.25,
                                                 moe_top_k=1, zero=1), BOTH),
    ("dp2 ep2 tp2 sp capacity1 zero3", dict(dp=2, ep=2, tp=2, sp=True, zero=3,
                                            capacity_factor=1.0), BOTH),
    ("cp2 tp2 sp capacity1 sgd", dict(cp=2, tp=2, sp=True, capacity_factor=1.0, **SGD),
     BOTH),
    ("pp2 tp2 sp zb capacity1", dict(pp=2, tp=2, sp=True, schedule="zb", microbatches=2,
                                     capacity_factor=1.0), BOTH),
]


def world(layout: dict) -> int:
    return math.prod(layout.get(k, 1) for k in ("dp", "pp", "tp", "cp"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON written (after every row)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--gpus", type=int, default=None, help="default: every visible GPU")
    ap.add_argument("--only", default=None, help="comma-separated row names")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: which dtypes")
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
    dtypes_asked = set(args.dtypes.split(","))
    for name, layout, dtypes in LAYOUTS:
        for dtype in dtypes:
            row = {"name": f"{name} {dtype}", "layout": layout, "dtype": dtype}
            if ((only and name not in only) or world(layout) > gpus
                    or dtype not in dtypes_asked):
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

    def reference() -> dict:
        if key not in references:
            references[key] = reference_record(TrainConfig(model="moe-tiny", steps=STEPS,
                                                           **knobs))
        return references[key]
    cfg = TrainConfig(model="moe-tiny", steps=STEPS, dtype=dtype, timeout=180,
                      backend="nccl" if cuda else "gloo", **layout)
    row, rec = parity_row(cfg, reference)
    if rec is not None:  # what each rank sent by all-to-all (ep)
        row["all_to_all_bytes"] = [r["comm"].get("ep", {}).get("all_to_all", {})
                                   .get("bytes", 0) for r in rec["ranks"]]
    return row


if __name__ == "__main__":
    main()
