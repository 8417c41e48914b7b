"""The theory against the papers' own numbers, the syllabus's examples, and real runs.

Published figures are quoted with the paper and the place they appear; where the
papers round, the comparison rounds the same way. Model-state bytes are compared
exactly with what a real (tiny) model and optimizer hold.
"""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch

from minipar.comm import Comm
from minipar.config import TrainConfig
from minipar.data import MarkovData
from minipar.launch import launch
from minipar.model import GPT, PRESETS, GPTConfig
from minipar.parallel.pp import partition_layers
from minipar.parallel.schedules import make_schedule
from minipar.parallel.tp import (
    apply_tensor_parallel,
    shard_tensor,
    sync_sequence_parallel_grads,
    tp_shard_dim,
)
from minipar.theory.activations import activation_elements_per_layer
from minipar.theory.bubble import bubble_fraction_formula, peak_in_flight
from minipar.theory.clusters import GPUS
from minipar.theory.comm_volume import comm_volume, dp_volume, total_wire_bytes
from minipar.theory.examples import gpt3_memory_claims
from minipar.theory.layout import Layout
from minipar.theory.memory import (
    buffers_in_flight,
    edge_activations,
    inflight,
    layer_activations,
    memory_breakdown,
    memory_per_stage,
    model_states,
    stage_activations,
    state_bytes,
)
from minipar.theory.models import get_model
from minipar.theory.params import (
    attention_flops_per_token,
    hardware_flops_per_token,
    head_layers_for,
    hfu,
    matmul_params,
    mfu,
    model_flops_per_token,
    narayanan_flops,
    param_count,
    param_table,
    stage_layers,
    stage_params,
    training_days,
)

GB = 1e9
TINY = PRESETS["tiny"]
# Korthikanti et al. 2022, Table 3 (a heads, h hidden, L layers; s = 2048) and GPT-3.
KORTHIKANTI_MODELS = {
    "22B": GPTConfig(vocab_size=51200, seq_len=2048, n_layer=48, n_head=64, d_model=6144),
    "175B": GPTConfig(vocab_size=51200, seq_len=2048, n_layer=96, n_head=96, d_model=12288),
    "530B": GPTConfig(vocab_size=51200, seq_len=2048, n_layer=105, n_head=128, d_model=20480),
    "1T": GPTConfig(vocab_size=51200, seq_len=2048, n_layer=128, n_head=160, d_model=25600),
}


# --- parameters -------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [TINY, PRESETS["small"], TINY.with_(tie_embeddings=True),
                                 TINY.with_(d_ff=96, n_layer=3)])
def test_param_count_is_exact(cfg):
    model = GPT(cfg)
    assert param_count(cfg) == model.num_params()
    named = dict(model.named_parameters())
    for p in param_table(cfg):  # every tensor: name and size as the model has them
        key = f"blocks.0.{p.name}" if p.where == "layer" else p.name
        if key == "head.weight" and cfg.tie_embeddings:
            key = "tok_emb.weight"
        assert named[key].numel() == p.numel, p.name
        assert (tp_shard_dim(key) is not None) == p.tp_split, p.name  # as tp.py splits


@pytest.mark.parametrize("name", ["gpt3-175b", "gpt-1t", "gpt-13b"])
def test_narayanan_parameter_formula(name):
    # Narayanan et al. 2021, Sec. 5.1: P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)),
    # tied head, d_ff = 4h; the final layer norm (2h) is the one thing it leaves out.
    cfg = PRESETS[name]
    l_, h, v, s = cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.seq_len
    formula = 12 * l_ * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l_ * h))
    assert param_count(cfg) == pytest.approx(formula + 2 * h, rel=1e-12)


def test_published_model_sizes():
    # GPT-3 "175B" (Brown et al. 2020) and Narayanan et al. Table 1's "1008B" model.
    assert param_count("gpt3-175b") / 1e9 == pytest.approx(175, rel=0.005)
    assert round(param_count("gpt-1t") / 1e9) == 1008


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_stage_params_match_tensor_parallel_shards(tp):
    """What tp.py's shard_tensor leaves on a rank is what stage_params predicts."""
    model = GPT(TINY)
    for rank in range(tp):
        held = sum(shard_tensor(n, p.detach(), rank, tp).numel()
                   for n, p in model.named_parameters())
        assert held == stage_params(TINY, pp=1, tp=tp)


