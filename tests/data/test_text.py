"""Text data: file discovery, packing against a hand-built token stream, shuffling, the held-out cut, errors."""
import json

import numpy as np
import pytest

from k3jax.data import DataError, TextDataset, load_tokenizer
from k3jax.data.packing import pack_rows
from tests.data.corpus import CORPUS_DOCUMENTS, write_files

EOS = 257  # the byte tokenizer's


def byte_stream(documents):
    """Reference token stream and per-token document number, built directly from the documents' bytes."""
    tokens, document = [], []
    for number, text in enumerate(documents):
        ids = list(text.encode("utf-8")) + [EOS]
        tokens += ids
        document += [number] * len(ids)
    return np.array(tokens), np.array(document)


def ordered_rows(ds, split="train"):
    """Every row of a split in stream order (the shuffle undone)."""
    return pack_rows(ds.splits[split], np.arange(ds.num_rows(split)), ds.seq_len)


def test_directory_is_read_recursively_sorted_and_filtered(corpus_dir):
    ds = TextDataset(corpus_dir, seq_len=16, heldout_fraction=0)
    assert [f.relative_to(corpus_dir).as_posix() for f in ds.files] == [
        "a.txt", "notes/b.md", "notes/c.jsonl", "notes/deeper/d.json"]
    assert np.array_equal(ds.stream.tokens, byte_stream(CORPUS_DOCUMENTS)[0])


@pytest.mark.parametrize("seq_len", [7, 16, 64])
def test_packing_keeps_every_token_and_resets_segments_at_documents(corpus_dir, seq_len):
    ds = TextDataset(corpus_dir, seq_len=seq_len, heldout_fraction=0)
    stream, document = byte_stream(CORPUS_DOCUMENTS)
    rows = ordered_rows(ds)
    count = ds.num_rows()
    assert count == (stream.size - 1) // seq_len
    assert np.count_nonzero(stream == EOS) == len(CORPUS_DOCUMENTS)
    # No token lost: the rows' inputs end to end, plus the last target, are the stream's prefix.
    rebuilt = np.append(rows["tokens"].ravel(), rows["targets"][-1, -1])
    assert np.array_equal(rebuilt, stream[: count * seq_len + 1])
    assert np.array_equal(rows["targets"][:, :-1], rows["tokens"][:, 1:])
    assert np.array_equal(rows["targets"][:-1, -1], rows["tokens"][1:, 0])
    for r in range(count):
        docs = document[r * seq_len: (r + 1) * seq_len]
        # Segment ids number the documents within the row from 1 (a continued document is 1 again) ...
        assert np.array_equal(rows["segment_ids"][r], docs - docs[0] + 1)
        # ... and change exactly after an EOS.
        changes = np.flatnonzero(np.diff(rows["segment_ids"][r])) + 1
        assert np.array_equal(changes, np.flatnonzero(rows["tokens"][r][:-1] == EOS) + 1)
    # The loss skips predicting a document's first token from the previous document's EOS.
    assert np.array_equal(rows["loss_mask"], (rows["tokens"] != EOS).astype(np.float32))


def test_epochs_are_seeded_permutations_of_the_rows(corpus_dir):
    ds = TextDataset(corpus_dir, seq_len=8, heldout_fraction=0)
    count = ds.num_rows()
    in_order = sorted(row.tobytes() for row in ordered_rows(ds)["tokens"])
    epochs = [ds.batch(epoch, count)["tokens"] for epoch in range(2)]
    for tokens in epochs:
        assert sorted(row.tobytes() for row in tokens) == in_order
    assert not np.array_equal(epochs[0], epochs[1])
    # A batch straddling an epoch boundary reads the end of one permutation and the start of the next.
    straddling = ds.batch(1, count - 2)["tokens"]  # global rows count-2 ... 2*count-5
    assert np.array_equal(straddling[:2], epochs[0][-2:]) and np.array_equal(straddling[2:], epochs[1][: count - 4])


def test_jsonl_field_and_explicit_file_list(tmp_path):
    records = [{"body": f"record number {i}", "title": "t"} for i in range(5)]
    write_files(tmp_path, {"data.jsonl": "\n".join(map(json.dumps, records)), "notes.log": "plain text\n"})
    paths = [tmp_path / "notes.log", tmp_path / "data.jsonl"]  # an unknown extension named directly is text
    ds = TextDataset(paths, seq_len=8, jsonl_field="body", heldout_fraction=0)
    expected = ["plain text\n"] + [r["body"] for r in records]
    assert np.array_equal(ds.stream.tokens, byte_stream(expected)[0])


def test_heldout_split_is_the_last_documents(tmp_path):
    documents = [f"document {i:02d} with some words" for i in range(20)]
    write_files(tmp_path, {"docs.jsonl": "\n".join(json.dumps({"text": d}) for d in documents)})
    ds = TextDataset(tmp_path / "docs.jsonl", seq_len=16, heldout_fraction=0.1)
    assert np.array_equal(ds.splits["train"].tokens, byte_stream(documents[:18])[0])
    assert np.array_equal(ds.splits["heldout"].tokens, byte_stream(documents[18:])[0])
    heldout = ds.batch(0, 2 * ds.num_rows("heldout"), split="heldout")["tokens"]
    assert "document 18" in ds.tokenizer.decode(heldout.ravel())


