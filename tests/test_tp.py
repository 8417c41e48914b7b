"""Tensor parallelism (minipar.parallel.tp) against the single-device reference.

Parity tolerance: fp32 everywhere; tensor parallelism changes only the order of some sums
(partial products all-reduced, a max-shifted softmax), so losses must agree within 1e-5
(absolute, losses are about 4) and every gathered gradient within 1e-5 of its largest
entry. Dropout masks are keyed by global position (``KeyedDropout``): a sequence shard
draws one device's mask for its positions, so the dropout variants are held to the same
tolerance.
"""

from __future__ import annotations

import copy
import types
from collections import Counter

import pytest
import torch

from minipar.comm import Comm
from minipar.data import MarkovData
from minipar.launch import launch
from minipar.meter import saved_tensor_elements
from minipar.model import GPT, PRESETS, GPTConfig
from minipar.parallel.tp import (
    ColwiseParallel,
    RowwiseParallel,
    Split,
    apply_tensor_parallel,
    check_tp,
    describe_plan,
    gather_tensor,
    param_splits,
    shard_tensor,
    sync_sequence_parallel_grads,
    tensor_parallel_plan,
    tp_shard_dim,
    unshard,
)
from minipar.theory.activations import activation_elements_per_layer

# Small enough for 2 busy cores, divisible enough for tp = 8 (heads, d, d_ff, V, s).
CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=8, d_model=32)
LOSS_TOL = 1e-5
GRAD_TOL = 1e-5
VARIANTS = [(sp, dropout, tied) for sp in (False, True) for dropout in (0.0, 0.1)
            for tied in (False, True)]


# --- pure functions --------------------------------------------------------------------

@pytest.mark.parametrize("change, tp, sp, word", [
    ({"n_head": 6, "d_model": 48}, 4, False, "n_head"),
    ({"d_ff": 130}, 4, False, "d_ff"),
    ({"vocab_size": 66}, 4, False, "vocab_size"),
    ({"seq_len": 18}, 4, True, "seq_len"),
    ({}, 0, False, "positive"),
])
def test_check_tp_rejects_with_one_line(change, tp, sp, word):
    with pytest.raises(ValueError, match=word) as err:
        check_tp(CFG.with_(**change), tp, sp)
    assert "\n" not in str(err.value)


def test_check_tp_accepts_and_apply_checks_first():
    for tp in (1, 2, 4, 8):
        check_tp(PRESETS["tiny"], tp, sequence_parallel=True)
    check_tp(CFG.with_(seq_len=18), 4, sequence_parallel=False)  # s matters only with SP
    fake = types.SimpleNamespace(size=3, rank=0)  # refused before any communication
    with pytest.raises(ValueError, match="tp=3"):
        apply_tensor_parallel(GPT(CFG), fake)


def test_the_plan_is_printable_and_replaces_submodules_only():
    """Applied as torchtitan's parallelize_module: pattern -> style, printed for a learner;
    the model stays a GPT (no class swap), every parameter keeps its reference name."""
    text = describe_plan(tensor_parallel_plan(sequence_parallel=True))
    assert "blocks.*.mlp.fc" in text and "ColwiseParallel(input_layouts=Shard(dim=1)" in text
    assert "loss_fn" in text and "VocabParallelLoss" in text
    names = launch(_plan_rank, 2, timeout=60)
    assert names[0] == names[1] == [n for n, _ in GPT(CFG).named_parameters()]


def _plan_rank() -> list[str]:
    model = apply_tensor_parallel(GPT(CFG.with_(tie_embeddings=True)), Comm(), True)
    assert type(model) is GPT and model.head.weight is model.tok_emb.weight
    assert type(model.blocks[0].mlp.fc).__name__ == "ColumnParallelLinear"
    return [n for n, _ in apply_tensor_parallel(GPT(CFG), Comm()).named_parameters()]


def test_shard_dims_by_name():
    assert tp_shard_dim("blocks.3.mlp.fc.weight") == 0
    assert tp_shard_dim("module.blocks.0.attn.proj.weight") == 1  # prefixes ignored
    assert tp_shard_dim("blocks.0.attn.proj.bias") is None  # added after the reduction
    assert tp_shard_dim("ln_f.weight") is None and tp_shard_dim("pos_emb.weight") is None
    assert tp_shard_dim("xhead.weight") is None  # whole path components only


