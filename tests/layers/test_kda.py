"""The KDA layer against an independent float64 NumPy layer (SPEC §1): both gate forms, full and
low-rank output gates, grouped values, carried state and conv tail, packed documents, decode; the
config's ``implementation`` reaching the forward, the one-token decode and the pooled decode, and
each implementation's decode paths against the forward over the whole history."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import KDAConfig
from k3jax.layers.kda import KDALayer
from k3jax.memory import KDAMemory, KDAPool
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


IMPLEMENTATIONS = ("reference", "chunk", "pallas", "auto")
apply = nnx.jit(lambda layer, x, memory: layer(x, memory))    # one compile per layer config and shapes


def grouped_layer(implementation: str) -> KDALayer:
    """The grouped-values layer with ``implementation`` (the same parameters for every implementation)."""
    cfg = dataclasses.replace(CONFIGS["kimi_linear_grouped"], implementation=implementation)
    return KDALayer(D_MODEL, cfg, init_std=0.3, rngs=nnx.Rngs(6))


def empty_memory(cfg: KDAConfig, rows: int) -> KDAMemory:
    return KDAMemory(jnp.zeros((rows, cfg.num_value_heads, cfg.head_dim, cfg.head_dim)),
                     jnp.zeros((rows, cfg.conv_size - 1, cfg.conv_width)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_config_implementation_reaches_all_three_paths(implementation):
    """On a CPU, exactly "pallas" puts Pallas kernels (a pallas_call) in the forward over a sequence,
    the one-token decode of a contiguous bank and the pooled decode; the others run XLA."""
    layer = grouped_layer(implementation)
    graphdef, params = nnx.split(layer)
    x = jnp.ones((2, 3, D_MODEL))
    contiguous = empty_memory(layer.config, 2)
    pooled = KDAPool(*empty_memory(layer.config, 5), rows=jnp.asarray([3, 1]))
    paths = {"forward": (x, contiguous), "one-token decode": (x[:, :1], contiguous),
             "pooled decode": (x[:, :1], pooled)}
    for path, (inputs, memory) in paths.items():
        jaxpr = jax.make_jaxpr(lambda p, x, m: nnx.merge(graphdef, p)(x, m))(params, inputs, memory)
        assert ("pallas_call" in str(jaxpr)) == (implementation == "pallas"), path


# "auto" is "chunk" on a CPU (tests/ops/test_decode_pool.py); "pallas" compiles its interpreted
# forward kernels for the prefill (over 10 s here).
@pytest.mark.parametrize("implementation", ["reference", "chunk", pytest.param("pallas", marks=pytest.mark.slow)])
def test_decode_paths_of_every_implementation_equal_the_forward_over_the_history(implementation):
    """A prefill of 4 tokens (this implementation's forward), then 3 one-token decodes of the
    contiguous bank and, from the same prefill, 3 pooled decodes from rows 3 and 1 of 5: the
    outputs, states and conv tails of the "reference" forward over all 7 tokens (fp32)."""
    layer = grouped_layer(implementation)
    cfg = layer.config
    x = jnp.asarray(np.random.default_rng(7).standard_normal((2, 7, D_MODEL)), jnp.float32)
    y_full, full = apply(grouped_layer("reference"), x, empty_memory(cfg, 2))
    y_prefill, memory = apply(layer, x[:, :4], empty_memory(cfg, 2))
    rows = jnp.asarray([3, 1])
    noise = np.random.default_rng(8)
    pools = [jnp.asarray(noise.standard_normal((5, *a.shape[1:])), jnp.float32).at[rows].set(a) for a in memory]
    pooled = KDAPool(*pools, rows=rows)
    decoded, decoded_pooled = [y_prefill], [y_prefill]
    for t in range(4, 7):
        y, memory = apply(layer, x[:, t : t + 1], memory)
        y_pooled, pooled = apply(layer, x[:, t : t + 1], pooled)
        decoded.append(y)
        decoded_pooled.append(y_pooled)
    for ys, state, conv in ((decoded, memory.state, memory.conv),
                            (decoded_pooled, pooled.state[rows], pooled.conv[rows])):
        assert rel_err(jnp.concatenate(ys, axis=1), y_full) <= 1e-5
        assert rel_err(state, full.state) <= 1e-5
        np.testing.assert_allclose(conv, full.conv, rtol=1e-6, atol=1e-6)
    for got, before in zip((pooled.state, pooled.conv), pools):
        np.testing.assert_array_equal(np.asarray(got)[[0, 2, 4]], np.asarray(before)[[0, 2, 4]])
