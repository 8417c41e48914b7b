"""The optimizer kernel: which one a run steps with, and the temporary the memory model
books for it against what torch allocates (``benchmarks/optimizer_memory.py``, CPU).

Measured here (torch 2.13, CPU, 3 tensors of 0.4M, 0.2M and 1k elements), the peak of a
step beyond its states, as a share of the fp32 parameters: AdamW foreach 1.000, fused
0.000, one tensor at a time 2.0 x its largest tensor; SGD, with or without momentum,
0.000 with every kernel.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from _scripts import load_script

from minipar.config import TrainConfig, optimizer_kernel, optimizer_kwargs, predicted_bytes
from minipar.theory.clusters import cluster
from minipar.theory.layout import Layout
from minipar.theory.memory import OPTIMIZER_KERNELS, memory_per_stage, optimizer_step_bytes
from minipar.theory.planner import evaluate

SIZES = (400_000, 200_000, 1_000)


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "sgd-momentum"])
def test_the_booked_temporary_is_what_torch_allocates(optimizer) -> None:
    bench = load_script("benchmarks/optimizer_memory.py")
    n = sum(SIZES)
    for kernel in ("foreach", "fused", "forloop"):
        row = bench.step_peak(optimizer, kernel, sizes=SIZES)
        booked = optimizer_step_bytes(n, 1, 0, optimizer=optimizer, kernel=kernel) / (4 * n)
        if kernel == "forloop":  # a tensor at a time: two of one tensor, not booked
            assert booked == 0 and row["share_of_largest"] <= 2.001, row
        else:
            assert row["share_of_params"] == pytest.approx(booked, abs=0.01), row


def test_the_kernel_follows_the_command_line() -> None:
    """``config.optimizer_kernel`` is the one decision: the optimizer's keyword arguments
    follow it, and ``TrainConfig.layout`` carries it to the memory model."""
    cases = [(dict(), "fused"), (dict(fused=False), "forloop"),
             (dict(optimizer="sgd"), "forloop"), (dict(fused=True), "fused"),
             (dict(backend="nccl"), "fused"), (dict(backend="nccl", fused=False), "foreach"),
             (dict(device="cuda", backend="gloo"), "fused"),
             (dict(dp=2, zero=2, offload=True), "host"),
             (dict(dp=2, zero=2, offload=True, optimizer="sgd"), "host")]
    for changes, kernel in cases:
        cfg = TrainConfig(**changes)
        assert optimizer_kernel(cfg) == kernel == cfg.layout().optimizer_kernel, changes
        fused = optimizer_kwargs(cfg, host=cfg.offload).get("fused", False)
        assert fused == (kernel == "fused" or (kernel == "host" and cfg.optimizer != "sgd"))
    cfg = TrainConfig(backend="nccl", fused=False)
    assert cfg.layout("cpu").optimizer_kernel == "forloop"
    assert {k for _, k in cases} == set(OPTIMIZER_KERNELS)


def test_only_the_multi_tensor_adamw_books_its_temporary() -> None:
    n = memory_per_stage("tiny", Layout(dp=2, zero=1), accounting="fused")[0]["n_params"]
    for kernel in OPTIMIZER_KERNELS:
        row = memory_per_stage("tiny", Layout(dp=2, zero=1, optimizer_kernel=kernel),
                               accounting="fused")[0]
        assert row["optimizer_step"] == ((n + 1) // 2 * 4 if kernel == "foreach" else 0)
    with pytest.raises(ValueError, match="optimizer kernel"):
        memory_per_stage("tiny", Layout(optimizer_kernel="apex"), accounting="fused")


def test_the_fit_check_books_the_runs_kernel_as_the_planner_does() -> None:
    """``train``'s prediction (``config.predicted_bytes``, also ``train --json``'s
    ``predicted_peak_bytes``) for a run on CUDA equals the planner's for the same layout
    with the same kernel: fused by default, foreach with ``--no-fused`` (gpt-13b dp 4
    ZeRO-3, full recompute: 63.8 and 69.1 GiB; its peak is the step's with the temporary)."""
    cfg = TrainConfig(model="gpt-13b", dp=4, zero=3, recompute="full", batch_size=16,
                      backend="nccl")
    h100 = cluster(4, "H100-80GB", 4)
    got = {k: predicted_bytes(replace(cfg, fused=k == "fused"), cfg.model_config())
           for k in ("fused", "foreach")}
    for kernel, bytes_ in got.items():
        lay = cfg.layout().with_(optimizer_kernel=kernel)
        assert bytes_ == evaluate("gpt-13b", h100, lay).memory["process"], kernel
    assert got["foreach"] - got["fused"] > 4 * 2**30
