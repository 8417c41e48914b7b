"""Real text: sources, tokenizers, and the memory-mapped token file ranks read from.

``--data SOURCE`` names one of

* ``markov``: the generated corpus (``minipar.data.MarkovData``), the default;
* ``pystdlib``: a built-in real corpus that needs no network, the Python standard
  library's own ``.py`` files (found with ``sysconfig``): a deterministic subset of
  about 4 MB, so tokenising takes seconds;
* a text file, or a directory of text files (read recursively, in sorted order);
* JSON Lines (``.jsonl``: one JSON object a line, its ``--text-field``, default
  ``text``), Parquet (``.parquet``, or a directory of them: that column, read one
  record batch at a time with ``pyarrow``), or a Hugging Face ``datasets`` directory
  written by ``save_to_disk`` (its ``train`` split when it holds several);
* a ``.bin`` token file: a flat little-endian uint16 or uint32 array, the convention
  nanoGPT made common. The dtype (and vocabulary size, and optionally a tokenizer) come
  from a sidecar ``NAME.json``; without one, from the vocabulary (uint16 up to 65,536).

Text is tokenised once, before any rank starts, into such a token file in a cache
directory (``~/.cache/minipar`` or ``--data-cache``), with the tokenizer beside it, so
the second run starts at once; documents are streamed (one file, line or record batch
at a time), never the whole corpus in memory. Tokenizers: ``byte`` (the UTF-8 bytes:
vocabulary 256, nothing to train), ``bpe`` (byte-level BPE trained with Hugging Face
``tokenizers`` on the corpus itself, to the model's vocabulary size), or a
``tokenizer.json`` file of that library (e.g. a GPT-2 model directory's).

``TokenData`` serves the training contract of ``minipar.data``: row r of step s is a
window of ``seq_len + 1`` tokens starting at an offset hashed from (seed, s, r), read
from the memory-mapped file by one vectorised fancy index (only the pages touched are
read). The last ``VAL_FRACTION`` of the tokens is held out for validation.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from minipar.checks import require
from minipar.data import SPLITS, MarkovData, counter_hash

BUILTIN = ("markov", "pystdlib")
TOKENIZERS = ("byte", "bpe")
VAL_FRACTION = 0.05
PYSTDLIB_BYTES = 4 * 2**20  # enough text to learn from; tokenises in seconds
EOT = "<|endoftext|>"  # BPE's document separator (id 0)
DATASETS_MARKS = ("dataset_info.json", "dataset_dict.json")  # a save_to_disk directory
BINARY_SNIFF = 4096  # a NUL byte among a file's first bytes: binary, not text


def default_cache() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "minipar")


# --- sources ---------------------------------------------------------------------------

def pystdlib_files(limit: int = PYSTDLIB_BYTES) -> list[str]:
    """The standard library's ``.py`` files (no tests, no vendored packages), sorted,
    until ``limit`` bytes: the same files for the same Python, on any machine."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    found = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip)
        found += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    out, total = [], 0
    for path in sorted(found, key=lambda p: os.path.relpath(p, root)):
        size = os.path.getsize(path)
        if total + size > limit:
            break
        out.append(path)
        total += size
    return out


def text_files(source: str) -> list[str]:
    """The text files a SOURCE names (not for ``.bin`` token files or ``markov``)."""
    if source == "pystdlib":
        return pystdlib_files()
    if os.path.isfile(source):
        return [source]
    found = []
    for d, dirs, files in os.walk(source):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        found += [p for p in (os.path.join(d, f) for f in sorted(files) if f[0] != ".")
                  if os.path.isfile(p)]  # regular files: a FIFO or a socket would block
    return found


def data_format(source: str) -> str:
    """How SOURCE's documents are read: ``text``, ``jsonl``, ``parquet`` or ``datasets``
    (a directory of only ``.jsonl`` or only ``.parquet`` files is read as that)."""
    if os.path.isdir(source) and any(os.path.isfile(os.path.join(source, m))
                                     for m in DATASETS_MARKS):
        return "datasets"
    names = [source] if os.path.isfile(source) else text_files(source) \
        if os.path.isdir(source) else []
    for fmt in ("jsonl", "parquet"):
        if names and all(n.endswith(f".{fmt}") for n in names):
            return fmt
    return "text"


