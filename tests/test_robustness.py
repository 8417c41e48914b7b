"""Nothing lost, nothing silently wrong: what a hostile user, a full disk or a damaged
file does to a run, and the one line each gets.

The table (``CASES``) runs in-process, each row well under a second: a non-zero exit,
one line on stderr, no traceback, no process started, no temporary file left (the
launcher's ``minipar-*`` files go to a directory of the test's own), no ``.tmp`` and no
token cache entry. With ``tests/test_cli_errors.py`` and ``tests/test_errors.py`` it
holds at least 180 command lines. Below it, what needs a real checkpoint or a real run:
checksums, a non-finite loss, the save-directory lock with two processes, a full disk
while saving, a slow run under ``--timeout``, and SIGHUP or ``kill -9`` of a launcher
running two ranks (no rank, no temporary file left).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch

from minipar import checkpoint
from minipar.__main__ import main
from minipar.config import TrainConfig, validate
from tests.test_cli_errors import NOWHERE_DIR, fake_checkpoint, fill_argv

ROOT = Path(__file__).resolve().parents[1]


def _text(d: Path) -> None:
    d.write_text("hello world, some text to learn from\n" * 50)


def _text_dir(d: Path) -> None:
    d.mkdir()
    _text(d / "a.txt")


def _fifo_dir(d: Path) -> None:
    d.mkdir()
    os.mkfifo(d / "pipe")  # reading it would block forever


def _bin(d: Path, sidecar: str | None = None, tokens: int = 1000) -> None:
    d.write_bytes(torch.randint(0, 200, (tokens,), dtype=torch.int16).numpy().tobytes())
    if sidecar is not None:
        d.with_suffix(".json").write_text(sidecar)


def _tp_hole(d: Path) -> None:
    """meta.json of a tp=2 run that lists only tp rank 0's shard."""
    path = fake_checkpoint(d)
    meta = json.loads((path / "meta.json").read_text())
    meta["tp"] = 2
    (path / "meta.json").write_text(json.dumps(meta))


def _digest_not_text(d: Path) -> None:
    path = fake_checkpoint(d)
    meta = json.loads((path / "meta.json").read_text())
    meta["files"]["rank-00000.pt"]["sha256"] = 5
    (path / "meta.json").write_text(json.dumps(meta))


def _fifo_in_checkpoint(name: str):
    """A checkpoint whose ``name`` (relative to it) is a FIFO: reading it would block."""
    def make(d: Path) -> None:
        fake_checkpoint(d)
        path = d / name.replace("STEP", "step-000001")
        path.unlink(missing_ok=True)
        os.mkfifo(path)
    return make


def _exists(d: Path) -> None:
    d.write_bytes(b"an earlier export")


def _full(d: Path) -> None:
    d.mkdir()
    (d / "notes.txt").write_text("a user's file")


def _hf_dir(config: str | None, weights: bytes | None = None):
    def make(d: Path) -> None:
        d.mkdir()
        if config is not None:
            (d / "config.json").write_text(config)
        if weights is not None:
            (d / "model.safetensors").write_bytes(weights)
    return make


SETUPS = {
    "text": _text, "textdir": _text_dir, "fifodir": _fifo_dir,
    "fifo": lambda d: os.mkfifo(d),
    "f32.bin": lambda d: _bin(d, '{"dtype": "float32", "vocab_size": 256}'),
    "int8.bin": lambda d: _bin(d, '{"dtype": "int8"}'),
    "badjson.bin": lambda d: _bin(d, "{not json"),
    "list.bin": lambda d: _bin(d, "[1, 2]"),
    "vocabstr.bin": lambda d: _bin(d, '{"dtype": "uint16", "vocab_size": "256"}'),
    "vocab0.bin": lambda d: _bin(d, '{"dtype": "uint16", "vocab_size": 0}'),
    "empty.bin": lambda d: d.write_bytes(b""),
    "file": lambda d: d.write_bytes(b""),  # {file}/d: a directory no user can have
    "odd.bin": lambda d: d.write_bytes(b"abc"),
    "ck": fake_checkpoint, "tphole": _tp_hole, "digest5": _digest_not_text,
    "old.safetensors": _exists, "dir": lambda d: d.mkdir(), "full": _full,
    "badtok.json": lambda d: d.write_text("{not json"),
    "hfbadjson": _hf_dir("{not json"), "hflist": _hf_dir("[1, 2]"),
    "hfsizetext": _hf_dir('{"n_embd": "wide"}'), "hfnoweights": _hf_dir("{}"),
    "hfbadweights": _hf_dir("{}", b"not safetensors" * 10),
    "calib.fifo": lambda d: os.mkfifo(d), "list.json": lambda d: d.write_text("[1, 2]"),
    "latin1.jsonl": lambda d: d.write_bytes('{"text": "café"}\n'.encode("latin-1")),
    "broken.jsonl": lambda d: d.write_text('{"text": "fine"}\n{"text": broken}\n'),
    "blank.jsonl": lambda d: d.write_text("\n\n"),
    "bad.parquet": lambda d: d.write_bytes(b"PAR1 not a table PAR1"),
    "latestfifo": _fifo_in_checkpoint("latest"), "metafifo": _fifo_in_checkpoint("STEP/meta.json"),
    "cardfifo": _fifo_in_checkpoint("run.json"),
}

