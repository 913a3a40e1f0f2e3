"""GRPO run by two processes of 4 devices (one jax.distributed system; mesh data=2 x fsdp=2 x
tensor=2 over its 8 devices) gives what one process of 8 devices gives: the same completions,
recorded log-probs, rewards (computed once, by process 0) and metrics, on either process, and the
same parameters; each recorded log-prob is the checkpointed policy's full forward on one device
(the rollouts sample with the sharded parameters themselves). So does a step of speculative
rollouts with a draft model (restored on a mesh of its own, run by every process)."""
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from k3jax.config import load_config
from k3jax.inference import restore_model
from k3jax.sampling import log_softmax
from k3jax.training import Trainer
from tests.helpers import MICRO
from tests.sharding.programs.common import SMALL_K3
from tests.sharding.test_multi_device import finish_all, free_port, start
from tests.train.test_rl_runs import letters

pytestmark = [pytest.mark.slow, pytest.mark.serial]

CALLS = "K3JAX_TEST_REWARD_CALLS"
WORDS = "cat dog mat sun sea sky tree bird fish cow hen pig".split()


def noted_letters(prompt, completion, record) -> float:
    """`letters`, with the index of the process that called it appended to the file $K3JAX_TEST_REWARD_CALLS."""
    with open(os.environ[CALLS], "a") as calls:
        calls.write(f"{jax.process_index()}\n")
    return letters(prompt, completion, record)