def check_tokenizer(tokenizer: str) -> None:
    if tokenizer not in TOKENIZERS and not (tokenizer.endswith(".json")
                                            and os.path.isfile(tokenizer)):
        raise ValueError(f"--tokenizer must be one of {', '.join(TOKENIZERS)} or a "
                         f"tokenizer.json file, got {tokenizer!r}")


def check_source(source: str, tokenizer: str, text_field: str = "text") -> None:
    """Raise ``ValueError`` (one line) for a SOURCE that cannot be read."""
    check_tokenizer(tokenizer)
    if source in BUILTIN:
        return
    if source.endswith(".bin"):
        if not os.path.isfile(source):
            raise ValueError(f"--data {source}: no such token file")
        if os.path.getsize(source) == 0:
            raise ValueError(f"--data {source}: the token file is empty")
        sidecar(source)  # (one line for a sidecar that cannot be used)
        return
    if os.path.isfile(source) or os.path.isdir(source):
        files = text_files(source)
        if not files:
            raise ValueError(f"--data {source}: the directory holds no files")
        if data_format(source) != "text":
            next(documents(source, text_field), None)  # the library, the field: or why not
        elif not any(_may_hold_text(p) for p in files):
            what = "the file is" if files == [source] else f"its {len(files)} files are"
            raise ValueError(f"--data {source}: no text found ({what} empty or binary; a "
                             "token file's name ends in .bin)")
        return
    raise ValueError(f"--data {source!r} is not a file, a directory, a .bin token file or a "
                     f"built-in corpus ({', '.join(BUILTIN)})")


def documents(source: str, text_field: str = "text",
              not_utf8: list[str] | None = None) -> Iterator[str]:
    """SOURCE's non-empty documents, one at a time: a text file each, a JSON line's or
    a table row's ``text_field``. Text files not in UTF-8 are added to ``not_utf8``."""
    fmt = data_format(source)
    if fmt == "text":
        yield from (t for t in (_read_text(p, not_utf8) for p in text_files(source)) if t)
    elif fmt == "jsonl":
        for path in text_files(source):
            yield from _jsonl_texts(path, text_field)
    else:
        for batch in _table_batches(source, fmt, text_field):
            yield from (t for t in batch if t)


def _jsonl_texts(path: str, text_field: str) -> Iterator[str]:
    """The ``text_field`` of each line of a JSON Lines file (UTF-8, as the format is)."""
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"--data {path}:{i}: not JSON ({e.msg})") from None
                    text = _field(record, text_field, f"{path}:{i}")
                    if text:
                        yield text
    except UnicodeDecodeError as e:
        raise ValueError(f"--data {path}: not UTF-8 (byte {e.object[e.start]:#04x}: "
                         f"{e.reason}); JSON Lines are UTF-8") from None


