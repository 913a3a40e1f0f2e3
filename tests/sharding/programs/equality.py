"""Loss, gradients and the balancing update of a small K3 on four meshes against one device.

Each mesh runs the model with expert parallelism (capacity dispatch, capacity_factor = E/k so no
assignment is dropped); the reference runs the same parameters and batch on one device without
a mesh. Prints, per mesh, the relative errors of the loss and of every gradient (the largest), the
largest difference of the quantile-balanced router biases, the dropped count, and how the
trainer's shard-by-shard initialisation compares with the eager parameters.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.data import make_dataset
from k3jax.model import K3Model
from k3jax.sharding import batch_sharding, make_mesh, named_shardings, parallelize
from k3jax.training import masked_cross_entropy, sharded_train_state, split_model
from tests.helpers import relative_error
from tests.sharding.programs.common import emit, mesh_config, small_k3_config
from k3jax.training import lay_out_run

MESHES = {
    "data=8": dict(data=8),
    "data=2,fsdp=4": dict(data=2, fsdp=4),
    "fsdp=2,expert=4": dict(fsdp=2, expert=4),
    "data=2,expert=2,tensor=2": dict(data=2, expert=2, tensor=2),
}


def make_step(parts):
    """(params, buffers, batch) -> (loss, grads, balanced router biases, dropped), jitted."""
    def loss_fn(params, buffers, batch):
        out = parts.merge(params, buffers)(batch["tokens"], segment_ids=batch["segment_ids"])
        loss_sum, count = masked_cross_entropy(out.logits, batch["targets"], batch["loss_mask"])
        return loss_sum / count, out.moe_stats

    def step(params, buffers, batch):
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, buffers, batch)
        model = parts.merge(params, buffers)
        model.update_router_bias(stats)
        return loss, grads, model.router_bias(), jnp.sum(stats.dropped)

    return jax.jit(step)


def sharded_initialisation(config, mesh_cfg, params):
    """(largest difference between the trainer's shard-by-shard initial parameters and the eager
    ones, whether every state array landed with the sharding the trainer asked for)."""
    layout = lay_out_run(dataclasses.replace(config, mesh=mesh_cfg))
    state = sharded_train_state(config.model, 0, layout.optimizer, layout.shardings.state)
    difference = max(float(np.max(np.abs(np.asarray(state.params[path]) - np.asarray(params[path]))))
                     for path in params)
    laid_out = all(array.sharding.is_equivalent_to(sharding, array.ndim) for array, sharding in
                   zip(jax.tree.leaves(state), jax.tree.leaves(layout.shardings.state)))
    return difference, laid_out


def main():
    config = small_k3_config()
    moe = config.model.moe
    parts, params, buffers = split_model(K3Model(config.model, rngs=nnx.Rngs(0)))
    batch = make_dataset(config.data).batch(0, config.train.batch_size)
    loss, grads, bias, _ = jax.device_get(make_step(parts)(params, buffers, batch))
    results = {}
    for name, sizes in MESHES.items():
        mesh_cfg = mesh_config(**sizes, moe_dispatch="capacity", capacity_factor=moe.num_experts / moe.top_k)
        mesh = make_mesh(mesh_cfg)
        args = (jax.device_put(params, named_shardings(parts.params.axes(), params, mesh_cfg.rules, mesh)),
                jax.device_put(buffers, named_shardings(parts.buffers.axes(), buffers, mesh_cfg.rules, mesh)),
                jax.device_put(batch, batch_sharding(mesh, mesh_cfg.rules)))
        mesh_parts, _, _ = split_model(parallelize(parts.merge(params, buffers), mesh, mesh_cfg))
        compiled = make_step(mesh_parts).lower(*args).compile()
        mesh_loss, mesh_grads, mesh_bias, dropped = jax.device_get(compiled(*args))
        init_difference, init_laid_out = sharded_initialisation(config, mesh_cfg, params)
        results[name] = {
            "initialisation": init_difference,
            "initialisation_laid_out": init_laid_out,
            "loss": relative_error(mesh_loss, loss),
            "gradients": max(relative_error(mesh_grads[path], grads[path]) for path in grads),
            "router_bias": float(np.max(np.abs(mesh_bias - bias))),
            "dropped": float(dropped),
        }
    emit(results)


if __name__ == "__main__":
    main()
