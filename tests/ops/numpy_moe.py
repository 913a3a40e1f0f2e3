"""Independent float64 NumPy reference of SPEC §4 (feed-forward, router, MoE, balancing, and the
expert-parallel capacity rule).

Written from the spec, loop- and dense-style: every expert runs on every token and the top-k
outputs are gathered. Never imports k3jax.
"""
import math

import numpy as np


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x):
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def situ_glu(a, u, beta=4.0, beta_linear=25.0):
    """beta_linear None: the up factor is u itself (no soft clip)."""
    a, u = np.asarray(a, np.float64), np.asarray(u, np.float64)
    linear = u if beta_linear is None else beta_linear * np.tanh(u / beta_linear)
    return beta * np.tanh(a / beta) * sigmoid(a) * linear


def swiglu(a, u):
    a, u = np.asarray(a, np.float64), np.asarray(u, np.float64)
    return a * sigmoid(a) * u


ACTIVATIONS = {"situ": situ_glu, "swiglu": swiglu}


def glu(x, w_gate, w_up, w_down, activation):
    """``activation``: a name of ACTIVATIONS or a function (a, u) -> hidden."""
    act = ACTIVATIONS[activation] if isinstance(activation, str) else activation
    return act(x @ w_gate, x @ w_up) @ w_down


def allowed_experts(biased_row, expert_groups, topk_groups):
    """Grouped top-k (DeepSeek-V3 noaux_tc): the experts of the ``topk_groups`` groups whose two
    best biased scores sum highest; every expert when there is one group."""
    num_experts = len(biased_row)
    size = num_experts // expert_groups
    group_score = [sum(sorted(biased_row[g * size:(g + 1) * size])[-2:])
                   for g in range(expert_groups)]
    best = sorted(range(expert_groups), key=lambda g: -group_score[g])[:topk_groups]
    return sorted(e for g in best for e in range(g * size, (g + 1) * size))


def route(scores, bias, top_k, routed_scale=1.0, bias_in_weights=False, renormalize=True,
          expert_groups=1, topk_groups=1):
    """(indices [N,k], weights [N,k]): top-k of s + b (within the allowed groups) by a full
    descending sort; weights from s (or from s + b with the HF quirk), normalised over the
    selection when ``renormalize``, times routed_scale."""
    scores = np.asarray(scores, np.float64)
    biased = scores + np.asarray(bias, np.float64)
    indices = []
    for row in biased:
        allowed = allowed_experts(row, expert_groups, topk_groups)
        indices.append(sorted(allowed, key=lambda e: -row[e])[:top_k])
    indices = np.array(indices)
    source = biased if bias_in_weights else scores
    chosen = np.take_along_axis(source, indices, axis=-1)
    if renormalize:
        chosen = chosen / (chosen.sum(-1, keepdims=True) + 1e-20)
    return indices, chosen * routed_scale


def routed_experts_dense(x, indices, weights, w_gate, w_up, w_down, activation):
    """Run every expert on every token, then gather each token's k outputs and weight them."""
    x = np.asarray(x, np.float64)
    all_outputs = np.stack(
        [glu(x, w_gate[e], w_up[e], w_down[e], activation) for e in range(w_gate.shape[0])]
    )  # [E, N, d]
    tokens = np.arange(x.shape[0])[:, None]
    return np.einsum("tkd,tk->td", all_outputs[indices, tokens], weights)


def rms_norm(x, weight, eps):
    return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def moe_forward(x, p, top_k, activation, routed_scale=1.0, norm_eps=1e-5, bias_in_weights=False,
                score="sigmoid", **routing):
    """MoE layer on x [N, d] from a dict of float64 parameters (keys as below; latent ones
    optional); ``score`` "sigmoid" or "softmax", ``routing`` more `route` options."""
    scores = (sigmoid if score == "sigmoid" else softmax)(x @ p["router"])
    indices, weights = route(scores, p["bias"], top_k, routed_scale, bias_in_weights, **routing)
    experts = (p["w_gate"], p["w_up"], p["w_down"])
    if "latent_down" in p:
        u = routed_experts_dense(x @ p["latent_down"], indices, weights, *experts, activation)
        if "latent_norm" in p:
            u = rms_norm(u, p["latent_norm"], norm_eps)
        y = u @ p["latent_up"]
    else:
        y = routed_experts_dense(x, indices, weights, *experts, activation)
    if "shared_gate" in p:
        y = y + glu(x, p["shared_gate"], p["shared_up"], p["shared_down"], activation)
    return y, scores, indices


def expert_load(indices, num_experts, mask=None):
    load = np.zeros(num_experts)
    for t, row in enumerate(indices):
        if mask is None or mask[t]:
            for e in row:
                load[e] += 1
    return load


def sign_update(bias, load, rate):
    mean = load.mean()
    return np.array([b + rate * (1.0 if l < mean else -1.0 if l > mean else 0.0) for b, l in zip(bias, load)])


def quantile_update(scores, bias, top_k, mask=None, expert_groups=1, topk_groups=1):
    """alpha_t = (k+1)-th largest of s_t + b among the token's allowed experts; r_tj = alpha_t - s_tj;
    b_j = the ceil(k n / E)-th smallest r_tj over the n kept tokens; centred to mean zero."""
    scores, bias = np.asarray(scores, np.float64), np.asarray(bias, np.float64)
    keep = np.ones(len(scores), bool) if mask is None else np.asarray(mask, bool)
    num_experts = scores.shape[1]
    biased = scores[keep] + bias
    alpha = np.array([np.sort(row[allowed_experts(row, expert_groups, topk_groups)])[::-1][top_k]
                      for row in biased])
    required = alpha[:, None] - scores[keep]
    n = int(keep.sum())
    rank = -(-top_k * n // num_experts)  # ceil without floats
    new = np.array([np.sort(required[:, j])[rank - 1] for j in range(num_experts)])
    return new - new.mean()


def capacity_dropped(indices, shards: int, num_experts: int, capacity_factor: float) -> int:
    """The capacity rule: each of ``shards`` equal blocks of token rows gives expert e at most
    C = ceil(capacity_factor * n k / E) of its assignments; the rest are dropped."""
    indices = np.asarray(indices)
    rows, top_k = indices.shape
    capacity = max(1, math.ceil(capacity_factor * (rows // shards) * top_k / num_experts))
    dropped = 0
    for block in np.split(indices, shards):
        counts = np.bincount(block.reshape(-1), minlength=num_experts)
        dropped += int(np.maximum(counts - capacity, 0).sum())
    return dropped