BIG = 2**70
# (id, arguments with {name} for a path made by SETUPS[name], what the one line says)
CASES = [
    # --- silent wrong data -------------------------------------------------------------
    ("bin sidecar float32", "train --data {f32.bin}", "says dtype 'float32'; token files"),
    ("bin sidecar int8", "train --data {int8.bin}", "says dtype 'int8'; token files hold"),
    ("bin sidecar not json", "train --data {badjson.bin}", "badjson.json is not readable"),
    ("bin sidecar a list", "train --data {list.bin}", "(ValueError: not a JSON object)"),
    ("bin sidecar vocab text", "train --data {vocabstr.bin}", "says vocab_size '256'"),
    ("bin sidecar vocab zero", "train --data {vocab0.bin}", "says vocab_size 0; a posit"),
    ("bin empty", "train --data {empty.bin}", "empty.bin: the token file is empty"),
    ("bin not whole tokens", "train --data {odd.bin} --steps 1", "3 bytes is not a whole"),
    ("data dir of a fifo", "train --data {fifodir}", "the directory holds no files"),
    ("data a fifo", "train --data {fifo}", "is not a file, a directory, a .bin"),
    # --- outputs onto inputs, or onto each other -----------------------------------------
    ("json onto the data", "train --data {text} --json {text}", "--json {text} is the same"),
    ("trace onto the data", "train --data {text} --trace {text}", "an output must not over"),
    ("json onto the trace", "train --json {dir}/x.json --trace {dir}/x.json",
     "two outputs cannot share one path"),
    ("save onto the data dir", "train --data {textdir} --save {textdir}", "same path as"),
    ("cache onto the data dir", "train --data {textdir} --data-cache {textdir}",
     "--data-cache {textdir} is the same path as --data"),
    ("export onto a file", "export --resume {ck} --out {old.safetensors}", "already exists"),
    ("export into no directory", "export --resume {ck} --out {file}/d/m.safetensors",
     "directory {file}/d does not exist"),
    ("export read-only", "export --resume {ck} --out /proc/m.safetensors", "cannot write"),
    ("export onto a directory", "export --resume {ck} --out {dir}.safetensors/",
     "must end in .safetensors"),
    ("export json onto out", "export --resume {ck} --out {dir}/m.safetensors --json "
     "{dir}/m.safetensors", "two outputs cannot share"),
    ("export json dir missing", "export --resume {ck} --out {dir}/m.safetensors --json "
     "{file}/d/x.json", "directory {file}/d does not exist"),
    ("export no checkpoint", "export --resume " + NOWHERE_DIR + " --out {dir}/m.safetensors",
     "no such checkpoint directory"),
    # --- export --format hf: the same output rules ----------------------------------------
    ("hf export into a full directory", "export --resume {ck} --format hf --out {full}",
     "--out {full} already holds files; remove them"),
    ("hf export onto a file", "export --resume {ck} --format hf --out {old.safetensors}",
     "is a file; give a directory name"),
    ("hf export into no directory", "export --resume {ck} --format hf --out {file}/d/hf",
     "--out {file}/d/hf: directory {file}/d does not exist"),
    ("hf export read-only", "export --resume {ck} --format hf --out /proc/hf",
     "cannot write there (read-only)"),
    ("hf export onto the checkpoint", "export --resume {ck} --format hf --out {ck}",
     "is the same path as --resume: an output must not overwrite an input"),
    ("hf export json inside out", "export --resume {ck} --format hf --out {dir} --json "
     "{dir}/config.json", "is inside --out {dir}, where it writes its files"),
    ("hf export json onto out", "export --resume {ck} --format hf --out {dir}/hf --json "
     "{dir}/hf", "two outputs cannot share one path"),
    ("hf export no name", "export --resume {ck} --format hf --out=", "needs a directory name"),
    ("hf export no checkpoint", "export --resume " + NOWHERE_DIR + " --format hf --out {dir}/hf",
     "no such checkpoint directory"),
    ("hf export tp shard missing", "export --resume {tphole} --format hf --out {dir}/hf",
     "not all of [(0, 0), (0, 1)]"),
    # --- outputs onto what a --save directory writes -----------------------------------------
    ("json onto the run card", "train --save {dir} --json {dir}/run.json",
     "--json {dir}/run.json is inside --save {dir}, where the checkpoint writes run.json"),
    ("trace onto latest", "train --save {dir} --trace {dir}/latest", "checkpoint writes latest"),
    ("trace onto a step", "train --save {dir} --trace {dir}/step-000005", "writes step-000005"),
    ("json onto the lock", "train --save {dir} --json {dir}/.minipar.lock", "writes .minipar"),
    ("json onto the tokenizer", "train --save {dir} --json {dir}/tokenizer.json",
     "where the checkpoint writes tokenizer.json"),
    ("json onto a resumed run card", "train --resume {ck} --save {ck} --json {ck}/run.json",
     "--json {ck}/run.json is inside --save {ck}"),
    ("cache onto a file", "train --data {text} --data-cache {old.safetensors}",
     "--data-cache {old.safetensors} is a file, not a directory"),
    ("cache read-only", "train --data {text} --data-cache /proc/c", "cannot write in /proc"),
    # --- mixture of experts, float8 ------------------------------------------------------------
    ("moe experts negative", "train --moe-experts -1", "--moe-experts must be 0 (dense) or a"),
    ("moe top-k over experts", "train --moe-experts 1", "--moe-top-k must be between 1 and "
     "--moe-experts (1), got 2"),
    ("moe top-k zero", "train --moe-experts 4 --moe-top-k 0", "must be between 1 and"),
    ("capacity factor inf", "train --moe-experts 4 --capacity-factor inf",
     "--capacity-factor must be a finite number >= 0, got inf"),
    ("capacity factor nan", "train --moe-experts 4 --capacity-factor nan", "got nan"),
    ("aux loss inf", "train --moe-experts 4 --aux-loss-coef inf", "--aux-loss-coef must be a "
     "finite"),
    ("z loss inf", "train --moe-experts 4 --z-loss-coef inf", "--z-loss-coef must be a finite"),
    ("moe every zero", "train --moe-experts 4 --moe-every 0", "--moe-every must be a positive"),
    ("ep without experts", "train --dp 2 --ep 2", "needs a mixture-of-experts model"),
    ("ep zero", "train --model moe-tiny --ep 0", "--ep must be a positive integer, got 0"),
    ("fp8 emulate alone", "train --fp8-emulate", "--fp8-emulate needs --fp8 rowwise"),
    # --- a transformers directory or a tokenizer that cannot be read --------------------------
    ("init-from config not json", "train --init-from {hfbadjson}",
     "{hfbadjson}/config.json is not a model config (JSONDecodeError"),
    ("init-from config a list", "train --init-from {hflist}", "(ValueError: not a JSON obj"),
    ("init-from size as text", "train --init-from {hfsizetext}", "invalid literal for int()"),
    ("init-from no weights", "train --init-from {hfnoweights}", "no model.safetensors (only"),
    ("init-from weights damaged", "train --init-from {hfbadweights}",
     "{hfbadweights}/model.safetensors is not readable (SafetensorError"),
    ("init-from a file", "train --init-from {text}", "no config.json (a transformers model"),
    ("init-from missing", "train --init-from " + NOWHERE_DIR, "no config.json"),
    ("tokenizer file damaged", "train --data {text} --tokenizer {badtok.json}",
     "--tokenizer {badtok.json} is not a tokenizer file"),
    # --- data files that cannot be read (no cache entry left) -----------------------------------
    ("jsonl not utf-8", "train --quiet --data {latin1.jsonl} --data-cache {dir}/cache",
     "{latin1.jsonl}: not UTF-8 (byte 0xe9: invalid continuation byte)"),
    ("jsonl line not json", "train --quiet --data {broken.jsonl} --data-cache {dir}/cache",
     "--data {broken.jsonl}:2: not JSON"),
    ("jsonl line not json, bpe", "train --quiet --data {broken.jsonl} --tokenizer bpe "
     "--vocab 512 --data-cache {dir}/cache", "--data {broken.jsonl}:2: not JSON"),
    ("jsonl no text", "train --quiet --data {blank.jsonl} --data-cache {dir}/cache",
     "--data {blank.jsonl}: no text found"),
    ("parquet damaged", "train --quiet --data {bad.parquet} --data-cache {dir}/cache",
     "{bad.parquet}: not a readable Parquet file (ArrowInvalid"),
    # --- a FIFO where a checkpoint keeps a small file: one line, no read that blocks ----------
    ("resume latest a fifo", "train --resume {latestfifo}", "{latestfifo}/latest is not read"),
    ("resume meta a fifo", "train --resume {metafifo}", "meta.json is not a minipar checkpoint"
     "'s metadata (OSError: [Errno 22] not a regular file"),
    ("sample run card a fifo", "sample --resume {cardfifo}", "{cardfifo}/run.json is not a "
     "minipar run card (OSError"),
    ("export run card a fifo", "export --resume {cardfifo} --out {dir}/m.safetensors",
     "{cardfifo}/run.json is not a minipar run card"),
    ("hf export run card a fifo", "export --resume {cardfifo} --format hf --out {dir}/hf",
     "{cardfifo}/run.json is not a minipar run card"),
    ("save into a fifo's checkpoint", "train --save {latestfifo}", "already holds another run"),
    # --- plan's inputs ---------------------------------------------------------------------------
    ("memory margin nan", "plan --memory-margin nan", "--memory-margin must be in [0, 1)"),
    ("memory margin 1", "plan --memory-margin 1", "left free), got 1.0"),
    ("memory margin negative", "plan --memory-margin -0.5", "got -0.5"),
    ("host memory zero", "plan --host-memory 0", "--host-memory must be a positive number"),
    ("recompute modes", "plan --recompute-modes none,most", "of none, selective, cheap, full; "
     "got 'most'"),
    ("host memory inf", "plan --host-memory inf", "of GiB (a node's host memory), got inf"),
    ("calibrate missing", "plan --calibrate " + NOWHERE_DIR + "/c.json",
     "--calibrate " + NOWHERE_DIR + "/c.json: no such file"),
    ("calibrate not json", "plan --calibrate {text}", "not a readable calibration JSON"),
    ("calibrate a list", "plan --calibrate {list.json}", "a JSON object with matmul_tflops"),
    ("calibrate a fifo", "plan --calibrate {calib.fifo}", "no such file"),
    # --- timeouts the backends cannot take ----------------------------------------------
    ("timeout 1e10", "train --timeout 1e10", "up to 604800 (a week), got 10000000000.0"),
    ("timeout 1e308", "train --timeout 1e308", "--timeout must be a positive number"),
    ("timeout inf", "train --timeout inf", "--timeout must be a positive number"),
    ("timeout -inf", "train --timeout=-inf", "--timeout must be a positive number"),
    # --- wrong or unclear lines -----------------------------------------------------------
    ("vocab 1 on markov", "train --vocab 1", "--vocab 1 is too small for the generated"),
    ("vocab 3 on markov", "train --vocab 3", "pass --vocab 4 or more"),
    ("resume tp shard missing", "train --resume {tphole}", "its shards cover (pp rank, tp"),
    ("resume digest not text", "train --resume {digest5}", "the sha256 of rank-00000.pt"),
    ("export tp shard missing", "export --resume {tphole} --out {dir}/m.safetensors",
     "not all of [(0, 0), (0, 1)]"),
    ("sample tp shard missing", "sample --resume {tphole}", "its shards cover"),
    ("sample a file", "sample --resume {file}", "a file, not a checkpoint directory"),
    ("export a file", "export --resume {file} --out {dir}/m.safetensors",
     "a file, not a checkpoint directory"),
    ("sample temperature nan", "sample --resume {ck} --temperature nan", "--temperature must"),
    ("sample temperature inf", "sample --resume {ck} --temperature inf", "a number >= 0"),
    ("sample seed huge", f"sample --resume {{ck}} --seed {BIG}", "--seed must be an integer"),
    ("sample seed negative", "sample --resume {ck} --seed -1", "--seed must be an integer"),
    ("sample tokens zero", "sample --resume {ck} --tokens 0", "--tokens must be a positive"),
    ("sample tokens beyond bound", "sample --resume {ck} --tokens 100000000000",
     "--tokens must be a positive integer up to 100,000"),
    ("sample no checkpoint", "sample --resume " + NOWHERE_DIR, "no such checkpoint"),
    ("lr inf", "train --lr inf", "--lr must be a positive number"),
    ("weight decay nan", "train --weight-decay nan", "--weight-decay must be a number"),
    ("grad clip inf", "train --grad-clip inf", "--grad-clip must be a number >= 0"),
    ("dropout nan", "train --dropout nan", "--dropout must be in [0, 1)"),
    ("keep negative", "train --keep -1", "--keep must be 0 or a positive integer"),
    ("save-every negative", "train --save-every -2", "--save-every must be 0 or a posit"),
    ("eval batches zero", "train --eval-batches 0", "--eval-batches must be a positive"),
    ("warmup negative", "train --warmup -1", "--warmup must be 0 or a positive integer"),
    ("stop-at past steps", "train --steps 3 --stop-at 4", "--stop-at must be between 1"),
    ("seq-len zero", "train --seq-len 0", "--seq-len must be a positive integer"),
    ("bpe on markov vocab", "train --data {text} --tokenizer bpe", "needs a vocabulary of"),
    # --- hangs ---------------------------------------------------------------------------
    ("plan gpus beyond any cluster", "plan --gpus 80000000000", "beyond the largest cluster"),
    ("plan gpus huge", "plan --gpus 1000000", "(262,144 GPUs)"),
]


