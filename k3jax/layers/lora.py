"""LoRA adapters beside a layer's projection weights (low-rank updates of a frozen base).

A weight W whose first c axes are its input (``x [..., in...]`` contracted with ``W [in..., out...]``,
`k3jax.layers.linear.project`) gets two factors, s = alpha / r:

    y = x W + s * dropout(x) A B          A [in..., r]   kaiming-uniform, bound 1 / sqrt(fan_in)
                                          B [r, out...]  zeros (the adapted model starts as the base)

A takes W's input axes and B its output axes (their logical names, so the sharding rules place
them like W; the rank axis "lora_rank" is replicated). Weights stacked over scanned layers keep
their leading "layers" axis in both factors. Routed experts W [E, in, out] share one A [in, r]
and have one B [E, r, out] per expert; their adapter is merged into the weight they are computed
with, W_e + s A B_e (as is MLA's kv_b_proj, which the cached attention absorbs into the queries),
so dropout does not apply to those two. MXFP4 routed experts (QLoRA) are frozen codes that are never
merged: their adapter's term is computed beside the decoded product instead (`k3jax.ops.mxfp4`),
and a module describes such a weight's dense layout through ``lora_layout(name)``.

Adapters are `Adapter` submodules named ``<weight>_lora`` beside the weight (its path is
unchanged); their factors are `LoRA` variables, not ``nnx.Param``s. `attach_adapters` adds them
to a built model; a layer computes an adaptable weight through `adapted_project` /
`adapted_weight`, which add the adapter's term when there is one. With dropout, each adapter
holds a `LoRADropoutSeed` slot the training forward fills with per-step keys (`dropout_keys`).

Serving several adapters over one base (S-LoRA / Punica batching) uses an `AdapterBank` in the
same place: N adapters of one weight side by side, slot 0 the base (zeros), each token choosing
its slot from the bank's `AdapterRows` slot (`set_adapter_rows`, filled by every serving call):

    y = x W + sum_n [slot(token) = n] s_n (x A_n) B_n

computed as one product of rank N * R (R the largest rank; a smaller adapter is zero-padded,
which adds exact zeros): h = x [A_0 | ... | A_{N-1}] [..., N, R], h *= onehot(slot) s, y += h B,
contracting N and R together, so no [..., N, out] product is ever formed.
"""
from __future__ import annotations

import fnmatch
import math
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.linear import project
from k3jax.layers.params import logical_axes

RANK_AXIS, STACK_AXIS, EXPERT_AXIS, SLOT_AXIS = "lora_rank", "layers", "experts", "lora_slots"
ADAPTER_SUFFIX = "_lora"


class LoRA(nnx.Variable):
    """A trainable LoRA factor (A or B) of an `Adapter`."""


class LoRADropoutSeed(nnx.Variable):
    """The key data (uint32 [..., 2], one key per stacked layer) of an adapter's dropout: a slot that
    every training forward fills with keys of its own (`dropout_keys`); never trained or saved."""


def kaiming_uniform(key: jax.Array, shape, fan_in: int, dtype=jnp.float32) -> jax.Array:
    """U(-b, b) with b = sqrt(6 / ((1 + a^2) fan_in)), a = sqrt(5): b = 1 / sqrt(fan_in)
    (PyTorch's Linear default, the usual LoRA A init)."""
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout: x / (1 - rate) where a Bernoulli(1 - rate) draw keeps it, else 0 (identity
    without a key or at rate 0)."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, scale: float, dtype, contract: int = 1) -> jax.Array:
    """``s (x A) B``: x [..., in...] (the last ``contract`` axes), A [in..., r], B [r, out...] ->
    [..., out...] in ``dtype``."""
    return (scale * project(project(x, a, dtype, contract), b, dtype)).astype(dtype)


