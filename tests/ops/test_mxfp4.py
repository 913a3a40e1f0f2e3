"""MXFP4 experts on device (`k3jax.ops.mxfp4`): the JAX codec against the SPEC §7 formulas and the
release encoder, and the grouped matmul -- the XLA loop over tiles and the Pallas kernel with
in-kernel decode (`k3jax.ops.mxfp4_pallas`, interpreted) -- values and input gradients against
float64 NumPy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.convert.mxfp4 import encode_mxfp4
from k3jax.ops import mxfp4
from k3jax.ops.mxfp4_format import decode, encode
from tests.ops import numpy_mxfp4 as ref

EXPERTS, IN, OUT, ROWS = 12, 64, 96, 40


def random_weights(seed, shape):
    """Normal weights with a different power-of-two range per row, a zero block and a -0.0."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, (*shape[:-1], 1)))
    w[..., 0, :32] = 0.0
    w[..., 1, 3] = -0.0
    return w.astype(np.float32)


def test_decode_matches_the_spec_formulas_for_every_code_and_scale():
    """Every code byte; scale bytes from 2 (below it, products are fp32 subnormals, which XLA
    flushes to zero) to 255 (NaN)."""
    rng = np.random.default_rng(0)
    packed = np.arange(256, dtype=np.uint8).reshape(2, 4, 32)
    scale = rng.integers(2, 256, (2, 4, 2)).astype(np.uint8)
    scale[0, 0] = (2, 255)
    decoded = np.asarray(jax.jit(decode)(packed, scale), np.float64)
    expected = ref.decode(packed, scale)
    np.testing.assert_array_equal(np.isnan(decoded), np.isnan(expected))
    np.testing.assert_array_equal(decoded[~np.isnan(expected)], expected[~np.isnan(expected)])
    assert decode(packed, scale, jnp.bfloat16).dtype == jnp.bfloat16


def test_e2m1_codes_round_as_a_cast_to_float4_e2m1fn():
    """Every midpoint (a tie), its neighbours either side, the grid, signed zeros and a fine sweep of
    [-6, 6] against ml_dtypes' cast (round to nearest, ties to even)."""
    import ml_dtypes

    from k3jax.ops.mxfp4_format import e2m1_codes

    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    ties = (grid[1:] + grid[:-1]) / 2
    near = [np.nextafter(ties, 0), np.nextafter(ties, 7)]
    magnitudes = np.concatenate([np.linspace(0, 6, 60001, dtype=np.float32), grid, ties, *near, [1e-30]])
    values = np.concatenate([magnitudes, -magnitudes]).astype(np.float32)
    expected = values.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    codes = np.asarray(jax.jit(e2m1_codes)(values))
    np.testing.assert_array_equal(codes, expected)
    assert codes[values.size // 2] == 8 and codes[0] == 0           # -0.0 keeps its sign bit


def test_jitted_encode_is_the_release_encoder_bit_for_bit():
    w = random_weights(1, (3, 8, 64))
    codes, scales = jax.jit(encode)(w)
    for e in range(3):
        packed, scale = encode_mxfp4(w[e])
        np.testing.assert_array_equal(np.asarray(codes[e]), packed)
        np.testing.assert_array_equal(np.asarray(scales[e]), scale)
    with pytest.raises(ValueError, match="multiple of 32"):
        encode(jnp.zeros((4, 48)))


def make_experts(tile, seed=2, implementation="xla"):
    w_t = np.random.default_rng(seed).standard_normal((EXPERTS, OUT, IN)).astype(np.float32)
    codes, scales = encode(w_t)
    return mxfp4.Mxfp4Experts(codes, scales, tile=tile, implementation=implementation)


def group_sizes(seed):
    """Ragged sizes with empty groups, summing to fewer than ROWS (the rest are padding rows)."""
    sizes = np.random.default_rng(seed).multinomial(ROWS - 5, np.full(EXPERTS, 1 / EXPERTS))
    sizes[[2, 7]] = 0
    sizes[0] += ROWS - 5 - sizes.sum()
    return sizes.astype(np.int32)


@pytest.mark.parametrize("dtype,tile,implementation", [
    (jnp.float32, 5, "xla"), (jnp.float32, EXPERTS, "xla"), (jnp.bfloat16, 3, "xla"),
    # pallas: in-kernel decode, interpreted on CPU (a grid step at a time: slow)
    pytest.param(jnp.float32, 1, "pallas", marks=pytest.mark.slow),
    pytest.param(jnp.bfloat16, 1, "pallas", marks=pytest.mark.slow)])
def test_grouped_matmul_values_and_input_gradients_match_numpy(dtype, tile, implementation):
    weight = make_experts(tile, implementation=implementation)
    sizes = group_sizes(3)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((ROWS, IN)), dtype)
    cotangent = jnp.asarray(rng.standard_normal((ROWS, OUT)), dtype)
    y, vjp = jax.vjp(lambda x: mxfp4.grouped_matmul(x, weight, jnp.asarray(sizes)), x)
    (dx,) = vjp(cotangent)
    w = ref.dense_experts(weight.codes, weight.scales)
    y_ref = ref.grouped_matmul(np.asarray(x, np.float64), w, sizes)
    dx_ref = ref.grouped_matmul(np.asarray(cotangent, np.float64), np.swapaxes(w, 1, 2), sizes)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    assert y.dtype == dtype and dx.dtype == dtype
    for value, expected in ((y, y_ref), (dx, dx_ref)):
        np.testing.assert_allclose(np.asarray(value, np.float64), expected, rtol=tolerance,
                                   atol=tolerance * np.abs(expected).max())
    assert not np.any(np.asarray(y[ROWS - 5:])) and not np.any(np.asarray(dx[ROWS - 5:]))