def _argv(template: str, tmp_path: Path) -> list[str]:
    return fill_argv(template, tmp_path, SETUPS)


def _run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def own_tmp(tmp_path, monkeypatch) -> Path:
    """The launcher's temporary files (``minipar-*``) go here, to be checked empty."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _one_line(code: int, err: str, says: str, want: int = 2) -> str:
    """The exit code and the one error line (after at most the note that tokenising
    started: a data file's fault shows only while it is read)."""
    lines = err.strip().splitlines()
    if len(lines) == 2 and lines[0].startswith("minipar: tokenising "):
        lines = lines[1:]
    assert code == want, err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert re.match(r"minipar \w+: error: ", lines[0]), lines[0]
    assert says in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("what,args,says", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_line(what, args, says, tmp_path, own_tmp, capsys) -> None:
    argv = _argv(args, tmp_path)
    for name in SETUPS:
        says = says.replace("{" + name + "}", str(tmp_path / name))
    children = len(psutil.Process().children(recursive=True))
    start = time.monotonic()
    code, _, err = _run_main(argv, capsys)
    assert time.monotonic() - start < 5
    _one_line(code, err, says)
    assert len(psutil.Process().children(recursive=True)) == children
    assert not list(own_tmp.glob("minipar-*"))
    assert not list(tmp_path.glob("**/*.tmp"))
    assert not list(tmp_path.glob("dir/cache/*"))  # no token cache entry of a refused run


def test_the_tables_hold_180_cases() -> None:
    from tests.test_cli_errors import CASES as CLI_CASES
    from tests.test_errors import CASES as DOC_CASES

    assert len(CASES) + len(CLI_CASES) + len(DOC_CASES) >= 180  # the command line's
    assert len(API_CASES) >= 29  # and the Python API's


def test_an_odd_sequence_length_is_fine_without_cp(capsys) -> None:
    assert main(["memory", "--seq-len", "33"]) == 0
    validate(TrainConfig(seq_len=33, steps=1))  # no "--cp 1 needs ..." line


def test_non_utf8_text_is_named_in_one_warning(tmp_path, capsys) -> None:
    from minipar.corpus import prepare

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "latin1.txt").write_bytes("café crème\n".encode("latin-1") * 20)
    (tmp_path / "d" / "utf8.txt").write_text("plain text\n" * 20)
    said = []
    prepare(str(tmp_path / "d"), cache=str(tmp_path / "cache"), progress=said.append)
    warnings = [s for s in said if s.startswith("warning")]
    assert warnings == [f"warning: 1 file(s) not UTF-8, their odd bytes read as U+FFFD: "
                        f"{tmp_path / 'd' / 'latin1.txt'} (byte 3)"]


# --- the Python API: TrainConfig's fields are checked, ValueError not TypeError ----------
API_CASES = [
    ({"lr": "0.1"}, "--lr must be float or None, got '0.1'"),
    ({"stop_at": "1"}, "--stop-at must be int or None, got '1'"),
    ({"save": 5}, "--save must be str or None, got 5"),
    ({"data": None}, "--data must be str, got None"),
    ({"dp": 2.0}, "--dp must be int, got 2.0"),
    ({"dp": True}, "--dp must be int, got True"),
    ({"sp": 1}, "--sp must be bool, got 1"),
    ({"steps": "20"}, "--steps must be int, got '20'"),
    ({"seed": 1.5}, "--seed must be int, got 1.5"),
    ({"timeout": "60"}, "--timeout must be float, got '60'"),
    ({"model": 7}, "--model must be str, got 7"),
    ({"overrides": []}, "--overrides must be dict, got []"),
    ({"resume": 3}, "--resume must be str or None, got 3"),
    ({"trace": b"t.json"}, "--trace must be str or None, got b't.json'"),
    ({"keep": None}, "--keep must be int, got None"),
    ({"dropout": "0.1"}, "--dropout must be float, got '0.1'"),
    ({"allow_nonfinite": "yes"}, "--allow-nonfinite must be bool, got 'yes'"),
    ({"timeout": 1e10}, "--timeout must be a positive number of seconds up to 604800"),
    ({"vocab": 2}, "--vocab 2 is too small for the generated Markov corpus"),
    ({"moe_experts": "4"}, "--moe-experts must be int or None, got '4'"),
    ({"capacity_factor": "1"}, "--capacity-factor must be float or None, got '1'"),
    ({"aux_loss_coef": float("inf")}, "--aux-loss-coef must be a finite number >= 0"),
    ({"ep": 2.0}, "--ep must be int, got 2.0"),
    ({"fp8": 1}, "--fp8 must be str or None, got 1"),
    ({"fp8_emulate": 1}, "--fp8-emulate must be bool, got 1"),
    ({"init_from": 5}, "--init-from must be str or None, got 5"),
    ({"text_field": None}, "--text-field must be str, got None"),
    ({"data_cache": 3}, "--data-cache must be str or None, got 3"),
    ({"grad_dtype": "fp16"}, "--grad-dtype must be one of fp32, bf16, got 'fp16'"),
]


@pytest.mark.parametrize("fields,says", API_CASES, ids=[str(c[0]) for c in API_CASES])
def test_the_python_api_raises_value_errors(fields, says) -> None:
    with pytest.raises(ValueError) as info:
        validate(TrainConfig(**fields))
    assert says in str(info.value) and "\n" not in str(info.value)


def test_a_huge_capacity_factor_is_every_slot_not_an_overflow() -> None:
    from minipar.model import MoE, get_config

    moe = MoE(get_config("moe-tiny").with_(capacity_factor=1e30))
    assert moe.capacity(32) == 32  # an expert takes each token of a sequence at most once


def test_timeouts_the_backends_take_are_accepted() -> None:
    from minipar.launch import TIMEOUT_MAX

    validate(TrainConfig(timeout=TIMEOUT_MAX))
    validate(TrainConfig(timeout=1))


# --- checkpoints that prove their integrity ------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A real one-rank checkpoint after 2 steps (the shard is about 5 MB)."""
    d = tmp_path_factory.mktemp("saved") / "ck"
    assert main(["train", "--steps", "2", "--quiet", "--save", str(d)]) == 0
    return d


def _copy(saved: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(saved, to)
    return to


def test_every_shard_has_its_digest_recorded(saved) -> None:
    import hashlib

    meta = checkpoint.inspect(str(saved))
    for fname, info in meta["files"].items():
        data = (Path(meta["path"]) / fname).read_bytes()
        assert info["sha256"] == hashlib.sha256(data).hexdigest()


def _damage(d: Path) -> Path:
    shard = d / "step-000002" / "rank-00000.pt"
    with open(shard, "r+b") as f:  # 4 KB overwritten inside: the zip directory is intact
        f.seek(200_000)
        f.write(b"\x11" * 4096)
    return shard


@pytest.mark.parametrize("command", ["train", "export", "export hf", "sample"])
def test_a_damaged_shard_is_named_by_whoever_reads_it(command, saved, tmp_path, own_tmp,
                                                      capsys) -> None:
    d = _copy(saved, tmp_path / "ck")
    shard = _damage(d)
    out = tmp_path / "m.safetensors"
    argv = {"train": ["train", "--steps", "4", "--quiet", "--resume", str(d)],
            "export": ["export", "--resume", str(d), "--out", str(out)],
            "export hf": ["export", "--resume", str(d), "--format", "hf", "--out", str(out)],
            "sample": ["sample", "--resume", str(d), "--prompt", "hello"]}[command]
    code, _, err = _run_main(argv, capsys)
    says = f"{shard} is damaged: its sha256 is not the one its meta.json recorded"
    line = _one_line(code, err, says, want=1 if command == "train" else 2)
    if command == "train":  # found by the rank reading it: the rank, the step, the file
        assert line.startswith("minipar train: error: rank 0 raised CheckpointError: ")
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))
    assert not list(own_tmp.glob("minipar-*"))


