"""Independent float64 NumPy references for the K3 layers, written from SPEC §§1-3 (token loops
where the spec is a loop). Parameters are read from the modules as plain arrays."""
import numpy as np

from tests.ops.numpy_kda import kda_numpy


def f64(x):
    return np.asarray(x, np.float64)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def causal_conv(x, weight, state=None, segment_ids=None):
    """y_t[c] = sum_i w[c,i] x_{t-W+1+i}[c]; positions before 0 read ``state`` (first segment);
    taps reading another segment read 0. Returns (y, new_state = last W-1 inputs of the last segment)."""
    batch, length, channels = x.shape
    taps = weight.shape[1]
    state = np.zeros((batch, taps - 1, channels)) if state is None else f64(state)
    seg = np.zeros((batch, length), int) if segment_ids is None else np.asarray(segment_ids)
    y = np.zeros((batch, length, channels))
    for b in range(batch):
        for t in range(length):
            for i in range(taps):
                pos = t - taps + 1 + i
                value = state[b, taps - 1 + pos] if pos < 0 else x[b, pos]
                value_seg = seg[b, 0] if pos < 0 else seg[b, pos]
                if value_seg == seg[b, t]:
                    y[b, t] += weight[:, i] * value
    window = np.concatenate([state, f64(x)], axis=1)[:, -(taps - 1):]
    window_seg = np.concatenate([np.repeat(seg[:, :1], taps - 1, 1), seg], axis=1)[:, -(taps - 1):]
    new_state = np.where((window_seg == seg[:, -1:])[..., None], window, 0.0)
    return y, new_state


def kda_layer(p, x, cfg, state=None, conv_state=None, segment_ids=None):
    """SPEC §1 for x [B,T,d] with parameters ``p`` (name -> array). Returns (y, state, conv_state)."""
    x = f64(x)
    batch, length, _ = x.shape
    heads, value_heads, dim = cfg.num_heads, cfg.num_value_heads, cfg.head_dim
    flat = lambda a: a.reshape(batch, length, -1)  # noqa: E731
    proj = np.concatenate([flat(np.einsum("btd,dhk->bthk", x, p[n])) for n in ("q_proj", "k_proj", "v_proj")], -1)
    conv_w = np.concatenate([p[n].reshape(-1, cfg.conv_size) for n in ("q_conv", "k_conv", "v_conv")])
    mixed, conv_state = causal_conv(proj, conv_w, conv_state, segment_ids)
    mixed = mixed * sigmoid(mixed)
    q, k, v = np.split(mixed, [heads * dim, 2 * heads * dim], axis=-1)
    unit = lambda a: a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6)  # noqa: E731
    q, k = unit(q.reshape(batch, length, heads, dim)), unit(k.reshape(batch, length, heads, dim))
    v = v.reshape(batch, length, value_heads, dim)
    z = np.einsum("btd,dr,rhk->bthk", x, p["f_a_proj"], p["f_b_proj"]) + p["dt_bias"].reshape(value_heads, dim)
    rate = np.exp(p["A_log"])[:, None]
    if cfg.gate == "softplus":
        g = -rate * np.log1p(np.exp(z))
    else:
        g = cfg.lower_bound * sigmoid(rate * z)
    beta = sigmoid(np.einsum("btd,dh->bth", x, p["b_proj"]))
    o, state = kda_numpy(q, k, v, g, beta, initial_state=state, segment_ids=segment_ids)
    o = rms_norm(o, p["o_norm"], cfg.output_norm_eps)
    if cfg.output_gate == "full":
        gate = np.einsum("btd,dhv->bthv", x, p["g_proj"])
    else:
        gate = np.einsum("btd,dr,rhv->bthv", x, p["g_a_proj"], p["g_b_proj"])
    y = np.einsum("bthv,hvd->btd", o * sigmoid(gate), p["o_proj"])
    return y, state, conv_state


def mla_layer(p, x, cfg, segment_ids=None):
    """SPEC §2, full causal attention over x [B,T,d] (expanded form, no rotary)."""
    x = f64(x)
    batch, length, _ = x.shape
    n, r = cfg.nope_head_dim, cfg.rope_head_dim
    if cfg.q_lora_rank is None:
        q = np.einsum("btd,dhe->bthe", x, p["q_proj"])
    else:
        q_lat = rms_norm(x @ p["q_a_proj"], p["q_a_norm"], cfg.norm_eps)
        q = np.einsum("btc,che->bthe", q_lat, p["q_b_proj"])
    latent = x @ p["kv_a_proj"]
    c = rms_norm(latent[..., : cfg.kv_lora_rank], p["kv_a_norm"], cfg.norm_eps)
    k_rope = latent[..., cfg.kv_lora_rank :]
    kv = np.einsum("btc,che->bthe", c, p["kv_b_proj"])
    k_nope, v = kv[..., :n], kv[..., n:]
    k = np.concatenate([k_nope, np.broadcast_to(k_rope[:, :, None], (*k_nope.shape[:3], r))], -1)
    seg = np.zeros((batch, length), int) if segment_ids is None else np.asarray(segment_ids)
    o = np.zeros((batch, length, cfg.num_heads, cfg.value_head_dim))
    for b in range(batch):
        for t in range(length):
            visible = [s for s in range(t + 1) if seg[b, s] == seg[b, t]]
            for h in range(cfg.num_heads):
                scores = np.array([q[b, t, h] @ k[b, s, h] for s in visible]) * (n + r) ** -0.5
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                o[b, t, h] = sum(w * v[b, s, h] for w, s in zip(weights, visible))
    if cfg.output_gate:
        o = o * sigmoid(np.einsum("btd,dhv->bthv", x, p["g_proj"]))
    return np.einsum("bthv,hvd->btd", o, p["o_proj"])


def attnres_mix(partial, sources, query, key_gain, eps):
    """SPEC §3 Mix over the list ``sources`` plus ``partial`` (all [B,T,d])."""
    values = [f64(s) for s in sources] + [f64(partial)]
    direction = f64(query) * f64(key_gain)
    scores = np.stack([(v @ direction) / np.sqrt(np.mean(v * v, -1) + eps) for v in values])
    weights = np.exp(scores - scores.max(0))
    weights /= weights.sum(0)
    return sum(w[..., None] * v for w, v in zip(weights, values))
