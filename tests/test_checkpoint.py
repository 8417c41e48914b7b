"""Checkpoints: bitwise resume, resharding to other layouts, atomic writes."""

from __future__ import annotations

import os

import pytest
import torch

from minipar import checkpoint
from minipar.config import TrainConfig
from minipar.engine import train
from minipar.launch import RankDied, launch
from minipar.model import get_config

STEPS, HALF = 6, 3


def run(**kw) -> list[float]:
    return train(TrainConfig(steps=STEPS, timeout=240, **kw))["losses"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list[float]]:
    """Train dp2 pp2 tp2 for HALF steps and save; also the uninterrupted losses."""
    d = str(tmp_path_factory.mktemp("ckpt"))
    layout = dict(dp=2, pp=2, tp=2, microbatches=2)
    full = run(**layout)
    first = run(**layout, save=d, stop_at=HALF)
    assert first == full[:HALF]
    return d, full


def test_resuming_with_another_optimizer_is_noted(saved, capsys) -> None:
    """Plain SGD from an AdamW checkpoint is allowed (a fine-tune may want it), and says
    in one line that the new optimizer's states start fresh; the same optimizer says
    nothing."""
    from minipar.__main__ import main

    d, _ = saved
    layout = dict(dp=2, pp=2, tp=2, microbatches=2, resume=d, steps=STEPS)
    assert checkpoint.resume_notes(d, TrainConfig(**layout)) == []
    note, = checkpoint.resume_notes(d, TrainConfig(optimizer="sgd", **layout))
    assert "--optimizer adamw: sgd's states start fresh" in note
    assert main(["train", "--resume", d, "--steps", str(HALF + 1), "--dp", "2", "--pp", "2",
                 "--tp", "2", "--microbatches", "2", "--optimizer", "sgd", "--quiet"]) == 0
    assert "note: --resume" in capsys.readouterr().err


def test_resume_is_bitwise_identical(saved) -> None:
    d, full = saved
    resumed = run(dp=2, pp=2, tp=2, microbatches=2, resume=d)
    assert resumed == full[HALF:]  # bitwise: CPU, fp32, same layout


# make test-full only: dp 4 x tp 2 (8 ranks) merges the two stages as dp 2 ZeRO-1 does and
# keeps tp 2 as dp 2 x pp 2 x tp 2 ZeRO-3 does; data parallelism shards no saved weight.
@pytest.mark.parametrize("layout", [pytest.param(dict(dp=4, tp=2), marks=pytest.mark.slow),
                                    dict(pp=2, tp=4, microbatches=2), dict(dp=2, zero=1),
                                    dict(tp=2, pp=2, zero=3, dp=2, microbatches=2)],
                         ids=["dp4 tp2", "pp2 tp4", "dp2 zero1", "dp2 pp2 tp2 zero3"])
def test_resume_at_another_layout(saved, layout: dict) -> None:
    d, full = saved
    resumed = run(resume=d, **layout)
    assert max(abs(a - b) for a, b in zip(resumed, full[HALF:])) < 1e-4


def test_context_parallel_ranks_write_one_shard(saved, tmp_path) -> None:
    """The weights and the gathered states are replicated over cp as over dp: one file a
    (pp, tp) shard, not one a cp rank; resumed with cp, the uninterrupted run's losses."""
    d, full = saved
    resumed = run(dp=2, cp=2, zero=1, resume=d, save=str(tmp_path), stop_at=HALF + 1)
    assert max(abs(a - b) for a, b in zip(resumed, full[HALF:])) < 1e-4
    [step] = [p for p in os.listdir(tmp_path) if p.startswith("step-")]
    assert sorted(os.listdir(tmp_path / step)) == ["meta.json", "rank-00000.pt"]


def test_tied_embeddings_reshard_from_one_stage_to_two(tmp_path) -> None:
    """At pp = 1 a tied weight is saved once (``tok_emb.weight``); resumed at pp = 2 the
    last stage's copy (``head.weight``) must start from it, optimizer state included."""
    tied = dict(overrides={"tie_embeddings": True})
    full = run(tp=2, **tied)
    run(tp=2, save=str(tmp_path), stop_at=HALF, **tied)
    resumed = run(pp=2, microbatches=2, resume=str(tmp_path), **tied)
    assert max(abs(a - b) for a, b in zip(resumed, full[HALF:])) < 1e-4