def _listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def test_an_unchanged_checkpoint_exports_and_resumes(saved, tmp_path, capsys) -> None:
    d = _copy(saved, tmp_path / "ck")
    assert main(["export", "--resume", str(d), "--out", str(tmp_path / "m.safetensors")]) == 0
    (tmp_path / "hf").mkdir()  # an empty directory is taken, renamed onto at the end
    assert main(["export", "--resume", str(d), "--format", "hf", "--out",
                 str(tmp_path / "hf")]) == 0
    assert _listing(tmp_path / "hf") == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "hf", "m.safetensors"]
    assert main(["train", "--steps", "3", "--quiet", "--resume", str(d), "--save",
                 str(d)]) == 0
    assert checkpoint.load(str(d))[1] == 3


def _poison(d: Path) -> None:
    """Make one weight NaN and record the file's new digest (a run that diverged)."""
    import hashlib

    path = d / "step-000002"
    blob = torch.load(path / "rank-00000.pt", weights_only=True)
    blob["weights"]["blocks.0.mlp.fc.weight"][0, 0] = float("nan")
    torch.save(blob, path / "rank-00000.pt")
    meta = json.loads((path / "meta.json").read_text())
    meta["files"]["rank-00000.pt"]["sha256"] = hashlib.sha256(
        (path / "rank-00000.pt").read_bytes()).hexdigest()
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("command", ["export", "export hf", "sample"])
def test_non_finite_weights_are_refused_by_sample_and_export(command, saved, tmp_path,
                                                             capsys) -> None:
    d = _copy(saved, tmp_path / "ck")
    _poison(d)
    out = str(tmp_path / "m.safetensors")
    argv = {"export": ["export", "--resume", str(d), "--out", out],
            "export hf": ["export", "--resume", str(d), "--format", "hf", "--out", out],
            "sample": ["sample", "--resume", str(d), "--temperature", "0"]}[command]
    code, _, err = _run_main(argv, capsys)
    _one_line(code, err, "weight blocks.0.mlp.fc.weight is not finite (the run diverged")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no output, no .tmp


