"""Hugging Face ``config.json`` <-> k3jax `ModelConfig` for the released Kimi K3 and Kimi Linear.

    model, carried = model_config_from_hf(json.load(open("config.json")))
    hf = hf_config_from_model(model, carried)            # the same config.json again

Two layouts (SPEC §7):

    K3           {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
                  "text_config": {"model_type": "kimi_linear", <text fields>}, "vision_config": ...}
                  tensors under ``language_model.model.`` (`checkpoint_flavour` "k3")
    Kimi Linear  {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], <text fields>}
                  tensors under ``model.`` (`checkpoint_flavour` "kimi_linear")

The text fields, as the reference code reads them (Moonshot's ``configuration_kimi.py`` /
``modeling_kimi.py`` of Kimi-Linear-48B-A3B and the K3 ``configuration_kimi_k3.py`` /
``modeling_kimi_linear.py``; vLLM ``kimi_linear.py``; torchtitan ``kimi_k3/hf_key_map.py``):

    num_hidden_layers, hidden_size, vocab_size      num_layers, d_model, vocab_size
    linear_attn_config.kda_layers / full_attn_layers 1-BASED layer numbers (``is_kda_layer(i)``
                                                    tests i + 1) -> the 0-based MLA placement
    linear_attn_config.num_heads, head_dim,         kda.num_heads, head_dim, conv_size
      short_conv_kernel_size
    linear_attn_config.gate_lower_bound             absent/null: kda.gate softplus; b: lower_bound b
    linear_attn_config.use_full_rank_gate           kda.output_gate full (g_proj) / low_rank (g_a, g_b)
    num_attention_heads, q_lora_rank, kv_lora_rank, mla.num_heads, q_lora_rank, kv_lora_rank,
      qk_nope_head_dim, qk_rope_head_dim, v_head_dim  nope_head_dim, rope_head_dim, value_head_dim
    mla_use_output_gate                             mla.output_gate
    mla_use_nope                                    must be true: k3jax applies no rotary embedding
    num_experts, num_experts_per_token,             moe.num_experts, top_k, expert_width
      moe_intermediate_size
    routed_expert_hidden_size, latent_moe_use_norm  moe.latent_dim (null: plain MoE), latent_norm
    num_shared_experts                              moe.num_shared_experts (one GLU of n * m)
    first_k_dense_replace, intermediate_size        dense_layers, dense_width
    moe_layer_freq                                  must be 1 (every layer after the dense ones is MoE)
    hidden_act, activation_situ_beta,               "situ": activation situ, situ_beta (null: 1.0,
      activation_situ_linear_beta                   the reference's ``beta or 1.0``), situ_linear_beta
                                                    (null: no clip); "silu": swiglu
    moe_router_activation_func                      moe.router_score (sigmoid | softmax)
    moe_renormalize                                 moe.renormalize (the reference renormalises only
                                                    when top-k > 1)
    routed_scaling_factor                           moe.routed_scale
    use_grouped_topk, num_expert_group, topk_group  moe.expert_groups / topk_groups when grouping
                                                    acts: use_grouped_topk (vLLM honours it) and
                                                    num_expert_group > topk_group; else 1 / 1
    attn_res_block_size                             null: attn_res none; S: block AttnRes of S layers
    rms_norm_eps                                    norm_eps (every decoder RMSNorm, the AttnRes key
                                                    norms, the latent norm) and kda.output_norm_eps
                                                    (the reference's o_norm uses it); the MLA q_a /
                                                    kv_a norms keep the reference's fixed 1e-6
    tie_word_embeddings                             tie_embeddings
    num_nextn_predict_layers                        must be 0 (no multi-token-prediction layers)
    quantization_config                             absent, or compressed-tensors mxfp4-pack-quantized
                                                    (routed experts only, SPEC §7); carried

A missing field takes the reference config class's default. Everything the model does not read
(model_type, architectures, auto_map, rope_theta / rope_parameters, vision_config, torch_dtype,
token ids, head_dim, num_key_value_heads, max_position_embeddings, topk_method,
quantization_config, and fields made inert by others, e.g. the SiTU betas of a SwiGLU model) does
not change the text model's computation here and comes back as ``carried``: the source mapping
with the consumed keys removed, nesting kept, for `hf_config_from_model` to write back (a field
stated at the reference's default stays there too: stating a default changes nothing, and export
then writes the file's fields back exactly). What the HF file does not say but k3jax needs
follows the released training recipes (SPEC §6): quantile balancing for a K3-style (block
AttnRes) model, sign balancing otherwise. Run settings (compute_dtype, expert_matmul, remat, ...)
keep k3jax's defaults; set them with overrides.
"""
from __future__ import annotations

