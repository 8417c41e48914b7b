"""Context parallelism (minipar.parallel.cp) against single-device causal attention.

Every rank draws the same full q, k, v and output gradient from one seed, keeps its
shard (zig-zag or contiguous), runs ring attention forward and backward, and hands its
shards back; the parent puts the sequence back together and compares with
``F.scaled_dot_product_attention(is_causal=True)`` on the whole sequence, fp32.

Tolerance: the ring reorders sums (per-block softmax, log-sum-exp merges, dk/dv
accumulated around the ring). Measured worst absolute difference over cp 1, 2, 4 and
both layouts (values and gradients of order 1): 8.3e-7 on outputs, 1.1e-6 on gradients.
We allow 2.5e-6 and 3e-6 (about 3x). The merge alone, over 20 seeds with large
scores (outputs up to 3): 2.9e-6, allowed 1e-5. bf16 inputs against the fp32 reference
(mostly the rounding of the inputs themselves): 1.2e-2, allowed 3.5e-2. A whole layer
(``Block``) on a shard: outputs and input gradients 4.8e-7, allowed 1.5e-6; weight
gradients summed over cp (sums over all tokens, larger) 3.8e-6, allowed 1.2e-5. Each
mutation misses by more than 1e-2. The flash block kernel: tests/test_cp_kernels.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from minipar.comm import Comm
from minipar.launch import launch
from minipar.model import Block, GPTConfig
from minipar.parallel import cp as cpmod
from minipar.parallel.cp import (
    RingAttention,
    RingCall,
    block_forward,
    block_plan,
    causal_pairs,
    chunk_ids,
    gather_sequence,
    merge_attention,
    positions,
    ring_attention,
    ring_plan,
    shard_sequence,
    unshard_sequence,
)
from minipar.theory.context import (
    attention_flops_per_rank,
    blocks_per_rank,
    causal_pairs_per_rank,
    imbalance,
    min_local_tokens_to_hide_ring,
    ring_bytes,
)

B, H, S, HD = 2, 2, 32, 8  # S cuts into 2 * cp chunks for cp up to 8
OUT_TOL, GRAD_TOL, MERGE_TOL, BF16_TOL = 2.5e-6, 3e-6, 1e-5, 3.5e-2
BLOCK_TOL, BLOCK_PARAM_TOL = 1.5e-6, 1.2e-5
MUTATIONS = ("no_lse_correction", "full_diagonal", "wrong_layout")
BLOCK_CFG = GPTConfig(seq_len=S, n_head=2, d_model=16)


def _full_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, S, HD, generator=g) for _ in range(4))  # q k v dout


def _reference() -> dict[str, torch.Tensor]:
    q, k, v, dout = (t.clone().requires_grad_(i < 3) for i, t in enumerate(_full_inputs()))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


# --- pure functions --------------------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_split_round_trip_and_positions(cp, layout):
    x = torch.randn(2, S, 3)
    shards = [shard_sequence(x, r, cp, layout) for r in range(cp)]
    assert all(s.shape == (2, S // cp, 3) for s in shards)
    assert torch.equal(unshard_sequence(shards, layout), x)
    pos = torch.arange(S).view(1, S)
    for r in range(cp):
        assert torch.equal(positions(S, r, cp, layout), shard_sequence(pos, r, cp, layout)[0])
    assert sorted(torch.cat([positions(S, r, cp, layout) for r in range(cp)]).tolist()) \
        == list(range(S))


def test_zigzag_chunks_and_refusals():
    assert [chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [chunk_ids(r, 4, "contiguous") for r in range(4)] == [(0, 1), (2, 3), (4, 5),
                                                                 (6, 7)]
    with pytest.raises(ValueError, match="divisible by 2\\*cp=8"):
        positions(20, 0, 4)
    with pytest.raises(ValueError, match="layout"):
        chunk_ids(0, 2, "striped")


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_zigzag_balances_causal_work_and_contiguous_does_not(cp):
    for layout in ("zigzag", "contiguous"):
        pairs = [causal_pairs(S, r, cp, layout) for r in range(cp)]
        assert pairs == causal_pairs_per_rank(S, cp, layout)
        assert sum(pairs) == S * (S + 1) // 2  # every causal pair exactly once
        plan = [block_plan(r, cp, layout) for r in range(cp)]
        counted = [{kind: sum(blk[2] == kind for step in p for blk in step)
                    for kind in ("causal", "full")} for p in plan]
        assert counted == blocks_per_rank(cp, layout)
    assert len(set(causal_pairs_per_rank(S, cp, "zigzag"))) == 1
    assert imbalance(attention_flops_per_rank(B, S, H * HD, cp, "zigzag")) == 1.0
    if cp > 1:
        assert len(set(causal_pairs_per_rank(S, cp, "contiguous"))) == cp  # grows with r
        flops = attention_flops_per_rank(B, S, H * HD, cp, "contiguous")
        assert imbalance(flops) == (4 * cp - 1) / (2 * cp + 1)


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_ring_plan_fuses_exactly_the_block_plan(cp):
    """Each fused call covers the same chunk pairs, with the same masks, as the step's
    blocks; at most one call a step in both layouts (torch's ring makes one too)."""
    def pairs(call):  # a causal call is causal on its square's diagonal only
        return {(qi, kj, "causal" if call.causal and qi == kj else "full")
                for qi in range(call.q0, call.q1) for kj in range(call.k0, call.k1)
                if not (call.causal and kj > qi)}

    for layout in ("zigzag", "contiguous"):
        for r in range(cp):
            fused, blocks = ring_plan(r, cp, layout), block_plan(r, cp, layout)
            assert [set().union(*map(pairs, step)) for step in fused] == \
                [set(step) for step in blocks]
            assert all(len(step) <= 1 for step in fused)


def test_merge_attention_equals_attention_over_the_union():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, 6, HD, generator=g) for _ in range(3))
    k, v = torch.randn(B, H, 10, HD, generator=g), torch.randn(B, H, 10, HD, generator=g)
    q = q * 3  # large scores: the merge must stay stable
    idx = torch.randperm(10, generator=g)
    a, b = idx[:4], idx[4:]  # disjoint, interleaved key sets
    scale = HD ** -0.5
    want, want_lse = block_forward(q, k, v, scale, causal=False)
    out_a, lse_a = block_forward(q, k[:, :, a], v[:, :, a], scale, causal=False)
    out_b, lse_b = block_forward(q, k[:, :, b], v[:, :, b], scale, causal=False)
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, want, rtol=0, atol=MERGE_TOL)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=MERGE_TOL)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=0,
                               atol=MERGE_TOL)
    wrong = (out_a + out_b) / 2  # the mutation: merged without weighing by the lse
    assert (wrong - want).abs().max() > 1e-2


