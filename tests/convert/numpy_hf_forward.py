"""An independent float64 NumPy forward of a K3 / Kimi Linear model straight from its Hugging Face
tensors and config.json (SPEC §§1-4, §7): HF weights [out, in] applied as x @ W.T, names as the
release spells them. Never touches k3jax's parameters or key map.
"""
import numpy as np

from k3jax.convert.mxfp4 import decode_mxfp4
from tests.numpy_reference import attnres_mix, causal_conv, rms_norm, sigmoid
from tests.ops.numpy_kda import kda_numpy
from tests.ops.numpy_moe import route, situ_glu, swiglu


class Tensors:
    """HF tensors by name as float64 (MXFP4 experts decoded), recording which were used."""

    def __init__(self, tensors: dict):
        self.tensors, self.used = tensors, set()

    def __call__(self, name: str) -> np.ndarray:
        if name + "_packed" in self.tensors:
            self.used |= {name + "_packed", name + "_scale"}
            return decode_mxfp4(self.tensors[name + "_packed"], self.tensors[name + "_scale"]).astype(np.float64)
        self.used.add(name)
        return np.asarray(self.tensors[name], np.float64)


def _kda(w, pre, x, lin, eps):
    heads, dim = lin["num_heads"], lin["head_dim"]
    batch, length, _ = x.shape
    proj = np.concatenate([x @ w(pre + f"{n}_proj.weight").T for n in "qkv"], -1)
    conv = np.concatenate([w(pre + f"{n}_conv1d.weight")[:, 0, :] for n in "qkv"])
    mixed, _ = causal_conv(proj, conv)
    mixed = mixed * sigmoid(mixed)
    q, k, v = (a.reshape(batch, length, heads, dim) for a in np.split(mixed, 3, axis=-1))
    unit = lambda a: a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6)  # noqa: E731
    z = (x @ w(pre + "f_a_proj.weight").T @ w(pre + "f_b_proj.weight").T).reshape(batch, length, heads, dim)
    z = z + w(pre + "dt_bias").reshape(heads, dim)
    rate = np.exp(w(pre + "A_log").reshape(-1)[:heads])[:, None]
    bound = lin.get("gate_lower_bound")
    g = -rate * np.log1p(np.exp(z)) if bound is None else bound * sigmoid(rate * z)
    beta = sigmoid(x @ w(pre + "b_proj.weight").T)
    o, _ = kda_numpy(unit(q), unit(k), v, g, beta)
    o = rms_norm(o, w(pre + "o_norm.weight"), eps)
    if lin.get("use_full_rank_gate"):
        gate = x @ w(pre + "g_proj.weight").T
    else:
        gate = x @ w(pre + "g_a_proj.weight").T @ w(pre + "g_b_proj.weight").T
    o = o.reshape(batch, length, -1) * sigmoid(gate)
    return o @ w(pre + "o_proj.weight").T


def _mla(w, pre, x, text):
    heads, n, r, vd = text["num_attention_heads"], text["qk_nope_head_dim"], text["qk_rope_head_dim"], text["v_head_dim"]
    kv_rank = text["kv_lora_rank"]
    batch, length, _ = x.shape
    if text.get("q_lora_rank"):
        q = rms_norm(x @ w(pre + "q_a_proj.weight").T, w(pre + "q_a_layernorm.weight"), 1e-6) @ w(pre + "q_b_proj.weight").T
    else:
        q = x @ w(pre + "q_proj.weight").T
    q = q.reshape(batch, length, heads, n + r)
    latent = x @ w(pre + "kv_a_proj_with_mqa.weight").T
    c = rms_norm(latent[..., :kv_rank], w(pre + "kv_a_layernorm.weight"), 1e-6)
    kv = (c @ w(pre + "kv_b_proj.weight").T).reshape(batch, length, heads, n + vd)
    k = np.concatenate([kv[..., :n], np.broadcast_to(latent[:, :, None, kv_rank:], (batch, length, heads, r))], -1)
    scores = np.einsum("bthe,bshe->bhts", q, k) * (n + r) ** -0.5
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    o = np.einsum("bhts,bshv->bthv", weights, kv[..., n:])
    if text.get("mla_use_output_gate"):
        o = o * sigmoid(x @ w(pre + "g_proj.weight").T).reshape(o.shape)
    return o.reshape(batch, length, -1) @ w(pre + "o_proj.weight").T


