"""Expert-parallel MoE layers on 8 devices: dropped tokens under a tight capacity, the dropless
ragged dispatch, all-to-all bytes of LatentMoE against plain MoE, and the mesh checks.

Prints one JSON object:
    capacity   dropped count of the capacity dispatch, the token rows' expert choices and the
               capacity parameters (the test recomputes the count with NumPy)
    ragged     relative errors of the ragged dispatch (ragged_all_to_all replaced by an
               all_gather emulation of its documented contract, as XLA:CPU lacks it) against
               the layer on one device, and the count of ragged_all_to_all calls in the same
               program lowered for CUDA
    bytes      all-to-all result bytes per device of LatentMoE and plain MoE (same d and top-k)
               in the compiled forward + backward programs
    histogram  the largest difference between the balancing histograms (and the biases read
               from them) of the 8-device layer and the one-device layer
    plan       `train.plan`'s figures for a one-MoE-layer K3 train step on mesh (data=2, expert=4)
    errors     the one-line ConfigErrors of meshes a run cannot use
"""
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.config import ConfigError, MoEConfig
from k3jax.layers.moe import MoE
from k3jax.ops.moe import updated_router_bias
from k3jax.sharding import check_run_fits, make_mesh, parallelize
from tests.helpers import relative_error
from tests.sharding.programs.common import emit, mesh_config, small_k3_config
from k3jax.training.plan import collective_bytes, plan_train_step

D_MODEL, LATENT, EXPERTS, TOP_K, BATCH, LENGTH = 32, 8, 8, 2, 8, 16
MESH = dict(data=2, expert=4)


def make_moe(latent_dim=LATENT, quantile_bins=None):
    config = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, expert_width=16, latent_dim=latent_dim,
                       latent_norm=latent_dim is not None, num_shared_experts=1, quantile_bins=quantile_bins)
    return nnx.split(MoE(D_MODEL, config, init_std=0.3, rngs=nnx.Rngs(0)))


def parallelized(graphdef, state, mesh, mesh_cfg):
    """The graph of the layer `parallelize`d for ``mesh`` (its state is unchanged)."""
    return nnx.split(parallelize(nnx.merge(graphdef, state), mesh, mesh_cfg))[0]


def loss_and_grad(graphdef):
    """(state, x) -> ((sum of y^2, (dropped, routing indices)), gradients for state and x), jitted.
    The input's gradient keeps the backward all-to-all of the dispatch alive, as in a model where
    x comes from earlier layers."""
    def loss(state, x):
        moe = nnx.merge(graphdef, state)
        y, stats = moe(x)
        indices, _, _ = moe.router(x.reshape(-1, D_MODEL))
        return jnp.sum(y.astype(jnp.float32) ** 2), (stats.dropped, indices)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def on_mesh_inputs(mesh, state, x):
    return (jax.device_put(state, NamedSharding(mesh, P())),
            jax.device_put(x, NamedSharding(mesh, P(("data", "expert")))))


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name, axis_index_groups=None):
    """``jax.lax.ragged_all_to_all`` by its documented contract, from all_gather: peer i's rows
    operand_i[input_offsets_i[j] : input_offsets_i[j] + send_sizes_i[j]] are written into peer j's
    ``output`` from output_offsets_i[j]; other rows of ``output`` are kept."""
    me = jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)
    starts, sizes, destinations = (jax.lax.all_gather(a, axis_name)[:, me]
                                   for a in (input_offsets, send_sizes, output_offsets))
    rows = jnp.arange(output.shape[0])
    inside = (rows >= destinations[:, None]) & (rows < (destinations + sizes)[:, None])
    source = jnp.argmax(inside, axis=0)
    source_row = jnp.clip(starts[source] + rows - destinations[source], 0, operand.shape[0] - 1)
    return jnp.where(jnp.any(inside, axis=0)[:, None], operands[source, source_row], output)


def capacity_check(graphdef, state, x):
    mesh_cfg = mesh_config(**MESH, moe_dispatch="capacity", capacity_factor=0.5)
    mesh = make_mesh(mesh_cfg)
    step = loss_and_grad(parallelized(graphdef, state, mesh, mesh_cfg))
    (_, (dropped, indices)), _ = step(*on_mesh_inputs(mesh, state, x))
    return {"dropped": float(dropped), "indices": jax.device_get(indices).tolist(), "shards": 8,
            "capacity_factor": 0.5, "num_experts": EXPERTS}


