"""Reading and writing 16-row tiles of Pallas refs, shared by the TPU (Mosaic) and GPU (Triton)
kernels; the math on the tiles is `blocks`."""
from __future__ import annotations

from k3jax.ops.kda import blocks
from k3jax.ops.kda.blocks import TILE


def load_tiles(ref, count, dtype, columns=slice(None)):
    """``count`` consecutive 16-row tiles of a ``[count * 16, d]`` ref, cast to ``dtype``."""
    return [ref[TILE * t : TILE * (t + 1), columns].astype(dtype) for t in range(count)]


def store_tiles(ref, tiles, columns=slice(None)):
    for t, tile in enumerate(tiles):
        ref[TILE * t : TILE * (t + 1), columns] = tile.astype(ref.dtype)


def load_chunk(q_ref, k_ref, g_ref, beta_ref, count_ref, count_row_ref, *, scale, dtype, dots) -> blocks.Chunk:
    """Read one chunk (refs ``[C, K]``, ``beta [C, 1]``, start counts ``[C, 1]`` and ``[C/16, 16]``)
    and compute its state-independent terms (`blocks.chunk_terms`)."""
    count = q_ref.shape[0] // TILE
    q = [x * scale for x in load_tiles(q_ref, count, dtype)]
    count_rows = [count_row_ref[t : t + 1, :].astype(dtype) for t in range(count)]
    return blocks.chunk_terms(q, load_tiles(k_ref, count, dtype), load_tiles(g_ref, count, dtype),
                              load_tiles(beta_ref, count, dtype), load_tiles(count_ref, count, dtype),
                              count_rows, dots)
