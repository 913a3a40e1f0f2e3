"""Peak memory of one training step of the tiny model vs sequence length: dense vs blockwise MLA.

    python -m bench.attention_memory [--lengths 8192 32768 131072] [--train-length 65536 --steps 3]
                                     [--out bench_results/attention_memory.json]

For each length T (batch 1) it compiles (XLA, nothing run) one training step -- forward, loss,
backward, AdamW update, `k3jax.training.make_train_step` -- with `model.mla.attention_implementation`
``dense`` (the [B, H, T, T] score matrix) and ``xla`` (blockwise online softmax), and prints the
compiled `memory_analysis()`: temporaries and argument bytes. With ``--train-length`` it then
trains the blockwise model for ``--steps`` steps at that length on random tokens and prints each
step's loss and seconds. Writes JSON atomically.
"""
from __future__ import annotations

import argparse
import platform
import sys

import k3jax  # noqa: F401  (XLA:CPU workaround before JAX starts)
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from bench.common import table, timed, write_json
from k3jax.config import ConfigError, load_config
from k3jax.model import K3Model
from k3jax.training import abstract_model, abstract_train_state, init_train_state, make_train_step, split_model

IMPLEMENTATIONS = ("dense", "xla")


def model_config(config_path: str, implementation: str, block_size: int):
    overrides = [f"model.mla.attention_implementation={implementation}", f"model.mla.attention_block_size={block_size}"]
    return load_config(config_path, overrides).model


def batch_of(length: int, vocab: int, key=None) -> dict:
    """Random tokens (or their shapes when ``key`` is None), two packed documents per row."""
    shape = (1, length)
    if key is None:
        tokens = jax.ShapeDtypeStruct(shape, jnp.int32)
        return {"tokens": tokens, "targets": tokens, "segment_ids": tokens, "loss_mask": tokens}
    tokens = jax.random.randint(key, shape, 0, vocab)
    segments = jnp.where(jnp.arange(length) < length // 3, 1, 2)[None].astype(jnp.int32)
    return {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=1), "segment_ids": segments,
            "loss_mask": jnp.ones(shape, jnp.int32)}


def compiled_memory(config, length: int) -> dict:
    """Bytes of the compiled training step's temporaries and arguments at sequence length T."""
    parts, params, buffers = abstract_model(config)
    optimizer = optax.adamw(1e-3)
    state = abstract_train_state(params, buffers, optimizer)
    step = make_train_step(parts, optimizer)
    compiled, compile_s = timed(lambda: step.lower(state, batch_of(length, config.vocab_size)).compile())
    analysis = compiled.memory_analysis()
    return {"temp_bytes": int(analysis.temp_size_in_bytes), "argument_bytes": int(analysis.argument_size_in_bytes),
            "output_bytes": int(analysis.output_size_in_bytes), "compile_s": compile_s}


def train(config, length: int, steps: int) -> list[dict]:
    """Loss and seconds of ``steps`` AdamW steps at sequence length T on random packed tokens."""
    parts, params, buffers = split_model(K3Model(config, rngs=nnx.Rngs(0)))
    optimizer = optax.adamw(1e-3)
    state = init_train_state(params, buffers, optimizer)
    step_fn = make_train_step(parts, optimizer)
    rows = []
    for step in range(steps):
        batch = batch_of(length, config.vocab_size, jax.random.key(step))
        (state, metrics), step_s = timed(step_fn, state, batch)
        loss = float(metrics["loss"])
        rows.append({"step": step, "loss": loss, "finite": bool(metrics["finite"]), "seconds": step_s})
        print(f"T={length} step {step}: loss {loss:.4f}  {rows[-1]['seconds']:.1f} s", flush=True)
    return rows


def gib(n: int) -> str:
    return f"{n / 2**30:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--train-length", type=int, default=0, help="also train at this length (0: no)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="bench_results/attention_memory.json")
    args = parser.parse_args()
    if min(args.lengths) < 1 or args.steps < 1 or args.block_size < 1:
        print("error: lengths, steps and block size must be positive", file=sys.stderr)
        return 2
    try:
        configs = {name: model_config(args.config, name, args.block_size) for name in IMPLEMENTATIONS}
    except (ConfigError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    rows = []
    for length in args.lengths:
        row = {"length": length}
        for name in IMPLEMENTATIONS:
            row[name] = compiled_memory(configs[name], length)
        rows.append(row)
        print(f"T={length}: dense temp {gib(row['dense']['temp_bytes'])} GiB, "
              f"xla temp {gib(row['xla']['temp_bytes'])} GiB", flush=True)
    lines = [[r["length"], gib(r["dense"]["temp_bytes"]), gib(r["xla"]["temp_bytes"]),
              f"{r['dense']['temp_bytes'] / r['xla']['temp_bytes']:.1f}", gib(r["xla"]["argument_bytes"])]
             for r in rows]
    print(table(["T", "dense temp GiB", "blockwise temp GiB", "dense / blockwise", "arguments GiB"], lines))
    result = {"config": args.config, "block_size": args.block_size, "batch": 1, "jax": jax.__version__,
              "machine": platform.machine(), "rows": rows}
    if args.train_length:
        result["training"] = {"length": args.train_length, "implementation": "xla",
                              "steps": train(configs["xla"], args.train_length, args.steps)}
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