@pytest.mark.parametrize("what", ["run.json", "tokenizer.json"])
def test_a_damaged_run_card_or_tokenizer_is_named(what, saved, tmp_path, capsys) -> None:
    d = _copy(saved, tmp_path / "ck")
    card = json.loads((d / "run.json").read_text())
    if what == "tokenizer.json":  # a text run's card names its tokenizer
        card["tokenizer_file"] = "tokenizer.json"
        (d / "run.json").write_text(json.dumps(card))
    (d / what).write_text("{garbage")
    code, _, err = _run_main(["sample", "--resume", str(d), "--prompt", "1"], capsys)
    _one_line(code, err, f"{d / what} is not a ")


# --- a non-finite loss stops the run, nothing of it is lost -------------------------------
def test_a_non_finite_loss_stops_the_run_and_keeps_its_record(tmp_path, own_tmp,
                                                              capsys) -> None:
    d, j = tmp_path / "ck", tmp_path / "run.json"
    code, out, err = _run_main(["train", "--steps", "4", "--lr", "1e9", "--quiet", "--save",
                                str(d), "--json", str(j)], capsys)
    line = _one_line(code, err, "the loss is not finite at step 1 (loss nan", want=1)
    record = json.loads(j.read_text())
    assert len(record["losses"]) == 1 and f"last finite loss {record['losses'][0]:.6g} " \
        "at step 0" in line
    assert "--allow-nonfinite" in line and "wrote no checkpoint" in line
    assert "    0  " in out  # the table of the steps done
    assert sorted(os.listdir(d)) == []  # nothing saved, no lock, no step-N.tmp
    assert not list(own_tmp.glob("minipar-*"))


