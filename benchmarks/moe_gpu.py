"""Mixture of experts on GPUs: moe-1.3b at ep 1, 2, 4 against gpt-1.3b, in one job.

moe-1.3b has gpt-1.3b's active parameters (top-2 of 8 experts of half the FFN, in every
other block; 2.5B in all): per token the same FLOPs, four times the MLP weights. Each
row trains through ``minipar.engine.train`` (NCCL, one rank per GPU, bf16, ZeRO-1,
AdamW) and reports tokens/s, MFU on active FLOPs (``theory.moe.moe_flops_per_token``,
the card's dense bf16 peak from ``theory.clusters``), the all-to-all calls and bytes
counted per step beside the theory's (``theory.moe.all_to_all_bytes``), the host
seconds spent in them, and the peak device memory. Experts run as one grouped GEMM
(``torch._grouped_mm``) where torch has it, else a loop (``grouped_mm`` in the JSON).
``a2a_exposed_estimate_s``: step time minus the ep = 1 row's (same FLOPs per rank; the
difference is the all-to-all left exposed plus the load imbalance between ranks).

    PYTHONPATH=. python benchmarks/moe_gpu.py --out $OUT/moe.json        # 4 GPUs
    PYTHONPATH=. python benchmarks/moe_gpu.py --device cpu --out /tmp/moe.json  # dry run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # NVLink multicast off in every rank started here

import torch  # noqa: E402

from minipar.config import TrainConfig  # noqa: E402
from minipar.engine import train  # noqa: E402
from minipar.theory.clusters import GPUS, gpu_for_device  # noqa: E402
from minipar.theory.moe import all_to_all_bytes, moe_flops_per_token, moe_params  # noqa: E402


def _row(args, model: str, ep: int, gpus: int, peak: float) -> dict:
    cuda = args.device == "cuda"
    cfg = TrainConfig(model=model, dp=gpus, ep=ep, zero=args.zero,
                      dtype="bf16" if cuda else "fp32", backend="nccl" if cuda else "gloo",
                      batch_size=args.batch_size, microbatches=args.microbatches,
                      steps=args.steps, warmup=1, lr=1e-4, fused=cuda,
                      recompute=args.recompute, timeout=args.timeout, log_every=args.steps)
    t0 = time.time()
    record = train(cfg)
    mcfg = cfg.model_config()
    # a step lasts as long as its slowest rank; the first steps warm up (allocator, NCCL)
    steps = [max(r["step_seconds"][i] for r in record["ranks"])
             for i in range(args.skip, args.steps)]
    step = statistics.median(steps)
    tokens = args.batch_size * mcfg.seq_len
    flops = moe_flops_per_token(mcfg)
    row = {"model": model, "ep": ep, "dp": gpus, "zero": args.zero,
           "params": moe_params(mcfg), "step_seconds": step, "steps_timed": steps,
           "tokens_per_s": tokens / step, "flops_per_token": flops,
           "mfu": tokens / step * flops / (gpus * peak), "losses": record["losses"],
           "device_peak_bytes": max(r["device_peak_bytes"] or 0 for r in record["ranks"]),
           "job_seconds": time.time() - t0}
    if ep > 1:
        a2a = [r["comm"].get("ep", {}).get("all_to_all", {}) for r in record["ranks"]]
        local = tokens // gpus
        theory = all_to_all_bytes(mcfg, local, ep, cfg.dtype, recompute=args.recompute == "full",
                                  microbatches=args.microbatches)
        row["all_to_all"] = {
            "calls_per_step": a2a[0]["calls"] / args.steps,
            "bytes_per_step_mean_rank": sum(a["bytes"] for a in a2a) / len(a2a) / args.steps,
            "theory_bytes_per_step": theory["bytes"],
            "wire_bytes_per_step_mean_rank":
                sum(a["wire_bytes"] for a in a2a) / len(a2a) / args.steps,
            "theory_wire_bytes_per_step": theory["wire_bytes"],
            "host_seconds_per_step_max_rank": max(a["seconds"] for a in a2a) / args.steps}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cuda", "cpu"))
    p.add_argument("--gpus", type=int, default=None, help="ranks (default: every GPU; cpu 2)")
    p.add_argument("--model", default=None, help="default moe-1.3b (cpu: moe-tiny)")
    p.add_argument("--dense", default=None, help="default gpt-1.3b (cpu: tiny)")
    p.add_argument("--ep", default="1,2,4", help="expert-parallel sizes to time")
    p.add_argument("--batch-size", type=int, default=None, help="global sequences a step")
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--skip", type=int, default=3, help="warm-up steps not timed")
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args()
    cuda = args.device == "cuda"
    gpus = args.gpus or (torch.cuda.device_count() if cuda else 2)
    args.model = args.model or ("moe-1.3b" if cuda else "moe-tiny")
    args.dense = args.dense or ("gpt-1.3b" if cuda else "tiny")
    args.batch_size = args.batch_size or (8 * gpus if cuda else 4 * gpus)
    args.microbatches = args.microbatches or (4 if cuda else 2)
    if not 0 <= args.skip < args.steps:
        p.error(f"--skip must be below --steps ({args.steps})")
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = GPUS[gpu_for_device(name)].peak_flops
    out = {"device": name, "gpus": gpus, "torch": torch.__version__,
           "grouped_mm": cuda and getattr(torch, "_grouped_mm", None) is not None,
           "peak_flops": peak, "args": vars(args), "rows": [], "errors": []}
    jobs = [(args.dense, 1)] + [(args.model, int(e)) for e in args.ep.split(",")]
    for model, ep in jobs:
        if gpus % ep:
            out["errors"].append(f"{model} ep={ep}: does not divide {gpus} ranks")
            continue
        try:
            out["rows"].append(_row(args, model, ep, gpus, peak))
        except Exception as e:  # a row that fails must not lose the others
            out["errors"].append(f"{model} ep={ep}: {type(e).__name__}: {e}"[:2000])
        print(json.dumps(out["rows"][-1] if out["rows"] else out["errors"][-1])[:400],
              flush=True)
    base = {r["model"]: r for r in out["rows"] if r["ep"] == 1}
    for r in out["rows"]:
        if r["ep"] > 1 and r["model"] in base:
            r["a2a_exposed_estimate_s"] = r["step_seconds"] - base[r["model"]]["step_seconds"]
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for r in out["rows"]:
        print(f"{r['model']:>10} ep={r['ep']}  {r['tokens_per_s']:>10.0f} tok/s  "
              f"MFU {100 * r['mfu']:.1f}%  peak {r['device_peak_bytes'] / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
