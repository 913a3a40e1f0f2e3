"""MXFP4 weights (compressed-tensors ``mxfp4-pack-quantized``, SPEC §7): decode and encode.

A weight W [out, in] is stored as two uint8 tensors:

    weight_packed [out, in/2]    two E2M1 codes per byte, element 2j in the low nibble, 2j+1 in the high
    weight_scale  [out, in/32]   one E8M0 exponent per block of 32 inputs: scale = 2^(byte - 127)

    W[o, i] = e2m1(code[o, i]) * 2^(scale[o, i // 32] - 127)
    e2m1: bits 0-2 the magnitude {0, 0.5, 1, 1.5, 2, 3, 4, 6}, bit 3 the sign

Encoding picks, per block, the OCP MX exponent floor(log2(max |W|)) - 2 (so the largest magnitude
lands in [4, 8) and rounds to at most 6), or a ``preferred`` exponent (the one the weight arrived
with) whenever every value of the block is exactly representable with it — so an imported MXFP4
expert that was not changed is written back bit for bit, whatever rule produced it.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from k3jax.ops.mxfp4_format import BLOCK, E2M1_MAX, SCALE_BIAS   # the format's constants, one definition


def _e2m1_values(codes: np.ndarray) -> np.ndarray:
    """fp32 values of 4-bit E2M1 codes (uint8 in [0, 16))."""
    return codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def _blocks(weight: np.ndarray) -> np.ndarray:
    """[out, in] -> [out, in/32, 32]; in must be a multiple of 32."""
    out, inputs = weight.shape
    if inputs % BLOCK:
        raise ValueError(f"MXFP4 needs an input width that is a multiple of {BLOCK}, got {inputs}")
    return weight.reshape(out, inputs // BLOCK, BLOCK)


def decode_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``weight_packed [out, in/2]``, ``weight_scale [out, in/32]`` (uint8) -> W [out, in] fp32, exactly."""
    out, half = packed.shape
    if packed.dtype != np.uint8 or scale.dtype != np.uint8 or scale.shape != (out, 2 * half // BLOCK) or (2 * half) % BLOCK:
        raise ValueError(f"MXFP4 expects uint8 weight_packed [out, in/2] and weight_scale [out, in/32]; got "
                         f"{packed.dtype}{list(packed.shape)} and {scale.dtype}{list(scale.shape)}")
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(out, 2 * half)
    factors = scale.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    return (_blocks(_e2m1_values(codes)) * factors[..., None]).reshape(out, 2 * half)


def _codes_at(blocks: np.ndarray, exponent: np.ndarray) -> np.ndarray:
    """E2M1 codes (uint8) of ``blocks [out, n, 32]`` divided by 2^exponent [out, n], rounded to
    nearest even and saturated at ±6; the sign of -0.0 is kept."""
    scaled = np.clip(blocks / np.exp2(exponent.astype(np.float32))[..., None], -E2M1_MAX, E2M1_MAX)
    return scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F


def encode_mxfp4(weight: np.ndarray, preferred: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """W [out, in] (float) -> ``(weight_packed [out, in/2], weight_scale [out, in/32])`` uint8.

    ``preferred`` (uint8 [out, in/32], e.g. the scales the weight was imported with) is used for each
    block it represents exactly; other blocks get the OCP exponent floor(log2 max|W|) - 2.
    """
    blocks = _blocks(np.asarray(weight, np.float32))
    amax = np.max(np.abs(blocks), axis=-1)
    with np.errstate(divide="ignore"):
        ocp = np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2
    exponent = np.clip(ocp, -SCALE_BIAS, SCALE_BIAS).astype(np.int32)
    if preferred is not None:
        if preferred.shape != amax.shape or preferred.dtype != np.uint8:
            raise ValueError(f"preferred scales must be uint8 {list(amax.shape)}, got {preferred.dtype}{list(preferred.shape)}")
        wanted = preferred.astype(np.int32) - SCALE_BIAS
        exact = np.all(_e2m1_values(_codes_at(blocks, wanted)) * np.exp2(wanted.astype(np.float32))[..., None] == blocks,
                       axis=-1) & (preferred != 0xFF)
        exponent = np.where(exact, wanted, exponent)
    codes = _codes_at(blocks, exponent).reshape(weight.shape[0], -1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, (exponent + SCALE_BIAS).astype(np.uint8)