@pytest.mark.parametrize("pp, virtual, k", [(2, 1, 0), (3, 1, 0), (4, 2, 0), (3, 2, 0),
                                            (4, 1, 2), (3, 2, 1)])
def test_stages_hold_every_parameter_once(pp, virtual, k):
    cfg = TINY.with_(n_layer=10)
    assert sum(stage_params(cfg, pp, 1, s, virtual, k) for s in range(pp)) == param_count(cfg)
    ranges = partition_layers(cfg.n_layer, pp * virtual, k)  # the pipeline's own split
    for s in range(pp):
        assert stage_layers(cfg.n_layer, pp, s, virtual, k) == sum(
            len(ranges[c]) for c in range(s, pp * virtual, pp))


def test_head_layers_balance_the_flops():
    """gpt-1.3b: the head and loss (6 V h a token) cost 1.76 layers: 2; gpt-13b 0.77: 1;
    a layer recomputed in full costs 4/3 as much, so the head weighs less."""
    assert head_layers_for("gpt-1.3b") == 2 and head_layers_for("gpt-13b") == 1
    assert head_layers_for("gpt-1.3b", "full") == 1


def test_tied_head_is_a_copy_on_the_last_stage():
    cfg = TINY.with_(tie_embeddings=True)
    total = sum(stage_params(cfg, 2, 1, s) for s in range(2))
    assert total == param_count(cfg) + cfg.vocab_size * cfg.d_model


# --- FLOPs --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt3-175b", "gpt-1t", "tiny"])
def test_flops_equal_narayanan(name):
    cfg, batch = PRESETS[name], 8
    tokens = batch * cfg.seq_len
    assert hardware_flops_per_token(cfg, "full") * tokens == pytest.approx(
        narayanan_flops(cfg, batch, recompute=True), rel=1e-12)
    assert model_flops_per_token(cfg) * tokens == pytest.approx(
        narayanan_flops(cfg, batch, recompute=False), rel=1e-12)


def test_flops_per_token_terms():
    cfg = PRESETS["gpt3-175b"]
    n, l_, s, h = matmul_params(cfg), cfg.n_layer, cfg.seq_len, cfg.d_model
    assert model_flops_per_token(cfg) == 6 * n + 12 * l_ * s * h  # PaLM, App. B
    assert attention_flops_per_token(cfg, "kaplan") * 2 == attention_flops_per_token(cfg)
    # full recomputation adds one forward of the layers: about a third more
    ratio = hardware_flops_per_token(cfg, "full") / model_flops_per_token(cfg)
    assert 1.3 < ratio < 4 / 3
    # at 1 token/s per GPU at peak 1 FLOP/s, MFU is the FLOPs per token
    assert mfu(1.0, cfg, 1, model_flops_per_token(cfg)) == pytest.approx(1.0)
    assert hfu(1.0, cfg, 1, 1.0, "full") / mfu(1.0, cfg, 1, 1.0) == pytest.approx(ratio)


def test_narayanan_training_times():
    # Sec. 5.1: GPT-3 on 300B tokens, 1024 A100s at 140 TFLOP/s: 34 days;
    # the 1T model on 450B tokens, 3072 A100s at 163 TFLOP/s: 84 days.
    assert round(training_days(175e9, 300e9, 1024, 140e12)) == 34
    assert round(training_days(param_count("gpt-1t"), 450e9, 3072, 163e12)) == 84


# --- model states: the ZeRO paper ------------------------------------------------------------

def test_zero_paper_figure_1():
    # Rajbhandari et al. 2019, Fig. 1: 7.5B parameters, N_d = 64, K = 12.
    published = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for zero, gb in published.items():
        mem = memory_breakdown(params=int(7.5e9), layout=Layout(dp=64, zero=zero))
        assert round(mem["total"] / GB, 1) == gb
        assert mem["activations"] == 0  # --params alone: model states only


