"""What both datasets promise the trainer: batch format, determinism from (seed, step), process shards."""
import json

import numpy as np
import pytest

from k3jax.data import DataError, MQARDataset, TextDataset

KEYS = {"tokens", "targets", "loss_mask", "segment_ids"}


@pytest.fixture(params=["mqar", "text"])
def make_dataset(request, corpus_dir):
    """A builder ``seed -> dataset`` of each kind, so tests can build fresh copies."""
    if request.param == "mqar":
        return lambda seed=0: MQARDataset(seq_len=64, seed=seed)
    return lambda seed=0: TextDataset(corpus_dir, seq_len=16, seed=seed, heldout_fraction=0.3)


def assert_batches_equal(a, b):
    assert a.keys() == b.keys() == KEYS
    for key in KEYS:
        assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key


def test_batch_format(make_dataset):
    ds = make_dataset()
    batch = ds.batch(0, 8)
    assert batch.keys() == KEYS
    for key in ("tokens", "targets", "segment_ids"):
        assert batch[key].dtype == np.int32 and batch[key].shape == (8, ds.seq_len)
    assert batch["loss_mask"].dtype == np.float32 and batch["loss_mask"].shape == (8, ds.seq_len)
    assert batch["tokens"].min() >= 0 and batch["targets"].max() < ds.vocab_size
    assert np.array_equal(batch["targets"][:, :-1], batch["tokens"][:, 1:])


def test_same_seed_and_step_give_the_same_batch(make_dataset):
    first, rebuilt = make_dataset(), make_dataset()
    for split in ("train", "heldout"):
        for step in (0, 5, 1000):
            assert_batches_equal(first.batch(step, 8, split), rebuilt.batch(step, 8, split))
    assert_batches_equal(first.batch(np.int64(5), np.int32(8)), first.batch(5, 8))  # e.g. a step from a checkpoint
    # Reading order does not matter: no hidden iterator state.
    later_first = make_dataset()
    later_first.batch(7, 8)
    assert_batches_equal(later_first.batch(2, 8), first.batch(2, 8))


def test_different_steps_and_seeds_differ(make_dataset):
    ds = make_dataset()
    assert not np.array_equal(ds.batch(0, 8)["tokens"], ds.batch(1, 8)["tokens"])
    assert not np.array_equal(ds.batch(0, 8)["tokens"], make_dataset(seed=1).batch(0, 8)["tokens"])


@pytest.mark.parametrize("process_count", [1, 2, 4, 8])
def test_process_shards_concatenate_to_the_global_batch(make_dataset, process_count):
    ds = make_dataset()
    whole = ds.batch(3, 8)
    shards = [ds.batch(3, 8, process_index=p, process_count=process_count) for p in range(process_count)]
    assert_batches_equal({key: np.concatenate([s[key] for s in shards]) for key in KEYS}, whole)


@pytest.mark.parametrize("arguments, message", [
    ({"step": -1}, "step must be an integer >= 0"),
    ({"step": 1.5}, "step must be an integer"),
    ({"batch_size": 6, "process_count": 4}, "multiple of process_count"),
    ({"process_index": 2, "process_count": 2}, "process_index must be in"),
    ({"split": "validation"}, "unknown split 'validation'"),
])
def test_bad_batch_arguments(make_dataset, arguments, message):
    with pytest.raises(DataError, match=message):
        make_dataset().batch(**{"step": 0, "batch_size": 8, **arguments})


def test_describe_is_json_and_hash_is_stable(make_dataset):
    ds = make_dataset()
    assert json.loads(json.dumps(ds.describe()))["vocab_size"] == ds.vocab_size
    assert ds.content_hash() == make_dataset().content_hash() != make_dataset(seed=1).content_hash()
