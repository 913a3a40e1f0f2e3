"""Expert parallelism for (Latent)MoE: experts split over mesh axes, token rows shipped to them.

`k3jax.sharding.parallelize` stores an `ExpertDispatch` on each MoE layer; its call, one
`jax.shard_map` region, replaces the layer's routed-expert computation. On entry each
device holds n of the N token rows -- for LatentMoE already down-projected to the latent width
l on the token's home device (W_down runs before the region, RMSNorm and W_up after it), so
every collective carries l-dim rows: d/l fewer bytes than plain MoE (l = d) -- and E/ep of the
E experts, ep the size of the expert axes. Assignment a = t*k + i sends row t to expert e_ti.

capacity (``all_to_all``; every platform):
    C          = max(1, ceil(capacity_factor * n k / E))   rows per (expert, source device)
    position_a = #{a' < a : e_a' = e_a}                    rank of a among its expert's assignments
    kept_a     = position_a < C                            the others are dropped (output 0)
    send[e_a * C + position_a] = z_t                       [E C, l] = [ep, E/ep C, l]
    recv       = all_to_all(send)                          [ep sources, E/ep, C, l]
    out        = each local expert's GLU on its ep C rows  (equal groups: batched GEMMs)
    back       = all_to_all(out)                           [E C, l] in send's slots
    u_t        = sum_i p_ti back[e_ti C + position_ti] kept_ti
ragged (``ragged_all_to_all``; dropless; GPU/TPU -- XLA:CPU has no ragged all-to-all):
    rows sorted by expert; device j receives every row bound for its experts into a buffer of
    ep n k rows (the worst case), regroups them by local expert, computes (grouped GEMMs with
    ``ragged_dot``), and returns them to the slots they came from; then the usual unsort and
    weighted sum.

Expert weights enter as [E/ep, l, m/tp] (dense, or MXFP4 codes and scales in the transposed release
layout, decoded a tile of local experts at a time), the hidden width m split over the ``hidden`` axes (tp
devices); each device computes its slice of every expert's hidden units and the partial outputs
are summed (psum over ``hidden``). Weights sharded over other axes (FSDP) are gathered by GSPMD
at the region's boundary, and their gradients reduced on the way out.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from k3jax.config import MeshConfig
from k3jax.ops.moe import (GLUActivation, combine_assignments, equal_groups_glu, expert_glu, sort_by_expert,
                           unsort_and_combine)
from k3jax.ops.mxfp4 import Mxfp4Experts
from k3jax.ops.mxfp4_format import BLOCK
from k3jax.sharding.mesh import AnyMesh, axes_size

DISPATCHES = ("capacity", "ragged")


class ExpertPlacement(NamedTuple):
    """Where an MoE layer's experts and tokens live (built by `expert_placement`).

    mesh:     the device mesh (a concrete one to run; an abstract one to reason about)
    tokens:   mesh axes splitting the token rows (they include ``experts``)
    experts:  mesh axes splitting the expert dimension (ep devices)
    hidden:   mesh axes splitting each expert's hidden width (tp devices; disjoint from the others)
    dispatch: "capacity" or "ragged"
    capacity_factor: C = ceil(capacity_factor * n k / E) for the capacity dispatch
    """

    mesh: AnyMesh
    tokens: tuple[str, ...]
    experts: tuple[str, ...]
    hidden: tuple[str, ...]
    dispatch: str
    capacity_factor: float

    def size(self, axes: tuple[str, ...]) -> int:
        return axes_size(self.mesh, axes)


def expert_placement(mesh: AnyMesh, config: MeshConfig, num_tokens: int, expert_width: int,
                     hidden_block: int = 1) -> ExpertPlacement:
    """How an MoE layer with ``num_tokens`` token rows and experts of hidden width ``expert_width``
    reaches experts split over the rules' "experts" axes of ``mesh`` with ``config``'s dispatch.

    Token rows split over the expert axes (each device ships its own rows) and those of the
    rules' batch and sequence axes that still divide them, in the rules' order (the layout of the
    flattened ``[B, T]`` rows); the hidden width over the rules' expert_mlp axes that divide it into
    whole ``hidden_block``s (MXFP4 experts: 32, W_down's scale blocks run along it) and split neither
    tokens nor experts.
    """
    rules = config.rules
    experts = tuple(axis for axis in rules.experts if mesh.shape[axis] > 1)
    if num_tokens % axes_size(mesh, experts):
        raise ValueError(f"{num_tokens} token rows do not split over the expert axes {experts} "
                         f"({axes_size(mesh, experts)} devices); expert parallelism needs them to")
    chosen = set(experts)
    row_axes = (*rules.batch, *rules.sequence)
    for axis in row_axes:
        if (axis not in chosen and mesh.shape[axis] > 1
                and num_tokens % (axes_size(mesh, chosen) * mesh.shape[axis]) == 0):
            chosen.add(axis)
    tokens = tuple(axis for axis in dict.fromkeys((*row_axes, *experts)) if axis in chosen)
    hidden: list[str] = []
    for axis in rules.expert_mlp:
        if (axis not in tokens and axis not in experts and mesh.shape[axis] > 1
                and expert_width % (hidden_block * axes_size(mesh, hidden) * mesh.shape[axis]) == 0):
            hidden.append(axis)
    return ExpertPlacement(mesh, tokens, experts, tuple(hidden), config.moe_dispatch, config.capacity_factor)


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """C = max(1, ceil(capacity_factor * n k / E)): rows each expert takes from one device's n tokens.
    capacity_factor >= E / k makes C >= n, so nothing is ever dropped."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def capacity_slots(indices: jax.Array, num_experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Each assignment's slot in a [E * C] buffer, first come first served in assignment order.

    indices [n, k] -> (slots [n k] int32, kept [n k] bool): slot_a = e_a C + position_a when
    position_a = #{a' < a : e_a' = e_a} < C, else E C (one past the end: dropped).
    """
    flat = indices.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts)
    starts = jnp.cumsum(sizes) - sizes
    ranks = jnp.arange(flat.shape[0]) - starts[flat[order]]
    position = jnp.zeros_like(flat).at[order].set(ranks.astype(flat.dtype), unique_indices=True)
    kept = position < capacity
    return jnp.where(kept, flat * capacity + position, num_experts * capacity).astype(jnp.int32), kept


def _exchange(x: jax.Array, placement: ExpertPlacement) -> jax.Array:
    """``all_to_all`` over the expert axes: block j of x's leading axis goes to peer j; block i of
    the result came from peer i."""
    return jax.lax.all_to_all(x, placement.experts, split_axis=0, concat_axis=0, tiled=True)


def _sum_hidden_slices(out: jax.Array, placement: ExpertPlacement) -> jax.Array:
    """Expert outputs computed from this device's slice of the hidden width, summed over the slices."""
    return jax.lax.psum(out, placement.hidden) if placement.hidden else out


def capacity_experts(x, indices, weights, w_gate, w_up, w_down, *, activation: GLUActivation,
                     capacity: int, placement: ExpertPlacement):
    """One device's part of the capacity dispatch (call inside `jax.shard_map`; see the module doc).

    x [n, l], indices / weights [n, k], W_gate / W_up [E/ep, l, m/tp], W_down [E/ep, m/tp, l] (dense, or
    `Mxfp4Experts` of these shapes: only the local experts are decoded, a tile at a time)
    -> (u [n, l] in x.dtype, assignments dropped on all devices [] fp32).
    """
    num_local, width = w_gate.shape[0], x.shape[-1]
    ep = placement.size(placement.experts)
    num_experts = ep * num_local
    slots, kept = capacity_slots(indices, num_experts, capacity)
    rows = jnp.repeat(x, indices.shape[-1], axis=0)
    send = jnp.zeros((num_experts * capacity, width), x.dtype).at[slots].set(rows, mode="drop")
    recv = _exchange(send.reshape(ep, num_local * capacity, width), placement)
    by_expert = recv.reshape(ep, num_local, capacity, width).swapaxes(0, 1).reshape(num_local, -1, width)
    out = _sum_hidden_slices(equal_groups_glu(by_expert, w_gate, w_up, w_down, activation), placement)
    out = out.reshape(num_local, ep, capacity, width).swapaxes(0, 1).reshape(ep, num_local * capacity, width)
    back = _exchange(out, placement).reshape(num_experts * capacity, width)
    y_assign = jnp.take(back, slots, axis=0, mode="fill", fill_value=0)
    dropped = jax.lax.psum(jnp.sum(~kept).astype(jnp.float32), placement.tokens)
    return combine_assignments(y_assign, weights), dropped


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


def local_expert_grouping(counts_from: jax.Array, buffer_rows: int) -> tuple[jax.Array, jax.Array]:
    """How to regroup a receive buffer by local expert.

    The buffer holds, source by source, each source's rows for local experts 0..L-1 in order:
    counts_from [ep, L] rows; rows past the total are padding. -> (order [buffer_rows]: a stable
    permutation putting rows of local expert 0 first, then 1, ..., padding last;
    group_sizes [L] int32).
    """
    num_local = counts_from.shape[-1]
    ends = jnp.cumsum(counts_from.reshape(-1))
    segment = jnp.searchsorted(ends, jnp.arange(buffer_rows), side="right")
    local_expert = jnp.where(segment < ends.shape[0], segment % num_local, num_local)
    return jnp.argsort(local_expert, stable=True), jnp.sum(counts_from, axis=0).astype(jnp.int32)


def ragged_experts(x, indices, weights, w_gate, w_up, w_down, *, activation: GLUActivation,
                   placement: ExpertPlacement):
    """One device's part of the dropless ragged dispatch (call inside `jax.shard_map`).

    Same contract as `capacity_experts`; nothing is dropped (the count is 0).
    """
    num_local, width = w_gate.shape[0], x.shape[-1]
    ep = placement.size(placement.experts)
    x_sorted, order, group_sizes = sort_by_expert(x, indices, ep * num_local)
    counts_to = group_sizes.reshape(ep, num_local)
    counts_from = _exchange(counts_to, placement)
    send_sizes, recv_sizes = jnp.sum(counts_to, axis=1), jnp.sum(counts_from, axis=1)
    input_offsets, recv_offsets = _exclusive_cumsum(send_sizes), _exclusive_cumsum(recv_sizes)
    # Offsets in the peer's buffer: where my rows land at peer j (j's recv_offsets[me]) and where
    # rows return to at peer i (i's input_offsets[me]).
    output_offsets, return_offsets = _exchange(recv_offsets, placement), _exchange(input_offsets, placement)
    buffer_rows = ep * x_sorted.shape[0]
    recv = jax.lax.ragged_all_to_all(x_sorted, jnp.zeros((buffer_rows, width), x.dtype), input_offsets, send_sizes,
                                     output_offsets, recv_sizes, axis_name=placement.experts)
    local_order, local_sizes = local_expert_grouping(counts_from, buffer_rows)
    out = _sum_hidden_slices(expert_glu(recv[local_order], local_sizes, w_gate, w_up, w_down, activation),
                             placement)
    out = jnp.zeros_like(out).at[local_order].set(out, unique_indices=True)
    back = jax.lax.ragged_all_to_all(out, jnp.zeros_like(x_sorted), recv_offsets, recv_sizes, return_offsets,
                                     send_sizes, axis_name=placement.experts)
    return unsort_and_combine(back, order, weights), jnp.zeros((), jnp.float32)


def _weight_spec(weight, dense_spec: P):
    """The shard_map spec of an expert weight whose dense [E, in, out] form splits as ``dense_spec``;
    `Mxfp4Experts` hold [E, out, in/2] codes and [E, out, in/32] scales: the same split, transposed;
    their adapter's shared A [in, r] splits like the input axis, B [E, r, out] like experts and output."""
    if not isinstance(weight, Mxfp4Experts):
        return dense_spec
    experts, inputs, outputs = dense_spec
    transposed = P(experts, outputs, inputs)
    adapter = {} if weight.adapter_a is None else dict(adapter_a=P(inputs, None), adapter_b=P(experts, None, outputs))
    return dataclasses.replace(weight, codes=transposed, scales=transposed, **adapter)


def expert_parallel_experts(x, indices, weights, w_gate, w_up, w_down, activation: GLUActivation,
                            placement: ExpertPlacement) -> tuple[jax.Array, jax.Array]:
    """``u_t = sum_i p_ti E_{e_ti}(x_t)`` with the experts split over ``placement``'s mesh.

    x [N, l] (latents, or tokens for plain MoE), indices / weights [N, k], W_gate / W_up [E, l, m],
    W_down [E, m, l] (dense, or `Mxfp4Experts`: each device holds and decodes only its own experts'
    codes) -> (u [N, l] in x.dtype, (token, expert) assignments dropped [] fp32).
    """
    if placement.dispatch not in DISPATCHES:
        raise ValueError(f"unknown expert dispatch {placement.dispatch!r}; expected one of {DISPATCHES}")
    rows, experts = P(placement.tokens), placement.experts
    hidden = placement.hidden or None
    if placement.dispatch == "capacity":
        capacity = expert_capacity(x.shape[0] // placement.size(placement.tokens), indices.shape[-1],
                                   w_gate.shape[0], placement.capacity_factor)
        body = functools.partial(capacity_experts, activation=activation, capacity=capacity, placement=placement)
    else:
        body = functools.partial(ragged_experts, activation=activation, placement=placement)
    region = jax.shard_map(
        body, mesh=placement.mesh,
        in_specs=(rows, rows, rows, _weight_spec(w_gate, P(experts, None, hidden)),
                  _weight_spec(w_up, P(experts, None, hidden)), _weight_spec(w_down, P(experts, hidden, None))),
        out_specs=(rows, P()),
    )
    return region(x, indices, weights, w_gate, w_up, w_down)


@dataclasses.dataclass(frozen=True)
class ExpertDispatch:
    """An MoE layer's routed experts run expert-parallel on ``mesh`` as ``config`` says
    (``moe_dispatch``, ``capacity_factor``, ``rules``). `k3jax.sharding.parallelize` stores one on
    each MoE layer (a static attribute: part of the layer's graph definition, so a program traced
    for one dispatch is never reused for another); the layer calls it in place of computing its
    experts locally. The token and hidden-width splits follow each call's shapes
    (`expert_placement`)."""

    mesh: Mesh
    config: MeshConfig

    def __call__(self, x, indices, weights, w_gate, w_up, w_down, activation: GLUActivation):
        """`expert_parallel_experts` of these arrays on the placement their shapes allow. A dropless
        dispatch (`is_dropless`) takes any number of token rows: it pads them with rows of routing
        weight 0 to a multiple of the expert devices (decoding a few sessions), which can displace
        no real row since nothing is dropped, and returns the real rows' outputs."""
        rows, hidden_block = x.shape[0], BLOCK if isinstance(w_gate, Mxfp4Experts) else 1
        ep = axes_size(self.mesh, tuple(axis for axis in self.config.rules.experts if self.mesh.shape[axis] > 1))
        padding = -rows % ep if is_dropless(self.config, w_gate.shape[0], indices.shape[-1]) else 0
        if padding:
            x, indices, weights = (jnp.pad(a, [(0, padding)] + [(0, 0)] * (a.ndim - 1)) for a in (x, indices, weights))
        placement = expert_placement(self.mesh, self.config, rows + padding, w_gate.shape[-1], hidden_block)
        out, dropped = expert_parallel_experts(x, indices, weights, w_gate, w_up, w_down, activation, placement)
        return out[:rows], dropped


def is_dropless(config: MeshConfig, num_experts: int, top_k: int) -> bool:
    """Whether ``config``'s dispatch never drops an assignment: ragged, or capacity with
    capacity_factor >= E / k (then C >= n, `expert_capacity`)."""
    return config.moe_dispatch == "ragged" or config.capacity_factor * top_k >= num_experts


def expert_dispatch(mesh: Mesh, config: MeshConfig) -> ExpertDispatch | None:
    """The dispatch MoE layers use on ``mesh``: None (experts computed where the tokens are) for
    ``moe_dispatch: local``."""
    return None if config.moe_dispatch == "local" else ExpertDispatch(mesh, config)