def ragged_check(graphdef, state, x):
    (reference, _), ref_grads = loss_and_grad(graphdef)(state, x)
    mesh_cfg = mesh_config(**MESH, moe_dispatch="ragged")
    mesh = make_mesh(mesh_cfg)
    step = loss_and_grad(parallelized(graphdef, state, mesh, mesh_cfg))
    args = on_mesh_inputs(mesh, state, x)
    abstract_args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), args)
    exported = jax.export.export(step, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(*abstract_args)
    original = jax.lax.ragged_all_to_all
    jax.lax.ragged_all_to_all = emulated_ragged_all_to_all
    try:
        (value, (dropped, _)), grads = loss_and_grad(parallelized(graphdef, state, mesh, mesh_cfg))(*args)
    finally:
        jax.lax.ragged_all_to_all = original
    return {"loss": relative_error(value, reference), "dropped": float(dropped),
            "gradients": max(relative_error(g, r) for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))),
            "cuda_ragged_all_to_all_calls": exported.mlir_module().count("stablehlo.custom_call @ragged_all_to_all")}


def all_to_all_bytes(latent_dim):
    graphdef, state = make_moe(latent_dim)
    x = jax.random.normal(jax.random.key(1), (BATCH, LENGTH, D_MODEL))
    mesh_cfg = mesh_config(**MESH, moe_dispatch="capacity")
    mesh = make_mesh(mesh_cfg)
    step = loss_and_grad(parallelized(graphdef, state, mesh, mesh_cfg))
    compiled = step.lower(*on_mesh_inputs(mesh, state, x)).compile()
    return collective_bytes(compiled.as_text())["all-to-all"]


def histogram_check(x):
    """Histograms of token shards add up to the one-device histogram, so the balanced bias agrees."""
    graphdef, state = make_moe(quantile_bins=64)

    def balanced(graphdef, state, x):
        moe = nnx.merge(graphdef, state)
        stats = moe(x)[1]
        bias = moe.router.e_score_correction_bias[...]
        return stats.bias_histogram, updated_router_bias(bias, stats, method="quantile", top_k=TOP_K)

    mesh_cfg = mesh_config(**MESH, moe_dispatch="capacity")
    mesh = make_mesh(mesh_cfg)
    histogram, bias = jax.jit(functools.partial(balanced, graphdef))(state, x)
    on_mesh = functools.partial(balanced, parallelized(graphdef, state, mesh, mesh_cfg))
    mesh_histogram, mesh_bias = jax.jit(on_mesh)(*on_mesh_inputs(mesh, state, x))
    return {"counted": int(jnp.sum(histogram)), "histogram": int(jnp.max(jnp.abs(mesh_histogram - histogram))),
            "bias": float(jnp.max(jnp.abs(mesh_bias - bias)))}


def plan_check():
    config = small_k3_config("model.num_layers=2", "model.mla_layers=[1]", "mesh.data=2", "mesh.expert=4",
                             "mesh.moe_dispatch=capacity")
    plan = plan_train_step(config)
    moe = config.model.moe
    return {"all_to_all_bytes_per_token": plan.all_to_all_bytes_per_token, "tokens": plan.tokens_per_step,
            "devices": plan.devices, "moe_layers": 1, "num_experts": moe.num_experts, "top_k": moe.top_k,
            "latent_dim": moe.latent_dim, "capacity_factor": config.mesh.capacity_factor,
            "parameters": plan.parameters, "optimizer_state": plan.optimizer_state,
            "temporaries": plan.temporaries, "peak": plan.peak}


def config_errors():
    """The ConfigError of each run a mesh cannot execute (8 CPU devices)."""
    cases = {
        "ragged on cpu": ("mesh.data=2", "mesh.expert=4", "mesh.moe_dispatch=ragged"),
        "experts do not split": ("mesh.data=1", "mesh.expert=8", "mesh.moe_dispatch=capacity"),
        "batch does not split": ("mesh.data=8", "train.batch_size=4"),
        "mesh is not the device count": ("mesh.data=2", "mesh.expert=2"),
    }
    errors = {}
    for name, overrides in cases.items():
        config = small_k3_config(*overrides)
        try:
            check_run_fits(config, make_mesh(config.mesh))
        except ConfigError as error:
            errors[name] = str(error)
    return errors


def main():
    graphdef, state = make_moe()
    x = jax.random.normal(jax.random.key(1), (BATCH, LENGTH, D_MODEL))
    emit({
        "capacity": capacity_check(graphdef, state, x),
        "ragged": ragged_check(graphdef, state, x),
        "bytes": {"latent": all_to_all_bytes(LATENT), "plain": all_to_all_bytes(None), "d_model": D_MODEL,
                  "latent_dim": LATENT},
        "histogram": histogram_check(x),
        "plan": plan_check(),
        "errors": config_errors(),
    })


if __name__ == "__main__":
    main()