import copy
import typing
from typing import Any

from k3jax.config import MAX_EXPERTS, MAX_LAYERS, ConfigError, ModelConfig, config_from_dict, periodic_mla_layers

K3_MODEL_TYPE = "kimi_k3"
TEXT_MODEL_TYPE = "kimi_linear"
K3_ARCHITECTURE = "KimiK3ForConditionalGeneration"
TEXT_ARCHITECTURE = "KimiLinearForCausalLM"
MXFP4_QUANT_METHOD = "compressed-tensors"
MXFP4_FORMAT = "mxfp4-pack-quantized"
HF_MLA_NORM_EPS = 1e-6       # KimiRMSNorm's default, which the reference's q_a / kv_a norms use
HF_ACTIVATIONS = {"situ": "situ", "silu": "swiglu"}   # hidden_act -> ModelConfig.activation
_REQUIRED = object()


class HFConfigError(ValueError):
    """A ``config.json`` k3jax cannot express (or a model config.json cannot): one line naming the field."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"config.json field {field}: {message}")


# --- reading ---------------------------------------------------------------------------------


def _check_type(value: Any, kind: type, field: str, optional: bool) -> Any:
    """``value`` if it is of JSON type ``kind`` (bool, int, float (an int is a float), str, list, dict)."""
    if value is None and optional:
        return None
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise HFConfigError(field, f"expected {'null or ' if optional else ''}{kind.__name__}, got {value!r}")
    return float(value) if kind is float else value


class _Section:
    """One mapping of config.json being read; remembers which keys the model consumed."""

    def __init__(self, data: Any, prefix: str):
        if not isinstance(data, dict):
            raise HFConfigError(prefix.rstrip(".") or "(top level)", f"expected a mapping, got {data!r}")
        self.data, self.prefix, self.used = data, prefix, set()

    def field(self, key: str) -> str:
        return self.prefix + key

    def peek(self, key: str, kind: type, default: Any = None, optional: bool = True) -> Any:
        """The value of ``key`` (type-checked), left in the carried remainder."""
        if key not in self.data:
            return default
        return _check_type(self.data[key], kind, self.field(key), optional)

    def take(self, key: str, kind: type, default: Any = _REQUIRED, optional: bool = False) -> Any:
        """The value of ``key`` (type-checked), consumed by the model; ``default`` when absent. A
        value equal to the reference's ``default`` says nothing and stays in the remainder too."""
        if key not in self.data:
            if default is _REQUIRED:
                raise HFConfigError(self.field(key), "required field is missing")
            return default
        value = _check_type(self.data[key], kind, self.field(key), optional)
        if default is _REQUIRED or value != default:
            self.used.add(key)
        return value

    def remainder(self) -> dict:
        return {key: copy.deepcopy(value) for key, value in self.data.items() if key not in self.used}


def _count(section: _Section, key: str, limit: int) -> int:
    """A required positive count of at most ``limit``, checked before anything of that count is built."""
    value = section.take(key, int)
    if not 1 <= value <= limit:
        raise HFConfigError(section.field(key), f"{value} is outside 1..{limit}")
    return value


def _listed(numbers: list[int]) -> str:
    """A layer list for an error message, at most 12 numbers shown."""
    return str(numbers) if len(numbers) <= 12 else f"[{', '.join(map(str, numbers[:12]))}, ... ({len(numbers)} in all)]"


