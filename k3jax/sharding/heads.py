"""Head-parallel kernels: under a mesh that splits the heads, each device runs the KDA kernels, and
MLA's splash attention, on its own heads.

XLA partitions the chunk form by itself (heads are a batch dimension of all its products), but a
Pallas kernel is a custom call it cannot split: a Triton kernel under a mesh is run on every head
by every device (the operands gathered), and a Mosaic (TPU) kernel is refused ("Mosaic kernels
cannot be automatically partitioned"). `HeadParallel` runs each KDA call in a `jax.shard_map`
manual over every mesh axis, each operand laid out as the model lays out that activation (its
logical axes through the mesh rules, `partition_spec`): a device gets its rows of the batch, H/n
query-key heads and HV/n value heads — value head j reads key head j // (HV/H), so contiguous
blocks of both stay matched — and its block of the state pool, updated in place. The short
convolution's channel pool splits its channels the same way (a depthwise convolution is per
channel). Each method has the signature of the op it runs (`k3jax.ops.kda`), so a layer calls
either; outputs are the same numbers as the op on the whole arrays.

`parallelize` sets one on each KDA layer of a mesh of more than one device — the batch alone may
be split, a kernel still sees only its device's operands — when the rules split both head counts
and the conv channels alike and no context axis splits the sequence (`k3jax.sharding.context`
runs those calls instead). It sets one on each MLA layer of such a mesh too, which runs its
attention among a call's tokens through `HeadParallel.attention` when that is a kernel XLA cannot
partition (`k3jax.ops.attention.KERNEL_IMPLEMENTATIONS`: splash; a Mosaic kernel under a TPU mesh
is refused otherwise): attention is independent per sequence and per head, so each device's rows
and heads give its block of the output.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
from jax.sharding import Mesh, PartitionSpec

from k3jax.config import AxisRules
from k3jax.ops.attention import attention
from k3jax.ops.kda import kda, kda_step, kda_steps
from k3jax.ops.kda.decode_pool import conv_pool_step, kda_pool_step
from k3jax.sharding.mesh import partition_spec

# The logical axes of the ops' operands and results (`k3jax.layers.axes` names; None: unsplit).
SEQUENCE = ("batch", None, "heads", None)           # q, k [B, T, H, K]; v, g, o [B, T, HV, ·]
SEQUENCE_GATE = ("batch", None, "heads")            # beta [B, T, HV]
TOKEN = ("batch", "heads", None)                    # one token's q, k, v, g, o [B, H, ·]
TOKEN_GATE = ("batch", "heads")                     # beta [B, HV]
STATE = ("batch", "heads", None, None)              # [B, HV, K, V]
STATES = ("batch", None, "heads", None, None)       # every position's [B, T, HV, K, V]
POOL = (None, "heads", None, None)                  # the state pool's rows [S, HV, K, V]
# A pool is whole on every device but for its heads, so every device updates every row it holds:
# the tokens of a pool step keep their batch whole too.
POOL_TOKEN = (None, "heads", None)
POOL_TOKEN_GATE = (None, "heads")                   # and beta [B, HV], the conv input x [B, C]
CONV_POOL = (None, None, "heads")                   # the conv pool's rows [S, W-1, C]
ROWS = (None,)                                      # pool rows [B]
SEGMENTS = ("batch", None)                          # segment ids [B, T]
CONV_WEIGHT = ("heads", None)                       # [C, W]


def mla_head_parallel(mesh: Mesh, rules: AxisRules) -> HeadParallel | None:
    """The `HeadParallel` of an MLA layer on ``mesh``: on any mesh of more than one device (heads the
    rules cannot split stay whole on each device, its rows of the batch still its own)."""
    return None if mesh.size == 1 else HeadParallel(mesh, rules)


def head_parallel_for(mesh: Mesh, rules: AxisRules, heads: int, value_heads: int, channels: int) -> HeadParallel | None:
    """The `HeadParallel` of a KDA layer with these head and conv-channel counts on ``mesh`` with
    ``rules``: on any mesh of more than one device (a Pallas kernel cannot be partitioned however
    the mesh splits its operands), unless the rules would split the query-key heads, the value
    heads and the conv channels unalike (then None: the ops on whole arrays)."""
    if mesh.size == 1:
        return None
    if len({partition_spec(("heads",), (count,), rules, mesh) for count in (heads, value_heads, channels)}) != 1:
        return None
    return HeadParallel(mesh, rules)


@dataclasses.dataclass(frozen=True)
class HeadParallel:
    """The KDA ops and MLA's attention with their heads split over ``mesh`` by ``rules`` (see the
    module docstring)."""

    mesh: Mesh
    rules: AxisRules

    def _spec(self, logical: Sequence[str | None], array) -> PartitionSpec:
        return partition_spec(logical, array.shape, self.rules, self.mesh)

    def _run(self, op: Callable, arrays: list, logical: list, out_logical: tuple, **options):
        """``op(*arrays, **options)`` per device, ``arrays[i]`` laid out by its logical axes
        ``logical[i]`` and the results by ``out_logical``; an array that is None passes as None."""
        given = [i for i, array in enumerate(arrays) if array is not None]

        def local(*values):
            full = list(arrays)
            for i, value in zip(given, values):
                full[i] = value
            return op(*full, **options)
        results = jax.eval_shape(lambda *values: local(*values), *(arrays[i] for i in given))
        return jax.shard_map(local, mesh=self.mesh, in_specs=tuple(self._spec(logical[i], arrays[i]) for i in given),
                             out_specs=tuple(self._spec(names, result) for names, result in zip(out_logical, results)),
                             check_vma=False)(*(arrays[i] for i in given))

    def kda(self, q, k, v, g, beta, *, initial_state=None, segment_ids=None, **options):
        """`k3jax.ops.kda.kda` on each device's heads: ``(o [B, T, HV, V], state [B, HV, K, V])``."""
        def op(q, k, v, g, beta, state, segments):
            return kda(q, k, v, g, beta, initial_state=state, segment_ids=segments, **options)
        return self._run(op, [q, k, v, g, beta, initial_state, segment_ids],
                         [SEQUENCE] * 4 + [SEQUENCE_GATE, STATE, SEGMENTS], (SEQUENCE, STATE))

    def kda_step(self, q, k, v, g, beta, state, **options):
        """`k3jax.ops.kda.kda_step`: ``(o [B, HV, V], state)``."""
        return self._run(kda_step, [q, k, v, g, beta, state], [TOKEN] * 4 + [TOKEN_GATE, STATE], (TOKEN, STATE),
                         **options)

    def kda_steps(self, q, k, v, g, beta, state, **options):
        """`k3jax.ops.kda.kda_steps`: ``(o [B, T, HV, V], states [B, T, HV, K, V])``."""
        return self._run(kda_steps, [q, k, v, g, beta, state], [SEQUENCE] * 4 + [SEQUENCE_GATE, STATE],
                         (SEQUENCE, STATES), **options)

    def kda_pool_step(self, pool, slots, q, k, v, g, beta, **options):
        """`k3jax.ops.kda.decode_pool.kda_pool_step`: ``(o [B, HV, V], pool [S, HV, K, V])``, each
        device updating its block of the pool's rows."""
        return self._run(kda_pool_step, [pool, slots, q, k, v, g, beta],
                         [POOL, ROWS] + [POOL_TOKEN] * 4 + [POOL_TOKEN_GATE], (POOL_TOKEN, POOL), **options)

    def conv_pool_step(self, pool, slots, x, weight, **options):
        """`k3jax.ops.kda.decode_pool.conv_pool_step` over each device's block of channels:
        ``(y [B, C], pool [S, W-1, C])``."""
        return self._run(conv_pool_step, [pool, slots, x, weight], [CONV_POOL, ROWS, POOL_TOKEN_GATE, CONV_WEIGHT],
                         (POOL_TOKEN_GATE, CONV_POOL), **options)

    def attention(self, q, k, v, *, query_segments=None, key_segments=None, **options):
        """`k3jax.ops.attention.attention`'s causal self-attention on each device's rows and heads:
        ``[B, T, H, Dv]``; keys and values of one shared head (G = 1) stay whole on every device."""
        key_axes = SEQUENCE if k.shape[2] == q.shape[2] else ("batch", None, None, None)

        def op(q, k, v, query_segments, key_segments):
            return (attention(q, k, v, query_segments=query_segments, key_segments=key_segments, **options),)
        return self._run(op, [q, k, v, query_segments, key_segments],
                         [SEQUENCE, key_axes, key_axes, SEGMENTS, SEGMENTS], (SEQUENCE,))[0]
