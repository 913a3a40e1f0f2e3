"""How the KDA block math (`blocks`) runs on each backend: the one place for backend workarounds.

The block math is written once, on arrays whose last two axes are a matrix (``[..., m, n]``; the
Pallas kernels pass 2-D tiles, the XLA chunk form batches ``[B, G, HV]`` blocks in front). Every
product goes through a `Dots`, which says at what precision it runs and how a backend prefers it:

    mm(a, b)    = a b          mm_nt(a, b) = a b^T          mm_tn(a, b) = a^T b
    vector_t(x) = x^T  for a row [..., 1, d] or a column [..., d, 1], as a sum through a
                  diagonal mask (vector transposes do not lower in every Pallas backend; in
                  XLA the masked form measured the same as a plain transpose: 0.974x vs 0.975x)
    sums(M, x)  = M x  for a 0/1 matrix M (gate sums), always full fp32

Choices, each with the measurement that justifies it (forward+backward of the chunk form at
(B, T, HV, K, V) = (1, 4096, 4, 128, 128), chunk 64, 7 interleaved rounds in one process on the
shared 2-core machine; median per-round ratio of process CPU time against main's chunk.py, the
default choices giving 0.975x):

  * ``transposed_operands`` (XLA): a^T b is taken as a plain product of a transposed copy of a
    held behind an optimization barrier (`k3jax.ops.products.held_transpose`), because XLA:CPU
    runs a dot whose lhs is contracted over its rows through a slower library path (without
    it: 0.872x).
  * ``factored_diagonal`` (XLA): a diagonal 16 x 16 score block whose tokens decay by at most
    `FACTORED_DECAY_LIMIT` is one product of exp(Gamma)-scaled rows and exp(-Gamma)-scaled
    columns (branch taken per chunk by `lax.cond`); the Pallas kernels always use the exact
    pairwise form (no data-dependent branch inside a kernel, whose lowering we cannot run here).
    In XLA the exact form everywhere measured 0.779x.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from k3jax.ops.products import held_transpose

EXACT = jax.lax.Precision.HIGHEST
FACTORED_DECAY_LIMIT = 80.0  # exp(80) ~ 5.5e34: products of such factors stay finite in fp32


def _contract(a, b, a_axis: int, b_axis: int, precision):
    """Contract axis ``a_axis`` of ``a [..., m, n]`` with ``b_axis`` of ``b [..., p, q]`` (-2 or -1),
    batching over the leading axes (broadcast when one side has none)."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = jnp.broadcast_to(a, batch + a.shape[-2:])
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    lead = tuple(range(len(batch)))
    dims = (((len(batch) + 2 + a_axis,), (len(batch) + 2 + b_axis,)), (lead, lead))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=a.dtype)


@dataclasses.dataclass(frozen=True)
class Dots:
    """The products of the block math on one backend (see the module docstring)."""

    precision: Any = EXACT
    transposed_operands: bool = False
    factored_diagonal: bool = False

    def mm(self, a, b):
        return _contract(a, b, -1, -2, self.precision)

    def mm_nt(self, a, b):
        return _contract(a, b, -1, -1, self.precision)

    def mm_tn(self, a, b):
        if self.transposed_operands:
            return self.mm(held_transpose(a), b)
        return _contract(a, b, -2, -2, self.precision)

    @staticmethod
    def vector_t(x):
        """``[..., 1, d]`` <-> ``[..., d, 1]`` as a sum through a diagonal mask."""
        row = x.shape[-2] == 1
        size = x.shape[-1] if row else x.shape[-2]
        index = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
        eye = index == jnp.swapaxes(index, 0, 1)
        return jnp.sum(jnp.where(eye, x, 0.0), axis=-1 if row else -2, keepdims=True)

    @staticmethod
    def sums(matrix, x):
        """``matrix @ x`` for a 0/1 ``matrix [m, j]``: exact fp32 sums of ``x [..., j, k]``."""
        return _contract(matrix, x, -1, -2, EXACT)


XLA_DOTS = Dots(transposed_operands=True, factored_diagonal=True)


def pallas_dots(precision) -> Dots:
    """The Pallas kernels' products at ``precision`` (TF32x3 on a GPU, full fp32 elsewhere)."""
    return Dots(precision=precision)