def test_ring_bytes_theory_shape():
    assert ring_bytes(B, S, H * HD, 1)["forward"]["bytes"] == 0
    t = ring_bytes(1, 1024, 64, 4, bytes_per_element=2)
    assert t["forward"] == {"calls": 3, "bytes": 3 * 2 * 256 * 64 * 2}
    # backward: 2 k|v messages (the ring starts from the kept block) and 3 accumulators
    assert t["backward"] == {"calls": 5, "bytes": 2 * 2 * 256 * 64 * 2 + 3 * 2 * 256 * 64 * 4}


# --- the ring on 1, 2 and 4 ranks ------------------------------------------------------
def _run(layout: str, shard_layout: str | None = None,
         dtype: torch.dtype = torch.float32) -> dict:
    """One ring forward + backward; shards and the counted sends of each pass."""
    comm = Comm(dim="cp")
    r, n = comm.rank, comm.size
    q, k, v, dout = (shard_sequence(t, r, n, shard_layout or layout, dim=2).to(dtype)
                     for t in _full_inputs())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    comm.log.clear()
    out = RingAttention(comm, layout)(q, k, v)
    fwd = comm.log.summary().get("cp", {})
    comm.log.clear()
    out.backward(dout)
    bwd = comm.log.summary().get("cp", {})
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "forward": fwd, "backward": bwd,
            "gathered": gather_sequence(out.detach(), comm, layout, dim=2)}


