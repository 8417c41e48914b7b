"""Weight-gradient accumulation fusion (``minipar/parallel/wgrad_fusion.py``).

The engine turns it on by default (ZeRO 0-2), so every parity test in ``test_engine.py``
runs it; these tests pin what those cannot see: the fused sums equal the hook's sums,
the split backward of the zero-bubble schedule computes each product once (B: the input
gradient only; W: the weight's only), a tied head is left alone, the unfused path stays
at parity, and a wrong product fails the parity check.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minipar.comm import Comm
from minipar.config import TrainConfig
from minipar.engine import train, train_reference
from minipar.launch import launch
from minipar.model import GPT, get_config
from minipar.parallel.wgrad_fusion import FusedWgradLinear, fuse_weight_gradients
from minipar.parallel.zero import Zero3, ZeroOptimizer
from minipar.parallel.zero import shards as zero_shards
from minipar.parity import TOLERANCES, compare

FP32 = TOLERANCES["fp32"]
SGD = dict(optimizer="sgd", grad_clip=0.0, lr=0.5, warmup=1)


def _summed_grads(stage: int, microbatches: int = 3) -> list[list[torch.Tensor]]:
    """This rank's reduced fp32 gradient shards after ``microbatches`` backwards (its own
    data), without and with the fusion."""
    out = []
    for fused in (False, True):
        model = GPT("tiny", seed=0)
        if stage == 3:
            sync = run = Zero3(model, Comm())
        else:
            sync, run = ZeroOptimizer(model, torch.optim.SGD, stage=stage, comm=Comm(),
                                      lr=0.1), model
        sync.backwards_per_step = microbatches
        if fused:  # the blocks' linear weights, and the head unless its call gathers it
            names = [n for n, _ in model.named_parameters()]
            assert fuse_weight_gradients([model], sync) == 4 * model.cfg.n_layer + (stage < 3)
            assert [n for n, _ in model.named_parameters()] == names  # (no sink inside)
        g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
        for _ in range(microbatches):
            idx = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=g)
            run(idx, torch.roll(idx, -1, 1)).backward()
        sync.finish_gradient_sync()
        out.append([f.master.grad.clone() for f in sync.flats])
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fused_sums_equal_the_hooks_sums(stage: int) -> None:
    for plain, fused in launch(_summed_grads, 2, args=(stage,), timeout=120):
        assert len(plain) == len(fused) > 0
        for a, b in zip(plain, fused):  # the same fp32 products added in another kernel
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


class _CountingSink:
    def __init__(self) -> None:
        self.products: list[torch.Tensor] = []

    def fusable(self, linear) -> bool:
        return True

    def accumulate_product(self, p, dy, x) -> None:
        self.products.append(dy.t() @ x)


def test_split_backward_computes_each_product_once() -> None:
    """B (``autograd.grad`` to a detached input) gives dx and no product; W
    (``backward(inputs=[weight])``) gives the product and no dx: as the executor runs
    the zero-bubble schedule."""
    torch.manual_seed(0)
    sink, linear = _CountingSink(), nn.Linear(8, 4)
    fused = FusedWgradLinear(linear, sink.accumulate_product)
    x = torch.randn(3, 8).requires_grad_()
    y = fused(x)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, [x], dy, retain_graph=True)  # B
    assert sink.products == [] and linear.weight.grad is None
    torch.testing.assert_close(dx, dy @ linear.weight)
    torch.autograd.backward(y, dy, inputs=[linear.weight, linear.bias])  # W
    assert len(sink.products) == 1 and x.grad is None
    torch.testing.assert_close(sink.products[0], dy.t() @ x)
    torch.testing.assert_close(linear.bias.grad, dy.sum(0))


def test_tied_head_and_foreign_weights_stay_unfused() -> None:
    untied = GPT("tiny", seed=0)
    names = list(dict(untied.named_parameters()))
    assert fuse_weight_gradients([untied], _CountingSink()) == 4 * 8 + 1  # and the head
    assert list(dict(untied.named_parameters())) == names  # same names, same order
    model = GPT(get_config("tiny").with_(tie_embeddings=True), seed=0)
    n = fuse_weight_gradients([model], _CountingSink())
    assert type(model.head) is nn.Linear  # shares the embedding's weight on this rank
    assert n == 4 * model.cfg.n_layer  # qkv, attention proj, fc, mlp proj

    class Nothing(_CountingSink):
        def fusable(self, linear) -> bool:
            return False
    assert fuse_weight_gradients([GPT("tiny", seed=0)], Nothing()) == 0


@pytest.mark.parametrize("layout", [dict(dp=2, zero=1, microbatches=2),
                                    dict(dp=2, zero=3, microbatches=2),
                                    dict(pp=2, schedule="zb", microbatches=2)],
                         ids=["dp2 zero1", "dp2 zero3", "pp2 zb"])
def test_unfused_path_still_matches(layout: dict) -> None:
    cfg = TrainConfig(steps=3, timeout=240, wgrad_fusion=False, **layout, **SGD)
    parity = compare(train(cfg), train_reference(cfg))
    assert parity.ok(FP32), parity.describe()


def test_a_wrong_product_fails_the_check(monkeypatch) -> None:
    """Mutation: the fused product added twice over. The hook's path is untouched, so
    only the fusion can carry the error; the check must see it."""
    cfg = TrainConfig(steps=3, timeout=240, dp=2, microbatches=2, **SGD)
    ref = train_reference(cfg)
    original = zero_shards.FlatParams.add_product

    def doubled(self, k, dy, x, dtype):
        return original(self, k, 2 * dy, x, dtype)

    monkeypatch.setattr(zero_shards.FlatParams, "add_product", doubled)
    broken = compare(train(cfg), ref)
    assert not broken.ok(FP32), f"a doubled weight gradient passed: {broken}"
    assert broken.grad_ratios[0] > 1.2  # most of the model's gradient is in those weights


def test_the_command_line_turns_it_off() -> None:
    from minipar.__main__ import build_parser, train_config

    def parsed(flags: str) -> TrainConfig:
        return train_config(build_parser().parse_args(["train", *flags.split()]))

    assert parsed("").wgrad_fusion and parsed("--wgrad-fusion").wgrad_fusion
    assert not parsed("--no-wgrad-fusion --dp 2").wgrad_fusion
