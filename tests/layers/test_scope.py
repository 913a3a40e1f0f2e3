"""Layer names on the operations of a forward and backward (`k3jax.layers.scope`), and how
`bench.step_profile` reads them back into components."""
import jax
import jax.numpy as jnp
from flax import nnx

from bench.step_profile import REST, component, instruction_op_names
from k3jax.config import load_config
from k3jax.model import K3Model
from tests.helpers import CONFIGS


def test_component_is_the_innermost_k3jax_scope_and_marks_the_backward():
    assert component("jit(train_step)/jvp(K3Model)/while/body/closed_call/KDALayer/checkpoint/eq") == "KDALayer"
    assert component("jit(train_step)/transpose(jvp(K3Model))/MoE/RoutedExperts/dot_general") == \
        "RoutedExperts backward"
    assert component("jit(train_step)/Optimizer/vmap()/closed_call/mul") == "Optimizer"
    assert component("jit(train_step)/jit(_where)/select_n") == REST


def test_every_layer_of_a_training_forward_and_backward_is_named():
    config = load_config(CONFIGS / "tiny.yaml", ["model.num_layers=2", "model.mla_period=2"]).model  # KDA, MLA
    graphdef, params = nnx.split(K3Model(config, rngs=nnx.Rngs(0)))
    tokens = jnp.zeros((2, 16), jnp.int32)

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params)(tokens).logits ** 2)

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)   # a cached program may predate the names
    try:
        hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
    op_names = instruction_op_names(hlo)
    found = {component(name) for name in op_names.values()}
    layers = {"K3Model", "KDALayer", "MLALayer", "AttnRes", "DenseGLU", "MoE", "Router", "RoutedExperts"}
    assert layers | {f"{layer} backward" for layer in layers} <= found, found
    # operations inside the KDA chunk loop carry the layer name too
    assert any(component(n) == "KDALayer backward" and "while" in n for n in op_names.values())
