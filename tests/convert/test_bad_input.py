"""Bad conversion input: each case is one ConvertError line naming the shard or tensor, and no
output directory (nor a leftover temporary) appears."""
import errno
import json
import pathlib
import shutil
import tracemalloc

import numpy as np
import pytest
from safetensors.numpy import save_file

from k3jax.convert import orbax_stream
from k3jax.convert.errors import ConvertError
from k3jax.convert.exporter import export_checkpoint
from k3jax.convert.importer import import_checkpoint
from tests.convert.hf_fixtures import BF16, hf_tensors, write_checkpoint
from tests.convert.test_import_export import kimi_linear_config

QUIET = lambda line: None  # noqa: E731


def small_config() -> dict:
    hf = kimi_linear_config()
    hf.update(num_hidden_layers=2)
    hf["linear_attn_config"].update(kda_layers=[1], full_attn_layers=[2])
    return hf


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("bad")
    return write_checkpoint(root / "hf", small_config(), hf_tensors(small_config(), seed=3))


@pytest.fixture
def broken(source, tmp_path) -> pathlib.Path:
    """A private copy of the good checkpoint to damage."""
    return pathlib.Path(shutil.copytree(source, tmp_path / "hf"))


@pytest.mark.slow   # compiles the model's forward
def test_tied_embeddings_import_and_export(tmp_path):
    """tie_word_embeddings: no lm_head tensor in or out; the logits use the embedding."""
    import jax.numpy as jnp
    from k3jax.inference import restore_model
    from tests.convert.numpy_hf_forward import hf_forward
    from tests.convert.test_import_export import _same_tensors
    hf = small_config()
    hf["tie_word_embeddings"] = True
    tensors = hf_tensors(hf, seed=5)
    assert "lm_head.weight" not in tensors
    write_checkpoint(tmp_path / "hf", hf, tensors)
    import_checkpoint(tmp_path / "hf", tmp_path / "run", log=QUIET)
    tokens = np.arange(10).reshape(2, 5)
    logits = np.asarray(restore_model(tmp_path / "run").model(jnp.asarray(tokens)).logits, np.float64)
    expected, _ = hf_forward(hf, tensors, tokens)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=2e-4 * np.abs(expected).max())
    export_checkpoint(tmp_path / "run", tmp_path / "out", log=QUIET)
    _same_tensors(tmp_path / "hf", tmp_path / "out", list(tensors))


def _shard_of(directory, name) -> str:
    return json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"][name]


def _rewrite_shard(directory, shard, change):
    """Rewrite one shard with ``change(tensors)`` applied, keeping the index in step."""
    from safetensors import safe_open
    with safe_open(directory / shard, "numpy") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    change(tensors)
    save_file(tensors, directory / shard)
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if s != shard} | {n: shard for n in tensors}
    index_path.write_text(json.dumps(index))


def _fails(hf_dir, out_dir, *words, overrides=()):
    with pytest.raises(ConvertError) as caught:
        import_checkpoint(hf_dir, out_dir, overrides, log=QUIET)
    message = str(caught.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    assert not out_dir.exists() and not list(out_dir.parent.glob(f".{out_dir.name}.*"))
    return message


def test_missing_shard(broken, tmp_path):
    (broken / "model-00002-of-00003.safetensors").unlink()
    _fails(broken, tmp_path / "run", "model-00002-of-00003.safetensors", "missing")


def test_truncated_shard(broken, tmp_path):
    path = broken / "model-00003-of-00003.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    _fails(broken, tmp_path / "run", "model-00003-of-00003.safetensors", "truncated")


def test_missing_tensor(broken, tmp_path):
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    _rewrite_shard(broken, _shard_of(broken, name), lambda t: t.pop(name))
    _fails(broken, tmp_path / "run", "missing", name)


def test_unexpected_tensor(broken, tmp_path):
    extra = "model.layers.1.self_attn.rotary_emb.inv_freq"
    _rewrite_shard(broken, "model-00001-of-00003.safetensors", lambda t: t.update({extra: np.ones(4, np.float32)}))
    _fails(broken, tmp_path / "run", "unexpected", extra)


def test_shape_mismatch(broken, tmp_path):
    name = "model.layers.0.self_attn.q_proj.weight"
    _rewrite_shard(broken, _shard_of(broken, name), lambda t: t.update({name: np.ones((32, 64), BF16)}))
    _fails(broken, tmp_path / "run", name, "shape [32, 64], expected [64, 64]")


def test_dtype_mismatch(broken, tmp_path):
    name = "model.norm.weight"
    _rewrite_shard(broken, _shard_of(broken, name), lambda t: t.update({name: np.ones(64, np.int32)}))
    _fails(broken, tmp_path / "run", name, "I32")


def test_unsupported_config_field(broken, tmp_path):
    hf = small_config()
    hf["mla_use_nope"] = False
    (broken / "config.json").write_text(json.dumps(hf))
    _fails(broken, tmp_path / "run", "mla_use_nope")


@pytest.mark.parametrize("change, words", [
    (dict(num_hidden_layers=10**7), ("num_hidden_layers", "outside 1..4096")),
    (dict(num_experts=10**8), ("num_experts", "outside 1..65536")),
    (dict(num_hidden_layers=4096, linear_attn_config={**small_config()["linear_attn_config"],
                                                      "kda_layers": list(range(1, 4096)), "full_attn_layers": [4096]}),
     ("describes 4096 layers", "holds tensors of 2")),
    (dict(num_experts=65536), ("describes 65536 routed experts", "holds tensors of")),
])
def test_absurd_counts_are_refused_before_anything_is_built(broken, tmp_path, change, words):
    hf = {**small_config(), **change}
    (broken / "config.json").write_text(json.dumps(hf))
    tracemalloc.start()
    try:
        _fails(broken, tmp_path / "run", *words)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak    # per-layer / per-expert structures of these counts take gigabytes


@pytest.mark.parametrize("entry, words", [(7, "maps to '7', not a shard file name"),
                                          (["a"], "not a shard file name"),
                                          ("../model-00001-of-00003.safetensors", "not a shard file name")])
def test_a_malformed_index_entry_is_one_line(broken, tmp_path, entry, words):
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = entry
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    _fails(broken, tmp_path / "run", words)


def test_a_deeply_nested_index_is_one_line(broken, tmp_path):
    (broken / "model.safetensors.index.json").write_text("[" * 100_000 + "]" * 100_000)
    _fails(broken, tmp_path / "run", "nested too deeply")


def test_bad_override(source, tmp_path):
    _fails(source, tmp_path / "run", "model.moe.expert_matmul", overrides=["model.moe.expert_matmul=fast"])


def test_output_directory_exists(source, tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(ConvertError, match="already exists"):
        import_checkpoint(source, tmp_path / "run", log=QUIET)
    with pytest.raises(ConvertError, match="already exists"):
        export_checkpoint(tmp_path, tmp_path / "run", log=QUIET)


def test_full_disk_leaves_nothing(source, tmp_path, monkeypatch):
    writes = []

    def full_disk(self, top, key, index, value):
        writes.append(key)
        if len(writes) > 5:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(orbax_stream.StreamedStateWriter, "write", full_disk)
    _fails(source, tmp_path / "run", "disk full")
