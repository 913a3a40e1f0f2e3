"""`k3jax.ops.products`: values and gradients against float64 NumPy, and the CPU program's shape."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.products import held_transpose, product


@pytest.mark.parametrize("x_shape, w_shape, contract", [((3, 5, 4), (4, 6), 1), ((2, 3, 4, 5), (4, 5, 7), 2)])
def test_product_values_and_gradients_match_numpy(x_shape, w_shape, contract):
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    out_shape = x_shape[: len(x_shape) - contract] + w_shape[contract:]
    c = rng.standard_normal(out_shape)   # the loss sum(c * y) has dL/dy = c
    inputs = int(np.prod(w_shape[:contract]))
    x2, w2, c2 = x.reshape(-1, inputs), w.reshape(inputs, -1), c.reshape(-1, int(np.prod(w_shape[contract:])))
    expected_y = (x2 @ w2).reshape(out_shape)
    expected_dx = (c2 @ w2.T).reshape(x_shape)
    expected_dw = (x2.T @ c2).reshape(w_shape)

    with jax.enable_x64():
        loss = lambda x, w: jnp.sum(jnp.asarray(c) * product(x, w, contract))  # noqa: E731
        y = product(jnp.asarray(x), jnp.asarray(w), contract)
        dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(y, expected_y, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, expected_dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw, expected_dw, rtol=1e-12, atol=1e-12)


def test_gradients_keep_each_operand_dtype():
    x = jnp.ones((4, 3), jnp.bfloat16)
    w = jnp.ones((3, 2), jnp.float32)
    dx, dw = jax.grad(lambda x, w: jnp.sum(product(x, w)), argnums=(0, 1))(x, w)
    assert (dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.float32)
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.full((4, 3), 2.0))
    np.testing.assert_array_equal(dw, np.full((3, 2), 4.0))


def test_held_transpose_swaps_the_last_two_axes():
    a = jnp.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(held_transpose(a), np.swapaxes(np.arange(24.0).reshape(2, 3, 4), -1, -2))


def test_weight_gradient_is_a_plain_product_on_cpu():
    """On XLA:CPU no dot of the gradient contracts its left operand over the rows (axis 0)."""
    grad = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.tanh(product(x, w))), argnums=1))
    text = grad.lower(jnp.ones((64, 8)), jnp.ones((8, 16))).compile().as_text()
    dots = re.findall(r"lhs_contracting_dims=\{(\d+)\}", text)
    assert dots and "0" not in dots, dots
