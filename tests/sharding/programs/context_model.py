"""Loss and gradients of the micro K3 with the sequence split over a `context` mesh axis against
one device: mesh.context = 2, 4, 8 and context=2 x expert=2 x data=2, packed documents that cross
shard boundaries (one starts exactly at the middle, a boundary of every split) and padding.

The model is `parallelize`d for each mesh (KDA and MLA layers run `k3jax.sharding.context`, batches
split [rows over data x fsdp x expert, sequence over context]); the reference runs the same
parameters and batch on one device without a mesh. Prints, per mesh, the relative errors of the
loss and of the gradients (the largest over parameters), whether every mixer got a
`ContextParallel` and whether the compiled step passes the conv halo (collective-permute).
"""
import sys

import jax
import numpy as np
from flax import nnx

from k3jax.layers.kda import KDALayer
from k3jax.layers.mla import MLALayer
from k3jax.model import K3Model
from k3jax.sharding import batch_sharding, make_mesh, named_shardings, parallelize
from k3jax.training import masked_cross_entropy, split_model
from tests.helpers import relative_error
from tests.sharding.programs.common import emit, mesh_config, small_k3_config

LENGTH, ROWS = 128, 4
MESHES = {
    "context=2": dict(context=2),
    "context=4": dict(context=4),
    "context=8": dict(context=8),
    "context=2,expert=2,data=2": dict(context=2, expert=2, data=2),
}
# 16-token KDA chunks and attention blocks so that every split has several per shard (KDA runs
# the recurrent reference form of micro.yaml, which compiles fastest; tests/ops check chunk = reference).
OVERRIDES = (f"data.seq_len={LENGTH}", f"train.batch_size={ROWS}", "model.kda.chunk_size=16",
             "model.mla.attention_block_size=16")


def packed_batch(vocab: int) -> dict:
    """Rows of documents ending inside shards (37, 104), at the middle (64), late (10) and none,
    and a row ending in padding (segment id 0, no loss)."""
    lengths = [[37, 27, 40, 24], [LENGTH], [10, 118], [100, 28]]
    segments = np.concatenate([np.repeat(np.arange(1, len(row) + 1), row)[None] for row in lengths]).astype(np.int32)
    segments[3, 100:] = 0
    tokens = np.asarray(jax.random.randint(jax.random.key(7), (ROWS, LENGTH), 0, vocab), np.int32)
    return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "segment_ids": segments,
            "loss_mask": (segments != 0).astype(np.float32)}


def loss_and_grads(parts):
    def loss_fn(params, buffers, batch):
        out = parts.merge(params, buffers)(batch["tokens"], segment_ids=batch["segment_ids"])
        loss_sum, count = masked_cross_entropy(out.logits, batch["targets"], batch["loss_mask"])
        return loss_sum / count

    return jax.jit(jax.value_and_grad(loss_fn))


def main():
    config = small_k3_config(*OVERRIDES)
    moe = config.model.moe
    model = K3Model(config.model, rngs=nnx.Rngs(0))
    parts, params, buffers = split_model(model)
    batch = packed_batch(config.model.vocab_size)
    loss, grads = jax.device_get(loss_and_grads(parts)(params, buffers, batch))
    results = {}
    for name, sizes in MESHES.items():
        mesh_cfg = mesh_config(**sizes, moe_dispatch="capacity", capacity_factor=moe.num_experts / moe.top_k)
        mesh = make_mesh(mesh_cfg, jax.devices()[:int(np.prod(list(sizes.values())))])
        args = (jax.device_put(params, named_shardings(parts.params.axes(), params, mesh_cfg.rules, mesh)),
                jax.device_put(buffers, named_shardings(parts.buffers.axes(), buffers, mesh_cfg.rules, mesh)),
                jax.device_put(batch, batch_sharding(mesh, mesh_cfg.rules)))
        parallel = parallelize(parts.merge(params, buffers), mesh, mesh_cfg)
        mixers = [m for _, m in nnx.iter_modules(parallel) if isinstance(m, (KDALayer, MLALayer))]
        compiled = loss_and_grads(split_model(parallel)[0]).lower(*args).compile()
        mesh_loss, mesh_grads = jax.device_get(compiled(*args))
        results[name] = {
            "loss": relative_error(mesh_loss, loss),
            "gradients": max(relative_error(mesh_grads[path], grads[path]) for path in grads),
            "every_mixer_split": bool(mixers) and all(m.context_parallel is not None for m in mixers),
            "halo_passed": "collective-permute" in compiled.as_text(),
            "batch_spec": str(args[2]["tokens"].sharding.spec),
            "finite": bool(np.isfinite(mesh_loss)),
        }
        print(name, results[name], file=sys.stderr, flush=True)
    results["reference_loss"] = float(loss)
    emit(results)


if __name__ == "__main__":
    main()
