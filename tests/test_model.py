"""The K3 stack: prefill/decode consistency, causality, packed documents, AttnRes at init,
training, gradients, parameter metadata and counts, memory bank, generation (SPEC §§0-6)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from k3jax.config import load_config
from k3jax.inference.generation import generate
from k3jax.layers.params import logical_axes
from k3jax.memory import init_memory, memory_bytes
from k3jax.model import DecoderLayer, K3Model, param_counts
from tests.helpers import CONFIGS, rel_err
from tests.ops import numpy_moe as ref_moe

# tiny.yaml with a 2-layer period (1 KDA : 1 MLA, AttnRes blocks of 2) and 7 layers, so a short
# stack has every group: unrolled prefix (0, 1), scanned body (2, 3) x 2, unrolled suffix (6).
MICRO = ["model.num_layers=7", "model.mla_period=2", "model.attn_res.block_size=2"]
BATCH, LENGTH = 2, 12

forward = nnx.jit(lambda model, tokens, segment_ids: model(tokens, segment_ids=segment_ids))
continue_ = nnx.jit(lambda model, tokens, memory: model(tokens, memory=memory))


def micro_config(*overrides):
    return load_config(CONFIGS / "tiny.yaml", MICRO + list(overrides)).model


@pytest.fixture(scope="module")
def model():
    return K3Model(micro_config(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tokens(model):
    return jax.random.randint(jax.random.key(1), (BATCH, LENGTH), 0, model.config.vocab_size)


def no_segments(tokens):
    """Every row one document (segment id 0 would mark padding)."""
    return jnp.ones(tokens.shape, jnp.int32)


def test_layer_groups_cover_prefix_scanned_body_and_suffix(model):
    assert model.groups.prefix == (0, 1) and model.groups.body == (2, 3)
    assert model.groups.repeats == 2 and model.groups.suffix == (6,)


PREFILL_THEN_DECODE = [(0, 8)] + [(t, t + 1) for t in range(8, LENGTH)]


def in_pieces(model, tokens, pieces):
    """``(logits, memory)`` of ``tokens`` fed to ``model`` piece by piece (``[(start, stop), ...]``),
    the memory carried from each piece to the next."""
    memory, logits = init_memory(model.config, BATCH, LENGTH), []
    for start, stop in pieces:
        out = continue_(model, tokens[:, start:stop], memory)
        logits.append(out.logits)
        memory = out.memory
    return jnp.concatenate(logits, axis=1), memory


@pytest.mark.slow   # 15-60 s of the default set's CPU: in .ci/run's slow set
def test_prefill_then_decode_equals_one_forward(model, tokens):
    full = forward(model, tokens, no_segments(tokens)).logits
    logits, memory = in_pieces(model, tokens, PREFILL_THEN_DECODE)
    assert rel_err(logits, full) <= 1e-4
    np.testing.assert_array_equal(memory.mla.length, LENGTH)
    logits, _ = in_pieces(model, tokens, [(0, 8), (8, 11), (11, 12)])   # three uneven pieces
    assert rel_err(logits, full) <= 1e-4


KIMI_LINEAR_STYLE = ["model.attn_res.kind=none", "model.kda.gate=softplus", "model.kda.output_gate=low_rank",
                     "model.kda.value_heads=4", "model.mla.q_lora_rank=null", "model.mla.output_gate=false",
                     "model.activation=swiglu", "model.moe.latent_dim=null", "model.moe.latent_norm=false",
                     "model.moe.routed_scale=2.446", "model.moe.balancing=sign"]


@pytest.mark.slow
def test_kimi_linear_style_stack_prefill_then_decode_equals_one_forward(tokens):
    """The other reference family at tiny size: PreNorm residual, softplus gate, low-rank output
    gate, grouped values, ungated MLA without q-LoRA, SwiGLU, plain MoE, sign balancing."""
    model = K3Model(micro_config(*KIMI_LINEAR_STYLE), rngs=nnx.Rngs(0))
    full = forward(model, tokens, no_segments(tokens))
    logits, _ = in_pieces(model, tokens, PREFILL_THEN_DECODE)
    assert rel_err(logits, full.logits) <= 1e-4
    model.update_router_bias(full.moe_stats)   # sign balancing: each bias moves by -rate, 0 or +rate
    steps = np.round(np.asarray(model.router_bias()) / model.config.moe.bias_update_rate)
    assert set(np.unique(steps)) <= {-1.0, 0.0, 1.0} and np.abs(steps).sum() > 0


def test_changing_a_token_changes_no_earlier_logit(model, tokens):
    changed = tokens.at[:, 6].set((tokens[:, 6] + 1) % model.config.vocab_size)
    before = forward(model, tokens, no_segments(tokens)).logits
    after = forward(model, changed, no_segments(tokens)).logits
    np.testing.assert_allclose(after[:, :6], before[:, :6], rtol=1e-6, atol=1e-6)
    assert np.abs(after[:, 6:] - before[:, 6:]).max() > 1e-3


def test_packed_documents_equal_documents_run_alone(model, tokens):
    """Rows of ``tokens`` start with documents a and b; by causality, their first 6 logits are the
    documents run alone. Packing [a | b] and [b | a] with segment ids must reproduce them."""
    half = LENGTH // 2
    a, b = tokens[0, :half], tokens[1, :half]
    alone = forward(model, tokens, no_segments(tokens)).logits[:, :half]
    packed = jnp.stack([jnp.concatenate([a, b]), jnp.concatenate([b, a])])
    segments = jnp.asarray([[3] * half + [4] * half] * 2)
    together = forward(model, packed, segments).logits
    assert rel_err(together[0, :half], alone[0]) <= 1e-5 and rel_err(together[0, half:], alone[1]) <= 1e-5
    assert rel_err(together[1, :half], alone[1]) <= 1e-5 and rel_err(together[1, half:], alone[0]) <= 1e-5


def test_fresh_block_attnres_equals_prenorm_residual(model, tokens):
    """Zero pseudo-queries make every Mix a mean of the sources, i.e. the running sum / n; the
    next RMSNorm removes the 1/n (exactly so for eps -> 0, hence the tiny eps here)."""
    block = K3Model(micro_config("model.norm_eps=1e-12"), rngs=nnx.Rngs(0))
    plain = K3Model(micro_config("model.norm_eps=1e-12", "model.attn_res.kind=none"), rngs=nnx.Rngs(7))
    assert plain.groups == block.groups
    block_params = dict(nnx.to_flat_state(nnx.state(block, nnx.Param)))
    plain_state = nnx.state(plain, nnx.Param)
    for path, variable in nnx.to_flat_state(plain_state):
        variable[...] = block_params[path][...]
    nnx.update(plain, plain_state)
    assert len(block_params) > len(list(nnx.to_flat_state(plain_state)))   # block has the AttnRes pairs
    logits = [forward(m, tokens, no_segments(tokens)).logits for m in (block, plain)]
    assert rel_err(*logits) <= 1e-5


def next_token_loss(model, tokens):
    logits = model(tokens[:, :-1]).logits
    return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))


@pytest.mark.slow   # 15-60 s of the default set's CPU: in .ci/run's slow set
def test_adamw_steps_reduce_loss_and_gradients_reach_every_parameter(tokens):
    # The token-serial KDA compiles its backward ~2.5x faster than the chunked form; the op tests
    # check that both give the same values and gradients.
    model = K3Model(micro_config("model.kda.implementation=reference"), rngs=nnx.Rngs(3))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, tokens):
        loss, grads = nnx.value_and_grad(next_token_loss)(model, tokens)
        optimizer.update(model, grads)
        return loss, grads

    losses = []
    for _ in range(4):
        loss, grads = train_step(model, optimizer, tokens)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05, losses

    # The last step's gradients (after updates, so pseudo-queries are no longer zero and the
    # key-norm gains see gradient too): only layer 0's attention-res pair is unused (SPEC §3).
    unused = {("prefix", "layers", 0, "attention_res", "query"), ("prefix", "layers", 0, "attention_res", "key_norm")}
    for path, grad in nnx.to_flat_state(grads):
        grad = np.asarray(grad[...])
        if path in unused:
            assert not grad.any(), path
            continue
        per_layer = grad.reshape(model.groups.repeats, -1) if path[0] == "body" else grad.reshape(1, -1)
        assert np.all(np.abs(per_layer).max(axis=1) > 0), path


def remat_loss_grads_and_temporaries(tokens, remat):
    model = K3Model(micro_config("model.kda.implementation=reference", "model.num_layers=6", f"model.remat={remat}"),
                    rngs=nnx.Rngs(3))
    graphdef, params = nnx.split(model)
    batch = jnp.tile(tokens, (4, 8))           # long enough for activations to dominate
    compiled = jax.jit(jax.value_and_grad(lambda p, t: next_token_loss(nnx.merge(graphdef, p), t))).lower(
        params, batch).compile()
    loss, grads = compiled(params, batch)
    return loss, jax.tree.leaves(grads), compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow   # 15-60 s of the default set's CPU: in .ci/run's slow set
@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_keeps_loss_and_gradients_and_saves_activation_memory(tokens, remat):
    """Checkpointed periods recompute the same forward: equal loss and gradients, and the
    compiled backward keeps fewer temporaries than without checkpointing (full remat)."""
    loss, grads, temporaries = remat_loss_grads_and_temporaries(tokens, "none")
    remat_loss, remat_grads, remat_temporaries = remat_loss_grads_and_temporaries(tokens, remat)
    assert rel_err(remat_loss, loss) <= 1e-6, remat
    scale = max(float(np.abs(grad).max()) for grad in grads)
    for grad, remat_grad in zip(grads, remat_grads):   # fp32 recomputation: rounding differs
        np.testing.assert_allclose(remat_grad, grad, rtol=1e-4, atol=1e-6 * scale, err_msg=remat)
    if remat == "full":
        assert remat_temporaries < temporaries, (remat_temporaries, temporaries)


def test_parameters_carry_logical_axes_and_stacked_ones_name_layers(model):
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        axes = logical_axes(variable)
        assert len(axes) == variable[...].ndim, path
        assert (axes[0] == "layers") == (path[0] == "body"), path


def test_moe_stats_and_router_bias_follow_layer_order(model, tokens):
    out = forward(model, tokens, no_segments(tokens))
    num_moe, experts = model.config.num_layers - 1, model.config.moe.num_experts
    assert out.moe_stats.expert_load.shape == (num_moe, experts)
    np.testing.assert_allclose(out.moe_stats.expert_load.sum(-1), BATCH * LENGTH * model.config.moe.top_k)
    padded = no_segments(tokens).at[:, LENGTH // 3:].set(0)         # segment id 0: padding, not balanced
    padded_stats = forward(model, tokens, padded).moe_stats
    np.testing.assert_allclose(padded_stats.expert_load.sum(-1), BATCH * (LENGTH // 3) * model.config.moe.top_k)
    np.testing.assert_array_equal(padded_stats.token_mask, np.asarray(padded).reshape(1, -1).repeat(num_moe, 0) != 0)
    bias = model.router_bias()
    assert bias.shape == (num_moe, experts) and not bias.any()
    new_bias = jnp.arange(num_moe * experts, dtype=jnp.float32).reshape(num_moe, experts)
    model.set_router_bias(new_bias)
    np.testing.assert_array_equal(model.router_bias(), new_bias)
    np.testing.assert_array_equal(model.suffix.layers[0].ffn.router.e_score_correction_bias[...], new_bias[-1])
    np.testing.assert_array_equal(model.body.layers[1].ffn.router.e_score_correction_bias[...][1], new_bias[4])

    model.update_router_bias(out.moe_stats)   # quantile balancing: overwritten, centred per layer
    bias = model.router_bias()
    assert np.all(np.abs(bias - new_bias).max(axis=1) > 0)
    np.testing.assert_allclose(bias.mean(axis=1), 0.0, atol=1e-4)
    model.set_router_bias(jnp.zeros_like(new_bias))


@pytest.mark.slow   # 15-60 s of the default set's CPU: in .ci/run's slow set
def test_greedy_generation_matches_decoding_and_stops_at_eos(model, tokens):
    prompt = tokens[:, :8]
    greedy = generate(model, prompt, max_new_tokens=4)
    out = continue_(model, prompt, init_memory(model.config, BATCH, LENGTH))
    expected = []
    for _ in range(4):
        expected.append(jnp.argmax(out.logits[:, -1], axis=-1))
        out = continue_(model, expected[-1][:, None], out.memory)
    np.testing.assert_array_equal(greedy.tokens, jnp.stack(expected, axis=1))
    np.testing.assert_array_equal(greedy.lengths, 4)

    eos = int(greedy.tokens[0, 1])
    stopped = generate(model, prompt, max_new_tokens=4, eos_id=eos)
    assert int(stopped.lengths[0]) == 2 and np.all(stopped.tokens[0, 1:] == eos)

    sampled = [generate(model, prompt, max_new_tokens=4, temperature=1.0, top_p=0.9, seed=s).tokens for s in (5, 5, 6)]
    np.testing.assert_array_equal(sampled[0], sampled[1])
    assert not np.array_equal(sampled[0], sampled[2])
    top1 = generate(model, prompt, max_new_tokens=4, temperature=2.0, top_k=1, seed=3)
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)


# k3.yaml's 61 layers take about a minute of CPU to trace (flax's RNG counter updates scan the
# whole trace for each parameter): slow set.
@pytest.mark.parametrize("name, total, active", [pytest.param("k3.yaml", 2779.5e9, 104.2e9, marks=pytest.mark.slow),
                                                 ("kimi-linear-48b.yaml", 49.1e9, 3.1e9)])
def test_param_counts_match_the_released_models(name, total, active):
    counted_total, counted_active = param_counts(load_config(CONFIGS / name).model)
    assert abs(counted_total / total - 1) < 0.005 and abs(counted_active / active - 1) < 0.005, \
        (counted_total, counted_active)


def test_memory_bank_kda_share_is_constant_and_mla_share_linear():
    for name in ("tiny.yaml", "k3.yaml"):
        config = load_config(CONFIGS / name).model
        sizes = [memory_bytes(config, length) for length in (1024, 2048, 3072)]
        assert sizes[0]["kda"] == sizes[1]["kda"] == sizes[2]["kda"]
        assert sizes[1]["mla"] - sizes[0]["mla"] == sizes[2]["mla"] - sizes[1]["mla"] > 0
    k3 = load_config(CONFIGS / "k3.yaml").model
    state_per_layer = 96 * 128 * 128 * 4                        # SPEC §1: ~6.3 MB per layer
    conv_per_layer = 3 * (3 * 96 * 128) * 2                     # W-1 taps of q|k|v in bf16
    assert memory_bytes(k3, 1)["kda"] == 69 * (state_per_layer + conv_per_layer)
    assert sizes[1]["mla"] - sizes[0]["mla"] == 24 * 1024 * 576 * 2


def test_init_memory_layout(model):
    memory = init_memory(model.config, 3, 10)
    kda, mla = model.config.kda, model.config.mla
    assert model.config.mla_layer_indices == (1, 3, 5, 6)
    assert memory.kda.state.shape == (3, 3, kda.num_value_heads, kda.head_dim, kda.head_dim)
    assert memory.kda.state.dtype == jnp.float32
    assert memory.kda.conv.shape == (3, 3, kda.conv_size - 1, 3 * kda.num_heads * kda.head_dim)
    assert memory.mla.latent.shape == (4, 3, 10, mla.kv_lora_rank + mla.rope_head_dim)
    assert memory.mla.length.shape == memory.mla.document_start.shape == (4, 3)


def test_a_prefill_longer_than_the_cache_is_refused(model, tokens):
    with pytest.raises(ValueError, match=f"holds {LENGTH - 1} tokens per sequence; 0 are used and {LENGTH} more do not fit"):
        model(tokens, memory=init_memory(model.config, BATCH, LENGTH - 1))


def test_tied_embeddings_make_the_head_the_transposed_embedding():
    """One parameter: the tied logits are the untied model's with lm_head = E^T, and the tied
    embedding's gradient is the sum of the untied embedding and head gradients (chain rule)."""
    tied = K3Model(micro_config("model.tie_embeddings=true", "model.num_layers=1"), rngs=nnx.Rngs(5))  # one MLA layer
    untied = K3Model(micro_config("model.num_layers=1"), rngs=nnx.Rngs(5))
    untied.lm_head[...] = tied.embedding[...].T
    assert not hasattr(tied, "lm_head")
    vocab, d = tied.embedding[...].shape
    tokens = jax.random.randint(jax.random.key(1), (BATCH, LENGTH), 0, vocab)
    assert param_counts(untied.config)[0] - param_counts(tied.config)[0] == vocab * d
    probe = jax.random.normal(jax.random.key(6), (BATCH, LENGTH, vocab))
    loss = lambda m: jnp.sum(m(tokens).logits * probe)  # noqa: E731
    value_and_grad = nnx.jit(nnx.value_and_grad(loss))
    (tied_loss, tied_grads), (untied_loss, untied_grads) = value_and_grad(tied), value_and_grad(untied)
    assert rel_err(tied_loss, untied_loss) < 1e-6
    expected = np.asarray(untied_grads["embedding"][...]) + np.asarray(untied_grads["lm_head"][...]).T
    assert rel_err(tied_grads["embedding"][...], expected) < 1e-5
    assert np.abs(np.asarray(untied_grads["lm_head"][...])).max() > 0


