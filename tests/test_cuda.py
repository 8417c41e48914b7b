"""The GPU code paths, checked where they can be: on the CPU.

The CUDA runs themselves are scripts (``benchmarks/gpu_parity.py``, ``benchmarks/gpu.py``)
run on a GPU machine, their results in ``docs/benchmarks.md``; CI has no GPU, and
a test that skips there would check nothing. What these tests pin down on the CPU:

* the GPU benchmark compares like with like: its plain PyTorch loop (bf16 weights,
  fp32 masters, fused AdamW, clipping) gives the engine's losses step for step, so its
  speed ratio measures minipar's machinery and nothing else;
* ``engine.train`` on a CUDA build starts its ranks with ``spawn`` (forking a process
  whose autograd already ran fails there), and a spawned run reproduces the reference.
"""

from __future__ import annotations

import torch
from _scripts import load_script

from minipar import engine
from minipar.config import TrainConfig
from minipar.launch import launch


def _load_benchmark():
    return load_script("benchmarks/gpu.py", "gpu_bench")


def _both_loops(steps: int) -> dict:
    bench = _load_benchmark()
    cfg = TrainConfig(model="tiny", dtype="bf16", device="cpu", batch_size=4, steps=steps,
                      warmup=2, lr=1e-2, fused=True)
    return {name: fn(cfg, steps - 1, 1, False)["losses"]
            for name, fn in (("minipar", bench.run_minipar), ("plain", bench.run_plain))}


def test_benchmark_plain_loop_is_the_engine_computation():
    steps = 8
    out = launch(_both_loops, 1, args=(steps,), timeout=120)[0]
    assert len(out["minipar"]) == len(out["plain"]) == steps
    # The same bf16 arithmetic, up to the order of the gradient-norm sums: a few 1e-4
    # after 8 steps (bf16 roundings flip). A plain loop with a 10% different learning
    # rate is 1e-2 off, one clipping at 0.5 instead of 1.0 is 2.5e-3 off.
    for a, b in zip(out["minipar"], out["plain"]):
        assert abs(a - b) <= 1.5e-3 * abs(b), (out["minipar"], out["plain"])


def test_train_spawns_ranks_on_cuda_builds(monkeypatch):
    cfg = TrainConfig(model="tiny", dp=2, steps=3, batch_size=8, timeout=120)
    ref = engine.train_reference(cfg)["losses"]  # autograd has run in this process
    methods = []

    def spy(*args, **kwargs):
        methods.append(kwargs.get("start_method"))
        return launch(*args, **kwargs)

    monkeypatch.setattr(engine, "launch", spy)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA build
    losses = engine.train(cfg)["losses"]
    assert methods == ["spawn"]
    assert max(abs(a - b) for a, b in zip(losses, ref)) < 1e-5