def test_the_plan_states_every_split():
    """The plan is the one statement of how a parameter is split: Megatron's split of
    every weight of a GPT, read off the styles (the fused q|k|v in three parts)."""
    splits = param_splits(GPT(CFG, device="meta"), tensor_parallel_plan())
    want = {"tok_emb.weight": Split(0), "head.weight": Split(0)}
    for i in range(CFG.n_layer):
        b = f"blocks.{i}."
        want |= {b + "attn.qkv.weight": Split(0, 3), b + "attn.qkv.bias": Split(0, 3),
                 b + "attn.proj.weight": Split(1), b + "mlp.fc.weight": Split(0),
                 b + "mlp.fc.bias": Split(0), b + "mlp.proj.weight": Split(1)}
    assert splits == want


def test_styles_mean_what_torchs_mean():
    """torch's names, defaults and layouts; what minipar cannot do is refused in one line
    rather than done differently (no DTensor outputs, no all-gathered column output)."""
    from torch.distributed.tensor import Replicate, Shard

    col, row = ColwiseParallel(), RowwiseParallel()
    assert (col.input_layouts, col.output_layouts) == (Replicate(), Shard(-1))
    assert (row.input_layouts, row.output_layouts) == (Shard(-1), Replicate())
    with pytest.raises(ValueError, match="use_local_output"):
        ColwiseParallel(use_local_output=False)
    with pytest.raises(ValueError, match="output_layouts"):
        ColwiseParallel(output_layouts=Replicate())
    with pytest.raises(ValueError, match="input_layouts"):  # torchtitan writes Replicate()
        RowwiseParallel().param_splits(torch.nn.Embedding(8, 4))
    assert RowwiseParallel(input_layouts=Replicate()).param_splits(
        torch.nn.Embedding(8, 4)) == {"weight": Split(0)}


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_shard_unshard_round_trip(tp):
    model = GPT(CFG)
    for name, full in model.state_dict().items():
        shards = [shard_tensor(name, full, r, tp) for r in range(tp)]
        assert torch.equal(unshard(name, shards), full), name
        if tp_shard_dim(name) is not None:
            assert shards[0].numel() * tp == full.numel(), name


def test_qkv_shard_holds_whole_heads():
    d, tp, hd = CFG.d_model, 4, CFG.head_dim
    w = GPT(CFG).blocks[0].attn.qkv.weight.detach()
    heads = CFG.n_head // tp
    for r in range(tp):
        rows = [w[part * d + r * heads * hd: part * d + (r + 1) * heads * hd]
                for part in range(3)]  # this rank's heads of q, then of k, then of v
        assert torch.equal(shard_tensor("blocks.0.attn.qkv.weight", w, r, tp),
                           torch.cat(rows))


# --- parity with the single device -------------------------------------------------------

def _parity_rank(variants, steps):
    comm, out = Comm(), []
    for sp, dropout, tied in variants:
        cfg = CFG.with_(dropout=dropout, tie_embeddings=tied)
        torch.manual_seed(0)
        ref = GPT(cfg)
        model = apply_tensor_parallel(copy.deepcopy(ref), comm, sp)
        full = dict(ref.named_parameters())
        starts_equal = all(torch.equal(p, shard_tensor(n, full[n], comm.rank, comm.size))
                           for n, p in model.named_parameters())
        # SGD, not Adam: Adam's m / sqrt(v) turns a 1e-9 sign flip of a near-zero
        # gradient into a full learning-rate step, which says nothing about TP.
        opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
        data = MarkovData(cfg.vocab_size, cfg.seq_len, seed=0)
        rec = {"variant": (sp, dropout, tied), "starts_equal": starts_equal,
               "loss_err": 0.0, "grad_err": 0.0, "norm_err": 0.0}
        for step in range(steps):
            x, y = data.batch(step, 4)
            if step == 0:  # dropout must really act (else the variant tests nothing)
                with torch.no_grad():
                    rec["eval_loss"] = ref.eval()(x, y).item()
                ref.train()
            torch.manual_seed(100 + step)  # the same dropout keys for both
            loss_ref = ref(x, y)
            loss_ref.backward()
            torch.manual_seed(100 + step)
            loss = model(x, y)
            loss.backward()
            sync_sequence_parallel_grads(model, comm)
            if step == 0:
                rec["train_loss"] = loss.item()
            rec["loss_err"] = max(rec["loss_err"], abs(loss.item() - loss_ref.item()))
            norm_sq = 0.0
            for name, p in model.named_parameters():
                g, g_ref = gather_tensor(name, p.grad, comm), full[name].grad
                err = (g - g_ref).abs().max() / g_ref.abs().max()
                rec["grad_err"] = max(rec["grad_err"], err.item())
                norm_sq += g.pow(2).sum()
            ref_sq = sum(p.grad.pow(2).sum() for p in ref.parameters())
            rec["norm_err"] = max(rec["norm_err"], abs(norm_sq.item() / ref_sq.item() - 1))
            for opt in opts:
                opt.step()
                opt.zero_grad()
        out.append(rec)
    return out


