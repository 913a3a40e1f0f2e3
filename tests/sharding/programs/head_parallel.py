"""Head-parallel kernels (`k3jax.sharding.heads`) on 8 devices (data=2 x tensor=4), against the ops
on whole arrays: KDA's chunk form and Pallas kernels (interpreted, both families) for a sequence,
one token, one token of pool rows and the conv pool, gradients of a sequence, and which KDA
layers `parallelize` gives one; MLA's splash attention (the TPU kernel, interpreted) with
segments, its gradients, and the micro K3 with splash attention on the mesh against XLA's
attention on one device.

Prints one JSON object:
    errors      {case: largest absolute difference over the outputs}
    gradients   {implementation: largest relative difference of d(q, k, v, g, beta) (splash: d(q, k, v))}
    pool_spec   where the head-parallel pool step leaves the state pool
    layers      per mesh, whether parallelize set a HeadParallel (and its axes) on the KDA layers
    mla_layers  per mesh, whether it set one on the MLA layers
    splash_model  the largest absolute difference of the micro K3's logits
"""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.layers.kda import KDALayer
from k3jax.layers.mla import MLALayer
from k3jax.model import K3Model
from k3jax.ops.attention import attention
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


def layers_on(kind=KDALayer, **mesh_sizes) -> list:
    model = K3Model(small_k3_config("model.kda.num_heads=4").model, rngs=nnx.Rngs(0))
    parallelize(model, make_mesh(mesh_config(**mesh_sizes)), mesh_config(**mesh_sizes))
    return sorted({str(None if m.head_parallel is None else m.head_parallel.mesh.shape["tensor"])
                   for _, m in nnx.iter_modules(model) if isinstance(m, kind)})


def splash_cases(heads: HeadParallel) -> tuple[float, float]:
    """Splash attention (interpreted) on each device's rows and heads against XLA's attention on
    whole arrays, two documents a row: (largest output difference, largest relative gradient
    difference of d(q, k, v)); qk and v head widths differ, as MLA's do."""
    rng = np.random.default_rng(2)
    length = 128                                       # splash's default block
    q, k = (jnp.asarray(rng.normal(size=(B, length, H, 48)), jnp.float32) for _ in range(2))
    v, weights = (jnp.asarray(rng.normal(size=(B, length, H, 32)), jnp.float32) for _ in range(2))
    segments = jnp.asarray(np.repeat([[0] * 50 + [1] * 78], B, 0), jnp.int32)
    options = dict(scale=0.1, query_segments=segments, key_segments=segments)
    ours = lambda *a: heads.attention(*a, implementation="splash", **options)         # noqa: E731
    theirs = lambda *a: attention(*a, implementation="xla", **options)               # noqa: E731
    loss = lambda run: lambda *a: jnp.sum(run(*a) * weights)                          # noqa: E731
    with forced_kernels("tpu"):
        error = largest_difference(jax.jit(ours)(q, k, v), theirs(q, k, v))
        gradients = jax.jit(jax.grad(loss(ours), argnums=range(3)))(q, k, v)
    expected = jax.grad(loss(theirs), argnums=range(3))(q, k, v)
    return error, max(relative_error(a, b) for a, b in zip(gradients, expected))


def splash_model_difference() -> float:
    """The micro K3 (4 heads a mixer) with splash attention, interpreted, parallelized over
    data=2 x tensor=4, against the same weights with XLA's attention on one device."""
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 200, (2, 128)), jnp.int32)
    sizes = dict(data=2, tensor=4)

    def logits(*overrides, mesh=None):
        config = small_k3_config("model.kda.num_heads=4", "model.mla.num_heads=4", *overrides)
        model = K3Model(config.model, rngs=nnx.Rngs(0))
        if mesh is not None:
            parallelize(model, mesh, mesh_config(**sizes))
        with forced_kernels("tpu"):
            return nnx.jit(lambda m, t: m(t).logits)(model, tokens)
    return largest_difference(logits("model.mla.attention_implementation=splash", mesh=make_mesh(mesh_config(**sizes))),
                              logits())


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
    errors["splash/attention"], splash_gradients = splash_cases(heads)
    emit({"errors": errors, "gradients": {**{impl: gradient_difference(heads, impl) for impl in ("chunk", "pallas")},
                                          "splash": splash_gradients},
          "pool_spec": sorted(specs),
          "layers": {"data=2,tensor=4": layers_on(data=2, tensor=4), "data=8": layers_on(data=8),
                     "tensor=8": layers_on(tensor=8), "context=2,tensor=4": layers_on(context=2, tensor=4)},
          "mla_layers": {"data=2,tensor=4": layers_on(MLALayer, data=2, tensor=4),
                         "context=2,tensor=4": layers_on(MLALayer, context=2, tensor=4)},
          "splash_model": splash_model_difference()})


if __name__ == "__main__":
    main()
