"""The tasks' figures come from the model: recomputed independently, chance for shuffled weights,
the trainer's own held-out recall reproduced; passkey prompts and the synthetic bank are as defined."""
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tqdm import tqdm

from k3jax.data import ByteTokenizer
from k3jax.memory import init_memory
from k3jax.inference import load_run
from eval.tasks import EvalContext, MQARLengthTask, run_task
from eval.tasks.common import content_hash
from eval.tasks.decode_cost import synthetic_memory
from eval.tasks.mqar import base_mqar_dataset, scaled_mqar_dataset
from eval.tasks.passkey import FILLER, INTRO, NEEDLE, QUESTION, passkey_row
from tests.eval.conftest import SMALL_TASKS

forward = nnx.jit(lambda model, tokens, segment_ids: model(tokens, segment_ids=segment_ids).logits)


@pytest.fixture(scope="module")
def restored(trained_run):
    return load_run(str(trained_run.path))


def independent_recall(model, dataset, seed, batches, batch_size):
    """Recall recomputed outside the task: a plain forward, argmax and comparison in NumPy."""
    hits = []
    for index in range(batches):
        batch = dataset.batch(seed * batches + index, batch_size, "heldout")
        logits = forward(model, jnp.asarray(batch["tokens"]), jnp.asarray(batch["segment_ids"]))
        answers = batch["loss_mask"] > 0
        hits.append(np.argmax(np.asarray(logits), axis=-1)[answers] == batch["targets"][answers])
    return float(np.mean(np.concatenate(hits))), sum(map(len, hits))


def test_mqar_recall_is_the_models_own(small_report, restored, trained_run):
    task = next(task for task in SMALL_TASKS if isinstance(task, MQARLengthTask))
    rows = {row["length_multiplier"]: row for row in small_report[0]["tasks"]["mqar"]["results"]}
    # seed 0 at 1x reads the rows the trainer's final evaluation read: the same figure
    assert rows[1]["recall"]["values"][0] == pytest.approx(trained_run.summary["heldout_mqar_recall"], abs=1e-12)
    assert rows[1]["recall"]["mean"] > 0.6                    # the micro model learned the task (chance 0.125)
    dataset = scaled_mqar_dataset(base_mqar_dataset(restored.config), 2)
    for seed, reported in enumerate(rows[2]["recall"]["values"]):
        recall, answers = independent_recall(restored.model, dataset, seed, task.batches_per_seed(2), task.batch_size)
        assert reported == pytest.approx(recall, abs=1.01 / answers)


def shuffled(model, seed=0):
    """The model with every parameter's entries randomly permuted (same values, no structure)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(seed)
    permute = lambda x: jnp.asarray(rng.permutation(np.asarray(x).ravel()).reshape(x.shape))  # noqa: E731
    return nnx.merge(graphdef, jax.tree.map(permute, params), rest)


def test_shuffled_weights_score_chance(restored):
    task = MQARLengthTask(length_multipliers=(1,), rows_per_seed=64, batch_size=32)
    result = run_task(task, EvalContext(shuffled(restored.model), restored.config, (0, 1)), tqdm(disable=True))
    row = result.output.rows[0]
    assert row["chance"] == 1 / 8
    assert row["recall"].mean < 0.35                          # chance 0.125; the trained model scores > 0.6


def test_passkey_prompt_layout():
    tokenizer = ByteTokenizer()
    for depth in (0.0, 0.5, 1.0):
        row, answer = passkey_row(tokenizer, "31415", depth, 300)
        text = tokenizer.decode(row.tolist())
        assert row.shape == (301,) and answer == len(" 31415")
        assert text.startswith(INTRO) and text.endswith(QUESTION + " 31415")
        needle = NEEDLE.format(key="31415")
        filler = len(text) - len(INTRO) - len(needle) - len(QUESTION + " 31415")
        assert text.index(needle) - len(INTRO) == round(depth * filler)
        assert FILLER[:20] in text


def test_synthetic_bank_is_filled_to_the_requested_length(restored):
    config = restored.config.model
    memory = synthetic_memory(config, 64, 40, jax.random.key(0))
    empty = init_memory(config, 1, 64)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), memory) == jax.tree.map(lambda a: (a.shape, a.dtype), empty)
    assert np.all(np.asarray(memory.mla.length) == 40)
    latent = np.asarray(memory.mla.latent)
    assert np.all(np.abs(latent[:, :, :40]).sum(-1) > 0) and not latent[:, :, 40:].any()


def test_content_hash_follows_the_definition_and_the_data():
    definition = {"length_multipliers": [1, 2], "rows_per_seed": 64}
    assert content_hash("mqar", definition, "d1") == content_hash("mqar", dict(reversed(definition.items())), "d1")
    assert content_hash("mqar", definition, "d1") != content_hash("mqar", {**definition, "rows_per_seed": 32}, "d1")
    assert content_hash("mqar", definition, "d1") != content_hash("mqar", definition, "d2")


@pytest.mark.parametrize("name", ["perplexity", "mqar", "passkey", "samples", "sessions"])
def test_a_task_whose_token_ids_the_model_lacks_is_skipped_with_the_reason(name, tmp_path):
    """Bad input at the eval boundary: data (the run's or --text) with ids beyond the model's
    vocabulary is a skipped task naming both sizes, before the model runs (there is none here)."""
    from eval.tasks import TASKS
    from k3jax.config import load_config
    from k3jax.data import TextDataset

    config = load_config(pathlib.Path(__file__).parents[1] / "train" / "micro.yaml", ["model.vocab_size=16"])
    (tmp_path / "text.txt").write_text("held-out text " * 20)
    text = TextDataset(tmp_path / "text.txt", 8, heldout_fraction=0.0)
    result = run_task(TASKS[name](), EvalContext(None, config, (0,), text), tqdm(disable=True))
    assert result.output is None
    assert re.fullmatch(r".* uses \d+ token ids, the model has 16", result.skipped), result.skipped
