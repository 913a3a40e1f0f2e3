"""LoRA on MXFP4 routed experts (QLoRA): ``y_r = mxfp4(x_r, W_j) + s (x_r A) B_j`` with the codes
frozen. The grouped matmul against a float64 NumPy reference on the weights decoded from SPEC §7
(values and the gradients w.r.t. x, A and B, fp32 and bf16 compute), and the MoE layer against
its dense twin whose adapters are merged into the decoded weights (values and gradients)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.layers.lora import LoRA, attach_adapters
from k3jax.layers.moe import EXPERT_WEIGHTS
from k3jax.ops.mxfp4 import Mxfp4Experts, grouped_matmul
from k3jax.ops.mxfp4_format import encode
from tests.layers.test_moe_mxfp4 import D_MODEL, MXFP4, build_pair
from tests.layers.test_moe import moe_config
from tests.ops import numpy_mxfp4

EXPERTS, IN, OUT, RANK, SCALE = 4, 64, 32, 3, 0.75
GROUPS = np.array([5, 0, 7, 3])          # 15 rows in groups, 2 rows past them


def numpy_reference(x, w, a, b, cotangent):
    """float64 (y, dx, dA, dB) of y_r = x_r (W_j + s A B_j), for the loss sum(cotangent * y):
    dx_r = c_r (W_j + s A B_j)^T,  dA = s sum_r x_r^T (c_r B_j^T),  dB_j = s sum_{r in j} (x_r A)^T c_r."""
    y, dx = np.zeros(cotangent.shape), np.zeros(x.shape)
    da, db = np.zeros(a.shape), np.zeros(b.shape)
    start = 0
    for j, size in enumerate(GROUPS):
        rows = slice(start, start + size)
        effective = w[j] + SCALE * a @ b[j]
        y[rows] = x[rows] @ effective
        dx[rows] = cotangent[rows] @ effective.T
        da += SCALE * x[rows].T @ (cotangent[rows] @ b[j].T)
        db[j] = SCALE * (x[rows] @ a).T @ cotangent[rows]
        start += size
    return y, dx, da, db


@functools.cache
def operands():
    rng = np.random.default_rng(0)
    codes, scales = encode(jnp.asarray(rng.standard_normal((EXPERTS, OUT, IN)), jnp.float32))
    x = rng.standard_normal((GROUPS.sum() + 2, IN))
    a, b = rng.standard_normal((IN, RANK)) / 8, rng.standard_normal((EXPERTS, RANK, OUT)) / 2
    cotangent = rng.standard_normal((x.shape[0], OUT))
    return codes, scales, x, a, b, cotangent


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_grouped_matmul_with_adapter_equals_numpy_on_decoded_weights(dtype):
    codes, scales, x, a, b, cotangent = operands()

    def loss(x, a, b):
        weight = Mxfp4Experts(codes, scales, tile=3, adapter_a=a, adapter_b=b, adapter_scale=SCALE)
        y = grouped_matmul(x.astype(dtype), weight, jnp.asarray(GROUPS, jnp.int32))
        return jnp.sum(y.astype(jnp.float32) * cotangent), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        jnp.asarray(x, jnp.float32), jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    w = numpy_mxfp4.dense_experts(np.asarray(codes), np.asarray(scales))
    if dtype == jnp.bfloat16:     # the reference on the bf16-rounded input
        x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
    expected = numpy_reference(x, w, a, b, cotangent)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, got, want in zip(("y", "dx", "dA", "dB"), (y, *grads), expected):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=tolerance * np.abs(want).max(),
                                   err_msg=name)
    assert not np.any(np.asarray(y)[GROUPS.sum():])          # rows past the groups stay zero


@pytest.mark.slow   # two layers with adapters, compiled with their gradients (~1 min here)
def test_qlora_moe_layer_equals_dense_twin_with_merged_adapters():
    """The MXFP4 layer with routed-expert adapters (the term beside the decoded product) against the
    dense layer on the decoded weights with the same adapters merged, W_e + s A B_e (values and the
    gradients w.r.t. the input and every adapter factor); the codes get no gradient."""
    def build():
        quantized, dense = build_pair(D_MODEL, moe_config(**MXFP4), jnp.float32)
        for model in (quantized, dense):
            attach_adapters(model, rank=RANK, alpha=SCALE * RANK, dropout_rate=0.0, targets=(),
                            routed_experts=True, seed=7)
            for name in EXPERT_WEIGHTS:      # B starts at zero: make the term matter
                adapter = getattr(model.experts, f"{name}_lora")
                adapter.b[...] = 0.3 * jax.random.normal(jax.random.key(len(name)), adapter.b.shape)
        return quantized, dense

    quantized, dense = nnx.jit(build)()

    def loss_and_grads(model, x):
        graphdef, adapters, rest = nnx.split(model, LoRA, ...)

        def loss(adapters, x, rest):
            return jnp.sum(jnp.sin(nnx.merge(graphdef, adapters, rest)(x)[0]))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(adapters, x, rest)

    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 12, D_MODEL)), jnp.float32)
    (value, (grads, dx)), (value_dense, (grads_dense, dx_dense)) = loss_and_grads(quantized, x), loss_and_grads(dense, x)
    np.testing.assert_allclose(value, value_dense, rtol=1e-5)
    np.testing.assert_allclose(dx, dx_dense, rtol=0, atol=1e-5 * np.abs(dx_dense).max())
    flat, flat_dense = dict(nnx.to_flat_state(grads)), dict(nnx.to_flat_state(grads_dense))
    assert flat.keys() == flat_dense.keys() and len(flat) == 6
    for path, variable in flat.items():
        want = np.asarray(flat_dense[path].get_value())
        assert np.abs(want).max() > 0, path
        np.testing.assert_allclose(variable.get_value(), want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=str(path))