def _one_based_layers(section: _Section, key: str, num_layers: int, required: bool) -> list[int] | None:
    """A 1-based layer list of ``linear_attn_config``, checked to lie in [1, num_layers] without repeats."""
    layers = section.take(key, list, _REQUIRED if required else None, optional=not required)
    if layers is None:
        return None
    for number in layers:
        _check_type(number, int, section.field(key), optional=False)
        if not 1 <= number <= num_layers:
            raise HFConfigError(section.field(key),
                                f"layer {number} is outside 1..{num_layers} (the lists are 1-based)")
    if len(set(layers)) != len(layers):
        raise HFConfigError(section.field(key), f"names a layer twice: {_listed(layers)}")
    return sorted(layers)


def _mla_placement(mla_layers: list[int], num_layers: int) -> dict:
    """The `ModelConfig` placement fields for 0-based ``mla_layers``: the periodic form when one
    period reproduces the list (so depth scans by that period), else the explicit list."""
    last = num_layers - 1 in mla_layers
    for period in range(1, num_layers + 1):
        if list(periodic_mla_layers(num_layers, period, last)) == mla_layers:
            return {"mla_period": period, "last_layer_full_attention": last}
    return {"mla_layers": mla_layers, "last_layer_full_attention": last}


def _layer_placement(linear: _Section, num_layers: int) -> dict:
    """MLA layers from the 1-based ``kda_layers`` / ``full_attn_layers`` (which must partition the
    layers; ``full_attn_layers`` may be left out, as the complement)."""
    kda = _one_based_layers(linear, "kda_layers", num_layers, required=True)
    full = _one_based_layers(linear, "full_attn_layers", num_layers, required=False)
    complement = sorted(set(range(1, num_layers + 1)) - set(kda))
    if full is not None and full != complement:
        raise HFConfigError(linear.field("full_attn_layers"),
                            f"{_listed(full)} and kda_layers must partition layers 1..{num_layers}; "
                            f"expected {_listed(complement)}")
    return _mla_placement([number - 1 for number in complement], num_layers)


