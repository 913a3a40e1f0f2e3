"""Checkpoint integrity: the per-array checksum against a NumPy reference written from its formula,
its sensitivity, and save -> corrupt -> restore refusing the altered array or metadata."""
import asyncio
import gc
import json
import logging
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import checkpoint
from k3jax.checkpoint import CheckpointError, RunCheckpoints, restore_newest_good, tree_checksums

MASK = (1 << 32) - 1


def reference_checksum(array: np.ndarray) -> int:
    """sum_i fmix32(w_i xor (i * 0x9E3779B9)) mod 2^32, in Python integers."""
    if array.dtype == np.bool_:
        words = array.astype(np.uint32)
    else:
        words = array.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[array.dtype.itemsize]).astype(np.uint32)
    total = 0
    for index, word in enumerate(words.reshape(-1).tolist()):
        h = word ^ ((index * 0x9E3779B9) & MASK)
        h = ((h ^ (h >> 16)) * 0x85EBCA6B) & MASK
        h = ((h ^ (h >> 13)) * 0xC2B2AE35) & MASK
        total += h ^ (h >> 16)
    return total & MASK


def _arrays():
    rng = np.random.default_rng(0)
    return {"f32": rng.normal(size=(3, 5)).astype(np.float32), "ones": np.ones((32,), np.float32),
            "bf16": np.asarray(jnp.asarray(rng.normal(size=(4, 3)), jnp.bfloat16)),
            "i32": rng.integers(-9, 9, size=(2, 3, 2)).astype(np.int32), "flags": rng.random(7) > 0.5,
            "scalar": np.float32(2.5)}


def test_checksums_equal_the_reference_formula():
    arrays = _arrays()
    sums = tree_checksums({name: jnp.asarray(a) for name, a in arrays.items()})
    for name, array in arrays.items():
        assert sums[f"['{name}']"] == reference_checksum(np.asarray(array)), name


def test_every_single_bit_flip_and_a_pair_of_sign_flips_change_the_checksum():
    x = np.random.default_rng(1).normal(size=(6, 4)).astype(np.float32)
    base = tree_checksums({"x": jnp.asarray(x)})["['x']"]
    flipped = []
    for bit in range(32):
        for index in (0, 7, 23):
            y = x.copy()
            y.reshape(-1).view(np.uint32)[index] ^= np.uint32(1 << bit)
            flipped.append(jnp.asarray(y))
    pair = x.copy()
    pair.reshape(-1)[[2, 9]] *= -1                          # sign bits of two words (a plain sum misses it)
    sums = tree_checksums({"flipped": flipped, "pair": jnp.asarray(pair)})
    assert base not in sums.values()


def _state():
    return {"params": {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4)}, "step": jnp.int32(5)}


def test_a_silently_altered_array_or_metadata_is_refused(tmp_path):
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _state())
    good = RunCheckpoints(tmp_path / "good", async_save=False)
    good.save(1, _state(), {"note": "x"}, force=True)
    good.wait()
    assert np.array_equal(good.restore(1, abstract)[0]["params"]["w"], _state()["params"]["w"])
    altered = _state()
    altered["params"]["w"] = altered["params"]["w"].at[1, 2].set(6.0000005)
    bad = RunCheckpoints(tmp_path / "bad", async_save=False)
    bad.save(1, altered, {"note": "x"}, force=True)
    bad.wait()
    meta_file = tmp_path / "bad" / "1" / "meta" / "metadata"
    meta_file.write_text((tmp_path / "good" / "1" / "meta" / "metadata").read_text())   # the original seal
    bad = RunCheckpoints(tmp_path / "bad", read_only=True)
    with pytest.raises(CheckpointError, match=r"array \['params'\]\['w'\] is corrupted"):
        bad.restore(1, abstract)
    meta = json.loads(meta_file.read_text())
    meta["note"] = "y"
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="metadata is corrupted"):
        bad.meta(1)


def test_restore_newest_good_falls_back_and_reports_each_skipped_step():
    def restore(step):
        if step > 2:
            raise CheckpointError(f"checkpoint {step} is broken")
        return step * 10
    said = []
    assert restore_newest_good([1, 2, 3, 4], restore, said.append) == (2, 20)
    assert said == ["warning: checkpoint 4 is broken", "warning: checkpoint 3 is broken",
                    "falling back to checkpoint 2 (unusable: 4, 3)"]
    with pytest.raises(CheckpointError, match=r"checkpoint 4 is broken \(and 1 older checkpoints\)"):
        restore_newest_good([3, 4], restore, said.append)


