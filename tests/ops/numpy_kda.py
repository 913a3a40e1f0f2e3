"""Independent float64 NumPy KDA written from SPEC §1 (token by token), the oracle for tests."""
import numpy as np


def kda_numpy(q, k, v, g, beta, scale=None, initial_state=None, segment_ids=None):
    """Returns (o [B,T,HV,V], final_state [B,HV,K,V]) in float64."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    batch, length, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2:]
    group = value_heads // heads
    scale = key_dim**-0.5 if scale is None else scale
    state = np.zeros((batch, value_heads, key_dim, value_dim))
    if initial_state is not None:
        state = state + np.asarray(initial_state, np.float64)
    o = np.zeros((batch, length, value_heads, value_dim))
    for b in range(batch):
        for t in range(length):
            if segment_ids is not None and t > 0 and segment_ids[b, t] != segment_ids[b, t - 1]:
                state[b] = 0.0
            for h in range(value_heads):
                qh, kh = q[b, t, h // group] * scale, k[b, t, h // group]
                s = state[b, h] * np.exp(g[b, t, h])[:, None]
                s = s + beta[b, t, h] * np.outer(kh, v[b, t, h] - kh @ s)
                state[b, h] = s
                o[b, t, h] = qh @ s
    return o, state


