"""Memory of a many-experts routed layer with dense bf16 vs MXFP4 experts (decoded per tile).

    python -m bench.mxfp4_memory [--experts 256 --width 256 --hidden 128 --tokens 512 --top-k 8]
                                 [--tiles 1 8 32 256] [--out bench_results/mxfp4_memory.json]

Compiles (XLA, nothing run) the forward + backward w.r.t. the input of
`k3jax.ops.moe.routed_experts` (sort, three grouped GEMMs, unsort) in bf16 compute, with the
experts given as dense bf16 arrays and as `k3jax.ops.mxfp4.Mxfp4Experts` decoded G experts at a
time for each G of ``--tiles`` (G = E decodes them all at once), and prints the compiled
`memory_analysis()`: the arguments (the expert weights dominate) and the temporaries. Writes
JSON atomically.
"""
from __future__ import annotations

import argparse
import platform

import k3jax  # noqa: F401  (XLA:CPU workaround before JAX starts)
import jax
import jax.numpy as jnp

from bench.common import table, write_json
from k3jax.ops.moe import glu_activation, routed_experts
from k3jax.ops.mxfp4 import Mxfp4Experts

MIB = 2**20


def compiled_memory(weights, tokens: int, width: int, experts: int, top_k: int) -> dict:
    """Argument and temporary bytes of the compiled forward + backward (w.r.t. x) of the layer."""
    activation = glu_activation("situ")

    def loss(x, indices, routing, weights):
        return jnp.sum(routed_experts(x, indices, routing, *weights, activation).astype(jnp.float32) ** 2)

    args = (jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16), jax.ShapeDtypeStruct((tokens, top_k), jnp.int32),
            jax.ShapeDtypeStruct((tokens, top_k), jnp.float32), weights)
    memory = jax.jit(jax.grad(loss)).lower(*args).compile().memory_analysis()
    return {"arguments": memory.argument_size_in_bytes, "temporaries": memory.temp_size_in_bytes}


def abstract_weights(fmt: str, experts: int, width: int, hidden: int, tile: int):
    """(W_gate, W_up, W_down) as abstract arrays: dense bf16 [E, in, out] or MXFP4 codes + scales."""
    shapes = ((width, hidden), (width, hidden), (hidden, width))
    if fmt == "bf16":
        return tuple(jax.ShapeDtypeStruct((experts, i, o), jnp.bfloat16) for i, o in shapes)
    return tuple(Mxfp4Experts(jax.ShapeDtypeStruct((experts, o, i // 2), jnp.uint8),
                              jax.ShapeDtypeStruct((experts, o, i // 32), jnp.uint8), tile=tile, implementation="xla")
                 for i, o in shapes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mxfp4_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--width", type=int, default=256, help="expert input width (the latent l)")
    parser.add_argument("--hidden", type=int, default=128, help="expert hidden width m")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tiles", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--out", default="bench_results/mxfp4_memory.json")
    args = parser.parse_args(argv)
    if args.width % 32 or args.hidden % 32:
        parser.error("--width and --hidden must be multiples of 32 (MXFP4 blocks)")
    shape = (args.experts, args.width, args.hidden)
    cases = [("bf16 dense", abstract_weights("bf16", *shape, 1))]
    cases += [(f"mxfp4 tile {g}", abstract_weights("mxfp4", *shape, g)) for g in args.tiles]
    results = {name: compiled_memory(weights, args.tokens, args.width, args.experts, args.top_k)
               for name, weights in cases}
    expert_bytes_bf16 = 2 * 3 * args.experts * args.width * args.hidden
    rows = [(name, f"{r['arguments'] / MIB:.2f}", f"{r['temporaries'] / MIB:.2f}",
             f"{r['temporaries'] / expert_bytes_bf16:.3f}") for name, r in results.items()]
    print(f"{args.experts} experts [{args.width} -> {args.hidden}], {args.tokens} tokens top-{args.top_k}, "
          f"bf16 compute, forward + backward w.r.t. x; all experts in bf16 = {expert_bytes_bf16 / MIB:.2f} MiB")
    print(table(["experts as", "arguments MiB", "temporaries MiB", "temporaries / bf16 experts"], rows))
    path = write_json(args.out, {"config": vars(args), "backend": jax.default_backend(), "host": platform.node(),
                                 "bf16_expert_bytes": expert_bytes_bf16, "results": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