def _check_parity(results):
    for rank_results in results:
        for rec in rank_results:
            what = f"variant (sp, dropout, tied)={rec['variant']}"
            assert rec["starts_equal"], what
            assert rec["loss_err"] < LOSS_TOL, (what, rec)
            assert rec["grad_err"] < GRAD_TOL, (what, rec)
            assert rec["norm_err"] < 1e-5, (what, rec)
            if rec["variant"][1] > 0:
                assert abs(rec["train_loss"] - rec["eval_loss"]) > 1e-3, (what, rec)


# tp 4 (make test-full): the same sharding as tp 2, on 4 ranks; test_engine.py keeps tp 4
# with sequence parallelism in make test.
@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_parity_with_single_device(tp):
    _check_parity(launch(_parity_rank, tp, args=(VARIANTS, 3), timeout=90))


@pytest.mark.slow
def test_parity_tp8():
    _check_parity(launch(_parity_rank, 8, args=(VARIANTS, 3), timeout=300))


# --- pipeline stages use the parts ----------------------------------------------------------

def _stages_rank(sp):
    comm = Comm()
    torch.manual_seed(0)
    model = apply_tensor_parallel(GPT(CFG), comm, sp)
    x, y = MarkovData(CFG.vocab_size, CFG.seq_len).batch(0, 2)
    h = model.embed(x)  # stage 0: embed + first block
    h = model.blocks[0](h)
    boundary = tuple(h.shape)  # what a pipeline sends between stages
    for block in model.blocks[1:]:  # last stage: other blocks, norm, head, loss
        h = block(h)
    logits = model.logits(h)
    split = model.loss(logits, y).item()
    return boundary, tuple(logits.shape), split, model(x, y).item()


