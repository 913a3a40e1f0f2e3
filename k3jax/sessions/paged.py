"""Device pools of session memory and the jitted programs that run the model over them.

    Pools
      state   [N_slots, N_kda, HV, K, V]   fp32   one KDA state per slot (a session or snapshot on device)
      conv    [N_slots, N_kda, W-1, C]            its conv tails
      latent  [N_mla, N_pages, page * L]  the paged MLA latent cache, L = kv_lora + r: each page
                                          one row holding its tokens' latents one after another

A sequence b on device is (slot[b], page table[b] [P], length[b]); token position t lives at
page table[b][t // page], row t % page. The batched decode step runs the model over the pools
themselves (`pooled_bank`: the KDA pools reshaped to rows, row slot * N_kda + layer, and the MLA
layer's pages indexed as (layer, page), so every layer's kernels read and write only the rows and
pages of the batch, in place in the donated pools, with the kernels of the model's ``kda.implementation``).
Calls of several tokens (a prefill piece, `feed_rows`) gather the slots' KDA states and conv tails
into a contiguous `KDAMemory` (the chunked KDA forms need one) and hand the model the MLA pools as
they are (`paged_bank`); the states and tails are scattered back after. MLA attention, in both,
writes the call's latent rows into their pages and reads each sequence's pages a key block at a
time where they lie (`k3jax.ops.attention.paged_attention`): no program holds a session's whole
cache. Padding rows of a batch use page N_pages (reads are zeros, writes are dropped) and a free
slot of their own (its contents are garbage until the slot is next allocated, which overwrites
it). Rows past a sequence's length are masked by the causal mask, so the paged result is the
contiguous one. The private baseline of `decode_step` (``gathered``) and `read_value` still gather
whole sequences into the contiguous bank of `k3jax.memory` (capacity P * page).

Compiles are reused through fixed buckets: batch sizes and page counts are powers of two and
prefill pieces are powers of two up to the KDA chunk size (`piece_lengths`).

A page is one row of the latent pool, not a [page, L] block, because TPUs lay out an array whose
last dimension is not a multiple of 128 (K3's and Kimi Linear's L = 576) with another dimension
minor-most -- [..., page, 576] with its pages minor-most -- and a gather of whole pages then
copies the entire pool into row-major order and back on every decode step (seen in the compiled
decode step for v5e, v5p and v6e: two copies of the pool among its temporaries). [..., page * 576]
is row-major there, as on CPU and GPU, so pages are read and rows written where they lie.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.lora import set_adapter_rows
from k3jax.sampling import Adjustment, adjusted_logits, sample_logits
from k3jax.memory import KDAMemory, KDAPool, KDAPositions, Memory, MLAMemory, MLAPages, page_rows, set_latent_rows


class StaticGraph:
    """A model's graphdef as the static argument of the jitted programs below, hashed once: JAX
    hashes static arguments on every call, and flax's GraphDef hashes its whole structure each time
    (0.26 ms for `configs/tiny.yaml`, a sixth of a CPU decode step)."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef):
        self.graphdef, self._hash = graphdef, hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, StaticGraph) and (other.graphdef is self.graphdef or other.graphdef == self.graphdef)

    def merge(self, params):
        """The model of this graph with ``params`` (`nnx.merge`)."""
        return nnx.merge(self.graphdef, params)


def host_readable(model, x: jax.Array) -> jax.Array:
    """``x`` (inside a program) made whole on every device of ``model``'s mesh, so that every
    process can read it back (a multi-process mesh); unchanged for a model on one device."""
    mesh = getattr(getattr(model, "activation_layout", None), "mesh", None)
    if mesh is None or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


