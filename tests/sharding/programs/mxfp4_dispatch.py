"""MXFP4 routed experts expert-parallel on 8 devices: the capacity dispatch on (data=2, expert=4)
and on (expert=4, tensor=2) (each expert's hidden width split, whole scale blocks per device), and
the ragged dispatch (``ragged_all_to_all`` emulated, as XLA:CPU lacks it), each in fp32 and bf16
compute, against the dense layer on the decoded weights on one device. QLoRA ("qlora ..." cases, the
split-hidden capacity and the ragged dispatch): the MXFP4 layer with routed-expert adapters (the
low-rank term beside the decoded product) in fp32 and bf16 compute against the fp32 dense layer with
the same adapters merged into the decoded weights on one device, values and the gradients w.r.t.
the input and the adapters.

Prints one JSON object: {"<dispatch> <mesh> <dtype>": {"loss": relative error, "input_gradient":
relative error, "dropped": count}; QLoRA cases also "adapter_gradient": relative error}.
"""
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.config import MoEConfig
from k3jax.layers.lora import LoRA, attach_adapters
from k3jax.layers.moe import EXPERT_WEIGHTS
from k3jax.sharding import make_mesh, parallelize
from tests.helpers import relative_error
from tests.layers.test_moe_mxfp4 import build_pair
from tests.sharding.programs.common import emit, mesh_config
from tests.sharding.programs.moe_dispatch import emulated_ragged_all_to_all

D_MODEL, LATENT, WIDTH, EXPERTS, TOP_K, BATCH, LENGTH = 16, 32, 64, 8, 2, 8, 8
CASES = {"capacity data=2,expert=4": dict(data=2, expert=4, moe_dispatch="capacity", capacity_factor=4.0),
         "capacity expert=4,tensor=2": dict(expert=4, tensor=2, moe_dispatch="capacity", capacity_factor=4.0),
         "ragged data=2,expert=4": dict(data=2, expert=4, moe_dispatch="ragged")}


def make_pair(dtype):
    config = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, expert_width=WIDTH, latent_dim=LATENT, latent_norm=True,
                       num_shared_experts=1, expert_format="mxfp4", expert_tile=1)
    return build_pair(D_MODEL, config, dtype)


def loss_and_input_grad(model):
    graphdef, state = nnx.split(model)

    def loss(state, x):
        y, stats = nnx.merge(graphdef, state)(x)
        return jnp.sum(jnp.sin(y.astype(jnp.float32))), stats.dropped

    return jax.jit(jax.value_and_grad(loss, argnums=1, has_aux=True)), state


def run(model, x, mesh=None, mesh_cfg=None):
    """(loss, dropped, input gradient) of ``model`` on one device, or parallelized on ``mesh``."""
    if mesh is not None:
        model = parallelize(model, mesh, mesh_cfg)
        x = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
    step, state = loss_and_input_grad(model)
    if mesh is not None:
        state = jax.device_put(state, NamedSharding(mesh, P()))
    original = jax.lax.ragged_all_to_all
    jax.lax.ragged_all_to_all = emulated_ragged_all_to_all
    try:
        (value, dropped), grad = step(state, x)
    finally:
        jax.lax.ragged_all_to_all = original
    return value, dropped, grad


def check(case, dtype, x):
    quantized, dense = make_pair(dtype)
    reference, _, reference_grad = run(dense, x)
    mesh_cfg = mesh_config(**CASES[case])
    mesh = make_mesh(mesh_cfg)
    dense_value, _, dense_grad = run(dense, x, mesh, mesh_cfg)
    value, dropped, grad = run(quantized, x, mesh, mesh_cfg)
    return {"loss": relative_error(value, reference), "input_gradient": relative_error(grad, reference_grad),
            "loss_vs_dense_on_mesh": relative_error(value, dense_value),
            "input_gradient_vs_dense_on_mesh": relative_error(grad, dense_grad), "dropped": float(dropped)}


QLORA_CASES = ("capacity expert=4,tensor=2", "ragged data=2,expert=4")


def with_adapters(model):
    """``model`` with rank-4 adapters on its routed experts, B drawn non-zero (the same for any twin)."""
    attach_adapters(model, rank=4, alpha=2.0, dropout_rate=0.0, targets=(), routed_experts=True, seed=3)
    for index, name in enumerate(EXPERT_WEIGHTS):
        adapter = getattr(model.experts, f"{name}_lora")
        adapter.b[...] = 0.3 * jax.random.normal(jax.random.key(index), adapter.b.shape)
    return model


def adapter_loss_and_grads(model, x, mesh=None, mesh_cfg=None):
    """(loss, input gradient, adapter gradients flattened) of ``model``, on one device or on ``mesh``."""
    if mesh is not None:
        model = parallelize(model, mesh, mesh_cfg)
        x = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
    graphdef, adapters, rest = nnx.split(model, LoRA, ...)
    if mesh is not None:
        adapters, rest = jax.device_put((adapters, rest), NamedSharding(mesh, P()))

    def loss(adapters, x, rest):     # positive: its relative error stays meaningful in bf16
        y, _ = nnx.merge(graphdef, adapters, rest)(x)
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    original = jax.lax.ragged_all_to_all
    jax.lax.ragged_all_to_all = emulated_ragged_all_to_all
    try:
        value, (grads, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(adapters, x, rest)
    finally:
        jax.lax.ragged_all_to_all = original
    return value, dx, jnp.concatenate([g.reshape(-1) for g in jax.tree.leaves(grads)])


def check_qlora(case, dtype, x):
    """The QLoRA layer in ``dtype`` on the mesh against the fp32 dense layer with merged adapters on
    one device (a bf16 twin would round the merged weights W + s A B themselves)."""
    quantized, dense = with_adapters(make_pair(dtype)[0]), with_adapters(make_pair(jnp.float32)[1])
    reference, reference_dx, reference_grads = adapter_loss_and_grads(dense, x)
    mesh_cfg = mesh_config(**CASES[case])
    value, dx, grads = adapter_loss_and_grads(quantized, x, make_mesh(mesh_cfg), mesh_cfg)
    return {"loss": relative_error(value, reference), "input_gradient": relative_error(dx, reference_dx),
            "adapter_gradient": relative_error(grads, reference_grads), "dropped": 0.0}


def main():
    x = jax.random.normal(jax.random.key(1), (BATCH, LENGTH, D_MODEL))
    dtypes = (("fp32", jnp.float32), ("bf16", jnp.bfloat16))
    results = {f"{case} {name}": check(case, dtype, x) for case in CASES for name, dtype in dtypes}
    results.update({f"qlora {case} {name}": check_qlora(case, dtype, x) for case in QLORA_CASES
                    for name, dtype in dtypes})
    emit(results)


if __name__ == "__main__":
    main()