def test_zero_paper_formulas_and_trillion_example():
    # Fig. 1's formulas for any N_d: (2+2+K) Psi; 2 Psi + 2 Psi + K Psi/N_d;
    # 2 Psi + (2+K) Psi/N_d; (2+2+K) Psi/N_d. Sec. 1: a trillion parameters on 1024
    # GPUs with all three stages need about 16 GB of model states per GPU (16 TB / 1024).
    psi, k = 10**9, 12
    for nd in (1, 4, 16, 256):
        got = [memory_breakdown(params=psi, layout=Layout(dp=nd, zero=z))["total"]
               for z in range(4)]
        assert got == [(4 + k) * psi, 4 * psi + k * psi // nd,
                       2 * psi + (2 + k) * psi // nd, (4 + k) * psi // nd]
    trillion = memory_breakdown(params=10**12, layout=Layout(dp=1024, zero=3))
    assert trillion["total"] / GB == pytest.approx(16, rel=0.03)


def test_bytes_per_parameter():
    assert state_bytes("bf16", "adam") == (2, 2, 12)  # the ZeRO paper's 2 + 2 + K
    assert state_bytes("fp32", "adamw") == (4, 4, 8)
    assert state_bytes("fp32", "sgd") == (4, 4, 0)
    assert state_bytes("bf16", "sgd-momentum") == (2, 2, 8)
    with pytest.raises(ValueError, match="optimizer"):
        state_bytes("bf16", "lion")


def test_zero_shards_are_padded_to_dp():
    st = model_states(10, dp=4, zero=3, dtype="fp32", optimizer="adam")
    assert st == {"params": 3 * 4, "grads": 3 * 4, "optimizer": 3 * 8}


def test_model_states_equal_a_real_run():
    """A tiny fp32 model after one AdamW step holds exactly the predicted bytes
    (Adam's 0-dim step counters, 4 bytes per tensor, are left out of the theory)."""
    model = GPT(TINY)
    opt = torch.optim.AdamW(model.parameters())
    x, y = MarkovData(TINY.vocab_size, TINY.seq_len).batch(0, 2)
    model(x, y).backward()
    opt.step()
    held = {
        "params": sum(p.numel() * p.element_size() for p in model.parameters()),
        "grads": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()),
        "optimizer": sum(v.numel() * v.element_size() for s in opt.state.values()
                         for v in s.values() if v.dim() > 0),
    }
    mem = memory_breakdown(TINY, Layout(dtype="fp32", optimizer="adamw"))
    assert {k: mem[k] for k in held} == held


# --- activations: Korthikanti et al. 2022 ----------------------------------------------------

def _table2(cfg, b, t, sp, recompute):
    """The paper's Table 2, per layer, in bytes."""
    s, h, a = cfg.seq_len, cfg.d_model, cfg.n_head
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh
    if recompute == "selective":
        return sbh * 34 / t if sp else sbh * (10 + 24 / t)
    if sp:
        return sbh * (34 / t + 5 * a * s / (h * t))
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize("name", list(KORTHIKANTI_MODELS))
@pytest.mark.parametrize("t", [1, 2, 8])
@pytest.mark.parametrize("sp, recompute", [(False, "none"), (True, "none"),
                                           (False, "selective"), (True, "selective"),
                                           (False, "full")])
def test_korthikanti_table_2(name, t, sp, recompute):
    cfg, b = KORTHIKANTI_MODELS[name], 2
    got = sum(layer_activations(cfg, b, t, sp, recompute, "bf16").values())
    assert got == pytest.approx(_table2(cfg, b, t, sp, recompute), rel=1e-12)


def test_korthikanti_no_parallelism_and_general_ffn():
    cfg = KORTHIKANTI_MODELS["22B"]
    s, b, h, a = cfg.seq_len, 1, cfg.d_model, cfg.n_head
    assert sum(layer_activations(cfg, b).values()) == pytest.approx(
        s * b * h * (34 + 5 * a * s / h), rel=1e-12)
    # Megatron's estimator for any d_ff with sp + selective: sbh (18 + 4 f/h) / t
    wide = cfg.with_(d_ff=3 * h)
    got = sum(layer_activations(wide, b, 8, True, "selective").values())
    assert got == pytest.approx(s * b * h * (18 + 4 * 3) / 8)


def test_korthikanti_section_5_numbers():
    # "5as/h = 80" for GPT-3; selective recomputation then saves 70% of the activations
    # (GPT-3) and 65% (MT-NLG 530B).
    gpt3, mtnlg = KORTHIKANTI_MODELS["175B"], KORTHIKANTI_MODELS["530B"]
    assert 5 * gpt3.n_head * gpt3.seq_len / gpt3.d_model == 80
    for cfg, pct in ((gpt3, 70), (mtnlg, 65)):
        full = sum(layer_activations(cfg).values())
        sel = sum(layer_activations(cfg, recompute="selective").values())
        assert round(100 * (1 - sel / full)) == pct


