"""HF checkpoint import / export (k3jax.convert): logits against an independent float64 NumPy
forward of the HF tensors, bit-exact round trips, and the tokenizer carried along.

Two tiny checkpoints in the release format (tests/convert/hf_fixtures.py): K3-shaped with MXFP4
routed experts, a zero-padded A_log, block AttnRes and vision tensors (8 layers: an unrolled
prefix and a scanned body); Kimi-Linear-shaped in bf16 with fp32 [1, 1, H, 1] A_log, no AttnRes
and a tokenizer (12 layers: the scanned body repeats twice).
"""
import functools
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.convert.exporter import export_checkpoint
from k3jax.convert.importer import import_checkpoint
from k3jax.convert.mxfp4 import decode_mxfp4
from k3jax.convert.safetensors_io import SafetensorsCheckpoint
from k3jax.data.tokenizers import load_tokenizer
from k3jax.inference.generation import generate
from k3jax.inference import restore_model
from tests.convert import hf_configs, release_names
from tests.convert.hf_fixtures import VISION, hf_tensors, write_checkpoint, write_tokenizer
from tests.convert.numpy_hf_forward import hf_forward

QUIET = lambda line: None  # noqa: E731


def k3_config() -> dict:
    hf = hf_configs.k3(8)
    hf["text_config"].update(
        hidden_size=64, vocab_size=640, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=4,
        num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=64, routed_expert_hidden_size=32,
        attn_res_block_size=2)
    hf["text_config"]["linear_attn_config"].update(num_heads=2, head_dim=32)
    return hf


def kimi_linear_config() -> dict:
    hf = hf_configs.kimi_linear_48b()
    hf.update(hidden_size=64, vocab_size=520, intermediate_size=128, num_hidden_layers=12, num_attention_heads=2,
              num_key_value_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              num_experts=8, num_experts_per_token=2, moe_intermediate_size=32)
    hf["linear_attn_config"] = {"kda_layers": [n for n in range(1, 13) if n % 4], "full_attn_layers": [4, 8, 12],
                                "num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4}
    return hf


class Imported:
    def __init__(self, root, name, hf, tensors, tokenizer=False):
        self.hf, self.tensors = hf, tensors
        self.hf_dir = write_checkpoint(root / f"{name}_hf", hf, tensors)
        if tokenizer:
            write_tokenizer(self.hf_dir)
        self.run_dir = root / f"{name}_run"
        self.summary = import_checkpoint(self.hf_dir, self.run_dir, log=QUIET)

    @functools.cached_property
    def restored(self):
        return restore_model(self.run_dir)


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    tensors = hf_tensors(k3_config(), seed=0, mxfp4=True, padded_a_log=4)
    tensors.update({name: np.ones(shape, np.float32) for name, shape in VISION.items()})
    return Imported(tmp_path_factory.mktemp("k3"), "k3", k3_config(), tensors)


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    return Imported(tmp_path_factory.mktemp("kl"), "kl", kimi_linear_config(), hf_tensors(kimi_linear_config(), seed=1),
                    tokenizer=True)


def _check_logits(imported, vocab):
    tokens = np.random.default_rng(2).integers(0, vocab, (2, 6))
    logits = np.asarray(imported.restored.model(jnp.asarray(tokens)).logits, np.float64)
    expected, used = hf_forward(imported.hf, imported.tensors, tokens)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=2e-4 * np.abs(expected).max())
    return used, {name for name in set(imported.tensors) - used if ".experts." not in name}


@pytest.mark.slow   # compiles the model forward
def test_k3_mxfp4_import_matches_numpy_forward(k3):
    _, unused = _check_logits(k3, 640)       # besides routed experts no token chose
    assert unused - set(VISION) == {f"language_model.model.layers.0.{n}.weight" for n in ("self_attention_res_norm", "self_attention_res_proj")}
    assert k3.summary["vision_skipped"] == len(VISION) and k3.summary["mxfp4_experts"] == 7 * 4 * 3
    groups = k3.restored.model.groups
    assert groups.prefix and groups.body and groups.repeats == 1


