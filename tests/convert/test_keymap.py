"""The key map covers every k3jax parameter region exactly once, and its HF names and shapes follow
SPEC §7 for both layouts and the released K3 index (its key count and patterns)."""
import collections
import math

import pytest

from k3jax.convert.hf_config import model_config_from_hf
from k3jax.convert.keymap import model_maps, mxfp4_names
from k3jax.training import abstract_model
from tests.convert import hf_configs, release_names
from tests.convert.test_import_export import k3_config, kimi_linear_config


@pytest.mark.parametrize("make, flavour", [(k3_config, "k3"), (kimi_linear_config, "kimi_linear")])
def test_every_region_of_every_leaf_is_filled_once(make, flavour):
    model, _ = model_config_from_hf(make())
    _, params, buffers = abstract_model(model)
    leaves = {**{("params", k): v.shape for k, v in params.items()}, **{("buffers", k): v.shape for k, v in buffers.items()}}
    regions = collections.defaultdict(set)
    for spec in model_maps(model, flavour):
        full = leaves[spec.top, spec.key]
        assert full[len(spec.index):] == spec.shape, spec
        assert all(0 <= i < n for i, n in zip(spec.index, full)), spec
        assert spec.index not in regions[spec.top, spec.key], spec
        regions[spec.top, spec.key].add(spec.index)
    for leaf, shape in leaves.items():
        depth = len(next(iter(regions[leaf])))
        assert len(regions[leaf]) == math.prod(shape[:depth]), leaf


def test_names_and_shapes_follow_the_release():
    model, _ = model_config_from_hf(k3_config())
    maps = {spec.hf_name: spec for spec in model_maps(model, "k3")}
    kda, mla = "language_model.model.layers.0.self_attn.", "language_model.model.layers.3.self_attn."
    assert maps[kda + "g_proj.weight"].key == "prefix/layers/0/mixer/g_proj"            # KDA's output gate
    assert maps[mla + "g_proj.weight"].hf_shape == (2 * 16, 64)                         # MLA's, [H V, d]
    assert maps[kda + "q_conv1d.weight"].hf_shape == (64, 1, 4)
    assert maps[kda + "dt_bias"].hf_shape == (64,)
    assert maps[kda + "o_proj.weight"].hf_shape == (64, 64) and maps[kda + "o_proj.weight"].in_dims == 2
    assert maps["language_model.model.layers.0.self_attention_res_proj.weight"].hf_shape == (1, 64)
    expert = maps["language_model.model.layers.5.block_sparse_moe.experts.2.w2.weight"]
    assert (expert.key, expert.index, expert.hf_shape) == ("body/layers/1/ffn/experts/w_down", (0, 2), (32, 64))
    assert "language_model.lm_head.weight" in maps and "language_model.model.output_attn_res_proj.weight" in maps
    model, _ = model_config_from_hf(kimi_linear_config())
    maps = {spec.hf_name: spec for spec in model_maps(model, "kimi_linear")}
    assert maps["model.layers.0.self_attn.A_log"].hf_shape == (1, 1, 2, 1)
    assert "model.layers.0.self_attn.g_a_proj.weight" in maps and "lm_head.weight" in maps
    assert maps["model.layers.9.self_attn.q_proj.weight"].index == (1,)       # body repeat 1


@pytest.mark.slow   # ~500,000 names
def test_released_k3_index_has_the_key_count_and_patterns_of_the_release():
    """The full K3 config names the 497,220 keys of the released index less its vision tower
    (6 keys + 6 per MoonViT block), in the release's 59 patterns less its 11 vision ones, with
    MXFP4 experts as weight_packed / weight_scale pairs (tests/convert/release_names.py)."""
    hf = hf_configs.k3()
    model, _ = model_config_from_hf(hf)
    maps = model_maps(model, "k3")
    names = [name for spec in maps for name in (mxfp4_names(spec.hf_name) if spec.expert else (spec.hf_name,))]
    vision = 6 + 6 * hf["vision_config"]["vt_num_hidden_layers"]
    assert len(names) == len(set(names)) == release_names.K3_INDEX_KEYS - vision
    text = {*release_names.K3_MODEL, *(f"language_model.model.layers.N.{n}" for n in release_names.expected_layer(
        "k3", True, True) | release_names.expected_layer("k3", False, False))}
    assert {release_names.pattern(name) for name in names} == text
    assert len(text) + len(release_names.K3_VISION) == release_names.K3_INDEX_PATTERNS
    shapes = {spec.hf_name: spec.hf_shape for spec in maps}
    assert shapes["language_model.model.layers.0.self_attn.A_log"] == (128,)
    assert shapes["language_model.model.layers.0.self_attn.dt_bias"] == (96 * 128,)
    assert sum(".self_attention_res_proj." in name for name in names) == 93
