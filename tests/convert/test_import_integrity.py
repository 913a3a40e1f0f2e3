"""Imported checkpoints are sealed like the trainer's: every array's checksum, summed region by
region while streaming, equals the whole-array checksum of what restores, and a bit flipped in
an imported array is refused on restore."""
import shutil

import numpy as np
import pytest
import tensorstore as ts

from k3jax.checkpoint import CHECKSUMS, CheckpointError, latest_meta, region_checksum, tree_checksums
from k3jax.convert.importer import import_checkpoint
from k3jax.convert.orbax_stream import StateReader
from k3jax.inference import restore_model
from tests.convert.hf_fixtures import hf_tensors, write_checkpoint
from tests.convert.test_import_export import QUIET, k3_config


def test_region_parts_add_up_to_the_whole_array_checksum():
    array = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(np.float32)
    parts = sum(region_checksum(array[i], i * 20) for i in range(3)) % 2**32
    assert parts == tree_checksums({"a": array})["['a']"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    hf_dir = write_checkpoint(root / "hf", k3_config(), hf_tensors(k3_config(), seed=0, mxfp4=True))
    import_checkpoint(hf_dir, root / "run", log=QUIET)
    return root / "run"


def test_imported_meta_holds_the_checksum_of_every_array(imported):
    _, meta = latest_meta(imported)
    reader = StateReader(imported / "checkpoints" / "0")
    names = list(meta[CHECKSUMS])
    assert any("_packed" in name for name in names) and any("buffers" in name for name in names)   # MXFP4 kept packed
    for name in names[:: max(1, len(names) // 6)]:          # a spread of them, read back whole
        top, key = (part.strip("'") for part in name[2:-2].split("']['"))
        assert tree_checksums({top: {key: reader.read(top, key)}})[name] == meta[CHECKSUMS][name]
    restore_model(imported)                                  # verifies every restored array


def with_a_flipped_embedding_bit(imported, run):
    """A copy of the imported run in ``run`` whose embedding has one bit flipped on disk (its saved
    checksum unchanged)."""
    shutil.copytree(imported, run)
    store = StateReader(run / "checkpoints" / "0")
    array = ts.open({**store.array("params", "embedding").spec().to_json()}, open=True, read=True, write=True).result()
    value = np.asarray(array[0, :1].read().result())
    array[0, :1].write((value.view(np.uint32) ^ np.uint32(1 << 7)).view(np.float32)).result()
    return run


def test_a_flipped_bit_in_an_imported_array_is_refused(imported, tmp_path):
    with pytest.raises(CheckpointError, match="embedding.* is corrupted"):
        restore_model(with_a_flipped_embedding_bit(imported, tmp_path / "run"))


def test_export_verifies_what_it_reads_and_a_flipped_bit_exports_nothing(imported, tmp_path):
    from k3jax.convert.errors import ConvertError
    from k3jax.convert.exporter import export_checkpoint

    export_checkpoint(imported, tmp_path / "good", log=QUIET)   # every array read whole matches its checksum
    run = with_a_flipped_embedding_bit(imported, tmp_path / "run")
    with pytest.raises(ConvertError, match=r"array params/embedding is corrupted"):
        export_checkpoint(run, tmp_path / "bad", log=QUIET)
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad*"))