def _check_quantization(section: _Section) -> None:
    """``quantization_config``, when present, must be the release's MXFP4 (compressed-tensors
    ``mxfp4-pack-quantized``, in its top-level ``format`` or in every config group)."""
    quantization = section.peek("quantization_config", dict)
    if quantization is None:
        return
    field = section.field("quantization_config")
    if quantization.get("quant_method") != MXFP4_QUANT_METHOD:
        raise HFConfigError(field, f"quant_method {quantization.get('quant_method')!r} is not supported; "
                                   f"k3jax reads {MXFP4_QUANT_METHOD!r} {MXFP4_FORMAT!r}")
    groups = quantization.get("config_groups") or {}
    formats = {quantization.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
    formats.discard(None)
    if formats != {MXFP4_FORMAT}:
        raise HFConfigError(field, f"format {sorted(map(str, formats)) or 'unset'} is not supported; "
                                   f"k3jax reads {MXFP4_FORMAT!r}")


def checkpoint_flavour(hf: dict) -> str:
    """"k3" (the multimodal wrapper: text fields under ``text_config``, tensors under
    ``language_model.model.``) or "kimi_linear" (flat, tensors under ``model.``)."""
    if not isinstance(hf, dict):
        raise HFConfigError("(top level)", f"expected a mapping, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type == K3_MODEL_TYPE or (model_type is None and "text_config" in hf):
        if not isinstance(hf.get("text_config"), dict):
            raise HFConfigError("text_config", f"a {K3_MODEL_TYPE!r} config needs a text_config mapping")
        return "k3"
    if model_type == TEXT_MODEL_TYPE and "text_config" not in hf:
        return "kimi_linear"
    raise HFConfigError("model_type", f"{model_type!r} is not a Kimi K3 ({K3_MODEL_TYPE!r} with a text_config) "
                                      f"or Kimi Linear ({TEXT_MODEL_TYPE!r}) config")


def _activation_fields(text: _Section) -> dict:
    """hidden_act and, for SiTU, its betas (inert, so carried, for SwiGLU)."""
    act = text.take("hidden_act", str, "silu")
    if act not in HF_ACTIVATIONS:
        raise HFConfigError(text.field("hidden_act"), f"{act!r} is not supported; k3jax has {sorted(HF_ACTIVATIONS)}")
    fields = {"activation": HF_ACTIVATIONS[act]}
    if act == "situ":
        fields["situ_beta"] = text.take("activation_situ_beta", float, None, optional=True) or 1.0
        fields["situ_linear_beta"] = text.take("activation_situ_linear_beta", float, None, optional=True)
    return fields


def _kda_fields(linear: _Section, norm_eps: float) -> dict:
    lower_bound = linear.take("gate_lower_bound", float, None, optional=True)
    fields = {
        "num_heads": linear.take("num_heads", int),
        "head_dim": linear.take("head_dim", int),
        "conv_size": linear.take("short_conv_kernel_size", int),
        "gate": "softplus" if lower_bound is None else "lower_bound",
        "output_gate": "full" if linear.take("use_full_rank_gate", bool, False) else "low_rank",
        "output_norm_eps": norm_eps,
    }
    if lower_bound is not None:
        fields["lower_bound"] = lower_bound
    return fields


def _mla_fields(text: _Section) -> dict:
    if text.peek("mla_use_nope", bool, True, optional=False) is not True:
        raise HFConfigError(text.field("mla_use_nope"),
                            "false (rotary MLA) is not supported; k3jax's MLA has no positional encoding")
    return {
        "num_heads": text.take("num_attention_heads", int),
        "q_lora_rank": text.take("q_lora_rank", int, None, optional=True),
        "kv_lora_rank": text.take("kv_lora_rank", int),
        "nope_head_dim": text.take("qk_nope_head_dim", int),
        "rope_head_dim": text.take("qk_rope_head_dim", int),
        "value_head_dim": text.take("v_head_dim", int),
        "output_gate": text.take("mla_use_output_gate", bool, False, optional=True) or False,
        "norm_eps": HF_MLA_NORM_EPS,
    }


def _grouping_fields(text: _Section) -> dict:
    """Grouped top-k, when it acts (use_grouped_topk, num_expert_group > topk_group); else the
    group fields are inert and stay carried."""
    grouped = text.peek("use_grouped_topk", bool, True, optional=False)
    groups = text.peek("num_expert_group", int, 1, optional=False)
    topk_groups = text.peek("topk_group", int, 1, optional=False)
    if not (grouped and groups > 1 and groups > topk_groups):
        return {}
    text.take("num_expert_group", int)
    text.take("topk_group", int)
    return {"expert_groups": groups, "topk_groups": topk_groups}


def _moe_fields(text: _Section, block_res: bool) -> dict:
    if text.peek("num_experts", int) is None:
        raise HFConfigError(text.field("num_experts"), "a model without routed experts is not supported")
    if text.peek("moe_layer_freq", int, 1, optional=False) != 1:
        raise HFConfigError(text.field("moe_layer_freq"), f"{text.data['moe_layer_freq']} is not supported; k3jax "
                                                          "puts MoE on every layer after first_k_dense_replace")
    top_k = text.take("num_experts_per_token", int)
    score = text.take("moe_router_activation_func", str, "sigmoid")
    if score not in ("sigmoid", "softmax"):
        raise HFConfigError(text.field("moe_router_activation_func"), f"{score!r} is not 'sigmoid' or 'softmax'")
    latent_dim = text.take("routed_expert_hidden_size", int, None, optional=True)
    latent_norm = text.take("latent_moe_use_norm", bool, False)
    if latent_norm and latent_dim is None:
        raise HFConfigError(text.field("latent_moe_use_norm"), "true needs routed_expert_hidden_size (a latent MoE)")
    fields = {
        "num_experts": _count(text, "num_experts", MAX_EXPERTS),
        "top_k": top_k,
        "expert_width": text.take("moe_intermediate_size", int),
        "latent_dim": latent_dim,
        "latent_norm": latent_norm,
        "num_shared_experts": text.take("num_shared_experts", int, 0, optional=True) or 0,
        "routed_scale": text.take("routed_scaling_factor", float, 1.0),
        "router_score": score,
        # the reference renormalises only when top-k > 1; with k = 1 the flag is inert (carried)
        "renormalize": text.take("moe_renormalize", bool, True) if top_k > 1 else False,
        "router_bias_in_weights": False,
        "balancing": "quantile" if block_res else "sign",
        **_grouping_fields(text),
    }
    return fields


def _text_sections(hf: dict) -> tuple[_Section, _Section | None]:
    """(the text fields, the K3 wrapper around them or None)."""
    if checkpoint_flavour(hf) == "k3":
        return _Section(hf["text_config"], "text_config."), _Section(hf, "")
    return _Section(hf, ""), None


def _model_fields(text: _Section, wrapper: _Section | None) -> tuple[dict, _Section]:
    """The ``model:`` mapping and the ``linear_attn_config`` section it consumed."""
    num_layers = _count(text, "num_hidden_layers", MAX_LAYERS)
    if text.peek("num_nextn_predict_layers", int, 0, optional=False) != 0:
        raise HFConfigError(text.field("num_nextn_predict_layers"), "multi-token-prediction layers are not supported")
    linear = _Section(text.take("linear_attn_config", dict), text.field("linear_attn_config."))
    block_size = text.take("attn_res_block_size", int, None, optional=True)
    norm_eps = text.take("rms_norm_eps", float, 1e-6)
    wrapper_tie = wrapper.peek("tie_word_embeddings", bool, False, optional=False) if wrapper else False
    for section in (text, wrapper):
        if section is not None:
            _check_quantization(section)
    model = {
        "vocab_size": text.take("vocab_size", int),
        "d_model": text.take("hidden_size", int),
        "num_layers": num_layers,
        **_layer_placement(linear, num_layers),
        "dense_layers": text.take("first_k_dense_replace", int, 0),
        "dense_width": text.take("intermediate_size", int),
        **_activation_fields(text),
        "norm_eps": norm_eps,
        "tie_embeddings": text.take("tie_word_embeddings", bool, wrapper_tie),
        "attn_res": {"kind": "none"} if block_size is None else {"kind": "block", "block_size": block_size},
        "kda": _kda_fields(linear, norm_eps),
        "mla": _mla_fields(text),
        "moe": _moe_fields(text, block_size is not None),
    }
    return model, linear


def _carried(hf: dict, text: _Section, linear: _Section, wrapper: _Section | None) -> dict:
    text_rest = text.remainder()
    text_rest["linear_attn_config"] = linear.remainder()
    if wrapper is None:
        return text_rest
    carried = copy.deepcopy({key: value for key, value in hf.items() if key != "text_config"})
    carried["text_config"] = text_rest
    return carried


# The HF field behind each k3jax model key whose validation can fail on imported values.
_HF_FIELD = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "num_layers": "num_hidden_layers",
    "mla_layers": "linear_attn_config.full_attn_layers", "mla_period": "linear_attn_config.full_attn_layers",
    "dense_layers": "first_k_dense_replace", "dense_width": "intermediate_size", "norm_eps": "rms_norm_eps",
    "situ_beta": "activation_situ_beta", "situ_linear_beta": "activation_situ_linear_beta",
    "attn_res.block_size": "attn_res_block_size",
    "kda.num_heads": "linear_attn_config.num_heads", "kda.head_dim": "linear_attn_config.head_dim",
    "kda.conv_size": "linear_attn_config.short_conv_kernel_size",
    "kda.lower_bound": "linear_attn_config.gate_lower_bound", "kda.output_norm_eps": "rms_norm_eps",
    "mla.num_heads": "num_attention_heads", "mla.q_lora_rank": "q_lora_rank", "mla.kv_lora_rank": "kv_lora_rank",
    "mla.nope_head_dim": "qk_nope_head_dim", "mla.rope_head_dim": "qk_rope_head_dim",
    "mla.value_head_dim": "v_head_dim",
    "moe.num_experts": "num_experts", "moe.top_k": "num_experts_per_token", "moe.expert_width": "moe_intermediate_size",
    "moe.latent_dim": "routed_expert_hidden_size", "moe.num_shared_experts": "num_shared_experts",
    "moe.routed_scale": "routed_scaling_factor", "moe.expert_groups": "num_expert_group",
    "moe.topk_groups": "topk_group",
}


def model_mapping_from_hf(hf: dict) -> tuple[dict, dict]:
    """``(model, carried)``: the ``model:`` section as a plain mapping (YAML-ready; combine it with
    other sections and ``key=value`` overrides through `k3jax.config.config_from_dict`) and the
    computation-neutral remainder of ``hf``. Raises `HFConfigError` naming the HF field."""
    text, wrapper = _text_sections(hf)
    model, linear = _model_fields(text, wrapper)
    try:
        config_from_dict({"model": model})
    except ConfigError as error:
        key = error.key.removeprefix("model.").split("[")[0]
        raise HFConfigError(text.prefix + _HF_FIELD.get(key, f"(k3jax model.{key})"), error.message) from None
    return model, _carried(hf, text, linear, wrapper)


def model_config_from_hf(hf: dict, overrides: typing.Sequence[str] = ()) -> tuple[ModelConfig, dict]:
    """-> (k3jax ModelConfig, carried): carried = the fields that do not change the text model's
    computation (model_type, topk_method, rope_parameters, auto_map, vision_config, architectures,
    torch_dtype, ...), kept so export can reproduce them. Fields at top level or under text_config.

    ``overrides`` are the trainer's dotted ``key=value`` strings (``model.moe.expert_matmul=dense``),
    applied to the imported config; a bad one raises `k3jax.config.ConfigError`.
    """
    model, carried = model_mapping_from_hf(hf)
    return config_from_dict({"model": model}, overrides).model, carried


# --- writing ---------------------------------------------------------------------------------


def _check_expressible(model: ModelConfig) -> None:
    """Raise `HFConfigError` (naming the k3jax field) for what config.json cannot state."""
    problems = {
        "model.kda.value_heads": (model.kda.value_heads not in (None, model.kda.num_heads),
                                  "grouped KDA values have no config.json field"),
        "model.kda.output_norm_eps": (model.kda.output_norm_eps != model.norm_eps,
                                      f"config.json has one rms_norm_eps, and model.norm_eps = {model.norm_eps}"),
        "model.mla.norm_eps": (model.mla.norm_eps != HF_MLA_NORM_EPS,
                               f"the HF Kimi code fixes the MLA q_a / kv_a norm eps at {HF_MLA_NORM_EPS}"),
        "model.moe.router_bias_in_weights": (model.moe.router_bias_in_weights,
                                             "true has no config.json field (the bias is selection-only)"),
        "model.moe.renormalize": (model.moe.renormalize and model.moe.top_k == 1,
                                  "true with top_k = 1: the HF code does not renormalise a single expert"),
    }
    for field, (bad, reason) in problems.items():
        if bad:
            raise HFConfigError(field, f"{_model_value(model, field)!r} cannot be written: {reason}")


def _model_value(model: ModelConfig, field: str) -> Any:
    """The value of dotted ``model.…`` field of ``model``."""
    value = model
    for part in field.removeprefix("model.").split("."):
        value = getattr(value, part)
    return value


def _set_unless_default(fields: dict, key: str, value: Any, default: Any) -> None:
    """Write ``key`` when ``value`` is not the reference's default or the source stated the key."""
    if value != default or key in fields:
        fields[key] = value


def _write_linear_attn(model: ModelConfig, linear: dict) -> None:
    mla = set(model.mla_layer_indices)
    linear["kda_layers"] = [layer + 1 for layer in range(model.num_layers) if layer not in mla]
    linear["full_attn_layers"] = [layer + 1 for layer in sorted(mla)]
    linear["num_heads"] = model.kda.num_heads
    linear["head_dim"] = model.kda.head_dim
    linear["short_conv_kernel_size"] = model.kda.conv_size
    _set_unless_default(linear, "use_full_rank_gate", model.kda.output_gate == "full", False)
    bound = model.kda.lower_bound if model.kda.gate == "lower_bound" else None
    _set_unless_default(linear, "gate_lower_bound", bound, None)


def _write_moe(model: ModelConfig, text: dict) -> None:
    moe = model.moe
    text["num_experts"] = moe.num_experts
    text["num_experts_per_token"] = moe.top_k
    text["moe_intermediate_size"] = moe.expert_width
    _set_unless_default(text, "routed_expert_hidden_size", moe.latent_dim, None)
    _set_unless_default(text, "latent_moe_use_norm", moe.latent_norm, False)
    _set_unless_default(text, "num_shared_experts", moe.num_shared_experts, 0)
    _set_unless_default(text, "routed_scaling_factor", moe.routed_scale, 1.0)
    _set_unless_default(text, "moe_router_activation_func", moe.router_score, "sigmoid")
    if moe.top_k > 1:
        _set_unless_default(text, "moe_renormalize", moe.renormalize, True)
    else:
        text.setdefault("moe_renormalize", False)
    if moe.expert_groups > 1:
        text.update(use_grouped_topk=True, num_expert_group=moe.expert_groups, topk_group=moe.topk_groups)


def _write_text(model: ModelConfig, text: dict) -> None:
    """Every model field into the text mapping ``text`` (which holds the carried fields)."""
    text.setdefault("model_type", TEXT_MODEL_TYPE)
    text["vocab_size"] = model.vocab_size
    text["hidden_size"] = model.d_model
    text["num_hidden_layers"] = model.num_layers
    text["intermediate_size"] = model.dense_width
    _set_unless_default(text, "first_k_dense_replace", model.dense_layers, 0)
    text["rms_norm_eps"] = model.norm_eps
    _set_unless_default(text, "tie_word_embeddings", model.tie_embeddings, False)
    text["hidden_act"] = {activation: hf for hf, activation in HF_ACTIVATIONS.items()}[model.activation]
    if model.activation == "situ":
        text["activation_situ_beta"] = model.situ_beta
        text["activation_situ_linear_beta"] = model.situ_linear_beta
    _set_unless_default(text, "attn_res_block_size",
                        model.attn_res.block_size if model.attn_res.kind == "block" else None, None)
    mla = model.mla
    text["num_attention_heads"] = mla.num_heads
    _set_unless_default(text, "q_lora_rank", mla.q_lora_rank, None)
    text["kv_lora_rank"] = mla.kv_lora_rank
    text["qk_nope_head_dim"] = mla.nope_head_dim
    text["qk_rope_head_dim"] = mla.rope_head_dim
    text["v_head_dim"] = mla.value_head_dim
    text.setdefault("mla_use_nope", True)
    _set_unless_default(text, "mla_use_output_gate", mla.output_gate, False)
    _write_moe(model, text)
    _write_linear_attn(model, text.setdefault("linear_attn_config", {}))


def _fresh_layout(model: ModelConfig) -> dict:
    """The carried skeleton of a model with no source: K3 style with block AttnRes, else Kimi Linear."""
    if model.attn_res.kind == "block":
        return {"model_type": K3_MODEL_TYPE, "architectures": [K3_ARCHITECTURE],
                "text_config": {"model_type": TEXT_MODEL_TYPE, "architectures": [TEXT_ARCHITECTURE]}}
    return {"model_type": TEXT_MODEL_TYPE, "architectures": [TEXT_ARCHITECTURE]}


def hf_config_from_model(model: ModelConfig, carried: dict | None = None) -> dict:
    """The inverse: a config.json dict with the source's model_type and every model field
    (K3 style when carried is None and the model uses block AttnRes, else Kimi Linear style).

    ``carried`` (from `model_config_from_hf`) supplies the layout and the computation-neutral
    fields; the model's fields are written over it. Raises `HFConfigError` (naming the k3jax
    field) for a model config.json cannot describe (e.g. grouped KDA values, an MLA norm eps
    other than the reference's 1e-6).
    """
    _check_expressible(model)
    hf = copy.deepcopy(carried) if carried is not None else _fresh_layout(model)
    text = hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf
    _write_text(model, text)
    if text is not hf and "tie_word_embeddings" in hf:
        hf["tie_word_embeddings"] = model.tie_embeddings
    return hf