def test_single_document_is_cut_by_tokens(tmp_path):
    text = "".join(f"line {i}\n" for i in range(150))
    write_files(tmp_path, {"book.txt": text})
    ds = TextDataset(tmp_path / "book.txt", seq_len=32, heldout_fraction=0.05)
    stream = byte_stream([text])[0]
    heldout_tokens = int(np.ceil(0.05 * stream.size))
    assert np.array_equal(ds.splits["heldout"].tokens, stream[-heldout_tokens:])
    assert np.array_equal(ds.splits["train"].tokens, stream[:-heldout_tokens])
    assert ds.num_rows("heldout") >= 1
    assert ds.batch(0, 4, split="heldout")["segment_ids"].min() == 1


def test_heldout_grows_to_one_row(tmp_path):
    write_files(tmp_path, {"small.txt": "x" * 40})  # 41 tokens: two rows of 17 fit
    ds = TextDataset(tmp_path / "small.txt", seq_len=16, heldout_fraction=0.01)
    assert ds.num_rows("train") >= 1 and ds.num_rows("heldout") == 1


def test_bpe_tokenizer(corpus_dir, bpe_file):
    ds = TextDataset(corpus_dir, seq_len=16, tokenizer_path=bpe_file, heldout_fraction=0)
    tokenizer = load_tokenizer(bpe_file)
    expected = [i for d in CORPUS_DOCUMENTS for i in tokenizer.encode(d) + [tokenizer.eos_id]]
    assert ds.stream.tokens.tolist() == expected
    assert ds.vocab_size == tokenizer.vocab_size
    assert ds.describe()["tokenizer"]["kind"] == "tiktoken"


BAD_INPUTS = {
    # case: (files to write, path to read, extra kwargs, what the message must say besides the file)
    "missing file": ({}, "absent.txt", {}, "no such file or directory"),
    "no data files in directory": ({"dir/table.csv": "a,b\n"}, "dir", {}, "no .txt, .md, .jsonl, .json, .parquet files"),
    "empty file": ({"empty.txt": ""}, "empty.txt", {}, "0 tokens"),
    "too few tokens": ({"short.txt": "abc"}, "short.txt", {}, "fewer than one row"),
    "not UTF-8": ({"latin1.txt": "caf\xe9 ok".encode("latin-1")}, "latin1.txt", {}, "byte offset 3"),
    "not UTF-8 JSONL": ({"latin1.jsonl": b'{"text": "\xff"}'}, "latin1.jsonl", {}, "byte offset 10"),
    "malformed JSONL": ({"broken.jsonl": '{"text": "fine"}\n{"text": oops}\n'}, "broken.jsonl", {}, ":2: malformed JSON"),
    "malformed JSON array": ({"broken.json": '[{"text": "a"},\n {"text": }]'}, "broken.json", {}, ":2: malformed JSON"),
    "JSON nested too deeply": ({"deep.json": "[" * 100_000 + "]" * 100_000}, "deep.json", {}, "nested too deeply"),
    "JSONL nested too deeply": ({"deep.jsonl": '{"text": "a"}\n' + "[" * 100_000 + "]" * 100_000},
                                "deep.jsonl", {}, ":2: JSON nested too deeply"),
    "missing field": ({"nofield.jsonl": '{"body": "x"}\n'}, "nofield.jsonl", {}, ":1: no 'text' field"),
    "missing custom field": ({"f.jsonl": '{"text": "x"}\n'}, "f.jsonl", {"jsonl_field": "content"}, "no 'content' field"),
    "field not a string": ({"num.jsonl": '{"text": 5}\n'}, "num.jsonl", {}, "is a number, not a string"),
    "record not an object": ({"list.json": '["just text"]'}, "list.json", {}, "record 0: expected a JSON object"),
    "unreadable BPE file": ({"data.txt": "x" * 100, "vocab.tiktoken": "not a bpe file\n"}, "data.txt",
                            {"tokenizer_path": "vocab.tiktoken"}, "vocab.tiktoken:1: not a tiktoken BPE line"),
    "missing BPE file": ({"data.txt": "x" * 100}, "data.txt", {"tokenizer_path": "absent.model"}, "absent.model: no such file"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_data_error_naming_the_file(tmp_path, case):
    files, path, kwargs, message = BAD_INPUTS[case]
    write_files(tmp_path, files)
    kwargs = {k: tmp_path / v if k == "tokenizer_path" else v for k, v in kwargs.items()}
    with pytest.raises(DataError) as error:
        TextDataset(tmp_path / path, seq_len=16, **kwargs)
    text = str(error.value)
    named = kwargs.get("tokenizer_path", tmp_path / path).name
    assert named in text and message in text and "\n" not in text, text


def test_empty_heldout_split_names_the_data(tmp_path):
    write_files(tmp_path, {"data.txt": "x" * 100})
    ds = TextDataset(tmp_path / "data.txt", seq_len=16, heldout_fraction=0)
    with pytest.raises(DataError, match="data.txt: the heldout split has 0 tokens"):
        ds.batch(0, 2, split="heldout")


@pytest.mark.parametrize("kwargs, message", [
    ({"seq_len": 0}, "seq_len must be"), ({"heldout_fraction": 1.0}, "heldout_fraction must be in"),
    ({"seed": -3}, "seed must be"), ({"jsonl_field": ""}, "jsonl_field must be"),
])
def test_bad_settings(corpus_dir, kwargs, message):
    with pytest.raises(DataError, match=message):
        TextDataset(corpus_dir, **{"seq_len": 16, **kwargs})
