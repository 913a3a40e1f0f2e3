"""GRPO's pieces against float64 NumPy written from the formulas (`k3jax.training.grpo`'s docstring):
advantages, the update's rows, the clipped objective's value, gradient and metrics."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.training.grpo import group_advantages, policy_objective, update_rows


def test_group_advantages_are_the_group_relative_rewards():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, -1.0, 2.0, 0.0]])
    for row, got_grpo, got_dr in zip(rewards, group_advantages(rewards, "grpo"), group_advantages(rewards, "dr_grpo")):
        mean = sum(row) / len(row)
        std = (sum((r - mean) ** 2 for r in row) / len(row)) ** 0.5
        np.testing.assert_allclose(got_dr, [r - mean for r in row], rtol=0, atol=1e-15)
        np.testing.assert_allclose(got_grpo, [(r - mean) / (std + 1e-6) for r in row], rtol=1e-15, atol=1e-15)
    assert np.all(group_advantages(rewards, "grpo")[1] == 0)     # a group that all agrees teaches nothing
    with pytest.raises(ValueError, match="unknown advantage"):
        group_advantages(rewards, "ppo")


def completion(prompt, tokens, sampled, logprobs, advantage):
    return types.SimpleNamespace(prompt=types.SimpleNamespace(tokens=np.asarray(prompt, np.int32)), tokens=tokens,
                                 sampled=sampled, logprobs=logprobs, advantage=advantage)


def test_update_rows_place_each_completion_after_its_prompt():
    rows = update_rows([completion([5, 6, 7], [8, 9], [True, True], [-0.5, -0.25], 1.5),
                        completion([4], [1, 2, 3, 0], [True, False, False, True], [-1.0, None, None, -2.0], -0.5)],
                       seq_len=6, loss_average="sequence")
    np.testing.assert_array_equal(rows["tokens"], [[5, 6, 7, 8, 0, 0], [4, 1, 2, 3, 0, 0]])
    np.testing.assert_array_equal(rows["targets"], [[6, 7, 8, 9, 0, 0], [1, 2, 3, 0, 0, 0]])
    np.testing.assert_array_equal(rows["segment_ids"], [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(rows["loss_mask"], [[0, 0, 1, 1, 0, 0], [1, 0, 0, 1, 0, 0]])
    np.testing.assert_array_equal(rows["old_logprobs"], [[0, 0, -0.5, -0.25, 0, 0], [-1, 0, 0, -2, 0, 0]])
    np.testing.assert_array_equal(rows["weights"], [[0, 0, 0.5, 0.5, 0, 0], [0.5, 0, 0, 0.5, 0, 0]])
    assert rows["advantages"][0, 2] == 1.5 and rows["advantages"][1, 3] == -0.5
    token_rows = update_rows([completion([5, 6, 7], [8, 9], [True, True], [-0.5, -0.25], 1.5)], 6, "token")
    np.testing.assert_array_equal(token_rows["weights"], token_rows["loss_mask"])
    with pytest.raises(ValueError, match="more than seq_len"):
        update_rows([completion([5, 6, 7], [8, 9, 1, 2], [True] * 4, [-1.0] * 4, 0.0)], 5, "token")


def reference_loss(logits, batch, clip, kl_coef, values=None):
    """The objective's (loss sum / weight sum, metrics) in float64, token by token; ``values``
    ``[B, T]``: the policy's log-probs (the replayed p_t) instead of the logits' log-softmax."""
    logits = np.asarray(logits, np.float64)
    total = weight_sum = clipped = mismatch = kl_total = 0.0
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if batch["loss_mask"][b, t] == 0:
                continue
            row = logits[b, t] - logits[b, t].max()
            logprob = row[batch["targets"][b, t]] - np.log(np.exp(row).sum()) if values is None else values[b, t]
            ratio = np.exp(logprob - batch["old_logprobs"][b, t])
            advantage = batch["advantages"][b, t]
            term = -min(ratio * advantage, min(max(ratio, 1 - clip), 1 + clip) * advantage)
            clipped += ratio * advantage > min(max(ratio, 1 - clip), 1 + clip) * advantage
            mismatch = max(mismatch, abs(logprob - batch["old_logprobs"][b, t]))
            if kl_coef:
                log_ratio = batch["reference_logprobs"][b, t] - logprob
                kl = np.exp(log_ratio) - log_ratio - 1
                term += kl_coef * kl
                kl_total += kl
            total += batch["weights"][b, t] * term
            weight_sum += batch["weights"][b, t]
    return total / weight_sum, {"clipped_tokens": clipped, "logprob_mismatch_max": mismatch, "kl_sum": kl_total}


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    batch_size, length, vocab = 3, 5, 7
    logits = rng.normal(size=(batch_size, length, vocab)) * 2
    targets = rng.integers(0, vocab, (batch_size, length))
    mask = (rng.random((batch_size, length)) < 0.7).astype(np.float32)
    true_logprobs = np.take_along_axis(logits - np.log(np.exp(logits).sum(-1, keepdims=True)), targets[..., None], -1)[..., 0]
    batch = {"targets": targets.astype(np.int32), "loss_mask": mask,
             "old_logprobs": (true_logprobs + rng.normal(scale=0.4, size=mask.shape)) * mask,   # ratios inside and outside the clip
             "advantages": np.repeat(rng.normal(size=(batch_size, 1)), length, axis=1),
             "weights": mask / mask.sum(axis=1, keepdims=True),
             "reference_logprobs": true_logprobs + rng.normal(scale=0.3, size=mask.shape)}
    return logits, {key: np.asarray(value, np.float32) if value.dtype == np.float64 else value
                    for key, value in batch.items()}


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_objective_value_and_metrics_equal_float64(problem, kl_coef):
    logits, batch = problem
    loss_sum, weight_sum, metrics = jax.jit(policy_objective(0.2, kl_coef))(jnp.asarray(logits, jnp.float32), batch)
    expected, expected_metrics = reference_loss(logits, batch, 0.2, kl_coef)
    assert float(loss_sum / weight_sum) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert 0 < float(metrics["clipped_tokens"]) == expected_metrics["clipped_tokens"] < float(metrics["sampled_tokens"])
    assert float(metrics["logprob_mismatch_max"]) == pytest.approx(expected_metrics["logprob_mismatch_max"], rel=1e-5)
    if kl_coef:
        assert float(metrics["kl_sum"]) == pytest.approx(expected_metrics["kl_sum"], rel=1e-5)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_objective_gradient_equals_float64_finite_differences(problem, kl_coef):
    logits, batch = problem
    objective = policy_objective(0.2, kl_coef)
    gradient = np.asarray(jax.grad(lambda x: (lambda s, w, _: s / w)(*objective(x, batch)))(jnp.asarray(logits, jnp.float32)))
    step = 1e-6
    for index in [(0, 0, 0), (1, 2, 3), (2, 4, 6), (0, 3, 1), (1, 1, 5)]:
        plus, minus = logits.copy(), logits.copy()
        plus[index] += step
        minus[index] -= step
        numeric = (reference_loss(plus, batch, 0.2, kl_coef)[0] - reference_loss(minus, batch, 0.2, kl_coef)[0]) / (2 * step)
        assert gradient[index] == pytest.approx(numeric, rel=1e-3, abs=1e-6)


def test_on_policy_ratio_is_one_and_the_gradient_is_the_advantage_weighted_score(problem):
    """With the recorded log-probs equal to the policy's, the loss is -mean(A) and its gradient
    -A (onehot - softmax) w: the policy-gradient theorem's estimator."""
    logits, batch = problem
    logprobs = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32))
    on_policy = {**batch, "old_logprobs": np.asarray(jnp.take_along_axis(logprobs, batch["targets"][..., None], -1)[..., 0])
                 * batch["loss_mask"]}
    objective = policy_objective(0.2, 0.0)
    loss_sum, weight_sum, metrics = objective(jnp.asarray(logits, jnp.float32), on_policy)
    assert float(metrics["logprob_mismatch_max"]) <= 1e-6 and float(metrics["clipped_tokens"]) == 0
    gradient = jax.grad(lambda x: objective(x, on_policy)[0])(jnp.asarray(logits, jnp.float32))
    softmax = np.exp(np.asarray(logprobs, np.float64))
    onehot = np.eye(logits.shape[-1])[batch["targets"]]
    expected = -(batch["weights"] * batch["advantages"])[..., None] * (onehot - softmax)
    np.testing.assert_allclose(gradient, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_replayed_log_probs_give_the_value_and_the_forward_its_gradient(problem, kl_coef):
    """With ``policy_logprobs`` p_t the objective is the float64 one at l_t = p_t, and its gradient
    dloss/dl_t (at p_t) times the forward's d log_softmax / dlogits = onehot - softmax."""
    logits, batch = problem
    mask = batch["loss_mask"]
    forward = np.take_along_axis(logits - np.log(np.exp(logits).sum(-1, keepdims=True)), batch["targets"][..., None], -1)[..., 0]
    policy = ((forward + np.random.default_rng(1).normal(scale=1e-2, size=mask.shape)) * mask).astype(np.float32)
    replayed = {**batch, "policy_logprobs": policy}
    objective = policy_objective(0.2, kl_coef)
    loss_sum, weight_sum, metrics = jax.jit(objective)(jnp.asarray(logits, jnp.float32), replayed)
    expected, expected_metrics = reference_loss(logits, batch, 0.2, kl_coef, values=policy)
    assert float(loss_sum / weight_sum) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert float(metrics["logprob_mismatch_max"]) == pytest.approx(expected_metrics["logprob_mismatch_max"], rel=1e-5)
    assert float(metrics["forward_gap_max"]) == pytest.approx(np.abs((forward - policy) * mask).max(), rel=1e-3)
    def mean_loss(x):
        total, weights, _ = objective(x, replayed)
        return total / weights

    gradient = np.asarray(jax.grad(mean_loss)(jnp.asarray(logits, jnp.float32)))
    softmax = np.exp(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))
    onehot = np.eye(logits.shape[-1])[batch["targets"]]
    step = 1e-6
    for b, t in zip(*np.nonzero(mask)):
        plus, minus = policy.astype(np.float64), policy.astype(np.float64)
        plus[b, t] += step
        minus[b, t] -= step
        slope = (reference_loss(logits, batch, 0.2, kl_coef, plus)[0] - reference_loss(logits, batch, 0.2, kl_coef, minus)[0]) / (2 * step)
        np.testing.assert_allclose(gradient[b, t], slope * (onehot[b, t] - softmax[b, t]), rtol=1e-3, atol=1e-6)
