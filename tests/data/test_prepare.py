"""python -m k3jax.data.prepare: deterministic bytes, a resume after a kill that ends in the same bytes,
and one-line errors for bad input (the reader's too)."""
import json

import numpy as np
import pyarrow
import pyarrow.parquet
import pytest

from k3jax.data import DataError, TextDataset, TokensDataset
from k3jax.data.prepare import main, prepare
from tests.data.corpus import CORPUS_DOCUMENTS, write_files
from tests.data.test_text import byte_stream

QUIET = {"log": lambda line: None}


def file_bytes(directory):
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_shards_hold_the_text_stream_and_two_runs_write_the_same_bytes(tmp_path, corpus_dir, bpe_file):
    for out in ("a", "b"):
        prepare([str(corpus_dir)], tmp_path / out, tokenizer_path=str(bpe_file), shard_tokens=30, **QUIET)
    assert file_bytes(tmp_path / "a") == file_bytes(tmp_path / "b")
    index = json.loads((tmp_path / "a" / "index.json").read_text())
    assert len(index["shards"]) >= 3
    # The shards end to end are the tokens TextDataset builds from the same files.
    tokens = np.concatenate([np.load(tmp_path / "a" / f"{entry['name']}.tokens.npy") for entry in index["shards"]])
    assert np.array_equal(tokens, TextDataset(corpus_dir, 8, tokenizer_path=bpe_file).stream.tokens)
    assert TokensDataset(tmp_path / "a", 8).vocab_size == index["vocab_size"]   # the BPE file found from the index


def test_a_killed_prepare_continues_and_ends_in_the_same_bytes(tmp_path, corpus_dir):
    prepare([str(corpus_dir)], tmp_path / "whole", shard_tokens=30, **QUIET)
    out = tmp_path / "killed"
    prepare([str(corpus_dir)], out, shard_tokens=30, **QUIET)
    # What a kill while writing shard 2 leaves: shards 0-1 complete, a temporary file, no index.
    for name in ("index.json", "shard-00002.json", "shard-00002.tokens.npy", "shard-00003.json",
                 "shard-00003.tokens.npy", "shard-00003.docs.npy"):
        (out / name).unlink(missing_ok=True)
    (out / ".shard-00002.tokens.npy.tmp").write_bytes(b"torn")
    with pytest.raises(DataError, match="unfinished prepare: run it again"):
        TokensDataset(out, 8)
    kept = (out / "shard-00000.tokens.npy").stat().st_mtime_ns
    messages = []
    prepare([str(corpus_dir)], out, shard_tokens=30, log=messages.append)
    assert "continuing after 2 complete shards" in messages[0]
    assert (out / "shard-00000.tokens.npy").stat().st_mtime_ns == kept   # not rewritten
    assert file_bytes(out) == file_bytes(tmp_path / "whole")


def test_other_settings_into_the_same_directory_are_refused(tmp_path, corpus_dir):
    prepare([str(corpus_dir)], tmp_path / "out", shard_tokens=30, **QUIET)
    with pytest.raises(DataError, match="prepared .* from other sources or settings"):
        prepare([str(corpus_dir)], tmp_path / "out", shard_tokens=31, **QUIET)


def test_a_source_edited_before_a_continue_is_refused_even_at_the_same_size(tmp_path, corpus_dir):
    out = tmp_path / "out"
    prepare([str(corpus_dir)], out, shard_tokens=30, **QUIET)
    (out / "index.json").unlink()                       # an unfinished prepare
    source = corpus_dir / "a.txt"
    text = source.read_bytes()
    source.write_bytes(text[:-2] + text[-1:] + text[-2:-1])   # two bytes swapped: the same size
    with pytest.raises(DataError, match="prepared .* from other sources or settings"):
        prepare([str(corpus_dir)], out, shard_tokens=30, **QUIET)


