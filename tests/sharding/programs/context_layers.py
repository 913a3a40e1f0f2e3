"""KDA and MLA layers with `ContextParallel` over a 4-device `context` axis against the same layers
on one device: outputs and gradients (input and parameters), documents crossing shard boundaries
and one starting exactly at one; MLA both by all-gather and by ring passing. Prints JSON
{"kda": rel, "mla": rel, "mla_ring": rel}."""
import json
import sys

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType

from k3jax.config import KDAConfig, MLAConfig
from k3jax.layers.kda import KDALayer
from k3jax.layers.mla import MLALayer
from k3jax.sharding.context import ContextParallel
from tests.helpers import rel_err

B, T, D = 2, 64, 16


def compare(layer, context, x, segments):
    layer.context_parallel = None
    graphdef, state = nnx.split(layer)

    def loss(state, x):
        y, _ = nnx.merge(graphdef, state)(x, None, segments)
        return jnp.sum(y * jnp.cos(y))

    expected = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)
    layer.context_parallel = context
    graphdef, state = nnx.split(layer)
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)
    return max(rel_err(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)))


def main():
    mesh = jax.make_mesh((4,), ("context",), devices=jax.devices()[:4], axis_types=(AxisType.Auto,))
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    segments = jnp.array([[1] * 16 + [2] * 21 + [3] * 27, [4] * T], jnp.int32)
    kda_layer = KDALayer(D, KDAConfig(num_heads=2, head_dim=8, chunk_size=16, implementation="chunk"),
                         init_std=0.3, rngs=nnx.Rngs(1))
    mla_layer = MLALayer(D, MLAConfig(num_heads=2, q_lora_rank=8, kv_lora_rank=8, nope_head_dim=4, rope_head_dim=4,
                                      value_head_dim=4, output_gate=True, attention_block_size=8),
                         init_std=0.3, rngs=nnx.Rngs(2))
    print(json.dumps({"kda": compare(kda_layer, ContextParallel(mesh), x, segments),
                      "mla": compare(mla_layer, ContextParallel(mesh), x, segments),
                      "mla_ring": compare(mla_layer, ContextParallel(mesh, attention_method="ring"), x, segments)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
