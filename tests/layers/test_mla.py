"""Gated MLA against float64 NumPy attention (SPEC §2): with/without q-LoRA and output gate,
packed documents, and the latent cache (absorbed form) equal to full causal attention."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import MLAConfig
from k3jax.layers.mla import MLALayer
from k3jax.memory import MLAMemory
from tests import numpy_reference as ref
from tests.helpers import call_layer, param_values, rel_err

D_MODEL = 24
CONFIGS = {
    "k3": MLAConfig(num_heads=2, q_lora_rank=12, kv_lora_rank=16, nope_head_dim=8, rope_head_dim=4,
                    value_head_dim=6, output_gate=True, norm_eps=1e-5),
    "kimi_linear": MLAConfig(num_heads=3, q_lora_rank=None, kv_lora_rank=16, nope_head_dim=8, rope_head_dim=4,
                             value_head_dim=6, output_gate=False),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_full_attention_matches_numpy_with_segments(name):
    cfg = CONFIGS[name]
    layer = MLALayer(D_MODEL, cfg, init_std=0.3, rngs=nnx.Rngs(0))
    x = np.random.default_rng(1).standard_normal((2, 9, D_MODEL))
    segments = np.array([[0] * 4 + [1] * 5, [2] * 9])
    y, memory = call_layer(layer, jnp.asarray(x, jnp.float32), None, jnp.asarray(segments))
    assert memory is None
    assert rel_err(y, ref.mla_layer(param_values(layer), x, cfg, segments)) < 1e-5


@pytest.mark.parametrize("name", CONFIGS)
def test_cached_prefill_and_decode_equal_full_attention(name):
    """Pieces of 5, 1, 1, 2 tokens through the cache; the first sequence packs two documents
    (boundary inside the first piece), so later pieces must not see the first document."""
    cfg = CONFIGS[name]
    layer = MLALayer(D_MODEL, cfg, init_std=0.3, rngs=nnx.Rngs(2))
    x = np.random.default_rng(3).standard_normal((2, 9, D_MODEL))
    segments = np.array([[0] * 3 + [1] * 6, [0] * 9])
    memory = MLAMemory(jnp.zeros((2, 12, cfg.latent_width)), jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32))
    outputs = []
    for start, stop in [(0, 5), (5, 6), (6, 7), (7, 9)]:
        y, memory = call_layer(layer, jnp.asarray(x[:, start:stop], jnp.float32), memory, jnp.asarray(segments[:, start:stop]))
        outputs.append(y)
    np.testing.assert_array_equal(memory.length, [9, 9])
    np.testing.assert_array_equal(memory.document_start, [3, 0])
    np.testing.assert_array_equal(memory.latent[:, 9:], 0.0)
    expected = ref.mla_layer(param_values(layer), x, cfg, segments)
    assert rel_err(jnp.concatenate(outputs, axis=1), expected) < 1e-5


def test_cache_holds_normed_latent_and_key_slice_per_token():
    cfg = CONFIGS["k3"]
    layer = MLALayer(D_MODEL, cfg, init_std=0.3, rngs=nnx.Rngs(4))
    p = param_values(layer)
    x = np.random.default_rng(5).standard_normal((1, 3, D_MODEL))
    memory = MLAMemory(jnp.zeros((1, 4, cfg.latent_width)), jnp.array([1], jnp.int32), jnp.array([0], jnp.int32))
    _, memory = call_layer(layer, jnp.asarray(x, jnp.float32), memory)
    latent = x @ p["kv_a_proj"]
    expected = np.concatenate([ref.rms_norm(latent[..., :16], p["kv_a_norm"], cfg.norm_eps), latent[..., 16:]], -1)
    np.testing.assert_allclose(memory.latent[:, 1:4], expected, rtol=1e-5, atol=1e-5)
    assert int(memory.length[0]) == 4