def test_korthikanti_five_fold_reduction():
    # Abstract: sequence parallelism + selective recomputation cut activation memory
    # about 5x against tensor parallelism alone (t = 8 for all Table 3 models).
    ratios = [sum(layer_activations(c, 1, 8).values())
              / sum(layer_activations(c, 1, 8, True, "selective").values())
              for c in KORTHIKANTI_MODELS.values()]
    assert all(4.5 < r < 6.5 for r in ratios), ratios
    assert sum(ratios) / len(ratios) == pytest.approx(5, abs=0.6)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_pipeline_first_stage_holds_all_layers(pp):
    """Sec. 4.2.3: with 1F1B the first stage keeps p micro-batches of L/p layers: L
    layers' worth; interleaving multiplies that by 1 + (p-1)/(pv); GPipe keeps m."""
    cfg, m = KORTHIKANTI_MODELS["22B"].with_(n_layer=32), 2 * pp
    per_layer = sum(layer_activations(cfg, 1, 8, True, "selective").values())
    first = sum(edge_activations(cfg, "first", 1, 8, True).values())

    def layers_part(schedule, v=1):
        total = stage_activations(cfg, Layout(pp=pp, tp=8, microbatches=m, schedule=schedule,
                                              virtual=v, sp=True, recompute="selective"))
        return total - first * math.ceil(inflight(schedule, pp, m, 0, v) / v)

    assert layers_part("1f1b") == pytest.approx(per_layer * cfg.n_layer)
    assert layers_part("interleaved", 2) == pytest.approx(
        per_layer * cfg.n_layer * (1 + (pp - 1) / (pp * 2)))
    assert layers_part("gpipe") == pytest.approx(per_layer * cfg.n_layer / pp * m)


def test_embedding_and_output_terms():
    # Sec. 4.3: embedding dropout sbhp/t on the first stage (p micro-batches in flight),
    # 4sbh/t (1 + v/h) for the output layer when p = 1.
    cfg, t, b = KORTHIKANTI_MODELS["22B"], 8, 1
    s, h, v = cfg.seq_len, cfg.d_model, cfg.vocab_size
    last = sum(edge_activations(cfg, "last", b, t, True).values())
    assert last == pytest.approx(4 * s * b * h / t * (1 + v / h))
    first = edge_activations(cfg, "first", b, t, True)
    assert first["embedding dropout mask"] * 4 == s * b * h * 4 / t


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                               ("interleaved", 3), ("zb", 1),
                                               ("interleaved-zb", 2), ("interleaved-zb", 3)])
@pytest.mark.parametrize("pp", [2, 4])
def test_inflight_matches_the_schedules(schedule, virtual, pp):
    """The formula agrees with the peak counted from the executed action lists."""
    for m in (pp, 2 * pp, 3 * pp):
        peaks = peak_in_flight(make_schedule(schedule, pp, m, virtual))
        assert peaks == [inflight(schedule, pp, m, s, virtual) for s in range(pp)]


@pytest.mark.parametrize("schedule, virtual", [("zb", 1), ("interleaved-zb", 2),
                                               ("interleaved-zb", 3)])
def test_the_fullest_moment_of_a_split_backward_is_the_schedules_own(schedule, virtual):
    """``split_in_flight``'s (deferred, whole) pair is the fullest moment of a walk along
    each stage's action list: before every B, the chunks whose B ran and whose W has not
    (each keeping a fraction of a whole one) and those whose F ran and whose B has not.
    For every pp, m and kept share, no B finds the stage fuller; and ``split_moment``,
    the closed form the planner uses past 8 stages, is one of the walk's moments."""
    from minipar.theory.memory import split_in_flight, split_moment, split_moments

    step = 1 if schedule == "zb" else None
    for pp in (2, 3, 4, 6, 8):
        for m in range(step or pp, 4 * pp + 1, step or pp):
            actions = make_schedule(schedule, pp, m, virtual)
            for stage in range(pp):
                pairs, busy, done = set(), 0, 0
                for a in actions[stage]:
                    busy += a.kind == "F"
                    if a.kind == "B":
                        pairs.add((done, busy))
                        busy, done = busy - 1, done + 1
                    done -= a.kind == "W"
                got = split_in_flight(schedule, pp, m, stage, virtual)
                assert got in pairs, (pp, m, stage, got)
                # the same moment chunk by chunk (past 8 stages the planner's one)
                assert split_moment(schedule, pp, m, stage, virtual) in split_moments(
                    schedule, pp, m, stage, virtual), (pp, m, stage)
                for kept in (0.1, 0.5, 0.9):
                    assert max(d * kept + b for d, b in pairs) == pytest.approx(
                        got[0] * kept + got[1]), (pp, m, stage, kept)


