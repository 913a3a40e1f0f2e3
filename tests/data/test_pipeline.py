"""The grain pipeline over every source kind: the same documents as text, JSONL, Parquet and prepared
tokens give the same rows, each row is a window of the reference byte stream, one epoch reads every
row once, and a batch's rows do not depend on the process count, a rebuilt dataset or prefetching."""
import json

import numpy as np
import pyarrow
import pyarrow.parquet
import pytest

from k3jax.data import DataError, Prefetcher, TextDataset, TokensDataset
from k3jax.data.prepare import prepare
from tests.data.test_text import byte_stream

DOCUMENTS = [f"document {i}: " + "word " * (i % 5) + "é" * (i % 3) for i in range(24)]
SEQ_LEN, BATCH, HELDOUT = 8, 8, 0.25
KINDS = ("text", "jsonl", "parquet", "tokens")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """kind -> a builder of that kind's dataset over `DOCUMENTS` (so a test can rebuild it, as a resume does)."""
    root = tmp_path_factory.mktemp("sources")
    (root / "text").mkdir()
    for number, document in enumerate(DOCUMENTS):
        (root / "text" / f"doc{number:03d}.txt").write_text(document, encoding="utf-8")
    (root / "docs.jsonl").write_text("\n".join(json.dumps({"body": d}) for d in DOCUMENTS), encoding="utf-8")
    pyarrow.parquet.write_table(pyarrow.table({"id": list(range(len(DOCUMENTS))), "body": DOCUMENTS}),
                                root / "docs.parquet", row_group_size=5)
    prepare([str(root / "docs.jsonl")], root / "tokens", jsonl_field="body", shard_tokens=70, log=lambda line: None)
    settings = {"seq_len": SEQ_LEN, "heldout_fraction": HELDOUT}
    return {
        "text": lambda: TextDataset(root / "text", **settings),
        "jsonl": lambda: TextDataset(root / "docs.jsonl", jsonl_field="body", **settings),
        "parquet": lambda: TextDataset(str(root / "*.parquet"), jsonl_field="body", **settings),
        "tokens": lambda: TokensDataset(root / "tokens", **settings),
    }


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key


def test_tokens_are_sharded(sources):
    ds = sources["tokens"]()
    assert len(ds.index["shards"]) >= 3  # rows cross shard boundaries below
    assert ds.stream.tokens.size == byte_stream(DOCUMENTS)[0].size


@pytest.mark.parametrize("kind", KINDS)
def test_rows_are_windows_of_the_stream_and_an_epoch_reads_each_once(sources, kind):
    ds = sources[kind]()
    stream = byte_stream(DOCUMENTS)[0].astype(np.int32)
    cut = len(stream) - ds.splits["heldout"].tokens.size   # the held-out tail, checked in test_text
    train = stream[:cut]
    rows = ds.num_rows()
    assert rows == (cut - 1) // SEQ_LEN
    epoch = ds.batch(0, rows)
    windows = [train[r * SEQ_LEN: r * SEQ_LEN + SEQ_LEN + 1] for r in range(rows)]
    read = [np.append(tokens, targets[-1]) for tokens, targets in zip(epoch["tokens"], epoch["targets"])]
    assert sorted(w.tobytes() for w in read) == sorted(w.tobytes() for w in windows)
    assert [w.tobytes() for w in read] != [w.tobytes() for w in windows]   # shuffled


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_gives_the_rows_of_plain_text(sources, kind):
    reference, ds = sources["text"](), sources[kind]()
    for split, step in (("train", 0), ("train", 7), ("heldout", 2)):
        assert_same(ds.batch(step, BATCH, split), reference.batch(step, BATCH, split))


@pytest.mark.parametrize("kind", KINDS)
def test_rows_identical_for_1_2_4_processes_and_after_a_resume(sources, kind):
    ds = sources[kind]()
    steps = range(6)   # several epochs of the small train split
    whole = [ds.batch(step, BATCH) for step in steps]
    for count in (2, 4):
        for step in steps:
            shards = [ds.batch(step, BATCH, process_index=p, process_count=count) for p in range(count)]
            assert_same({key: np.concatenate([s[key] for s in shards]) for key in shards[0]}, whole[step])
    resumed = sources[kind]()   # a new process: the dataset rebuilt from the files, read from step 3 on
    with Prefetcher(lambda step: resumed.batch(step, BATCH, process_index=1, process_count=2), 3, 6, depth=2) as batches:
        for step, batch in zip(steps[3:], batches):
            assert_same(batch, {key: value[BATCH // 2:] for key, value in whole[step].items()})


def test_prefetcher_yields_the_batches_in_order_and_raises_where_reading_failed():
    def read(step):
        if step == 5:
            raise DataError("step 5 is unreadable")
        return {"step": np.array([step])}

    for depth in (0, 1, 3):
        with Prefetcher(read, 2, 5, depth) as batches:
            assert [int(b["step"][0]) for b in batches] == [2, 3, 4]
        failing = Prefetcher(read, 3, 8, depth)
        assert int(next(failing)["step"][0]) == 3 and int(next(failing)["step"][0]) == 4
        with pytest.raises(DataError, match="step 5"):
            next(failing)
        failing.close()
