"""``--data`` in the formats people have: JSON Lines, Parquet (a file or a directory),
a Hugging Face ``datasets`` directory (``save_to_disk``), each streamed into the same
token cache as text: the same documents give the same tokens in every format, and a
large file is tokenised in a fraction of its size in memory. Every file is made here.
"""

from __future__ import annotations

import json
import os
import tracemalloc

import numpy as np
import pytest

from minipar import corpus
from minipar.__main__ import main

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

DOCS = [f"document {i}: the quick brown fox, {'é' * (i % 3)} jumps {i} times.\n"
        for i in range(60)]


def write_jsonl(path, docs, field: str = "text") -> str:
    with open(path, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")
    return str(path)


def write_parquet(path, docs, field: str = "text", row_group: int = 16) -> str:
    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), str(path),
                   row_group_size=row_group)
    return str(path)


def formats(tmp_path) -> dict[str, str]:
    """The same documents in every format ``--data`` reads."""
    text = tmp_path / "text"
    text.mkdir()
    for i, d in enumerate(DOCS):
        (text / f"{i:03d}.txt").write_text(d)
    shards = tmp_path / "parquet"
    shards.mkdir()
    write_parquet(shards / "a.parquet", DOCS[:25])
    write_parquet(shards / "b.parquet", DOCS[25:])
    ds = datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))})
    ds.save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(
        str(tmp_path / "dsdict"))
    return {"text": str(text), "jsonl": write_jsonl(tmp_path / "d.jsonl", DOCS),
            "parquet": write_parquet(tmp_path / "d.parquet", DOCS),
            "parquet dir": str(shards), "datasets": str(tmp_path / "ds"),
            "datasets dict": str(tmp_path / "dsdict")}


@pytest.mark.parametrize("tokenizer,vocab", [("byte", 256), ("bpe", 512)])
def test_every_format_gives_the_tokens_of_the_same_text(tmp_path, tokenizer, vocab) -> None:
    sources = formats(tmp_path)
    cache = str(tmp_path / "cache")
    tokens = {k: np.array(corpus.open_tokens(corpus.prepare(v, tokenizer, vocab, cache),
                                             vocab)) for k, v in sources.items()}
    assert {corpus.data_format(v) for v in sources.values()} == {
        "text", "jsonl", "parquet", "datasets"}
    for name, t in tokens.items():
        assert np.array_equal(t, tokens["text"]), name
    if tokenizer == "byte":
        assert corpus.ByteTokenizer().decode(tokens["jsonl"]) == "\n".join(DOCS)


def test_text_field_and_what_is_refused(tmp_path, capsys) -> None:
    jsonl = write_jsonl(tmp_path / "c.jsonl", DOCS, field="content")
    parquet = write_parquet(tmp_path / "c.parquet", DOCS, field="content")
    cache = str(tmp_path / "cache")
    for src in (jsonl, parquet):
        assert main(["train", "--data", src, "--steps", "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert "no " in err and "'text'" in err and "--text-field" in err, err
        assert len(err.splitlines()) == 1
        assert main(["train", "--data", src, "--text-field", "content", "--steps", "1",
                     "--data-cache", cache, "--quiet"]) == 0
        capsys.readouterr()
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    assert main(["train", "--data", str(tmp_path / "bad.jsonl"), "--steps", "1",
                 "--data-cache", cache, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # (after the progress line)
    assert "bad.jsonl:2: not JSON" in err[-1] and sum("error" in e for e in err) == 1, err
    assert not [f for _, _, fs in os.walk(cache) for f in fs if f.endswith(".tmp")]


def _traced_peak(src: str, cache: str) -> int:
    tracemalloc.start()
    try:
        corpus.prepare(src, "byte", 256, cache)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_large_file_is_streamed_not_loaded(tmp_path, fmt) -> None:
    """Tokenising 3.5 MB and 10.7 MB of the same kind of documents: the traced peak does
    not grow with the corpus (documents go to the token file a line, or a record batch
    of 256 rows, at a time). Measured: JSON Lines 35-70 KB; Parquet (row groups
    of 1,000 rows) about 1 MB for both."""
    write = write_jsonl if fmt == "jsonl" else (
        lambda path, docs: write_parquet(path, docs, row_group=1000))
    peaks, sizes = [], []
    for n in (3000, 9000):
        docs = [f"line {i} " * 120 for i in range(n)]
        src = write(tmp_path / f"big{n}.{fmt}", docs)
        peaks.append(_traced_peak(src, str(tmp_path / "cache")))
        sizes.append(sum(map(len, docs)))
    assert peaks[1] < 1.3 * peaks[0] + 2**16 and peaks[1] < sizes[1] / 5, (peaks, sizes)


def test_a_missing_optional_library_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    import sys

    src = write_parquet(tmp_path / "d.parquet", DOCS)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if not installed
    assert main(["train", "--data", src, "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("needs the optional package pyarrow.parquet: "
                        "pip install 'minipar[hf]'") and len(err.splitlines()) == 1, err
