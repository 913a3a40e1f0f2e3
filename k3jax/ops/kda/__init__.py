"""Kimi Delta Attention (KDA), SPEC §1: public entry points.

    kda(q, k, v, g, beta, ...)        -> (o [B,T,HV,V] in v.dtype, final_state [B,HV,K,V] fp32)
    kda_step(q, k, v, g, beta, state) -> (o [B,HV,V], state)            one token
    kda_steps(q, k, v, g, beta, state) -> (o [B,T,HV,V], states [B,T,HV,K,V])   token by token,
                                                                        every state kept
    kda_gate(raw, A_log, dt_bias, lower_bound=None) -> g               log-space decay, fp32
    l2_normalize(x)                                                     x / sqrt(sum x^2 + 1e-6)

Recurrence per value head (state S in R^{K x V}, fp32):
    S <- Diag(exp g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale q_t)

Value head j reads query/key head j // (HV / H) (grouped values). Every KDA path takes one
``implementation`` word, the same four everywhere (`k3jax.config.KDAConfig.implementation` passes
its value to all three paths of the layer):

    path                               "reference"        "chunk"             "pallas"
    a sequence (`kda`)                 token-serial scan  WY/UT chunked form  fused kernels (`pallas`)
    one token (`kda_step`)             XLA token step     XLA token step      decode kernel (`pallas_decode`)
    one token of pool rows             gather, XLA token step, scatter        decode kernels, rows in place
      (`decode_pool`)

(a chunk of one token is the token step). "auto" (or None) is "pallas" where the computation is
lowered for a GPU and the XLA form ("chunk") for CPUs and TPUs: one rule for every path,
`by_implementation`. Not Pallas on TPU: compiled for one device, neither form has the lower
roofline on every generation (`bench.tpu_compile`; the README's table: the kernels' on v5p and v6e,
the XLA form's forward+VJP on v5e and TPU7x), and the Mosaic kernels have only run interpreted; a
TPU program may ask for "pallas" (under a mesh the layers run it head-parallel,
`k3jax.sharding.heads`, as XLA cannot partition a Mosaic kernel). Pallas kernels are Mosaic on
TPU, Triton on GPU and interpreted elsewhere
(`pallas.on_target_platform`; tests force a family with `pallas.forced_kernels`). Every
implementation serves every path; another word is a ValueError naming the path. "chunk" and
"pallas" share one definition of the block math (`blocks`) and one meaning of ``chunk_size``.
Log decays below `gate.LOG_DECAY_FLOOR` (g = -inf included) are a full reset of the channel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.ops.kda.blocks import check_chunk_size
from k3jax.ops.kda.chunk import chunk_kda
from k3jax.ops.kda.gate import floor_log_decay, kda_gate
from k3jax.ops.kda.pallas import pallas_kda
from k3jax.ops.kda.pallas_decode import pallas_kda_pool_step
from k3jax.ops.kda.reference import recurrent_kda, recurrent_step
from k3jax.ops.norms import l2_normalize

__all__ = ["kda", "kda_step", "kda_steps", "kda_gate", "l2_normalize", "IMPLEMENTATIONS", "segment_starts"]

IMPLEMENTATIONS = ("auto", "reference", "chunk", "pallas")
XLA_PLATFORMS = ("cpu", "tpu")   # where "auto" is the XLA form (module docstring)


def _require_shape(name: str, x, expected: tuple, meaning: str) -> None:
    if x.ndim != len(expected) or any(e is not None and s != e for s, e in zip(x.shape, expected)):
        shown = tuple("?" if e is None else e for e in expected)
        raise ValueError(f"{name} must have shape {meaning} = {shown}, got {tuple(x.shape)}")


def _check_inputs(q, k, v, g, beta, state, token_axis: bool):
    """Validate shapes (with or without the T axis); return (heads, value_heads, key_dim, value_dim)."""
    lead = 2 if token_axis else 1
    bt = "B, T, " if token_axis else "B, "
    if q.ndim != lead + 2:
        raise ValueError(f"q must have shape [{bt}H, K], got {tuple(q.shape)}")
    *batch_time, heads, key_dim = q.shape
    batch_time = tuple(batch_time)
    _require_shape("k", k, (*batch_time, heads, key_dim), f"[{bt}H, K]")
    if v.ndim != lead + 2 or tuple(v.shape[:lead]) != batch_time:
        raise ValueError(f"v must have shape [{bt}HV, V] with {bt.rstrip(', ')} = {batch_time}, got {tuple(v.shape)}")
    value_heads, value_dim = v.shape[-2:]
    if value_heads % heads:
        raise ValueError(f"v has HV = {value_heads} value heads, which must be a multiple of H = {heads}")
    _require_shape("g", g, (*batch_time, value_heads, key_dim), f"[{bt}HV, K]")
    _require_shape("beta", beta, (*batch_time, value_heads), f"[{bt}HV]")
    if state is not None:
        name = "initial_state" if token_axis else "state"
        _require_shape(name, state, (batch_time[0], value_heads, key_dim, value_dim), "[B, HV, K, V]")
    return heads, value_heads, key_dim, value_dim


def _compute_dtype(*arrays) -> jnp.dtype:
    """fp32, or float64 when an input is float64 (x64 mode, used to verify gradients)."""
    return jnp.float64 if any(x.dtype == jnp.float64 for x in arrays if x is not None) else jnp.float32


def _to_value_heads(q, k, value_heads, scale, dtype):
    """Queries (scaled) and keys in the compute dtype, repeated so value head j reads head j // group."""
    group = value_heads // q.shape[-2]
    q = jnp.repeat(q.astype(dtype) * scale, group, axis=-2)
    k = jnp.repeat(k.astype(dtype), group, axis=-2)
    return q, k


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """``[B, T]`` bool, True where the segment id changes (never at t = 0: the initial state belongs
    to the first segment)."""
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.zeros((segment_ids.shape[0], 1), bool), changed], axis=1)