@pytest.mark.parametrize("schedule, virtual", [("zb", 1), ("interleaved-zb", 2)])
def test_a_split_backward_stage_of_the_head_alone_is_priced(schedule, virtual):
    """``--head-layers`` may leave the last stage no block (8 layers, pp 4, head 2: 3, 3,
    2 and 0): under a split backward it keeps no block's inputs for W, only the head's
    logits gradient, and is priced, not divided by its zero blocks (interleaved: 14
    layers in 8 chunks, the last of them empty)."""
    cfg = TINY.with_(n_layer=8 if virtual == 1 else 14)
    layout = Layout(pp=4, microbatches=8, schedule=schedule, virtual=virtual, head_layers=2)
    assert not partition_layers(cfg.n_layer, 4 * virtual, 2)[-1]
    for accounting in ("korthikanti", "fused"):  # (fused: what card_peak prices)
        rows = memory_per_stage(cfg, layout, accounting=accounting)
        assert len(rows) == 4 and all(r["total"] > 0 for r in rows)
        assert rows[-1]["total"] < rows[0]["total"]


@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True), (4, True)])
def test_fused_accounting_matches_tensor_parallel_count(tp, sp):
    """tp.py derives (and measures) the saved tensors of its layers; same total."""
    got = sum(layer_activations(TINY, 3, tp, sp, "none", "fp32", "fused").values())
    assert got == activation_elements_per_layer(TINY, 3, tp, sp) * 4


def test_a_run_and_the_theory_describe_it_with_one_layout():
    """``TrainConfig.layout`` passes on every field the two share: a field added to both
    and not passed on keeps the ``Layout`` default, which no value below has. A
    micro-batch is batch / (dp x micro-batches); ``with_batch`` goes the other way. The
    optimizer's kernel is the run's (``config.optimizer_kernel``): the host's under
    offload; so is compilation (``config.use_compile``)."""
    shared = {f.name for f in fields(Layout)} & {f.name for f in fields(TrainConfig)}
    derived = {"microbatch_size", "optimizer_kernel", "compiled"}
    assert shared == {f.name for f in fields(Layout)} - derived
    run = dict(dp=2, pp=2, tp=2, cp=2, ep=2, zero=3, microbatches=4, schedule="interleaved",
               virtual=2, head_layers=1, sp=True, recompute="full", recompute_layers=3,
               recompute_rest="cheap", offload=True, dtype="fp32", optimizer="sgd",
               grad_dtype="bf16", separate_reduce_group=True,
               fp8="tensorwise", order="pp-inside-dp", chunked_loss=True)
    assert set(run) == shared and all(v != getattr(Layout(), k) for k, v in run.items())
    layout = TrainConfig(batch_size=64, compile=True, **run).layout()
    want = Layout(microbatch_size=8, optimizer_kernel="host", compiled=True, **run)
    assert layout == want and layout.global_batch == 64
    assert not TrainConfig(**run).layout().compiled  # CPU: eager unless asked
    assert {layout: 1}[want] == 1  # frozen: a cache key
    assert Layout(dp=2, microbatch_size=2).with_batch(16).microbatches == 4
    with pytest.raises(ValueError, match="not divisible"):
        Layout(dp=3).with_batch(16)


def test_memory_breakdown_keys_and_most_loaded_stage():
    layout = Layout(dp=2, pp=4, tp=2, zero=1, microbatches=8, sp=True)
    mem = memory_breakdown("tiny", layout)
    stages = memory_per_stage("tiny", layout)
    assert mem["total"] == max(s["total"] for s in stages)
    for row in stages:
        assert row["total"] == sum(row[k] for k in ("params", "grads", "optimizer",
                                                    "activations"))
    with pytest.raises(ValueError, match="tp=3"):
        memory_breakdown("tiny", Layout(tp=3))


# --- communication volume ----------------------------------------------------------------

