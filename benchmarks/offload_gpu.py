"""``OffloadOptimizer`` (minipar.parallel.offload) on one GPU: parity, memory, step time.

What this times is the paper's scheme on its own (Ren et al. 2021, arXiv 2101.06840,
Sec. 4), no data parallelism: each parameter's gradient streams to a pinned host buffer
in the device dtype as backward makes it and is added into its master's fp32 gradient
(made once, reused every step); the CPU steps the fp32 masters with the optimizer
passed, here torch's AdamW with its defaults (the per-tensor CPU loop); the updated
weights come back in the device dtype. Three runs of the same model and batches: plain
fp32 AdamW on the GPU (the baseline), offload with fp32 parameters on the GPU (must
match the baseline to rounding: the CPU's AdamW and the GPU's differ only in summation
order), and offload with bf16 parameters. For each: peak device memory, seconds per
step (median after a warm-up) and the host-device bytes of the last step against
``theory.offload.offload_traffic``.

``train --offload`` no longer runs this path (the first wiring did: ``OffloadOptimizer``
inside ZeRO 0-2). It runs ``offload.HostShards`` under ``ZeroOptimizer`` and ``Zero3``:
the gradient is reduced on the device in fp32 and this rank's shard crosses once per
step, as its bucket's reduction completes during the last micro-batch's backward (ZeRO-3
sums the micro-batches' reduce-scattered shards on the device first), straight into
persistent pinned fp32 host gradients; the host steps with torch's fused CPU AdamW
(``config.optimizer_kwargs(host=True)``, 4-6x the per-tensor loop timed here); the new
shard is cast on the host and crosses back in 16 bits (``theory.offload.
zero_offload_traffic``). That path is measured by ``benchmarks/multigpu.py`` (its cp
section's offload rows, ZeRO 1-3) and, host side only, by ``benchmarks/offload_host.py``.

    python benchmarks/offload_gpu.py --model gpt2-125m      # on a CUDA machine
    python benchmarks/offload_gpu.py --model tiny --device cpu  # a dry run anywhere

Measured on one H100 (torch 2.11, 16 host cores; one micro-batch, AdamW; peak device
memory includes activations and the fp32 logits of a 50k vocabulary):

    model       batch  plain fp32          offload fp32        offload bf16
    gpt2-125m   4      0.089 s, 6.50 GB    0.259 s, 5.49 GB    0.279 s, 4.03 GB
    gpt2-350m   2      0.127 s, 8.81 GB    0.648 s, 5.97 GB    0.485 s, 3.64 GB

Host-device bytes per step equal the theory exactly (125m bf16: 249 MB each way). The
fp32 offload run differs from the GPU AdamW by at most 1.3e-5 (125m) and 4.7e-5 (350m)
after 3 steps at lr 1e-4: the CPU's and GPU's AdamW round differently. The step costs
3-5x here: the per-tensor CPU AdamW, and the step does not overlap anything (the
paper's one-step delay is not implemented, so parity stays exact).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from minipar.model import GPT, PRESETS
from minipar.parallel.offload import OffloadOptimizer
from minipar.theory.offload import offload_traffic


def _run(model, opt, batches, device) -> dict:
    times = []
    for i, (x, y) in enumerate(batches):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    out = {"seconds": statistics.median(times)}
    if device == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2-125m", choices=list(PRESETS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    cfg = PRESETS[a.model]
    base = GPT(cfg)
    n = sum(q.numel() for q in base.parameters())
    g = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randint(0, cfg.vocab_size, (a.batch, cfg.seq_len), generator=g)
                     .to(a.device) for _ in range(2)) for _ in range(a.steps)]
    res: dict = {"model": a.model, "params": n}
    models = {}
    for name, dtype in (("plain", None), ("offload fp32", None), ("offload bf16",
                                                                 torch.bfloat16)):
        model = copy.deepcopy(base).to(a.device)
        if a.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if name == "plain":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            opt = OffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4,
                                   param_dtype=dtype)
        res[name] = _run(model, opt, batches, a.device)
        if name != "plain":
            pb = 2 if dtype is not None else 4
            res[name]["traffic"] = opt.last_traffic
            res[name]["traffic_theory"] = offload_traffic(n, param_bytes=pb)
        models[name] = model.cpu()
        del opt, model
    res["max_param_diff_fp32"] = max(
        (a_ - b_).abs().max().item() for a_, b_ in zip(models["plain"].parameters(),
                                                       models["offload fp32"].parameters()))
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
