"""The launcher's CLIs in process (`train.cli`, `train.plan`): fast checks of their one-line errors.
The end-to-end runs of ``python -m train`` are in test_cli.py (subprocesses, slow)."""
import json

import pytest

from tests.helpers import MICRO
from train import plan as plan_cli
from train.cli import main as train_main


def test_plan_needs_a_device_count_for_a_filled_axis(capsys):
    assert plan_cli.main(["tests/train/micro.yaml"]) == 2
    assert capsys.readouterr().err.strip() == "error: mesh: a mesh axis is -1: give the device count with --devices"


def test_plan_refuses_a_device_count_it_cannot_create(capsys):
    for devices in ("0", "-3", "1000000"):
        assert plan_cli.main(["configs/tiny.yaml", "--devices", devices, "--layout-only"]) == 2
        assert capsys.readouterr().err.strip() == f"error: --devices: must be in 1..16384, got {devices}"


@pytest.mark.parametrize("arguments, message", [
    (["--tpu", "v9:2x2"], "error: --tpu 'v9:2x2': unknown TPU generation 'v9'; known: v4, v5e, v5p, v6e, tpu7x"),
    (["--tpu", "v5p"], "error: --tpu 'v5p': expected GENERATION:AxB or GENERATION:AxBxC"),
    (["--tpu", "v5e:2x2", "--devices", "4"], "error: --devices: --tpu takes its devices from the topology"),
])
def test_plan_tpu_target_errors_are_one_line(capsys, arguments, message):
    """Checked before libtpu is needed: they hold on any installation."""
    assert plan_cli.main(["configs/tiny.yaml", "--layout-only", *arguments]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(message) and "\n" not in error


@pytest.mark.parametrize("overrides, message", [
    ([], "prompts.jsonl:17: no 'answer' field (rl.reward=contains compares"),
    (["rl.reward=nowhere_module:f"], "rl.reward: cannot import 'nowhere_module'"),
    (["rl.environment=calculator"], "rl.environment: a tool environment needs chat prompts"),
    (["rl.reward=tests.train.test_rl_runs:letters"], "init_from=/nonexistent/run"),
])
def test_bad_rl_input_is_one_line_before_any_compute(tmp_path, capsys, overrides, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{n} + 1 =", "answer": n + 1}) + "\n" for n in range(16))
                       + json.dumps({"prompt": "no answer"}) + "\n")
    code = train_main([str(MICRO), f"run_dir={tmp_path / 'run'}", "init_from=/nonexistent/run", "model.vocab_size=258",
                       "train.objective=grpo", "data.kind=prompts", f"data.path={prompts}", "data.seq_len=16",
                       "rl.reward=contains", *overrides])
    error = capsys.readouterr().err.strip()
    assert code == 2 and message in error and "\n" not in error
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_loads_under_other_kernels_but_not_another_model():
    from k3jax.config import load_config, to_dict
    from k3jax.training.resume import RunError, check_same_model

    saved = {"config": {"model": to_dict(load_config("configs/tiny.yaml").model)}}
    kernels = ["model.kda.implementation=reference", "model.mla.attention_implementation=dense",
               "model.moe.expert_matmul=dense"]
    check_same_model(saved, load_config("configs/tiny.yaml", kernels), "init_from run")      # no error
    with pytest.raises(RunError, match=r"^init_from run was written by a different model: model.kda.chunk_size"):
        check_same_model(saved, load_config("configs/tiny.yaml", ["model.kda.chunk_size=32", *kernels]), "init_from run")


def test_a_resume_reads_ahead_as_it_likes_but_not_other_data():
    from k3jax.config import load_config, to_dict
    from k3jax.training.resume import RunError, check_same_data

    saved = {"config": {"data": to_dict(load_config("configs/tiny.yaml").data)}, "data_hash": "h"}
    check_same_data(saved, load_config("configs/tiny.yaml", ["data.prefetch=0"]), "h", "checkpoint 4")   # no error
    with pytest.raises(RunError, match=r"^checkpoint 4 was trained on other data: data.seq_len"):
        check_same_data(saved, load_config("configs/tiny.yaml", ["data.seq_len=32", "data.prefetch=0"]), "h",
                        "checkpoint 4")
