"""ZeRO-Offload (minipar.parallel.offload) against a plain optimizer on the same model.

fp32 on the device: the data path is the plain one (the same gradients, accumulated in
the same order, the same torch optimizer on the same values), so parameters must be
bit-identical after every step. 16-bit on the device: compared with the mixed-precision
recipe written out by hand (fp32 masters, gradients cast up, the step, weights cast
down), again bit-identical. Bytes moved are checked against ``minipar.theory.offload``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from minipar.model import GPT, GPTConfig
from minipar.parallel import offload as offmod
from minipar.parallel.offload import OffloadOptimizer
from minipar.theory.offload import offload_memory, offload_traffic

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)
STEPS, MICRO = 3, 2
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
              "sgd": (torch.optim.SGD, {"lr": 0.1})}


def _batches(step: int, micro: int = MICRO) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g),
             torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g))
            for _ in range(micro)]


def _loss(model, x, y) -> torch.Tensor:
    out = model(x, y)
    return out[1] if isinstance(out, tuple) else out


def _train(model, opt, hand_rolled_masters=None, micro: int = MICRO) -> list[dict]:
    """STEPS steps of ``micro`` micro-batches; the parameters after each step."""
    seen = []
    for step in range(STEPS):
        for x, y in _batches(step, micro):
            (_loss(model, x, y) / micro).backward()
        if hand_rolled_masters is not None:  # mixed precision by hand: grads up, step, down
            for p, m in zip(model.parameters(), hand_rolled_masters):
                m.grad = p.grad.float()
        opt.step()
        if hand_rolled_masters is not None:
            with torch.no_grad():
                for p, m in zip(model.parameters(), hand_rolled_masters):
                    p.copy_(m)
                    p.grad = None
        opt.zero_grad()
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return seen


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fp32_offload_is_bit_identical_to_the_plain_optimizer(name):
    cls, kwargs = OPTIMIZERS[name]
    torch.manual_seed(0)
    ref_model = GPT(CFG)
    model = copy.deepcopy(ref_model)
    want = _train(ref_model, cls(ref_model.parameters(), **kwargs))
    opt = OffloadOptimizer(model.parameters(), cls, **kwargs)
    got = _train(model, opt)
    for w, g in zip(want, got):
        for k in w:
            assert torch.equal(w[k], g[k]), k
    n = sum(p.numel() for p in model.parameters())
    assert opt.last_traffic == offload_traffic(n, param_bytes=4, microbatches=MICRO)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups[0]["params"][0] is opt.masters[0]  # LR schedules reach them


def test_bf16_offload_matches_mixed_precision_by_hand():
    torch.manual_seed(0)
    ref_model = GPT(CFG)
    model = copy.deepcopy(ref_model)
    masters = [p.detach().clone() for p in ref_model.parameters()]
    ref_model.to(torch.bfloat16)
    # One micro-batch: by hand, micro-batch gradients would add up in bf16 on the
    # device, where offload adds them in fp32 on the host (a rounding apart).
    want = _train(ref_model, torch.optim.AdamW(masters, lr=1e-2), masters, micro=1)
    opt = OffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                           param_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    got = _train(model, opt, micro=1)
    for w, g in zip(want, got):
        for k in w:
            assert torch.equal(w[k], g[k]), k
    for p, m in zip(model.parameters(), opt.masters):  # the device holds the masters, cast
        assert torch.equal(p, m.to(torch.bfloat16))
    n = sum(p.numel() for p in model.parameters())
    assert opt.last_traffic == {"to_host": 2 * n, "to_device": 2 * n}
    step_counters = 4 * len(opt.masters)  # AdamW's per-tensor fp32 step count, not per param
    assert opt.host_bytes() == offload_memory(n, param_bytes=2)["host"] + step_counters


def test_gradients_leave_the_device_as_they_are_produced():
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = OffloadOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    x, y = _batches(0)[0]
    _loss(model, x, y).backward()
    assert all(p.grad is None for p in model.parameters())  # hooks took every gradient
    assert opt.traffic["to_host"] == 4 * sum(p.numel() for p in model.parameters())
    opt.step()
    opt.zero_grad()
    assert all(float(m.grad.abs().sum()) == 0.0 for m in opt.masters)


def test_without_overlap_gradients_are_offloaded_on_request():
    torch.manual_seed(0)
    ref_model = GPT(CFG)
    model = copy.deepcopy(ref_model)
    want = _train(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1))
    opt = OffloadOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, overlap=False)
    got = _train(model, opt)  # step() offloads what is still on the device
    assert all(torch.equal(want[-1][k], got[-1][k]) for k in want[-1])


def test_mutation_overwriting_instead_of_accumulating_fails(monkeypatch):
    torch.manual_seed(0)
    ref_model = GPT(CFG)
    model = copy.deepcopy(ref_model)
    want = _train(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1))

    def land_overwrite(self, i):  # the mutation: the last micro-batch wins
        if self._in_flight.pop(i, "none") != "none":
            self.masters[i].grad.copy_(self._host_grads[i])

    monkeypatch.setattr(offmod.OffloadOptimizer, "_land", land_overwrite)
    got = _train(model, OffloadOptimizer(model.parameters(), torch.optim.SGD, lr=0.1))
    worst = max((want[-1][k] - got[-1][k]).abs().max().item() for k in want[-1])
    assert worst > 1e-3


def test_theory_numbers():
    # the paper's accounting: 16-bit params and grads, one micro-batch: 4 bytes per param
    assert sum(offload_traffic(10**9).values()) == 4 * 10**9
    assert offload_traffic(8, microbatches=4, dp=2, zero=2) == {"to_host": 32,
                                                                 "to_device": 8}
    mem = offload_memory(10**9)
    assert mem["device"] == 2 * 10**9 and mem["host"] == 20 * 10**9
    assert offload_memory(10**9, dp=4, zero=3)["device"] == 5 * 10**8
