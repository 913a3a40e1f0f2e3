"""The memory plan of running a model (`k3jax.inference.plan`, ``python -m eval.plan``): per-device
weight and session bytes against a hand computation from shapes, the estimate against the compiled
programs, the refusal and its knobs, the CLI's inputs and its one-line errors."""
import json
import math
import os
import subprocess
import sys
import time

import pytest

from eval.plan import main
from k3jax.config import load_config
from k3jax.convert.importer import hf_run_config
from k3jax.inference.layout import mesh_sizes
from k3jax.inference.plan import compiled_activations, model_weights, plan_running, refusal
from tests.convert.hf_configs import k3, kimi_linear_48b
from tests.helpers import CONFIGS, MICRO, ROOT

# The micro K3 with two KDA and MLA heads and eight experts: 4 layers (KDA 0-2, MLA 3), d 32,
# KDA heads 2 of K = V = 16 with 4 taps, MLA latent 16 + 8, experts of width 16 on a latent of 16.
MICRO_8 = ["model.kda.num_heads=2", "model.mla.num_heads=2", "model.moe.num_experts=8"]


@pytest.fixture(scope="module")
def micro():
    config = load_config(MICRO, MICRO_8).model
    return config, model_weights(config)


def hand_weight_bytes(weights, ways: dict[str, tuple[str, int]], itemsize=None) -> tuple[int, int]:
    """``(replicated, sharded)`` bytes on one device: each dimension divided by the devices of the
    mesh axis its logical axis takes (``ways``: name -> (mesh axis, size)) when they divide it and
    no earlier dimension of the array took that mesh axis; floating weights in ``itemsize`` bytes."""
    replicated = sharded = 0
    for array in weights:
        split, taken = [], set()
        for size, axis in zip(array.shape, array.axes):
            mesh_axis, count = ways.get(axis, (None, 1))
            divides = count > 1 and size % count == 0 and mesh_axis not in taken
            split.append(count if divides else 1)
            taken.update([mesh_axis] if divides else [])
        held = itemsize if itemsize and array.castable else array.dtype.itemsize
        size = math.prod(array.shape) // math.prod(split) * held
        if math.prod(split) == 1:
            replicated += size
        else:
            sharded += size
    return replicated, sharded


def test_per_device_bytes_match_a_hand_computation(micro):
    config, weights = micro
    sizes = mesh_sizes(config, "expert=4,tensor=2", 8)
    plan = plan_running(config, weights, sizes, batch=3, context=100)
    # tensor splits heads, value heads, FFN and expert hidden widths and the vocabulary; expert
    # the experts and, where no expert dimension took it, the model width (the MoE latent goes
    # over fsdp, which is 1 here)
    tensor, expert = ("tensor", 2), ("expert", 4)
    ways = {"heads": tensor, "value_heads": tensor, "mlp": tensor, "expert_mlp": tensor, "vocab": tensor,
            "experts": expert, "embed": expert}
    assert (plan.weights.replicated, plan.weights.sharded) == hand_weight_bytes(weights, ways)
    assert plan.weights.sharded > 0 and plan.weights.replicated > 0
    # 3 sessions: KDA states of 3 layers x 1 of 2 heads x 16 x 16 fp32; conv tails of 3 taps x
    # (2 x 2 x 16 + 2 x 16) channels, half of them (over tensor); 2 pages of 64 tokens each x 1 MLA
    # layer x 24, fp32
    assert plan.sessions.kda_states.bytes == 3 * 3 * 1 * 16 * 16 * 4
    assert plan.sessions.conv_tails.bytes == 3 * 3 * 3 * 96 * 4 // 2
    assert plan.sessions.mla_pages.bytes == 1 * (3 * 2) * 64 * 24 * 4
    assert plan.total == plan.weights.total + plan.sessions.total + max(plan.decode, plan.prefill)

    cast = plan_running(config, weights, sizes, batch=3, context=100, dtype="bfloat16")
    assert (cast.weights.replicated, cast.weights.sharded) == hand_weight_bytes(weights, ways, itemsize=2)
    assert cast.sessions.mla_pages.bytes == plan.sessions.mla_pages.bytes // 2    # compute dtype bf16 too
    assert cast.sessions.kda_states == plan.sessions.kda_states                  # always fp32
    one = plan_running(config, weights, {"data": 1}, batch=3, context=100)
    assert one.weights.sharded == 0 and one.weights.replicated == sum(
        math.prod(w.shape) * w.dtype.itemsize for w in weights)


def test_the_estimate_is_near_what_the_compiled_programs_allocate(micro):
    config, weights = micro
    plan = plan_running(config, weights, {"data": 1}, batch=8, context=1024)
    decode, prefill = compiled_activations(config, {"data": 1}, 8, 1024)
    assert 0.5 < plan.decode / decode < 2 and 0.5 < plan.prefill / prefill < 2, (plan, decode, prefill)


