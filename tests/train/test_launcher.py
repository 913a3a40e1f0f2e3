"""The launcher's CLIs in process (`train.cli`, `train.plan`): fast checks of their one-line errors.
The end-to-end runs of ``python -m train`` are in test_cli.py (subprocesses, slow)."""
from train import plan as plan_cli


def test_plan_needs_a_device_count_for_a_filled_axis(capsys):
    assert plan_cli.main(["tests/train/micro.yaml"]) == 2
    assert capsys.readouterr().err.strip() == "error: mesh: a mesh axis is -1: give the device count with --devices"


def test_plan_refuses_a_device_count_it_cannot_create(capsys):
    for devices in ("0", "-3", "1000000"):
        assert plan_cli.main(["configs/tiny.yaml", "--devices", devices, "--layout-only"]) == 2
        assert capsys.readouterr().err.strip() == f"error: --devices: must be in 1..16384, got {devices}"