def test_decoder_layers_read_the_feed_forward_fields_of_the_config():
    """SiTU betas, router score, renormalisation and grouped top-k reach the dense FFN and the
    MoE of a decoder layer (checked against the float64 NumPy feed-forward)."""
    config = micro_config("model.situ_beta=2.0", "model.situ_linear_beta=null", "model.moe.router_score=softmax",
                          "model.moe.renormalize=false", "model.moe.num_experts=8", "model.moe.expert_groups=4",
                          "model.moe.topk_groups=2", "model.init_std=0.5")
    activation = functools.partial(ref_moe.situ_glu, beta=2.0, beta_linear=None)
    x = np.random.default_rng(7).standard_normal((1, 5, config.d_model))
    dense = DecoderLayer(config, 0, rngs=nnx.Rngs(8)).ffn
    weights = (np.asarray(w[...], np.float64) for w in (dense.w_gate, dense.w_up, dense.w_down))
    expected = ref_moe.glu(x, *weights, activation)
    call = nnx.jit(lambda layer, x: layer(x))   # one program per layer, not one per eager operation
    assert rel_err(call(dense, jnp.asarray(x, jnp.float32)), expected) < 1e-5

    moe = DecoderLayer(config, 1, rngs=nnx.Rngs(9)).ffn
    f64 = lambda v: np.asarray(v[...], np.float64)  # noqa: E731
    p = {"router": f64(moe.router.weight), "bias": f64(moe.router.e_score_correction_bias),
         "w_gate": f64(moe.experts.w_gate), "w_up": f64(moe.experts.w_up), "w_down": f64(moe.experts.w_down),
         "latent_down": f64(moe.latent_down), "latent_up": f64(moe.latent_up),
         "latent_norm": f64(moe.latent_norm_weight), "shared_gate": f64(moe.shared.w_gate),
         "shared_up": f64(moe.shared.w_up), "shared_down": f64(moe.shared.w_down)}
    y, _ = call(moe, jnp.asarray(x, jnp.float32))
    expected, _, _ = ref_moe.moe_forward(x.reshape(-1, config.d_model), p, config.moe.top_k, activation,
                                         score="softmax", renormalize=False, expert_groups=4, topk_groups=2)
    assert rel_err(y.reshape(-1, config.d_model), expected) < 1e-4


