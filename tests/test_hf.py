"""In and out of the Hugging Face ecosystem (``minipar/hf.py``).

* ``export --format hf``: ``GPT2LMHeadModel.from_pretrained`` gives minipar's logits
  within fp32 rounding (measured max |diff| over max |logit|: 0 on 40 tokens, 7e-7 on
  `small` and 2.7e-6 on `gpt2-125m` with 2 tokens, where transformers takes another
  attention path; bound 1e-5) and ``generate`` gives ``sample``'s greedy tokens;
  ``AutoTokenizer`` encodes as the run's tokenizer did;
* ``train --init-from DIR``: a tp x pp layout, ZeRO-3 and tp with sp, started from a
  GPT-2 directory, train as the single-device reference started from the same weights
  (``parity.TOLERANCES``; the mutation test of the check is in ``test_parity.py``), and
  the first loss is the loss ``transformers`` computes on that batch; an untied model
  starts its head from a tied directory's ``wte``; a sharded save (an index) reads too;
* an architecture that differs is refused in one line, before launch, and so is a
  mixture-of-experts model either way (GPT-2 has no router or experts).

No network: ``HF_HUB_OFFLINE=1``, every directory is made here.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

from minipar.__main__ import main  # noqa: E402
from minipar.config import TrainConfig  # noqa: E402
from minipar.corpus import ByteTokenizer  # noqa: E402
from minipar.engine import train, train_reference  # noqa: E402
from minipar.hf import HFCheckpoint, save_hf  # noqa: E402
from minipar.model import GPT, get_config, materialize  # noqa: E402
from minipar.parallel.tp import shard_tensor  # noqa: E402
from minipar.parity import TOLERANCES, compare  # noqa: E402
from minipar.sample import generate, load_model  # noqa: E402

LOGIT_RTOL = 1e-5  # of the largest logit: fp32 rounding (measured up to 2.7e-6)


def logit_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to the largest logit."""
    return (a - b).abs().max().item() / max(1.0, b.abs().max().item())


def random_gpt(cfg) -> GPT:
    """A GPT with random weights (not minipar's initialisation: a run that ignored them
    would show), made fast (torch's generator) even at gpt2-125m's size."""
    g = torch.Generator().manual_seed(1)
    return materialize(GPT(cfg, device="meta"),
                       lambda n, p: torch.randn(p.shape, generator=g) * 0.05 + (
                           1.0 if p.dim() == 1 and ".ln" in f".{n}" and n.endswith("weight")
                           else 0.0)).eval()


# make test-full only at gpt2-125m's size: the same export and the same comparison as at
# small's; lesson 06 exports a trained small model and compares transformers' greedy text.
@pytest.mark.parametrize("preset", ["small", pytest.param("gpt2-125m", marks=pytest.mark.slow)])
def test_transformers_gives_minipars_logits(preset: str, tmp_path) -> None:
    cfg = get_config(preset)
    model = random_gpt(cfg)
    save_hf(model.named_parameters(), cfg, str(tmp_path), ByteTokenizer())
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    ids = torch.tensor([[3, 250]]) if preset == "gpt2-125m" else torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        assert logit_diff(hf(ids).logits, model(ids)) <= LOGIT_RTOL
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "héllo, wörld"
    assert tok(text)["input_ids"] == ByteTokenizer().encode(text)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[str, str]:
    """A pp2 x tp2 run on byte-level text, saved and exported with --format hf."""
    tmp = tmp_path_factory.mktemp("exported")
    text = tmp / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    ckpt, out = str(tmp / "ckpt"), str(tmp / "hf")
    train(TrainConfig(pp=2, tp=2, microbatches=2, steps=2, data=str(text), save=ckpt,
                      data_cache=str(tmp / "cache"), timeout=240))
    assert main(["export", "--resume", ckpt, "--format", "hf", "--out", out]) == 0
    return ckpt, out


def test_export_of_a_tp_pp_run_loads_and_generates_in_transformers(exported) -> None:
    """pp2 x tp2 checkpoint (byte text) -> export --format hf -> transformers: the same
    logits, the same greedy continuation as ``sample``, the same tokenizer."""
    ckpt, out = exported
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json"]
    ref, tok = load_model(ckpt)
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = tok.encode("the quick")
    assert hf_tok("the quick")["input_ids"] == prompt
    ids = torch.tensor([prompt])
    with torch.no_grad():
        assert logit_diff(hf(ids).logits, ref(ids)) <= LOGIT_RTOL
    greedy = generate(ref, prompt, 12, temperature=0)
    hf_out = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    assert hf_out[0, len(prompt):].tolist() == greedy
    assert hf_tok.decode(greedy) == tok.decode(greedy)