@pytest.mark.slow   # compiles the model forward
def test_kimi_linear_import_matches_numpy_forward(kimi_linear):
    _, unused = _check_logits(kimi_linear, 520)
    assert unused == set()
    assert kimi_linear.restored.model.groups.repeats == 2


def _same_tensors(source_dir, exported_dir, names):
    source, exported = SafetensorsCheckpoint(source_dir), SafetensorsCheckpoint(exported_dir)
    assert set(exported.manifest) == set(names)
    for name in names:
        a, b = source.read(name), exported.read(name)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        assert a.tobytes() == b.tobytes(), name


@pytest.fixture(scope="module")
def k3_exported(k3, tmp_path_factory):
    out = tmp_path_factory.mktemp("k3_export") / "out"
    export_checkpoint(k3.run_dir, out, mxfp4=True, shard_bytes=100_000, log=QUIET)
    return out


@pytest.fixture(scope="module")
def kimi_linear_exported(kimi_linear, tmp_path_factory):
    out = tmp_path_factory.mktemp("kl_export") / "out"
    export_checkpoint(kimi_linear.run_dir, out, log=QUIET)
    return out


def test_k3_round_trip_mxfp4_is_bit_exact(k3, k3_exported):
    _same_tensors(k3.hf_dir, k3_exported, [n for n in k3.tensors if n not in VISION])
    assert json.loads((k3_exported / "config.json").read_text()) == k3.hf
    index = json.loads((k3_exported / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_kimi_linear_round_trip_bf16_is_bit_exact(kimi_linear, kimi_linear_exported):
    _same_tensors(kimi_linear.hf_dir, kimi_linear_exported, list(kimi_linear.tensors))
    assert json.loads((kimi_linear_exported / "config.json").read_text()) == kimi_linear.hf
    a_log = SafetensorsCheckpoint(kimi_linear_exported).manifest["model.layers.0.self_attn.A_log"]
    assert (a_log.dtype, a_log.shape) == ("F32", (1, 1, 2, 1))
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (kimi_linear_exported / name).read_bytes() == (kimi_linear.hf_dir / name).read_bytes()


def _check_release_names(exported_dir, hf: dict, flavour: str) -> None:
    """Every exported key is a released name (tests/convert/release_names.py, from the public
    loaders of the release) at the place the release puts it: each layer holds exactly the
    names of its attention kind (1-based ``full_attn_layers``) and FFN kind (dense below
    ``first_k_dense_replace``), and the release's layouts hold (conv [P, 1, W], flat dt_bias,
    AttnRes projections [1, d], MXFP4 pairs uint8 with packed[1] * 2 == scale[1] * 32)."""
    manifest = SafetensorsCheckpoint(exported_dir).manifest
    text = hf.get("text_config", hf)
    prefix, model_names = release_names.RELEASES[flavour][:2]
    full_attention = {n - 1 for n in text["linear_attn_config"]["full_attn_layers"]}
    layers = {}
    for name in manifest:
        if not name.startswith(prefix):
            continue
        layer, rest = name[len(prefix):].split(".", 1)
        layers.setdefault(int(layer), set()).add(release_names.pattern("." + rest)[1:])
    assert set(manifest) - {n for n in manifest if n.startswith(prefix)} == (
        set(model_names) if text.get("attn_res_block_size") else {n for n in model_names if "attn_res" not in n})
    assert sorted(layers) == list(range(text["num_hidden_layers"]))
    for layer, names in layers.items():
        expected = release_names.expected_layer(flavour, layer in full_attention, layer < text["first_k_dense_replace"])
        assert names == expected, (layer, names ^ expected)
    width, heads = text["linear_attn_config"]["head_dim"], text["linear_attn_config"]["num_heads"]
    for name, info in manifest.items():
        if name.endswith("_conv1d.weight"):
            assert info.shape == (heads * width, 1, text["linear_attn_config"]["short_conv_kernel_size"]), name
        if name.endswith("dt_bias"):
            assert info.shape == (heads * width,), name
        if name.endswith("_res_proj.weight"):
            assert info.shape == (1, text["hidden_size"]), name
        if name.endswith(".weight_packed"):
            scale = manifest[name.removesuffix("_packed") + "_scale"]
            assert info.dtype == scale.dtype == "U8" and info.shape[1] * 2 == scale.shape[1] * 32, name


def test_exported_names_are_the_released_ones(k3, k3_exported, kimi_linear, kimi_linear_exported):
    _check_release_names(k3_exported, k3.hf, "k3")
    _check_release_names(kimi_linear_exported, kimi_linear.hf, "kimi_linear")


def test_mxfp4_experts_exported_as_bf16_hold_the_decoded_values(k3, tmp_path):
    export_checkpoint(k3.run_dir, tmp_path / "out", log=QUIET)
    exported = SafetensorsCheckpoint(tmp_path / "out")
    base = "language_model.model.layers.5.block_sparse_moe.experts.3.w2.weight"
    expected = decode_mxfp4(k3.tensors[base + "_packed"], k3.tensors[base + "_scale"])
    np.testing.assert_array_equal(np.asarray(exported.read(base), np.float32), expected)
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in hf["text_config"] and "quantization_config" not in hf


@pytest.mark.slow   # compiles the model's forward (generate: prefill and decode)
def test_imported_tokenizer_generates(kimi_linear):
    config = kimi_linear.restored.config
    tokenizer = load_tokenizer(config.data.tokenizer)
    assert str(kimi_linear.run_dir) in config.data.tokenizer
    assert tokenizer.vocab_size == 515 and tokenizer.eos_id == 261 and tokenizer.bos_id == 259
    prompt = tokenizer.encode(" the heat")
    assert prompt[0] == 258                       # the " the" merge
    out = generate(kimi_linear.restored.model, prompt, max_new_tokens=3, eos_id=tokenizer.eos_id)
    expected = np.argmax(hf_forward(kimi_linear.hf, kimi_linear.tensors, np.asarray([prompt]))[0][0, -1])
    assert int(out.tokens[0]) == expected


def test_export_of_a_run_without_hf_source_uses_defaults(k3, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(k3.run_dir, run)
    shutil.rmtree(run / "hf_source")
    export_checkpoint(run, tmp_path / "out", log=QUIET)
    exported = SafetensorsCheckpoint(tmp_path / "out")
    assert exported.manifest["language_model.model.layers.0.self_attn.A_log"].shape == (2,)
    assert exported.manifest["language_model.model.embed_tokens.weight"].dtype == "BF16"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "kimi_k3"


def test_k3_import_keeps_mxfp4_experts_packed_byte_for_byte(k3, tmp_path):
    """The release's experts land in the checkpoint's buffers as their codes and scales (no decode);
    ``model.moe.expert_format=dense`` decodes them instead."""
    from k3jax.checkpoint import checkpoint_directory
    from k3jax.config import load_config
    from k3jax.convert.keymap import model_maps
    from k3jax.convert.orbax_stream import StateReader

    assert k3.summary["mxfp4_kept_packed"]
    config = load_config(k3.run_dir / "config.yaml").model
    assert config.moe.expert_format == "mxfp4"
    packed = {spec.hf_name: spec for spec in model_maps(config, "k3") if spec.layout == "packed"}
    assert len(packed) == 2 * k3.summary["mxfp4_experts"]
    reader = StateReader(checkpoint_directory(k3.run_dir) / "0")
    for name, spec in packed.items():
        stored = reader.read("buffers", spec.key, spec.index)
        assert stored.dtype == np.uint8 and stored.tobytes() == k3.tensors[name].tobytes(), name
    spec = packed["language_model.model.layers.5.block_sparse_moe.experts.3.w2.weight_packed"]
    dense_key = spec.key.removesuffix("_packed")
    assert not reader.has("params", dense_key)
    dense = import_checkpoint(k3.hf_dir, tmp_path / "dense", ["model.moe.expert_format=dense"], log=QUIET)
    assert not dense["mxfp4_kept_packed"] and dense["mxfp4_experts"] == k3.summary["mxfp4_experts"]
    decoded = StateReader(checkpoint_directory(tmp_path / "dense") / "0").read("params", dense_key, spec.index)
    base = spec.hf_name.removesuffix("_packed")
    np.testing.assert_array_equal(decoded.T, decode_mxfp4(k3.tensors[base + "_packed"], k3.tensors[base + "_scale"]))
