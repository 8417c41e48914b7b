"""Ring attention (minipar.parallel.cp) on GPUs with NCCL: parity, balance and time.

One rank per GPU. Every rank draws the same full q, k, v and output gradient, runs the
single-device reference (``F.scaled_dot_product_attention(is_causal=True)``) on the
whole sequence on its own GPU, then ring attention on its shard, and reports the worst
difference of its shard of the output and of the q, k, v gradients, plus the time of
one ring forward + backward (median of a few, after a warm-up) for each layout. Every
rank's ring time is the same (each step waits for the slowest rank), so the balance shows
in ``forward_compute_seconds``: the rank's own forward blocks run with no communication.
Zig-zag should make it equal across ranks; the contiguous split should not.
``forward_seconds`` minus the slowest rank's compute is the communication left exposed.

    python benchmarks/cp_gpu.py --cp 2 --seq 8192          # on a machine with 2 GPUs
    python benchmarks/cp_gpu.py --cp 2 --seq 64 --device cpu   # a dry run anywhere (gloo)
    python benchmarks/cp_gpu.py --cp 4 --seq 16384 --dtype bf16 --kernel math  # vs flash

``--kernel`` picks the block kernel (``minipar.parallel.cp.block_kernel``): auto runs the
fused flash kernel in bf16 on GPUs and the math path otherwise. The tables below were
measured with the math block kernel, before the flash one existed (``--kernel math``).

Measured on 4 H100 (torch 2.11, NCCL; 1 sequence, 8 heads of 64; seconds per forward +
backward, the same on every rank because each ring step waits for the slowest rank):

    cp  seq    dtype  zig-zag  contiguous  ratio (theory (4C-1)/(2C+1))  worst |err| out, grad
    2   8192   fp32   0.0125   0.0169      1.35  (1.40)                  1.4e-6, 8.3e-6
    4   16384  fp32   0.0289   0.0349      1.21  (1.67)                  1.7e-6, 1.2e-5
    4   16384  bf16   0.0222   0.0355      1.60  (1.67)                  7.8e-3, 1.6e-2
    4   65536  bf16   0.287    0.468       1.63  (1.67)                  1.6e-2, 1.6e-2

No deadlock with NCCL's per-pair ordering at cp 2 or 4 (see ``_exchange``). bf16 errors
are against the bf16 reference and of the size of one bf16 rounding of values near 2.

Per-rank forward compute (no communication) and the ring forward, 4 H100, bf16,
131072 tokens (32768 per rank), seconds:

    layout      rank 0  rank 1  rank 2  rank 3  ring forward  fwd + bwd
    zig-zag     0.484   0.484   0.484   0.484   0.486         1.131
    contiguous  0.181   0.383   0.586   0.789   0.791         1.845

Zig-zag equalises the work; the contiguous ranks grow as the theory's blocks 3, 7, 11, 15
(measured 1 : 2.1 : 3.2 : 4.4, the theory 1 : 2.3 : 3.7 : 5; diagonal blocks cost less
than full ones in practice). The ring forward exceeds the slowest rank's compute by
0.4%: the k|v transfers are hidden (32768 tokens per rank is far above the
``min_local_tokens_to_hide_ring`` bound). At 32768 tokens on 4 GPUs: 0.0314 s compute
on every rank, 0.0323 s for the ring forward (3% over compute).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from minipar.comm import Comm
from minipar.launch import launch
from minipar.parallel.cp import block_kernel, block_plan, ring_attention, shard_sequence


def _timed(device: str, reps: int, fn, *args) -> float:
    """Median seconds of ``fn(*args)`` over ``reps`` runs after one warm-up."""
    times = []
    for rep in range(reps + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)
        if device == "cuda":
            torch.cuda.synchronize()
        if rep:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _local_blocks(q, k, v, rank: int, cp: int, layout: str, kernel: str) -> None:
    """This rank's forward blocks with no communication (its own k, v as stand-ins)."""
    qs, ks, vs = q.chunk(2, dim=2), k.chunk(2, dim=2), v.chunk(2, dim=2)
    fwd = block_kernel(q, kernel).forward
    for blocks in block_plan(rank, cp, layout):
        for qi, kj, kind in blocks:
            fwd(qs[qi], ks[kj], vs[kj], q.shape[-1] ** -0.5, kind == "causal")


def _rank(seq: int, heads: int, hd: int, dtype: str, device: str, reps: int,
          kernel: str = "auto") -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device(f"cuda:{torch.cuda.current_device()}" if device == "cuda" else "cpu")
    comm = Comm(dim="cp")
    r, n = comm.rank, comm.size
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    g = torch.Generator(device=dev).manual_seed(0)
    full = [torch.randn(1, heads, seq, hd, generator=g, device=dev, dtype=dt)
            for _ in range(4)]
    ref = [t.clone().requires_grad_() for t in full[:3]]
    ref_out = F.scaled_dot_product_attention(*ref, is_causal=True)
    ref_out.backward(full[3])
    want = [ref_out.detach()] + [t.grad for t in ref]
    result: dict = {"rank": r, "device": torch.cuda.get_device_name(dev)
                    if device == "cuda" else "cpu", "kernel": block_kernel(full[0], kernel).name}
    for layout in ("zigzag", "contiguous"):
        q, k, v, dout = (shard_sequence(t, r, n, layout, dim=2) for t in full)
        times = []
        for rep in range(reps + 1):
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = ring_attention(q, k, v, comm, layout, kernel=kernel)
            out.backward(dout)
            if device == "cuda":
                torch.cuda.synchronize()
            if rep:  # the first is the warm-up
                times.append(time.perf_counter() - t0)
        got = [out.detach(), q.grad, k.grad, v.grad]
        err = [(a.float() - shard_sequence(b, r, n, layout, dim=2).float()).abs().max().item()
               for a, b in zip(got, want)]
        with torch.no_grad():
            fwd = _timed(device, reps, ring_attention, q, k, v, comm, layout, None, kernel)
            local = _timed(device, reps, _local_blocks, q, k, v, r, n, layout, kernel)
        result[layout] = {"max_err_out": err[0], "max_err_grad": max(err[1:]),
                          "seconds": statistics.median(times), "forward_seconds": fwd,
                          "forward_compute_seconds": local}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--hd", type=int, default=64)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kernel", default="auto", choices=("auto", "math", "flash"),
                   help="block kernel: auto = flash on CUDA in bf16, else math")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    backend = "nccl" if a.device == "cuda" else "gloo"
    res = launch(_rank, a.cp, args=(a.seq, a.heads, a.hd, a.dtype, a.device, a.reps, a.kernel),
                 backend=backend, timeout=300)
    for r in res:
        print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "ranks": list(res)}, f, indent=1)


if __name__ == "__main__":
    main()
