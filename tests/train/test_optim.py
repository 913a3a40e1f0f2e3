"""`k3jax.training.optim` against an independent float64 NumPy reference written from the math.

    Newton-Schulz  Jordan's quintic (modded-nanogpt, 2024): X_0 = M / (||M||_F + 1e-8), then five
                   steps of X <- a X + b (X X^T) X + c (X X^T)^2 X, (a, b, c) = (3.4445, -4.7750, 2.0315)
    Muon           one matrix per (reduction axes flattened) x (output axis) block, every other axis
                   indexing separate matrices (layers, experts, and the heads of a per-head
                   projection); momentum as optax.contrib.muon defines it, m_t = beta m_{t-1} +
                   (1 - beta) g_t and Nesterov with bias corrections, M_t = beta m_t / (1 - beta^(t+1))
                   + (1 - beta) g_t / (1 - beta^t), beta = 0.95; the step lr_t (0.2 sqrt(max(fan_in,
                   fan_out)) NS(M_t) + wd p) (Moonlight's RMS matching, Liu et al. 2025)
    AdamW          bias-corrected moments, the step lr_t (m_hat / (sqrt(v_hat) + eps) + wd p), the
                   decay on matrices only
    clipping       the whole gradient scaled to global norm ``grad_clip`` when it is larger
    schedules      warmup then cosine, warmup-stable-decay or constant, in closed form

Which parameter goes to Muon or AdamW and which decays is written out by hand for each leaf
(``LEAVES``, ``ROUTES``) from the rules optim.py documents; the reference calls no k3jax or optax code.
"""
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

from k3jax.training.optim import NS_COEFFS, NS_STEPS, build_optimizer, decays, learning_rate_schedule, muon_dimensions
from tests.helpers import rel_err

# fp32 against float64. A Newton-Schulz step multiplies the rounding error already in X by at most
# |f'(0)| = a = 3.44 (the quintic's largest slope) and adds ~1e-7 of the largest entry, so five
# steps stay within ~3.44^5 * 1e-7 = 5e-5. Measured: 2.3e-5 for the rank-one matrix (its null
# directions are rounding noise, which the iteration amplifies most), <= 4e-6 everywhere else. A
# coefficient or the RMS off by 0.1%, one iteration fewer, momentum 0.9, the whole [d, H K] matrix
# for the heads, a wrong decay mask or learning-rate step, no clipping: 2e-3 or more.
TOLERANCE = 1e-4

NS_A, NS_B, NS_C = 3.4445, -4.7750, 2.0315
NS_EPS = 1e-8
BETA = 0.95          # Muon's momentum
RMS = 0.2            # Muon's update RMS (build_optimizer's muon_rms default)


class Muon(NamedTuple):
    reduction: tuple     # axes flattened into the matrix's rows (fan_in)
    output: int          # the axis of its columns (fan_out)


class AdamW(NamedTuple):
    decay: bool


def newton_schulz(m: np.ndarray, steps: int = 5) -> list[np.ndarray]:
    """The iterates X_0 .. X_steps of one matrix."""
    x = m / (np.linalg.norm(m) + NS_EPS)
    iterates = [x]
    for _ in range(steps):
        gram = x @ x.T
        x = NS_A * x + (NS_B * gram + NS_C * gram @ gram) @ x
        iterates.append(x)
    return iterates


def orthogonalised(m: np.ndarray, route: Muon) -> np.ndarray:
    """NS(M) of every matrix of ``m`` (see the module doc), in ``m``'s layout."""
    batch = [axis for axis in range(m.ndim) if axis not in route.reduction and axis != route.output]
    order = batch + list(route.reduction) + [route.output]
    moved = m.transpose(order)
    rows = math.prod(m.shape[axis] for axis in route.reduction)
    matrices = moved.reshape(-1, rows, m.shape[route.output])
    result = np.stack([newton_schulz(matrix)[-1] for matrix in matrices]).reshape(moved.shape)
    return result.transpose(np.argsort(order))


def muon_scale(shape, route: Muon) -> float:
    fan_in, fan_out = math.prod(shape[axis] for axis in route.reduction), shape[route.output]
    return RMS * math.sqrt(max(fan_in, fan_out))


def clipped(grads: dict, grad_clip) -> dict:
    norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
    if grad_clip is None or norm <= grad_clip:
        return grads
    return {name: g * grad_clip / norm for name, g in grads.items()}


