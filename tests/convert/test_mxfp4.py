"""MXFP4 codec against the format's definition (SPEC §7), written out by hand here."""
import numpy as np
import pytest

from k3jax.convert.mxfp4 import decode_mxfp4, encode_mxfp4

MAGNITUDES = [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def reference_decode(packed, scale):
    """Loop form of SPEC §7: low nibble first, bit 3 the sign, 2^(byte - 127) per 32 inputs."""
    out = np.zeros((packed.shape[0], packed.shape[1] * 2))
    for o in range(packed.shape[0]):
        for j in range(packed.shape[1]):
            for half, code in enumerate((packed[o, j] & 0xF, packed[o, j] >> 4)):
                i = 2 * j + half
                value = MAGNITUDES[code & 7] * (-1 if code & 8 else 1)
                out[o, i] = value * 2.0 ** (int(scale[o, i // 32]) - 127)
    return out


def test_decode_matches_the_definition():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (3, 32), dtype=np.uint8)
    scale = rng.integers(100, 150, (3, 2), dtype=np.uint8)
    np.testing.assert_array_equal(decode_mxfp4(packed, scale), reference_decode(packed, scale))


def test_encode_keeps_the_scales_it_was_given_bit_for_bit():
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, (4, 48), dtype=np.uint8)
    packed[0, :16] = 0x88                      # a block of -0.0: any scale represents it
    scale = rng.integers(110, 140, (4, 3), dtype=np.uint8)
    weight = decode_mxfp4(packed, scale)
    again_packed, again_scale = encode_mxfp4(weight, preferred=scale)
    np.testing.assert_array_equal(again_packed, packed)
    np.testing.assert_array_equal(again_scale, scale)


def test_encode_without_preferred_scales_is_exact_on_representable_values_and_bounded_otherwise():
    rng = np.random.default_rng(2)
    weight = decode_mxfp4(rng.integers(0, 256, (4, 32), dtype=np.uint8), rng.integers(120, 130, (4, 2), dtype=np.uint8))
    np.testing.assert_array_equal(decode_mxfp4(*encode_mxfp4(weight)), weight)
    x = rng.normal(size=(8, 64)).astype(np.float32)
    packed, scale = encode_mxfp4(x)
    blocks = np.abs(x).reshape(8, 2, 32).max(-1)
    np.testing.assert_array_equal(scale.astype(int) - 127, np.floor(np.log2(blocks)) - 2)    # OCP exponent
    error = np.abs(decode_mxfp4(packed, scale) - x).reshape(8, 2, 32).max(-1)
    # |x| / scale lies in [0, 8): rounding costs at most half the largest E2M1 step (1), saturating 8 -> 6 at most 2
    assert np.all(error <= 2 * 2.0 ** (scale.astype(int) - 127))


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="multiple of 32"):
        encode_mxfp4(np.ones((2, 48)))
    with pytest.raises(ValueError, match="weight_scale"):
        decode_mxfp4(np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8))
