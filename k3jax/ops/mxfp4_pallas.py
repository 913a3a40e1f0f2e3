"""Pallas grouped matmul over MXFP4 experts, decoding the codes inside the kernel (`k3jax.ops.mxfp4`).

Rows sorted by expert are laid out so that every block of ``block_rows`` rows belongs to one
expert (each group padded to a multiple of ``block_rows`` with zero rows); the expert of each row
block is a scalar-prefetch operand that picks the codes block the kernel reads. Inputs 2i and
2i+1 meet the low and high nibbles of code byte i, so x is split into its even and odd columns
outside the kernel and nothing is interleaved inside it:

    forward   (grid: row blocks x output blocks of W_j^T [out, in])
        y = x_even (e2m1(lo) * s)^T + x_odd (e2m1(hi) * s)^T        s = 2^(scale - 127), per 32 inputs
    transposed (``contract_output``, the backward pass; grid: row blocks x output blocks, the
               second a reduction into fp32 VMEM accumulators)
        dx_even = sum_j dy_j (e2m1(lo_j) * s_j),  dx_odd = sum_j dy_j (e2m1(hi_j) * s_j)

Every block keeps whole rows of codes and scales (a scale block of in/32 columns), because
Mosaic needs a block's last dimension to be a multiple of 128 or the array's own.

The products accumulate in fp32 (``preferred_element_type``) and are returned in x's dtype. The
grid spec is TPU's (scalar prefetch): compiled on TPU, interpreted elsewhere
(``pltpu.InterpretParams``: the CPU tests; a GPU, slowly). `grouped_matmul` uses it with
``implementation="pallas"``; both kernels compile for v5e, v5p, v6e and TPU7x at K3's shapes
(`bench.tpu_compile`, compile-only devices) but have not been timed on a TPU, so "auto" does not
pick them yet.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from k3jax.ops.mxfp4_format import BLOCK, e2m1_values, e8m0_values

CODES_PER_SCALE = BLOCK // 2     # code bytes under one E8M0 scale


def _decoded_halves(codes: jax.Array, scales: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """codes [rows, n] uint8, scales [rows, n/16] -> (low-nibble values, high-nibble values) [rows, n]
    in ``dtype``, each times its block's scale. The bytes are widened to 32 bits before their nibbles
    are split (Mosaic has no 8-bit vector shifts)."""
    factor = jnp.repeat(e8m0_values(scales), CODES_PER_SCALE, axis=1)
    codes = codes.astype(jnp.uint32)
    return ((e2m1_values(codes & 0x0F) * factor).astype(dtype), (e2m1_values(codes >> 4) * factor).astype(dtype))


def _forward_kernel(block_expert, x_even, x_odd, codes, scales, y):
    del block_expert
    low, high = _decoded_halves(codes[...], scales[...], x_even.dtype)        # [block_out, in/2]
    contract = (((1,), (1,)), ((), ()))
    acc = jax.lax.dot_general(x_even[...], low, contract, preferred_element_type=jnp.float32)
    acc += jax.lax.dot_general(x_odd[...], high, contract, preferred_element_type=jnp.float32)
    y[...] = acc.astype(y.dtype)


def _transposed_kernel(block_expert, dy, codes, scales, dx_even, dx_odd, even_sum, odd_sum):
    del block_expert
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        even_sum[...] = jnp.zeros_like(even_sum)
        odd_sum[...] = jnp.zeros_like(odd_sum)

    low, high = _decoded_halves(codes[...], scales[...], dy.dtype)            # [block_out, in/2]
    even_sum[...] += jnp.dot(dy[...], low, preferred_element_type=jnp.float32)
    odd_sum[...] += jnp.dot(dy[...], high, preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        dx_even[...] = even_sum[...].astype(dx_even.dtype)
        dx_odd[...] = odd_sum[...].astype(dx_odd.dtype)


def _block(size: int, preferred: int, multiple: int = 1) -> int:
    """The largest divisor of ``size`` that is at most ``preferred`` and a multiple of ``multiple``."""
    return max(b for b in range(multiple, min(size, preferred) + 1, multiple) if size % b == 0)


def _padded_layout(group_sizes: jax.Array, rows: int, block_rows: int):
    """Where each sorted row goes when every group is padded to whole row blocks.

    -> (positions [rows] int32: a row's padded index (rows past the groups: one past the end),
    block_expert [padded / block_rows] int32: each block's expert, padded rows: static count)."""
    experts = group_sizes.shape[0]
    padded_rows = -(-(rows + experts * (block_rows - 1)) // block_rows) * block_rows
    starts = jnp.cumsum(group_sizes) - group_sizes
    padded_sizes = -(-group_sizes // block_rows) * block_rows
    padded_starts = jnp.cumsum(padded_sizes) - padded_sizes
    row = jnp.arange(rows)
    group = jnp.searchsorted(jnp.cumsum(group_sizes), row, side="right")
    inside = group < experts
    group = jnp.minimum(group, experts - 1)
    positions = jnp.where(inside, padded_starts[group] + row - starts[group], padded_rows)
    block_start = jnp.arange(padded_rows // block_rows) * block_rows
    block_expert = jnp.searchsorted(jnp.cumsum(padded_sizes), block_start, side="right")
    return positions.astype(jnp.int32), jnp.minimum(block_expert, experts - 1).astype(jnp.int32), padded_rows


@functools.partial(jax.jit, static_argnames=("contract_output", "interpret", "block_rows"))
def pallas_grouped_matmul(x: jax.Array, codes: jax.Array, scales: jax.Array, group_sizes: jax.Array, *,
                          contract_output: bool = False, interpret: bool = False, block_rows: int = 8) -> jax.Array:
    """The module doc's kernels: x [M, in] -> [M, out] (``contract_output``: x [M, out] -> [M, in]),
    rows grouped by ``group_sizes`` [E] over codes [E, out, in/2] / scales [E, out, in/32]."""
    rows = x.shape[0]
    experts, out, half = codes.shape
    positions, block_expert, padded_rows = _padded_layout(group_sizes, rows, block_rows)
    padded = jnp.zeros((padded_rows, x.shape[1]), x.dtype).at[positions].set(x, mode="drop")
    row_blocks = padded_rows // block_rows
    params = dict(interpret=pltpu.InterpretParams() if interpret else False)
    if not contract_output:
        block_out = _block(out, 128)
        spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(row_blocks, out // block_out),
            in_specs=[pl.BlockSpec((block_rows, half), lambda i, j, e: (i, 0)),
                      pl.BlockSpec((block_rows, half), lambda i, j, e: (i, 0)),
                      pl.BlockSpec((None, block_out, half), lambda i, j, e: (e[i], j, 0)),
                      pl.BlockSpec((None, block_out, half // CODES_PER_SCALE), lambda i, j, e: (e[i], j, 0))],
            out_specs=pl.BlockSpec((block_rows, block_out), lambda i, j, e: (i, j)))
        y = pl.pallas_call(_forward_kernel, grid_spec=spec, out_shape=jax.ShapeDtypeStruct((padded_rows, out), x.dtype),
                           **params)(block_expert, padded[:, 0::2], padded[:, 1::2], codes, scales)
    else:
        block_out = _block(out, 128)
        spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(row_blocks, out // block_out),
            in_specs=[pl.BlockSpec((block_rows, block_out), lambda i, j, e: (i, j)),
                      pl.BlockSpec((None, block_out, half), lambda i, j, e: (e[i], j, 0)),
                      pl.BlockSpec((None, block_out, half // CODES_PER_SCALE), lambda i, j, e: (e[i], j, 0))],
            out_specs=[pl.BlockSpec((block_rows, half), lambda i, j, e: (i, 0))] * 2,
            scratch_shapes=[pltpu.VMEM((block_rows, half), jnp.float32)] * 2)
        halves = jax.ShapeDtypeStruct((padded_rows, half), x.dtype)
        even, odd = pl.pallas_call(
            _transposed_kernel, grid_spec=spec, out_shape=[halves, halves],
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
            **params)(block_expert, padded, codes, scales)
        y = jnp.stack([even, odd], axis=-1).reshape(padded_rows, 2 * half)
    return jnp.take(y, positions, axis=0, mode="fill", fill_value=0)
