"""Compile time of the K3 stack vs depth: scanning the repeating period keeps it flat.

    python -m bench.compile_time [--config configs/tiny.yaml] [--layers 8 32] [--out bench_results/compile_time.json]

For each depth it builds the model (shapes only), then lowers and compiles (XLA:CPU) the
training forward and the training step (loss and gradients), and prints seconds for each, with
the layer split (unrolled prefix, scanned body x repeats, unrolled suffix). Writes JSON.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time

import k3jax  # noqa: F401  (XLA:CPU workaround before JAX starts)
import jax
import jax.numpy as jnp
from flax import nnx

from bench.common import table, write_json
from k3jax.config import ConfigError, load_config
from k3jax.model import K3Model, layer_groups


def next_token_loss(model: K3Model, tokens: jax.Array) -> jax.Array:
    logits = model(tokens[:, :-1]).logits
    return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))


def seconds_to_compile(fn, *args) -> tuple[float, float]:
    """(lowering seconds, XLA compile seconds)."""
    start = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    traced = time.perf_counter()
    lowered.compile()
    return traced - start, time.perf_counter() - traced


def measure(config_path: str, num_layers: int, batch: int, length: int) -> dict:
    config = load_config(config_path, [f"model.num_layers={num_layers}"]).model
    graphdef, state = nnx.split(nnx.eval_shape(lambda: K3Model(config, rngs=nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((batch, length + 1), jnp.int32)
    forward = lambda s, t: nnx.merge(graphdef, s)(t[:, :-1]).logits  # noqa: E731
    train_step = jax.value_and_grad(lambda s, t: next_token_loss(nnx.merge(graphdef, s), t))
    groups = layer_groups(config)
    row = {"num_layers": num_layers, "prefix": len(groups.prefix), "body": len(groups.body),
           "repeats": groups.repeats, "suffix": len(groups.suffix)}
    row["forward_lower_s"], row["forward_compile_s"] = seconds_to_compile(forward, state, tokens)
    row["train_step_lower_s"], row["train_step_compile_s"] = seconds_to_compile(train_step, state, tokens)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--out", default="bench_results/compile_time.json")
    args = parser.parse_args()
    try:
        rows = [measure(args.config, n, args.batch, args.length) for n in args.layers]
    except (ConfigError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    lines = [[r["num_layers"], f"{r['prefix']}+{r['body']}x{r['repeats']}+{r['suffix']}",
              *(f"{r[key]:.2f}" for key in ("forward_lower_s", "forward_compile_s", "train_step_lower_s",
                                             "train_step_compile_s"))] for r in rows]
    print(table(["layers", "split (prefix+body x n+suffix)", "fwd lower s", "fwd compile s", "step lower s",
                 "step compile s"], lines))
    written = write_json(args.out, {"config": args.config, "batch": args.batch, "length": args.length,
                                    "jax": jax.__version__, "machine": platform.machine(), "rows": rows})
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
