"""ZeRO-1/2's weight all-gather overlapped with the next forward
(``minipar/parallel/zero/param_gather.py``).

The engine turns it on by default, so every ZeRO-1/2 parity test in ``test_engine.py``
and ``test_dp_engine.py`` runs it; these tests pin what a parity test cannot see: after
``step()`` the gathers are still in flight, a module's call finishes only its own
buckets, in forward order, the weights then equal a synchronous gather's bit for bit,
and the same run with the overlap off trains to identical numbers.
"""

from __future__ import annotations

import pytest
import torch

from minipar.comm import Comm
from minipar.config import TrainConfig
from minipar.engine import train, train_reference
from minipar.launch import launch
from minipar.model import GPT
from minipar.parallel.zero import ZeroOptimizer
from minipar.parity import TOLERANCES, compare

FP32 = TOLERANCES["fp32"]
SGD = dict(optimizer="sgd", grad_clip=0.0, lr=0.5, warmup=1)


def _one_step(stage: int, overlap: bool) -> dict:
    """Rank-local: one step of a tiny GPT, a bucket per parameter; what is pending
    after the step, after the embedding's call, and the weights after a forward."""
    model = GPT("tiny", seed=0)
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=stage, comm=Comm(), lr=0.1,
                        bucket_mb=0, overlap_param_gather=overlap)
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    idx = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=g)
    model(idx, torch.roll(idx, -1, 1)).backward()
    opt.step()
    after_step = len(opt._gathers._pending)
    model.tok_emb(idx)  # the first module of the forward: its own bucket only
    after_embedding = len(opt._gathers._pending)
    names = {id(p): n for n, p in model.named_parameters()}
    still = sorted(names[id(p)] for i in opt._gathers._pending for p in opt.flats[i].params)
    with torch.no_grad():
        model(idx)
    return {"after_step": after_step, "after_embedding": after_embedding, "still": still,
            "left": len(opt._gathers._pending), "flats": len(opt.flats),
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("stage", [1, 2])
def test_gathers_wait_for_the_module_that_reads_them(stage: int) -> None:
    overlapped = launch(_one_step, 2, args=(stage, True), timeout=120)
    synchronous = launch(_one_step, 2, args=(stage, False), timeout=120)
    for lap, sync in zip(overlapped, synchronous):
        assert sync["after_step"] == 0  # waited inside step()
        assert lap["after_step"] == lap["flats"] > 1  # every bucket still in flight
        assert lap["after_embedding"] == lap["flats"] - 1  # the embedding's bucket only
        assert any(n.startswith("blocks.") for n in lap["still"])  # the layers still travel
        assert lap["left"] == 0  # the forward finished every one
        for name, w in sync["weights"].items():
            assert torch.equal(lap["weights"][name], w), name


def test_the_engine_trains_the_same_with_and_without_the_overlap() -> None:
    """dp 2 ZeRO-2 with 2 micro-batches, plain SGD: at parity with one process, and the
    same losses and gradient norms as with the overlap off, bit for bit (the same values
    gathered, only waited for later)."""
    runs = {on: train(TrainConfig(dp=2, zero=2, microbatches=2, steps=3, timeout=240,
                                  overlap_param_gather=on, **SGD)) for on in (True, False)}
    parity = compare(runs[True], train_reference(TrainConfig(dp=2, zero=2, microbatches=2,
                                                             steps=3, **SGD)))
    assert parity.ok(FP32), parity.describe()
    assert runs[True]["losses"] == runs[False]["losses"]
    assert [r["grad_norms"] for r in runs[True]["ranks"]] == [
        r["grad_norms"] for r in runs[False]["ranks"]]


def test_the_command_line_turns_it_off() -> None:
    from minipar.__main__ import build_parser, train_config

    def parsed(flags: str) -> TrainConfig:
        return train_config(build_parser().parse_args(["train", *flags.split()]))

    assert parsed("").overlap_param_gather
    assert not parsed("--no-overlap-param-gather --dp 2 --zero 1").overlap_param_gather