def test_zero_traffic_relative_to_data_parallel():
    # ZeRO paper Sec. 7: stages 1 and 2 move what data parallelism moves; stage 3 1.5x.
    n, dp = 1_000_000, 8
    base = total_wire_bytes(dp_volume(n, dp, 0))
    assert total_wire_bytes(dp_volume(n, dp, 1)) == base
    assert total_wire_bytes(dp_volume(n, dp, 2)) == base
    assert total_wire_bytes(dp_volume(n, dp, 3)) == pytest.approx(1.5 * base)
    assert base == 2 * (dp - 1) * n * 2 // dp  # ring all-reduce of bf16 gradients


def test_pipeline_traffic():
    vol = comm_volume("tiny", Layout(pp=4, microbatch_size=2, microbatches=8, dtype="fp32"),
                      stage=1)
    act = 2 * TINY.seq_len * TINY.d_model * 4
    assert vol["pp"]["send"] == {"calls": 16, "bytes": 16 * act, "wire_bytes": 16 * act}
    first = comm_volume("tiny", Layout(pp=4, microbatches=8, virtual=2, schedule="interleaved"),
                        stage=0)
    assert first["pp"]["send"]["calls"] == 8 * (2 + 1)  # two chunks forward, one back


def _tp_comm_rank(sp, b):
    cfg = TINY.with_(n_layer=2)
    comm = Comm(dim="tp")
    model = apply_tensor_parallel(GPT(cfg), comm, sp)
    x, y = MarkovData(cfg.vocab_size, cfg.seq_len).batch(0, b)
    comm.log.clear()
    model(x, y).backward()
    sync_sequence_parallel_grads(model, comm)
    return comm.log.summary()


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_traffic_equals_a_real_run(sp):
    b = 2
    measured = launch(_tp_comm_rank, 2, args=(sp, b), timeout=60)[0]
    predicted = comm_volume(TINY.with_(n_layer=2), Layout(tp=2, dtype="fp32",
                                                          microbatch_size=b, sp=sp))
    strip = {d: {op: {k: x[k] for k in ("calls", "bytes", "wire_bytes")}
                 for op, x in ops.items()} for d, ops in measured.items()}
    assert strip == predicted


# --- the syllabus -----------------------------------------------------------------------------

def test_syllabus_bubble_examples_and_rule():
    # Its examples, (P-1)/(M+P-1) for P = 4: 27%, 16%, 9%: right.
    for m, pct in ((8, 27), (16, 16), (32, 9)):
        assert round(100 * bubble_fraction_formula("1f1b", 4, m)) == pct
    # Its rule "M >= 4P keeps bubbles < 10%" is wrong: at M = 4P the bubble is
    # (P-1)/(5P-1) >= 1/9 for every P >= 2 (its own P=4, M=16 example shows 16%).
    for p in (2, 4, 8, 16):
        assert bubble_fraction_formula("1f1b", p, 4 * p) > 0.10


def test_syllabus_hardware_claims():
    # A figure often quoted gives the H100 141 GB of HBM3e: that is the H200; the H100 has 80 GB.
    assert GPUS["H100-80GB"].memory < 86e9 < GPUS["H200-141GB"].memory
    assert GPUS["H200-141GB"].memory / 2**30 == pytest.approx(140.4, abs=0.1)


def test_gpt3_per_gpu_memory_two_ways():
    rows = {r["source"]: r for r in gpt3_memory_claims()}
    a, b = rows["~40 GB: 20 B/param (ZeRO §3.1: 16)"], rows["~28 GB: 16 B/param (ZeRO §3.1: 16)"]
    assert round(a["total"] / GB) == 40 and round(b["total"] / GB) == 28
    # the gap: 20 vs 16 bytes per parameter, and 10 + 2.5 vs 4 + 2 GB asserted
    per_rank = 175e9 / 128
    assert (a["params"] + a["grads"] + a["optimizer"]) / per_rank == 20
    assert (b["params"] + b["grads"] + b["optimizer"]) / per_rank == 16
    # the ~40 GB claim's "Adam = 3x the fp32 weights" is the mixed-precision figure;
    # fp32 Adam is 2x
    assert state_bytes("fp32", "adam")[2] == 2 * state_bytes("fp32", "adam")[0]
    ours = rows["minipar (sp + selective)"]
    assert (ours["params"] + ours["grads"] + ours["optimizer"]) == pytest.approx(
        16 * stage_params("gpt3-175b", 16, 8, 0))
    # without sp and recomputation the first stage's activations alone nearly fill 80 GB
    assert rows["minipar (tp only, no recompute)"]["activations"] > 50 * GB
    assert rows["minipar (sp + selective, ZeRO-1)"]["total"] < ours["total"]


