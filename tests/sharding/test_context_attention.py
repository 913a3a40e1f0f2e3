"""The ring form's pieces on one device (k3jax.sharding.context): blockwise attention over disjoint
key parts, merged by log-sum-exp, equals float64 NumPy attention over all keys -- values and
gradients, with packed documents, padding, and query rows that see no key of a part."""
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.attention import blockwise_attention_with_lse
from k3jax.sharding.context import _merge_attention
from tests.helpers import rel_err
from tests.ops.test_attention import inputs, numpy_attention


def test_attention_over_three_key_parts_merged_by_lse_equals_numpy_over_all_keys():
    """Queries at positions 12..23 of a 24-token sequence; keys in parts 0..7, 8..15, 16..23 (the
    last part partly after the queries); document 1 ends at 14, padding id 0 from 22 on."""
    q, k, v, d_o = inputs(1, 12, 24, 2, 1, 6, 5, seed=3)
    key_segments = np.array([[1] * 15 + [2] * 7 + [0] * 2], np.int32)
    query_segments = key_segments[:, 12:]
    query_positions = np.arange(12, 24, dtype=np.int32)[None]
    key_positions = np.arange(24, dtype=np.int32)[None]
    scale = 6**-0.5

    def merged(q, k, v):
        parts = [blockwise_attention_with_lse(q, k[:, s:s + 8], v[:, s:s + 8], query_positions,
                                              key_positions[:, s:s + 8], query_segments,
                                              key_segments[:, s:s + 8], scale, 4)
                 for s in (0, 8, 16)]
        out = parts[0]
        for part in parts[1:]:
            out = _merge_attention(out, part)
        return jnp.sum(out[0] * d_o), out

    (_, (o, lse)), grads = jax.jit(jax.value_and_grad(merged, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    # the padding queries (segment 0 at positions 22, 23) see only themselves and earlier padding
    expected = numpy_attention(q, k, v, scale, query_positions, key_positions, query_segments, key_segments, d_o)
    assert bool(jnp.all(jnp.isfinite(lse)))
    _, first_part_lse = blockwise_attention_with_lse(q, k[:, :8], v[:, :8], query_positions, key_positions[:, :8],
                                                     query_segments, key_segments[:, :8], scale, 4)
    assert not bool(jnp.all(jnp.isfinite(first_part_lse)))      # document 2 sees no key of part 0
    for got, want in zip((o, *grads), expected):
        assert rel_err(got, want) <= 1e-5
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