def muon_direction(g, momentum, t: int, route: Muon):
    """``(direction, momentum)`` of step ``t`` (from 1) of a Muon leaf, before weight decay."""
    momentum = BETA * momentum + (1 - BETA) * g
    nesterov = BETA * momentum / (1 - BETA ** (t + 1)) + (1 - BETA) * g / (1 - BETA**t)
    return muon_scale(g.shape, route) * orthogonalised(nesterov, route), momentum


def adam_direction(g, moments, t: int, b1: float, b2: float, eps: float):
    """``(direction, moments)`` of step ``t`` (from 1) of an AdamW leaf, before weight decay."""
    first, second = b1 * moments[0] + (1 - b1) * g, b2 * moments[1] + (1 - b2) * g * g
    return first / (1 - b1**t) / (np.sqrt(second / (1 - b2**t)) + eps), (first, second)


def reference_run(params: dict, grads: list[dict], routes: dict, lr, *, weight_decay: float, grad_clip,
                  b1=0.9, b2=0.95, eps=1e-8) -> list[dict]:
    """The parameters after each step on ``grads`` from ``params`` (flat dicts of arrays), float64.
    ``lr(count)``: the learning rate of the step after ``count`` earlier ones."""
    p = {name: np.asarray(value, np.float64) for name, value in params.items()}
    state = {name: (np.zeros_like(value), np.zeros_like(value)) for name, value in p.items()}
    history = []
    for t, g in enumerate(grads, start=1):
        g = clipped({name: np.asarray(value, np.float64) for name, value in g.items()}, grad_clip)
        for name, route in routes.items():
            if isinstance(route, Muon):
                direction, momentum = muon_direction(g[name], state[name][0], t, route)
                state[name] = (momentum, None)
            else:
                direction, state[name] = adam_direction(g[name], state[name], t, b1, b2, eps)
            decayed = isinstance(route, Muon) or route.decay
            p[name] = p[name] - lr(t - 1) * (direction + (weight_decay * p[name] if decayed else 0.0))
        history.append(dict(p))
    return history


