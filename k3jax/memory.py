"""The memory bank: everything a K3 model carries from one call to the next, as an explicit pytree.

    Memory
      kda: KDAMemory   one entry per KDA layer, in layer order (leading axis N_kda)
        state   [N_kda, B, HV, K, V]      fp32   the delta-rule state S (constant in context length)
        conv    [N_kda, B, W-1, 2P + HV V]       the last W-1 inputs of the q|k|v short convolution
      mla: MLAMemory   one entry per MLA layer, in layer order (leading axis N_mla)
        latent  [N_mla, B, S, kv_lora + r]       per token: RMSNorm(c) and the shared key slice k_r
        length  [N_mla, B]                int32  tokens written so far (cache slots [0, length) are filled)
        document_start [N_mla, B]         int32  first slot of the current packed document (earlier
                                                 slots are invisible to later tokens)

Packed documents: a call's first segment continues the bank; at a boundary inside a call the
KDA state and conv window restart and MLA hides the slots before it, and the bank then carries
the last document on. The conv tails and latent caches are stored in the config's compute dtype. A layer sees the same
types without the leading layer axis. Training calls pass ``memory=None``; prefill and decode
pass a bank from `init_memory` (or a saved one) and get the updated bank back. A bank whose kda is
a `KDAPositions` returns every position's KDA state and conv tail (short calls: a verify).

Pooled decode (one token per sequence, memory kept in pools shared by many sequences and updated
in place, as `k3jax.sessions` keeps it): the bank is a `Memory` of

      kda: KDAPool     state [N, HV, K, V] fp32, conv [N, W-1, C]: pools of rows shared by every
                       KDA layer; rows [N_kda, B] int32: the row of each (layer, sequence), distinct
                       within a layer (`k3jax.ops.kda.decode_pool`, with the kernels of the
                       config's kda.implementation)
      mla: MLAPages    latent [N_mla, N, page * L]: each MLA layer's pool of N pages, a page
                       one row of its tokens' latents (L = kv_lora + r; `k3jax.sessions.paged`);
                       tables [N_mla, B, P] int32: each sequence's pages in order (entries >= N
                       read as zeros and drop writes); length [N_mla, B] int32: tokens so far;
                       layer [N_mla] int32: the MLA layer's index into the latent pools

Calls of several tokens (the session store's prefill pieces and `feed_rows`) pass a contiguous
KDA bank (`KDAMemory` or `KDAPositions`) beside `MLAPages`. A layer sees its own rows ``[B]`` /
tables ``[B, P]``, length ``[B]`` and layer index with the whole pools; the model threads the
pools through its layers (`split_pools`, `join_pools`). Layers
index the pools where they lie, never through a reshape of them: on TPU a reshape that merges the
layer and page axes is free only in one layout, and the compiler then copies the whole pool into
it and back on every step.

    python -m k3jax.memory configs/k3.yaml [configs/tiny.yaml ...]     # bytes per sequence vs context
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.config import ConfigError, ModelConfig, load_config


class KDAMemory(NamedTuple):
    state: jax.Array
    conv: jax.Array


class KDAPositions(NamedTuple):
    """A contiguous KDA bank (state ``[.., B, HV, K, V]``, conv ``[.., B, W-1, C]``) whose call
    returns the state and conv tail after every token instead of only the last: state
    ``[.., B, T, HV, K, V]``, conv ``[.., B, T, W-1, C]`` (a speculative verify; token by token,
    `k3jax.ops.kda.kda_steps`)."""

    state: jax.Array
    conv: jax.Array


class MLAMemory(NamedTuple):
    latent: jax.Array
    length: jax.Array
    document_start: jax.Array


class Memory(NamedTuple):
    kda: KDAMemory
    mla: MLAMemory


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KDAPool:
    state: jax.Array
    conv: jax.Array
    rows: jax.Array


class MLAPages(NamedTuple):
    latent: jax.Array
    tables: jax.Array
    length: jax.Array
    layer: jax.Array


def page_rows(pages: jax.Array, width: int) -> jax.Array:
    """Gathered pages ``[..., P, page * L]`` -> their tokens' latents in order ``[..., P * page, L]``."""
    return pages.reshape(*pages.shape[:-2], -1, width)


