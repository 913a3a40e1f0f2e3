"""MXFP4 routed-expert weights on device, and the grouped matmul that decodes them a tile at a time.

A stack of E expert matrices W_j [in, out] is held as MXFP4 codes and scales (`k3jax.ops.mxfp4_format`:
0.53 bytes per weight, 0.27 of bf16). The codes are frozen: nothing differentiates them.

    grouped_matmul(x, w, group_sizes)      rows of group j (contiguous, groups in order): y_r = x_r W_j

With a LoRA adapter (QLoRA: a shared A [in, r], one B_j [r, out] per expert, scale s = alpha / r)
the frozen codes are never merged with it (that would need the dense weights); the low-rank term
is added beside the decoded product, ``y_r = x_r W_j + s (x_r A) B_j``, its second factor one more
grouped matmul (`lax.ragged_dot`) of rank r. Gradients reach x, A and B; never the codes.

The XLA form never decodes all experts: a loop over tiles of G experts decodes only the tile's
experts (to x's dtype; exact, every MXFP4 value is a bf16 value) and runs `lax.ragged_dot` on the
window of rows starting at the tile's first row (x padded with zero rows so the window always
fits; rows past the tile's groups come out zero and the window is added into y). Its temporary
is O(G * expert size + rows * width) instead of O(E * expert size). Gradients flow to x only,
through a custom VJP that runs the same tiled loop on the transposed decoded tiles,
``dx_r = dy_r W_j^T`` (so the backward pass keeps no decoded weights either); the codes and
scales get none. The Pallas form (`k3jax.ops.mxfp4_pallas`, ``implementation="pallas"``) decodes
inside the kernel; it is written for TPU (scalar prefetch) and runs interpreted elsewhere (tests).
"auto" is the XLA loop everywhere until the kernel has been compiled and timed on a TPU; GPUs use
the XLA loop (a Triton variant of the kernel is not written).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from k3jax.ops.mxfp4_format import decode
from k3jax.ops.mxfp4_pallas import pallas_grouped_matmul

IMPLEMENTATIONS = ("auto", "xla", "pallas")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mxfp4Experts:
    """E expert matrices W_j [in, out] as MXFP4 (the module doc's layout); ``tile``: experts decoded
    at once, ``implementation``: "auto", "xla" or "pallas" (static); optionally a LoRA adapter
    beside them, ``adapter_a`` [in, r] (shared), ``adapter_b`` [E, r, out], scale ``adapter_scale``."""

    codes: jax.Array                      # [E, out, in/2] uint8
    scales: jax.Array                     # [E, out, in/32] uint8
    tile: int = dataclasses.field(default=8, metadata=dict(static=True))
    implementation: str = dataclasses.field(default="auto", metadata=dict(static=True))
    adapter_a: jax.Array | None = None    # [in, r]
    adapter_b: jax.Array | None = None    # [E, r, out]
    adapter_scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int, int]:
        """The dense stack's shape [E, in, out]."""
        experts, out, half = self.codes.shape
        return experts, 2 * half, out

    def decoded(self, dtype=jnp.float32) -> jax.Array:
        """All experts dense, [E, in, out], without the adapter (for tests and export: the layer
        never calls this)."""
        return jnp.swapaxes(decode(self.codes, self.scales, dtype), -1, -2)


def adapter_term(x: jax.Array, weight: Mxfp4Experts, group_sizes: jax.Array) -> jax.Array:
    """The LoRA term of grouped rows, ``s (x_r A) B_j`` for the rows r of group j: x [M, in] ->
    [M, out] in x.dtype (zero rows past the groups)."""
    low_rank = jnp.matmul(x, weight.adapter_a.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    term = jax.lax.ragged_dot(low_rank, weight.adapter_b.astype(x.dtype), group_sizes,
                              preferred_element_type=jnp.float32)
    return (weight.adapter_scale * term).astype(x.dtype)


def tile_size(num_experts: int, tile: int) -> int:
    """The largest divisor of ``num_experts`` that is at most ``tile``."""
    return max(g for g in range(1, min(tile, num_experts) + 1) if num_experts % g == 0)


def _tiled_grouped_matmul(x: jax.Array, codes: jax.Array, scales: jax.Array, group_sizes: jax.Array, tile: int,
                          contract_output: bool) -> jax.Array:
    """The XLA loop of the module doc. x [M, in] -> [M, out] (``contract_output``: x [M, out], the
    decoded tiles transposed, -> [M, in]), in x.dtype."""
    rows = x.shape[0]
    experts, out, half = codes.shape
    group = tile_size(experts, tile)
    result_width = 2 * half if contract_output else out
    padded = jnp.concatenate([x, jnp.zeros_like(x)])
    tile_rows = jnp.sum(group_sizes.reshape(experts // group, group), axis=1)
    tile_starts = jnp.cumsum(tile_rows) - tile_rows

    def one_tile(t, y):
        first = t * group
        w_t = decode(jax.lax.dynamic_slice_in_dim(codes, first, group),
                     jax.lax.dynamic_slice_in_dim(scales, first, group), x.dtype)     # [G, out, in]
        rhs = w_t if contract_output else jnp.swapaxes(w_t, 1, 2)
        window = jax.lax.dynamic_slice_in_dim(padded, tile_starts[t], rows)
        part = jax.lax.ragged_dot(window, rhs, jax.lax.dynamic_slice_in_dim(group_sizes, first, group))
        start = tile_starts[t]
        return jax.lax.dynamic_update_slice_in_dim(y, jax.lax.dynamic_slice_in_dim(y, start, rows) + part, start, 0)

    y = _varying_like(jnp.zeros((2 * rows, result_width), x.dtype), x, codes, scales, group_sizes)
    return jax.lax.fori_loop(0, experts // group, one_tile, y)[:rows]


def _varying_like(value: jax.Array, *arrays: jax.Array) -> jax.Array:
    """``value`` varying over every manual mesh axis any of ``arrays`` varies over (inside
    `jax.shard_map`, so that a loop carry keeps one type; unchanged elsewhere)."""
    varying = lambda a: jax.typeof(a).manual_axis_type.varying  # noqa: E731
    axes = tuple(sorted(set().union(*map(varying, arrays)) - varying(value)))
    return jax.lax.pcast(value, axes, to="varying") if axes else value


def _pallas_compiles() -> bool:
    """The Pallas kernel uses TPU scalar prefetch: compiled on TPU, interpreted elsewhere."""
    return jax.default_backend() == "tpu"


def _grouped_matmul_impl(x, codes, scales, group_sizes, tile, implementation, contract_output):
    """Forward (or, ``contract_output``, the transposed product of the backward pass) by implementation.
    "auto" is the XLA loop on every platform until the Pallas kernel has been compiled and timed on
    a TPU (it has only run interpreted); "pallas" asks for the kernel."""
    if implementation == "pallas":
        return pallas_grouped_matmul(x, codes, scales, group_sizes, contract_output=contract_output,
                                     interpret=not _pallas_compiles())
    return _tiled_grouped_matmul(x, codes, scales, group_sizes, tile, contract_output)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _grouped_matmul(x, codes, scales, group_sizes, tile, implementation):
    return _grouped_matmul_impl(x, codes, scales, group_sizes, tile, implementation, False)


def _grouped_matmul_fwd(x, codes, scales, group_sizes, tile, implementation):
    return _grouped_matmul(x, codes, scales, group_sizes, tile, implementation), (codes, scales, group_sizes)


def _grouped_matmul_bwd(tile, implementation, residuals, dy):
    codes, scales, group_sizes = residuals
    dx = _grouped_matmul_impl(dy, codes, scales, group_sizes, tile, implementation, True)
    return dx, None, None, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def grouped_matmul(x: jax.Array, weight: "Mxfp4Experts | jax.Array", group_sizes: jax.Array) -> jax.Array:
    """``y_r = x_r W_j`` for the rows r of group j: x [M, in] sorted by group, group_sizes [E] int32
    (rows past their sum come out zero), weight a dense [E, in, out] (``lax.ragged_dot``) or
    `Mxfp4Experts` (decoded per tile; gradients w.r.t. x, and with an adapter, ``+ s (x_r A) B_j``
    w.r.t. A and B too). -> [M, out] in x.dtype."""
    if not isinstance(weight, Mxfp4Experts):
        return jax.lax.ragged_dot(x, weight, group_sizes)
    if weight.implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown MXFP4 implementation {weight.implementation!r}; expected one of {IMPLEMENTATIONS}")
    group_sizes = group_sizes.astype(jnp.int32)
    # Inside shard_map: x varies over the weights' axes before the custom VJP (whose backward then
    # psums the partial dx over the axes x was replicated on, e.g. a split hidden width).
    x = _varying_like(x, x, weight.codes, weight.scales, group_sizes)
    y = _grouped_matmul(x, weight.codes, weight.scales, group_sizes, weight.tile, weight.implementation)
    return y if weight.adapter_a is None else y + adapter_term(x, weight, group_sizes)
