"""GRPO runs end to end (in this process): a micro model trained on text, then RL on prompts.

The recorded log-probs equal those of the checkpointed policy's full forward; the update recomputes
them bit for bit by replaying the decode (full fine-tuning, LoRA, an 8-device mesh), or to <= 1e-5
with the training forward (``rl.update_logprobs=forward``); a resumed run repeats the unbroken one
exactly; LoRA keeps its base bit for bit; speculative rollouts (prompt lookup) log their
speculation metrics. (On a mesh, by one process or two: tests/sharding/test_rl_processes.py.)"""
import json
import signal
import time

import jax
import numpy as np
import pytest
from flax import nnx

from k3jax.checkpoint import RunCheckpoints
from k3jax.config import load_config
from k3jax.inference import restore_model
from k3jax.sampling import log_softmax
from k3jax.training import RLTrainer, Trainer
from tests.helpers import MICRO
from tests.train.test_heldout_eval import write_corpus

pytestmark = pytest.mark.slow    # five trainers: ~2 minutes of compilation on 2 cores

PROMPTS = [{"prompt": f"the {word} is", "answer": word, "id": f"q-{word}"} for word in
           "cat dog mat sun sea sky tree bird fish cow hen pig fox owl bee ant".split()]


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    corpus = write_corpus(root)
    (root / "prompts.jsonl").write_text("".join(json.dumps(record) + "\n" for record in PROMPTS))
    cache = root / "xla"
    Trainer(load_config(MICRO, [f"run_dir={root / 'sft'}", "model.vocab_size=258", "data.kind=text",
                                f"data.path={corpus}", "train.steps=2", "train.eval_batches=0",
                                f"train.compilation_cache={cache}"])).run()
    return root


def letters(prompt, completion, record) -> float:
    """A reward that differs between samples of a barely trained model: the letters written."""
    return float(sum(character.isalpha() for character in completion))


def grpo(root, name, steps, *overrides):
    summary = RLTrainer(load_config(MICRO, grpo_overrides(root, name, steps, *overrides))).run()
    return summary, read_jsonl(root / name / "rollouts.jsonl"), read_jsonl(root / name / "metrics.jsonl")


def grpo_overrides(root, name, steps, *overrides) -> list[str]:
    return [
        f"run_dir={root / name}", f"init_from={root / 'sft'}", "model.vocab_size=258", "train.objective=grpo",
        "data.kind=prompts", f"data.path={root / 'prompts.jsonl'}", "data.seq_len=16", "data.heldout_fraction=0.25",
        f"train.steps={steps}", "rl.prompts_per_step=2", "rl.group_size=3", "rl.max_new_tokens=5", "rl.eval_prompts=2",
        "rl.reward=tests.train.test_rl_runs:letters", "rl.advantage=dr_grpo", "checkpoint.every=1", "checkpoint.keep=10", "optimizer.learning_rate=3e-2",
        "optimizer.warmup_steps=0", "optimizer.schedule_steps=4", f"train.compilation_cache={root / 'xla'}",
        *overrides]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def policy_logprobs(run_dir, record) -> np.ndarray:
    """The float64 log-probs of the record's completion under checkpoint policy_step's full forward."""
    model = restore_model(run_dir, step=record["policy_step"]).model
    sequence = np.array(record["prompt_tokens"] + record["completion_tokens"], np.int32)
    logits = np.asarray(nnx.jit(lambda m, t: m(t).logits)(model, np.pad(sequence, (0, 32 - sequence.size))[None])[0])
    start = len(record["prompt_tokens"]) - 1
    return log_softmax(logits[start : start + len(record["completion_tokens"])])[
        np.arange(len(record["completion_tokens"])), record["completion_tokens"]]