def merged_weight(weight: jax.Array, a: jax.Array, b: jax.Array, scale: float, routed: bool = False) -> jax.Array:
    """``W + s A B`` in fp32: W [in..., out...] with A [in..., r], B [r, out...]; ``routed`` experts
    W [E, in, out] with a shared A [in, r] and B [E, r, out] give W_e + s A B_e."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    delta = jnp.einsum("ir,ero->eio", a, b) if routed else jnp.tensordot(a, b, axes=1)
    return weight.astype(jnp.float32) + scale * delta


class Adapter(nnx.Module):
    """The factors ``a`` and ``b`` (`LoRA`) of one weight's adapter, its scale s = alpha / r, its
    dropout rate, (with dropout) its ``seed`` (`LoRADropoutSeed`) and whether it adapts routed
    experts (a shared A). ``dropout_rate`` is static:
    `set_adapter_dropout` turns dropout off for evaluation."""

    def __init__(self, a: jax.Array, b: jax.Array, a_axes, b_axes, scale: float, dropout_rate: float,
                 seed: jax.Array | None, routed: bool = False):
        self.a = LoRA(a, logical_axes=tuple(a_axes))
        self.b = LoRA(b, logical_axes=tuple(b_axes))
        self.scale = scale
        self.routed = routed
        self.dropout_rate = dropout_rate
        self.seed = None if seed is None else LoRADropoutSeed(seed, logical_axes=(*a_axes[:_stacked(a_axes)], None))

    def __call__(self, x: jax.Array, dtype, contract: int = 1) -> jax.Array:
        """``s dropout(x) A B`` in ``dtype``."""
        key = None if self.seed is None or not self.dropout_rate else jax.random.wrap_key_data(self.seed[...])
        return lora_delta(dropout(x, self.dropout_rate, key), self.a[...], self.b[...], self.scale, dtype, contract)


class AdapterScales(nnx.Variable):
    """The scales s_n = alpha_n / r_n of an `AdapterBank`'s slots (0 for a free slot and the base)."""


class AdapterRows(nnx.Variable):
    """The slot of every token of one call (int32 [..., B, T], leading stacked-layer axes) of an
    `AdapterBank`: a per-call input, set by `set_adapter_rows`; never trained or saved."""


class AdapterBank(nnx.Module):
    """N adapters of one weight, chosen per token (the module doc's bank): ``a`` [*stack, in..., N, R],
    ``b`` [*stack, N, R, out...] (`LoRA`), ``scales`` [*stack, N] (`AdapterScales`), ``rows`` the
    call's slots (`AdapterRows`, None: every token on slot 0, the base)."""

    def __init__(self, a: jax.Array, b: jax.Array, scales: jax.Array, a_axes, b_axes, scale_axes):
        self.a = LoRA(a, logical_axes=tuple(a_axes))
        self.b = LoRA(b, logical_axes=tuple(b_axes))
        self.scales = AdapterScales(scales, logical_axes=tuple(scale_axes))
        self.rows: AdapterRows | None = nnx.data(None)

    @property
    def slots(self) -> int:
        return self.scales.shape[-1]

    def row_weights(self, lead: tuple, dtype) -> jax.Array:
        """``[*lead, N]``: s_n where token's slot is n, else 0; ``lead`` the leading axes of the
        input (a call's [B, T], or its B * T tokens flattened)."""
        if self.rows is None:
            return jnp.zeros((*lead, self.slots), dtype)
        rows, scales = self.rows[...], self.scales[...].astype(jnp.float32)
        if math.prod(lead) != rows.size:
            raise ValueError(f"adapter bank: an input of leading shape {lead} does not match the call's "
                             f"{rows.shape} token slots")
        return (jax.nn.one_hot(rows.reshape(lead), self.slots, dtype=jnp.float32) * scales).astype(dtype)

    def low_rank(self, h: jax.Array, dtype) -> jax.Array:
        """``h [*lead, N, R]`` (the input through every slot's A) with each token's other slots
        zeroed and its own scaled by s_n."""
        return h * self.row_weights(h.shape[:-2], dtype)[..., None]

    def __call__(self, x: jax.Array, dtype, contract: int = 1) -> jax.Array:
        """``sum_n [slot = n] s_n (x A_n) B_n`` in ``dtype``."""
        h = self.low_rank(project(x, self.a[...], dtype, contract), dtype)
        return project(h, self.b[...], dtype, 2)


def _stacked(axes) -> int:
    """1 when the leading axis is the scanned "layers" axis, else 0."""
    return int(bool(axes) and axes[0] == STACK_AXIS)


def adapted_project(module: nnx.Module, name: str, x: jax.Array, dtype, contract: int = 1) -> jax.Array:
    """``x W + s dropout(x) A B`` for the weight ``module.<name>`` (just ``x W`` without an adapter)."""
    y = project(x, getattr(module, name)[...], dtype, contract)
    adapter = getattr(module, name + ADAPTER_SUFFIX, None)
    return y if adapter is None else y + adapter(x, dtype, contract)


def adapted_weight(module: nnx.Module, name: str, dtype) -> jax.Array:
    """The weight ``module.<name>`` in ``dtype``, with its adapter merged in (``W + s A B``) if it has
    one; an `AdapterBank` (one adapter per token) cannot be merged: its layer asks `adapter_bank`."""
    weight = getattr(module, name)[...]
    adapter = getattr(module, name + ADAPTER_SUFFIX, None)
    if isinstance(adapter, AdapterBank):
        raise ValueError(f"{type(module).__name__}.{name}: an adapter bank is computed beside the weight, not merged")
    if adapter is None:
        return weight.astype(dtype)
    return merged_weight(weight, adapter.a[...], adapter.b[...], adapter.scale, adapter.routed).astype(dtype)


