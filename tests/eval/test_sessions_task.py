"""The `sessions` eval task's accuracy is the model's own (a plain forward over the whole row), and
``python -m eval.chat`` runs its commands and reports bad input in one line."""
import io

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tqdm import tqdm

from eval.chat import main as chat_main
from k3jax.inference import load_run
from eval.tasks import EvalContext, SessionsTask, run_task
from eval.tasks.mqar import base_mqar_dataset
from eval.tasks.sessions import split_row

forward = nnx.jit(lambda model, tokens: model(tokens).logits)


@pytest.fixture(scope="module")
def restored(trained_run):
    return load_run(str(trained_run.path))


@pytest.mark.slow      # ~2 min of compiles on a loaded 2-core CPU
def test_sessions_task_accuracy_is_a_plain_forward_over_the_row(restored):
    task = SessionsTask(sessions_per_seed=2)
    result = run_task(task, EvalContext(restored.model, restored.config, (0, 1)), tqdm(disable=True))
    rows = {row["turn"]: row for row in result.output.rows}
    dataset = base_mqar_dataset(restored.config)
    correct = {0: 0, 1: 0}
    for seed in (0, 1):
        for index in range(2):
            writes, queries = split_row(dataset, dataset.row(seed * 2 + index, "heldout"))
            sequence = np.concatenate([writes, queries])
            predicted = np.argmax(np.asarray(forward(restored.model, jnp.asarray(sequence)[None]))[0], axis=-1)
            keys_at = len(writes) + 2 * np.arange(len(queries) // 2)
            correct[seed] += int(np.sum(predicted[keys_at] == queries[1::2]))
    answers = rows["query 1"]["answers_per_seed"] + rows["query 2"]["answers_per_seed"]
    for seed in (0, 1):
        per_turn = [rows[t]["accuracy"].values[seed] * rows[t]["answers_per_seed"] for t in ("query 1", "query 2")]
        assert round(sum(per_turn)) == correct[seed]
    assert answers == 2 * dataset.queries_per_row
    assert rows["write"]["tokens_per_seed"] == 2 * (2 * dataset.num_pairs + dataset.num_filler + 1)
    assert 0.5 <= rows["branches"]["agreement_with_linear"].mean <= 1.0
    assert result.cost.tokens > 0


@pytest.mark.slow
def test_chat_runs_its_commands(trained_run, tmp_path):
    # An MQAR run: turns are space-separated token ids, as eval.generate takes its prompts.
    lines = ["3 4", "/fork", "/rollback", "5 6", "/sessions", "/rollback", "/save s1", "/save s1", "/load s1",
             "7 8", "/switch 1", "9 10", "/sessions", "a b", "/load missing", "/switch 7", "/bogus", "/quit",
             "never read"]
    out = io.StringIO()
    code = chat_main([str(trained_run.path), "--max-new-tokens", "2", "--sessions-dir", str(tmp_path)],
                     stdin=io.StringIO("\n".join(lines) + "\n"), stdout=out)
    replies = out.getvalue().splitlines()
    expected = ["forked: now in session 1", "error: nothing to roll back in this session",
                "  0: 4 tokens", "* 1: 8 tokens",       # 2 typed + 2 generated; then 2 + 2 more in the fork
                "rolled back to 4 tokens", f"saved 2 sessions to {tmp_path / 's1'}",
                f"error: {tmp_path / 's1'} already exists; save writes a new directory",
                "loaded 2 sessions; current 0",
                "  0: 8 tokens", "* 1: 8 tokens",       # a turn after /load and one after /switch: no crash
                "error: this run's data are MQAR token ids; give space-separated integers, got 'a b'",
                "error: no session '7'; /sessions lists them",
                "error: unknown command /bogus; see python -m eval.chat --help"]
    assert code == 0
    position = -1
    for line in expected:                       # in this order (generated text may hold newlines)
        position = replies.index(line, position + 1)
    assert replies[-1] == expected[-1]
    assert any(line.startswith("error:") and "missing" in line for line in replies)


def test_chat_bad_startup_is_one_line_and_status_2(tmp_path, capsys):
    assert chat_main([str(tmp_path / "missing")], stdin=io.StringIO("")) == 2
    assert chat_main([str(tmp_path), "--temperature", "-1"], stdin=io.StringIO("")) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all(line.startswith("error: ") for line in errors)