def test_rollouts_are_the_checkpointed_policys_and_the_update_recomputes_them(setting):
    summary, rollouts, metrics = grpo(setting, "full", 3, "rl.kl_coef=0.05", "train.eval_every=3")
    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3] and len(rollouts) == 3 * 2 * 3
    fields = {"policy_step", "prompt_index", "sample", "prompt_tokens", "completion_tokens", "completion", "logprobs",
              "reward", "advantage", "finish_reason"}
    assert all(fields <= set(record) for record in rollouts)
    for record in rollouts:         # each names the line it came from, and carries the record's id
        path, line = record["source"].rsplit(":", 1)
        assert path.endswith("prompts.jsonl") and record["id"] == f"q-{PROMPTS[int(line) - 1]['answer']}"
    assert [r["policy_step"] for r in rollouts] == [s for s in range(3) for _ in range(6)]
    assert [r["sample"] for r in rollouts[:6]] == [0, 1, 2, 0, 1, 2]
    for m in steps:
        assert m["grad_norm"] > 0 and m["reward_std"] > 0
        assert m["logprob_mismatch"] == 0 and m["ratio_mean"] == 1 and m["kl"] >= 0     # the replayed decode
        assert 0 < m["forward_gap"] <= 1e-5 and m["replay_seconds"] > 0
        assert {"reward_mean", "reward_std", "pass_at_1", "pass_at_3", "completion_length", "clip_fraction",
                "rollout_seconds", "update_seconds"} <= set(m)
    assert steps[0]["kl"] == pytest.approx(0, abs=1e-6)            # step 0's policy is the reference
    worst = 0.0
    for record in rollouts[::2]:
        worst = max(worst, float(np.abs(policy_logprobs(setting / "full", record) - record["logprobs"]).max()))
    assert worst <= 1e-5
    for group in (rollouts[i:i + 3] for i in range(0, len(rollouts), 3)):
        rewards = np.array([r["reward"] for r in group])
        np.testing.assert_allclose([r["advantage"] for r in group], rewards - rewards.mean(), rtol=1e-12, atol=1e-12)
    evaluations = [m for m in metrics if m.get("kind") == "eval"]
    assert [e["step"] for e in evaluations] == [0, 3] and summary["heldout_prompts"] == 2


def test_a_resumed_run_repeats_the_unbroken_one_exactly(setting):
    _, straight, straight_metrics = grpo(setting, "straight", 4, "rl.updates_per_rollout=2")
    grpo(setting, "resumed", 2, "rl.updates_per_rollout=2")
    _, resumed, resumed_metrics = grpo(setting, "resumed", 4, "rl.updates_per_rollout=2")
    assert resumed == straight
    drop_times = lambda ms: [{k: v for k, v in m.items() if "seconds" not in k and k != "tokens_per_second"}  # noqa: E731
                             for m in ms if "loss" in m]
    assert drop_times(resumed_metrics) == drop_times(straight_metrics)
    states = [RunCheckpoints(setting / name / "checkpoints", read_only=True) for name in ("straight", "resumed")]
    a, b = (s.read_state(4) for s in states)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert int(a["step"]) == 8                                       # two updates per rollout


def test_lora_rl_keeps_its_base_and_its_log_probs(setting):
    _, rollouts, metrics = grpo(setting, "lora", 2, "finetune.lora_rank=4", "rl.kl_coef=0.1")
    assert all(m["logprob_mismatch"] == 0 for m in metrics if "loss" in m)
    base, tuned = restore_model(setting / "sft").model, restore_model(setting / "lora").model
    base_state = dict(nnx.to_flat_state(nnx.state(base, nnx.Param)))
    for path, value in nnx.to_flat_state(nnx.state(tuned, nnx.Param)):
        if path in base_state and "lora" not in str(path):
            assert np.array_equal(np.asarray(value[...]), np.asarray(base_state[path][...])), path
    record = rollouts[-1]
    assert np.abs(policy_logprobs(setting / "lora", record) - record["logprobs"]).max() <= 1e-5


SPECULATION_METRICS = {"speculation_acceptance_rate", "speculation_mean_accepted_length", "speculation_tokens_per_round",
                       "speculation_draft_seconds", "speculation_verify_seconds"}


def test_speculative_rl_logs_its_speculation_metrics(setting):
    _, rollouts, metrics = grpo(setting, "speculative", 1, "rl.prompt_lookup=2", "rl.eval_prompts=0",
                                "rl.update_logprobs=forward")
    (step,) = [m for m in metrics if "loss" in m]
    assert SPECULATION_METRICS <= set(step) and step["speculation_tokens_per_round"] >= 1
    assert 0 <= step["speculation_acceptance_rate"] <= 1 and step["speculation_verify_seconds"] > 0
    assert 0 < step["logprob_mismatch"] <= 1e-5 and len(rollouts) == 2 * 3     # the training forward recomputes them
    assert "forward_gap" not in step and "replay_seconds" not in step


def hangs(prompt, completion, record) -> float:
    time.sleep(120)
    return 0.0


def signalled_while_hanging(prompt, completion, record) -> float:
    signal.raise_signal(signal.SIGTERM)         # as if sent while the reward hangs
    time.sleep(120)
    return 0.0


