"""MoE layers with MXFP4 routed experts (``expert_format: mxfp4``): the same function as the dense
layer on the decoded weights and as the float64 NumPy reference (decoding from SPEC §7 itself),
gradients for the inputs only, frozen uint8 codes, their device bytes."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import ConfigError
from k3jax.layers.moe import EXPERT_WEIGHTS, ExpertCodes, MoE
from k3jax.layers.params import logical_axes
from tests.layers.test_moe import TOP_K, moe_config, numpy_params
from tests.ops import numpy_moe as ref
from tests.ops import numpy_mxfp4

D_MODEL, LATENT, WIDTH = 16, 32, 64
MXFP4 = dict(num_experts=8, expert_width=WIDTH, latent_dim=LATENT, latent_norm=True, num_shared_experts=1,
             expert_format="mxfp4", expert_tile=3)


def build_pair(d_model: int, config, dtype):
    """(an MXFP4 MoE of ``config``, its dense twin: every parameter equal, experts the decoded codes)."""
    quantized = MoE(d_model, config, init_std=0.3, dtype=dtype, rngs=nnx.Rngs(0))
    dense = MoE(d_model, dataclasses.replace(config, expert_format="dense"), init_std=0.3, dtype=dtype,
                rngs=nnx.Rngs(1))
    nnx.update(dense, nnx.state(quantized, nnx.Param))
    for name, weight in zip(EXPERT_WEIGHTS, quantized.experts.expert_weights()):
        getattr(dense.experts, name)[...] = weight.decoded()
    return quantized, dense


@functools.cache
def make_pair(dtype=jnp.float32):
    """`build_pair` of this file's layer, built jitted (much faster on CPU than eagerly)."""
    return nnx.jit(lambda: build_pair(D_MODEL, moe_config(**MXFP4), dtype))()


def spec_params(quantized, dense):
    """The layer's parameters in float64 for `numpy_moe`, the experts decoded from the MXFP4 layer's
    codes by `numpy_mxfp4` (not by k3jax)."""
    experts = quantized.experts
    decoded = {name: numpy_mxfp4.dense_experts(np.asarray(getattr(experts, f"{name}_packed")[...]),
                                               np.asarray(getattr(experts, f"{name}_scale")[...]))
               for name in EXPERT_WEIGHTS}
    return {**numpy_params(dense), **decoded}


def loss_and_input_grad(model, x):
    def loss(x):
        y, _ = model(x)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))
    return jax.jit(jax.value_and_grad(loss))(x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_mxfp4_layer_equals_dense_twin_and_numpy(dtype):
    quantized, dense = make_pair(dtype)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 12, D_MODEL)), jnp.float32)
    (loss, grad), (loss_dense, grad_dense) = loss_and_input_grad(quantized, x), loss_and_input_grad(dense, x)
    tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(loss, loss_dense, rtol=tolerance)
    np.testing.assert_allclose(grad, grad_dense, rtol=tolerance, atol=tolerance * np.abs(grad_dense).max())
    if dtype == jnp.float32:
        y = nnx.jit(lambda m, x: m(x)[0])(quantized, x)
        y_ref, _, _ = ref.moe_forward(np.asarray(x, np.float64).reshape(-1, D_MODEL), spec_params(quantized, dense), TOP_K,
                                      "situ")
        np.testing.assert_allclose(np.asarray(y).reshape(-1, D_MODEL), y_ref, rtol=1e-4,
                                   atol=1e-4 * np.abs(y_ref).max())


def test_codes_are_frozen_uint8_buffers_in_the_release_layout():
    quantized, _ = make_pair()
    experts = quantized.experts
    assert not [path for path, _ in nnx.to_flat_state(nnx.state(experts, nnx.Param))]
    codes = dict(nnx.to_flat_state(nnx.state(experts, ExpertCodes)))
    assert {path[0] for path in codes} == {f"{n}_{part}" for n in EXPERT_WEIGHTS for part in ("packed", "scale")}
    assert experts.w_gate_packed[...].shape == (8, WIDTH, LATENT // 2) and experts.w_gate_packed[...].dtype == jnp.uint8
    assert experts.w_down_scale[...].shape == (8, LATENT, WIDTH // 32)
    assert logical_axes(experts.w_gate_packed) == ("experts", "expert_mlp", "latent")
    assert logical_axes(experts.w_down_packed) == ("experts", "latent", "expert_mlp")
    grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x)[0])))(quantized, jnp.ones((1, 4, D_MODEL)))
    assert not [path for path, _ in nnx.to_flat_state(grads) if "experts" in path]


def test_device_bytes_of_mxfp4_experts_are_at_most_0_27_of_bf16():
    quantized, _ = make_pair()
    stored = sum(v.get_value().nbytes for _, v in nnx.to_flat_state(nnx.state(quantized.experts, ExpertCodes)))
    weights = sum(np.prod(w.shape) for w in quantized.experts.expert_weights())
    assert stored / (2 * weights) <= 0.27, stored / (2 * weights)


def test_mxfp4_configuration_errors():
    with pytest.raises(ConfigError, match="expert_matmul"):
        moe_config(**MXFP4, expert_matmul="dense")
    with pytest.raises(ConfigError, match="expert_tile"):
        moe_config(**{**MXFP4, "expert_tile": 0})
    with pytest.raises(ValueError, match="multiple of 32"):
        MoE(D_MODEL, moe_config(**{**MXFP4, "expert_width": 48}), rngs=nnx.Rngs(0))