@pytest.mark.parametrize("sp", [False, True])
def test_parts_work_as_pipeline_stages(sp):
    tp = 2
    for boundary, logits, split, whole in launch(_stages_rank, tp, args=(sp,), timeout=60):
        assert boundary == (2, CFG.seq_len // tp if sp else CFG.seq_len, CFG.d_model)
        assert logits == (2, CFG.seq_len, CFG.vocab_size // tp)  # vocab shard only
        assert split == whole


# --- communication: count and bytes per layer ------------------------------------------------

def expected_collectives(cfg, b, tp, sp, n_replicated):
    """Per training step (forward + backward), fp32: Megatron section 3 and Korthikanti
    section 4.2.2. Each [b, s, h] collective carries S = 4bsh bytes (all-gather: its
    output; reduce-scatter and all-reduce: their input).

    Without SP: embedding g (1 all-reduce fwd); per layer g twice fwd, f twice bwd
    (4 all-reduces); head f (1 bwd). With SP: embedding reduce-scatter fwd, all-gather
    bwd; per layer 2 all-gathers + 2 reduce-scatters fwd, and bwd 2 reduce-scatters
    (of the all-gathers), 2 all-gathers (of the reduce-scatters), 2 re-gathers of the
    column inputs; head all-gather fwd, re-gather and reduce-scatter bwd; then one flat
    all-reduce of the replicated parameters' gradients. Loss: 3 all-reduces of [b*s].
    """
    if tp == 1:
        return Counter()
    big, tokens, layers = 4 * b * cfg.seq_len * cfg.d_model, 4 * b * cfg.seq_len, cfg.n_layer
    out = Counter({("all_reduce", tokens): 3})
    if sp:
        out[("all_gather", big)] = 1 + 6 * layers + 2
        out[("reduce_scatter", big)] = 1 + 4 * layers + 1
        out[("all_reduce", 4 * n_replicated)] = 1
    else:
        out[("all_reduce", big)] = 1 + 4 * layers + 1
    return out


def _comm_rank(sp, b):
    comm, out = Comm(), {}
    for n_layer in (1, 3):
        cfg = CFG.with_(n_layer=n_layer)
        model = apply_tensor_parallel(GPT(cfg), comm, sp)
        x, y = MarkovData(cfg.vocab_size, cfg.seq_len).batch(0, b)
        comm.log.clear()
        model(x, y).backward()
        sync_sequence_parallel_grads(model, comm)
        replicated = sum(p.numel() for n, p in model.named_parameters()
                         if tp_shard_dim(n) is None)
        out[n_layer] = (Counter((r.op, r.nbytes) for r in comm.log.records), replicated)
    return out


@pytest.mark.parametrize("tp, sp", [(2, False), (2, True), (4, True)])
def test_collectives_match_theory(tp, sp):
    b = 2
    results = launch(_comm_rank, tp, args=(sp, b), timeout=60)
    assert all(r == results[0] for r in results)  # every tp rank does the same
    for n_layer, (counts, replicated) in results[0].items():
        cfg = CFG.with_(n_layer=n_layer)
        assert counts == expected_collectives(cfg, b, tp, sp, replicated), n_layer
    # Per layer, from the difference of two depths: the all-reduce of each sublayer's
    # forward and backward, or with SP their all-gather / reduce-scatter halves plus the
    # re-gather of each column linear's input in backward.
    big = 4 * b * CFG.seq_len * CFG.d_model
    per_layer = {op: (results[0][3][0][(op, big)] - results[0][1][0][(op, big)]) // 2
                 for op in ("all_reduce", "all_gather", "reduce_scatter")}
    assert per_layer == ({"all_reduce": 0, "all_gather": 6, "reduce_scatter": 4} if sp
                         else {"all_reduce": 4, "all_gather": 0, "reduce_scatter": 0})



# --- SP's collectives along the sequence of [b, s, h] ----------------------------------------

def _sequence_collectives_rank():
    comm = Comm()
    torch.manual_seed(comm.rank)  # a different partial sum on every rank
    full = torch.randn(3, 4 * comm.size, 5).to(torch.bfloat16)
    shard = torch.randn(3, 4, 5).to(torch.bfloat16)
    comm.log.clear()
    out = {"full": full, "shard": shard,
           "rs_1": comm.reduce_scatter(full, dim=1), "rs_m2": comm.reduce_scatter(full, dim=-2),
           "ag_1": comm.all_gather(shard, dim=1)}
    out["records"] = [(r.op, r.nbytes, r.dtype) for r in comm.log.records]
    return out


def test_sequence_dim_collectives_are_exact():
    """The sequence-dim reduce-scatter / all-gather of SP (b > 1, so a sequence slice is
    not contiguous): values as a reduce along dim 1 then a slice, bf16 kept, the bytes
    counted as the theory counts them (input for reduce-scatter, output for all-gather)."""
    tp = 2
    results = launch(_sequence_collectives_rank, tp, timeout=60)
    total = sum(r["full"].float() for r in results)
    gathered = torch.cat([r["shard"] for r in results], dim=1)
    for rank, r in enumerate(results):
        mine = total.chunk(tp, dim=1)[rank]
        assert r["rs_1"].dtype == torch.bfloat16 and r["rs_1"].shape == (3, 4, 5)
        assert torch.allclose(r["rs_1"].float(), mine, atol=0.05)
        assert torch.equal(r["rs_1"], r["rs_m2"])
        assert torch.equal(r["ag_1"], gathered)
        big = 3 * 4 * tp * 5 * 2
        assert r["records"] == [("reduce_scatter", big, "bfloat16")] * 2 + [
            ("all_gather", big, "bfloat16")]


# --- activation memory: measured saved tensors against the derived formula ------------------

def _memory_rank(cfg, b):
    comm, out = Comm(), {}
    for sp in (False, True):
        torch.manual_seed(0)
        model = apply_tensor_parallel(GPT(cfg), comm, sp)
        s = cfg.seq_len // comm.size if sp else cfg.seq_len
        x = torch.randn(b, s, cfg.d_model, requires_grad=True)  # the block's input
        out[sp] = saved_tensor_elements(lambda m=model, x=x: m.blocks[0](x), model.parameters())
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_activation_memory(tp):
    cfg, b = CFG.with_(seq_len=32, d_model=64, n_layer=1), 4
    measured = launch(_memory_rank, tp, args=(cfg, b), timeout=60)[0]
    derived = {sp: activation_elements_per_layer(cfg, b, tp, sp) for sp in (False, True)}
    for sp in (False, True):  # every saved tensor accounted for
        assert measured[sp] == pytest.approx(derived[sp], rel=0.01), (sp, measured, derived)
    ratio = measured[False] / measured[True]
    assert ratio == pytest.approx(derived[False] / derived[True], rel=0.01)
    # The reduction the paper predicts: what sat outside the tensor-parallel regions
    # (layer-norm inputs and outputs, 4sbh, plus their 4sb statistics) is divided by t.
    s, h = cfg.seq_len, cfg.d_model
    saved = measured[False] - measured[True]
    assert saved == pytest.approx((4 * s * b * h + 4 * s * b) * (1 - 1 / tp), rel=0.01)
