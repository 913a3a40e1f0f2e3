"""LoRA adapters (`k3jax.layers.lora`): values and gradients against a float64 NumPy reference,
merging, target selection, and the adapters' placement beside a tiny model's weights."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import load_config
from k3jax.layers.lora import (Adapter, LoRA, adapted_project, attach_adapters, dropout, merged_weight,
                               select_weights)
from k3jax.model import K3Model


def _reference(x, w, a, b, scale, g):
    """float64: y = x W + s x A B for x [N, in], W [in, out], A [in, r], B [r, out], and the
    gradients of sum(y * g) w.r.t. x, A and B."""
    x, w, a, b, g = (np.asarray(t, np.float64) for t in (x, w, a, b, g))
    y = x @ w + scale * (x @ a) @ b
    dx = g @ (w + scale * a @ b).T
    da = scale * x.T @ (g @ b.T)
    db = scale * (x @ a).T @ g
    return y, dx, da, db


class _Holder(nnx.Module):
    """A weight W with an adapter, as a layer holds them."""

    def __init__(self, w, a, b, scale):
        self.w = nnx.Param(w)
        self.w_lora = Adapter(a, b, ("embed", "lora_rank"), ("lora_rank", "mlp"), scale, 0.0, None)


@pytest.mark.parametrize("in_shape,out_shape,contract", [((6,), (5,), 1), ((6,), (2, 3), 1), ((2, 3), (5,), 2)])
def test_adapted_projection_values_and_gradients_match_float64(in_shape, out_shape, contract):
    rank, scale = 3, 0.75
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (4, *in_shape))
    w = jax.random.normal(keys[1], (*in_shape, *out_shape))
    a = jax.random.normal(keys[2], (*in_shape, rank))
    b = jax.random.normal(keys[3], (rank, *out_shape))
    g = jax.random.normal(keys[4], (4, *out_shape))

    def loss(x, a, b):
        holder = _Holder(w, a, b, scale)
        return jnp.sum(adapted_project(holder, "w", x, jnp.float32, contract) * g)

    y = adapted_project(_Holder(w, a, b, scale), "w", x, jnp.float32, contract)
    dx, da, db = jax.grad(loss, argnums=(0, 1, 2))(x, a, b)
    flat = lambda t, lead: np.asarray(t).reshape(*t.shape[:lead], -1) if lead else np.asarray(t).reshape(-1)  # noqa: E731
    fin, fout = int(np.prod(in_shape)), int(np.prod(out_shape))
    ref_y, ref_dx, ref_da, ref_db = _reference(np.asarray(x).reshape(4, fin), np.asarray(w).reshape(fin, fout),
                                               np.asarray(a).reshape(fin, rank), np.asarray(b).reshape(rank, fout),
                                               scale, np.asarray(g).reshape(4, fout))
    np.testing.assert_allclose(flat(y, 1), ref_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(flat(dx, 1), ref_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(da).reshape(fin, rank), ref_da, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(db).reshape(rank, fout), ref_db, rtol=1e-5, atol=1e-5)


def test_merged_weight_matches_float64_including_routed_experts():
    keys = jax.random.split(jax.random.key(1), 5)
    w, a, b = (jax.random.normal(k, s) for k, s in zip(keys, [(4, 3), (4, 2), (2, 3)]))
    np.testing.assert_allclose(merged_weight(w, a, b, 0.5),
                               np.float64(w) + 0.5 * np.float64(a) @ np.float64(b), rtol=1e-6, atol=1e-6)
    experts = jax.random.normal(keys[3], (5, 4, 3))
    per_expert_b = jax.random.normal(keys[4], (5, 2, 3))
    expected = np.stack([np.float64(experts[e]) + 2.0 * np.float64(a) @ np.float64(per_expert_b[e]) for e in range(5)])
    np.testing.assert_allclose(merged_weight(experts, a, per_expert_b, 2.0, routed=True), expected, rtol=1e-6, atol=1e-6)


def test_dropout_keeps_the_expected_fraction_and_scales_the_rest():
    x = jnp.ones((200, 50))
    y = np.asarray(dropout(x, 0.25, jax.random.key(3)))
    assert set(np.unique(y)) == {0.0, np.float32(1 / 0.75)}
    assert abs((y == 0).mean() - 0.25) < 0.02
    assert dropout(x, 0.25, None) is x


@pytest.fixture(scope="module")
def tiny():
    return load_config("configs/tiny.yaml").model


@pytest.mark.slow   # 15-60 s of the default set's CPU: in .ci/run's slow set
def test_adapters_sit_beside_their_weights_with_the_weights_axes_and_start_as_the_base(tiny):
    model = K3Model(tiny, rngs=nnx.Rngs(0))
    tokens = jnp.arange(24).reshape(2, 12)
    before = model(tokens).logits
    base_paths = {p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    paths = attach_adapters(model, rank=4, alpha=8.0, dropout_rate=0.0, targets=("mixer/q_proj", "ffn/shared/w_*"),
                            routed_experts=True, seed=0)
    assert {p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))} == base_paths   # base paths unchanged
    assert all(p.endswith(("mixer/q_proj", "shared/w_gate", "shared/w_up", "shared/w_down", "experts/w_gate",
                           "experts/w_up", "experts/w_down")) for p in paths)
    factors = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, LoRA))}
    a = factors["body/layers/0/mixer/q_proj_lora/a"]
    assert a.get_metadata()["logical_axes"] == ("layers", "embed", "lora_rank")
    assert factors["body/layers/0/mixer/q_proj_lora/b"].get_metadata()["logical_axes"] == (
        "layers", "lora_rank", "heads", "head_dim")
    routed_a = factors["body/layers/1/ffn/experts/w_gate_lora/a"]
    routed_b = factors["body/layers/1/ffn/experts/w_gate_lora/b"]
    assert routed_a.shape == (1, tiny.moe.latent_dim, 4)                     # one A shared by the experts
    assert routed_b.shape == (1, tiny.moe.num_experts, 4, tiny.moe.expert_width)
    np.testing.assert_array_equal(model(tokens).logits, before)             # B = 0: the base's function


def test_targets_by_logical_axis_and_unknown_targets(tiny):
    model = nnx.eval_shape(lambda: K3Model(tiny, rngs=nnx.Rngs(0)))
    chosen = {w.path.rsplit("/", 1)[-1] for w in select_weights(model, ("axis:mlp",), False)}
    assert chosen == {"w_gate", "w_up", "w_down"}
    with pytest.raises(ValueError, match="'mixer/nope' selects no adaptable weight"):
        select_weights(model, ("mixer/nope",), False)


@pytest.mark.parametrize("in_shape,out_shape,contract,flattened", [((6,), (5,), 1, False), ((2, 3), (5,), 2, False),
                                                                   ((6,), (2, 3), 1, True)])
def test_an_adapter_bank_gives_each_token_its_own_slots_term_in_float64(in_shape, out_shape, contract, flattened):
    """AdapterBank: y = x W + s_n (x A_n) B_n with n the token's slot (0, the base: nothing added),
    slots of ranks 3 and 1 zero-padded to the bank's rank 3; inputs [B, T, in...] or their tokens
    flattened [B * T, in...] (as shared experts see them)."""
    from k3jax.layers.lora import AdapterBank, adapted_project, set_adapter_rows

    rng = np.random.default_rng(0)
    batch, length, rank, scales = 2, 3, 3, [0.0, 0.5, 2.0]
    x = rng.normal(size=(batch, length, *in_shape)).astype(np.float32)
    w = rng.normal(size=(*in_shape, *out_shape)).astype(np.float32)
    factors = [(np.zeros((*in_shape, rank)), np.zeros((rank, *out_shape))),
               (rng.normal(size=(*in_shape, 3)), rng.normal(size=(3, *out_shape))),
               (rng.normal(size=(*in_shape, 1)), rng.normal(size=(1, *out_shape)))]
    a = np.stack([np.pad(f[0], [(0, 0)] * len(in_shape) + [(0, rank - f[0].shape[-1])]) for f in factors], -2)
    b = np.stack([np.pad(f[1], [(0, rank - f[1].shape[0])] + [(0, 0)] * len(out_shape)) for f in factors])
    holder = nnx.Module()
    holder.w = nnx.Param(jnp.asarray(w))
    in_axes, out_axes = (None,) * len(in_shape), (None,) * len(out_shape)
    holder.w_lora = AdapterBank(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), jnp.asarray(scales),
                                (*in_axes, "lora_slots", "lora_rank"), ("lora_slots", "lora_rank", *out_axes),
                                ("lora_slots",))
    rows = np.asarray([[1, 0, 2], [2, 2, 0]], np.int32)
    set_adapter_rows(holder, jnp.asarray(rows))
    inputs = x.reshape(batch * length, *in_shape) if flattened else x
    y = np.asarray(adapted_project(holder, "w", jnp.asarray(inputs), jnp.float32, contract))
    axes = list(range(-contract, 0))
    expected = np.empty((batch, length, *out_shape))
    for i in range(batch):
        for t in range(length):
            xt = x[i, t].astype(np.float64)
            low_a, low_b = factors[rows[i, t]]
            expected[i, t] = np.tensordot(xt, w, (axes, list(range(contract)))) + scales[rows[i, t]] * np.tensordot(
                np.tensordot(xt, low_a, (axes, list(range(contract)))), low_b, 1)
    np.testing.assert_allclose(y.reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)
    set_adapter_rows(holder, jnp.zeros((batch, 2), jnp.int32))
    with pytest.raises(ValueError, match="does not match the call's"):
        adapted_project(holder, "w", jnp.asarray(x), jnp.float32, contract)