class Pools(NamedTuple):
    state: jax.Array
    conv: jax.Array
    latent: jax.Array


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def piece_lengths(start: int, stop: int, chunk: int) -> list[int]:
    """Split tokens [start, stop) into prefill pieces that never cross a multiple of ``chunk``,
    each a power of two (largest first): the same positions always get the same pieces."""
    pieces, position = [], start
    while position < stop:
        boundary = min(stop, (position // chunk + 1) * chunk)
        size = 1 << ((boundary - position).bit_length() - 1)
        pieces.append(size)
        position += size
    return pieces


def turn_stop(position: int, stop: int, turn_tokens: int, chunk: int) -> int:
    """Where a prefill of [position, stop) that feeds about ``turn_tokens`` per turn ends this turn:
    ``stop``, or an earlier multiple of ``chunk`` (at least one past ``position``), so that turns cut
    only where `piece_lengths` cuts anyway -- a prefill in turns runs the same pieces as one in a go."""
    end = max((position + turn_tokens) // chunk, position // chunk + 1) * chunk
    return min(end, stop)


# Logical axes of the pools' dimensions (`k3jax.layers.params` names): on a mesh the KDA states
# split over the value heads as the model's KDA weights do, and the conv tails' channels (q, k
# and v of every head) as the projections that write them; the MLA latent (one compressed row per
# token, shared by every head) is replicated. These are the layouts the decode step's outputs take,
# so the pools keep one layout (and the programs one compilation) from step to step.
POOL_AXES = Pools(state=(None, None, "value_heads", "head_dim", "head_dim"), conv=(None, None, None, "heads"),
                  latent=(None, None, None))


def pool_shardings(model, pools: Pools) -> Pools | None:
    """The shardings of ``pools`` for a model `k3jax.sharding.parallelize`d on a mesh (the mesh and
    rules of its ``activation_layout``; `POOL_AXES`); None for a model on one device."""
    from k3jax.sharding.mesh import partition_spec   # the sharding package imports the model
    layout = getattr(model, "activation_layout", None)
    mesh = getattr(layout, "mesh", None)
    if mesh is None or mesh.size == 1:
        return None
    return Pools(*(jax.sharding.NamedSharding(mesh, partition_spec(axes, array.shape, layout.rules, mesh))
                   for axes, array in zip(POOL_AXES, pools)))


def empty_pools(config, slots: int, pages: int, page_size: int) -> Pools:
    """Zero pools for ``slots`` KDA slots and ``pages`` MLA pages (shapes only: ``jax.ShapeDtypeStruct``s
    through `placed`)."""
    kda, mla = config.kda, config.mla
    num_mla = len(config.mla_layer_indices)
    num_kda = config.num_layers - num_mla
    dtype = jnp.dtype(config.compute_dtype)
    return Pools(
        state=jax.ShapeDtypeStruct((slots, num_kda, kda.num_value_heads, kda.head_dim, kda.head_dim), jnp.float32),
        conv=jax.ShapeDtypeStruct((slots, num_kda, kda.conv_size - 1, kda.conv_width), dtype),
        latent=jax.ShapeDtypeStruct((num_mla, pages, page_size * mla.latent_width), dtype),
    )


def placed(shapes: Pools, shardings: Pools | None) -> Pools:
    """Zero pools of these shapes, created where ``shardings`` put them (None: the default device)."""
    def zeros():
        return Pools(*(jnp.zeros(shape.shape, shape.dtype) for shape in shapes))
    return jax.jit(zeros, out_shardings=shardings)()


def grown(pools: Pools, slots: int, pages: int, shardings: Pools | None = None) -> Pools:
    """``pools`` with capacity raised to ``slots`` and ``pages`` (contents kept, new entries zero),
    laid out by ``shardings`` (None: where XLA puts them)."""
    def pad(array, axis, size):
        widths = [(0, 0)] * array.ndim
        widths[axis] = (0, size - array.shape[axis])
        return jnp.pad(array, widths)

    def grow(pools):
        return Pools(pad(pools.state, 0, slots), pad(pools.conv, 0, slots), pad(pools.latent, 1, pages))
    return jax.jit(grow, out_shardings=shardings)(pools)


def gather_bank(pools: Pools, slots: jax.Array, tables: jax.Array, lengths: jax.Array, width: int) -> Memory:
    """The contiguous bank of B sequences: slots ``[B]``, page tables ``[B, P]``, lengths ``[B]``;
    ``width``: L, a token's latent."""
    latent = page_rows(pools.latent.at[:, tables].get(mode="fill", fill_value=0), width)    # [N_mla, B, P * page, L]
    num_mla, batch = latent.shape[:2]
    lengths = jnp.broadcast_to(lengths, (num_mla, batch))
    return Memory(kda=slot_states(pools, slots), mla=MLAMemory(latent, lengths, jnp.zeros_like(lengths)))


def slot_states(pools: Pools, slots: jax.Array) -> KDAMemory:
    """The KDA states and conv tails of slots ``[B]`` as a contiguous bank ``[N_kda, B, ...]``
    (slots past the pool read as zeros)."""
    state = pools.state.at[slots].get(mode="fill", fill_value=0)
    conv = pools.conv.at[slots].get(mode="fill", fill_value=0)
    return KDAMemory(jnp.swapaxes(state, 0, 1), jnp.swapaxes(conv, 0, 1))


def paged_bank(pools: Pools, slots: jax.Array, tables: jax.Array, lengths: jax.Array) -> Memory:
    """The bank of B sequences for a call of several tokens: their KDA states and conv tails
    gathered into a contiguous `KDAMemory` (a few MiB a sequence), the MLA latent pools as they
    are with each layer's tables ``[B, P]`` (`MLAPages`: attention reads the pages where they
    lie and writes the call's rows into them; no sequence's cache is gathered whole)."""
    return Memory(kda=slot_states(pools, slots), mla=pooled_bank(pools, slots, tables, lengths).mla)


def scatter_paged(pools: Pools, slots, bank: Memory) -> Pools:
    """Write back the KDA states and conv tails of a `paged_bank` the model returned; its latent
    pools already hold the call's rows."""
    return set_slots(pools._replace(latent=bank.mla.latent), slots, jnp.swapaxes(bank.kda.state, 0, 1),
                     jnp.swapaxes(bank.kda.conv, 0, 1))


def scatter_bank(pools: Pools, slots, tables, lengths, bank: Memory, new_tokens: int) -> Pools:
    """Write back the KDA states and conv tails of ``bank`` and its latent rows at positions
    [length, length + new_tokens) into the pages of each table (padding rows are dropped)."""
    num_mla, width = pools.latent.shape[0], bank.mla.latent.shape[-1]
    page_size = pools.latent.shape[2] // width
    positions = lengths[:, None] + jnp.arange(new_tokens)                      # [B, T]
    pages = jnp.take_along_axis(tables, positions // page_size, axis=1, mode="fill", fill_value=pools.latent.shape[1])
    rows = jnp.take_along_axis(bank.mla.latent, positions[None, :, :, None], axis=2)   # [N_mla, B, T, L]
    layers = jnp.arange(num_mla)[:, None, None]
    latent = set_latent_rows(pools.latent, layers, pages, positions % page_size, rows)
    return set_slots(pools._replace(latent=latent), slots, jnp.swapaxes(bank.kda.state, 0, 1),
                     jnp.swapaxes(bank.kda.conv, 0, 1))


def model_for(graph: StaticGraph, params, adapters, shape) -> nnx.Module:
    """The model of ``graph`` with ``params``, its adapter banks (if any) serving the tokens of a
    call of ``shape`` [B, T] from slots ``adapters [B]`` (`k3jax.layers.lora.set_adapter_rows`;
    None: a model without banks)."""
    model = graph.merge(params)
    if adapters is not None:
        set_adapter_rows(model, jnp.broadcast_to(adapters[:, None], shape))
    return model


@functools.partial(jax.jit, static_argnames=("graph",), donate_argnames=("pools",))
def prefill_piece(graph: StaticGraph, params, pools: Pools, slot, table, length, tokens, adapter=None):
    """One sequence continues by ``tokens [T]`` (served by adapter slot ``adapter``, None: the
    model has no adapter bank): -> (logits [T, vocab] fp32, pools)."""
    slots, tables, lengths = slot[None], table[None], length[None]
    model = model_for(graph, params, None if adapter is None else adapter[None], (1, tokens.shape[0]))
    out = model(tokens[None], memory=paged_bank(pools, slots, tables, lengths))
    return host_readable(model, out.logits[0]), scatter_paged(pools, slots, out.memory)


@functools.partial(jax.jit, static_argnames=("graph", "every_position"), donate_argnames=("pools",))
def feed_rows(graph: StaticGraph, params, pools: Pools, slots, tables, lengths, tokens, restore=None, every_position=False,
              adapters=None):
    """B sequences continue by ``tokens [B, T]`` each (served by adapter slots ``adapters [B]``, as
    `model_for`), in one call (a speculative round's verify and replay, `k3jax.sessions.speculate`) -> (logits [B, T, vocab] fp32, pools, saved KDA states
    and conv tails ``(state, conv)``): the slots' from before the call ``[B, ...]``, or with
    ``every_position`` the states and tails after every token ``[B, T, ...]`` (fed token by token,
    `k3jax.memory.KDAPositions`; `keep_positions` then sets each slot to the position it keeps).

    ``restore`` ``(state, conv)`` [B, ...] (such a pair from an earlier call) is written into the
    slots first: the rollback of a verify before the replay of its accepted tokens. The slots end
    holding the state after all T tokens. Padding rows: page tables of page N_pages (nothing read
    or written) and free slots of their own."""
    if restore is not None:
        pools = set_slots(pools, slots, *restore)
    model = model_for(graph, params, adapters, tokens.shape)
    bank = paged_bank(pools, slots, tables, lengths)
    if not every_position:
        out = model(tokens, memory=bank)
        before = (jnp.swapaxes(bank.kda.state, 0, 1), jnp.swapaxes(bank.kda.conv, 0, 1))
        return host_readable(model, out.logits), scatter_paged(pools, slots, out.memory), before
    out = model(tokens, memory=bank._replace(kda=KDAPositions(*bank.kda)))
    after = (jnp.moveaxis(out.memory.kda.state, 0, 2), jnp.moveaxis(out.memory.kda.conv, 0, 2))   # [B, T, N_kda, ...]
    last = KDAMemory(*(jnp.swapaxes(array[:, -1], 0, 1) for array in after))
    return host_readable(model, out.logits), scatter_paged(pools, slots, out.memory._replace(kda=last)), after


def set_slots(pools: Pools, slots, state, conv) -> Pools:
    """Slots ``[B]`` := KDA states ``state [B, N_kda, ...]`` and conv tails ``conv`` (padding slots
    past the pool are dropped)."""
    return pools._replace(state=pools.state.at[slots].set(state, mode="drop"),
                          conv=pools.conv.at[slots].set(conv, mode="drop"))


@functools.partial(jax.jit, donate_argnames=("pools",))
def keep_positions(pools: Pools, slots, saved, positions) -> Pools:
    """Each slot ``slots[b]`` := its KDA state and conv tail after token ``positions[b]`` of the
    ``every_position`` call of `feed_rows` that saved ``saved`` ``[B, T, ...]``: the rollback of
    the tokens after it (its MLA rows past its length are masked, nothing to undo there)."""
    batch = jnp.arange(slots.shape[0])
    return set_slots(pools, slots, saved[0][batch, positions], saved[1][batch, positions])


def pooled_bank(pools: Pools, slots: jax.Array, tables: jax.Array, lengths: jax.Array) -> Memory:
    """The pooled bank (`k3jax.memory`) of B sequences: the KDA pools reshaped to rows (no copy),
    rows ``slot * N_kda + layer`` ``[N_kda, B]``; the MLA latent pools as they are, with each
    layer's tables ``[B, P]`` and its index."""
    num_kda, num_mla = pools.state.shape[1], pools.latent.shape[0]
    rows = slots[None, :] * num_kda + jnp.arange(num_kda, dtype=slots.dtype)[:, None]
    return Memory(
        kda=KDAPool(pools.state.reshape(-1, *pools.state.shape[2:]), pools.conv.reshape(-1, *pools.conv.shape[2:]),
                    rows),
        mla=MLAPages(pools.latent, jnp.broadcast_to(tables, (num_mla, *tables.shape)),
                     jnp.broadcast_to(lengths, (num_mla, slots.shape[0])), jnp.arange(num_mla, dtype=jnp.int32)),
    )


def pools_of(bank: Memory, like: Pools) -> Pools:
    """The `Pools` (shaped as ``like``) behind a pooled bank the model returned."""
    return Pools(bank.kda.state.reshape(like.state.shape), bank.kda.conv.reshape(like.conv.shape), bank.mla.latent)


class RowSampling(NamedTuple):
    """Each row's sampling, arrays ``[B]``: the key of the token a row samples at position p is
    fold_in(fold_in(key(seed), stream), p); temperature 0 is greedy, top_k 0 and top_p 1 are off
    (`k3jax.sampling.sample_logits`)."""

    seed: jax.Array          # uint32
    stream: jax.Array        # uint32
    temperature: jax.Array   # float32
    top_k: jax.Array         # int32
    top_p: jax.Array         # float32


@functools.partial(jax.jit, static_argnames=("graph", "gathered"), donate_argnames=("pools",))
def decode_step(graph: StaticGraph, params, pools: Pools, slots, tables, lengths, logits, sampling: RowSampling,
                gathered: bool = False, adjustment: Adjustment | None = None, adapters=None):
    """Every row samples its next token from ``logits [B, vocab]`` with its own `RowSampling` and
    feeds it (served by adapter slots ``adapters [B]``, as `model_for`): -> (tokens [B], their logits [B, vocab] fp32, pools). Slots must be distinct (padding
    rows: free slots). The model decodes over `pooled_bank` (its KDA kernels are its config's
    ``kda.implementation``). One program for every subset of sessions and sampling settings of a
    batch bucket and page bucket; a second one where rows adjust their logits first (``adjustment``
    `[B, ...]`: penalties, biases, grammars' token masks, min-p; `k3jax.sampling.adjusted_logits`),
    so the plain step does none of that work.

    ``gathered`` is private, a baseline for `bench.sessions` and the tests: gather the contiguous
    bank, decode, scatter back (the same numbers up to rounding, more memory traffic)."""
    def sample_row(row_logits, length, seed, stream, temperature, top_k, top_p, min_p=None):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), length)
        return sample_logits(row_logits[None], key, temperature, top_k, top_p, min_p)[0]
    if adjustment is None:
        tokens = jax.vmap(sample_row)(logits, lengths, *sampling)
    else:
        tokens = jax.vmap(sample_row)(adjusted_logits(logits, adjustment, xp=jnp), lengths, *sampling, adjustment.min_p)
    model = model_for(graph, params, adapters, (logits.shape[0], 1))
    tokens = host_readable(model, tokens)
    if gathered:
        out = model(tokens[:, None], memory=gather_bank(pools, slots, tables, lengths, model.config.mla.latent_width))
        return tokens, host_readable(model, out.logits[:, 0]), scatter_bank(pools, slots, tables, lengths, out.memory, 1)
    out = model(tokens[:, None], memory=pooled_bank(pools, slots, tables, lengths))
    return tokens, host_readable(model, out.logits[:, 0]), pools_of(out.memory, pools)


@functools.partial(jax.jit, donate_argnames=("pools",))
def copy_slot(pools: Pools, source, target) -> Pools:
    """Slot ``target`` := slot ``source`` (a fork or snapshot's KDA state and conv tails)."""
    return pools._replace(state=pools.state.at[target].set(pools.state[source]),
                          conv=pools.conv.at[target].set(pools.conv[source]))


@functools.partial(jax.jit, donate_argnames=("pools",))
def copy_page(pools: Pools, source, target) -> Pools:
    """Page ``target`` := page ``source`` (copy-on-write of a shared partial page)."""
    return pools._replace(latent=pools.latent.at[:, target].set(pools.latent[:, source]))


@functools.partial(jax.jit, donate_argnames=("pools",))
def write_value(pools: Pools, slot, state, conv, table, rows) -> Pools:
    """Upload one sequence: its state, conv tails and latent rows ``[N_mla, P * page, L]`` into
    ``slot`` and the pages of ``table [P]`` (entries N_pages are dropped)."""
    pages = rows.reshape(rows.shape[0], table.shape[0], pools.latent.shape[2])      # each page's rows in one
    return Pools(pools.state.at[slot].set(state), pools.conv.at[slot].set(conv),
                 pools.latent.at[:, table].set(pages, mode="drop"))


@functools.partial(jax.jit, static_argnames=("width",))
def read_value(pools: Pools, slot, table, width: int):
    """-> (state, conv tails, latent rows ``[N_mla, P * page, L]``, L = ``width``) of one sequence on device."""
    bank = gather_bank(pools, slot[None], table[None], jnp.zeros((1,), jnp.int32), width)
    return bank.kda.state[:, 0], bank.kda.conv[:, 0], bank.mla.latent[:, 0]


@jax.jit
def read_slot(pools: Pools, slot):
    """-> (state, conv tails) of one slot."""
    return pools.state[slot], pools.conv[slot]
