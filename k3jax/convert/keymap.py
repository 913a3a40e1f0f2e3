"""Hugging Face tensor names <-> k3jax parameters (SPEC §7), from the model config alone.

Every HF tensor maps to one region of one k3jax leaf (`TensorMap`): the leaf key of the flat
parameter dict (`k3jax.training.split_model`), the index inside it (the repeat of a scanned body
layer, then the expert), and a layout rule:

    linear   HF W [out, in]  ->  W^T reshaped to the k3jax shape, whose first ``in_dims`` axes are the input
    packed   uint8 copied as it is: MXFP4 expert codes / scales of a model with ``moe.expert_format: mxfp4``
    reshape  same values, new shape (norms [d], convolutions [P, 1, W] -> [H, K, W], flat dt_bias [P] -> [H, K],
             AttnRes projections [1, d] -> [d])
    narrow   A_log: the first HV entries of a zero-padded [n >= HV] (K3) or of [1, 1, HV, 1] (Kimi Linear)

Layer l of the HF checkpoint is ``prefix/layers/i`` (unrolled), ``body/layers/j`` at repeat r
(scanned: the leaf has a leading repeat axis) or ``suffix/layers/i`` (`k3jax.model.layer_groups`).
Names depend on the layer's kind: ``g_proj`` / ``o_proj`` are KDA's output gate and projection in
KDA layers and MLA's in MLA layers. Routed experts ``experts.{e}.w1|w3|w2`` (gate, up, down) are
one expert row of ``experts/w_gate|w_up|w_down``, or with ``moe.expert_format: mxfp4`` their
``weight_packed`` / ``weight_scale`` are one expert row of the buffers ``experts/w_*_packed|_scale``
(the release layout, no decode); shared experts are ``gate|up|down_proj``.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from k3jax.config import ModelConfig
from k3jax.model import layer_groups

PREFIXES = {"k3": ("language_model.model.", "language_model.lm_head.weight"),
            "kimi_linear": ("model.", "lm_head.weight")}
# The released K3 stores A_log zero-padded to 128 entries for its 96 KDA heads of dim 128 (the
# padded length torchtitan's loader declares for exactly that layout).
RELEASED_A_LOG = ((96, 128), 128)
VISION_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.", "vision_model.")


class TensorMap(NamedTuple):
    hf_name: str                  # routed experts: the module name + ".weight" (MXFP4: "_packed" / "_scale")
    top: str                      # "params" or "buffers" (the router's selection bias)
    key: str                      # the k3jax leaf
    index: tuple[int, ...]        # the region of the leaf: (repeat,) for scanned layers, then (expert,)
    shape: tuple[int, ...]        # the region's k3jax shape
    hf_shape: tuple[int, ...]     # the HF shape (A_log: the unpadded default)
    layout: str                   # "linear", "reshape", "narrow" or "packed"
    in_dims: int = 1              # linear: leading k3jax axes that are the HF input axis
    expert: bool = False          # a routed expert weight (may arrive as MXFP4)


def _linear(name, key, index, shape, in_dims=1, top="params", expert=False) -> TensorMap:
    hf_shape = (math.prod(shape[in_dims:]), math.prod(shape[:in_dims]))
    return TensorMap(name, top, key, index, tuple(shape), hf_shape, "linear", in_dims, expert)


def _reshape(name, key, index, shape, hf_shape, top="params") -> TensorMap:
    return TensorMap(name, top, key, index, tuple(shape), tuple(hf_shape), "reshape")


def _layer_location(config: ModelConfig, layer: int) -> tuple[str, tuple[int, ...]]:
    """(k3jax key prefix, leading index) of HF layer ``layer``."""
    groups = layer_groups(config)
    if layer in groups.prefix:
        return f"prefix/layers/{groups.prefix.index(layer)}/", ()
    if layer in groups.suffix:
        return f"suffix/layers/{groups.suffix.index(layer)}/", ()
    offset = layer - groups.body[0]
    period = len(groups.body)
    return f"body/layers/{offset % period}/", (offset // period,)


def _a_log_shape(hf: str, value_heads: int, dim: int) -> tuple[int, ...]:
    """The HF shape of ``A_log`` a checkpoint without a source manifest gets: Kimi Linear's
    [1, 1, H, 1]; K3's flat [H], except the released 96-head x 128 layout, which stores 128
    entries, the tail zero (`RELEASED_A_LOG`)."""
    if not hf.startswith(PREFIXES["k3"][0]):
        return (1, 1, value_heads, 1)
    heads_dim, padded = RELEASED_A_LOG
    return (padded,) if (value_heads, dim) == heads_dim else (value_heads,)


def _kda_maps(config: ModelConfig, hf: str, k3: str, index) -> list[TensorMap]:
    kda, d = config.kda, config.d_model
    heads, value_heads, dim, taps = kda.num_heads, kda.num_value_heads, kda.head_dim, kda.conv_size
    maps = [
        _linear(hf + "q_proj.weight", k3 + "q_proj", index, (d, heads, dim)),
        _linear(hf + "k_proj.weight", k3 + "k_proj", index, (d, heads, dim)),
        _linear(hf + "v_proj.weight", k3 + "v_proj", index, (d, value_heads, dim)),
        _reshape(hf + "q_conv1d.weight", k3 + "q_conv", index, (heads, dim, taps), (heads * dim, 1, taps)),
        _reshape(hf + "k_conv1d.weight", k3 + "k_conv", index, (heads, dim, taps), (heads * dim, 1, taps)),
        _reshape(hf + "v_conv1d.weight", k3 + "v_conv", index, (value_heads, dim, taps), (value_heads * dim, 1, taps)),
        _linear(hf + "f_a_proj.weight", k3 + "f_a_proj", index, (d, dim)),
        _linear(hf + "f_b_proj.weight", k3 + "f_b_proj", index, (dim, value_heads, dim)),
        _linear(hf + "b_proj.weight", k3 + "b_proj", index, (d, value_heads)),
        TensorMap(hf + "A_log", "params", k3 + "A_log", index, (value_heads,), _a_log_shape(hf, value_heads, dim),
                  "narrow"),
        _reshape(hf + "dt_bias", k3 + "dt_bias", index, (value_heads, dim), (value_heads * dim,)),
        _reshape(hf + "o_norm.weight", k3 + "o_norm", index, (dim,), (dim,)),
        _linear(hf + "o_proj.weight", k3 + "o_proj", index, (value_heads, dim, d), in_dims=2),
    ]
    if kda.output_gate == "full":
        maps.append(_linear(hf + "g_proj.weight", k3 + "g_proj", index, (d, value_heads, dim)))
    else:
        maps += [_linear(hf + "g_a_proj.weight", k3 + "g_a_proj", index, (d, dim)),
                 _linear(hf + "g_b_proj.weight", k3 + "g_b_proj", index, (dim, value_heads, dim))]
    return maps


def _mla_maps(config: ModelConfig, hf: str, k3: str, index) -> list[TensorMap]:
    mla, d = config.mla, config.d_model
    heads = mla.num_heads
    if mla.q_lora_rank is None:
        maps = [_linear(hf + "q_proj.weight", k3 + "q_proj", index, (d, heads, mla.qk_head_dim))]
    else:
        maps = [_linear(hf + "q_a_proj.weight", k3 + "q_a_proj", index, (d, mla.q_lora_rank)),
                _reshape(hf + "q_a_layernorm.weight", k3 + "q_a_norm", index, (mla.q_lora_rank,), (mla.q_lora_rank,)),
                _linear(hf + "q_b_proj.weight", k3 + "q_b_proj", index, (mla.q_lora_rank, heads, mla.qk_head_dim))]
    maps += [
        _linear(hf + "kv_a_proj_with_mqa.weight", k3 + "kv_a_proj", index, (d, mla.latent_width)),
        _reshape(hf + "kv_a_layernorm.weight", k3 + "kv_a_norm", index, (mla.kv_lora_rank,), (mla.kv_lora_rank,)),
        _linear(hf + "kv_b_proj.weight", k3 + "kv_b_proj", index,
                (mla.kv_lora_rank, heads, mla.nope_head_dim + mla.value_head_dim)),
        _linear(hf + "o_proj.weight", k3 + "o_proj", index, (heads, mla.value_head_dim, d), in_dims=2),
    ]
    if mla.output_gate:
        maps.append(_linear(hf + "g_proj.weight", k3 + "g_proj", index, (d, heads, mla.value_head_dim)))
    return maps


def _glu_maps(hf: str, k3: str, index, d: int, width: int) -> list[TensorMap]:
    return [_linear(hf + "gate_proj.weight", k3 + "w_gate", index, (d, width)),
            _linear(hf + "up_proj.weight", k3 + "w_up", index, (d, width)),
            _linear(hf + "down_proj.weight", k3 + "w_down", index, (width, d))]


def _moe_maps(config: ModelConfig, hf: str, k3: str, index) -> list[TensorMap]:
    moe, d = config.moe, config.d_model
    width = d if moe.latent_dim is None else moe.latent_dim
    maps = [_linear(hf + "gate.weight", k3 + "router/weight", index, (d, moe.num_experts)),
            _reshape(hf + "gate.e_score_correction_bias", k3 + "router/e_score_correction_bias", index,
                     (moe.num_experts,), (moe.num_experts,), top="buffers")]
    if moe.latent_dim is not None:
        maps += [_linear(hf + "routed_expert_down_proj.weight", k3 + "latent_down", index, (d, moe.latent_dim)),
                 _linear(hf + "routed_expert_up_proj.weight", k3 + "latent_up", index, (moe.latent_dim, d))]
    if moe.latent_norm:
        maps.append(_reshape(hf + "routed_expert_norm.weight", k3 + "latent_norm_weight", index,
                             (moe.latent_dim,), (moe.latent_dim,)))
    if moe.shared_width is not None:
        maps += _glu_maps(hf + "shared_experts.", k3 + "shared/", index, d, moe.shared_width)
    for expert in range(moe.num_experts):
        name, at = f"{hf}experts.{expert}.", (*index, expert)
        if moe.expert_format == "mxfp4":
            maps += [*_packed_maps(name + "w1.weight", k3 + "experts/w_gate", at, moe.expert_width, width),
                     *_packed_maps(name + "w3.weight", k3 + "experts/w_up", at, moe.expert_width, width),
                     *_packed_maps(name + "w2.weight", k3 + "experts/w_down", at, width, moe.expert_width)]
            continue
        maps += [_linear(name + "w1.weight", k3 + "experts/w_gate", at, (width, moe.expert_width), expert=True),
                 _linear(name + "w3.weight", k3 + "experts/w_up", at, (width, moe.expert_width), expert=True),
                 _linear(name + "w2.weight", k3 + "experts/w_down", at, (moe.expert_width, width), expert=True)]
    return maps


def _packed_maps(hf_weight: str, key: str, index, out: int, inputs: int) -> list[TensorMap]:
    """An MXFP4 expert weight [out, in] kept packed: its codes and scales, each one expert row of a buffer."""
    packed, scale = mxfp4_names(hf_weight)
    return [TensorMap(packed, "buffers", key + "_packed", index, (out, inputs // 2), (out, inputs // 2), "packed"),
            TensorMap(scale, "buffers", key + "_scale", index, (out, inputs // 32), (out, inputs // 32), "packed")]


def _res_maps(hf: str, k3: str, index, d: int, hf_names: tuple[str, str], k3_name: str) -> list[TensorMap]:
    norm, proj = hf_names
    return [_reshape(f"{hf}{norm}.weight", f"{k3}{k3_name}/key_norm", index, (d,), (d,)),
            _reshape(f"{hf}{proj}.weight", f"{k3}{k3_name}/query", index, (d,), (1, d))]


def layer_maps(config: ModelConfig, flavour: str, layer: int) -> list[TensorMap]:
    """The tensors of HF layer ``layer``."""
    d = config.d_model
    hf = f"{PREFIXES[flavour][0]}layers.{layer}."
    k3, index = _layer_location(config, layer)
    maps = [_reshape(hf + "input_layernorm.weight", k3 + "input_norm", index, (d,), (d,)),
            _reshape(hf + "post_attention_layernorm.weight", k3 + "post_attention_norm", index, (d,), (d,))]
    if config.attn_res.kind == "block":
        maps += _res_maps(hf, k3, index, d, ("self_attention_res_norm", "self_attention_res_proj"), "attention_res")
        maps += _res_maps(hf, k3, index, d, ("mlp_res_norm", "mlp_res_proj"), "ffn_res")
    mixer = _mla_maps if config.is_mla(layer) else _kda_maps
    maps += mixer(config, hf + "self_attn.", k3 + "mixer/", index)
    if config.is_dense(layer):
        maps += _glu_maps(hf + "mlp.", k3 + "ffn/", index, d, config.dense_width)
    else:
        maps += _moe_maps(config, hf + "block_sparse_moe.", k3 + "ffn/", index)
    return maps


def model_maps(config: ModelConfig, flavour: str) -> list[TensorMap]:
    """Every tensor of the text model, in checkpoint order: embedding, layers, final mix, norm, head."""
    if flavour not in PREFIXES:
        raise ValueError(f"unknown checkpoint flavour {flavour!r}; expected one of {sorted(PREFIXES)}")
    prefix, head = PREFIXES[flavour]
    d, vocab = config.d_model, config.vocab_size
    maps = [_reshape(prefix + "embed_tokens.weight", "embedding", (), (vocab, d), (vocab, d))]
    for layer in range(config.num_layers):
        maps += layer_maps(config, flavour, layer)
    if config.attn_res.kind == "block":
        maps += _res_maps(prefix, "", (), d, ("output_attn_res_norm", "output_attn_res_proj"), "output_res")
    maps += [_reshape(prefix + "norm.weight", "final_norm", (), (d,), (d,)),
             _linear(head, "lm_head", (), (d, vocab))]
    return maps


def mxfp4_names(hf_name: str) -> tuple[str, str]:
    """(weight_packed, weight_scale) names of an expert weight ``....weight``."""
    return hf_name + "_packed", hf_name + "_scale"


def is_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIXES) or ".vision_tower." in name
