"""MXFP4 routed experts expert-parallel on 8 devices: the capacity dispatch on (data=2, expert=4)
and on (expert=4, tensor=2) (each expert's hidden width split, whole scale blocks per device), and
the ragged dispatch (``ragged_all_to_all`` emulated, as XLA:CPU lacks it), each in fp32 and bf16
compute, against the dense layer on the decoded weights on one device.

Prints one JSON object: {"<dispatch> <mesh> <dtype>": {"loss": relative error, "input_gradient":
relative error, "dropped": count, "local_codes_bytes": bytes of expert codes + scales per device}}.
"""
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.config import MoEConfig
from k3jax.sharding import make_mesh, parallelize
from tests.layers.test_moe_mxfp4 import build_pair
from tests.sharding.programs.common import emit, mesh_config, relative_error
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


def main():
    x = jax.random.normal(jax.random.key(1), (BATCH, LENGTH, D_MODEL))
    emit({f"{case} {name}": check(case, dtype, x) for case in CASES
          for name, dtype in (("fp32", jnp.float32), ("bf16", jnp.bfloat16))})


if __name__ == "__main__":
    main()
