"""config.json <-> ModelConfig (k3jax.convert.hf_config) on release-shaped config dicts."""
import copy
import dataclasses

import pytest

from k3jax.config import ConfigError, load_config
from k3jax.convert.hf_config import HFConfigError, checkpoint_flavour, hf_config_from_model, model_config_from_hf
from tests.convert import hf_configs

CONFIGS = {
    "kimi_linear_48b": hf_configs.kimi_linear_48b,
    "k3": hf_configs.k3,
    "tiny_k3": hf_configs.tiny_k3,
    "tiny_kimi_linear": hf_configs.tiny_kimi_linear,
}


def text_of(hf):
    return hf["text_config"] if "text_config" in hf else hf


@pytest.mark.parametrize("name, yaml", [("kimi_linear_48b", "configs/kimi-linear-48b.yaml"), ("k3", "configs/k3.yaml")])
def test_released_configs_map_to_the_shipped_yaml(name, yaml):
    model, _ = model_config_from_hf(CONFIGS[name]())
    expected = load_config(yaml).model
    assert dataclasses.replace(model, compute_dtype=expected.compute_dtype) == expected


def test_spec_table_layer_placement():
    """SPEC §6: MLA (0-based) at 3, 7, ..., 23, 26 for Kimi Linear and 3, 7, ..., 91, 92 for K3."""
    kimi_linear, _ = model_config_from_hf(hf_configs.kimi_linear_48b())
    k3, _ = model_config_from_hf(hf_configs.k3())
    assert kimi_linear.mla_layer_indices == (3, 7, 11, 15, 19, 23, 26)
    assert k3.mla_layer_indices == tuple(range(3, 92, 4)) + (92,)
    assert len(k3.mla_layer_indices) == 24 and sum(not k3.is_mla(l) for l in range(93)) == 69


def test_one_based_lists_and_explicit_placement():
    hf = hf_configs.tiny_kimi_linear()                     # kda [1, 3], full [2, 4]
    model, _ = model_config_from_hf(hf)
    assert model.mla_layer_indices == (1, 3) and model.mla_layers is None and model.mla_period == 2
    hf["linear_attn_config"].update(kda_layers=[2, 3], full_attn_layers=[1, 4])
    model, _ = model_config_from_hf(hf)
    assert model.mla_layers == (0, 3) and model.mla_layer_indices == (0, 3)
    del hf["linear_attn_config"]["full_attn_layers"]      # the complement of kda_layers
    assert model_config_from_hf(hf)[0] == model
    assert hf_config_from_model(model)["linear_attn_config"]["full_attn_layers"] == [1, 4]


def test_text_config_nesting_reads_the_same_model():
    nested = hf_configs.tiny_k3()
    flat = copy.deepcopy(nested["text_config"])
    assert checkpoint_flavour(nested) == "k3" and checkpoint_flavour(flat) == "kimi_linear"
    assert model_config_from_hf(nested)[0] == model_config_from_hf(flat)[0]


@pytest.mark.parametrize("name", CONFIGS)
def test_round_trip_reproduces_the_file(name):
    hf = CONFIGS[name]()
    model, carried = model_config_from_hf(hf)
    assert hf_config_from_model(model, carried) == hf
    fresh = hf_config_from_model(model)
    assert checkpoint_flavour(fresh) == checkpoint_flavour(hf)
    assert model_config_from_hf(fresh)[0] == model


def test_carried_holds_the_neutral_fields_only():
    _, carried = model_config_from_hf(hf_configs.k3())
    text = carried["text_config"]
    for key in ("vision_config", "auto_map", "architectures", "media_placeholder_token_id"):
        assert key in carried
    for key in ("topk_method", "rope_parameters", "quantization_config", "num_key_value_heads", "model_type"):
        assert key in text
    for key in ("hidden_size", "num_experts", "q_lora_rank", "attn_res_block_size", "activation_situ_beta"):
        assert key not in text
    assert set(text["linear_attn_config"]) == set()


def test_inert_fields_are_carried():
    hf = hf_configs.tiny_kimi_linear()
    hf.update(activation_situ_beta=2.0, use_grouped_topk=False, num_expert_group=4, topk_group=2)
    model, carried = model_config_from_hf(hf)
    assert model.moe.expert_groups == 1 and model.situ_beta == 4.0   # SwiGLU; grouping switched off
    assert {"activation_situ_beta", "num_expert_group", "topk_group"} <= set(carried)
    assert hf_config_from_model(model, carried) == hf


def test_router_fields():
    hf = hf_configs.tiny_kimi_linear()
    hf.update(moe_router_activation_func="softmax", moe_renormalize=False, num_expert_group=4, topk_group=2)
    moe = model_config_from_hf(hf)[0].moe
    assert (moe.router_score, moe.renormalize, moe.expert_groups, moe.topk_groups) == ("softmax", False, 4, 2)
    hf.update(num_experts_per_token=1, moe_renormalize=True)   # the reference skips renormalising k = 1
    model, carried = model_config_from_hf(hf)
    assert model.moe.renormalize is False and hf_config_from_model(model, carried) == hf


