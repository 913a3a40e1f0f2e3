"""config.json dicts in the released layouts, written here from the published field lists.

Kimi Linear 48B-A3B: the fields of moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json as
vLLM / Megatron-Bridge / mlx test fixtures reproduce them. Kimi K3: the defaults of the K3
``configuration_kimi_k3.py`` (stated there to be the released config.json's values), nested
under ``text_config`` of the ``kimi_k3`` wrapper with a vision tower.
"""
import copy


def kimi_linear_48b() -> dict:
    kda_layers = [n for n in range(1, 28) if n % 4 != 0 and n != 27]
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                     "AutoModel": "modeling_kimi.KimiLinearModel",
                     "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
        "model_type": "kimi_linear",
        "bos_token_id": 163584,
        "eos_token_id": 163585,
        "pad_token_id": 163839,
        "first_k_dense_replace": 1,
        "head_dim": 72,
        "hidden_act": "silu",
        "hidden_size": 2304,
        "initializer_range": 0.02,
        "intermediate_size": 9216,
        "kv_lora_rank": 512,
        "linear_attn_config": {
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
            "head_dim": 128,
            "kda_layers": kda_layers,
            "num_heads": 32,
            "short_conv_kernel_size": 4,
        },
        "mla_use_nope": True,
        "model_max_length": 1048576,
        "moe_intermediate_size": 1024,
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "num_attention_heads": 32,
        "num_expert_group": 1,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_hidden_layers": 27,
        "num_key_value_heads": 32,
        "num_nextn_predict_layers": 0,
        "num_shared_experts": 1,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "routed_scaling_factor": 2.446,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.56.0",
        "use_cache": True,
        "use_grouped_topk": True,
        "v_head_dim": 128,
        "vocab_size": 163840,
    }


def k3_text(num_layers: int = 93) -> dict:
    full = list(range(4, num_layers, 4)) + [num_layers]
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "intermediate_size": 33792,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 96,
        "num_key_value_heads": 96,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1048576,
        "tie_word_embeddings": False,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "attn_res_block_size": 12,
        "num_nextn_predict_layers": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "linear_attn_config": {
            "kda_layers": [n for n in range(1, num_layers + 1) if n not in full],
            "full_attn_layers": full,
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
        },
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                          "weights": {"num_bits": 4, "type": "float", "group_size": 32}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:vision_tower.*"],
        },
        "pad_token_id": 163839,
        "bos_token_id": 163584,
        "eos_token_id": 163586,
    }


def k3(num_layers: int = 93) -> dict:
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config"},
        "text_config": k3_text(num_layers),
        "vision_config": {"patch_size": 14, "vt_hidden_size": 1024, "vt_num_hidden_layers": 27,
                          "merge_kernel_size": [2, 2], "text_hidden_size": 7168},
        "media_placeholder_token_id": 163605,
        "ignore_index": -100,
        "pad_token_id": 163839,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }


def tiny_k3() -> dict:
    """A 4-layer K3-shaped config (KDA, KDA, KDA, MLA; block AttnRes of 2)."""
    hf = k3(4)
    text = hf["text_config"]
    text.update(hidden_size=64, vocab_size=640, intermediate_size=128, num_attention_heads=2,
                num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, num_experts=4, num_experts_per_token=2,
                num_shared_experts=1, moe_intermediate_size=64, routed_expert_hidden_size=32,
                attn_res_block_size=2)
    text["linear_attn_config"].update(num_heads=2, head_dim=32)
    return hf


def tiny_kimi_linear() -> dict:
    """A 4-layer Kimi-Linear-shaped config (KDA, MLA, KDA, MLA with explicit lists)."""
    hf = kimi_linear_48b()
    hf.update(hidden_size=64, vocab_size=512, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=16, num_experts=8, num_experts_per_token=2,
              moe_intermediate_size=32, head_dim=32)
    hf["linear_attn_config"] = {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 2,
                                "head_dim": 32, "short_conv_kernel_size": 4}
    return copy.deepcopy(hf)