def test_fine_tune_an_exported_model_on_json_lines(exported, tmp_path, capsys) -> None:
    """The round trip back: --init-from the exported directory, on dp2 x tp2, with JSON
    Lines data tokenised by the directory's tokenizer.json (the run's bytes again)."""
    _, out = exported
    data = tmp_path / "notes.jsonl"
    data.write_text("".join(json.dumps({"text": f"note {i}: the lazy dog sleeps."}) + "\n"
                            for i in range(300)))
    ckpt = str(tmp_path / "tuned")
    assert main(["train", "--init-from", out, "--data", str(data), "--dp", "2", "--tp", "2",
                 "--steps", "2", "--data-cache", str(tmp_path / "cache"), "--save", ckpt,
                 "--quiet"]) == 0
    from minipar import corpus

    cached = corpus.prepare(str(data), os.path.join(out, "tokenizer.json"), 256,
                            str(tmp_path / "cache"))
    byte = corpus.prepare(str(data), "byte", 256, str(tmp_path / "cache"))
    assert cached != byte and list(corpus.open_tokens(cached, 256)) == list(
        corpus.open_tokens(byte, 256))
    capsys.readouterr()
    assert main(["sample", "--resume", ckpt, "--prompt", "note", "--tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("note")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> tuple[str, GPT]:
    """A GPT-2 directory of `tiny`'s shape with a tied head and random weights."""
    d = str(tmp_path_factory.mktemp("gpt2"))
    cfg = get_config("tiny").with_(tie_embeddings=True)
    model = random_gpt(cfg)
    save_hf(model.named_parameters(), cfg, d)
    return d, model


SGD = dict(optimizer="sgd", grad_clip=0.0, lr=0.5, warmup=1)


# AdamW with clipping in make test-full: the same loading and layout as plain SGD, where a
# wrong weight cannot hide; AdamW from loaded weights stays in make test (tp + sp below).
@pytest.mark.parametrize("knobs", [SGD, pytest.param({}, marks=pytest.mark.slow)],
                         ids=["sgd-noclip", "adamw-clip"])
def test_init_from_trains_as_the_reference_from_the_same_weights(gpt2_dir, tmp_path,
                                                                  knobs) -> None:
    d, model = gpt2_dir
    cfg = TrainConfig(init_from=d, pp=2, tp=2, microbatches=2, steps=3, timeout=240,
                      save=str(tmp_path / "ck"), **knobs)
    run, ref = train(cfg), train_reference(cfg)
    from minipar.parity import final_parameters

    params = final_parameters(cfg.save)
    ref_params = {k: v.detach() for k, v in ref["model"].state_dict().items()}
    parity = compare(run, ref, params, ref_params)
    assert parity.ok(TOLERANCES["fp32"]), parity.describe()
    # the first step's loss is the directory's model's: transformers computes it too
    from minipar.corpus import make_data

    x, y = make_data(cfg, 64, 32).batch(0, cfg.batch_size)
    hf = transformers.GPT2LMHeadModel.from_pretrained(d).eval()
    with torch.no_grad():
        logits = hf(x).logits
    hf_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    assert abs(run["losses"][0] - hf_loss) < 1e-5
    fresh = train_reference(TrainConfig(steps=1, **knobs))  # minipar's own initialisation
    assert abs(fresh["losses"][0] - hf_loss) > 1e-2  # (measured 0.07: not these weights)


def parity_from(cfg: TrainConfig) -> dict:
    """Train ``cfg`` and its single-device reference; assert parity; the reference."""
    from minipar.parity import final_parameters

    run, ref = train(cfg), train_reference(cfg)
    ref_params = {k: v.detach() for k, v in ref["model"].state_dict().items()}
    parity = compare(run, ref, final_parameters(cfg.save), ref_params)
    assert parity.ok(TOLERANCES["fp32"]), parity.describe()
    return ref


@pytest.mark.parametrize("layout,knobs", [
    (dict(dp=2, zero=3), SGD),
    (dict(tp=2, sp=True), {}),
], ids=["zero3-sgd-noclip", "tp-sp-adamw-clip"])
def test_init_from_with_zero3_and_sp(gpt2_dir, tmp_path, layout, knobs) -> None:
    """ZeRO-3 makes each weight's shard from the directory as its unit is built;
    sequence parallelism reads the same tp slices: both train as the reference."""
    d, _ = gpt2_dir
    parity_from(TrainConfig(init_from=d, steps=3, timeout=240, save=str(tmp_path / "ck"),
                            **layout, **knobs))


def test_an_untied_model_starts_its_head_from_wte(gpt2_dir, tmp_path, capsys) -> None:
    """A directory that ties (no ``lm_head.weight``, ``tie_word_embeddings`` true or
    absent, as ``transformers`` reads it) starts an untied model's head as ``wte``;
    untied in the directory and missing, ``lm_head.weight`` is refused in one line."""
    d, model = gpt2_dir
    notie = tmp_path / "notie"  # the same files, with tie_word_embeddings left out
    notie.mkdir()
    os.symlink(os.path.join(d, "model.safetensors"), notie / "model.safetensors")
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    del config["tie_word_embeddings"]
    (notie / "config.json").write_text(json.dumps(config))
    cfg = TrainConfig(init_from=str(notie), overrides={"tie_embeddings": False}, tp=2,
                      steps=3, timeout=240, save=str(tmp_path / "ck"), **SGD)
    start = materialize(GPT(cfg.model_config(), device="meta"), HFCheckpoint(notie).values())
    assert start.head.weight is not start.tok_emb.weight  # two weights, one value
    assert torch.equal(start.head.weight, model.tok_emb.weight)
    ref = parity_from(cfg)
    assert not torch.equal(ref["model"].head.weight, ref["model"].tok_emb.weight)  # trained
    (notie / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    assert main(["train", "--init-from", str(notie), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "lacks 1 weights of a GPT-2 (lm_head.weight" in err and len(err.splitlines()) == 1


def test_init_from_reads_only_this_ranks_slices(gpt2_dir) -> None:
    """A tp shard read from the file is the slice of the full weight (q|k|v per third)."""
    d, model = gpt2_dir
    ck = HFCheckpoint(d)
    for name, p in model.named_parameters():
        for r in range(2):
            got = ck.local(name, tuple(p.shape), r, 2)
            assert torch.equal(got, shard_tensor(name, p.detach(), r, 2)), name
    short = ck.local("pos_emb.weight", (16, 64))  # a shorter --seq-len: the first rows
    assert torch.equal(short, model.pos_emb.weight.detach()[:16])
    a, b = ck.local("tok_emb.weight", (64, 64)), ck.local("head.weight", (64, 64))
    a.add_(1.0)  # each read is its own memory, not a view of the file's map
    assert torch.equal(b, model.tok_emb.weight.detach())


def test_init_from_reads_a_sharded_save(gpt2_dir, tmp_path) -> None:
    """``save_pretrained`` with a shard size writes several files and an index."""
    d, model = gpt2_dir
    out = tmp_path / "sharded"
    transformers.GPT2LMHeadModel.from_pretrained(d).save_pretrained(out, max_shard_size="50KB")
    assert (out / "model.safetensors.index.json").is_file()
    ck = HFCheckpoint(str(out))
    ck.check(model.cfg)
    for name, p in model.named_parameters():
        assert torch.equal(ck.local(name, tuple(p.shape), 1, 2),
                           shard_tensor(name, p.detach(), 1, 2)), name


@pytest.mark.parametrize("change,says", [
    (["--layers", "4"], "the checkpoint has layers 8, the model 4"),
    (["--seq-len", "64"], "seq-len 64 exceeds the checkpoint's 32 positions"),
    ({"activation_function": "relu"}, "activation relu"),
    ({"model_type": "llama"}, "a llama model"),
    (["--moe-experts", "4"], "GPT-2's architecture has no mixture of experts"),
], ids=["layers", "positions", "activation", "llama", "experts"])
def test_a_different_architecture_is_refused_in_one_line(gpt2_dir, tmp_path, capsys,
                                                          change, says) -> None:
    d, _ = gpt2_dir
    if isinstance(change, dict):
        link = tmp_path / "other"
        link.mkdir()
        os.symlink(os.path.join(d, "model.safetensors"), link / "model.safetensors")
        with open(os.path.join(d, "config.json")) as f:
            config = json.load(f) | change
        (link / "config.json").write_text(json.dumps(config))
        d, change = str(link), []
    assert main(["train", "--init-from", d, "--steps", "1", *change]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_a_mixture_of_experts_checkpoint_is_not_exported_as_gpt2(tmp_path, capsys) -> None:
    """GPT-2 has no router and no experts: ``export --format hf`` of an MoE checkpoint
    is refused in one line (it used to fail on the router's name, an internal error),
    and writes nothing."""
    ckpt, out = str(tmp_path / "ck"), str(tmp_path / "hf")
    train(TrainConfig(model="moe-tiny", steps=1, save=ckpt, timeout=240))
    capsys.readouterr()
    assert main(["export", "--resume", ckpt, "--format", "hf", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert "no mixture of experts" in err and len(err.splitlines()) == 1, err
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_a_directory_without_gpt2_files_is_refused(tmp_path, capsys) -> None:
    assert main(["train", "--init-from", str(tmp_path), "--steps", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err