def set_latent_rows(latent: jax.Array, layers, pages, rows_in_page, values: jax.Array) -> jax.Array:
    """``latent`` ``[N_mla, N_pages, page * L]`` with each ``values[...]`` ``[L]`` written at row
    ``rows_in_page[...]`` of page ``pages[...]`` of layer ``layers[...]`` (index arrays broadcast
    against ``values.shape[:-1]``); a page outside the pool drops its row."""
    width = values.shape[-1]
    indices = jnp.stack(jnp.broadcast_arrays(layers, pages, rows_in_page * width), axis=-1)
    numbers = jax.lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0, 1),
                                              scatter_dims_to_operand_dims=(0, 1, 2))
    return jax.lax.scatter(latent, indices.reshape(-1, 3), values.reshape(-1, width).astype(latent.dtype), numbers,
                           mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


class SharedPools(NamedTuple):
    """The arrays of a pooled bank that every layer of a kind reads and writes (None when absent)."""

    kda_state: jax.Array | None = None
    kda_conv: jax.Array | None = None
    mla_latent: jax.Array | None = None


def split_pools(memory):
    """``(memory without its shared pool arrays, SharedPools)`` for a bank or one layer's memory;
    memories without pools come back unchanged with empty pools."""
    if isinstance(memory, Memory):
        kda, kda_pools = split_pools(memory.kda)
        mla, mla_pools = split_pools(memory.mla)
        return Memory(kda, mla), SharedPools(kda_pools.kda_state, kda_pools.kda_conv, mla_pools.mla_latent)
    if isinstance(memory, KDAPool):
        return dataclasses.replace(memory, state=None, conv=None), SharedPools(memory.state, memory.conv, None)
    if isinstance(memory, MLAPages):
        return memory._replace(latent=None), SharedPools(mla_latent=memory.latent)
    return memory, SharedPools()


def join_pools(memory, pools: SharedPools):
    """Inverse of `split_pools`: put the shared pool arrays back into ``memory``."""
    if isinstance(memory, Memory):
        return Memory(join_pools(memory.kda, pools), join_pools(memory.mla, pools))
    if isinstance(memory, KDAPool):
        return dataclasses.replace(memory, state=pools.kda_state, conv=pools.kda_conv)
    if isinstance(memory, MLAPages):
        return memory._replace(latent=pools.mla_latent)
    return memory


def updated_pools(pools: SharedPools, layer_memory) -> SharedPools:
    """``pools`` with the arrays one layer's memory returned (unchanged for memories without pools)."""
    _, new = split_pools(layer_memory)
    return SharedPools(*(old if fresh is None else fresh for old, fresh in zip(pools, new)))


def init_memory(config: ModelConfig, batch_size: int, max_length: int) -> Memory:
    """An empty bank for ``batch_size`` sequences of up to ``max_length`` tokens (zeros)."""
    kda, mla = config.kda, config.mla
    dtype = jnp.dtype(config.compute_dtype)
    num_mla = len(config.mla_layer_indices)
    num_kda = config.num_layers - num_mla
    return Memory(
        kda=KDAMemory(
            state=jnp.zeros((num_kda, batch_size, kda.num_value_heads, kda.head_dim, kda.head_dim), jnp.float32),
            conv=jnp.zeros((num_kda, batch_size, kda.conv_size - 1, kda.conv_width), dtype),
        ),
        mla=MLAMemory(
            latent=jnp.zeros((num_mla, batch_size, max_length, mla.latent_width), dtype),
            length=jnp.zeros((num_mla, batch_size), jnp.int32),
            document_start=jnp.zeros((num_mla, batch_size), jnp.int32),
        ),
    )


def check_memory(config: ModelConfig, memory: Memory, batch_size: int, new_tokens: int) -> None:
    """Raise ValueError unless ``memory`` is a bank of ``config`` (every array's shape and dtype as
    `init_memory` makes them) for ``batch_size`` sequences with room for ``new_tokens`` more tokens
    each (checked when its lengths are concrete, i.e. outside jit)."""
    if not isinstance(memory, Memory):
        raise ValueError(f"memory must be a k3jax.memory.Memory (from init_memory), got {type(memory).__name__}")
    if isinstance(memory.kda, KDAPool) and (not isinstance(memory.mla, MLAPages) or new_tokens != 1):
        raise ValueError("a KDAPool bank decodes one token per call, beside MLAPages; got "
                         f"{type(memory.mla).__name__} and {new_tokens} tokens")
    pages = isinstance(memory.mla, MLAPages)
    capacity = memory.mla.latent.shape[2] if not pages and memory.mla.latent.ndim == 4 else 0
    expected = jax.eval_shape(lambda: init_memory(config, batch_size, capacity))
    if pages:
        _check_pages(config, memory.mla, batch_size)
    else:
        _check_arrays(memory.mla, expected.mla, "mla", batch_size)
    if isinstance(memory.kda, KDAPool):
        _check_kda_pool(config, memory.kda, batch_size)
    else:
        _check_arrays(memory.kda, expected.kda, "kda", batch_size)
    if not pages and memory.mla.length.size and not isinstance(memory.mla.length, jax.core.Tracer):
        used = int(jnp.max(memory.mla.length))
        if used + new_tokens > capacity:
            raise ValueError(f"the memory bank holds {capacity} tokens per sequence; {used} are used and "
                             f"{new_tokens} more do not fit (init_memory's max_length)")


def _check_arrays(part, expected, name: str, batch_size: int) -> None:
    """Raise ValueError unless the arrays of ``part`` have ``expected``'s shapes and dtypes."""
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(part)):
        if (tuple(got.shape), jnp.dtype(got.dtype)) != (want.shape, want.dtype):
            raise ValueError(f"memory.{name}{jax.tree_util.keystr(path)} is {got.dtype}{list(got.shape)}, but this "
                             f"model ({batch_size} sequences) needs {want.dtype}{list(want.shape)}: a bank from "
                             f"another config or batch")