def test_situ_and_other_fields():
    hf = hf_configs.tiny_k3()
    text = hf["text_config"]
    text.update(activation_situ_beta=None, activation_situ_linear_beta=None, tie_word_embeddings=True,
                rms_norm_eps=1e-6, mla_use_output_gate=False, q_lora_rank=None)
    text["linear_attn_config"].update(use_full_rank_gate=False)
    del text["linear_attn_config"]["gate_lower_bound"]
    model, _ = model_config_from_hf(hf)
    assert (model.situ_beta, model.situ_linear_beta, model.tie_embeddings) == (1.0, None, True)
    assert (model.norm_eps, model.kda.output_norm_eps, model.mla.norm_eps) == (1e-6, 1e-6, 1e-6)
    assert (model.kda.gate, model.kda.output_gate, model.mla.output_gate) == ("softplus", "low_rank", False)
    assert model.mla.q_lora_rank is None and model.attn_res.block_size == 2 and model.moe.balancing == "quantile"


def test_overrides_apply_after_import():
    model, _ = model_config_from_hf(hf_configs.tiny_k3(), ["model.moe.expert_matmul=dense", "model.remat=full"])
    assert model.moe.expert_matmul == "dense" and model.remat == "full"
    with pytest.raises(ConfigError, match="model.moe.expert_matmull"):
        model_config_from_hf(hf_configs.tiny_k3(), ["model.moe.expert_matmull=dense"])


def _set(path, value):
    def mutate(hf):
        target = text_of(hf)
        *parents, leaf = path.split(".")
        for parent in parents:
            target = target[parent]
        if value is KeyError:
            del target[leaf]
        else:
            target[leaf] = value
    return mutate


BAD_FIELDS = [
    ("hidden_act", "gelu", "text_config.hidden_act"),
    ("mla_use_nope", False, "text_config.mla_use_nope"),
    ("moe_layer_freq", 2, "text_config.moe_layer_freq"),
    ("num_nextn_predict_layers", 1, "text_config.num_nextn_predict_layers"),
    ("moe_router_activation_func", "tanh", "text_config.moe_router_activation_func"),
    ("num_experts", None, "text_config.num_experts"),
    ("hidden_size", KeyError, "text_config.hidden_size"),
    ("hidden_size", "64", "text_config.hidden_size"),
    ("linear_attn_config", KeyError, "text_config.linear_attn_config"),
    ("linear_attn_config.kda_layers", [0, 1, 2], "text_config.linear_attn_config.kda_layers"),
    ("linear_attn_config.kda_layers", [1, 2, 3, 4], "text_config.linear_attn_config.full_attn_layers"),
    ("linear_attn_config.kda_layers", [1, 1, 2], "text_config.linear_attn_config.kda_layers"),
    ("linear_attn_config.head_dim", 0, "text_config.linear_attn_config.head_dim"),
    ("routed_expert_hidden_size", None, "text_config.latent_moe_use_norm"),
    ("num_experts_per_token", 4, "text_config.num_experts_per_token"),
    ("num_expert_group", 3, "text_config.num_expert_group"),
    ("attn_res_block_size", 0, "text_config.attn_res_block_size"),
    ("quantization_config", {"quant_method": "fp8", "format": "float-quantized"}, "text_config.quantization_config"),
    ("quantization_config", {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"},
     "text_config.quantization_config"),
]


@pytest.mark.parametrize("path, value, field", BAD_FIELDS)
def test_unsupported_value_is_a_one_line_error_naming_the_field(path, value, field):
    hf = hf_configs.tiny_k3()
    _set(path, value)(hf)
    with pytest.raises(HFConfigError) as error:
        model_config_from_hf(hf)
    assert "\n" not in str(error.value) and f"field {field}:" in str(error.value)


@pytest.mark.parametrize("hf, field", [({"model_type": "llama"}, "model_type"),
                                       ({"model_type": "kimi_k3"}, "text_config"), ([], "(top level)")])
def test_not_a_kimi_config(hf, field):
    with pytest.raises(HFConfigError) as error:
        checkpoint_flavour(hf)
    assert f"field {field}:" in str(error.value)


@pytest.mark.parametrize("override, field", [
    ("model.kda.value_heads=4", "model.kda.value_heads"),
    ("model.mla.norm_eps=1e-5", "model.mla.norm_eps"),
    ("model.kda.output_norm_eps=1e-6", "model.kda.output_norm_eps"),
    ("model.moe.router_bias_in_weights=true", "model.moe.router_bias_in_weights"),
])
def test_export_refuses_what_config_json_cannot_state(override, field):
    model, carried = model_config_from_hf(hf_configs.tiny_k3(), [override])
    with pytest.raises(HFConfigError, match=f"field {field}:"):
        hf_config_from_model(model, carried)


def test_export_writes_model_changes_over_carried_fields():
    hf = hf_configs.tiny_k3()
    hf["text_config"]["num_experts"] = 8
    model, carried = model_config_from_hf(hf, ["model.tie_embeddings=true", "model.moe.router_score=softmax",
                                                "model.moe.expert_groups=2", "model.moe.topk_groups=1"])
    out = hf_config_from_model(model, carried)
    text = out["text_config"]
    assert text["tie_word_embeddings"] is True and out["tie_word_embeddings"] is True
    assert (text["moe_router_activation_func"], text["num_expert_group"], text["topk_group"]) == ("softmax", 2, 1)
    assert model_config_from_hf(out)[0] == model
