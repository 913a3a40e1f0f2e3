"""Data pipeline throughput against the tiny model's train step, measured side by side in one run.

    pipeline alone   tokens/s of ``ds.batch(step, B)`` for each source kind (MQAR, JSONL, Parquet,
                     prepared tokens) at the config's batch size and sequence length
    train step       tokens/s of the trainer's loop body (read batch, device put, step, fetch metrics,
                     as `k3jax.training.Trainer` does) with the batches read in line (data.prefetch=0) and
                     read ahead on the prefetch thread (data.prefetch=2), and the step alone on a
                     batch already on the device (the ceiling)

The corpus is synthetic (seeded random words, ``--documents`` of them), written as JSONL and
Parquet and prepared into token shards in a temporary directory. One trainer is built (one
compile); its dataset is swapped between MQAR and the prepared tokens (the step does not depend
on the data, only on the shapes). Rounds alternate the variants in rotating order; the table
reports medians over rounds.

    python -m bench.data_pipeline [--config configs/tiny.yaml] [--steps 20] [--rounds 3]
                                  [--documents 4000] [--json bench/data_pipeline.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import pyarrow
import pyarrow.parquet

from bench.common import table, write_json
from k3jax.config import load_config
from k3jax.data import Prefetcher, TextDataset, TokensDataset, make_dataset
from k3jax.data.prepare import prepare
from k3jax.training import Trainer

WORDS = ["alpha", "beta", "gamma", "delta", "memory", "state", "gate", "expert", "router", "chunk", "token",
         "latent", "residual", "block", "the", "of", "and", "a", "in", "to"]


def write_corpus(directory: Path, documents: int) -> dict[str, Path]:
    """The same seeded documents as JSONL and Parquet."""
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, rng.integers(20, 200))) + "." for _ in range(documents)]
    jsonl = directory / "corpus.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": text}) for text in texts), encoding="utf-8")
    parquet = directory / "corpus.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"text": texts}), parquet)
    return {"jsonl": jsonl, "parquet": parquet}


def _seconds(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def pipeline_rates(datasets: dict, batch_size: int, steps: int, rounds: int) -> dict[str, float]:
    """Tokens/s of reading ``steps`` batches from each dataset (median over rounds, fresh steps each)."""
    times = {name: [] for name in datasets}
    for dataset in datasets.values():
        dataset.batch(0, batch_size)   # builds the row orders (and imports grain) outside the timing
    for r in range(rounds):
        for i in range(len(datasets)):
            name = list(datasets)[(r + i) % len(datasets)]
            first = (r + 1) * steps
            times[name].append(_seconds(lambda: [datasets[name].batch(s, batch_size) for s in range(first, first + steps)]))
    tokens = steps * batch_size * datasets[next(iter(datasets))].seq_len
    return {name: tokens / statistics.median(values) for name, values in times.items()}


def train_loop_seconds(trainer: Trainer, first: int, steps: int, depth: int) -> float:
    """Seconds for ``steps`` iterations of the trainer's loop body from batch ``first``, reading ``depth`` ahead."""
    started = time.perf_counter()
    with Prefetcher(trainer._host_batch, first, first + steps, depth) as batches:
        for rows in batches:
            trainer.state, metrics = trainer.train_step(trainer.state, trainer._device_batch(rows), *trainer.frozen_args)
            jax.device_get(metrics)
    return time.perf_counter() - started


def step_alone_seconds(trainer: Trainer, steps: int) -> float:
    batch = trainer._device_batch(trainer._host_batch(0))
    started = time.perf_counter()
    for _ in range(steps):
        trainer.state, metrics = trainer.train_step(trainer.state, batch, *trainer.frozen_args)
        jax.device_get(metrics)
    return time.perf_counter() - started


def train_rates(trainer: Trainer, datasets: dict, steps: int, rounds: int) -> dict[str, float]:
    """Tokens/s of the loop with prefetch 0 and 2 for each dataset, and of the step alone."""
    variants = [(name, depth) for name in datasets for depth in (0, 2)] + [("step alone", None)]
    times = {variant: [] for variant in variants}
    train_loop_seconds(trainer, 0, 2, 0)   # compile
    for r in range(rounds):
        for i in range(len(variants)):
            name, depth = variants[(r + i) % len(variants)]
            if depth is None:
                times[(name, depth)].append(step_alone_seconds(trainer, steps))
                continue
            trainer.data = datasets[name]
            times[(name, depth)].append(train_loop_seconds(trainer, (r + 1) * steps, steps, depth))
    tokens = steps * trainer.config.train.batch_size * trainer.config.data.seq_len
    return {f"{name}" + ("" if depth is None else f", prefetch {depth}"): tokens / statistics.median(values)
            for (name, depth), values in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.data_pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=20, help="batches per timed trial")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--documents", type=int, default=4000)
    parser.add_argument("--json", default="bench/data_pipeline.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        files = write_corpus(scratch, args.documents)
        prepare([str(files["jsonl"])], scratch / "tokens", shard_tokens=2**18, log=lambda line: None)
        config = load_config(args.config, [f"run_dir={scratch / 'run'}", "logging.progress=false",
                                           "checkpoint.async_save=false"])
        seq_len, batch_size = config.data.seq_len, config.train.batch_size
        datasets = {"mqar": make_dataset(config.data),
                    "jsonl": TextDataset(files["jsonl"], seq_len),
                    "parquet": TextDataset(files["parquet"], seq_len),
                    "tokens": TokensDataset(scratch / "tokens", seq_len)}
        pipeline = pipeline_rates(datasets, batch_size, args.steps, args.rounds)
        trainer = Trainer(config)
        try:
            train = train_rates(trainer, {"mqar": datasets["mqar"], "tokens": datasets["tokens"]}, args.steps, args.rounds)
        finally:
            trainer.close()
    rows = [[f"pipeline alone: {name}", f"{rate:,.0f}"] for name, rate in pipeline.items()]
    rows += [[f"train loop: {name}", f"{rate:,.0f}"] for name, rate in train.items()]
    print(f"{args.config}: batch {batch_size} x seq_len {seq_len}, {args.steps} steps per trial, "
          f"median of {args.rounds} rounds, {jax.device_count()} {jax.default_backend()} device(s)")
    print(table(["", "tokens/s"], rows))
    result = {"config": args.config, "batch_size": batch_size, "seq_len": seq_len, "steps": args.steps,
              "rounds": args.rounds, "documents": args.documents, "backend": jax.default_backend(),
              "pipeline_tokens_per_second": pipeline, "train_tokens_per_second": train,
              "command": "python -m bench.data_pipeline " + " ".join(sys.argv[1:] if argv is None else argv)}
    print(f"wrote {write_json(args.json, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