@pytest.mark.parametrize("reward, timeout, code, line", [
    ("hangs", "1", 2, r"error: .*prompts\.jsonl:\d+: the reward took longer than rl\.reward_timeout=1 seconds"),
    ("signalled_while_hanging", "null", 0, r"SIGTERM received: stopped before the first step, nothing to save; run again to resume"),
], ids=["timeout", "signal"])
def test_a_hung_reward_ends_the_run_in_one_line(setting, capsys, reward, timeout, code, line):
    """`python -m train` (its `main`, in this process) over a reward that never returns: past
    ``rl.reward_timeout`` the run ends with one line naming the prompt's record; with no timeout a
    SIGTERM stops it inside the reward call. Either way within seconds, and it resumes."""
    import re

    from train.cli import main
    overrides = grpo_overrides(setting, f"hung-{reward}", 2, f"rl.reward=tests.train.test_rl_runs:{reward}",
                               f"rl.reward_timeout={timeout}", "logging.progress=false")
    started = time.monotonic()
    assert main([str(MICRO), *overrides]) == code
    captured = capsys.readouterr()
    lines = [text for text in (captured.out + captured.err).splitlines() if text.strip()]
    assert len(lines) == 1 and re.fullmatch(line, lines[0]), lines
    assert time.monotonic() - started < 100
    summary, _, _ = grpo(setting, f"hung-{reward}", 1)            # the same run directory resumes
    assert summary["step"] == 1


def short(prompts, completions, records) -> list[float]:
    """A batched reward (``rl.rewards``): shorter completions score higher."""
    return [-0.1 * len(completion) for completion in completions]


def letters_of_some_prompts(prompt, completion, record) -> float:
    """`letters` for the prompts whose answer starts with a to m, 0 for the others (whose groups then
    have no reward spread)."""
    return letters(prompt, completion, record) if record["answer"] < "n" else 0.0


def test_dynamic_sampling_refills_the_update_from_more_rounds(setting):
    _, rollouts, metrics = grpo(setting, "resampled", 2, "rl.reward=tests.train.test_rl_runs:letters_of_some_prompts",
                                "rl.dynamic_sampling=true", "rl.resample_rounds=3", "rl.eval_prompts=0")
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 2 and all(m["logprob_mismatch"] == 0 for m in steps)
    groups = [rollouts[first:first + 3] for first in range(0, len(rollouts), 3)]
    assert len(groups) == 4 and all(len({(r["source"], r.get("resampling", 0)) for r in g}) == 1 for g in groups)
    spread = [max(r["reward"] for r in g) > min(r["reward"] for r in g) for g in groups]
    resampled = [g[0].get("resampling", 0) > 0 for g in groups]
    for step, first in zip(steps, (0, 2)):
        assert step["groups_resampled"] == sum(resampled[first:first + 2])
        assert step["groups_dropped"] == 2 - sum(spread[first:first + 2])
        assert spread[first:first + 2] == sorted(spread[first:first + 2], reverse=True)   # groups with spread first
        assert step["groups_dropped"] == 0 or step["sampling_rounds"] == 4     # short only after every round
        assert step["sampling_rounds"] > 1 or step["groups_resampled"] == 0
    assert any(resampled) and all(spread), (resampled, spread)   # prompts n-z (no spread) replaced by others


def test_dapo_gspo_options_and_weighted_batch_rewards_run_and_log(setting):
    _, rollouts, metrics = grpo(
        setting, "dapo", 2, "rl.reward=null", "rl.rewards=[{name: contains, weight: 0.5}, "
        "{name: 'tests.train.test_rl_runs:short', weight: 2.0}]", "rl.dynamic_sampling=true", "rl.overlong_filter=true",
        "rl.overlong_penalty=2", "rl.clip_high=0.28", "rl.ratio=sequence", "rl.loss_average=dr_grpo", "rl.eval_prompts=0")
    from k3jax.training.grpo import overlong_penalty

    for record in rollouts:
        terms = record["rewards"]
        length = len(record["completion_tokens"])
        expected = 0.5 * terms["contains"] + 2.0 * terms["tests.train.test_rl_runs:short"]
        assert record["reward"] == pytest.approx(expected + overlong_penalty([length], 5, 2)[0], abs=1e-12)
        assert terms["tests.train.test_rl_runs:short"] == pytest.approx(-0.1 * len(record["completion"]))
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 2 and all(m["logprob_mismatch"] == 0 for m in steps)
    for step, first in zip(steps, (0, 6)):
        group_rewards = [[r["reward"] for r in rollouts[first + 3 * g: first + 3 * g + 3]] for g in range(2)]
        cut = sum(r["finish_reason"] == "length" for r in rollouts[first:first + 6])
        assert step["groups_dropped"] == sum(max(g) == min(g) for g in group_rewards)
        assert step["completions_filtered"] == cut
        assert {"reward_contains_mean", "overlong_penalty_mean", "kept_completions"} <= set(step)