def test_fused_accounting_adds_the_loss_backward_workspace_on_the_last_stage():
    """Cross-entropy's backward holds two fp32 s x b x V gradients beside the stored
    log-softmax; the fused accounting counts them in the total, the paper's does not."""
    cfg = PRESETS["tiny"]
    rows = memory_per_stage("tiny", Layout(pp=2, microbatch_size=3, microbatches=2),
                            accounting="fused")
    assert rows[0]["loss_workspace"] == 0
    assert rows[1]["loss_workspace"] == 2 * 4 * cfg.seq_len * 3 * cfg.vocab_size
    for r in rows:
        assert r["total"] == sum(r[k] for k in ("params", "grads", "optimizer",
                                                "activations", "loss_workspace"))
    assert "loss_workspace" not in memory_breakdown("tiny", Layout(microbatch_size=3))


@pytest.mark.parametrize("cp", [2, 4])
def test_a_cp_rank_counts_its_own_tokens_once_and_whole_tensors_whole(cp, monkeypatch):
    """Context parallelism splits what is per token, and only that: an MoE layer's rows
    (the router's, the experts') fall to 1/cp of one rank's at cp 1, as a dense layer's
    activations do; the embedding's weight gradient, which a zero-bubble first stage makes
    beside its activations, is the whole V x h on every cp rank."""
    import minipar.theory.memory as memory

    def acts(model: str, c: int, **kw) -> float:
        return memory_per_stage(model, Layout(cp=c, microbatch_size=2, **kw), stages=[0],
                                accounting="fused")[0]["activations"]
    moe = {c: acts("moe-tiny", c) - acts("tiny", c) for c in (1, cp)}
    assert moe[cp] == pytest.approx(moe[1] / cp, rel=1e-9)
    zb = dict(pp=2, schedule="zb", microbatches=4)
    with_grad = acts("gpt-1.3b", cp, **zb)
    monkeypatch.setattr(memory, "embedding_grad_bytes", lambda *a: 0)
    made = with_grad - acts("gpt-1.3b", cp, **zb)
    cfg = get_model("gpt-1.3b")
    assert made == pytest.approx(cfg.vocab_size * cfg.d_model * 2, abs=1)


@pytest.mark.parametrize("cp", [2, 4])
def test_loss_workspace_of_a_cp_rank_covers_its_own_tokens(cp):
    """A cp rank's loss is over the targets ``shard_batch`` gives it, so its backward's
    two fp32 [tokens, V] gradients have that rank's token count, not the sequence's."""
    from minipar.parallel.cp import shard_sequence

    cfg, b = PRESETS["tiny"], 3
    y = torch.zeros(b, cfg.seq_len, dtype=torch.long)
    tokens = max(shard_sequence(y, r, cp).numel() for r in range(cp))
    # (2 micro-batches: the gradients wait beside the activations; sgd: no optimizer
    # temporary, so the backward holds the peak)
    row = memory_breakdown("tiny", Layout(microbatch_size=b, microbatches=2, cp=cp,
                                          optimizer="sgd"), accounting="fused")
    assert row["loss_workspace"] == 2 * 4 * tokens * cfg.vocab_size
    assert row["total"] == sum(row[k] for k in ("params", "grads", "optimizer",
                                                "activations", "loss_workspace"))


def test_zero3_one_microbatch_holds_activations_or_gradients_not_both():
    """ZeRO-3 at one micro-batch: backward frees a layer's activations as its gradient
    shard appears, so the peak holds the larger of the two (4 x H200, gpt-13b dp 4,
    micro-batch 4: 102.7 GiB predicted when both were counted, 90.7 with the larger,
    91.0 with the buffers in flight beside them, 90.8 measured; dp 2 gpt-1.3b: 43.2 ->
    40.7, 40.8 measured). The buffers in flight (``buffers_in_flight``): fewer at the
    backward's start, where they follow the loss's workspace, than later, beside the
    gradients. With two micro-batches the first's shards are held through the second's
    forward: both count."""
    layout = Layout(dp=4, zero=3, microbatch_size=4)
    one = memory_per_stage("gpt-13b", layout, accounting="fused")[0]
    two = memory_per_stage("gpt-13b", layout.with_(microbatches=2), accounting="fused")[0]
    start, later = buffers_in_flight(get_model("gpt-13b"), layout)
    states = one["params"] + one["optimizer"]
    at_start = one["activations"] + max(one["loss_workspace"], start)
    assert one["total"] == states + max(at_start, one["grads"] + later)
    assert two["total"] == states + two["grads"] + max(at_start, later)
    assert round(one["total"] / 2**30, 1) == 91.0