def test_a_rank_that_fails_mid_run_leaves_every_step_done(tmp_path, own_tmp, monkeypatch,
                                                         capsys) -> None:
    """Rank 0, which reports the loss, raises as its fourth step starts (the ranks are
    forked: the patch reaches them), right after reporting the third: one error line
    naming it, and every step before it printed and written, its loss and rate, however
    seldom the progress bar is updated (``--log-every 2``) and however soon the failure
    follows."""
    from minipar import engine

    real = engine.train_step

    def fourth_step_fails(cfg, rm, parts, data, step):
        if step == 3 and rm.rank == 0:
            raise RuntimeError("a fault in step 3")
        return real(cfg, rm, parts, data, step)

    monkeypatch.setattr(engine, "train_step", fourth_step_fails)
    j = tmp_path / "run.json"
    code, out, err = _run_main(["train", "--dp", "2", "--steps", "6", "--log-every", "2",
                                "--quiet", "--json", str(j)], capsys)
    line = _one_line(code, err, "rank 0 raised RuntimeError: a fault in step 3", want=1)
    assert "Traceback" not in line
    record = json.loads(j.read_text())
    assert [s["step"] for s in record["progress"]] == [1, 2, 3]
    assert all(s["loss"] > 0 and s["tokens_per_s"] > 0 for s in record["progress"])
    assert "a fault in step 3" in record["error"] and record["config"]["dp"] == 2
    assert "the run reached step 3 before the failure" in out


