"""Step time of the routed experts with dense bf16 vs MXFP4 weights on an accelerator (GPU / TPU).

    python -m bench.mxfp4_gpu [--experts 16 --width 3584 --hidden 3072 --tokens 4096 --top-k 8]
                              [--tiles 4 16] [--pallas] [--rounds 10] [--out bench_results/mxfp4_gpu.json]

Times, interleaved round by round (`bench.common.interleaved_times`), the jitted forward + backward
(w.r.t. the input) of `k3jax.ops.moe.routed_experts` in bf16 compute for the experts held as dense
bf16 arrays (``lax.ragged_dot``) and as `k3jax.ops.mxfp4.Mxfp4Experts` decoded G experts at a time
by the XLA loop for each G of ``--tiles``; with ``--pallas`` also the Pallas kernel with in-kernel
decode (`k3jax.ops.mxfp4_pallas`; compiled on TPU only, interpreted -- very slow -- elsewhere).
The defaults are one device's share of K3's experts (896 over 56 devices: 16, l = 3584, m = 3072).
Prints median milliseconds and the ratio to dense bf16 and the compiled temporaries; writes JSON
atomically. Written for an accelerator; not run on one yet.
"""
from __future__ import annotations

import argparse
import platform

import k3jax  # noqa: F401  (XLA:CPU workaround before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

from bench.common import interleaved_times, table, write_json
from k3jax.ops.moe import glu_activation, routed_experts
from k3jax.ops.mxfp4 import Mxfp4Experts
from k3jax.ops.mxfp4_format import encode


def make_inputs(args, key):
    """(x [N, l] bf16, indices, routing weights, dense bf16 weights, (codes, scales) per weight)."""
    keys = jax.random.split(key, 6)
    x = jax.random.normal(keys[0], (args.tokens, args.width), jnp.bfloat16)
    indices = jax.random.randint(keys[1], (args.tokens, args.top_k), 0, args.experts)
    routing = jax.nn.softmax(jax.random.normal(keys[2], (args.tokens, args.top_k)), axis=-1)
    shapes = ((args.width, args.hidden), (args.width, args.hidden), (args.hidden, args.width))
    dense = tuple(0.02 * jax.random.normal(k, (args.experts, i, o), jnp.float32) for k, (i, o) in zip(keys[3:], shapes))
    packed = tuple(jax.jit(encode)(jnp.swapaxes(w, 1, 2)) for w in dense)
    return x, indices, routing, tuple(w.astype(jnp.bfloat16) for w in dense), packed


def step_fn(activation):
    def loss(x, indices, routing, weights):
        return jnp.sum(routed_experts(x, indices, routing, *weights, activation).astype(jnp.float32) ** 2)
    return jax.jit(jax.grad(loss))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.mxfp4_gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--width", type=int, default=3584)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tiles", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--pallas", action="store_true")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default="bench_results/mxfp4_gpu.json")
    args = parser.parse_args(argv)
    if args.width % 32 or args.hidden % 32:
        parser.error("--width and --hidden must be multiples of 32 (MXFP4 blocks)")
    return args


def measure(args: argparse.Namespace) -> dict:
    """``{"seconds": {case: [per round]}, "median_seconds": {case: s}, "temporaries": {case: bytes}}``
    for the dense bf16 experts first, then each MXFP4 case ``args`` asks for."""
    x, indices, routing, dense, packed = make_inputs(args, jax.random.key(0))
    cases = {"bf16 dense": dense}
    cases.update({f"mxfp4 xla tile {g}": tuple(Mxfp4Experts(c, s, tile=g, implementation="xla") for c, s in packed)
                  for g in args.tiles})
    if args.pallas:
        cases["mxfp4 pallas"] = tuple(Mxfp4Experts(c, s, implementation="pallas") for c, s in packed)
    step = step_fn(glu_activation("situ"))
    fns = [lambda x, i, r, w=weights: step(x, i, r, w) for weights in cases.values()]
    times = interleaved_times(fns, (x, indices, routing), args.rounds)
    temporaries = {name: step.lower(x, indices, routing, w).compile().memory_analysis().temp_size_in_bytes
                   for name, w in cases.items()}
    return {"seconds": {name: times[:, i].tolist() for i, name in enumerate(cases)},
            "median_seconds": dict(zip(cases, np.median(times, axis=0).tolist())), "temporaries": temporaries}


def main(argv=None) -> int:
    args = parse_args(argv)
    result = measure(args)
    dense = result["median_seconds"]["bf16 dense"]
    rows = [(name, f"{1e3 * t:.3f}", f"{t / dense:.2f}", f"{result['temporaries'][name] / 2**20:.1f}")
            for name, t in result["median_seconds"].items()]
    print(f"{jax.devices()[0].device_kind}: {args.experts} experts [{args.width} -> {args.hidden}], "
          f"{args.tokens} tokens top-{args.top_k}, bf16, forward + backward w.r.t. x")
    print(table(["experts as", "median ms", "vs bf16", "temporaries MiB"], rows))
    path = write_json(args.out, {"config": vars(args), "device": jax.devices()[0].device_kind, "host": platform.node(),
                                 **result})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