def _check_kda_pool(config: ModelConfig, pool: KDAPool, batch_size: int) -> None:
    """Raise ValueError unless ``pool`` is a `KDAPool` (module docstring) of ``config`` for
    ``batch_size`` sequences."""
    kda = config.kda
    expected = {
        "kda.state": (pool.state, (kda.num_value_heads, kda.head_dim, kda.head_dim), jnp.float32, 1),
        "kda.conv": (pool.conv, (kda.conv_size - 1, kda.conv_width), jnp.dtype(config.compute_dtype), 1),
        "kda.rows": (pool.rows, (config.num_layers - len(config.mla_layer_indices), batch_size), jnp.int32, 0),
    }
    _check_pooled(expected, batch_size)


def _check_pages(config: ModelConfig, pages: MLAPages, batch_size: int) -> None:
    """Raise ValueError unless ``pages`` is an `MLAPages` (module docstring) of ``config`` for
    ``batch_size`` sequences."""
    num_mla, width, dtype = len(config.mla_layer_indices), config.mla.latent_width, jnp.dtype(config.compute_dtype)
    latent = pages.latent
    if latent.ndim != 3 or latent.shape[0] != num_mla or latent.shape[-1] % width or jnp.dtype(latent.dtype) != dtype:
        raise ValueError(f"pooled memory mla.latent is {latent.dtype}{list(latent.shape)}; this model needs {dtype} "
                         f"with shape [{num_mla}, pages, page * {width}]")
    _check_pooled({"mla.tables": (pages.tables, (num_mla, batch_size), jnp.int32, None),
                   "mla.length": (pages.length, (num_mla, batch_size), jnp.int32, 0)}, batch_size)
    if pages.tables.ndim != 3:
        raise ValueError(f"pooled memory mla.tables is {pages.tables.dtype}{list(pages.tables.shape)}; this model "
                         f"({batch_size} sequences) needs int32 with shape [{num_mla}, {batch_size}, pages]")


def _check_pooled(expected: dict, batch_size: int) -> None:
    """``{name: (array, shape, dtype, skip)}``: each array's shape after its first ``skip`` axes
    (None: its first two axes) must be ``shape``, its dtype ``dtype``."""
    for name, (array, shape, want_dtype, skip) in expected.items():
        got = tuple(array.shape)[skip:] if skip is not None else tuple(array.shape)[:2]
        if got != shape or jnp.dtype(array.dtype) != jnp.dtype(want_dtype):
            raise ValueError(f"pooled memory {name} is {array.dtype}{list(array.shape)}; this model "
                             f"({batch_size} sequences) needs {jnp.dtype(want_dtype)} with shape ...{list(shape)}")


def _nbytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def format_bytes(value: float) -> str:
    """``value`` bytes in the largest binary unit that keeps it at least 1, right-aligned (the
    planners' tables: ``train.plan``, ``eval.plan``)."""
    unit = max((u for u in range(5) if value >= 1024**u), default=0)
    return f"{value / 1024**unit:10.3f} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[unit]}"


def memory_bytes(config: ModelConfig, max_length: int) -> dict[str, int]:
    """Bytes of the bank per sequence at context ``max_length``, by part (from shapes only)."""
    shapes = jax.eval_shape(lambda: init_memory(config, 1, max_length))
    return {"kda": _nbytes(shapes.kda), "mla": _nbytes(shapes.mla)}


def memory_report(configs: dict[str, ModelConfig], lengths=(4096, 32768, 131072, 1048576)) -> str:
    """A table of bank bytes per sequence vs context length for each named config."""
    rows = [f"{'config':<22}{'context':>10}{'KDA (MiB)':>14}{'MLA (MiB)':>14}{'total (MiB)':>14}{'KDA share':>11}"]
    for name, config in configs.items():
        for length in lengths:
            parts = memory_bytes(config, length)
            total = parts["kda"] + parts["mla"]
            rows.append(f"{name:<22}{length:>10}{parts['kda'] / 2**20:>14.2f}{parts['mla'] / 2**20:>14.2f}"
                        f"{total / 2**20:>14.2f}{parts['kda'] / total:>11.1%}")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m k3jax.memory CONFIG.yaml [CONFIG.yaml ...]", file=sys.stderr)
        return 2
    try:
        configs = {path.rsplit("/", 1)[-1]: load_config(path).model for path in argv}
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(memory_report(configs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def memory_limit(device=None) -> int:
    """Bytes one device (default: this process's first) can hold: its allocator's limit where it
    reports one (GPU, TPU), else the host's physical memory (CPU)."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() or {}
    return int(stats.get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