# --- choosing and attaching adapters ------------------------------------------------------------


class AdaptableWeight(NamedTuple):
    """A weight a layer computes through `adapted_project` / `adapted_weight` (or, MXFP4 experts,
    beside their decoded product)."""

    path: str               # "body/layers/0/mixer/q_proj"
    module: nnx.Module
    name: str               # the attribute ("q_proj")
    input_dims: int         # leading (after any "layers" / "experts" axis) axes contracted with the input
    routed: bool            # routed experts: a shared A, one B per expert
    shape: tuple            # the (dense) weight's shape and logical axes
    axes: tuple


def weight_layout(module: nnx.Module, name: str) -> tuple[tuple, tuple] | None:
    """``(shape, logical axes)`` of the adaptable weight ``module.<name>``: an ``nnx.Param``'s own, or
    the dense layout the module's ``lora_layout`` gives (MXFP4 experts); None when it has none."""
    weight = getattr(module, name, None)
    if isinstance(weight, nnx.Param):
        return tuple(weight.shape), logical_axes(weight)
    layout = getattr(module, "lora_layout", None)
    return None if layout is None else layout(name)


def adaptable_weights(model: nnx.Module) -> Iterator[AdaptableWeight]:
    """Every weight of ``model`` whose layer can adapt it: the modules' ``LORA_WEIGHTS``
    (``{attribute: input dims}``) that exist, in graph order; routed experts are the modules with
    ``LORA_ROUTED = True``."""
    for path, module in nnx.iter_modules(model):
        for name, input_dims in getattr(type(module), "LORA_WEIGHTS", {}).items():
            layout = weight_layout(module, name)
            if layout is not None:
                yield AdaptableWeight("/".join(map(str, (*path, name))), module, name, input_dims,
                                      getattr(type(module), "LORA_ROUTED", False), *layout)


def target_matches(target: str, path: str, axes: tuple) -> bool:
    """A ``lora_targets`` entry against a weight: ``axis:NAME`` when NAME is one of its logical axes,
    else a glob over its path matched whole or at any depth (``mixer/q_proj`` matches
    ``body/layers/0/mixer/q_proj``)."""
    if target.startswith("axis:"):
        return target[len("axis:"):] in axes
    return fnmatch.fnmatchcase(path, target) or fnmatch.fnmatchcase(path, "*/" + target)


def select_weights(model: nnx.Module, targets: tuple[str, ...], routed_experts: bool) -> list[AdaptableWeight]:
    """The adaptable weights ``targets`` select (routed experts only with ``routed_experts``, and then
    all of them). Raises ValueError naming a target that selects nothing."""
    candidates = list(adaptable_weights(model))
    plain = [w for w in candidates if not w.routed]
    for target in targets:
        if not any(target_matches(target, w.path, w.axes) for w in plain):
            raise ValueError(f"finetune.lora_targets: {target!r} selects no adaptable weight (adaptable: e.g. "
                             f"{', '.join(sorted({w.path.rsplit('/', 2)[-2] + '/' + w.name for w in plain})[:8])})")
    chosen = [w for w in plain if any(target_matches(t, w.path, w.axes) for t in targets)]
    routed = [w for w in candidates if w.routed]
    if routed_experts and not routed:
        raise ValueError("finetune.lora_routed_experts: the model has no routed experts to adapt")
    return chosen + (routed if routed_experts else [])


def adapter_factors(shape: tuple, axes: tuple, input_dims: int, routed: bool, rank: int, key: jax.Array):
    """``(A, B, A axes, B axes)`` of a new adapter for a weight of this shape and logical axes
    (fp32; B zero)."""
    stack = _stacked(axes)
    lead = stack + int(routed)                              # stacked layers, then experts
    in_shape, in_axes = shape[lead:lead + input_dims], axes[lead:lead + input_dims]
    out_shape, out_axes = shape[lead + input_dims:], axes[lead + input_dims:]
    a_shape = (*shape[:stack], *in_shape, rank)
    a = kaiming_uniform(key, a_shape, math.prod(in_shape))
    b = jnp.zeros((*shape[:lead], rank, *out_shape), jnp.float32)
    return a, b, (*axes[:stack], *in_axes, RANK_AXIS), (*axes[:lead], RANK_AXIS, *out_axes)


