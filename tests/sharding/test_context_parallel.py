"""Context parallelism (k3jax.sharding.context) on 8 fake CPU devices in subprocesses: the KDA op
and short convolution over 2, 4 and 8 shards, the KDA and MLA layers, the whole model as
`parallelize` sets it up for ``mesh.context`` (alone and with expert and data axes), and the
trainer and planner given ``mesh.context`` -- all against one device (relative <= 1e-5), with
documents ending inside shards and at a shard boundary."""
import json

import pytest

from tests.helpers import MICRO
from k3jax.training.plan import COLLECTIVES
from tests.sharding.test_multi_device import finish, program, program_result, start

pytestmark = pytest.mark.slow   # subprocesses of 8 devices

TOLERANCE = 1e-5
CONTEXT_RUN = ("train.steps=2", "train.eval_batches=0", "checkpoint.every=2", "logging.peak_tflops=1.0",
               "data.seq_len=64", "mesh.context=2")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every subprocess, started at once (each is mostly one busy compiler thread)."""
    run_dir = tmp_path_factory.mktemp("context-run")
    jobs = {
        "model": program("context_model"),
        "train": start(["-m", "train", str(MICRO), f"run_dir={run_dir}", *CONTEXT_RUN]),
        "plan": start(["-m", "train.plan", str(MICRO), "--devices", "8", "--json", "data.seq_len=64",
                       "mesh.context=2", "mesh.context_attention=ring"]),
        "bad_length": start(["-m", "train", str(MICRO), f"run_dir={run_dir}-bad", *CONTEXT_RUN, "data.seq_len=48"]),
        "run_dir": run_dir,
    }
    yield jobs
    for name in ("model", "train", "plan", "bad_length"):   # left by a failed test
        if jobs[name].poll() is None:
            jobs[name].kill()
            jobs[name].communicate()


def test_kda_and_conv_across_2_4_8_context_shards_equal_one_device():
    results = json.loads(finish(program("context_kda")).splitlines()[-1])
    assert sorted(results) == ["2", "4", "8"]
    for size, errors in results.items():
        assert all(error <= TOLERANCE for error in errors.values()), (size, errors)


def test_kda_and_mla_layers_with_context_parallel_equal_one_device():
    """The layers as `parallelize` equips them (`ContextParallel` over 4 shards; MLA all-gathered
    and ring-passed): outputs and the gradients of the input and every parameter."""
    results = json.loads(finish(program("context_layers")).splitlines()[-1])
    assert sorted(results) == ["kda", "mla", "mla_ring"]
    assert all(error <= TOLERANCE for error in results.values()), results


def test_model_loss_and_gradients_with_a_context_axis_equal_one_device(launched):
    results = program_result(launched["model"])
    meshes = {"context=2", "context=4", "context=8", "context=2,expert=2,data=2"}
    assert set(results) == meshes | {"reference_loss"}
    for mesh in meshes:
        result = results[mesh]
        assert result["loss"] <= TOLERANCE and result["gradients"] <= TOLERANCE, (mesh, result)
        assert result["every_mixer_split"] and result["halo_passed"] and result["finite"], (mesh, result)
        assert "context" in result["batch_spec"], (mesh, result)


def test_trainer_trains_with_mesh_context_and_names_a_length_that_does_not_split(launched):
    finish(launched["train"])
    lines = (launched["run_dir"] / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2] and all(r["loss"] == r["loss"] < 1e9 for r in records)
    bad = launched["bad_length"]
    _, stderr = bad.communicate(timeout=600)
    assert bad.returncode != 0
    assert stderr.strip().splitlines()[-1].startswith("error: data.seq_len: 48 does not split into whole KDA "
                                                      "chunks of 32 tokens on each of the 2 devices"), stderr[-2000:]


def test_plan_counts_the_bytes_the_context_axis_moves(launched):
    plan = json.loads(finish(launched["plan"]).splitlines()[-1])
    assert plan["mesh"]["context"] == 2 and plan["context_bytes_per_token"] > 0
    collectives = plan["collectives"]
    assert 0 < collectives["context axis"] <= sum(collectives[name] for name in COLLECTIVES)
    assert collectives["collective-permute"] > 0                  # the ring and the conv halo


def test_prefill_on_a_context_mesh_gives_the_one_device_memory_bank_and_decodes_the_same():
    """mesh.context = 2 and 4: the bank a sequence-split prefill returns (KDA states, conv tails, MLA
    latents, lengths, document starts) and every greedy decode step's logits equal one device's."""
    results = program_result(program("context_decode"))
    assert sorted(results) == ["context=2", "context=4"]
    for mesh, result in results.items():
        assert result["bookkeeping_equal"] and result["sequence_split"], (mesh, result)
        errors = {k: v for k, v in result.items() if not isinstance(v, bool)}
        assert set(errors) == {"kda_state", "kda_conv", "mla_latent", "prefill_logits", "decode_logits"}, errors
        assert all(error <= TOLERANCE for error in errors.values()), (mesh, result)
