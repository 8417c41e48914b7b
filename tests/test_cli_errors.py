"""The command line as a hostile user meets it: every bad input ends in one line.

For each row: a non-zero exit, no traceback, one clear line on stderr (argparse's own
usage line before its error line is fine), no process started, under 5 s. The rows cover
every subcommand; the checkpoints they resume are written here by hand (a ``meta.json``
and a shard), since ``check_resume`` reads only those before a run starts.
Below the table: what must still work when something fails late (results kept, a
damaged shard named, Ctrl-C), which does start ranks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from minipar.__main__ import main
from minipar.corpus import prepare

ROOT = Path(__file__).resolve().parents[1]
# Under a regular file: a directory no user can have, root included, whatever ran before.
NOWHERE_DIR = os.path.join(os.__file__, "d")
NOWHERE = f"{NOWHERE_DIR}/out.json"


def fake_checkpoint(d: Path, model: str = "tiny", step: int = 1) -> Path:
    """The files of a one-rank checkpoint: ``latest``, ``meta.json`` and a shard."""
    path = d / f"step-{step:06d}"
    path.mkdir(parents=True)
    torch.save({"weights": {}, "states": {}}, path / "rank-00000.pt")
    meta = {"step": step, "tp": 1, "pp": 1, "dp": 1,
            "files": {"rank-00000.pt": {"tp_rank": 0, "pp_rank": 0}},
            "config": {"model": model, "overrides": {}}}
    (path / "meta.json").write_text(json.dumps(meta))
    (d / "latest").write_text(path.name)
    return path


def _truncated(d: Path) -> None:
    shard = fake_checkpoint(d) / "rank-00000.pt"
    shard.write_bytes(shard.read_bytes()[:100])


def _random_bytes(d: Path) -> None:
    (fake_checkpoint(d) / "rank-00000.pt").write_bytes(os.urandom(2000))


def _bad_meta(d: Path) -> None:
    (fake_checkpoint(d) / "meta.json").write_text("{not json")


def _meta_without_files(d: Path) -> None:
    (fake_checkpoint(d) / "meta.json").write_text(json.dumps({"step": 1}))


def _dangling(d: Path) -> None:
    fake_checkpoint(d)
    (d / "latest").write_text("step-000009")


def _missing_shard(d: Path) -> None:
    (fake_checkpoint(d) / "rank-00000.pt").unlink()


def _locked(d: Path) -> None:
    d.mkdir()
    (d / ".minipar.lock").write_text("1")  # pid 1 is always alive: another run's lock


def _corpora(d: Path) -> None:
    """A text too short for tiny's sequences and one of 4,000 bytes (a held-out split of
    200 tokens: 168 sequences, 10 batches of 16), tokenised into ``d/cache`` already (a
    first tokenisation prints a line of its own)."""
    d.mkdir()
    (d / "short.txt").write_text("hi")
    (d / "small.txt").write_text("minipar " * 500)
    for name in ("short.txt", "small.txt"):
        prepare(str(d / name), "byte", 256, str(d / "cache"))


def _no_text(d: Path) -> None:
    """An empty file, a binary one, and a directory of both: nothing to tokenise."""
    d.mkdir()
    (d / "empty.txt").write_text("")
    (d / "blob.dat").write_bytes(bytes(range(256)) * 4)
    (d / "both").mkdir()
    (d / "both" / "empty.txt").write_text("")
    (d / "both" / "blob.dat").write_bytes(bytes(range(256)) * 4)


SETUPS = {
    "empty": lambda d: d.mkdir(), "file": lambda d: d.write_text("x"),
    "tiny": fake_checkpoint, "small": lambda d: fake_checkpoint(d, "small"),
    "moetiny": lambda d: fake_checkpoint(d, "moe-tiny"),
    "at3": lambda d: fake_checkpoint(d, step=3), "truncated": _truncated,
    "random": _random_bytes, "badmeta": _bad_meta, "nofiles": _meta_without_files,
    "dangling": _dangling, "noshard": _missing_shard, "locked": _locked,
    "corpora": _corpora, "notext": _no_text,
}

# (id, arguments with {name} for a path made by SETUPS[name], what the one line says)
CASES = [
    # --- train: outputs --------------------------------------------------------------
    ("train separate reduce group without zero 3", "train --dp 2 --zero 2 "
     "--separate-reduce-group", "--separate-reduce-group needs --zero 3 over more than"),
    ("train json dir missing", f"train --json {NOWHERE}", f"directory {NOWHERE_DIR} does not"),
    ("train trace dir missing", f"train --trace {NOWHERE}", f"--trace {NOWHERE}"),
    ("train json is a dir", "train --json {empty}", "is a directory; give a file name"),
    ("train trace is a dir", "train --trace {empty}", "is a directory; give a file name"),
    ("train json read-only", "train --json /proc/out.json", "cannot write there (read-only)"),
    ("train save onto a file", "train --save {file}", "is a file, not a directory"),
    ("train save read-only", "train --save /proc/ckpt", "cannot write in /proc (read-only)"),
    ("train save under a file", "train --save {file}/sub", "is a file, not a directory"),
    ("train save other run", "train --save {tiny}", "already holds another run's checkpoints"),
    ("train save in use", "train --save {locked}", "is in use by another run (process 1)"),
    ("train head layers too many", "train --pp 2 --head-layers 9", "--head-layers 9 must"),
    ("train bf16 sums of fp32", "train --grad-dtype bf16", "--grad-dtype bf16 needs --dtype bf16"),
    # --- train: resume ---------------------------------------------------------------
    ("resume empty", "train --resume {empty}", "no checkpoint in"),
    ("resume a file", "train --resume {file}", "a file, not a checkpoint directory"),
    ("resume other preset", "train --resume {small}", "holds model 'small'"),
    ("resume dense as moe", "train --resume {tiny} --moe-experts 4 --moe-top-k 1",
     "they differ in n_expert"),
    ("resume moe, other experts", "train --model moe-tiny --resume {moetiny} --moe-experts 2",
     "they differ in n_expert"),
    ("resume moe, other blocks", "train --model moe-tiny --resume {moetiny} --moe-every 1",
     "they differ in moe_every"),
    ("resume truncated shard", "train --resume {truncated}", "rank-00000.pt is damaged"),
    ("resume random shard", "train --resume {random}", "rank-00000.pt is damaged"),
    ("resume bad meta", "train --resume {badmeta}", "meta.json is not a minipar checkpoint"),
    ("resume meta no files", "train --resume {nofiles}", "meta.json is not a minipar"),
    ("resume dangling latest", "train --resume {dangling}", "names 'step-000009'"),
    ("resume missing shard", "train --resume {noshard}", "rank-00000.pt is missing"),
    ("resume at the end", "train --steps 3 --resume {at3}", "nothing to train"),
    ("resume past the end", "train --steps 2 --resume {at3}", "at step 3, and this run ends"),
    # --- train: data -----------------------------------------------------------------
    ("corpus too short", "train --data {corpora}/short.txt --data-cache {corpora}/cache",
     "the corpus has 2 tokens: too few for sequences of 32"),
    ("eval batches past the held-out split", "train --eval-every 1 --eval-batches 100000 "
     "--data {corpora}/small.txt --data-cache {corpora}/cache",
     "has 168: pass --eval-batches 10 or fewer"),
    ("text file empty", "train --data {notext}/empty.txt --data-cache {notext}/c",
     "empty.txt: no text found (the file is empty or binary; a token file's name ends in"),
    ("text file binary", "train --data {notext}/blob.dat --data-cache {notext}/c",
     "blob.dat: no text found (the file is empty or binary"),
    ("text dir of no text", "train --data {notext}/both --data-cache {notext}/c",
     "both: no text found (its 2 files are empty or binary"),
    # --- train: numbers --------------------------------------------------------------
    ("seed too large", f"train --seed {2**70}", "--seed must be an integer from 0 to"),
    ("seed negative", "train --seed -1", "--seed must be an integer from 0 to"),
    ("timeout zero", "train --timeout 0", "--timeout must be a positive number"),
    ("timeout negative", "train --timeout -5", "--timeout must be a positive number"),
    ("timeout nan", "train --timeout nan", "--timeout must be a positive number"),
    ("microbatches zero", "train --microbatches 0", "--microbatches must be a positive"),
    ("steps negative", "train --steps -1", "--steps must be a positive integer"),
    ("batch zero", "train --batch-size 0", "--batch-size must be a positive integer"),
    ("stop-at zero", "train --stop-at 0", "--stop-at must be between 1 and --steps"),
    ("lr nan", "train --lr nan", "--lr must be a positive number"),
    ("zero stage 5", "train --zero 5", "argument --zero: invalid choice"),
    ("dp not a number", "train --dp two", "argument --dp: invalid int value"),
    ("unknown flag", "train --nope", "unrecognized arguments: --nope"),
    # --- memory ----------------------------------------------------------------------
    ("memory dp zero", "memory --dp 0", "--dp must be a positive integer, got 0"),
    ("memory virtual zero", "memory --virtual 0", "--virtual must be a positive integer"),
    ("memory heads zero", "memory --heads 0", "--heads must be a positive integer"),
    ("memory tp negative", "memory --tp -4", "--tp must be a positive integer, got -4"),
    ("memory params negative", "memory --params -5", "is not a parameter count"),
    ("memory params with a model", "memory --params 7.5B --model tiny", "--params counts a "
     "model's states from its size alone: give it without --model and the sizes, or drop "
     "it (got --model tiny too)"),
    ("memory params with sizes", "memory --params 1e9 --layers 4", "(got --layers 4 too)"),
    ("memory microbatch size", "memory --microbatch-size -1", "--microbatch-size must be"),
    ("memory pp above layers", "memory --pp 1000", "8 layers cannot fill pp=1000"),
    ("memory microbatches zero", "memory --microbatches 0", "--microbatches must be a"),
    ("memory virtual without interleaved", "memory --pp 2 --virtual 2", "--virtual 2 needs "
     "--schedule interleaved or interleaved-zb (got 1f1b)"),
    ("memory interleaved one chunk", "memory --pp 2 --schedule interleaved",
     "--schedule interleaved needs --virtual 2 or more"),
    ("memory interleaved m % pp", "memory --pp 2 --virtual 2 --schedule interleaved "
     "--microbatches 3", "needs --microbatches divisible by --pp (3 % 2 != 0)"),
    ("memory sp without tp", "memory --sp", "--sp (sequence parallelism) splits along tp"),
    ("memory cp not cutting", "memory --cp 3", "needs a sequence length divisible by 2*cp=6"),
    ("memory cp zero", "memory --cp 0", "--cp must be a positive integer, got 0"),
    ("memory tp not dividing", "memory --tp 3", "is not divisible by tp=3"),
    ("memory hidden vs heads", "memory --hidden 100", "d_model=100 is not divisible by"),
    ("memory unknown model", "memory --model nope", "unknown model preset 'nope'; choose"),
    ("memory capacity factor negative", "memory --moe-experts 4 --capacity-factor -1",
     "--capacity-factor must be a finite number >= 0, got -1.0"),
    ("memory json dir missing", f"memory --json {NOWHERE}", f"directory {NOWHERE_DIR} does"),
    ("memory fp8 with sp", "memory --tp 2 --sp --fp8 rowwise",
     "--fp8 with --sp is not supported: use --fp8 with tp alone"),
    ("memory fp8 cheap tensorwise", "memory --recompute cheap --fp8 tensorwise",
     "--recompute cheap with --fp8 tensorwise saves nothing"),
    ("memory fp8 sizes", "memory --hidden 72 --fp8 rowwise",
     "--fp8 needs GEMM sizes divisible by 16 (torch._scaled_mm); hidden is 72"),
    ("memory fp8 without a model", "memory --params 7e9 --fp8 rowwise",
     "--fp8 changes what a model's blocks keep: give --model (or its sizes), not --params"),
    # --- bubble ----------------------------------------------------------------------
    ("bubble pp zero", "bubble --pp 0", "--pp must be a positive integer, got 0"),
    ("bubble microbatches zero", "bubble --microbatches 0", "--microbatches must be a"),
    ("bubble virtual without interleaved", "bubble --virtual 2", "needs --schedule interl"),
    ("bubble interleaved m % pp", "bubble --schedule interleaved --virtual 2 --pp 4 "
     "--microbatches 6", "divisible by --pp (6 % 4 != 0)"),
    ("bubble huge interleaved m % pp", "bubble --schedule interleaved --virtual 2 --pp 1000 "
     "--microbatches 100001", "divisible by --pp"),
    ("bubble unknown schedule", "bubble --schedule nope", "argument --schedule: invalid"),
    ("bubble json dir missing", f"bubble --json {NOWHERE}", f"directory {NOWHERE_DIR} does"),
    # --- plan ------------------------------------------------------------------------
    ("plan fp8 on a card without it", "plan --fp8 rowwise", "--fp8 needs GPUs with float8 "
     "matmuls: A100-80GB has none (H100-80GB, H200-141GB, B200 have them); plan without"),
    ("plan fp8 unknown recipe", "plan --gpus 4 --gpu H100-80GB --fp8 fast",
     "argument --fp8: invalid choice: 'fast'"),
    ("plan unknown gpu", "plan --gpus 8 --gpu nope", "unknown --gpu 'nope'"),
    ("plan zero gpus", "plan --gpus 0", "--gpus must be a positive integer, got 0"),
    ("plan zero batch", "plan --batch 0", "--batch must be a positive integer, got 0"),
    ("plan zero top", "plan --top 0", "--top must be a positive integer, got 0"),
    ("plan gpus not filling nodes", "plan --gpus 12", "12 GPUs do not fill nodes of 8"),
    ("plan unknown cluster", "plan --cluster nope", "unknown cluster 'nope'"),
    ("plan cluster in capitals", "plan --cluster DGX-A100", "unknown cluster 'DGX-A100' (did "
     "you mean 'dgx-a100'?); choose one of"),
    ("plan gpu without its memory", "plan --gpus 8 --gpu h200", "unknown --gpu 'h200' (did "
     "you mean 'H200-141GB'?); choose one of ["),
    ("plan gpu of two sizes", "plan --gpus 8 --gpu A100", "(did you mean 'A100-40GB' or "
     "'A100-80GB'?)"),
    ("plan model misspelt", "plan --model gpt-13", "unknown model preset 'gpt-13' (did you "
     "mean 'gpt-13b'?); choose one of ['gpt-1.3b',"),
    ("plan pp no layout has", "plan --gpus 4 --pp 3", "no layout of 4 GPUs has pp=3"),
    ("plan cp too short", "plan --model tiny --gpus 2 --cp 2", "no layout of 2 GPUs has cp=2"
     ": dp x pp x tp x cp must make 2, pp divide the 8 layers, tp the heads, FFN and "
     "vocabulary; tp and cp are powers of two, tp x cp within a node of 2, and cp leaves "
     "each rank 4096 or more of the 32 tokens of a sequence (in 2*cp equal chunks)"),
    ("plan pp zero", "plan --gpus 4 --pp 0", "--pp must be a positive integer, got 0"),
    ("plan layers zero", "plan --layers 0", "--layers must be a positive integer"),
    ("plan capacity factor nan", "plan --moe-experts 4 --capacity-factor nan",
     "--capacity-factor must be a finite number >= 0, got nan"),
    ("plan json dir missing", f"plan --json {NOWHERE}", f"directory {NOWHERE_DIR} does"),
    # --- doctor and the program itself ---------------------------------------------
    ("doctor json dir missing", f"doctor --json {NOWHERE}", f"directory {NOWHERE_DIR} does"),
    ("doctor unknown flag", "doctor --nope", "unrecognized arguments: --nope"),
    ("doctor pp above layers", "doctor --model tiny --pp 100", "8 layers cannot fill pp=100"),
    ("doctor layout without a model", "doctor --dp 2 --dtype bf16", "--dp 2 --dtype bf16 is "
     "the layout of --model: give --model NAME too"),
    ("no subcommand", "", "the following arguments are required: command"),
    ("unknown subcommand", "fly", "argument command: invalid choice: 'fly'"),
]


def fill_argv(template: str, tmp_path: Path, setups: dict) -> list[str]:
    """A command line's words with each ``{name}`` of ``setups`` replaced by
    ``tmp_path / name``, made first by ``setups[name](path)`` when missing."""
    argv = template.split()
    for i, word in enumerate(argv):
        for name, make in setups.items():
            if "{" + name + "}" in word:
                path = tmp_path / name
                if not path.exists():
                    make(path)
                word = word.replace("{" + name + "}", str(path))
        argv[i] = word
    return argv


def _argv(template: str, tmp_path: Path) -> list[str]:
    return fill_argv(template, tmp_path, SETUPS)


def test_the_table_covers_every_subcommand() -> None:
    assert len(CASES) >= 40
    firsts = {c[1].split()[0] for c in CASES if c[1]}
    assert {"train", "memory", "bubble", "plan", "doctor"} <= firsts


@pytest.mark.parametrize("what,args,says", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_line(what: str, args: str, says: str, tmp_path: Path,
                                  capsys: pytest.CaptureFixture) -> None:
    argv = _argv(args, tmp_path)
    children = len(psutil.Process().children(recursive=True))
    start = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: usage line, then its error line
        code = e.code
    seconds = time.monotonic() - start
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code not in (0, None)
    assert "Traceback" not in out + err
    assert says in lines[-1]
    assert len(lines) == 1 or lines[0].startswith("usage:")  # argparse: usage, error
    assert re.match(r"minipar( \w+)?: error: ", lines[-1])
    assert seconds < 5
    assert len(psutil.Process().children(recursive=True)) == children


def test_huge_bubble_prints_a_bounded_summary(capsys: pytest.CaptureFixture) -> None:
    start = time.monotonic()
    assert main(["bubble", "--pp", "100000", "--microbatches", "100000"]) == 0
    out = capsys.readouterr().out
    assert time.monotonic() - start < 5 and len(out) < 1000
    assert "closed forms" in out and "0.5000" in out  # (p-1)/(m+p-1) with p = m


def test_memory_names_the_model_it_used(capsys: pytest.CaptureFixture) -> None:
    assert main(["memory", "--layers", "4"]) == 0
    assert "per-device memory of tiny with --layers 4," in capsys.readouterr().out
    assert main(["memory", "--ffn", "1000"]) == 0
    assert "per-device memory of tiny with --ffn 1000," in capsys.readouterr().out


def test_more_than_8_ranks_get_a_note_with_the_slowdown() -> None:
    from minipar.checks import oversubscription

    assert oversubscription(8) is None
    note = oversubscription(16)
    assert f"16 ranks on {os.cpu_count()} cores: the cores are oversubscribed" in note
    assert "x as long" in note and "--timeout" in note


def test_a_killed_saves_leftovers_do_not_block_the_next_run(tmp_path) -> None:
    from minipar.checkpoint import check_save

    (tmp_path / "step-000003.tmp").mkdir()
    check_save(str(tmp_path), None)  # no error: a partial save is no run's checkpoint


def test_an_output_failing_late_is_one_line_after_the_table(tmp_path, capsys, monkeypatch):
    import minipar.__main__ as cli

    def disk_full(path, payload):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(cli, "_write_json", disk_full)
    assert main(["memory", "--json", str(tmp_path / "m.json")]) == 1
    out, err = capsys.readouterr()
    assert "total" in out
    assert err.strip() == (f"minipar memory: error: {tmp_path / 'm.json'}: No space left "
                           "on device")


def test_a_corpus_without_text_is_named_once(tmp_path, capsys) -> None:
    """Found only by tokenising (every record's text empty): one error line, its
    ``--data`` named once, after the line that says tokenising started."""
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": ""}\n')
    code = main(["train", "--quiet", "--data", str(blank), "--data-cache", str(tmp_path / "c")])
    assert code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"minipar train: error: --data {blank}: no text found"


def test_resuming_on_other_data_is_noted(tmp_path, capsys) -> None:
    """A run trained on pystdlib resumed without its --data reads the generated corpus:
    allowed (a fine-tune may mean it), and said in one note before the run starts."""
    from minipar.checkpoint import resume_notes
    from minipar.config import TrainConfig

    step = fake_checkpoint(tmp_path / "ck")
    meta = json.loads((step / "meta.json").read_text())
    meta["config"]["data"] = "pystdlib"
    (step / "meta.json").write_text(json.dumps(meta))
    ck = str(tmp_path / "ck")
    assert resume_notes(ck, TrainConfig(resume=ck, data="pystdlib", steps=3)) == []
    note, = resume_notes(ck, TrainConfig(resume=ck, steps=3))
    assert note == (f"--resume {ck} was trained on --data pystdlib: this run reads --data "
                    "markov (pass --data pystdlib to go on with the same text)")


# --- failures after launch: results kept, one line -------------------------------------
def test_a_late_trace_error_keeps_the_losses_and_the_json(tmp_path, capsys, monkeypatch):
    import minipar.trace

    def disk_full(path, ranks):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(minipar.trace, "write_chrome_trace", disk_full)
    out_json = tmp_path / "run.json"
    code = main(["train", "--steps", "2", "--quiet", "--trace", str(tmp_path / "t.json"),
                 "--json", str(out_json)])
    out, err = capsys.readouterr()
    assert code == 1
    assert err.strip() == (f"minipar train: error: --trace {tmp_path / 't.json'}: not "
                           "written (No space left on device)")
    assert len(json.loads(out_json.read_text())["losses"]) == 2
    assert "    1  " in out  # the second step's loss was printed


def test_a_damaged_shard_found_by_a_rank_is_named(tmp_path, capsys) -> None:
    """Valid zip, garbage inside: only ``torch.load`` in the rank can tell."""
    shard = fake_checkpoint(tmp_path / "ck") / "rank-00000.pt"
    torch.save({"something": "else"}, shard)
    code = main(["train", "--steps", "2", "--quiet", "--resume", str(tmp_path / "ck")])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert err.startswith(f"minipar train: error: rank 0 raised CheckpointError: {shard} is "
                          "damaged or not a minipar shard (ValueError) (rank 0 was: ")
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_ctrl_c_is_one_line_and_exit_130_with_no_rank_left(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # (a shell's background job starts with SIGINT ignored, and a child inherits that: give
    # the command line the terminal's Ctrl-C whatever ran this test)
    cli = subprocess.Popen([sys.executable, "-m", "minipar", "train", "--dp", "2", "--steps",
                            "100000", "--quiet"], cwd=tmp_path, env=env,
                           stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    me = psutil.Process(cli.pid)
    try:
        deadline = time.monotonic() + 60
        while len(me.children()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = me.children(recursive=True)
        assert len(ranks) >= 2
        cli.send_signal(signal.SIGINT)
        err = cli.communicate(timeout=30)[1]
    finally:  # a failing check must not leave a 100,000-step run behind (its ranks die
        if cli.poll() is None:  # with it)
            cli.kill()
            cli.wait()
    assert cli.returncode == 130
    assert err.strip() == "minipar train: interrupted"
    time.sleep(0.5)
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
