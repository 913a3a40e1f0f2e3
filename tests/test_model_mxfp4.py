"""A tiny K3 with MXFP4 routed experts: its loss equals its dense-decoded twin's, and it trains --
every trained parameter is an ``nnx.Param`` outside the experts, which stay bit for bit."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from k3jax.config import load_config
from k3jax.model import K3Model
from k3jax.ops.mxfp4_format import decode
from k3jax.training import init_train_state, make_train_step, split_model
from tests.helpers import MICRO

MXFP4 = ("model.moe.expert_format=mxfp4", "model.moe.expert_matmul=ragged_dot", "model.moe.expert_width=32",
         "model.moe.latent_dim=32", "model.moe.expert_tile=3")


def dense_twin_params(params: dict, buffers: dict) -> dict:
    """The dense model's parameters: the MXFP4 model's, plus each expert weight decoded [.., E, in, out]."""
    dense = dict(params)
    for key, codes in buffers.items():
        if key.endswith("_packed"):
            name = key.removesuffix("_packed")
            dense[name] = jnp.swapaxes(decode(codes, buffers[name + "_scale"]), -1, -2)
    return dense


def batch(seed, config):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 17)), jnp.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": jnp.ones((2, 16), jnp.float32),
            "segment_ids": jnp.ones((2, 16), jnp.int32)}


@pytest.mark.slow   # compiles the model three times (two forwards, a train step): minutes on 2 shared cores
def test_tiny_mxfp4_model_equals_dense_twin_and_trains_with_frozen_codes():
    config = load_config(MICRO, list(MXFP4)).model
    dense_config = load_config(MICRO, [*MXFP4, "model.moe.expert_format=dense"]).model
    parts, params, buffers = split_model(nnx.jit(lambda: K3Model(config, rngs=nnx.Rngs(0)))())
    dense_parts, dense_params, dense_buffers = split_model(nnx.eval_shape(lambda: K3Model(dense_config, rngs=nnx.Rngs(0))))
    codes = {k: np.asarray(v) for k, v in buffers.items() if "experts" in k}   # the train step donates its state
    assert codes and all(v.dtype == jnp.uint8 for v in codes.values())
    assert not [k for k in params if "/experts/" in k]
    twin = dense_twin_params(params, buffers)
    assert set(twin) == set(dense_params)
    data = batch(1, config)

    def logits(parts, params, buffers):
        return parts.merge(params, buffers)(data["tokens"], segment_ids=data["segment_ids"]).logits

    quantized_logits = jax.jit(lambda p, b: logits(parts, p, b))(params, buffers)
    dense_logits = jax.jit(lambda p, b: logits(dense_parts, p, b))(
        twin, {k: v for k, v in buffers.items() if k in dense_buffers})
    np.testing.assert_allclose(quantized_logits, dense_logits, rtol=1e-5, atol=1e-5)

    initial = {k: np.asarray(v) for k, v in params.items()}
    optimizer = optax.adam(1e-2)
    state = init_train_state(params, buffers, optimizer)
    step = make_train_step(parts, optimizer)
    losses = []
    for i in range(3):
        state, metrics = step(state, batch(1, config))
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
    for key, value in codes.items():
        np.testing.assert_array_equal(np.asarray(state.buffers[key]), value, err_msg=key)
    changed = [k for k in params if not np.array_equal(np.asarray(state.params[k]), initial[k])]
    assert "body/layers/1/ffn/latent_down" in changed and "lm_head" in changed and len(changed) > len(params) // 2
