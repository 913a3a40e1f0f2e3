"""MQAR: row structure checked by re-reading each row independently, split disjointness, recall."""
import dataclasses
import json

import numpy as np
import pytest

from k3jax.data import DataError, MQARDataset, mqar_recall


def parse_row(tokens, targets, ds):
    """Re-read a row from its tokens alone: (written key→value dict, noise, [(query, answer, position)])."""
    sequence = np.append(tokens, targets[-1])
    separator = int(np.flatnonzero(sequence == ds.separator_id)[0])
    writes = sequence[: 2 * ds.num_pairs]
    noise = sequence[2 * ds.num_pairs: separator]
    queries = [(int(sequence[p]), int(sequence[p + 1]), p) for p in range(separator + 1, sequence.size - 1, 2)
               if sequence[p] != ds.pad_id]
    return dict(zip(writes[0::2].tolist(), writes[1::2].tolist())), noise, queries


def is_key(token, ds):
    return ds.first_key_id <= token < ds.first_key_id + ds.num_keys


def is_value(token, ds):
    return ds.first_value_id <= token < ds.first_value_id + ds.num_values


@pytest.mark.parametrize("options", [{}, {"num_filler": 7, "num_queries": 5}, {"num_pairs": 24, "seq_len": 200}])
def test_row_structure(options):
    ds = MQARDataset(**{"seq_len": 64, **options})
    batch = ds.batch(3, 16)
    seen_keys, seen_values = set(), set()
    rows = zip(batch["tokens"], batch["targets"], batch["loss_mask"], batch["segment_ids"])
    for tokens, targets, mask, segments in rows:
        bindings, noise, queries = parse_row(tokens, targets, ds)
        seen_keys |= set(bindings)
        seen_values |= set(bindings.values())
        assert len(bindings) == ds.num_pairs  # distinct keys
        assert len(set(bindings.values())) == ds.num_pairs  # distinct values
        assert all(is_key(k, ds) and is_value(v, ds) for k, v in bindings.items())
        assert noise.size == ds.num_filler and np.all((noise >= ds.first_noise_id) & (noise < ds.vocab_size))
        assert len(queries) == ds.queries_per_row
        assert len({q for q, _, _ in queries}) == len(queries)  # distinct keys queried
        for query, answer, position in queries:
            assert answer == bindings[query]  # the value written earlier
            assert tokens[position] == query and targets[position] == answer
        # The loss counts exactly the answers.
        assert sorted(np.flatnonzero(mask).tolist()) == [p for _, _, p in queries]
        assert np.array_equal(segments, (tokens != ds.pad_id).astype(np.int32))
    assert not seen_keys & seen_values


def test_vocabulary_layout():
    ds = MQARDataset(seq_len=64)  # 256 keys, 256 values, 64 noise tokens after PAD 0 and SEP 1
    assert (ds.pad_id, ds.separator_id) == (0, 1)
    assert (ds.first_key_id, ds.first_value_id, ds.first_noise_id, ds.vocab_size) == (2, 258, 514, 578)


def test_default_queries_every_key_once_in_varying_order():
    ds = MQARDataset(seq_len=64)
    batch = ds.batch(0, 8)
    orders = set()
    for tokens, targets in zip(batch["tokens"], batch["targets"]):
        bindings, _, queries = parse_row(tokens, targets, ds)
        assert sorted(q for q, _, _ in queries) == sorted(bindings)
        orders.add(tuple(list(bindings).index(q) for q, _, _ in queries))
    assert len(orders) == 8


def test_longer_rows_keep_the_vocabulary():
    ds = MQARDataset(seq_len=64)
    for factor in (2, 4, 8):
        longer = dataclasses.replace(ds, seq_len=64 * factor, num_pairs=16 * factor if factor < 8 else 100)
        assert longer.vocab_size == ds.vocab_size
        batch = longer.batch(0, 2, split="heldout")
        assert batch["tokens"].shape == (2, 64 * factor)
        assert batch["loss_mask"].sum() == 2 * longer.num_pairs


def test_padding_after_the_queries():
    ds = MQARDataset(seq_len=100)
    batch = ds.batch(0, 4)
    length = 2 * 16 + 1 + 2 * 16  # writes, separator, queries and their answers
    assert np.all(batch["tokens"][:, length:] == ds.pad_id) and np.all(batch["segment_ids"][:, length:] == 0)
    assert np.all(batch["tokens"][:, :length] != ds.pad_id) and np.all(batch["segment_ids"][:, :length] == 1)


def test_train_and_heldout_never_share_a_binding_set():
    # 4 keys x 4 values, 2 pairs: only 144 distinct write sections, so each split repeats its own
    # often; the two splits must still never meet.
    ds = MQARDataset(seq_len=8, num_pairs=2, num_keys=4, num_values=4, noise_vocab_size=0)
    writes = {split: {tuple(row[:4]) for row in ds.batch(0, 400, split=split)["tokens"]}
              for split in ("train", "heldout")}
    assert len(writes["train"]) < 400 and len(writes["heldout"]) < 400  # repeats happen within a split
    assert not writes["train"] & writes["heldout"]


def test_default_splits_differ():
    ds = MQARDataset(seq_len=64)
    train, heldout = ds.batch(0, 64)["tokens"], ds.batch(0, 64, split="heldout")["tokens"]
    assert not {r.tobytes() for r in train} & {r.tobytes() for r in heldout}


def test_recall_metric():
    ds = MQARDataset(seq_len=64)
    batch = ds.batch(0, 64)
    assert mqar_recall(batch["targets"], batch) == 1.0
    # Each row's answers shuffled among its own queries: about 1 in num_pairs lands right by chance.
    rng = np.random.default_rng(0)
    shuffled = batch["targets"].copy()
    for row in shuffled:
        row[ds.answer_positions] = rng.permutation(row[ds.answer_positions])
    assert abs(mqar_recall(shuffled, batch) - 1 / ds.num_pairs) < 0.04
    # Predicting anything off the answer positions does not count.
    off_answers = np.where(batch["loss_mask"] > 0, batch["targets"], 0)
    assert mqar_recall(off_answers, batch) == 1.0
    with pytest.raises(DataError, match="shape"):
        mqar_recall(batch["targets"][:, :-1], batch)


def test_describe_and_content_hash():
    ds = MQARDataset(seq_len=64)
    assert ds.describe()["vocab_size"] == ds.vocab_size
    assert json.dumps(MQARDataset(seq_len=np.int64(64)).describe()) == json.dumps(ds.describe())  # plain ints
    assert ds.content_hash() == MQARDataset(seq_len=64).content_hash()
    assert ds.content_hash() != MQARDataset(seq_len=64, seed=1).content_hash()
    assert ds.content_hash() != MQARDataset(seq_len=128).content_hash()


@pytest.mark.parametrize("options, message", [
    ({"seq_len": 63}, "needs at least 64"),
    ({"seq_len": 64, "num_pairs": 300}, "num_pairs 300 exceeds"),
    ({"seq_len": 64, "num_queries": 17}, "num_queries 17 exceeds"),
    ({"seq_len": 64, "num_pairs": 0}, "num_pairs must be an integer >= 1"),
    ({"seq_len": 80, "num_filler": 4, "noise_vocab_size": 0}, "noise_vocab_size"),
    ({"seq_len": 64, "seed": -1}, "seed must be"),
    ({"seq_len": 64.0}, "seq_len must be an integer"),
])
def test_bad_definitions(options, message):
    with pytest.raises(DataError, match=message):
        MQARDataset(**options)