def test_gradient_flows_upstream_and_not_to_the_codes():
    weight = make_experts(4)
    sizes = jnp.asarray(group_sizes(5))
    x = jnp.asarray(np.random.default_rng(6).standard_normal((ROWS, IN)), jnp.float32)
    scale = jnp.float32(1.5)
    grad = jax.grad(lambda s: jnp.sum(mxfp4.grouped_matmul(s * x, weight, sizes) ** 2))(scale)
    y = np.asarray(mxfp4.grouped_matmul(x, weight, sizes), np.float64)
    np.testing.assert_allclose(grad, 2 * 1.5 * np.sum(y * y), rtol=1e-4)
    cotangents = jax.grad(lambda w: jnp.sum(mxfp4.grouped_matmul(x, w, sizes)), allow_int=True)(weight)
    assert all(c.dtype == jax.dtypes.float0 for c in jax.tree.leaves(cotangents))


def compiled_temporary(grouped, weight, x, sizes) -> int:
    """Temporary bytes of the compiled forward + backward of ``grouped(x, weight, sizes)``."""
    step = jax.jit(jax.grad(lambda x, weight: jnp.sum(grouped(x, weight, sizes) ** 2)))
    return step.lower(x, weight).compile().memory_analysis().temp_size_in_bytes


def test_tiled_temporary_is_far_below_decoding_every_expert():
    """256 experts, decoded 4 at a time, against the same product on all experts decoded at once."""
    experts = 256
    codes, scales = encode(jnp.ones((experts, OUT, IN)))
    weight = mxfp4.Mxfp4Experts(codes, scales, tile=4, implementation="xla")
    sizes = jnp.full((experts,), 1, jnp.int32)
    x = jnp.ones((experts, IN))
    tiled = compiled_temporary(mxfp4.grouped_matmul, weight, x, sizes)
    decode_all = compiled_temporary(lambda x, w, sizes: jax.lax.ragged_dot(x, w.decoded(), sizes), weight, x, sizes)
    assert tiled < 0.1 * decode_all, (tiled, decode_all)


def test_shape_tiles_and_bad_implementation():
    weight = make_experts(5)
    assert weight.shape == (EXPERTS, IN, OUT)
    assert weight.decoded().shape == (EXPERTS, IN, OUT)
    assert [mxfp4.tile_size(EXPERTS, t) for t in (1, 5, 8, 12, 40)] == [1, 4, 6, 12, 12]
    bad = mxfp4.Mxfp4Experts(weight.codes, weight.scales, implementation="cuda")
    with pytest.raises(ValueError, match="unknown MXFP4 implementation"):
        mxfp4.grouped_matmul(jnp.ones((ROWS, IN)), bad, jnp.asarray(group_sizes(1)))