def test_a_layout_that_does_not_fit_is_refused_with_what_would_fit(micro):
    config, weights = micro
    page = config.kda.chunk_size

    def plan(batch=16, context=4096, dtype=None, memory=None):
        return plan_running(config, weights, {"data": 1}, batch, context, dtype, memory)

    memory = plan(dtype="bfloat16").total + 1
    refused = plan(memory=memory)
    assert refused.fits is False
    line = refusal(config, weights, refused)
    assert "\n" not in line and line.startswith("16 sessions of 4096 tokens on --mesh data=1 do not fit")
    batch = max(b for b in range(1, 16) if plan(batch=b, memory=memory).fits)
    assert f"--batch {batch}," in line
    context = int(line.split("--context ")[1].split(",")[0])
    assert context % page == 0
    assert plan(context=context, memory=memory).fits and not plan(context=context + page, memory=memory).fits
    assert "--dtype bfloat16" in line
    assert refusal(config, weights, plan(memory=refused.total)) is None
    assert refusal(config, weights, plan()) is None                      # no memory given: no verdict


def run_cli(capsys, *argv):
    status = main([*map(str, argv)])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_the_cli_prints_the_plan_of_a_config_and_refuses_what_does_not_fit(capsys):
    status, out, err = run_cli(capsys, MICRO, *MICRO_8, "--mesh", "expert=4,tensor=2", "--batch", "3",
                               "--context", "100", "--device-memory", "1GiB")
    assert status == 0 and err == "", err
    assert "8 devices (--mesh expert=4,tensor=2): 3 sessions x 100 tokens" in out
    assert "= 3 sessions x 3 layers x 1 head x 16 x 16 x 4 B" in out and "fits" in out
    status, out, err = run_cli(capsys, MICRO, "--batch", "64", "--context", "65536", "--device-memory", "256MiB")
    assert status == 1 and "does not fit" in out
    assert len(err.splitlines()) == 1 and err.startswith("refused: 64 sessions of 65536 tokens") and "--batch" in err


def test_the_cli_reads_a_run_directory(untrained_run, capsys):
    status, out, err = run_cli(capsys, untrained_run.path, "--devices", "2")
    assert status == 0, err
    assert f"run {untrained_run.path} on 2 devices" in out and "d 48" in out


@pytest.mark.parametrize("argv, message", [
    (["no-such-config"], "no such file, and not a packaged config"),
    ([MICRO, "--mesh", "tensor=3"], "--mesh tensor=3 does not divide model.kda.num_heads = 1"),
    ([MICRO, "--mesh", "context=2"], "inference has no context axis"),
    ([MICRO, "--devices", "4", "--mesh", "tensor=3"], "--mesh tensor=3 is 3 devices"),
    ([MICRO, "--batch", "0"], "--batch must be at least 1"),
    ([MICRO, "--device-memory", "lots"], "expected a byte count"),
    ([MICRO, "--step", "3"], "--step applies to a run directory only"),
    ([MICRO, "model.no_such_key=1"], "no_such_key"),
    (["BAD_JSON"], "not readable JSON"),
    ([MICRO, "--tpu", "v9:2x2"], "unknown TPU generation 'v9'"),      # checked before libtpu is needed
])
def test_bad_input_is_one_line_and_status_2(argv, message, tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    argv = [str(tmp_path / "config.json") if arg == "BAD_JSON" else arg for arg in argv]
    status, out, err = run_cli(capsys, *argv)
    assert status == 2 and out == "" and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert message in err, err


def test_kimi_linear_48b_plans_in_seconds_and_its_config_json_is_its_yaml(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(kimi_linear_48b()))
    started = time.perf_counter()
    plans = []
    for source in (tmp_path / "config.json", CONFIGS / "kimi-linear-48b.yaml"):
        config = (hf_run_config(source, tmp_path) if source.suffix == ".json" else load_config(source)).model
        sizes = mesh_sizes(config, "tensor=8", 8)
        plans.append(plan_running(config, model_weights(config), sizes, 64, 32768, "bfloat16", 80 * 2**30))
    assert time.perf_counter() - started < 30
    assert plans[0].weights == plans[1].weights and plans[0].sessions == plans[1].sessions
    # 49.1B parameters in bf16, split 8 ways but for the norms and router biases
    assert plans[0].weights.total * 8 == pytest.approx(49.1e9 * 2, rel=0.01)
    assert plans[0].fits


@pytest.mark.slow     # K3's abstract model takes ~10 s to build on one core
def test_k3_with_mxfp4_experts_fits_64_chips(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(k3()))
    status, out, err = run_cli(capsys, tmp_path / "config.json", "--mesh", "expert=8,tensor=8", "--dtype",
                               "bfloat16", "--batch", "16", "--context", "65536", "--device-memory", "96GiB")
    assert status == 0, err
    assert "896 experts top-16 (mxfp4)" in out and "fits" in out


@pytest.mark.slow     # compiles for 8 fake CPU devices in a subprocess
def test_compile_prints_what_xla_allocates_on_a_mesh():
    result = subprocess.run([sys.executable, "-m", "eval.plan", str(MICRO), *MICRO_8, "--mesh", "expert=4,tensor=2",
                             "--batch", "8", "--context", "1024", "--compile"], cwd=ROOT, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "decode step (XLA:CPU compiled)" in result.stdout and "prefill piece (XLA:CPU compiled)" in result.stdout