def _mutated(mutation: str, layout: str) -> dict:
    """The same run with one deliberate defect (this rank's process only: ranks fork)."""
    if mutation == "wrong_layout":  # sharded contiguously, attended as zig-zag
        return _run(layout, shard_layout="contiguous")
    saved = cpmod.merge_attention, cpmod.block_plan
    if mutation == "no_lse_correction":
        cpmod.merge_attention = lambda oa, la, ob, lb: ((oa + ob) / 2, torch.logaddexp(la, lb))
    elif mutation == "full_diagonal":
        cpmod.block_plan = lambda *a: [[(qi, kj, "full") for qi, kj, _ in step]
                                       for step in saved[1](*a)]
    try:
        return _run(layout)
    finally:
        cpmod.merge_attention, cpmod.block_plan = saved


def _block(layout: str) -> dict:
    """A whole transformer layer on a sequence shard: outputs, input and weight grads."""
    comm = Comm(dim="cp")
    r, n = comm.rank, comm.size
    torch.manual_seed(0)
    ref = Block(BLOCK_CFG)
    block = copy.deepcopy(ref)
    block.attn.core = RingAttention(comm, layout)  # what a plan entry does: a submodule
    g = torch.Generator().manual_seed(3)
    x, w = (torch.randn(B, S, BLOCK_CFG.d_model, generator=g) for _ in range(2))
    x_full = x.clone().requires_grad_()
    out_full = ref(x_full)
    (out_full * w).sum().backward()  # a loss that is a sum over tokens, like the LM loss
    x_mine = shard_sequence(x, r, n, layout).requires_grad_()
    out = block(x_mine)
    (out * shard_sequence(w, r, n, layout)).sum().backward()  # this rank's tokens' part
    params = dict(block.named_parameters())

    def worst_param_error() -> float:
        return max((params[k].grad - p.grad).abs().max().item()
                   for k, p in ref.named_parameters())

    unsummed = worst_param_error()
    for p in block.parameters():  # cp ranks hold the same weights: sum, as dp does
        comm.all_reduce(p.grad)
    return {"out": (out - shard_sequence(out_full, r, n, layout)).abs().max().item(),
            "dx": (x_mine.grad - shard_sequence(x_full.grad, r, n, layout)).abs().max().item(),
            "param_grads": worst_param_error(), "param_grads_unsummed": unsummed}


def _rank() -> dict:
    res = {layout: _run(layout) for layout in ("zigzag", "contiguous")}
    res["mutations"] = {m: _mutated(m, "zigzag") for m in MUTATIONS}
    res["bf16"] = _run("zigzag", dtype=torch.bfloat16)
    res["block"] = {layout: _block(layout) for layout in ("zigzag", "contiguous")}
    return res


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"cp{n}")
def ring(request):
    n = request.param
    return n, launch(_rank, n, timeout=120)


def _gathered(results: list[dict], layout: str) -> dict[str, torch.Tensor]:
    return {key: unshard_sequence([r[key] for r in results], layout, dim=2)
            for key in ("out", "dq", "dk", "dv")}