def _field(record, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        raise ValueError(f"--data {where}: no text field {text_field!r} (pass --text-field)")
    return record[text_field]


def _table_batches(source: str, fmt: str, text_field: str) -> Iterator[list]:
    """Column ``text_field`` of Parquet files or a ``datasets`` directory, a record
    batch at a time (memory-mapped Arrow: only the batch read is in memory)."""
    if fmt == "parquet":
        pq = require("pyarrow.parquet", "Parquet --data")
        arrow_error = require("pyarrow", "Parquet --data").ArrowException
        for path in text_files(source):
            try:
                f = pq.ParquetFile(path)
                names = f.schema_arrow.names
                if text_field in names:
                    for b in f.iter_batches(batch_size=256, columns=[text_field]):
                        yield b.column(0).to_pylist()
            except arrow_error as e:  # a damaged or truncated file
                raise ValueError(f"--data {path}: not a readable Parquet file "
                                 f"({type(e).__name__}: {str(e)[:100]})") from None
            if text_field not in names:
                raise ValueError(f"--data {path}: no column {text_field!r} (columns: "
                                 f"{', '.join(names)}; pass --text-field)")
        return
    datasets = require("datasets", "a datasets --data directory")
    ds = datasets.load_from_disk(source)
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    if text_field not in ds.column_names:
        raise ValueError(f"--data {source}: no column {text_field!r} (columns: "
                         f"{', '.join(ds.column_names)}; pass --text-field)")
    for b in ds.select_columns([text_field]).iter(batch_size=256):
        yield b[text_field]


def _is_binary(head: bytes) -> bool:
    """Whether a file whose first bytes are ``head`` is binary, not text."""
    return b"\0" in head[:BINARY_SNIFF]


def _may_hold_text(path: str) -> bool:
    """Whether ``_read_text`` would find any text in ``path`` (its first bytes only)."""
    with open(path, "rb") as f:
        head = f.read(BINARY_SNIFF)
    return bool(head) and not _is_binary(head)


def _read_text(path: str, not_utf8: list[str] | None = None) -> str | None:
    """The file's text; None for a binary file. Bytes that are not UTF-8 become U+FFFD,
    and the file is added to ``not_utf8`` (a warning names it)."""
    with open(path, "rb") as f:
        raw = f.read()
    if _is_binary(raw):
        return None  # binary: not text
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if not_utf8 is not None:
            not_utf8.append(f"{path} (byte {e.start})")
        return raw.decode("utf-8", errors="replace")


# --- tokenizers --------------------------------------------------------------------------

class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to learn, nothing unknown."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", "replace")

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"minipar_tokenizer": "byte"}, f)


class BPETokenizer:
    """Byte-level BPE (GPT-2's scheme) from Hugging Face ``tokenizers``."""

    kind = "bpe"

    def __init__(self, tok) -> None:
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()

    @classmethod
    def train(cls, texts: Iterator[str], vocab_size: int) -> BPETokenizer:
        # optional: byte and Markov data run without it
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])

    def save(self, path: str) -> None:
        self.tok.save(path)


def load_tokenizer(path: str | None):
    """A tokenizer saved by ``save`` (``None``: none known, ids are shown as numbers)."""
    if path is None or not os.path.exists(path):
        return None
    try:
        if not os.path.isfile(path):  # a FIFO would block the read forever
            raise OSError("not a regular file")
        with open(path, encoding="utf-8") as f:
            head = json.load(f)
        if head.get("minipar_tokenizer") == "byte":
            return ByteTokenizer()
        from tokenizers import Tokenizer  # optional: byte and Markov data run without it

        return BPETokenizer(Tokenizer.from_file(path))
    except Exception as e:  # json's errors, tokenizers' (a plain Exception), a non-dict
        raise ValueError(f"{path} is not a tokenizer file ({type(e).__name__}: "
                         f"{str(e)[:100]})") from None


# --- the token file ----------------------------------------------------------------------

TOKEN_DTYPES = ("uint16", "uint32")  # what a token file may hold


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def sidecar(bin_path: str) -> dict:
    """``NAME.json`` beside ``NAME.bin`` (dtype, vocab_size, tokenizer), or {}; one
    ``ValueError`` line naming it when it cannot be used (not JSON, a dtype that is not
    a token id's: float32 tokens would read as garbage ids)."""
    path = os.path.splitext(bin_path)[0] + ".json"
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise ValueError(f"--data {bin_path}: its sidecar {path} is not readable JSON "
                         f"({type(e).__name__}: {e})") from None
    if meta.get("dtype", "uint16") not in TOKEN_DTYPES:
        raise ValueError(f"--data {bin_path}: its sidecar {path} says dtype "
                         f"{meta['dtype']!r}; token files hold {' or '.join(TOKEN_DTYPES)}")
    vocab = meta.get("vocab_size")
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int)
                              or vocab < 1):
        raise ValueError(f"--data {bin_path}: its sidecar {path} says vocab_size "
                         f"{vocab!r}; a positive integer is needed")
    if meta.get("tokenizer"):  # relative to the sidecar
        meta["tokenizer"] = os.path.join(os.path.dirname(path), meta["tokenizer"])
    return meta


