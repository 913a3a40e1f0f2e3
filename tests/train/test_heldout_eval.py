"""Periodic held-out evaluation (``train.eval_every``): bits per byte against float64 NumPy from the
same logits, the eval records in metrics.jsonl, and an interrupted run that writes the same ones."""
import json
import math
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from k3jax.config import ConfigError, load_config
from tests.helpers import MICRO, ROOT
from k3jax.training import Trainer


def write_corpus(directory: pathlib.Path) -> pathlib.Path:
    """40 short documents, some with multi-byte UTF-8 characters (so bytes ≠ characters)."""
    path = directory / "corpus.jsonl"
    words = ["alpha", "beta", "γάμμα", "delta", "ёж", "zeta", "日本", "theta"]
    lines = [json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(6 + i % 5))}) for i in range(40)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def text_overrides(tmp_path, corpus) -> list[str]:
    return [f"run_dir={tmp_path / 'run'}", "data.kind=text", f"data.path={corpus}", "data.heldout_fraction=0.2",
            "model.vocab_size=258", "train.eval_batches=2", "train.compilation_cache=null"]


def numpy_bits_per_byte(logits: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    """(mean NLL in nats per scored token, bits per byte) in float64; byte tokens are ids < 256."""
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    nll_sum = float(np.sum(nll * mask))
    num_bytes = float(np.sum((targets < 256) * mask))
    return nll_sum / float(np.sum(mask)), nll_sum / math.log(2) / num_bytes


@pytest.mark.slow   # builds a trainer: about 30 s of compilation on 2 cores
def test_bits_per_byte_matches_float64_numpy(tmp_path):
    config = load_config(MICRO, text_overrides(tmp_path, write_corpus(tmp_path)))
    trainer = Trainer(config)
    try:
        result = trainer.evaluate()
        forward = jax.jit(lambda params, buffers, tokens, segment_ids:
                          trainer.parts.merge(params, buffers)(tokens, segment_ids=segment_ids).logits)
        logits, targets, masks = [], [], []
        for index in range(config.train.eval_batches):
            batch = trainer.data.batch(index, config.train.batch_size, "heldout")
            logits.append(np.asarray(forward(trainer.state.params, trainer.state.buffers, batch["tokens"],
                                             batch["segment_ids"])))
            targets.append(batch["targets"])
            masks.append(batch["loss_mask"])
    finally:
        trainer.close()
    targets = np.concatenate(targets)
    assert (targets == 257).any() and (targets < 256).any()   # EOS (0 bytes) and byte tokens are both scored
    loss, bits = numpy_bits_per_byte(np.concatenate(logits), targets, np.concatenate(masks))
    np.testing.assert_allclose(result["heldout_loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(result["heldout_bits_per_byte"], bits, rtol=1e-5)
    assert result["heldout_bytes"] < result["heldout_tokens"]
    assert result["heldout_bits_per_byte"] != pytest.approx(result["heldout_loss"] / math.log(2))


@pytest.mark.parametrize("overrides, message", [
    (["train.eval_every=-1"], "train.eval_every: must be non-negative"),
    (["train.eval_every=5", "train.eval_batches=0"], "train.eval_every: 5 needs train.eval_batches > 0"),
])
def test_bad_eval_every_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(MICRO, overrides)


def eval_records(run_dir) -> list[dict]:
    lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record.get("kind") == "eval"]


def train_command(run_dir, corpus, cache, *overrides):
    return [sys.executable, "-m", "train", MICRO, *text_overrides(run_dir.parent, corpus)[1:], f"run_dir={run_dir}",
            f"train.compilation_cache={cache}", "train.steps=12", "train.eval_every=3", "checkpoint.every=4",
            *overrides]


@pytest.mark.slow   # subprocesses
def test_interrupted_run_writes_the_same_eval_records(tmp_path):
    corpus, cache = write_corpus(tmp_path), tmp_path / "xla"
    straight = subprocess.run(train_command(tmp_path / "straight", corpus, cache), cwd=ROOT, capture_output=True,
                              text=True, timeout=1800)
    assert straight.returncode == 0, straight.stderr
    expected = eval_records(tmp_path / "straight")
    assert [record["step"] for record in expected] == [3, 6, 9, 12]
    assert all(0 < record["heldout_bits_per_byte"] < 20 for record in expected)
    assert "step 12  held-out loss" in straight.stderr and "bits/byte" in straight.stderr
    summary = json.loads((tmp_path / "straight" / "summary.json").read_text())
    assert summary["heldout_bits_per_byte"] == expected[-1]["heldout_bits_per_byte"]

    # Killed once checkpoint 4 and step 6's evaluation are written, then resumed from checkpoint 4.
    run_dir = tmp_path / "interrupted"
    process = subprocess.Popen(train_command(run_dir, corpus, cache, "checkpoint.every=4"), cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not (run_dir / "metrics.jsonl").exists() or max((r["step"] for r in eval_records(run_dir)), default=0) < 6:
            assert process.poll() is None, process.stderr.read()
            time.sleep(0.1)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    resumed = subprocess.run(train_command(run_dir, corpus, cache), cwd=ROOT, capture_output=True, text=True,
                             timeout=1800)
    assert resumed.returncode == 0, resumed.stderr
    resumed_from = int(re.search(r"resumed from checkpoint (\d+)", resumed.stderr).group(1))
    assert resumed_from in (4, 8)   # killed mid-run: the records after it are dropped, then written again
    assert eval_records(run_dir) == expected


def test_evaluating_an_empty_held_out_split_is_refused_before_anything_runs(tmp_path):
    config = load_config(MICRO, [*text_overrides(tmp_path, write_corpus(tmp_path)), "data.heldout_fraction=0"])
    with pytest.raises(ConfigError, match="train.eval_batches: 2, but the data's held-out split is empty"):
        Trainer(config)
    assert not (tmp_path / "run").exists()   # a failed start leaves no run directory
