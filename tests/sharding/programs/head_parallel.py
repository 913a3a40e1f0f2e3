"""Head-parallel KDA (`k3jax.sharding.heads`) on 8 devices (data=2 x tensor=4), against the ops on
whole arrays: the chunk form and the Pallas kernels (interpreted, both families) for a sequence,
one token, one token of pool rows and the conv pool, gradients of a sequence, and which KDA
layers `parallelize` gives one.

Prints one JSON object:
    errors      {case: largest absolute difference over the outputs}
    gradients   {implementation: largest relative difference of d(q, k, v, g, beta)}
    pool_spec   where the head-parallel pool step leaves the state pool
    layers      per mesh, whether parallelize set a HeadParallel (and its axes) on the KDA layers
"""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.layers.kda import KDALayer
from k3jax.model import K3Model
from k3jax.ops.kda import kda, kda_step
from k3jax.ops.kda.decode_pool import conv_pool_step, kda_pool_step
from k3jax.ops.kda.pallas import forced_kernels
from k3jax.sharding import make_mesh, parallelize
from k3jax.sharding.heads import HeadParallel
from tests.helpers import relative_error
from tests.sharding.programs.common import emit, mesh_config, small_k3_config

B, T, H, HV, K, CHUNK = 2, 32, 4, 8, 16, 16


def inputs():
    rng = np.random.default_rng(0)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q, k = (jnp.asarray(unit(rng.normal(size=(B, T, H, K))), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(B, T, HV, K)), jnp.float32)
    g = jnp.asarray(-3 * rng.random((B, T, HV, K)), jnp.float32)
    beta = jnp.asarray(rng.random((B, T, HV)), jnp.float32)
    pool = jnp.asarray(rng.normal(size=(5, HV, K, K)), jnp.float32)
    conv = jnp.asarray(rng.normal(size=(5, 3, 2 * H * K + HV * K)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(B, conv.shape[-1])), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(conv.shape[-1], 4)), jnp.float32)
    return q, k, v, g, beta, pool, conv, x, weight


def largest_difference(ours, theirs) -> float:
    return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)))


def op_cases(heads: HeadParallel, mesh, implementation: str) -> dict:
    q, k, v, g, beta, pool, conv, x, weight = inputs()
    rows = jnp.array([3, 1], jnp.int32)
    one = lambda a: a[:, 0]
    state = kda(q, k, v, g, beta, chunk_size=CHUNK, implementation="reference")[1]
    split_pool = jax.device_put(pool, NamedSharding(mesh, P(None, "tensor")))
    split_conv = jax.device_put(conv, NamedSharding(mesh, P(None, None, "tensor")))
    options = dict(implementation=implementation)
    cases = {
        "kda": (lambda *a: heads.kda(*a, initial_state=state, chunk_size=CHUNK, **options),
                lambda *a: kda(*a, initial_state=state, chunk_size=CHUNK, **options), (q, k, v, g, beta)),
        "kda_step": (lambda *a: heads.kda_step(*a, state, **options), lambda *a: kda_step(*a, state, **options),
                     tuple(map(one, (q, k, v, g, beta)))),
        "kda_pool_step": (lambda p, *a: heads.kda_pool_step(p, rows, *a, **options),
                          lambda p, *a: kda_pool_step(p, rows, *a, **options),
                          (split_pool, *map(one, (q, k, v, g, beta)))),
        "conv_pool_step": (lambda p, *a: heads.conv_pool_step(p, rows, *a, **options),
                           lambda p, *a: conv_pool_step(p, rows, *a, **options), (split_conv, x, weight)),
    }
    errors, spec = {}, None
    for name, (ours, theirs, args) in cases.items():
        got = jax.jit(ours)(*args)
        errors[f"{implementation}/{name}"] = largest_difference(got, theirs(*args))
        if name == "kda_pool_step":
            spec = str(got[1].sharding.spec)
    return errors, spec


def gradient_difference(heads: HeadParallel, implementation: str) -> float:
    q, k, v, g, beta = inputs()[:5]
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, HV, K)), jnp.float32)

    def loss(run):
        return lambda *a: jnp.sum(run(*a)[0] * weights) + jnp.sum(run(*a)[1])
    ours = jax.jit(jax.grad(loss(lambda *a: heads.kda(*a, chunk_size=CHUNK, implementation=implementation)),
                            argnums=range(5)))(q, k, v, g, beta)
    theirs = jax.grad(loss(lambda *a: kda(*a, chunk_size=CHUNK, implementation=implementation)),
                      argnums=range(5))(q, k, v, g, beta)
    return max(relative_error(a, b) for a, b in zip(ours, theirs))


def layers_on(**mesh_sizes) -> list:
    model = K3Model(small_k3_config("model.kda.num_heads=4").model, rngs=nnx.Rngs(0))
    parallelize(model, make_mesh(mesh_config(**mesh_sizes)), mesh_config(**mesh_sizes))
    return sorted({str(None if m.head_parallel is None else m.head_parallel.mesh.shape["tensor"])
                   for _, m in nnx.iter_modules(model) if isinstance(m, KDALayer)})


def main() -> None:
    mesh = make_mesh(mesh_config(data=2, tensor=4))
    heads = HeadParallel(mesh, mesh_config(data=2, tensor=4).rules)
    errors, specs = {}, set()
    for implementation in ("chunk", "pallas"):
        found, spec = op_cases(heads, mesh, implementation)
        errors.update(found)
        specs.add(spec)
    with forced_kernels("tpu"):
        found, spec = op_cases(heads, mesh, "pallas")
        errors.update({f"tpu-{name}": value for name, value in found.items()})
        specs.add(spec)
    emit({"errors": errors, "gradients": {impl: gradient_difference(heads, impl) for impl in ("chunk", "pallas")},
          "pool_spec": sorted(specs),
          "layers": {"data=2,tensor=4": layers_on(data=2, tensor=4), "data=8": layers_on(data=8),
                     "tensor=8": layers_on(tensor=8), "context=2,tensor=4": layers_on(context=2, tensor=4)}})


if __name__ == "__main__":
    main()
