"""Independent float64 NumPy decoding of MXFP4 weights, written from SPEC §7 (never imports k3jax).

weight_packed [out, in/2] uint8: two E2M1 codes per byte, low nibble first; weight_scale
[out, in/32] uint8: 2^(byte - 127) per 32 inputs (byte 255: NaN); E2M1 code: magnitude bits
{0, 0.5, 1, 1.5, 2, 3, 4, 6}, bit 3 the sign.
"""
import numpy as np

MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1(codes):
    codes = np.asarray(codes, np.int64)
    return np.where(codes & 8, -1.0, 1.0) * MAGNITUDES[codes & 7]


def decode(packed, scale):
    """[..., out, in/2], [..., out, in/32] uint8 -> W^T [..., out, in] float64."""
    packed, scale = np.asarray(packed), np.asarray(scale)
    codes = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), np.int64)
    codes[..., 0::2], codes[..., 1::2] = packed & 0x0F, packed >> 4
    factor = np.where(scale == 255, np.nan, np.exp2(scale.astype(np.float64) - 127))
    return e2m1(codes) * np.repeat(factor, 32, axis=-1)


def dense_experts(packed, scale):
    """Expert stack in k3jax's dense layout [E, in, out] float64."""
    return np.swapaxes(decode(packed, scale), -1, -2)


def grouped_matmul(x, w, group_sizes):
    """Rows of group j (contiguous, in order) times w[j] [in, out]; rows past the groups give 0."""
    x = np.asarray(x, np.float64)
    y = np.zeros((x.shape[0], w.shape[-1]))
    start = 0
    for j, size in enumerate(group_sizes):
        y[start:start + size] = x[start:start + size] @ w[j]
        start += size
    return y