def _cache_key(source: str, tokenizer: str, vocab_size: int, files: list[str],
               text_field: str = "text") -> str:
    structured = data_format(source) != "text"
    h = hashlib.sha1(f"{tokenizer} {vocab_size} {sys.version_info[:2]}".encode())
    for p in files + ([tokenizer] if tokenizer not in TOKENIZERS else []):
        st = os.stat(p)
        h.update(f"{os.path.abspath(p)} {st.st_size} {st.st_mtime_ns}\n".encode())
    if structured:
        h.update(f"field {text_field}".encode())
    name = "pystdlib" if source == "pystdlib" else os.path.basename(source.rstrip("/"))
    kind = tokenizer if tokenizer in TOKENIZERS else "file"
    return f"{name}-{kind}{vocab_size if kind == 'bpe' else ''}-{h.hexdigest()[:12]}"


def _tokenizer_for(tokenizer: str, vocab_size: int, texts):
    """The byte tokenizer, BPE trained on ``texts()`` (a fresh iterator), or a file's."""
    if tokenizer == "byte":
        return ByteTokenizer()
    if tokenizer == "bpe":
        return BPETokenizer.train(texts(), vocab_size)
    from tokenizers import Tokenizer  # optional: byte and Markov data run without it

    return BPETokenizer(Tokenizer.from_file(tokenizer))


def prepare(source: str, tokenizer: str = "byte", vocab_size: int = 256,
            cache: str | None = None, progress=None, text_field: str = "text") -> str:
    """The ``.bin`` token file for SOURCE, tokenising it into the cache the first time.

    Returns its path; ``NAME.json`` beside it holds dtype, vocab_size, token count and
    the tokenizer's file. Documents are streamed: BPE training reads them once, and
    encoding once more, a batch at a time, appending to the file (documents each
    followed by ``<|endoftext|>`` when the tokenizer has it, else joined by a newline).
    Written to a temporary name and renamed: a concurrent or interrupted preparation
    never leaves a half-written file where a run would read it.
    """
    if source.endswith(".bin"):
        return source
    files = text_files(source)
    out_dir = os.path.join(cache or default_cache(),
                           _cache_key(source, tokenizer, vocab_size, files, text_field))
    bin_path = os.path.join(out_dir, "tokens.bin")
    if os.path.exists(os.path.join(out_dir, "tokens.json")):
        return bin_path  # the second run: nothing to do
    os.makedirs(out_dir, exist_ok=True)
    not_utf8: list[str] = []
    if progress is not None:
        progress(f"tokenising {source} ({data_format(source)}, {len(files)} files) with "
                 f"{tokenizer}; cached in {out_dir}")
    texts = lambda: documents(source, text_field, not_utf8)  # noqa: E731 (a fresh pass)
    pid = os.getpid()
    count = n_docs = 0
    try:
        tok = _tokenizer_for(tokenizer, vocab_size, texts)
        dtype = token_dtype(tok.vocab_size)
        with open(bin_path + f".{pid}.tmp", "wb") as out:
            if tok.kind == "byte":
                for n_docs, text in enumerate(texts(), 1):
                    sep = "\n" if n_docs > 1 else ""
                    ids = np.frombuffer((sep + text).encode("utf-8"), dtype=np.uint8)
                    out.write(ids.astype(dtype).tobytes())  # (a full disk: errno)
                    count += len(ids)
            else:
                eot = tok.tok.token_to_id(EOT)  # without one: a newline between, as bytes
                end = [] if eot is None else [eot]
                it = texts()
                while batch := list(itertools.islice(it, 256)):
                    if eot is None:
                        batch = [("\n" if n_docs + j else "") + t for j, t in enumerate(batch)]
                    n_docs += len(batch)
                    for x in tok.encode_batch(batch):
                        out.write(np.asarray(x + end, dtype=dtype).tobytes())
                        count += len(x) + len(end)
        if not n_docs:
            raise ValueError(f"--data {source}: no text found")
    except BaseException as e:  # a full disk, an unreadable record: nothing left behind
        with contextlib.suppress(OSError):
            os.remove(bin_path + f".{pid}.tmp")
        with contextlib.suppress(OSError):
            os.rmdir(out_dir)  # when empty (another run may be preparing it too)
        if isinstance(e, OSError) and e.filename is None:  # a write: name the file
            raise OSError(e.errno, e.strerror or str(e), bin_path) from None
        raise
    os.replace(bin_path + f".{pid}.tmp", bin_path)
    tok.save(os.path.join(out_dir, f"tokenizer.json.{pid}.tmp"))
    os.replace(os.path.join(out_dir, f"tokenizer.json.{pid}.tmp"),
               os.path.join(out_dir, "tokenizer.json"))
    meta = {"dtype": dtype.name, "vocab_size": tok.vocab_size, "tokens": count,
            "tokenizer": "tokenizer.json", "source": source, "documents": n_docs}
    with open(os.path.join(out_dir, f"tokens.json.{pid}.tmp"), "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(os.path.join(out_dir, f"tokens.json.{pid}.tmp"),
               os.path.join(out_dir, "tokens.json"))
    not_utf8 = list(dict.fromkeys(not_utf8))  # (BPE reads each file twice)
    if not_utf8:
        say = progress or (lambda text: print(f"minipar: {text}", file=sys.stderr))
        say(f"warning: {len(not_utf8)} file(s) not UTF-8, their odd bytes read as U+FFFD: "
            f"{not_utf8[0]}{', ...' if len(not_utf8) > 1 else ''}")
    return bin_path


