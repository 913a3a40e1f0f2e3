"""The tensor names of the released checkpoints, as the public loaders that read them spell them.

Copied (names only) from:

- K3 (``language_model.model.`` / ``language_model.lm_head.weight``, MXFP4 routed experts):
  torchtitan PR #4281, https://github.com/pytorch/torchtitan/pull/4281 —
  ``torchtitan/models/kimi_k3/hf_key_map.py`` (the map its test drives with the released
  ``model.safetensors.index.json``: 497,220 keys in 59 patterns, ``.<digits>.`` -> ``.N.``; 93
  ``self_attention_res_proj`` and 93 ``mlp_res_proj`` keys, one ``output_attn_res_proj``; every
  ``.experts.`` key a ``weight_packed`` or ``weight_scale``), and torchtitan PR #4791,
  https://github.com/pytorch/torchtitan/pull/4791 — ``torchtitan/models/kimi_k3/state_dict_adapter.py``
  (its HF templates; ``PackedPairSpec(packed_suffix=".weight_packed", scale_suffix=".weight_scale")``,
  both uint8 and 2-D with ``packed.shape[1] * 2 == scale.shape[1] * 32``; ``A_log`` a vector of
  128 entries for 96 heads of dim 128 (``LogicalPrefixSpec``); the unused
  ``layers.0.self_attention_res_{norm,proj}`` pair; the vision tower's names).
- Kimi Linear (``model.`` / ``lm_head.weight``, bf16): vLLM
  https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/models/kimi_linear.py and
  https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/layers/kda.py (module
  names; ``dt_bias`` [H*K], ``{q,k,v}_conv1d.weight`` [H*K, 1, W], ``A_log`` [1, 1, H, 1]), and the
  Hugging Face ``modeling_kimi.py`` of moonshotai/Kimi-Linear-48B-A3B (read in its copy
  https://github.com/troy12x/quasar-kimi/blob/main/modeling_kimi.py: ``KimiSparseMoeBlock``
  ``block_sparse_moe.{gate,experts.E.w1/w2/w3,shared_experts}``, dense ``mlp``, fla
  ``ShortConvolution`` ``{q,k,v}_conv1d``, ``A_log`` ``.view(1, 1, -1, 1)``).
"""
import re

K3_MODEL = ("language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
            "language_model.model.output_attn_res_norm.weight", "language_model.model.output_attn_res_proj.weight",
            "language_model.lm_head.weight")
K3_LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attention_res_norm.weight",
            "self_attention_res_proj.weight", "mlp_res_norm.weight", "mlp_res_proj.weight")
K3_KDA = tuple(f"self_attn.{n}" for n in (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
    "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight", "g_proj.weight", "o_norm.weight", "o_proj.weight",
    "A_log", "dt_bias"))
K3_MLA = tuple(f"self_attn.{n}.weight" for n in (
    "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "g_proj", "o_proj"))
DENSE = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
K3_MOE = tuple(f"block_sparse_moe.{n}" for n in (
    "gate.weight", "gate.e_score_correction_bias", "routed_expert_down_proj.weight", "routed_expert_up_proj.weight",
    "routed_expert_norm.weight", "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
    "shared_experts.down_proj.weight",
    *(f"experts.N.{w}.{part}" for w in ("w1", "w2", "w3") for part in ("weight_packed", "weight_scale"))))
K3_VISION = ("vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
             "vision_tower.encoder.blocks.N.norm0.weight", "vision_tower.encoder.blocks.N.norm1.weight",
             "vision_tower.encoder.blocks.N.wqkv.weight", "vision_tower.encoder.blocks.N.wo.weight",
             "vision_tower.encoder.blocks.N.mlp.fc0.weight", "vision_tower.encoder.blocks.N.mlp.fc1.weight",
             "vision_tower.encoder.final_layernorm.weight", "mm_projector.proj.N.weight", "mm_projector.post_norm.weight")
K3_INDEX_KEYS, K3_INDEX_PATTERNS = 497_220, 59

KIMI_LINEAR_MODEL = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
KIMI_LINEAR_LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight")
KIMI_LINEAR_KDA = tuple(f"self_attn.{n}" for n in (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
    "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight", "g_a_proj.weight", "g_b_proj.weight", "o_norm.weight",
    "o_proj.weight", "A_log", "dt_bias"))
KIMI_LINEAR_MLA = tuple(f"self_attn.{n}.weight" for n in (
    "q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"))
KIMI_LINEAR_MOE = tuple(f"block_sparse_moe.{n}" for n in (
    "gate.weight", "gate.e_score_correction_bias", "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
    "shared_experts.down_proj.weight", *(f"experts.N.{w}.weight" for w in ("w1", "w2", "w3"))))

RELEASES = {
    "k3": ("language_model.model.layers.", K3_MODEL, K3_LAYER, K3_KDA, K3_MLA, K3_MOE),
    "kimi_linear": ("model.layers.", KIMI_LINEAR_MODEL, KIMI_LINEAR_LAYER, KIMI_LINEAR_KDA, KIMI_LINEAR_MLA,
                    KIMI_LINEAR_MOE),
}


def pattern(name: str) -> str:
    """A key with its numbers replaced the way torchtitan's test counts patterns."""
    return re.sub(r"\.\d+\.", ".N.", name)


def expected_layer(flavour: str, mla: bool, dense: bool) -> set[str]:
    """The names (after ``layers.N.``, experts as ``N``) of one released layer of ``flavour``."""
    _, _, layer, kda, mla_names, moe = RELEASES[flavour]
    return {*layer, *(mla_names if mla else kda), *(DENSE if dense else moe)}