@pytest.mark.parametrize("damage", ["tokens", "docs"])
def test_a_shard_changed_on_disk_is_refused_when_training_reads_it(tmp_path, corpus_dir, damage):
    prepare([str(corpus_dir)], tmp_path / "out", shard_tokens=30, **QUIET)
    path = tmp_path / "out" / f"shard-00001.{damage}.npy"
    values = np.load(path)
    values[-1] += 1                                       # same shape, same dtype, other values
    np.save(path, values)
    with pytest.raises(DataError, match=r"shard-00001: the .* do not match the SHA-256 the index recorded"):
        ds = TokensDataset(tmp_path / "out", 8, heldout_fraction=0)
        ds.batch(0, ds.num_rows())                        # every row: shard 1 is read


def test_tokens_need_the_tokenizer_they_were_made_with(tmp_path, corpus_dir, bpe_file):
    prepare([str(corpus_dir)], tmp_path / "out", **QUIET)
    with pytest.raises(DataError, match="prepared with the tokenizer bytes, not .*tiny.tiktoken"):
        TokensDataset(tmp_path / "out", 8, tokenizer_path=bpe_file)


def bad_parquet(path):
    pyarrow.parquet.write_table(pyarrow.table({"text": ["fine", None], "n": [1, 2]}), path)


BAD_INPUTS = {
    # case: (files to write (a callable writes one itself), prepare arguments, what stderr's line must say)
    "empty glob": ({"a.txt": "x"}, ["{root}/*.jsonl", "{root}/out"], "*.jsonl: no .txt, .md, .jsonl, .json, .parquet files match"),
    "malformed record": ({"d.jsonl": '{"text": "a"}\n{"text": "b"}\n{"text" "c"}\n'}, ["{root}/d.jsonl", "{root}/out"],
                         "d.jsonl:3: malformed JSON"),
    "missing field": ({"d.jsonl": '{"text": "a"}\n{"body": "b"}\n'}, ["{root}/d.jsonl", "{root}/out"],
                      "d.jsonl:2: no 'text' field (its fields: 'body')"),
    "missing column": ({"d.parquet": bad_parquet}, ["{root}/d.parquet", "{root}/out", "--jsonl-field", "body"],
                       "d.parquet: no 'body' column (its columns: 'text', 'n')"),
    "column not text": ({"d.parquet": bad_parquet}, ["{root}/d.parquet", "{root}/out", "--jsonl-field", "n"],
                        "d.parquet: column 'n' holds int64, not strings"),
    "null text": ({"d.parquet": bad_parquet}, ["{root}/d.parquet", "{root}/out"], "d.parquet: row 1: column 'text' is null"),
    "not parquet": ({"d.parquet": "plain text"}, ["{root}/d.parquet", "{root}/out"], "d.parquet: not a readable Parquet file"),
    "too short for seq-len": ({"a.txt": "abc"}, ["{root}/a.txt", "{root}/out", "--seq-len", "8"], "fewer than one row"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_1(tmp_path, capsys, case):
    files, arguments, message = BAD_INPUTS[case]
    for name, content in files.items():
        content(tmp_path / name) if callable(content) else write_files(tmp_path, {name: content})
    assert main([argument.format(root=tmp_path) for argument in arguments]) == 1
    error = capsys.readouterr().err
    assert error.startswith("prepare: error: ") and message in error and error.count("\n") == 1, error


def test_a_prepared_directory_is_read_through_memory_maps(tmp_path, corpus_dir):
    prepare([str(corpus_dir)], tmp_path / "out", shard_tokens=30, **QUIET)
    ds = TokensDataset(tmp_path / "out", 8, heldout_fraction=0)
    assert len(ds.stream.tokens.shards) >= 3 and all(isinstance(s, np.memmap) for s in ds.stream.tokens.shards)
    stream = byte_stream(CORPUS_DOCUMENTS)[0]
    epoch = ds.batch(0, ds.num_rows())["tokens"]
    assert sorted(map(bytes, epoch.astype(np.uint16))) == sorted(
        bytes(stream[r * 8: r * 8 + 8].astype(np.uint16)) for r in range(ds.num_rows()))