def test_quiet_checkpoint_io_drops_only_late_io_callbacks(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    checkpoint.quiet_checkpoint_io()
    checkpoint.quiet_checkpoint_io()                    # idempotent: one filter, not two
    late = types.SimpleNamespace(object=None, exc_value=RuntimeError("Event loop is closed"))
    other_message = types.SimpleNamespace(object=None, exc_value=RuntimeError("disk on fire"))
    with_object = types.SimpleNamespace(object=print, exc_value=RuntimeError("Event loop is closed"))
    other_type = types.SimpleNamespace(object=None, exc_value=ValueError("Event loop is closed"))
    closed_read, closed_other = orbax_like_coroutine("/orbax/checkpoint/_src/serialization/serialization.py"), \
        orbax_like_coroutine("/site-packages/mylib/io.py")
    in_orbax = types.SimpleNamespace(object=closed_read, exc_value=Exception("Encountered error while reading"))
    elsewhere = types.SimpleNamespace(object=closed_other, exc_value=Exception("Encountered error while reading"))
    for report in (late, other_message, with_object, other_type, in_orbax, elsewhere):
        sys.unraisablehook(report)
    closed_read.close(), closed_other.close()
    assert seen == [other_message, with_object, other_type, elsewhere]


def orbax_like_coroutine(filename: str):
    """A coroutine whose code is defined in ``filename`` (as Orbax's array reads are)."""
    namespace = {}
    exec(compile("async def read():\n    pass\n", filename, "exec"), namespace)
    return namespace["read"]()


def abandon_failed_task(filename: str) -> None:
    """Let a task whose coroutine is defined in ``filename`` fail and be collected unretrieved, as
    Orbax's other array reads are after one has failed: asyncio then logs its report."""
    namespace = {}
    exec(compile("async def read():\n    raise OSError('truncated')\n", filename, "exec"), namespace)
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(namespace["read"]())
        loop.run_until_complete(asyncio.sleep(0))
        assert task.done()
        del task
        gc.collect()
    finally:
        loop.close()


def test_quiet_checkpoint_io_drops_only_abandoned_orbax_tasks(monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("asyncio"), "filters", [])
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    checkpoint.quiet_checkpoint_io()
    checkpoint.quiet_checkpoint_io()                    # idempotent: one filter, not two
    assert len(logging.getLogger("asyncio").filters) == 1
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        abandon_failed_task("/site-packages/orbax/checkpoint/_src/serialization/serialization.py")
        abandon_failed_task("/site-packages/mylib/io.py")
    reports = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
    assert len(reports) == 1 and "mylib/io.py" in reports[0]


LATE_READ = """
import asyncio, sys, time
import numpy as np, tensorstore as ts
from k3jax.checkpoint import quiet_checkpoint_io
if sys.argv[1] == "quiet":
    quiet_checkpoint_io()
spec = {"driver": "zarr", "kvstore": "memory://", "metadata": {"shape": [4096, 4096], "chunks": [256, 256],
        "dtype": "<f4", "compressor": {"id": "zstd", "level": 1}}}
array = ts.open(spec, create=True).result()
array.write(np.random.default_rng(0).random((4096, 4096), np.float32)).result()
pending = []                            # reads still in flight when their loop closes (as after a failed restore)
for _ in range(5):
    loop = asyncio.new_event_loop()
    async def read():
        await array.read()
    pending.append(loop.create_task(read()))
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
time.sleep(5)
"""


@pytest.mark.slow
def test_a_read_outliving_its_event_loop_prints_nothing_once_quieted():
    def stderr(mode):
        result = subprocess.run([sys.executable, "-c", LATE_READ, mode], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stderr
    assert "RuntimeError: Event loop is closed" in stderr("plain")    # the race this guards against happens
    assert "Event loop is closed" not in stderr("quiet")


def test_a_subtree_restored_in_groups_equals_the_saved_arrays_and_is_verified(tmp_path):
    """One array a group (``group_bytes=1``) or all in one: the saved arrays, at their paths in the
    abstract tree; an altered array is refused by name either way."""
    from k3jax.checkpoint import restore_groups, restore_subtree
    state = {"params": {"layers": {0: {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(4, jnp.bfloat16)},
                                   1: {"a": jnp.full((2, 3), 7.0), "b": jnp.zeros(4, jnp.bfloat16)}},
                        "head": jnp.arange(5, dtype=jnp.int32)}}
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state["params"])
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    assert [len(group) for group in restore_groups(leaves, 1)] == [1] * 5
    assert [len(group) for group in restore_groups(leaves, 24 + 8)] == [1, 2, 2]   # head 20 B, then a 24 B + b 8 B
    saved = RunCheckpoints(tmp_path / "run" / "checkpoints", async_save=False)
    saved.save(1, state, {"note": "x"}, force=True)
    saved.wait()
    for group_bytes in (1, 2**20):
        restored, meta = restore_subtree(tmp_path / "run", "params", abstract, group_bytes=group_bytes)
        assert meta["note"] == "x"
        assert jax.tree.structure(restored) == jax.tree.structure(abstract)
        for ours, theirs in zip(jax.tree.leaves(restored), jax.tree.leaves(state["params"])):
            assert ours.dtype == theirs.dtype and np.array_equal(np.asarray(ours), np.asarray(theirs))
    meta_file = tmp_path / "run" / "checkpoints" / "1" / "meta" / "metadata"
    sealed = meta_file.read_text()
    state["params"]["layers"][1]["a"] = state["params"]["layers"][1]["a"].at[0, 0].set(7.5)
    saved.save(2, state, {"note": "x"}, force=True)
    saved.wait()
    (tmp_path / "run" / "checkpoints" / "2" / "meta" / "metadata").write_text(sealed)   # step 1's seal
    for group_bytes in (1, 2**20):
        with pytest.raises(CheckpointError, match=r"array \['params'\]\['layers'\]\[1\]\['a'\] is corrupted"):
            restore_subtree(tmp_path / "run", "params", abstract, step=2, group_bytes=group_bytes)