def _glu(w, pre, x, act, names=("gate_proj", "up_proj", "down_proj")):
    gate, up, down = (w(f"{pre}{name}.weight") for name in names)
    return act(x @ gate.T, x @ up.T) @ down.T


def _moe(w, pre, x, text, act):
    tokens = x.reshape(-1, x.shape[-1])
    scores = sigmoid(tokens @ w(pre + "gate.weight").T)
    indices, weights = route(scores, w(pre + "gate.e_score_correction_bias"), text["num_experts_per_token"],
                             text["routed_scaling_factor"])
    latent = text.get("routed_expert_hidden_size")
    inputs = tokens @ w(pre + "routed_expert_down_proj.weight").T if latent else tokens
    u = np.zeros_like(inputs)
    for t in range(tokens.shape[0]):
        for e, p in zip(indices[t], weights[t]):
            u[t] += p * _glu(w, f"{pre}experts.{e}.", inputs[t], act, ("w1", "w3", "w2"))
    if latent:
        if text.get("latent_moe_use_norm"):
            u = rms_norm(u, w(pre + "routed_expert_norm.weight"), text["rms_norm_eps"])
        u = u @ w(pre + "routed_expert_up_proj.weight").T
    y = u + _glu(w, pre + "shared_experts.", tokens, act) if text.get("num_shared_experts") else u
    return y.reshape(x.shape)


def _mix(w, tensors_prefix, norm, proj, partial, sources, eps):
    return attnres_mix(partial, sources, w(f"{tensors_prefix}{proj}.weight")[0], w(f"{tensors_prefix}{norm}.weight"), eps)


def hf_forward(hf: dict, tensors: dict, tokens: np.ndarray) -> tuple[np.ndarray, set]:
    """Logits [B, T, vocab] float64 of ``tokens`` [B, T]; and the names of the tensors read."""
    text = hf.get("text_config", hf)
    root = "language_model." if "text_config" in hf else ""
    prefix = root + "model."
    w = Tensors(tensors)
    lin, eps = text["linear_attn_config"], text["rms_norm_eps"]
    act = situ_glu if text["hidden_act"] == "situ" else swiglu
    full = {n - 1 for n in lin["full_attn_layers"]}
    block = text.get("attn_res_block_size")
    p = w(prefix + "embed_tokens.weight")[tokens]
    sources = []
    for layer in range(text["num_hidden_layers"]):
        pre = f"{prefix}layers.{layer}."
        start = bool(block) and layer % block == 0
        h = _mix(w, pre, "self_attention_res_norm", "self_attention_res_proj", p, sources, eps) if sources else p
        if start:
            sources.append(p)
        x = rms_norm(h, w(pre + "input_layernorm.weight"), eps)
        a = _mla(w, pre + "self_attn.", x, text) if layer in full else _kda(w, pre + "self_attn.", x, lin, eps)
        p = a if start else p + a
        f_in = _mix(w, pre, "mlp_res_norm", "mlp_res_proj", p, sources, eps) if block else p
        f_in = rms_norm(f_in, w(pre + "post_attention_layernorm.weight"), eps)
        dense = layer < text["first_k_dense_replace"]
        p = p + (_glu(w, pre + "mlp.", f_in, act) if dense else _moe(w, pre + "block_sparse_moe.", f_in, text, act))
    out = _mix(w, prefix, "output_attn_res_norm", "output_attn_res_proj", p, sources, eps) if block else p
    out = rms_norm(out, w(prefix + "norm.weight"), eps)
    head = w(prefix + "embed_tokens.weight") if text.get("tie_word_embeddings") else w(root + "lm_head.weight")
    return out @ head.T, w.used
