"""The KDA layer against an independent float64 NumPy layer (SPEC §1): both gate forms, full and
low-rank output gates, grouped values, carried state and conv tail, packed documents, decode."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import KDAConfig
from k3jax.layers.kda import KDALayer
from k3jax.memory import KDAMemory
from tests import numpy_reference as ref
from tests.helpers import call_layer, param_values, rel_err

D_MODEL = 24
CONFIGS = {
    "k3": KDAConfig(num_heads=2, head_dim=8, gate="lower_bound", lower_bound=-5.0, output_gate="full"),
    "kimi_linear_grouped": KDAConfig(num_heads=2, head_dim=8, value_heads=4, gate="softplus", output_gate="low_rank"),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_layer_matches_numpy_with_memory_and_segments(name):
    cfg = CONFIGS[name]
    layer = KDALayer(D_MODEL, cfg, init_std=0.3, rngs=nnx.Rngs(0))
    p = param_values(layer)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 21, D_MODEL))
    state = rng.standard_normal((2, cfg.num_value_heads, cfg.head_dim, cfg.head_dim))
    conv = rng.standard_normal((2, cfg.conv_size - 1, cfg.conv_width))
    segments = np.array([[0] * 9 + [1] * 12, [5] * 21])
    y, memory = call_layer(layer, jnp.asarray(x, jnp.float32), KDAMemory(jnp.asarray(state, jnp.float32),
                     jnp.asarray(conv, jnp.float32)), jnp.asarray(segments))
    y_ref, state_ref, conv_ref = ref.kda_layer(p, x, cfg, state, conv, segments)
    assert rel_err(y, y_ref) < 1e-4
    assert rel_err(memory.state, state_ref) < 1e-4
    np.testing.assert_allclose(memory.conv, conv_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_then_decode_steps_equal_one_pass(name):
    cfg = CONFIGS[name]
    layer = KDALayer(D_MODEL, cfg, init_std=0.3, rngs=nnx.Rngs(2))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 7, D_MODEL)), jnp.float32)
    empty = KDAMemory(jnp.zeros((2, cfg.num_value_heads, cfg.head_dim, cfg.head_dim)),
                      jnp.zeros((2, cfg.conv_size - 1, cfg.conv_width)))
    y_full, full_memory = call_layer(layer, x, empty)
    y, memory = call_layer(layer, x[:, :4], empty)
    outputs = [y]
    for t in range(4, 7):  # one-token decode steps (the kda_step path)
        y, memory = call_layer(layer, x[:, t : t + 1], memory)
        outputs.append(y)
    assert rel_err(jnp.concatenate(outputs, axis=1), y_full) < 1e-5
    assert rel_err(memory.state, full_memory.state) < 1e-5
    np.testing.assert_allclose(memory.conv, full_memory.conv, rtol=1e-6)


def test_parameters_carry_logical_axes():
    layer = KDALayer(D_MODEL, CONFIGS["kimi_linear_grouped"], init_std=0.02, rngs=nnx.Rngs(0))
    for path, variable in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        axes = variable.get_metadata()["logical_axes"]
        assert len(axes) == variable[...].ndim, path
    assert layer.A_log[...].shape == (4,) and layer.dt_bias[...].size == 4 * 8
    assert np.all((np.exp(layer.A_log[...]) >= 1) & (np.exp(layer.A_log[...]) <= 16))


def test_output_norm_eps_matches_numpy():
    cfg = KDAConfig(num_heads=2, head_dim=8, output_norm_eps=0.5)   # large enough to change the output
    layer = KDALayer(D_MODEL, cfg, init_std=0.3, rngs=nnx.Rngs(4))
    p = param_values(layer)
    x = np.random.default_rng(5).standard_normal((1, 6, D_MODEL))
    y, _ = call_layer(layer, jnp.asarray(x, jnp.float32))
    y_ref, _, _ = ref.kda_layer(p, x, cfg)
    assert rel_err(y, y_ref) < 1e-4
    y_default_eps, _, _ = ref.kda_layer(p, x, KDAConfig(num_heads=2, head_dim=8))
    assert rel_err(y_default_eps, y_ref) > 1e-2