def test_a_model_sized_by_flags_resumes(tmp_path) -> None:
    """``meta.json`` records the model as built (``--layers``, the data's vocabulary,
    ``--init-from``'s sizes), not only the preset: such a run resumes, and loads whole."""
    full = run(layers=4)
    run(layers=4, save=str(tmp_path), stop_at=HALF)
    assert run(layers=4, resume=str(tmp_path)) == full[HALF:]
    assert {k.split(".")[1] for k in checkpoint.load(str(tmp_path))[0]["model"]
            if k.startswith("blocks.")} == {"0", "1", "2", "3"}


def test_the_shape_check_names_what_changes_the_weights() -> None:
    tiny, moe = get_config("tiny"), get_config("moe-tiny")
    # a dense model's MoE fields shape nothing
    assert checkpoint.shape_changes(tiny, tiny.with_(moe_every=2, moe_top_k=1)) == []
    assert checkpoint.shape_changes(tiny, moe) == ["n_expert"]
    assert checkpoint.shape_changes(moe, moe.with_(moe_top_k=1, capacity_factor=1.5)) == []
    assert checkpoint.shape_changes(moe, moe.with_(moe_every=1, expert_d_ff=128)) == [
        "moe_every", "expert_d_ff"]


def test_balanced_stages_reshard_both_ways(tmp_path) -> None:
    """A checkpoint saved with ``head_layers`` (the last stage holds fewer layers) is
    read by the saved split: resumed with the even split, and back again."""
    full = run(pp=2, microbatches=2, head_layers=1)
    run(pp=2, microbatches=2, head_layers=1, save=str(tmp_path / "a"), stop_at=HALF)
    resumed = run(pp=2, microbatches=2, resume=str(tmp_path / "a"))
    assert max(abs(a - b) for a, b in zip(resumed, full[HALF:])) < 1e-4
    run(pp=2, microbatches=2, save=str(tmp_path / "b"), stop_at=HALF)
    resumed = run(pp=2, microbatches=2, head_layers=1, resume=str(tmp_path / "b"))
    assert max(abs(a - b) for a, b in zip(resumed, full[HALF:])) < 1e-4


def test_checkpoint_is_loaded_without_code(saved) -> None:
    d, _ = saved
    path = checkpoint.resolve(d)
    files = [f for f in os.listdir(path) if f.endswith(".pt")]
    assert len(files) == 4  # dp replica 0 of a 2 x 2 x 2 mesh writes; the others do not
    blob = torch.load(os.path.join(path, files[0]), weights_only=True)
    assert set(blob) == {"weights", "states"}


def _crash_while_saving(directory: str) -> None:
    """Save once, then die half-way through a second save (after the shards)."""
    cfg = TrainConfig(steps=2, save=directory, stop_at=1)
    from minipar.engine import rank_main

    rank_main(cfg)
    real_replace = os.replace

    def dying_replace(src, dst):
        if src.endswith(".tmp") and "step-000002" in src:
            os._exit(9)  # killed between writing the shards and publishing them
        real_replace(src, dst)

    os.replace = dying_replace
    rank_main(TrainConfig(steps=2, save=directory, resume=directory))


def test_a_crash_while_saving_keeps_the_previous_checkpoint(tmp_path) -> None:
    d = str(tmp_path)
    with pytest.raises(RankDied):
        launch(_crash_while_saving, 1, args=(d,), timeout=120)
    assert checkpoint.resolve(d).endswith("step-000001")
    state, step = checkpoint.load(d)
    assert step == 1 and "tok_emb.weight" in state["model"]
    assert run(resume=d)[0] > 0  # and training resumes from it