def nest(flat: dict) -> dict:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}``."""
    tree = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return tree


def flatten(tree: dict) -> dict:
    return {"/".join(str(key.key) for key in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def k3jax_run(name: str, params: dict, grads: list[dict], axes: dict, lr, **options) -> list[dict]:
    """The parameters after each step of ``build_optimizer(name=name, ...)``, as flat float32 dicts."""
    optimizer = build_optimizer(name=name, schedule=lr, axes=nest(axes), **options)
    p = nest({path: jnp.asarray(value, jnp.float32) for path, value in params.items()})
    state = optimizer.init(p)
    update = jax.jit(optimizer.update)
    history = []
    for g in grads:
        updates, state = update(nest({path: jnp.asarray(value, jnp.float32) for path, value in g.items()}), state, p)
        p = optax.apply_updates(p, updates)
        history.append(flatten(p))
    return history


# A small parameter tree with one leaf of each kind the model has: (shape, logical axes, route).
LEAVES = {
    "embedding": ((12, 8), ("vocab", "embed"), AdamW(decay=True)),
    "lm_head": ((8, 12), ("embed", "vocab"), AdamW(decay=True)),
    "final_norm": ((8,), ("embed",), AdamW(decay=False)),
    # [layers, d, H, K]: one matrix [d, K] per layer and head
    "layers/q_proj": ((2, 8, 2, 4), ("layers", "embed", "heads", "head_dim"), Muon((1,), 3)),
    "layers/v_proj": ((2, 8, 3, 4), ("layers", "embed", "value_heads", "head_dim"), Muon((1,), 3)),
    # [layers, H, K, d]: the heads are the input, so one matrix [H K, d] per layer
    "layers/o_proj": ((2, 2, 4, 8), ("layers", "heads", "head_dim", "embed"), Muon((1, 2), 3)),
    "layers/b_proj": ((2, 8, 3), ("layers", "embed", "value_heads"), Muon((1,), 2)),
    "layers/experts_up": ((2, 3, 6, 5), ("layers", "experts", "latent", "expert_mlp"), Muon((2,), 3)),
    "layers/k_conv": ((2, 2, 4, 3), ("layers", "heads", "head_dim", "conv"), AdamW(decay=True)),
    # "experts" indexes matrices, so the router has one matrix axis: a vector per expert, no decay
    "layers/router": ((2, 8, 3), ("layers", "embed", "experts"), AdamW(decay=False)),
    "layers/dt_bias": ((2, 3, 4), ("layers", "value_heads", "head_dim"), AdamW(decay=False)),
    "layers/A_log": ((2, 3), ("layers", "value_heads"), AdamW(decay=False)),
    "layers/input_norm": ((2, 8), ("layers", "embed"), AdamW(decay=False)),
}
ROUTES = {
    "muon": {path: route for path, (_, _, route) in LEAVES.items()},
    # AdamW alone: every leaf, matrices (Muon's) decayed
    "adamw": {path: AdamW(decay=True) if isinstance(route, Muon) else route for path, (_, _, route) in LEAVES.items()},
}


def dimension_numbers(route) -> MuonDimensionNumbers | None:
    return MuonDimensionNumbers(reduction_axis=route.reduction, output_axis=route.output) \
        if isinstance(route, Muon) else None


@pytest.mark.parametrize("path", LEAVES)
def test_each_parameter_kind_goes_to_its_optimizer(path):
    _, axes, route = LEAVES[path]
    names = tuple(path.split("/"))
    assert muon_dimensions(names, axes) == dimension_numbers(route)
    assert decays(names, axes) == (isinstance(route, Muon) or route.decay)


@pytest.mark.parametrize("axes, route", [
    (("layers", "q_lora", "heads", "head_dim"), Muon((1,), 3)),                # MLA q_b: per head
    (("layers", "kv_lora", "heads", "head_dim"), Muon((1,), 3)),               # MLA kv_b: per head
    (("layers", "gate_rank", "value_heads", "head_dim"), Muon((1,), 3)),       # KDA f_b: per head
    (("layers", "embed", "kv_lora"), Muon((1,), 2)),
    (("layers", "experts", "expert_mlp", "latent"), Muon((2,), 3)),
    (("layers", "mlp", "embed"), Muon((1,), 2)),
    (("heads", "head_dim"), None),                                             # no input axis once heads split
])
def test_model_layouts_split_as_documented(axes, route):
    assert muon_dimensions(("w",), axes) == dimension_numbers(route)


def random_params_and_grads(seed: int, steps: int, scales=(1.0, 0.01, 1.0)) -> tuple[dict, list[dict]]:
    """Parameters (std 0.1) and ``steps`` gradients for ``LEAVES``; the gradients' global norm is
    ~25 times ``scales[t]`` (above and below the clipping threshold 1)."""
    rng = np.random.default_rng(seed)
    params = {path: 0.1 * rng.standard_normal(shape) for path, (shape, _, _) in LEAVES.items()}
    grads = [{path: scales[t] * rng.standard_normal(shape) for path, (shape, _, _) in LEAVES.items()}
             for t in range(steps)]
    return params, grads


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_updates_over_steps_match_reference(name):
    params, grads = random_params_and_grads(0, 3)
    lr = lambda count: 0.01 * (count + 1)  # noqa: E731  (a rate that differs from step to step)
    axes = {path: leaf_axes for path, (_, leaf_axes, _) in LEAVES.items()}
    got = k3jax_run(name, params, grads, axes, lr, weight_decay=0.1, grad_clip=1.0)
    want = reference_run(params, grads, ROUTES[name], lr, weight_decay=0.1, grad_clip=1.0)
    for step, (got_params, want_params) in enumerate(zip(got, want), start=1):
        for path in LEAVES:
            change = got_params[path] - params[path]
            assert rel_err(change, want_params[path] - params[path]) <= TOLERANCE, (step, path)


def matrix_cases():
    rng = np.random.default_rng(1)
    rank_one = np.outer(rng.standard_normal(6), rng.standard_normal(5))
    return {"square": rng.standard_normal((6, 6)), "wide": rng.standard_normal((4, 10)),
            "tall": rng.standard_normal((10, 4)), "row": rng.standard_normal((1, 7)),
            "rank one": rank_one, "tiny (norm ~ eps)": 1e-8 * rng.standard_normal((5, 5)),
            "huge": 1e4 * rng.standard_normal((5, 8)), "zero": np.zeros((3, 5))}


MATRICES = matrix_cases()


def test_newton_schulz_iterates_match_reference():
    """Each iterate of the iteration optim.py configures (``NS_COEFFS``; ``scale_by_muon`` without
    momentum orthogonalises the gradient itself) against the reference's, for a wide, a tall, a
    rank-one and a tiny matrix (the next test takes every matrix through the whole step)."""
    assert NS_STEPS == 5
    cases = {case: MATRICES[case] for case in ("wide", "tall", "rank one", "tiny (norm ~ eps)")}
    matrices = {case: MuonDimensionNumbers(reduction_axis=0, output_axis=1) for case in cases}
    transforms = [optax.contrib.scale_by_muon(ns_coeffs=NS_COEFFS, ns_steps=steps, beta=0.0, nesterov=False,
                                              weight_dimension_numbers=matrices)
                  for steps in range(NS_STEPS + 1)]
    iterates = jax.jit(lambda x: [transform.update(x, transform.init(x))[0] for transform in transforms])
    got = iterates({case: jnp.asarray(g, jnp.float32) for case, g in cases.items()})
    for case, g in cases.items():
        for steps, expected in enumerate(newton_schulz(g, 5)):
            assert rel_err(got[steps][case], expected) <= TOLERANCE, (case, steps)


def test_one_muon_step_on_each_matrix_matches_reference():
    """The whole first step (momentum, five iterations, scale, decay, rate) on every matrix."""
    params = {case: np.random.default_rng(2).standard_normal(g.shape) for case, g in MATRICES.items()}
    lr = lambda count: 0.5  # noqa: E731
    axes = {case: ("embed", "mlp") for case in MATRICES}
    routes = {case: Muon((0,), 1) for case in MATRICES}
    (got,) = k3jax_run("muon", params, [MATRICES], axes, lr, weight_decay=0.1, grad_clip=None)
    (want,) = reference_run(params, [MATRICES], routes, lr, weight_decay=0.1, grad_clip=None)
    for case, p in params.items():
        assert rel_err(got[case] - p, want[case] - p) <= TOLERANCE, case


def test_heads_are_orthogonalised_apart():
    """A [d, H, K] projection's update is the heads' blocks orthogonalised one by one, side by
    side, and not the [d, H K] matrix orthogonalised whole."""
    g = np.random.default_rng(3).standard_normal((8, 3, 4))
    per_head = np.stack([newton_schulz(g[:, head])[-1] for head in range(3)], axis=1)
    whole = newton_schulz(g.reshape(8, 12))[-1].reshape(8, 3, 4)
    assert rel_err(whole, per_head) > 0.1
    lr = lambda count: 1.0  # noqa: E731
    (got,) = k3jax_run("muon", {"q": np.zeros(g.shape)}, [{"q": g}], {"q": ("embed", "heads", "head_dim")}, lr,
                       weight_decay=0.0, grad_clip=None)
    # The first Nesterov average is a multiple of g, which the normalisation divides out.
    assert rel_err(got["q"], -RMS * math.sqrt(8) * per_head) <= TOLERANCE
    assert rel_err(got["q"], -RMS * math.sqrt(12) * whole) > 0.1


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        build_optimizer(name="sgd", schedule=optax.constant_schedule(1e-3), axes={"w": ("embed", "mlp")})


PEAK, TOTAL, WARMUP, FLOOR = 1e-3, 100, 10, 1e-4   # FLOOR: min_lr_ratio 0.1


def cosine(step):
    if step < WARMUP:
        return PEAK * step / WARMUP
    progress = min(step - WARMUP, TOTAL - WARMUP) / (TOTAL - WARMUP)
    return FLOOR + (PEAK - FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_stable_decay(step):
    """decay_fraction 0.2: stable until step 80, then linear to FLOOR at step 100."""
    if step < WARMUP:
        return PEAK * step / WARMUP
    return PEAK + (FLOOR - PEAK) * min(max(step - 80, 0), 20) / 20


def constant(step):
    return PEAK * min(step, WARMUP) / WARMUP


@pytest.mark.parametrize("kind, closed_form", [("cosine", cosine), ("wsd", warmup_stable_decay),
                                               ("constant", constant)])
def test_learning_rate_schedules_match_closed_form(kind, closed_form):
    schedule = learning_rate_schedule(kind, PEAK, TOTAL, WARMUP, min_lr_ratio=0.1, decay_fraction=0.2)
    for step in (0, 1, 5, 9, 10, 11, 40, 55, 79, 80, 85, 90, 99, 100, 150):
        assert float(schedule(step)) == pytest.approx(closed_form(step), rel=1e-6, abs=1e-12), step


def test_warmup_is_cut_to_reach_the_peak_within_the_run():
    """A warmup as long as the run ends one step early, so the peak is reached."""
    schedule = learning_rate_schedule("constant", PEAK, 5, 10)
    assert [float(schedule(step)) for step in range(6)] == pytest.approx([0, PEAK / 4, PEAK / 2, 3 * PEAK / 4,
                                                                          PEAK, PEAK], rel=1e-6)
    assert float(learning_rate_schedule("wsd", PEAK, 100, 0)(0)) == pytest.approx(PEAK, rel=1e-6)


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'linear'"):
        learning_rate_schedule("linear", PEAK, TOTAL, WARMUP)
