"""The MXFP4 format of the routed experts: its constants, and exact decode / encode under jit.

A stack of E expert matrices W_j [in, out] (k3jax's layout) is held in the release layout (SPEC §7,
`k3jax.convert.mxfp4`), one block of 32 along the contraction (input) axis per scale:

    codes  [E, out, in/2]  uint8   two E2M1 codes per byte, input 2i in the low nibble, 2i+1 in the high
    scales [E, out, in/32] uint8   E8M0: 2^(byte - 127)
    W_j[i, o] = e2m1(code[j, o, i]) * 2^(scales[j, o, i // 32] - 127)
    e2m1(c) = (-1)^(c >> 3) * {0, 0.5, 1, 1.5, 2, 3, 4, 6}[c & 7]

0.5 + 1/32 = 0.53125 bytes per weight (0.27 of bf16). `k3jax.ops.mxfp4` multiplies by such weights;
`k3jax.convert.mxfp4` reads and writes them in checkpoints.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32          # inputs per E8M0 scale
SCALE_BIAS = 127    # scale = 2^(byte - SCALE_BIAS)
E2M1_MAX = 6.0      # the largest E2M1 magnitude

MXFP4_BYTES_PER_WEIGHT = 0.5 + 1 / BLOCK

_SIGN_BIT = np.uint32(1 << 31)
_HALF_BITS = np.uint32(0x3F000000)          # fp32 0.5, the E2M1 subnormal (code 1)
_SMALLEST_SCALE_BITS = np.uint32(1 << 22)   # fp32 2^-127 (E8M0 byte 0), an fp32 subnormal
_NAN_BITS = np.uint32(0x7FC00000)           # E8M0 byte 255


def e2m1_values(codes: jax.Array) -> jax.Array:
    """fp32 values of 4-bit E2M1 codes (any unsigned integer dtype, values in [0, 16)), built from
    their bits: magnitude m = c & 7 is 0, 0.5 (m = 1) or 2^((m >> 1) - 1) * (1 + (m & 1) / 2)."""
    c = codes.astype(jnp.uint32)
    m = c & 7
    normal = ((m >> 1) + 126) << 23 | (m & 1) << 22
    bits = jnp.where(m >= 2, normal, jnp.where(m == 1, _HALF_BITS, 0)) | (c & 8) << 28
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def e8m0_values(scales: jax.Array) -> jax.Array:
    """fp32 values 2^(byte - 127) of E8M0 scale bytes (byte 255 is NaN)."""
    s = scales.astype(jnp.uint32)
    bits = jnp.where(s == 0, _SMALLEST_SCALE_BITS, jnp.where(s == 255, _NAN_BITS, s << 23))
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


# The E2M1 magnitudes' midpoints, each with whether a value exactly on it rounds up: round to
# nearest, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_codes(x: jax.Array) -> jax.Array:
    """4-bit E2M1 codes (uint8, values in [0, 16)) of float32 values in [-6, 6], rounded to nearest
    with ties to the even code, as a cast to float4_e2m1fn rounds (negative zero included): the
    magnitude code is the number of `_E2M1_MIDPOINTS` |x| lies past, the sign bit x's sign bit.
    Integer arithmetic only, so no 4-bit type reaches the compiler."""
    magnitude = jnp.abs(x)
    code = sum(((magnitude >= point) if up else (magnitude > point)).astype(jnp.uint8)
               for point, up in _E2M1_MIDPOINTS)
    return code | jnp.signbit(x).astype(jnp.uint8) << 3


def decode(codes: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``codes [..., out, in/2]``, ``scales [..., out, in/32]`` -> W^T ``[..., out, in]`` in ``dtype``
    (the release layout, not transposed), exactly."""
    *lead, out, half = codes.shape
    nibbles = jnp.stack([codes & 0x0F, codes >> 4], axis=-1)                  # [..., out, in/2, 2]
    values = e2m1_values(nibbles).reshape(*lead, out, 2 * half // BLOCK, BLOCK)
    return (values * e8m0_values(scales)[..., None]).reshape(*lead, out, 2 * half).astype(dtype)


def encode(weight_t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """W^T ``[..., out, in]`` (float) -> ``(codes [..., out, in/2], scales [..., out, in/32])`` uint8 with
    the OCP MX exponent per block, floor(log2 max|W|) - 2 (the rule of `k3jax.convert.mxfp4.encode_mxfp4`,
    which also keeps preferred scales; this one runs under jit, for initialising a fresh model)."""
    *lead, out, inputs = weight_t.shape
    if inputs % BLOCK:
        raise ValueError(f"MXFP4 needs an input width that is a multiple of {BLOCK}, got {inputs}")
    blocks = weight_t.astype(jnp.float32).reshape(*lead, out, inputs // BLOCK, BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    _, exponent = jnp.frexp(jnp.where(amax > 0, amax, 1.0))                 # amax = f 2^e, f in [0.5, 1)
    exponent = jnp.clip(exponent - 3, -SCALE_BIAS, SCALE_BIAS)                # floor(log2 amax) - 2
    scaled = jnp.clip(blocks / jnp.exp2(exponent.astype(jnp.float32))[..., None], -E2M1_MAX, E2M1_MAX)
    codes = e2m1_codes(scaled).reshape(*lead, out, inputs // 2, 2)
    return codes[..., 0] | codes[..., 1] << 4, (exponent + SCALE_BIAS).astype(jnp.uint8)
