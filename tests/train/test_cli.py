"""The training launcher end to end, in subprocesses: exact resume after SIGKILL, SIGTERM,
fine-tuning, and one-line errors for bad input that leave checkpoints intact."""
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from k3jax.checkpoint import RunCheckpoints
from tests.helpers import MICRO, ROOT

pytestmark = pytest.mark.slow   # subprocesses


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    """One persistent compilation cache for every run of this module: the first run compiles."""
    return tmp_path_factory.mktemp("xla-cache")


def command(run_dir, cache, *overrides):
    return [sys.executable, "-m", "train", MICRO, f"run_dir={run_dir}", f"train.compilation_cache={cache}", *overrides]


def run(run_dir, cache, *overrides, timeout=600):
    return subprocess.run(command(run_dir, cache, *overrides), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def losses(run_dir) -> dict[int, float]:
    lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def wait_for_step(process, run_dir, step, timeout=600):
    """Block until the run logged ``step`` (or fail if it ended first)."""
    deadline = time.time() + timeout
    metrics = pathlib.Path(run_dir) / "metrics.jsonl"
    while time.time() < deadline:
        if metrics.exists() and max(losses(run_dir), default=0) >= step:
            return
        if process.poll() is not None:
            raise AssertionError(f"run ended early: {process.stdout.read()} {process.stderr.read()}")
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def final_params(run_dir):
    checkpoints = RunCheckpoints(pathlib.Path(run_dir) / "checkpoints", read_only=True)
    step = checkpoints.latest_step()
    state = checkpoints.read_state(step)
    checkpoints.close()
    return step, state["params"]


def files_digest(directory) -> str:
    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(directory).rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(directory)).encode() + path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, xla_cache):
    """40 steps without interruption (checkpoints every 20)."""
    run_dir = tmp_path_factory.mktemp("straight")
    result = run(run_dir, xla_cache)
    assert result.returncode == 0, result.stderr
    return run_dir


def test_resume_after_sigkill_repeats_every_loss_bit_for_bit(tmp_path, xla_cache, straight_run):
    process = subprocess.Popen(command(tmp_path, xla_cache), cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    wait_for_step(process, tmp_path, 25)         # checkpoint 20 is written, steps 21-25 are not saved
    process.send_signal(signal.SIGKILL)
    process.wait()
    resumed = run(tmp_path, xla_cache)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from checkpoint" in resumed.stderr
    assert losses(tmp_path) == losses(straight_run)              # every step, exactly
    step, params = final_params(tmp_path)
    straight_step, straight_params = final_params(straight_run)
    assert step == straight_step == 40
    assert params.keys() == straight_params.keys()
    for name in params:
        np.testing.assert_array_equal(params[name], straight_params[name], err_msg=name)


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, xla_cache, straight_run):
    # The schedule keeps the straight run's 40-step horizon, so the compiled step is shared.
    process = subprocess.Popen(command(tmp_path, xla_cache, "train.steps=100000", "optimizer.schedule_steps=40",
                                       "checkpoint.every=100000"),
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(process, tmp_path, 3)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert "SIGTERM received: saved checkpoint" in stdout
    saved = RunCheckpoints(tmp_path / "checkpoints", read_only=True).latest_step()
    assert saved is not None and saved >= 3
    resumed = run(tmp_path, xla_cache, f"train.steps={saved + 2}", "optimizer.schedule_steps=40")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from checkpoint {saved}" in resumed.stderr
    assert max(losses(tmp_path)) == saved + 2


def test_finetune_from_an_mqar_checkpoint_onto_text_lowers_the_loss(tmp_path, xla_cache, straight_run):
    text = tmp_path / "notes.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    result = run(tmp_path / "finetune", xla_cache, f"init_from={straight_run}", "data.kind=text",
                 f"data.path={text}", "train.eval_batches=1")
    assert result.returncode == 0, result.stderr
    curve = [loss for _, loss in sorted(losses(tmp_path / "finetune").items())]
    assert np.mean(curve[-5:]) < np.mean(curve[:5]) - 0.5


def _bad_inputs(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("caf\xe9 cr\xe8me".encode("latin-1") * 50)
    a_file = tmp_path / "plain-file"
    a_file.write_text("not a directory")
    return {
        "unknown config key": (["train.stpes=3"], "did you mean 'steps'"),
        "invalid value": (["model.moe.top_k=9"], "model.moe.top_k"),
        "missing data file": (["data.kind=text", f"data.path={tmp_path / 'missing.txt'}"], "missing.txt"),
        "empty data": (["data.kind=text", f"data.path={empty}"], "empty.txt"),
        "non-UTF-8 text": (["data.kind=text", f"data.path={binary}"], "latin1.txt"),
        "unwritable run dir": ([f"run_dir={a_file}/run"], "cannot write run directory"),
        "mismatched checkpoint": (["model.d_model=48"], "different model: model.d_model"),
    }


@pytest.mark.parametrize("case", ["unknown config key", "invalid value", "missing data file", "empty data",
                                  "non-UTF-8 text", "unwritable run dir", "mismatched checkpoint"])
def test_bad_input_is_one_line_error_with_nonzero_exit_and_checkpoints_intact(case, tmp_path, xla_cache,
                                                                              straight_run):
    overrides, expected = _bad_inputs(tmp_path)[case]
    before = files_digest(straight_run / "checkpoints")
    result = run(straight_run, xla_cache, *overrides, timeout=300)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0]
    assert files_digest(straight_run / "checkpoints") == before
    assert os.path.exists(straight_run / "config.yaml")
