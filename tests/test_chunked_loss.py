"""The chunked cross-entropy (``minipar/parallel/chunked_loss.py``): the loss's value and
gradients, with no fp32 copy of the logits kept.

* Against ``model.CrossEntropy`` (``F.cross_entropy(logits.float())``) on the same
  logits: fp32 logits, the loss equal and the gradients within 1e-6 relative (measured:
  the loss equal, gradients 2.3e-9 apart at most of 3.9e-3, fp32 rounding order); bf16
  logits, gradients measured bit for bit equal, checked at one bf16 rounding, and the
  loss equal on one CPU and one fp32 rounding apart on another (1.1e-7 relative on an
  AMD EPYC: the order of the fp32 sums follows the vector width), checked at 3.3e-7.
  Any chunk size gives the same, from one token a chunk to all of them.
* What the backward keeps: the logits as they came and one fp32 value per token, where
  the cross-entropy keeps its fp32 log-softmax.
* Layouts (dp 2, pp 2, dp 2 x pp 2 with ZeRO-1) against the one-process run of the plain
  cross-entropy, at the fp32 tolerances of ``parity.TOLERANCES`` and plain SGD without
  clipping; a doubled logits gradient (the mutation) fails the same check.
* The memory model: 12 bytes a logit become the logits' own 2 and their gradient's 2
  (bf16), plus one chunk's fp32 temporaries; tensor parallelism is refused in one line.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from test_engine import FP32, SGD, reference

from minipar.config import TrainConfig, validate
from minipar.engine import train
from minipar.model import CrossEntropy
from minipar.parallel import chunked_loss
from minipar.parallel.chunked_loss import ChunkedCrossEntropy, chunk_tokens
from minipar.parity import compare, final_parameters
from minipar.theory.layout import Layout
from minipar.theory.memory import memory_per_stage


def _logits(dtype: torch.dtype, vocab: int = 97, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(2, 48, vocab, generator=g) * 3).to(dtype)
    return z, torch.randint(0, vocab, (2, 48), generator=g)


def _loss_and_grad(loss_fn, z: torch.Tensor, t: torch.Tensor):
    z = z.clone().requires_grad_()
    loss = loss_fn(z, t)
    (0.37 * loss).backward()  # a loss scale, as micro-batches give
    return loss.detach(), z.grad


@pytest.mark.parametrize("chunk_rows", [1, 7, 96, 1000])
def test_the_cross_entropys_value_and_gradients(chunk_rows: int) -> None:
    for dtype, rtol in ((torch.float32, 1e-6), (torch.bfloat16, 2**-8)):
        z, t = _logits(dtype)
        chunked = ChunkedCrossEntropy(chunk_bytes=4 * z.shape[-1] * chunk_rows)
        (want, want_grad), (got, got_grad) = (_loss_and_grad(f, z, t) for f in (
            CrossEntropy(), chunked))
        assert got.dtype == torch.float32 and got_grad.dtype == dtype
        torch.testing.assert_close(got, want, rtol=3.3e-7, atol=0)
        torch.testing.assert_close(got_grad, want_grad, rtol=rtol, atol=1e-9)


def test_the_backward_keeps_the_logits_and_a_value_per_token() -> None:
    z, t = _logits(torch.bfloat16)
    kept = {}
    for name, loss_fn in (("plain", CrossEntropy()), ("chunked", ChunkedCrossEntropy())):
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda x, saved=saved: saved.append(x) or x, lambda x: x):
            loss_fn(z.clone().requires_grad_(), t)
        kept[name] = {(x.dtype, x.numel()) for x in saved}
    n, v = t.numel(), z.shape[-1]
    assert (torch.float32, n * v) in kept["plain"]  # the fp32 log-softmax
    assert all(numel < n * v for dtype, numel in kept["chunked"] if dtype == torch.float32)
    assert (torch.bfloat16, n * v) in kept["chunked"]  # the logits as they came
    assert chunk_tokens(50304) == 1334  # gpt-1.3b's vocabulary: 256 MiB of fp32 logits


def _run(**layout) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory() as save:
        run = train(TrainConfig(steps=5, timeout=240, save=save, chunked_loss=True,
                                **layout, **SGD))
        return run, final_parameters(save)


@pytest.mark.parametrize("layout", [dict(dp=2), dict(pp=2, microbatches=2),
                                    dict(dp=2, pp=2, zero=1, microbatches=2)],
                         ids=["dp2", "pp2", "dp2-pp2-zero1"])
def test_layouts_match_one_process(layout: dict) -> None:
    run, params = _run(**layout)
    ref = reference(**SGD)
    parity = compare(run, ref, params, ref["params"])
    assert parity.ok(FP32), parity.describe()


def test_a_doubled_logits_gradient_fails(monkeypatch) -> None:
    backward = chunked_loss._ChunkedCrossEntropy.backward
    monkeypatch.setattr(chunked_loss._ChunkedCrossEntropy, "backward", staticmethod(
        lambda ctx, g: (2 * backward(ctx, g)[0], None, None)))
    run, params = _run(dp=2)
    ref = reference(**SGD)
    assert not compare(run, ref, params, ref["params"]).ok(FP32)


def test_the_memory_model_and_the_refusal() -> None:
    """gpt-1.3b, 8 sequences a micro-batch, bf16: the last stage's loss takes 12 bytes a
    logit (the fp32 log-softmax kept, two fp32 gradients in the backward), chunked 2 + 2
    and one chunk's temporaries: 5.4 GiB less of 55.5."""
    lay = Layout(microbatch_size=8, microbatches=4)
    plain, chunked = (memory_per_stage("gpt-1.3b", lay.with_(chunked_loss=c),
                                       accounting="fused")[0] for c in (False, True))
    logits = 8 * 2048 * 50304
    assert plain["loss_workspace"] == 8 * logits
    assert chunked["loss_workspace"] == 2 * logits + 3 * chunked_loss.CHUNK_BYTES
    assert plain["activations"] - chunked["activations"] == 2 * logits
    assert lay.with_(chunked_loss=True).train_flags("gpt-1.3b")[-3] == "--chunked-loss"
    with pytest.raises(ValueError, match="^--chunked-loss with --tp > 1 is not supported"):
        validate(TrainConfig(tp=2, chunked_loss=True))