def _errors(got: dict, want: dict) -> dict[str, float]:
    return {key: (got[key] - want[key]).abs().max().item() for key in want}


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_attention_matches_single_device(ring, layout):
    n, res = ring
    got = _gathered([r[layout] for r in res], layout)
    err = _errors(got, _reference())
    assert err["out"] <= OUT_TOL, err
    for r in res:  # the in-process gather (all_gather on cp) puts tokens back the same way
        assert torch.equal(r[layout]["gathered"], got["out"])
    assert max(err["dq"], err["dk"], err["dv"]) <= GRAD_TOL, err


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_counted_ring_bytes_equal_theory(ring, layout):
    n, res = ring
    want = ring_bytes(B, S, H * HD, n, bytes_per_element=4)
    for r in res:
        for phase in ("forward", "backward"):
            sends = r[layout][phase].get("send", {"calls": 0, "bytes": 0, "wire_bytes": 0})
            recvs = r[layout][phase].get("recv", {"calls": 0, "bytes": 0, "wire_bytes": 0})
            assert (sends["calls"], sends["bytes"]) == (want[phase]["calls"],
                                                        want[phase]["bytes"])
            assert sends["wire_bytes"] == sends["bytes"]
            assert (recvs["calls"], recvs["bytes"], recvs["wire_bytes"]) == (
                sends["calls"], sends["bytes"], 0)
            assert set(r[layout][phase]) <= {"send", "recv"}  # nothing else on cp


def test_mutations_fail_the_check(ring):
    n, res = ring
    want = _reference()
    for mutation in MUTATIONS:
        if mutation == "wrong_layout" and n == 1:  # one rank: both layouts hold 0 and 1
            assert chunk_ids(0, 1, "zigzag") == chunk_ids(0, 1, "contiguous")
            continue
        if mutation == "no_lse_correction" and n == 1:  # one causal call: nothing merges
            assert ring_plan(0, 1) == [[RingCall(0, 2, 0, 2, True)]]
            continue
        layout = "contiguous" if mutation == "wrong_layout" else "zigzag"
        err = _errors(_gathered([r["mutations"][mutation] for r in res], layout), want)
        assert max(err.values()) > 1e-2, (mutation, err)


def test_ring_attention_module_refuses_dropout_and_bad_layout():
    fake = type("FakeComm", (), {"size": 1, "rank": 0})()
    with pytest.raises(ValueError, match="layout"):
        RingAttention(fake, "striped")
    module = RingAttention(fake, dropout=0.1)
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(NotImplementedError, match="dropout"):
        module.core(q, q, q)
    module.eval()
    torch.testing.assert_close(module.core(q, q, q),
                               F.scaled_dot_product_attention(q, q, q, is_causal=True))
    with pytest.raises(ValueError, match="even"):
        ring_attention(q[:, :, :3], q[:, :, :3], q[:, :, :3], fake)


def test_bf16_ring_sends_16_bit_blocks_and_fp32_gradient_accumulators(ring):
    n, res = ring
    err = _errors(_gathered([r["bf16"] for r in res], "zigzag"), _reference())
    assert max(err.values()) <= BF16_TOL, err
    want = ring_bytes(B, S, H * HD, n, bytes_per_element=2, grad_bytes=4)
    for r in res:
        for phase in ("forward", "backward"):
            sends = r["bf16"][phase].get("send", {"calls": 0, "bytes": 0})
            assert (sends["calls"], sends["bytes"]) == (want[phase]["calls"],
                                                        want[phase]["bytes"])


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_a_transformer_layer_on_a_sequence_shard(ring, layout):
    """The integration in small: one Block, its attention core replaced by the ring.

    Outputs and input gradients are per token and match the reference's shard; weight
    gradients match once summed over the cp group (each rank saw only its tokens).
    """
    n, res = ring
    for r in res:
        got = r["block"][layout]
        assert max(got["out"], got["dx"]) <= BLOCK_TOL, got
        assert got["param_grads"] <= BLOCK_PARAM_TOL, got
        if n > 1:  # the mutation: a rank's own weight gradient is only its tokens' part
            assert got["param_grads_unsummed"] > 1e-2, got


def test_overlap_condition():
    # compute of two (t/2)^2 blocks equals the transfer of t tokens' k|v exactly at t
    f, bw, e = 1e12, 1e10, 2
    t = min_local_tokens_to_hide_ring(f, bw, e)
    assert t == 200
    flops, nbytes = 2 * t * t * 16, 2 * t * 16 * e  # b = 1, w = 16
    assert flops / f == pytest.approx(nbytes / bw)