@pytest.mark.parametrize("after", [0.0, 0.6, 1.5])
def test_a_ctrl_c_at_any_moment_of_the_start_is_one_line(after: float) -> None:
    """SIGINT while ``python -m minipar`` is still importing torch (seconds), or later:
    exit status 130 and one line, never a traceback (``minipar/startup.py``). Sent
    ``after`` seconds from the moment torch's first library is mapped into the process
    (the package's first line has run by then, on a loaded machine too). Python's own
    start, before that line, is Python's: not tried here."""
    run = subprocess.Popen([sys.executable, "-m", "minipar", "train", "--steps", "10000",
                            "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, cwd=ROOT)
    deadline = time.monotonic() + 60
    while "torch" not in Path(f"/proc/{run.pid}/maps").read_text():
        assert time.monotonic() < deadline and run.poll() is None, "torch never loaded"
        time.sleep(0.005)
    time.sleep(after)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 130, err
    assert "Traceback" not in err and err.strip().endswith("interrupted"), err


def test_an_interrupted_comparison_keeps_the_run(tmp_path, own_tmp, monkeypatch,
                                                capsys) -> None:
    """Ctrl-C while ``--compare`` trains the one-process reference: the run's table and
    JSON are there, the exit status is 130's."""
    import minipar.__main__ as cli

    def interrupted(cfg, record):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "check_run", interrupted)
    j = tmp_path / "run.json"
    code, out, err = _run_main(["train", "--steps", "2", "--quiet", "--compare", "--json",
                                str(j)], capsys)
    assert code == 130 and "the run's record is kept" in err
    assert len(json.loads(j.read_text())["losses"]) == 2 and "    1  " in out


def test_a_json_that_cannot_be_written_is_named(tmp_path) -> None:
    """``--json``: a failure names the path (a full device, a missing directory); a
    file is replaced whole, through a temporary beside it that does not stay."""
    import minipar.__main__ as cli

    j = tmp_path / "run.json"
    j.write_text('{"old": 1}')
    with pytest.raises(OSError) as full:
        cli._write_json("/dev/full", {"n": 1})
    assert full.value.filename == "/dev/full"
    with pytest.raises(OSError) as missing:
        cli._write_json(str(tmp_path / "no" / "run.json"), {"n": 1})
    assert missing.value.filename == str(tmp_path / "no" / "run.json")
    cli._write_json(str(j), {"new": 2})
    assert json.loads(j.read_text()) == {"new": 2} and os.listdir(tmp_path) == ["run.json"]


def test_allow_nonfinite_trains_on_but_never_saves_nan_weights(tmp_path, capsys) -> None:
    j, d = tmp_path / "run.json", tmp_path / "ck"
    code, _, err = _run_main(["train", "--steps", "3", "--lr", "1e9", "--quiet",
                              "--allow-nonfinite", "--save", str(d), "--json", str(j)], capsys)
    _one_line(code, err, "step 3 not saved: weight", want=1)
    assert os.listdir(d) == []
    losses = json.loads(j.read_text())["losses"]  # the record is kept all the same
    assert len(losses) == 3 and losses[-1] != losses[-1]  # NaN, as asked


# --- the lock holds --save for the whole run ------------------------------------------------
RACER = """
import sys, time, minipar.engine as e
real = e.prepare_data
def slow(cfg):  # a long tokenisation: the window the second run used to slip through
    open(sys.argv[2], "w").close()
    time.sleep(2)
    return real(cfg)
e.prepare_data = slow
from minipar.__main__ import main
sys.exit(main(["train", "--steps", "2", "--quiet", "--save", sys.argv[1]]))
"""


def test_two_processes_cannot_share_a_save_directory(tmp_path, capsys) -> None:
    d, marker = tmp_path / "ck", tmp_path / "tokenising"
    first = subprocess.Popen([sys.executable, "-c", RACER, str(d), str(marker)],
                             env={**os.environ, "PYTHONPATH": str(ROOT)},
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists()
    code, _, err = _run_main(["train", "--steps", "3", "--quiet", "--save", str(d)], capsys)
    _one_line(code, err, f"--save {d} is in use by another run (process {first.pid})")
    assert first.wait(timeout=120) == 0, first.stderr.read()
    assert checkpoint.load(str(d))[1] == 2  # the first run's, untouched


def test_a_run_that_finished_between_check_and_lock_is_not_overwritten(tmp_path,
                                                                       monkeypatch) -> None:
    import minipar.engine as engine

    d = tmp_path / "ck"
    real = engine.validate

    def meanwhile(cfg, **kw):  # another run saves into d right after our check
        real(cfg, **kw)
        fake_checkpoint(d)

    monkeypatch.setattr(engine, "validate", meanwhile)
    with pytest.raises(checkpoint.CheckpointError, match="already holds another run's"):
        engine.train(TrainConfig(steps=1, save=str(d)))
    assert checkpoint.load(str(d))[1] == 1 and not (d / checkpoint.LOCK).exists()


def test_keep_prunes_only_its_own_checkpoints(tmp_path, capsys) -> None:
    """... and a save killed mid-way (kill -9) leaves a ``step-N.tmp`` of shards, which
    the next run holding the directory removes; a user's ``step-N.tmp`` stays."""
    d = tmp_path / "ck"
    (d / "step-000002.keepme").mkdir(parents=True)
    (d / "step-000002.keepme" / "notes.txt").write_text("mine")
    (d / "step-000009").mkdir()  # no meta.json: not a checkpoint
    (d / "step-000007.tmp").mkdir()  # a killed save's
    (d / "step-000007.tmp" / "rank-00000.pt").write_bytes(b"half a shard")
    (d / "step-000008.tmp").mkdir()  # a user's
    (d / "step-000008.tmp" / "notes.txt").write_text("mine")
    (d / checkpoint.LOCK).write_text("999999999")  # the killed run's lock: stale
    assert main(["train", "--steps", "3", "--quiet", "--save", str(d), "--save-every", "1",
                 "--keep", "1"]) == 0
    assert sorted(n for n in os.listdir(d) if n.startswith("step-")) == [
        "step-000002.keepme", "step-000003", "step-000008.tmp", "step-000009"]


# --- a full disk while saving ------------------------------------------------------------------
FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG, not a kill
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
from minipar.__main__ import main
sys.exit(main(sys.argv[2:]))
"""


def _limited(limit: int, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", FULL_DISK, str(limit), *argv], cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(cwd)},
                          capture_output=True, text=True, timeout=120)


def test_a_full_disk_while_saving_keeps_the_losses_and_leaves_no_tmp(tmp_path) -> None:
    d, j = tmp_path / "ck", tmp_path / "run.json"
    run = _limited(1_000_000, "train", "--steps", "2", "--quiet", "--save", str(d),
                   "--json", str(j), cwd=tmp_path)  # the 5 MB shard fails, the JSON fits
    shard = d / "step-000002.tmp" / "rank-00000.pt"
    assert run.returncode == 1
    assert run.stderr.strip() == f"minipar train: error: --save {d}: {shard}: File too large"
    assert len(json.loads(j.read_text())["losses"]) == 2
    assert "    1  " in run.stdout
    assert os.listdir(d) == []  # no step-000002.tmp, no latest, no lock
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("minipar-")]


def test_a_full_disk_while_tokenising_names_the_file(tmp_path) -> None:
    (tmp_path / "big.txt").write_text("some text that is long enough\n" * 40_000)
    cache = tmp_path / "cache"
    run = _limited(200_000, "train", "--steps", "1", "--quiet", "--data",
                   str(tmp_path / "big.txt"), "--data-cache", str(cache), cwd=tmp_path)
    line = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert re.fullmatch(r"minipar train: error: \S+/tokens\.bin: File too large", line), line
    assert not list(cache.glob("**/*.tmp")) and not list(cache.glob("**/tokens.json"))


# --- --timeout: no progress for that long, not the run's length ---------------------------------
def _slow_but_moving(seconds: float) -> int:
    from minipar.comm import Comm

    comm, beats, end = Comm(dim="world"), 0, time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.3)
        comm.barrier()  # a collective finished: a heartbeat
        beats += 1
    return beats


def _silent(seconds: float) -> None:
    time.sleep(seconds)


def test_a_slow_run_that_keeps_moving_outlives_its_timeout() -> None:
    from minipar.launch import launch

    start = time.monotonic()
    assert min(launch(_slow_but_moving, 2, args=(4.0,), timeout=2)) >= 5
    assert time.monotonic() - start >= 4


def test_a_rank_without_progress_is_reported_after_the_timeout() -> None:
    from minipar.launch import RankTimeout, launch

    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        launch(_silent, 1, args=(60,), timeout=2)
    assert time.monotonic() - start < 15
    assert str(info.value).startswith("timed out: rank 0 made no progress (no collective "
                                      "finished, no step done) for 2 s; where each rank was:")
    assert "  rank 0: running code outside minipar's counted calls" in str(info.value)


def _slow_to_start(seconds: float) -> None:
    from minipar.comm import Comm
    from minipar.launch import heartbeat

    if Comm(dim="world").rank == 1:
        time.sleep(seconds)  # building: its peer waits in the first collective meanwhile
    else:
        heartbeat()  # progress of its own (a checkpoint's bytes read)
    for _ in range(3):
        Comm(dim="world").barrier()


def test_start_up_is_not_counted_against_the_timeout() -> None:
    from minipar.launch import launch

    launch(_slow_to_start, 2, args=(3.0,), timeout=1, startup=30)


def test_a_rank_that_never_starts_is_reported_after_the_start_up_allowance() -> None:
    from minipar.launch import RankTimeout, launch

    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        launch(_slow_to_start, 2, args=(60.0,), timeout=1, startup=4)
    assert 4 <= time.monotonic() - start < 20
    report = str(info.value)
    assert report.startswith("timed out: rank 1 made no progress (no collective finished, "
                             "no step done) for 4 s since the launch (the start-up's")
    assert "  rank 1: running code outside minipar's counted calls (no counted collective " \
           "entered yet) (no progress yet: still starting, " in report
    assert "  rank 0: inside barrier on world, shape (1,) float32 (last progress " in report


def test_a_short_timeout_does_not_call_a_starting_run_hung(capsys) -> None:
    """Start-up (forking, joining, the build, a first step) takes seconds on a loaded
    machine: a --timeout of one second counts from the first collective a rank finishes."""
    assert main(["train", "--dp", "2", "--steps", "1", "--timeout", "1", "--quiet"]) == 0


# --- a stray torchrun environment: one line within --timeout, no hang ---------------------------
def test_a_stray_torchrun_environment_fails_within_the_timeout(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "minipar", "train", "--dp", "2", "--steps",
                          "1", "--quiet", "--timeout", "2"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert time.monotonic() - start < 30
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert lines[0].startswith("minipar train: note: joining the job that RANK=0")
    assert lines[-1].startswith("minipar train: error: could not join the job that RANK=0 "
                                f"WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={port}")
    assert lines[-1].endswith("unset them to train on this machine alone")


# --- a closed terminal (SIGHUP) or kill -9 of the launcher: no rank, no file left ---------------
def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=["SIGHUP", "kill -9"])
def test_a_killed_launcher_leaves_no_rank_and_no_file(sig, tmp_path) -> None:
    """SIGHUP runs the launcher's own cleanup; after kill -9 the ranks end themselves
    (each watches its parent) and the launcher's keeper removes its temporary directory."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    cli = subprocess.Popen([sys.executable, "-m", "minipar", "train", "--dp", "2", "--steps",
                            "100000", "--quiet"], cwd=tmp_path, env=env,
                           stderr=subprocess.PIPE, text=True)
    me = psutil.Process(cli.pid)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sum(
                p.name().startswith("minipar-rank") for p in _alive(me.children())) < 2:
            time.sleep(0.1)
        started = me.children(recursive=True)  # two ranks and the keeper
        assert len(started) == 3
        assert sorted(f.name for f in tmp_path.glob("minipar-run-*/*")) == [
            "rank0.log", "rank0.progress", "rank1.log", "rank1.progress", "store"]
    finally:
        cli.send_signal(sig)
        cli.communicate(timeout=30)
    assert cli.returncode == (128 + sig if sig == signal.SIGHUP else -sig)
    deadline = time.monotonic() + 5
    while (_alive(started) or list(tmp_path.glob("minipar-*"))) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(started)
    assert not list(tmp_path.glob("minipar-*"))