def attach_adapters(model: nnx.Module, *, rank: int, alpha: float, dropout_rate: float, targets: tuple[str, ...],
                    routed_experts: bool, seed: int) -> list[str]:
    """Add an `Adapter` beside every weight ``targets`` select (in place); returns their weight paths.
    The factors depend on ``seed`` and the weight's path only (the model's own initialisation is
    untouched), so the same call on another copy of the base gives the same adapters."""
    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {rank}")
    chosen = select_weights(model, targets, routed_experts)
    root = jax.random.key(seed)
    for item in chosen:
        key = jax.random.fold_in(root, _path_hash(item.path))
        a, b, a_axes, b_axes = adapter_factors(item.shape, item.axes, item.input_dims, item.routed, rank, key)
        stack = a.shape[:_stacked(a_axes)]
        slot = jnp.zeros((*stack, 2), jnp.uint32) if dropout_rate and not item.routed else None
        setattr(item.module, item.name + ADAPTER_SUFFIX,
                Adapter(a, b, a_axes, b_axes, alpha / rank, dropout_rate, slot, item.routed))
    return [item.path for item in chosen]


def _path_hash(path: str) -> int:
    """A 31-bit number of a path (FNV-1a), stable across processes (Python's ``hash`` is salted)."""
    h = 0x811C9DC5
    for byte in path.encode():
        h = ((h ^ byte) * 0x01000193) % 2**32
    return h % 2**31


def dropout_keys(slots: dict, key: jax.Array | None) -> dict:
    """Fill the dropout slots ``{path: uint32 [..., 2]}`` (arrays or shapes) with key data drawn
    from ``key`` (one step's key) and each slot's path; zeros without a key (no dropout)."""
    def fill(path, slot):
        if key is None:
            return jnp.zeros(slot.shape, jnp.uint32)
        own = jax.random.fold_in(key, _path_hash(path))
        return jax.random.key_data(jax.random.split(own, slot.shape[:-1]) if len(slot.shape) > 1 else own)
    return {path: fill(path, slot) for path, slot in slots.items()}


def adapter_bank(module: nnx.Module, name: str) -> AdapterBank | None:
    """The `AdapterBank` of weight ``module.<name>``, None when it has none (or a plain adapter)."""
    adapter = getattr(module, name + ADAPTER_SUFFIX, None)
    return adapter if isinstance(adapter, AdapterBank) else None


def attach_banks(model: nnx.Module, weights: list[AdaptableWeight], slots: int, rank: int) -> None:
    """An empty `AdapterBank` (``slots`` slots of rank ``rank``, every factor and scale zero) beside
    each of ``weights`` of ``model`` (in place). Routed experts take none: their adapters are merged
    into the weights the dispatch computes with."""
    for item in weights:
        if item.routed:
            raise ValueError(f"{item.path}: routed experts' adapters cannot be chosen per token")
        stack = _stacked(item.axes)
        in_shape, in_axes = item.shape[stack:stack + item.input_dims], item.axes[stack:stack + item.input_dims]
        out_shape, out_axes = item.shape[stack + item.input_dims:], item.axes[stack + item.input_dims:]
        lead, lead_axes = item.shape[:stack], item.axes[:stack]
        a = jnp.zeros((*lead, *in_shape, slots, rank), jnp.float32)
        b = jnp.zeros((*lead, slots, rank, *out_shape), jnp.float32)
        setattr(item.module, item.name + ADAPTER_SUFFIX, AdapterBank(
            a, b, jnp.zeros((*lead, slots), jnp.float32), (*lead_axes, *in_axes, SLOT_AXIS, RANK_AXIS),
            (*lead_axes, SLOT_AXIS, RANK_AXIS, *out_axes), (*lead_axes, SLOT_AXIS)))


def set_adapter_rows(model: nnx.Module, rows: jax.Array | None) -> None:
    """Every `AdapterBank` of ``model`` serves the tokens of the next call from slots ``rows``
    (int32 [B, T]; None: no bank is used), broadcast over its stacked layers."""
    if rows is None:
        return
    for _, module in nnx.iter_modules(model):
        if isinstance(module, AdapterBank):
            lead = module.scales.shape[:-1]
            module.rows = AdapterRows(jnp.broadcast_to(rows.astype(jnp.int32), (*lead, *rows.shape)),
                                      logical_axes=(*module.scales.get_metadata()["logical_axes"][:-1], None, None))


def set_adapter_dropout(model: nnx.Module, rate: float) -> None:
    """Set the dropout rate of every adapter of ``model`` (0: evaluation, nothing dropped)."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Adapter):
            module.dropout_rate = rate
