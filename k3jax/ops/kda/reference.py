"""Token-serial KDA (SPEC §1.5): the obviously-right recurrence, one token per `lax.scan` step.

Per value head, with state S in R^{K x V} (fp32), q already multiplied by the scale:

    S   <- Diag(exp g_t) S                      decay first (per key channel)
    S   <- S + beta_t k_t (v_t - S^T k_t)^T      delta-rule write
    o_t  = S^T q_t                               read from the updated state

At a segment start (packed documents) S restarts from zero before the decay.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.kda.blocks import token_step


def recurrent_step(q, k, v, g, beta, state):
    """One KDA token (`blocks.token_step`) on fp32 arrays already expanded to value heads.

    Shapes: q, k, g ``[B, HV, K]`` (q scaled), v ``[B, HV, V]``, beta ``[B, HV]``,
    state ``[B, HV, K, V]``. Returns ``(o [B, HV, V], new_state)``.
    """
    column = lambda x: x[..., None]  # noqa: E731
    o, state = token_step(state, column(q), column(k), v[..., None, :], column(g), beta[..., None, None])
    return o[..., 0, :], state


def recurrent_kda(q, k, v, g, beta, initial_state, segment_starts):
    """KDA over a sequence by scanning `recurrent_step` token by token.

    Takes fp32 arrays already expanded to value heads and scaled: q, k, g ``[B, T, HV, K]``,
    v ``[B, T, HV, V]``, beta ``[B, T, HV]``, initial_state ``[B, HV, K, V]``, and
    segment_starts ``[B, T]`` bool (True where the state restarts) or None.
    Returns ``(o [B, T, HV, V] fp32, final_state [B, HV, K, V] fp32)``.
    """
    batch, length = q.shape[:2]
    if segment_starts is None:
        segment_starts = jnp.zeros((batch, length), dtype=bool)

    def body(state, token):
        q_t, k_t, v_t, g_t, beta_t, start_t = token
        state = jnp.where(start_t[:, None, None, None], 0.0, state)
        o_t, state = recurrent_step(q_t, k_t, v_t, g_t, beta_t, state)
        return state, o_t

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, segment_starts)]
    final_state, o = jax.lax.scan(body, initial_state, time_major)
    return jnp.moveaxis(o, 0, 1), final_state