# 2 layers (one KDA, one MLA) in the fast set; the 7-layer stack (MLA also in the scanned body) is slow.
@pytest.mark.slow   # 15-60 s of the default set's CPU: in .ci/run's slow set
@pytest.mark.parametrize("num_layers", [2, 7])
def test_blockwise_attention_keeps_logits_and_gradients_of_dense_attention(tokens, num_layers):
    """MLA with the xla blockwise attention (blocks of 5 over 12 tokens, documents crossing
    blocks) against the dense score matrix: the same logits and parameter gradients."""
    segments = jnp.array([[1] * 7 + [2] * 5, [3] * 12], jnp.int32)

    def loss_and_grads(implementation):
        model = K3Model(micro_config(f"model.mla.attention_implementation={implementation}",
                                     "model.mla.attention_block_size=5", f"model.num_layers={num_layers}"),
                        rngs=nnx.Rngs(0))
        loss = lambda m: jnp.mean(m(tokens, segment_ids=segments).logits ** 2)
        return nnx.jit(nnx.value_and_grad(loss))(model), forward(model, tokens, segments).logits

    (loss_xla, grads_xla), logits_xla = loss_and_grads("xla")
    (loss_dense, grads_dense), logits_dense = loss_and_grads("dense")
    assert rel_err(logits_xla, logits_dense) < 1e-5
    assert abs(float(loss_xla) - float(loss_dense)) <= 1e-5 * abs(float(loss_dense))
    for got, want in zip(jax.tree.leaves(grads_xla), jax.tree.leaves(grads_dense)):
        assert np.abs(np.asarray(got)).max() == 0 if np.abs(np.asarray(want)).max() == 0 else rel_err(got, want) < 1e-4
