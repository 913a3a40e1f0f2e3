"""Peak memory of one training step of the tiny model vs sequence length and context shards.

    python -m bench.context_memory [--lengths 8192 32768 131072] [--contexts 1 2 4 8]  (--contexts alone: none)
                                   [--config configs/tiny.yaml] [--out bench_results/context_memory.json]

For each length T (batch 1) it compiles (XLA:CPU, nothing run) one training step --
`k3jax.training.make_train_step`: forward, loss, backward, AdamW update -- and reads
``compiled.memory_analysis()`` per device:

    one device       MLA attention ``dense`` (the [B, H, T, T] score matrix) and ``xla`` (blockwise)
    mesh.context = P blockwise, the model `parallelize`d on P of 8 fake CPU devices (data = 1), the
                     batch split [rows, sequence over context]; also the bytes its collectives move
                     per device (`k3jax.training.plan.collective_bytes`)

Temporaries should grow linearly in T and fall about linearly in P. Rewrites the JSON atomically
after every compile (a stopped run keeps what it measured) and prints each figure as it comes.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time

import k3jax  # noqa: F401  (XLA:CPU workaround before JAX starts)
import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402

from bench.common import table, write_json  # noqa: E402
from k3jax.config import ConfigError, MeshConfig, load_config  # noqa: E402
from k3jax.sharding import abstract, make_mesh, step_shardings  # noqa: E402
from k3jax.training import abstract_model, abstract_train_state, make_train_step  # noqa: E402
from k3jax.training.plan import BATCH_DTYPES, collective_bytes  # noqa: E402


def batch_shapes(length: int, sharding=None) -> dict:
    """Abstract ``[1, T]`` batch arrays (laid out by ``sharding`` when given)."""
    return {name: jax.ShapeDtypeStruct((1, length), dtype, sharding=sharding) for name, dtype in BATCH_DTYPES.items()}


def compiled_step(model_config, length: int, contexts: int | None):
    """The compiled train step: one device without a mesh (``contexts`` None) or `parallelize`d on a
    ``data=1, context=contexts`` mesh of the first ``contexts`` devices."""
    optimizer = optax.adamw(1e-3)
    if contexts is None:
        parts, params, buffers = abstract_model(model_config)
        state = abstract_train_state(params, buffers, optimizer)
        return make_train_step(parts, optimizer).lower(state, batch_shapes(length)).compile()
    mesh_config = MeshConfig(data=1, context=contexts)
    mesh = make_mesh(mesh_config, jax.devices()[:contexts])
    parts, params, buffers = abstract_model(model_config, mesh, mesh_config)
    shapes = abstract_train_state(params, buffers, optimizer)
    shardings = step_shardings(shapes, parts.params.axes(), parts.buffers.axes(), mesh, mesh_config)
    step = make_train_step(parts, optimizer, shardings=shardings)
    return step.lower(abstract(shapes, shardings.state), batch_shapes(length, shardings.batch)).compile()


def measure(model_config, length: int, contexts: int | None) -> dict:
    """Per-device bytes of the compiled step's temporaries, arguments and collectives."""
    start = time.perf_counter()
    compiled = compiled_step(model_config, length, contexts)
    analysis = compiled.memory_analysis()
    moved = collective_bytes(compiled.as_text())
    return {"temp_bytes": int(analysis.temp_size_in_bytes), "argument_bytes": int(analysis.argument_size_in_bytes),
            "collective_bytes": {k: v for k, v in moved.items() if v}, "compile_s": time.perf_counter() - start}


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def write_result(path: str, rows: list, **fields) -> None:
    """``{**fields, batch, jax, machine, rows}`` as JSON at ``path`` (atomically), and say so."""
    result = {**fields, "batch": 1, "jax": jax.__version__, "machine": platform.machine(), "rows": rows}
    print(f"wrote {write_json(path, result)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--contexts", type=int, nargs="*", default=[2, 4, 8], help="none: one-device rows only")
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--no-dense", action="store_true", help="skip the dense one-device rows")
    parser.add_argument("--out", default="bench_results/context_memory.json")
    args = parser.parse_args()
    if min(args.lengths) < 1 or args.block_size < 1 or any(p not in (1, 2, 4, 8) for p in args.contexts):
        print("error: lengths and block size must be positive, contexts among 1 2 4 8", file=sys.stderr)
        return 2
    try:
        configs = {name: load_config(args.config, [f"model.mla.attention_implementation={name}",
                                                   f"model.mla.attention_block_size={args.block_size}"]).model
                   for name in ("dense", "xla")}
    except (ConfigError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    rows, fields = [], dict(config=args.config, block_size=args.block_size)
    for length in args.lengths:
        row = {"length": length, "context": {}}
        rows.append(row)
        cases = [("blockwise", configs["xla"], None), *([("dense", configs["dense"], None)] * (not args.no_dense)),
                 *((p, configs["xla"], p) for p in args.contexts)]
        for name, model_config, contexts in cases:
            result = measure(model_config, length, contexts)
            (row["context"] if contexts else row)[str(name)] = result
            print(f"T={length} {'context=' if contexts else ''}{name}: {mib(result['temp_bytes'])} MiB temporaries, "
                  f"compile {result['compile_s']:.0f} s", flush=True)
            write_result(args.out, rows, **fields)     # after every compile: a stopped run keeps what it measured
    headers = ["T", *(["dense temp MiB"] if not args.no_dense else []), "blockwise temp MiB",
               *(f"context={p} temp MiB/device" for p in args.contexts),
               *(f"context={p} collectives MiB/device" for p in args.contexts)]
    lines = [[r["length"], *([mib(r["dense"]["temp_bytes"])] if not args.no_dense else []),
              mib(r["blockwise"]["temp_bytes"]),
              *(mib(r["context"][str(p)]["temp_bytes"]) for p in args.contexts),
              *(mib(sum(r["context"][str(p)]["collective_bytes"].values())) for p in args.contexts)] for r in rows]
    print(table(headers, lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