def _resave_dying_at(directory: str, k: int) -> int:
    """Save step 1, then save step 1 again and die at the k-th rename or delete of that
    second save; returns how many there were when it lives."""
    import shutil

    from minipar.engine import build
    from minipar.mesh import Mesh

    cfg = TrainConfig(steps=1)
    rm = Mesh(1, 1, 1).connect()
    parts = build(cfg, rm)
    checkpoint.save(directory, 1, cfg, rm, parts)
    calls = 0

    def dying(real):
        def call(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == k:
                os._exit(9)  # a kill at exactly this point of the save
            return real(*args, **kwargs)
        return call

    os.replace, shutil.rmtree = dying(os.replace), dying(shutil.rmtree)
    checkpoint.save(directory, 1, cfg, rm, parts)
    return calls


def test_a_kill_anywhere_in_a_resave_leaves_a_complete_checkpoint(tmp_path) -> None:
    """Re-saving a step replaces a directory, which no single rename can do: at every
    point of it, ``latest`` must still name a complete checkpoint."""
    steps = launch(_resave_dying_at, 1, args=(str(tmp_path / "whole"), 0), timeout=120)[0]
    assert steps >= 5
    for k in range(1, steps + 1):
        d = str(tmp_path / f"killed-at-{k}")
        with pytest.raises(RankDied):
            launch(_resave_dying_at, 1, args=(d, k), timeout=120)
        state, step = checkpoint.load(d)  # resolve, check every file, read every tensor
        assert step == 1 and "tok_emb.weight" in state["model"], k
        checkpoint.check_resume(d, TrainConfig(steps=2))
        if open(os.path.join(d, "latest")).read().endswith(".tmp"):  # killed mid-publish:
            launch(_resave_dying_at, 1, args=(d, 0), timeout=120)  # the next save finishes
            assert checkpoint.resolve(d).endswith("step-000001")  # it and saves its own
            assert checkpoint.load(d)[1] == 1


def test_a_save_directory_is_held_by_one_run(tmp_path) -> None:
    d = str(tmp_path)
    with open(os.path.join(d, checkpoint.LOCK), "w") as f:
        f.write("1")  # a live process (init) holds it
    with pytest.raises(checkpoint.CheckpointError, match="in use by another run"):
        with checkpoint.locked(d):
            pass
    with open(os.path.join(d, checkpoint.LOCK), "w") as f:
        f.write("999999999")  # no such process: a stale lock, taken over
    with checkpoint.locked(d):
        with open(os.path.join(d, checkpoint.LOCK)) as f:
            assert f.read() == str(os.getpid())
    assert not os.path.exists(os.path.join(d, checkpoint.LOCK))


def test_resume_with_compare_compares_the_same_steps(tmp_path, capsys) -> None:
    import json

    from minipar.__main__ import main

    d, out = str(tmp_path / "ck"), tmp_path / "run.json"
    assert main(["train", "--steps", "4", "--stop-at", "2", "--save", d, "--quiet"]) == 0
    capsys.readouterr()
    assert main(["train", "--steps", "4", "--resume", d, "--compare", "--quiet",
                 "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["first_step"] == 2 and len(record["reference_losses"]) == 2
    assert max(abs(a - b) for a, b in zip(record["losses"], record["reference_losses"])) < 1e-4
    assert "    2  " in capsys.readouterr().out  # steps numbered from where it resumed


def test_a_rank_opens_only_the_shards_it_needs(saved) -> None:
    """The dp2 pp2 tp2 checkpoint: 4 files (pp x tp). A layer of stage 0 read at tp 4
    by rank 3 needs saved tp rank 1's file alone; at tp 1, both of stage 0's files."""
    from minipar.parallel.tp import shard_tensor
    from minipar.reshard import ShardReader

    d, _ = saved
    cfg = TrainConfig().model_config()
    full = checkpoint.load(d)[0]
    files = {(i["pp_rank"], i["tp_rank"]): f for f, i in checkpoint.inspect(d)["files"].items()}
    name = "blocks.1.mlp.fc.weight"
    reader = ShardReader(d, cfg, tp_rank=3, tp=4)
    assert torch.equal(reader.local(name), shard_tensor(name, full["model"][name], 3, 4))
    assert torch.equal(reader.local(name, "exp_avg"),
                       shard_tensor(name, full["optimizer"][name]["exp_avg"], 3, 4))
    assert reader.opened == [files[(0, 1)]]
    whole = ShardReader(d, cfg)
    assert torch.equal(whole.local("head.weight"), full["model"]["head.weight"])
    assert sorted(whole.opened) == sorted([files[(1, 0)], files[(1, 1)]])


def test_resume_from_zero3_with_tied_pipeline_stages(tmp_path) -> None:
    """Saved by ZeRO-3 with the tied embedding on two stages (two copies), resumed at
    pp = 1 with ZeRO-1 (one weight): the same losses as the uninterrupted run."""
    tied = dict(overrides={"tie_embeddings": True})
    layout = dict(dp=2, pp=2, zero=3, microbatches=2, **tied)
    full = run(**layout)
    run(save=str(tmp_path), stop_at=HALF, **layout)
    resumed = run(dp=2, tp=2, zero=1, resume=str(tmp_path), **tied)
    assert max(abs(a - b) for a, b in zip(resumed, full[HALF:])) < 1e-4


def test_export_round_trip_into_one_device(saved, tmp_path) -> None:
    """pp2 tp2 checkpoint -> export -> export.load_gpt: the single-device model's
    validation loss equals the one the run measured through its layout."""
    from minipar.__main__ import main
    from minipar.corpus import make_data
    from minipar.evaluate import reference_eval
    from minipar.export import load_gpt

    d = str(tmp_path / "run")
    cfg = TrainConfig(dp=2, pp=2, tp=2, microbatches=2, steps=2, eval_every=2,
                      save=d, timeout=240)
    record = train(cfg)
    out = str(tmp_path / "model.safetensors")
    assert main(["export", "--resume", d, "--out", out]) == 0
    model = load_gpt(out)
    data = make_data(cfg, model.cfg.vocab_size, model.cfg.seq_len)
    loss = reference_eval(model, data, cfg.batch_size, cfg.eval_batches)
    assert abs(loss - record["eval"][-1]["loss"]) < 1e-5
    assert main(["export", "--resume", d, "--out", str(tmp_path / "model.pt")]) == 2


def test_a_resumed_step_count_goes_where_its_kernel_reads_it() -> None:
    """Adam's step count comes back from a checkpoint on the host; a fused (or
    capturable) kernel reads it on the parameter's device, the others on the host, as
    torch's own ``load_state_dict`` places it (on a GPU a fused AdamW given a host step
    stops the first step after a resume). A parameter on the meta device stands in for
    a GPU's."""
    from minipar.parallel.zero.shards import _scalar_state

    param = torch.zeros(4, device="meta")
    step = torch.tensor(7.0)
    for flags, device in (({"fused": True}, "meta"), ({"capturable": True}, "meta"),
                          ({"fused": None, "capturable": False}, "cpu")):
        group = {"params": [param], **flags}
        optimizer = type("Stepper", (), {"param_groups": [group]})()
        moved = _scalar_state(step, optimizer, param)
        assert moved.device.type == device and moved.dtype == step.dtype, flags
        assert moved is not step


def test_a_step_directory_keeps_its_runs_tokenizer(tmp_path) -> None:
    """``--resume`` may name one checkpoint (``step-N``, e.g. an earlier one kept by
    ``--keep``): ``sample`` and ``export --format hf`` read the run card beside it, so
    the text is the same as from the save directory and the export carries the
    tokenizer (the card used to be looked for inside ``step-N`` only: sample refused a
    text prompt, and the export silently left the tokenizer out)."""
    from minipar.export import export_hf
    from minipar.sample import sample

    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    d = str(tmp_path / "run")
    train(TrainConfig(steps=1, data=str(text), save=d, data_cache=str(tmp_path / "cache"),
                      timeout=240))
    step = os.path.join(d, "step-000001")
    assert sample(step, "the", 8, 0.0) == sample(d, "the", 8, 0.0)
    out = export_hf(step, str(tmp_path / "hf"))
    assert out["tokenizer"] and os.path.isfile(tmp_path / "hf" / "tokenizer.json")