def check_implementation(implementation: str | None, path: str) -> str:
    """``implementation`` ("auto" for None), or a one-line ValueError naming ``path`` (e.g. "forward")."""
    implementation = implementation or "auto"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"KDA {path}: implementation must be one of {IMPLEMENTATIONS} or None, "
                         f"got {implementation!r}")
    return implementation


def by_implementation(implementation: str | None, *args, path: str, xla, pallas):
    """``pallas(*args)`` or ``xla(*args)`` (the path's XLA form) as ``implementation`` says: the one
    rule of every KDA path (module docstring). "pallas" -> pallas; "reference", "chunk" -> xla;
    "auto" or None -> chosen by `jax.lax.platform_dependent` when the computation is lowered:
    pallas for a GPU, xla for a CPU or TPU (xla directly, without tracing pallas, when JAX's
    default backend is a CPU or TPU). ValueError naming ``path`` for any other word."""
    implementation = check_implementation(implementation, path)
    if implementation == "pallas":
        return pallas(*args)
    if implementation == "auto" and jax.default_backend() not in XLA_PLATFORMS:
        return jax.lax.platform_dependent(*args, cpu=xla, tpu=xla, default=pallas)
    return xla(*args)


def _xla_kda(q, k, v, g, beta, initial_state, starts, *, scale: float, chunk_size: int, recurrent: bool):
    """`kda`'s XLA forward on validated inputs (``starts``: `segment_starts` or None): the token
    recurrence (`recurrent_kda`, "reference") or the chunked form (`chunk_kda`), in the compute dtype."""
    batch, _, value_heads, value_dim = v.shape
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    q32, k32 = _to_value_heads(q, k, value_heads, scale, dtype)
    v32, g32, beta32 = (x.astype(dtype) for x in (v, g, beta))
    if initial_state is None:
        state = jnp.zeros((batch, value_heads, q.shape[-1], value_dim), dtype)
    else:
        state = initial_state.astype(dtype)
    if recurrent:
        o, final_state = recurrent_kda(q32, k32, v32, g32, beta32, state, starts)
    else:
        o, final_state = chunk_kda(q32, k32, v32, g32, beta32, state, starts, chunk_size)
    return o.astype(v.dtype), final_state


def kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    chunk_size: int = 64,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """KDA over a sequence.

    Args:
      q, k: ``[B, T, H, K]``, already L2-normalised.
      v: ``[B, T, HV, V]``, HV a multiple of H.
      g: ``[B, T, HV, K]`` log-space decay (<= 0).
      beta: ``[B, T, HV]`` write strength in (0, 1).
      scale: query scale, default ``K ** -0.5``.
      initial_state: ``[B, HV, K, V]``; zeros when None.
      segment_ids: ``[B, T]`` ints; the state restarts where the id changes (packed documents).
      chunk_size: tokens per chunk, a power of two >= 16 (`blocks.chunk_length`; shorter
        sequences use the smallest power of two >= T): the tokens whose state-independent terms
        are computed together, in 16-token tiles. "pallas" passes the state once per chunk;
        "chunk" passes it from tile to tile inside the chunk (one scan step per chunk).
      implementation: "auto" (or None), "reference", "chunk" or "pallas" (see the module docstring).

    Returns:
      ``(o [B, T, HV, V] in v.dtype, final_state [B, HV, K, V] fp32)``. All arithmetic is fp32
      (float64 when an input is float64, for verification in x64 mode).
    """
    key_dim = _check_inputs(q, k, v, g, beta, initial_state, token_axis=True)[2]
    batch, length = q.shape[:2]
    if segment_ids is not None:
        _require_shape("segment_ids", segment_ids, (batch, length), "[B, T]")
    check_chunk_size(chunk_size)

    scale = key_dim**-0.5 if scale is None else scale
    starts = None if segment_ids is None else segment_starts(segment_ids)
    g = floor_log_decay(g)
    pallas = functools.partial(pallas_kda, scale=scale, chunk_size=chunk_size)
    xla = functools.partial(_xla_kda, scale=scale, chunk_size=chunk_size, recurrent=implementation == "reference")
    return by_implementation(implementation, q, k, v, g, beta, initial_state, starts, path="forward",
                             xla=xla, pallas=pallas)


def kda_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    scale: float | None = None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One decode token: q, k ``[B, H, K]``, v ``[B, HV, V]``, g ``[B, HV, K]``, beta ``[B, HV]``,
    state ``[B, HV, K, V]``. Returns ``(o [B, HV, V] in v.dtype, new_state fp32)`` (float64 when
    an input is float64).

    ``implementation`` (module docstring): "reference" and "chunk" run the XLA token step
    (`reference.recurrent_step`); "pallas" runs the Pallas decode kernel
    (`pallas_decode.pallas_kda_pool_step`) with the B states as a pool of B rows; "auto" (or
    None) is the Pallas kernel where lowered for a GPU, the XLA step for a CPU or TPU.
    """
    _, value_heads, key_dim, _ = _check_inputs(q, k, v, g, beta, state, token_axis=False)
    scale = key_dim**-0.5 if scale is None else scale
    dtype = _compute_dtype(q, k, v, g, beta, state)

    def xla(q, k, v, g, beta, state):
        q32, k32 = _to_value_heads(q, k, value_heads, scale, dtype)
        o, new_state = recurrent_step(q32, k32, *(x.astype(dtype) for x in (v, g, beta, state)))
        return o.astype(v.dtype), new_state

    def pallas(q, k, v, g, beta, state):
        rows = jnp.arange(state.shape[0], dtype=jnp.int32)
        return pallas_kda_pool_step(state.astype(dtype), rows, q, k, v, g, beta, scale=scale)

    return by_implementation(implementation, q, k, v, g, beta, state, path="one-token decode",
                             xla=xla, pallas=pallas)


def kda_steps(q, k, v, g, beta, state, *, scale: float | None = None, implementation: str | None = None):
    """T tokens fed one at a time from ``state``, keeping the state after every token (a
    speculative verify, whose rejected drafts are undone by picking an earlier state):

        S_t = step(S_{t-1}, q_t, k_t, v_t, g_t, beta_t)     (`kda_step`, the decode recurrence)
        o_t = S_t^T (scale q_t)

    q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g ``[B, T, HV, K]``, beta ``[B, T, HV]``, state
    ``[B, HV, K, V]`` -> ``(o [B, T, HV, V] in v.dtype, states [B, T, HV, K, V] fp32)``, states[:, t]
    the state after token t: the numbers of T `kda_step` calls with ``implementation``. Memory is T
    states per sequence, so this is for short T (a verify of 1 + k tokens); a sequence is `kda`."""
    _check_inputs(q, k, v, g, beta, state, token_axis=True)

    def step(carry, token):
        o, carry = kda_step(*token, carry, scale=scale, implementation=implementation)
        return carry, (o, carry)

    tokens = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, g, beta))
    _, (o, states) = jax.lax.scan(step, state.astype(_compute_dtype(q, k, v, g, beta, state)), tokens)
    return jnp.swapaxes(o, 0, 1), jnp.swapaxes(states, 0, 1)