def grpo(root, name: str) -> list[str]:
    return ["-m", "train", str(MICRO), f"run_dir={root / name}", f"init_from={root / 'base'}", *SMALL_K3,
            "model.vocab_size=258", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.objective=grpo",
            "data.kind=prompts", f"data.path={root / 'prompts.jsonl'}", "data.seq_len=16", "data.heldout_fraction=0.25",
            "train.steps=2", "rl.prompts_per_step=2", "rl.group_size=4", "rl.max_new_tokens=4", "rl.eval_prompts=2",
            "rl.kl_coef=0.05", "rl.reward=tests.sharding.test_rl_processes:noted_letters", "checkpoint.every=1",
            f"train.compilation_cache={root / 'xla'}"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The prompts and an untrained base (saved here, on one device)."""
    root = tmp_path_factory.mktemp("rl")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"the {word} is", "id": word}) + "\n"
                                                for word in WORDS))
    Trainer(load_config(MICRO, [f"run_dir={root / 'base'}", *SMALL_K3, "model.vocab_size=258",
                                "train.compilation_cache=null"])).save(force=True)
    return root


@pytest.fixture(scope="module")
def root(base):
    """GRPO from the base by one process of 8 devices and, at the same time, by two processes of 4."""
    root = base
    address = f"127.0.0.1:{free_port()}"
    with pytest.MonkeyPatch.context() as patch:       # a subprocess takes the environment it starts with
        patch.setenv(CALLS, str(root / "calls-one"))
        jobs = [start(grpo(root, "one"), devices=8)]
        patch.setenv(CALLS, str(root / "calls-two"))
        jobs += [start([*grpo(root, "two"), "--coordinator-address", address, "--num-processes", "2",
                        "--process-id", str(index)], devices=4) for index in range(2)]
    finish_all(jobs)
    return root


@pytest.fixture(scope="module")
def drafted(base):
    """One step of GRPO with speculative rollouts (``rl.speculation.draft``: another untrained model
    of the base's shape, whose drafts the policy rejects), by one process of 8 devices and, at the same
    time, by two processes of 4: the draft is restored on a mesh of every device of its own."""
    root = base
    Trainer(load_config(MICRO, [f"run_dir={root / 'draft'}", *SMALL_K3, "model.vocab_size=258", "train.seed=7",
                                "train.compilation_cache=null"])).save(force=True)
    address = f"127.0.0.1:{free_port()}"
    speculative = [f"rl.speculation.draft={root / 'draft'}", "rl.speculation.k=2", "train.steps=1", "rl.eval_prompts=0"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CALLS, str(root / "calls-drafted-one"))
        jobs = [start([*grpo(root, "drafted-one"), *speculative], devices=8)]
        patch.setenv(CALLS, str(root / "calls-drafted-two"))
        jobs += [start([*grpo(root, "drafted-two"), *speculative, "--coordinator-address", address, "--num-processes",
                        "2", "--process-id", str(index)], devices=4) for index in range(2)]
    finish_all(jobs)
    return root


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def untimed(record: dict) -> dict:
    return {key: value for key, value in record.items() if "seconds" not in key and "per_second" not in key}


def test_two_processes_sample_score_and_record_what_one_process_does(root):
    one, two = jsonl(root / "one" / "rollouts.jsonl"), jsonl(root / "two" / "rollouts.jsonl")
    assert len(one) == 2 * 2 * 4 and one == two           # tokens, log-probs, rewards, advantages, sources
    assert {record["id"] for record in one} <= set(WORDS)
    assert not (root / "two" / "rollouts.process1.jsonl").exists()
    metrics = [[untimed(r) for r in jsonl(root / run / name)]
               for run, name in (("one", "metrics.jsonl"), ("two", "metrics.jsonl"), ("two", "metrics.process1.jsonl"))]
    for theirs in metrics[1:]:             # losses and norms to float32 rounding (gloo adds in another order)
        assert [sorted(record) for record in theirs] == [sorted(record) for record in metrics[0]]
        for ours_record, their_record in zip(metrics[0], theirs):
            assert their_record == {key: pytest.approx(value, rel=1e-5, abs=1e-6) if isinstance(value, float) else value
                                    for key, value in ours_record.items()}
    steps = [record for record in metrics[0] if "loss" in record]
    assert len(steps) == 2 and all(record["logprob_mismatch"] == 0 for record in steps)
    summaries = [untimed(json.loads((root / run / "summary.json").read_text())) for run in ("one", "two")]
    assert summaries[0]["heldout_prompts"] == 2 and summaries[0] == summaries[1]      # greedy held-out rewards
    calls = [(root / name).read_text().split() for name in ("calls-one", "calls-two")]
    assert len(calls[1]) == len(calls[0]) > len(one) and set(calls[1]) == {"0"}    # rollouts and held-out: on process 0


def test_two_processes_update_the_parameters_as_one_process(root):
    """Equal to float32 rounding, not bit for bit: gloo's all-reduce across processes adds in
    another order than one process's."""
    states = [jax.tree.leaves(nnx.state(restore_model(root / run, step=2).model)) for run in ("one", "two")]
    for ours, theirs in zip(*states):
        np.testing.assert_allclose(np.asarray(theirs), np.asarray(ours), rtol=1e-6, atol=1e-7)


def test_recorded_log_probs_are_each_policys_full_forward_on_one_device(root):
    forward = nnx.jit(lambda model, tokens: model(tokens).logits)
    worst = 0.0
    for record in jsonl(root / "two" / "rollouts.jsonl"):
        model = restore_model(root / "two", step=record["policy_step"]).model
        sequence = np.array(record["prompt_tokens"] + record["completion_tokens"], np.int32)
        logits = np.asarray(forward(model, np.pad(sequence, (0, 32 - sequence.size))[None])[0])
        start_at, count = len(record["prompt_tokens"]) - 1, len(record["completion_tokens"])
        expected = log_softmax(logits[start_at : start_at + count])[np.arange(count), record["completion_tokens"]]
        worst = max(worst, float(np.abs(expected - record["logprobs"]).max()))
    assert worst <= 1e-5, worst


def test_a_draft_model_drafts_across_processes_as_in_one(drafted):
    one, two = (jsonl(drafted / run / "rollouts.jsonl") for run in ("drafted-one", "drafted-two"))
    assert len(one) == 2 * 4 and one == two
    metrics = [[untimed(r) for r in jsonl(drafted / run / "metrics.jsonl") if "loss" in r]
               for run in ("drafted-one", "drafted-two")]
    assert len(metrics[0]) == 1 and metrics[1][0] == {key: pytest.approx(value, rel=1e-5, abs=1e-6)
                                                       for key, value in metrics[0][0].items()}
    # the replayed decode recomputes what the verify rounds recorded to fp32 rounding, not bit for bit
    assert metrics[0][0]["logprob_mismatch"] <= 1e-5
    # an untrained draft of another seed: its drafts are rejected, each round rolling both stores back
    assert metrics[0][0]["speculation_tokens_per_round"] == 1.0 and metrics[0][0]["speculation_acceptance_rate"] == 0
