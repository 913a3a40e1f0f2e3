"""The training loop runs one step ahead of its metrics (`Trainer._train_loop`): the records, the
evaluations and the checkpoints must still come at their steps, the state must be the one a plain
step-by-step loop reaches, and non-finite steps must still stop the run at the limit."""
import json
import pathlib

import jax
import numpy as np
import pytest

from k3jax.config import load_config
from tests.helpers import MICRO
from k3jax.training import RunError, Trainer

pytestmark = pytest.mark.slow   # builds trainers: about 30 s of compilation each on 2 cores


def micro_config(run_dir: pathlib.Path, *overrides: str):
    return load_config(MICRO, [f"run_dir={run_dir}", "train.compilation_cache=null", *overrides])


def read_records(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_records_evaluations_and_checkpoints_come_at_their_steps_with_a_plain_loops_state(tmp_path):
    overrides = ("train.steps=12", "train.eval_every=3", "checkpoint.every=4")
    trainer = Trainer(micro_config(tmp_path / "run", *overrides))
    summary = trainer.run()
    records = read_records(tmp_path / "run")
    kinds = [(r.get("kind", "train"), r["step"]) for r in records]
    expected = []
    for step in range(1, 13):
        expected.append(("train", step))
        if step % 3 == 0:
            expected.append(("eval", step))
    assert kinds == expected
    assert sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == [4, 8, 12]   # keep: 3
    assert summary["step"] == 12

    # A plain loop: each step's metrics read before the next step is dispatched.
    plain = Trainer(micro_config(tmp_path / "plain", *overrides))
    losses, evaluations = [], []
    for step in range(12):
        plain.state, metrics = plain.train_step(plain.state, plain._device_batch(plain._host_batch(step)))
        losses.append(float(jax.device_get(metrics)["loss"]))
        if (step + 1) % 3 == 0:
            evaluations.append(plain.evaluate()["heldout_loss"])
    state = plain.state
    plain.close()
    assert [r["loss"] for r in records if "kind" not in r] == losses
    assert [r["heldout_loss"] for r in records if r.get("kind") == "eval"] == evaluations
    restored = Trainer(micro_config(tmp_path / "run", *overrides))   # resumes from checkpoint 12
    try:
        for name, value in state.params.items():
            np.testing.assert_array_equal(np.asarray(restored.state.params[name]), np.asarray(value), err_msg=name)
    finally:
        restored.close()


def test_non_finite_steps_stop_the_run_at_the_limit_with_each_one_logged(tmp_path):
    # A learning rate of 1e30 sends the parameters to ~1e30 at step 1, so every later loss is inf/NaN.
    config = micro_config(tmp_path / "run", "train.steps=40", "train.max_nonfinite_steps=3",
                          "optimizer.learning_rate=1e30", "optimizer.warmup_steps=0", "checkpoint.every=100")
    trainer = Trainer(config)
    with pytest.raises(RunError, match=r"^3 non-finite steps in a row at step 4; stopping .*last checkpoint: 1$"):
        trainer.run()
    records = read_records(tmp_path / "run")
    assert [(r["step"], r["skipped"]) for r in records] == [(1, False), (2, True), (3, True), (4, True)]