def open_tokens(bin_path: str, vocab_size: int) -> np.memmap:
    """Memory-map a token file (dtype from its sidecar, else from the vocabulary)."""
    meta = sidecar(bin_path)
    dtype = np.dtype(meta.get("dtype", token_dtype(meta.get("vocab_size", vocab_size))))
    dtype = dtype.newbyteorder("<")
    size = os.path.getsize(bin_path)
    if size % dtype.itemsize:
        raise ValueError(f"--data {bin_path}: {size} bytes is not a whole number of "
                         f"{dtype.name} tokens")
    return np.memmap(bin_path, dtype=dtype, mode="r")


def split_sizes(n_tokens: int, seq_len: int, val_fraction: float = VAL_FRACTION
                ) -> tuple[int, int]:
    """(training, held-out) token counts of a corpus of ``n_tokens``: the last
    ``val_fraction`` held out, each part at least one window (``seq_len + 1`` tokens)
    and one start past it. One ``ValueError`` line when the corpus is too small."""
    need = seq_len + 2
    n_val = max(need, int(n_tokens * val_fraction))
    if n_tokens - n_val < need:
        raise ValueError(f"the corpus has {n_tokens} tokens: too few for sequences of "
                         f"{seq_len} with a held-out split (need {2 * need}); give more "
                         "text or a shorter --seq-len")
    return n_tokens - n_val, n_val


def held_out_rows(n_val: int, seq_len: int) -> int:
    """The distinct sequences a held-out split of ``n_val`` tokens holds: one per start
    (``TokenData.rows`` draws its windows' starts from these)."""
    return n_val - seq_len


