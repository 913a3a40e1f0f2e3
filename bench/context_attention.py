"""MLA under context parallelism: all-gather of the compact latent vs ring passing, 8 fake CPU devices.

    python -m bench.context_attention [--length 16384] [--contexts 2 4 8] [--rounds 3]
                                      [--out bench_results/context_attention.json]

For each context size P it compiles the forward + backward of one `k3jax.layers.mla.MLALayer`
(the tiny model's MLA shapes, batch 1, packed documents) with ``ContextParallel(attention_method=
"all_gather" | "ring")`` and reports, per device: the result bytes of the context region's
collectives in the optimized HLO (`k3jax.training.plan.collective_bytes`; an all-gather's result includes
the shard's own part), the compiled temporaries, and the wall time
(interleaved rounds, `bench.common.interleaved_times`; the 8 "devices" share this machine's cores,
so times compare the two methods' compute and copies, not a network). Writes JSON atomically.
"""
from __future__ import annotations

import argparse
import sys

import k3jax  # noqa: F401  (XLA:CPU workaround before JAX starts)
import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from bench.common import interleaved_times, table  # noqa: E402
from bench.context_memory import mib, write_result  # noqa: E402
from k3jax.config import ConfigError, load_config  # noqa: E402
from k3jax.layers.mla import MLALayer  # noqa: E402
from k3jax.sharding.context import CONTEXT_ATTENTION, ContextParallel  # noqa: E402
from k3jax.training.plan import CONTEXT_AXIS, collective_bytes  # noqa: E402


def loss_and_grads(layer: MLALayer, segments: jax.Array):
    """A jitted ``(state, x) -> (loss, grads)`` of the layer as it is set up now."""
    graphdef, _ = nnx.split(layer)

    def loss(state, x):
        y, _ = nnx.merge(graphdef, state)(x, None, segments)
        return jnp.sum(y * jnp.cos(y))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench_results/context_attention.json")
    args = parser.parse_args()
    if any(p not in (2, 4, 8) or args.length % p for p in args.contexts) or args.rounds < 1:
        print("error: contexts among 2 4 8, each dividing --length; rounds positive", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
    except (ConfigError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    d_model = config.model.d_model
    layer = MLALayer(d_model, config.model.mla, init_std=0.02, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (1, args.length, d_model))
    third = args.length // 3
    segments = jnp.where(jnp.arange(args.length) < third, 1, 2)[None].astype(jnp.int32)
    _, state = nnx.split(layer)
    rows = []
    for contexts in args.contexts:
        mesh = jax.make_mesh((contexts,), ("context",), devices=jax.devices()[:contexts],
                             axis_types=(AxisType.Auto,))
        functions, row = [], {"contexts": contexts}
        for method in CONTEXT_ATTENTION:
            layer.context_parallel = ContextParallel(mesh, attention_method=method)
            compiled = loss_and_grads(layer, segments).lower(state, x).compile()
            moved = collective_bytes(compiled.as_text())
            row[method] = {"collective_bytes": {k: v for k, v in moved.items() if v},
                           "total_bytes": moved[CONTEXT_AXIS],
                           "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes)}
            functions.append(compiled)
        times = interleaved_times(functions, (state, x), args.rounds)
        for method, column in zip(CONTEXT_ATTENTION, times.T):
            row[method]["median_s"] = float(np.median(column))
        rows.append(row)
        print(row, flush=True)
    lines = [[r["contexts"], *(mib(r[m]["total_bytes"]) for m in CONTEXT_ATTENTION),
              *(mib(r[m]["temp_bytes"]) for m in CONTEXT_ATTENTION),
              *(f"{r[m]['median_s']:.3f}" for m in CONTEXT_ATTENTION)] for r in rows]
    print(table(["context", "all-gather MiB moved", "ring MiB moved", "all-gather temp MiB", "ring temp MiB",
                 "all-gather s", "ring s"], lines))
    write_result(args.out, rows, config=args.config, length=args.length)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