def test_minipar_gradient_buffers_in_the_fused_accounting():
    """minipar's ZeRO 0-2 sum bf16 micro-batch gradients in fp32 buffers (4 bytes, the
    paper's 2 with ``--grad-dtype bf16``); only ZeRO-1's full buffer lives across steps,
    so at one micro-batch ZeRO 0 and 2 hold the larger of gradients and activations.
    Measured on 2 x H100, gpt-1.3b dp 2, 8 x 2048 a GPU: ZeRO-1 48.2 GiB (was predicted
    45.6, now 48.1); one GPU 50.6 (was 53.0, now 50.6)."""
    n = stage_params("gpt-1.3b")
    one = Layout(microbatch_size=8)

    def fused(layout: Layout) -> dict:
        return memory_per_stage("gpt-1.3b", layout, accounting="fused")[0]
    z1 = fused(one.with_(dp=2, zero=1))
    assert z1["grads"] == 4 * n
    parts = ("params", "optimizer", "loss_workspace")
    assert z1["total"] == sum(z1[k] for k in parts) + z1["grads"] + z1["activations"]
    z0 = fused(one)
    assert z0["total"] == sum(z0[k] for k in parts) + max(z0["grads"], z0["activations"])
    z0m2 = fused(one.with_(microbatches=2))
    assert z0m2["total"] == sum(z0m2[k] for k in parts) + z0m2["grads"] + z0m2["activations"]
    half = fused(one.with_(dp=2, zero=1, grad_dtype="bf16"))
    assert half["grads"] == 2 * n and half["total"] == z1["total"] - 2 * n
    paper = memory_per_stage("gpt-1.3b", one.with_(dp=2, zero=1))[0]
    assert paper["grads"] == 2 * n  # the paper's accounting keeps its 2 bytes
    assert abs(z1["total"] / 2**30 - 48.2) < 0.2  # the measured peak


def test_cheap_recomputation_keeps_no_layer_norm_or_gelu_output():
    """``recompute="cheap"`` drops exactly the layer norms' and GELU's outputs from what a
    block keeps (12 bytes a token and hidden unit in bf16, d_ff = 4h: 2 + 2 + 8), adds no
    FLOPs, and the step model prices its memory passes: gpt-13b dp 4 ZeRO-3 on 4 x H100
    lands between keeping everything and recomputing every block, in time and memory."""
    from minipar.theory.clusters import cluster
    from minipar.theory.memory import CHEAP_TO_RECOMPUTE
    from minipar.theory.params import hardware_flops_per_token
    from minipar.theory.planner import evaluate
    from minipar.theory.rates import cheap_recompute_seconds

    cfg = PRESETS["gpt-13b"]
    none, cheap = (layer_activations(cfg, 1, recompute=r, accounting="fused")
                   for r in ("none", "cheap"))
    assert set(none) - set(cheap) == set(CHEAP_TO_RECOMPUTE)
    assert sum(none.values()) - sum(cheap.values()) == 12 * cfg.seq_len * cfg.d_model
    assert hardware_flops_per_token(cfg, "cheap") == hardware_flops_per_token(cfg)
    h100 = cluster(4, "H100-80GB", 4)
    est = {r: evaluate(cfg, h100, Layout(dp=4, zero=3, microbatches=4, recompute=r))
           for r in ("none", "cheap", "full")}
    assert est["none"].step_time < est["cheap"].step_time < est["full"].step_time
    assert (est["none"].memory["process"] > est["cheap"].memory["process"]
            > est["full"].memory["process"])
    assert cheap_recompute_seconds(cfg, h100, "bf16", "cheap") > 0
    assert cheap_recompute_seconds(cfg, h100, "bf16", "none") == 0
