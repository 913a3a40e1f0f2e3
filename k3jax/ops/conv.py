"""Causal depthwise convolution with a carried window (the KDA short convolution, SPEC §1.1).

Per channel c, with W taps w[c, 0..W-1] and no bias:

    y_t[c] = sum_{i=0..W-1} w[c, i] * x_{t-W+1+i}[c]

Positions before the sequence read the carried ``state`` (the previous call's last W-1 inputs;
zeros for a fresh sequence). With packed documents (``segment_ids``) a tap only reads inputs of
the token's own segment, so the window restarts from zeros at each boundary; the carried state
belongs to the first segment of the call.
Shapes: x ``[B, T, C]``, weight ``[C, W]``, state ``[B, W-1, C]``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_depthwise_conv(
    x: jax.Array,
    weight: jax.Array,
    state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Returns ``(y [B, T, C] in x.dtype, new_state [B, W-1, C])``.

    ``new_state`` holds the last W-1 inputs (from the carried state when T < W-1), with inputs of
    earlier segments than the last token's zeroed, so a continuation reads only its own document.
    """
    batch, length, channels = x.shape
    taps = weight.shape[-1]
    if state is None:
        state = jnp.zeros((batch, taps - 1, channels), x.dtype)
    window = jnp.concatenate([state.astype(x.dtype), x], axis=1)            # [B, W-1+T, C]
    if segment_ids is not None:
        window_segments = jnp.concatenate([jnp.repeat(segment_ids[:, :1], taps - 1, axis=1), segment_ids], axis=1)
    y = jnp.zeros(x.shape, jnp.float32)
    for i in range(taps):
        tap = window[:, i : i + length].astype(jnp.float32)
        if segment_ids is not None:
            tap = jnp.where((window_segments[:, i : i + length] == segment_ids)[..., None], tap, 0.0)
        y = y + tap * weight[:, i].astype(jnp.float32)
    new_state = window[:, length:]
    if segment_ids is not None:
        same = window_segments[:, length:] == segment_ids[:, -1:]
        new_state = jnp.where(same[..., None], new_state, 0)
    return y.astype(x.dtype), new_state


def conv_tails(x: jax.Array, state: jax.Array) -> jax.Array:
    """The carried window after every token: x ``[B, T, C]`` continuing ``state [B, W-1, C]`` ->
    ``[B, T, W-1, C]`` in state's dtype, entry t the last W-1 inputs once token t is in (the
    ``new_state`` a call ending at token t returns; no segments)."""
    length, kept = x.shape[1], state.shape[1]
    window = jnp.concatenate([state, x.astype(state.dtype)], axis=1)          # [B, W-1+T, C]
    index = jnp.arange(length)[:, None] + 1 + jnp.arange(kept)[None, :]       # [T, W-1]
    return window[:, index]