@dataclass
class TokenData:
    """Training rows from a memory-mapped token file (the ``minipar.data`` contract)."""

    tokens: np.ndarray  # the whole file, memory-mapped
    vocab_size: int
    seq_len: int
    seed: int = 0
    val_fraction: float = VAL_FRACTION

    def __post_init__(self) -> None:
        self.n_train, self.n_val = split_sizes(len(self.tokens), self.seq_len,
                                               self.val_fraction)

    @classmethod
    def open(cls, bin_path: str, vocab_size: int, seq_len: int, seed: int = 0) -> TokenData:
        return cls(open_tokens(bin_path, vocab_size), vocab_size, seq_len, seed)

    def rows(self, step: int, row_indices, split: str = "train"
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of step ``step``: windows at hashed offsets in the train or val split."""
        rows = np.asarray(row_indices, dtype=np.int64).reshape(-1)
        base, span = (0, self.n_train) if split == "train" else (self.n_train, self.n_val)
        h = counter_hash(self.seed, SPLITS.index(split), step, rows, 1)[:, 0]
        starts = base + (h % np.uint64(span - self.seq_len)).astype(np.int64)
        window = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        tokens = torch.from_numpy(self.tokens[window].astype(np.int64))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows(step, range(batch_size))


def tokenizer_path(bin_path: str) -> str | None:
    return sidecar(bin_path).get("tokenizer")


def data_vocab(source: str, tokenizer: str, vocab_size: int | None) -> int | None:
    """The vocabulary a SOURCE imposes on the model (``None``: the model's own).

    Byte-level text: 256. A ``.bin`` file with a sidecar: its vocabulary rounded up to a
    multiple of 8 (tensor parallelism splits the vocabulary). BPE: the model's.
    """
    if source == "markov":
        return None
    if source.endswith(".bin"):
        v = sidecar(source).get("vocab_size") if os.path.isfile(source) else None
        return None if v is None else -(-int(v) // 8) * 8
    if tokenizer in TOKENIZERS:
        return 256 if tokenizer == "byte" else vocab_size
    return -(-tokenizer_vocab(tokenizer) // 8) * 8  # a tokenizer.json's, rounded up


def tokenizer_vocab(path: str) -> int:
    """The vocabulary of a ``tokenizer.json`` file (Hugging Face ``tokenizers``)."""
    from tokenizers import Tokenizer  # optional: byte and Markov data run without it

    try:
        return Tokenizer.from_file(path).get_vocab_size()
    except Exception as e:  # tokenizers raises a plain Exception
        raise ValueError(f"--tokenizer {path} is not a tokenizer file ({type(e).__name__}: "
                         f"{str(e)[:100]})") from None


# --- what the engine calls ----------------------------------------------------------------

def _say(text: str) -> None:
    print(f"minipar: {text}", file=sys.stderr)


def token_count(cfg, vocab_size: int) -> int:
    """How many tokens ``cfg.data`` (text or a ``.bin`` file) holds: text is tokenised
    into the cache for it (once: the run's ranks find it there)."""
    path = prepare(cfg.data, cfg.tokenizer, vocab_size, cfg.data_cache, progress=_say,
                   text_field=cfg.text_field)
    return len(open_tokens(path, vocab_size))


def prepare_data(cfg) -> str | None:
    """Before any rank starts: tokenise ``cfg.data`` into the cache (once), and check a
    ``.bin`` file's tokens fit the model's vocabulary. Returns the token file's path."""
    if cfg.data == "markov":
        return None
    vocab = cfg.model_config().vocab_size
    path = prepare(cfg.data, cfg.tokenizer, vocab, cfg.data_cache, progress=_say,
                   text_field=cfg.text_field)
    if cfg.data.endswith(".bin"):
        tokens = open_tokens(path, vocab)
        biggest = int(tokens.max()) if len(tokens) else 0  # one streaming pass
        if biggest >= vocab:
            raise ValueError(f"--data {path} holds token {biggest}: the model's vocabulary "
                             f"({vocab}) is too small; pass --vocab {biggest + 1} or more")
    return path


def make_data(cfg, vocab_size: int, seq_len: int):
    """The run's data source on this rank (``minipar.data.TokenSource``)."""
    if cfg.data == "markov":
        return MarkovData(vocab_size, seq_len, seed=cfg.seed)
    path = prepare(cfg.data, cfg.tokenizer, vocab_size, cfg.data_cache,  # the cache
                   text_field=cfg.text_field)
    return TokenData.open(path, vocab_size, seq_len, seed=cfg.seed)
