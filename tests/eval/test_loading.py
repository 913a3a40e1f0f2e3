"""Restoring checkpoints: the saved config decides the architecture; bad input is one line, exit 2."""
import shutil
import subprocess
import sys

import pytest

from k3jax.training import split_model
from eval.cli import main
from k3jax.inference import InputError, load_run
from tests.eval.conftest import CONFIGS, assert_params_equal

REPO = CONFIGS.parent


def test_two_configs_restore_with_their_own_architecture(trained_run, untrained_run):
    loaded = {name: load_run(str(run.path)) for name, run in (("trained", trained_run), ("untrained", untrained_run))}
    for name, run in (("trained", trained_run), ("untrained", untrained_run)):
        restored = loaded[name]
        assert restored.config.model == run.config.model
        assert restored.step == run.step
        assert restored.model.config == run.config.model
        assert_params_equal(split_model(restored.model)[1], run.params)
    trained, untrained = (loaded[name].model for name in ("trained", "untrained"))
    assert (trained.config.num_layers, trained.config.d_model) == (2, 64)
    assert (untrained.config.num_layers, untrained.config.d_model) == (4, 48)
    assert untrained.config.mla_layer_indices == (1, 3) and untrained.config.attn_res.kind == "none"
    assert trained.embedding[...].shape == (260, 64) and untrained.embedding[...].shape == (64, 48)


def test_step_directory_and_step_option_name_the_same_checkpoint(trained_run):
    step_dir = trained_run.path / "checkpoints" / str(trained_run.step)
    assert load_run(str(step_dir)).step == trained_run.step
    assert load_run(str(trained_run.path / "checkpoints"), step=trained_run.step).step == trained_run.step
    with pytest.raises(InputError, match="step"):
        load_run(str(step_dir), step=trained_run.step + 1)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eval", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def assert_one_line_error(status: int, stderr: str) -> None:
    assert status == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr


@pytest.mark.slow   # a subprocess
def test_missing_checkpoint_is_one_line_and_status_2(tmp_path):
    result = run_cli(tmp_path / "no-such-run", "--no-progress")
    assert_one_line_error(result.returncode, result.stderr)
    assert "no such directory" in result.stderr


def garble(step_dir):
    for path in (step_dir / "state").rglob("*"):
        if path.is_file():
            path.write_bytes(b"\x00garbage" * 7)


@pytest.mark.slow   # a subprocess
def test_corrupted_checkpoints_are_one_line_and_status_2(trained_run, tmp_path):
    copy = shutil.copytree(trained_run.path, tmp_path / "corrupted")
    for step_dir in (copy / "checkpoints").iterdir():
        garble(step_dir)
    result = run_cli(copy, "--tasks", "mqar", "--no-progress")
    assert_one_line_error(result.returncode, result.stderr)
    assert "cannot load the checkpoint" in result.stderr


def test_a_corrupted_latest_checkpoint_falls_back_to_the_previous_one_saying_so(trained_run, tmp_path, capsys):
    copy = shutil.copytree(trained_run.path, tmp_path / "latest-corrupted")
    steps = sorted(int(path.name) for path in (copy / "checkpoints").iterdir() if path.name.isdigit())
    assert len(steps) >= 2
    garble(copy / "checkpoints" / str(steps[-1]))
    capsys.readouterr()                                    # drop what the fixture's training printed
    assert load_run(str(copy)).step == steps[-2]
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"warning: cannot restore 'params' from checkpoint {steps[-1]}")
    assert lines[1] == f"falling back to checkpoint {steps[-2]} (unusable: {steps[-1]})"
    with pytest.raises(InputError, match=f"checkpoint {steps[-1]}"):
        load_run(str(copy), step=steps[-1])


def test_corrupted_metadata_is_one_line_and_status_2(trained_run, tmp_path, capsys):
    copy = shutil.copytree(trained_run.path, tmp_path / "bad-meta")
    for path in (copy / "checkpoints").glob("*/meta/*"):
        path.write_text("{not json")
    capsys.readouterr()                                    # drop what the fixture's training printed
    assert_one_line_error(main([str(copy), "--no-progress"]), capsys.readouterr().err)


@pytest.mark.parametrize("args", [
    ["{run}", "--tasks", "mqar,nonsense"],
    ["{run}", "--seeds", "0"],
    ["{run}", "--step", "12345"],
    ["{run}", "--text", "{run}/no-such-file.txt"],
    ["{run}", "--bogus"],
    [],
])
def test_bad_arguments_are_one_line_and_status_2(trained_run, args, capsys):
    status = main([arg.format(run=trained_run.path) for arg in args])
    assert_one_line_error(status, capsys.readouterr().err)


def test_directory_without_checkpoints_is_one_line_and_status_2(tmp_path, capsys):
    assert_one_line_error(main([str(tmp_path), "--no-progress"]), capsys.readouterr().err)
