"""The fused flash-attention block kernel of ring attention (minipar.parallel.cp_kernels).

No GPU here: the dispatch is checked as a pure function, and the flash path's wiring
(which blocks are causal, shapes, dtypes, the merge of the kernel's lse, the backward
from the merged out and lse, the dk/dv ring) runs with torch's CPU flash kernel standing
in for the two CUDA ops, with their arguments and returns. Measured against the
single-device reference (cp 1, 2, 4, both layouts): fp32 4.8e-7 on outputs, 9.5e-7 on
gradients; bf16 1.4e-2; held to test_cp.py's tolerances. On GPUs:
``benchmarks/cp_gpu.py --dtype bf16`` runs the real kernels.
"""

from __future__ import annotations

import pytest
import torch
from test_cp import (
    BF16_TOL,
    GRAD_TOL,
    HD,
    OUT_TOL,
    B,
    H,
    S,
    _errors,
    _full_inputs,
    _gathered,
    _reference,
)

from minipar.comm import Comm
from minipar.launch import launch
from minipar.parallel import cp as cpmod
from minipar.parallel import cp_kernels
from minipar.parallel.cp import ring_attention, ring_plan, shard_sequence
from minipar.theory.context import ring_bytes


def test_block_kernel_picks_math_on_cpu_and_flash_only_where_it_runs():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert cpmod.block_kernel(torch.zeros(1, 1, 2, 8, dtype=dtype)) is cpmod.MATH
    assert cpmod.block_kernel(torch.zeros(1, 1, 2, 8), "flash") is cpmod.FLASH
    with pytest.raises(ValueError, match="kernel"):
        cpmod.block_kernel(torch.zeros(1, 1, 2, 8), "cudnn")
    ok = cp_kernels.flash_supported
    assert ok("cuda", torch.bfloat16, 64, (9, 0)) and ok("cuda", torch.float16, 256, (8, 0))
    assert not ok("cuda", torch.float32, 64, (9, 0))  # fp32 on a GPU: the math path
    assert not ok("cpu", torch.bfloat16, 64)
    assert not ok("cuda", torch.bfloat16, 512, (9, 0))
    assert not ok("cuda", torch.bfloat16, 64, (7, 5))  # flash needs sm80+


class _CpuFlashOps:
    """The two CUDA flash ops' contract, computed by torch's CPU flash kernel.

    Same arguments and the same 9-tuple / 3-tuple as ``aten._scaled_dot_product_flash_
    attention`` (and its backward) return on CUDA; checks what the CUDA kernels require
    (unit stride on the head dim, a contiguous fp32 lse, out and dout in q's dtype) and
    records (is_causal, t_q, t_k) of every call.
    """

    def __init__(self) -> None:
        self.calls: dict[str, list] = {"forward": [], "backward": []}

    def _scaled_dot_product_flash_attention(self, q, k, v, dropout_p, is_causal,
                                            return_debug_mask, *, scale):
        assert all(t.stride(-1) == 1 and t.dtype == q.dtype for t in (q, k, v))
        assert dropout_p == 0.0 and not return_debug_mask
        self.calls["forward"].append((is_causal, q.shape[2], k.shape[2]))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, scale=scale)
        assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
        rng = torch.zeros(2, dtype=torch.int64)
        return (out, lse, None, None, q.shape[2], k.shape[2], rng, torch.zeros(()),
                torch.empty(0, dtype=q.dtype))

    def _scaled_dot_product_flash_attention_backward(self, dout, q, k, v, out, lse, cum_q,
                                                     cum_k, max_q, max_k, dropout_p,
                                                     is_causal, seed, offset, *, scale):
        assert lse.is_contiguous() and lse.dtype == torch.float32
        assert all(t.stride(-1) == 1 and t.dtype == q.dtype for t in (k, v, out, dout))
        assert (max_q, max_k, cum_q, cum_k) == (q.shape[2], k.shape[2], None, None)
        assert seed.shape == (2,) and dropout_p == 0.0
        self.calls["backward"].append((is_causal, q.shape[2], k.shape[2]))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, dropout_p, is_causal, scale=scale)


def _run_flash(layout: str, dtype: torch.dtype) -> dict:
    """One ring forward + backward on the flash path, its CUDA ops played by CPU ones."""
    comm = Comm(dim="cp")
    r, n = comm.rank, comm.size
    ops, saved = _CpuFlashOps(), cp_kernels.aten
    cp_kernels.aten = ops  # this rank's process only (ranks fork or spawn)
    try:
        q, k, v, dout = (shard_sequence(t, r, n, layout, dim=2).to(dtype)
                         for t in _full_inputs())
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        comm.log.clear()
        out = ring_attention(q, k, v, comm, layout, kernel="flash")
        out.backward(dout)
        sent = comm.log.summary().get("cp", {}).get("send", {"calls": 0, "bytes": 0})
    finally:
        cp_kernels.aten = saved
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "calls": ops.calls, "sent": (sent["calls"], sent["bytes"])}


def _flash_rank() -> dict:
    return {(layout, str(dtype)): _run_flash(layout, dtype)
            for layout in ("zigzag", "contiguous") for dtype in (torch.float32,
                                                                 torch.bfloat16)}


@pytest.mark.parametrize("n", [1, 2, 4])
def test_flash_path_wiring_with_cpu_kernels(n):
    """Shapes, causal flags, merge and backward of the flash path, CUDA not needed.

    fp32 through the CPU flash kernel meets the fp32 tolerances; bf16 the bf16 one. The
    kernel runs exactly ``ring_plan``'s calls, causal where the plan says, each whole
    chunks against whole chunks (no mask), forward, and backward in reverse; the ring sends what it
    sends on the math path (bf16 blocks, fp32 gradient accumulators).
    """
    res, want, c = launch(_flash_rank, n, timeout=120), _reference(), S // (2 * n)
    for layout in ("zigzag", "contiguous"):
        for dtype, tol in ((torch.float32, (OUT_TOL, GRAD_TOL)),
                           (torch.bfloat16, (BF16_TOL, BF16_TOL))):
            got = [r[(layout, str(dtype))] for r in res]
            err = _errors(_gathered(got, layout), want)
            assert err["out"] <= tol[0] and max(err.values()) <= tol[1], (layout, dtype, err)
            for rank, g in enumerate(got):
                steps = [[(b.causal, (b.q1 - b.q0) * c, (b.k1 - b.k0) * c) for b in step]
                         for step in ring_plan(rank, n, layout)]
                # at most one fused call per ring step, as torch's ring makes; the
                # backward runs the steps last first
                assert all(len(step) <= 1 for step in steps)
                assert g["calls"]["forward"] == [x for step in steps for x in step]
                assert g["calls"]["backward"] == [x for step in steps[::-1] for x in step]
            size = 2 if dtype == torch.bfloat16 else 4
            bytes_ = ring_bytes(B, S, H * HD, n, bytes_per_element=size, grad_bytes=4)
            assert all(g["sent"] == (bytes_["forward"]["calls"] + bytes_["backward"]["calls"],
                                     bytes_["forward"]["bytes"] + bytes_["backward"]["bytes"])
                       for g in got)
