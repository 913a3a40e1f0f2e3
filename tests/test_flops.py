"""`k3jax.flops` against XLA's own count of
the compiled forward (`compiled.cost_analysis()`), on a micro K3 whose forward has no loop (one
period of layers, one KDA chunk: XLA counts a loop's body once, whatever its trip count).

XLA counts what the program executes, which is more than the model count: with
``expert_matmul: dense`` every expert runs on every token (E / k = 2x the routed experts' products
here), the chunk form computes full C x C squares where the algorithm needs causal halves (about
2x the KDA count at one chunk, measured with bench.kda's inputs), dense attention the full T x T
square, and every elementwise operation (norms, gates, activations, softmax) counts one FLOP per
element. Hence the band: at least the model count, at most 1.6x it (1.38x measured on
configs/tiny.yaml). A count that forgets a part (the head, the latent projections, the shared
expert) or double-counts one falls outside it."""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from k3jax.config import load_config
from k3jax.model import K3Model
from k3jax.flops import attn_res_mix_sources, decode_flops, forward_flops, training_flops
from tests.helpers import MICRO


@pytest.fixture(scope="module")
def micro_config():
    return load_config(MICRO, ["model.kda.implementation=chunk"]).model


@pytest.mark.slow   # one forward compile (~15 s on 2 idle cores)
def test_forward_flops_bracket_xla_cost_analysis(micro_config):
    length = 32
    model = K3Model(micro_config, rngs=nnx.Rngs(0))
    graph, state = nnx.split(model)
    forward = jax.jit(lambda s, tokens: nnx.merge(graph, s)(tokens).logits)
    compiled = forward.lower(state, jnp.zeros((1, length), jnp.int32)).compile()
    executed = compiled.cost_analysis()["flops"] / length
    counted = forward_flops(micro_config, length).total
    assert 1.0 <= executed / counted <= 1.6, (executed, counted)


def test_training_is_three_forwards_and_attention_grows_with_the_context(micro_config):
    short, long = forward_flops(micro_config, 32), forward_flops(micro_config, 64)
    assert training_flops(micro_config, 32).total == pytest.approx(3 * short.total)
    mla = micro_config.mla
    per_key = 2 * mla.num_heads * (mla.qk_head_dim + mla.value_head_dim) * len(micro_config.mla_layer_indices)
    assert long.mla - short.mla == pytest.approx(per_key * 32 / 2)   # (T + 1) / 2 keys on average
    assert long.weights == short.weights


def test_attn_res_sources_follow_the_block_procedure(micro_config):
    # 4 layers, blocks of 2 (SPEC §3): layer 0 opens block 1 (no attention Mix), layer 2 block 2
    assert attn_res_mix_sources(micro_config) == [2, 2, 2, 2, 3, 3, 3, 3]


def test_a_decode_token_costs_the_weights_a_constant_delta_rule_and_attention_over_the_bank(micro_config):
    near, far = decode_flops(micro_config, 100), decode_flops(micro_config, 200)
    kda, mla = micro_config.kda, micro_config.mla
    layers_mla = len(micro_config.mla_layer_indices)
    assert near.weights == far.weights == forward_flops(micro_config, 32).weights
    assert near.kda == far.kda == (micro_config.num_layers - layers_mla) * 8 * kda.num_value_heads * kda.head_dim ** 2
    per_key = 2 * mla.num_heads * (2 * mla.kv_lora_rank + mla.rope_head_dim) * layers_mla    # absorbed form
    assert far.mla - near.mla == pytest.approx(per_key * 100) and near.mla == pytest.approx(per_key * 100)
    assert near.total == sum(near)
