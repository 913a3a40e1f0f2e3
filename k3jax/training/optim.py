"""Optimizers for K3 training (optax), driven by the parameters' logical axis names.

    schedule   warmup (linear from 0) then cosine to ``min_lr_ratio * lr``, warmup-stable-decay
               (constant, then linear to ``min_lr_ratio * lr`` over the last ``decay_fraction``
               of the steps), or constant
    AdamW      global-norm clipping, then AdamW; weight decay only on matrices (see `decays`)
    Muon       per-head Muon (Newton-Schulz on each head block of a [d, H, K] projection, as K3
               trained its Q/K/V) for matrices, AdamW for everything else (embeddings, head,
               norms, gates, biases, convolution taps, router) -- `muon_dimensions`. Per matrix
               G [fan_in, fan_out]: Nesterov momentum (beta 0.95, optax.contrib.muon's
               bias-corrected form), then `NS_STEPS` steps of Jordan's quintic
               X <- a X + b (X X^T) X + c (X X^T)^2 X, (a, b, c) = `NS_COEFFS`, from
               X = M / (||M||_F + 1e-8), then scaled by ``muon_rms * sqrt(max(fan_in, fan_out))``

Parameters are plain nested dicts of arrays; their logical axes (`k3jax.layers.params`) come in
a parallel nested dict of tuples.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import optax
from optax.contrib import MuonDimensionNumbers

# Axes that index independent matrices rather than a matrix dimension.
BATCH_AXES = frozenset({"layers", "experts"})
HEAD_AXES = frozenset({"heads", "value_heads"})
# Parameters that are matrices by shape but not by role.
NOT_DECAYED = frozenset({"dt_bias", "A_log"})
MUON_MOMENTUM = 0.95
# Newton-Schulz: Keller Jordan's quintic coefficients (modded-nanogpt, 2024), five steps.
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def learning_rate_schedule(kind: str, peak: float, total_steps: int, warmup_steps: int,
                           min_lr_ratio: float = 0.1, decay_fraction: float = 0.2) -> optax.Schedule:
    """The learning rate at each optimizer step."""
    warmup_steps = min(warmup_steps, max(total_steps - 1, 0))
    floor = peak * min_lr_ratio
    if kind == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup_steps, max(total_steps, warmup_steps + 1), floor)
    warmup = optax.linear_schedule(0.0, peak, max(warmup_steps, 1))
    if kind == "constant":
        return optax.join_schedules([warmup, optax.constant_schedule(peak)], [warmup_steps])
    if kind == "wsd":
        decay_steps = max(int(round(total_steps * decay_fraction)), 1)
        stable_end = max(total_steps - decay_steps, warmup_steps)
        return optax.join_schedules(
            [warmup, optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay_steps)],
            [warmup_steps, stable_end],
        )
    raise ValueError(f"unknown learning-rate schedule {kind!r}; expected cosine, wsd or constant")


def _matrix_axes(axes: Sequence[str]) -> list[int]:
    return [i for i, name in enumerate(axes) if name not in BATCH_AXES]


def decays(path: Sequence[Any], axes: Sequence[str]) -> bool:
    """Weight decay applies to matrices (two or more non-batch axes), except gate parameters:
    never to norms, A_log, dt_bias, AttnRes queries and key gains, or biases."""
    return len(_matrix_axes(axes)) >= 2 and str(path[-1]) not in NOT_DECAYED


def muon_dimensions(path: Sequence[Any], axes: Sequence[str]) -> MuonDimensionNumbers | None:
    """How Muon sees a parameter, or None for AdamW.

    Muon takes projection matrices (``x @ W``: input axes first, the output axis last). Axes
    "layers" and "experts" index separate matrices; a [.., heads, head_dim] output is split per
    head (per-head Muon). Embeddings and the head (a "vocab" axis), convolution taps, the router
    (output "experts") and gate parameters stay on AdamW.
    """
    if not decays(path, axes) or "vocab" in axes or "conv" in axes or axes[-1] == "experts":
        return None
    matrix = _matrix_axes(axes)
    output = matrix[-1]
    per_head = axes[output] == "head_dim" and any(axes[i] in HEAD_AXES for i in matrix[:-1])
    reduction = tuple(i for i in matrix[:-1] if not (per_head and axes[i] in HEAD_AXES))
    if not reduction:
        return None
    return MuonDimensionNumbers(reduction_axis=reduction, output_axis=output)


def _path_names(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def map_axes(fn, axes):
    """``fn(path, leaf_axes)`` for every parameter; ``axes`` is a nested dict whose leaves are tuples
    of logical axis names. Returns a tree of the same structure."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf_axes: fn(_path_names(path), leaf_axes), axes, is_leaf=lambda x: isinstance(x, tuple)
    )


def build_optimizer(
    *,
    name: str,
    schedule: optax.Schedule,
    axes: Any,
    weight_decay: float = 0.1,
    beta1: float = 0.9,
    beta2: float = 0.95,
    eps: float = 1e-8,
    grad_clip: float | None = 1.0,
    muon_rms: float = 0.2,
) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (``name="adamw"``) or per-head Muon for the matrices
    `muon_dimensions` accepts with AdamW for the rest (``name="muon"``).

    Muon updates are rescaled to RMS ``muon_rms`` (0.2, as Moonlight and K3 did) so that one
    learning rate serves both; weight decay is decoupled and masked by `decays` in both.
    ``axes``: the logical axes of every parameter, a nested dict shaped like the parameters.
    """
    decay_mask = map_axes(decays, axes)
    adamw = optax.adamw(schedule, b1=beta1, b2=beta2, eps=eps, weight_decay=weight_decay, mask=decay_mask)
    clip = [optax.clip_by_global_norm(grad_clip)] if grad_clip else []
    if name == "adamw":
        return optax.chain(*clip, adamw)
    if name != "muon":
        raise ValueError(f"unknown optimizer {name!r}; expected adamw or muon")
    dims = map_axes(muon_dimensions, axes)
    labels = jax.tree.map(lambda d: "adam" if d is None else "muon", dims,
                          is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
    muon = optax.contrib.muon(schedule, ns_coeffs=NS_COEFFS, ns_steps=NS_STEPS, beta=MUON_MOMENTUM,
                              weight_decay=weight_decay, muon_weight_dimension_numbers=dims,
                              consistent_rms=muon_rms)
    return optax.chain(*clip, optax.multi_transform({"muon": muon, "adam": adamw}, labels))
