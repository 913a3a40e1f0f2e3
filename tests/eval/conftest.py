"""Micro checkpoints written by the trainer, built once per test session.

``trained_run``: 2 layers (KDA, MLA), dense feed-forward, block AttnRes, trained 200 steps on a
2-pair MQAR (8 keys, 8 values) until it recalls; its vocabulary holds the byte tokenizer, so
every task applies. ``untrained_run``: another architecture (4 layers, MoE, no AttnRes, another
width), saved at initialisation (step 0) without compiling a training step.
"""
from __future__ import annotations

import pathlib
from typing import NamedTuple

import jax
import numpy as np
import pytest

from k3jax.config import Config, load_config
from tests.helpers import CONFIGS
from k3jax.training import Trainer
from eval.cli import evaluate, write_outputs
from k3jax.inference import load_run
from eval.tasks import DecodeCostTask, MQARLengthTask, PasskeyTask, PerplexityTask, SamplesTask

COMMON = [
    "model.kda.num_heads=1", "model.kda.head_dim=32", "model.mla.num_heads=2", "model.mla.q_lora_rank=32",
    "model.mla.kv_lora_rank=32", "model.mla.nope_head_dim=16", "model.mla.rope_head_dim=8",
    "model.mla.value_head_dim=16", "model.moe.num_experts=4", "model.moe.top_k=1", "model.moe.expert_width=64",
    "model.moe.latent_dim=32", "data.seq_len=16", "data.num_pairs=2", "data.num_keys=8", "data.num_values=8",
    "data.noise_vocab_size=2", "train.batch_size=32", "train.log_every=25", "checkpoint.async_save=false",
    "checkpoint.every=100000", "logging.progress=false", "logging.peak_tflops=1", "optimizer.name=adamw",
]
TRAINED = COMMON + [
    "model.num_layers=2", "model.mla_period=2", "model.d_model=64", "model.vocab_size=260", "model.dense_width=128",
    "model.dense_layers=2", "model.attn_res.block_size=2", "train.steps=200", "train.eval_batches=2",
    "optimizer.learning_rate=1e-2", "optimizer.warmup_steps=10",
]
UNTRAINED = COMMON + [
    "model.num_layers=4", "model.mla_period=2", "model.d_model=48", "model.vocab_size=64", "model.dense_width=96",
    "model.dense_layers=1", "model.attn_res.kind=none", "train.steps=1",
]


# Small definitions of every task; MQAR seed 0 at 1x reads the rows of the trainer's final evaluation
# (train.eval_batches x train.batch_size), and perplexity shares its batch shape (one compilation).
SMALL_TASKS = [
    PerplexityTask(batches_per_seed=1, batch_size=32),
    MQARLengthTask(length_multipliers=(1, 2), rows_per_seed=64, batch_size=32),
    PasskeyTask(context_lengths=(200,), depths=(0.0, 1.0), trials=1),
    DecodeCostTask(context_lengths=(64,), warmup_steps=1, timed_steps=2),
    SamplesTask(mqar_prompts=2, max_new_tokens=3),
]
SEEDS = 2


class MicroRun(NamedTuple):
    path: pathlib.Path
    config: Config
    step: int
    params: dict          # {path: numpy array} as the trainer left them
    summary: dict         # what the trainer printed at the end ({} when it did not train)


def micro_config(overrides: list[str], run_dir: pathlib.Path) -> Config:
    return load_config(CONFIGS / "tiny.yaml", overrides + [f"run_dir={run_dir}"])


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> MicroRun:
    run_dir = tmp_path_factory.mktemp("trained")
    trainer = Trainer(micro_config(TRAINED, run_dir))
    summary = trainer.run()
    return MicroRun(run_dir, trainer.config, trainer.position, jax.device_get(trainer.state.params), summary)


@pytest.fixture(scope="session")
def untrained_run(tmp_path_factory) -> MicroRun:
    run_dir = tmp_path_factory.mktemp("untrained")
    trainer = Trainer(micro_config(UNTRAINED, run_dir))
    trainer.save(force=True)
    trainer.checkpoints.wait()
    return MicroRun(run_dir, trainer.config, 0, jax.device_get(trainer.state.params), {})


@pytest.fixture(scope="session")
def small_report(trained_run, tmp_path_factory) -> tuple[dict, pathlib.Path]:
    """``(report, output directory)`` of `SMALL_TASKS` on the trained micro checkpoint."""
    out = tmp_path_factory.mktemp("report")
    run = load_run(str(trained_run.path))
    report, records = evaluate(run, SMALL_TASKS, SEEDS, show_progress=False)
    write_outputs(report, records, run.step, out)
    return report, out


def assert_params_equal(restored: dict, expected: dict) -> None:
    assert restored.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(np.asarray(restored[key]), value, err_msg=key)