# Each rank starts a sleeper in its group, one in a session of its own (its child) and
# an orphan in a session of its own (a second Python started it and exited), then
# reports their pids; the keeper is never told of rank 1 (as if the launcher died
# between starting it and telling the keeper).
STRAYS_SCRIPT = """
import importlib, os, subprocess, sys, time
launcher = importlib.import_module("minipar.launch")

def rank(pidfile):
    sleepers = [subprocess.Popen(["sleep", "120"]).pid,
                subprocess.Popen(["sleep", "120"], start_new_session=True).pid,
                int(subprocess.run([sys.executable, "-I", "-S", "-c",
                    "import subprocess as s; print(s.Popen(['sleep', '120'], "
                    "start_new_session=True, stdout=s.DEVNULL).pid)"],
                    stdout=subprocess.PIPE, text=True).stdout)]
    with open(pidfile, "a") as f:
        f.write(" ".join(map(str, [os.getpid(), *sleepers])) + chr(10))
    time.sleep(120)

class HeardOfRankZeroOnly(launcher._Scratch):
    def watch(self, pid):
        if not hasattr(self, "told"):
            super().watch(pid)
            self.told = pid

launcher._Scratch = HeardOfRankZeroOnly
launcher.launch(rank, 2, args=(sys.argv[1],), timeout=300)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="elsewhere a rank's orphan in a session of its own is beyond reach")
def test_kill_9_of_a_launcher_leaves_no_process_of_the_run(tmp_path) -> None:
    """What left a rank's process group (``setsid``: a compile worker pool, a loader, a
    ``subprocess``), an orphan among them, and a rank the keeper never heard of: none
    survives ``kill -9`` of the launcher, and no file does."""
    pidfile = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    cli = subprocess.Popen([sys.executable, "-c", STRAYS_SCRIPT, str(pidfile)], cwd=tmp_path,
                           env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
                not pidfile.exists() or pidfile.read_text().count("\n") < 2):
            time.sleep(0.05)
        pids = [int(p) for p in pidfile.read_text().split()]
        assert len(pids) == 8
        started = [psutil.Process(p) for p in pids]
        started += [p for p in psutil.Process(cli.pid).children(recursive=True)
                    if p.pid not in pids]  # the keeper, and anything else of the run's
        what = {p.pid: " ".join(p.cmdline())[:60] for p in started}
    finally:
        cli.kill()
        cli.wait(30)
    deadline = time.monotonic() + 5
    while (_alive(started) or list(tmp_path.glob("minipar-*"))) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _alive(started)
    for p in left:  # (not left to the machine's other work)
        p.kill()
    assert not left, "survived the launcher: " + "; ".join(what[p.pid] for p in left)
    assert not list(tmp_path.glob("minipar-*"))
