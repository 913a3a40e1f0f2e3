"""KDA and its short convolution with the sequence split over a `context` axis of 2, 4 and 8 fake
CPU devices, against one device: outputs, final state and gradients (values and q, k, v, g, beta
cotangents). Documents end inside shards and exactly at a shard boundary. Prints JSON
{"P": {"kda": rel, "state": rel, "grads": rel, "conv": rel}}."""
import json
import sys

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from k3jax.ops.conv import causal_depthwise_conv
from k3jax.ops.kda import kda, l2_normalize
from k3jax.sharding.context import conv_across_shards, kda_across_shards
from tests.helpers import rel_err

B, T, H, HV, K, W = 2, 64, 1, 2, 8, 4


def inputs():
    keys = jax.random.split(jax.random.key(0), 6)
    q = l2_normalize(jax.random.normal(keys[0], (B, T, H, K)))
    k = l2_normalize(jax.random.normal(keys[1], (B, T, H, K)))
    v = jax.random.normal(keys[2], (B, T, HV, K))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (B, T, HV, K))) * 0.3
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, HV)))
    # row 0: boundaries at 8 (a shard boundary for P = 8, 4, 2 as 8 | 16 | 32), 21, 32; row 1: one document
    segments = jnp.array([[1] * 8 + [2] * 13 + [3] * 11 + [4] * 32, [5] * T], jnp.int32)
    return (q, k, v, g, beta), segments, jax.random.normal(keys[5], (B, T, HV, K))


def main():
    (q, k, v, g, beta), segments, cotangent = inputs()
    x = jax.random.normal(jax.random.key(1), (B, T, 6))
    weight = jax.random.normal(jax.random.key(2), (6, W))

    def loss(fn, *args):
        o, state = fn(*args)
        return jnp.sum(o * cotangent) + jnp.sum(state**2)

    one_device = lambda *a: kda(*a, segment_ids=segments, chunk_size=16, implementation="chunk")
    expected = one_device(q, k, v, g, beta)
    expected_grads = jax.grad(lambda *a: loss(one_device, *a), argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)
    expected_conv, _ = causal_depthwise_conv(x, weight, None, segments)
    results = {}
    for size in (2, 4, 8):
        mesh = jax.make_mesh((size,), ("context",), devices=jax.devices()[:size], axis_types=(AxisType.Auto,))
        seq = P(None, "context")
        sharded = jax.shard_map(
            lambda q, k, v, g, beta, s: kda_across_shards(q, k, v, g, beta, s, axis_name="context", chunk_size=16,
                                                          implementation="chunk"),
            mesh=mesh, in_specs=(seq,) * 6, out_specs=(seq, P()), check_vma=False)
        run = jax.jit(lambda *a: sharded(*a, segments))
        o, state = run(q, k, v, g, beta)
        grads = jax.jit(jax.grad(lambda *a: loss(run, *a), argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta)
        conv = jax.jit(jax.shard_map(lambda x, s: conv_across_shards(x, weight, s, "context"), mesh=mesh,
                                     in_specs=(seq, seq), out_specs=seq, check_vma=False))(x, segments)
        results[size] = {"kda": rel_err(o, expected[0]), "state": rel_err(state, expected[1]),
                         "grads": max(rel_err(a, b) for a, b in zip(grads, expected_grads)),
                         "conv": rel_err(conv, expected_conv)}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
