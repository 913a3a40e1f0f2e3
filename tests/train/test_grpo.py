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


def reference_loss(logits, batch, clip, kl_coef, values=None, clip_high=None, ratio_level="token"):
    """The objective's (loss sum / count sum, metrics) in float64, token by token; ``values``
    ``[B, T]``: the policy's log-probs (the replayed p_t) instead of the logits' log-softmax;
    the ratio clipped to [1 - clip, 1 + clip_high (default clip)], per token or (``ratio_level=
    "sequence"``) exp of the mean log-ratio of the row's sampled tokens (GSPO's s_i)."""
    logits = np.asarray(logits, np.float64)
    clip_high = clip if clip_high is None else clip_high
    total = weight_sum = clipped = mismatch = kl_total = 0.0
    logprobs = np.zeros(logits.shape[:2])
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            row = logits[b, t] - logits[b, t].max()
            logprobs[b, t] = row[batch["targets"][b, t]] - np.log(np.exp(row).sum()) if values is None else values[b, t]
    for b in range(logits.shape[0]):
        sampled = [t for t in range(logits.shape[1]) if batch["loss_mask"][b, t]]
        sequence_ratio = np.exp(np.mean([logprobs[b, t] - batch["old_logprobs"][b, t] for t in sampled])) if sampled else 1.0
        for t in sampled:
            logprob = logprobs[b, t]
            ratio = np.exp(logprob - batch["old_logprobs"][b, t]) if ratio_level == "token" else sequence_ratio
            advantage = batch["advantages"][b, t]
            bounded = min(max(ratio, 1 - clip), 1 + clip_high)
            term = -min(ratio * advantage, bounded * advantage)
            clipped += ratio * advantage > bounded * advantage
            mismatch = max(mismatch, abs(logprob - batch["old_logprobs"][b, t]))
            if kl_coef:
                log_ratio = batch["reference_logprobs"][b, t] - logprob
                kl = np.exp(log_ratio) - log_ratio - 1
                term += kl_coef * kl
                kl_total += kl
            total += batch["weights"][b, t] * term
            weight_sum += batch["counts"][b, t]
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
             "counts": mask / mask.sum(axis=1, keepdims=True),
             "reference_logprobs": true_logprobs + rng.normal(scale=0.3, size=mask.shape)}
    return logits, {key: np.asarray(value, np.float32) if value.dtype == np.float64 else value
                    for key, value in batch.items()}


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_objective_value_and_metrics_equal_float64(problem, kl_coef):
    logits, batch = problem
    loss_sum, weight_sum, metrics = jax.jit(policy_objective(0.2, 0.2, kl_coef))(jnp.asarray(logits, jnp.float32), batch)
    expected, expected_metrics = reference_loss(logits, batch, 0.2, kl_coef)
    assert float(loss_sum / weight_sum) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert 0 < float(metrics["clipped_tokens"]) == expected_metrics["clipped_tokens"] < float(metrics["sampled_tokens"])
    assert float(metrics["logprob_mismatch_max"]) == pytest.approx(expected_metrics["logprob_mismatch_max"], rel=1e-5)
    if kl_coef:
        assert float(metrics["kl_sum"]) == pytest.approx(expected_metrics["kl_sum"], rel=1e-5)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_objective_gradient_equals_float64_finite_differences(problem, kl_coef):
    logits, batch = problem
    objective = policy_objective(0.2, 0.2, kl_coef)
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
    objective = policy_objective(0.2, 0.2, 0.0)
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
    objective = policy_objective(0.2, 0.2, kl_coef)
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


def loss_averages(mask: np.ndarray, max_tokens: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(w_t, c_t) of each ``rl.loss_average`` written from the docstring's table."""
    lengths = np.maximum(mask.sum(axis=1, keepdims=True), 1)
    return {"token": (mask, mask), "sequence": (mask / lengths, mask / lengths),
            "dr_grpo": (mask, mask * max_tokens / lengths)}


VARIANTS = [   # (clip_low, clip_high, ratio, loss_average, kl_coef)
    (0.2, 0.2, "token", "dr_grpo", 0.0),
    (0.1, 0.4, "token", "token", 0.1),          # DAPO's clip-higher
    (0.2, 0.3, "sequence", "sequence", 0.0),    # GSPO
    (0.05, 0.1, "sequence", "token", 0.1),
]


@pytest.mark.parametrize("clip_low, clip_high, ratio, loss_average, kl_coef", VARIANTS)
def test_dapo_and_gspo_options_value_and_gradient_wrt_logprobs_equal_float64(problem, clip_low, clip_high, ratio,
                                                                              loss_average, kl_coef):
    """Each option's loss against the float64 formula at the policy's log-probs l_t = p_t, and its
    gradient with respect to them: dloss/dl_t by central differences of the float64 loss (the
    objective's gradient reaches the logits as dloss/dl_t (onehot - softmax))."""
    logits, batch = problem
    mask = batch["loss_mask"]
    weights, counts = loss_averages(mask.astype(np.float64), max_tokens=6)[loss_average]
    batch = {**batch, "weights": weights.astype(np.float32), "counts": counts.astype(np.float32)}
    forward = np.take_along_axis(logits - np.log(np.exp(logits).sum(-1, keepdims=True)), batch["targets"][..., None], -1)[..., 0]
    policy = ((forward + np.random.default_rng(2).normal(scale=0.3, size=mask.shape)) * mask).astype(np.float32)
    replayed = {**batch, "policy_logprobs": policy}
    objective = policy_objective(clip_low, clip_high, kl_coef, ratio)
    options = dict(clip_high=clip_high, ratio_level=ratio)
    loss_sum, count, metrics = jax.jit(objective)(jnp.asarray(logits, jnp.float32), replayed)
    expected, expected_metrics = reference_loss(logits, batch, clip_low, kl_coef, policy, **options)
    assert float(loss_sum / count) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert float(metrics["clipped_tokens"]) == expected_metrics["clipped_tokens"]
    gradient = np.asarray(jax.grad(lambda x: (lambda s, c, _: s / c)(*objective(x, replayed)))(jnp.asarray(logits, jnp.float32)))
    softmax = np.exp(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))
    onehot = np.eye(logits.shape[-1])[batch["targets"]]
    step, slopes = 1e-6, []
    for b, t in zip(*np.nonzero(mask)):
        plus, minus = policy.astype(np.float64), policy.astype(np.float64)
        plus[b, t] += step
        minus[b, t] -= step
        slope = (reference_loss(logits, batch, clip_low, kl_coef, plus, **options)[0]
                 - reference_loss(logits, batch, clip_low, kl_coef, minus, **options)[0]) / (2 * step)
        slopes.append(slope)
        np.testing.assert_allclose(gradient[b, t], slope * (onehot[b, t] - softmax[b, t]), rtol=1e-3, atol=1e-6)
    assert max(map(abs, slopes)) > 1e-3


def test_update_rows_weights_counts_and_left_out_completions():
    completions = [completion([5, 6], [8, 9, 1], [True] * 3, [-0.5] * 3, 1.0),
                   completion([4], [1, 2], [True, True], [-1.0, -2.0], -1.0)]
    for loss_average in ("token", "sequence", "dr_grpo"):
        rows = update_rows(completions, 6, loss_average, max_tokens=4, keep=[True, False])
        expected_w, expected_c = loss_averages(rows["loss_mask"][:1].astype(np.float64), 4)[loss_average]
        np.testing.assert_allclose(rows["weights"][0], expected_w[0], rtol=1e-7)
        np.testing.assert_allclose(rows["counts"][0], expected_c[0], rtol=1e-7)
        assert not rows["weights"][1].any() and not rows["counts"][1].any() and rows["loss_mask"][1].sum() == 2


def test_overlong_penalty_is_dapos_soft_ramp():
    from k3jax.training.grpo import overlong_penalty

    limit, cache = 20, 5
    lengths = np.arange(0, 24)
    expected = [0.0 if n <= limit - cache else (limit - cache - n) / cache if n <= limit else -1.0 for n in lengths]
    np.testing.assert_allclose(overlong_penalty(lengths, limit, cache), expected, rtol=0, atol=1e-15)
    assert overlong_penalty([15, 16, 20], limit, cache).tolist() == [0.0, -0.2, -1.0]


def test_resampling_refills_the_update_with_groups_that_have_spread_in_the_order_sampled():
    from types import SimpleNamespace

    from k3jax.training.grpo import groups_for_update

    def rounds_of(*rewards_per_round):
        """``sample_round`` over fixed rounds of groups (a group: its rewards); records each call."""
        calls = []

        def sample_round(r):
            calls.append(r)
            return [[SimpleNamespace(reward=x, name=(r, g)) for x in rewards]
                    for g, rewards in enumerate(rewards_per_round[r])]
        return sample_round, calls

    names = lambda groups: [group[0].name for group in groups]      # noqa: E731
    flat, spread = [1.0, 1.0], [0.0, 1.0]
    sample, calls = rounds_of([flat, spread, flat])
    own, update, count = groups_for_update(sample, 3, 0)            # no resampling: round 0 as sampled
    assert own is update and names(update) == [(0, 0), (0, 1), (0, 2)] and count == 1 and calls == [0]
    sample, calls = rounds_of([flat, spread, flat], [spread, flat, spread], [spread] * 3)
    own, update, count = groups_for_update(sample, 3, 5)            # filled after round 1: round 2 never sampled
    assert names(own) == [(0, 0), (0, 1), (0, 2)] and calls == [0, 1] and count == 2
    assert names(update) == [(0, 1), (1, 0), (1, 2)]
    sample, calls = rounds_of([flat, spread, flat], [flat, flat, flat], [flat, flat, spread], [spread] * 3)
    own, update, count = groups_for_update(sample, 3, 2)            # out of rounds: round 0's flat groups fill
    assert calls == [0, 1, 2] and count == 3 and names(update) == [(0, 1), (2, 2), (0, 0)]


def test_kept_completions_drop_groups_without_spread_and_cut_completions():
    from k3jax.training.grpo import kept_completions

    rewards = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5]])
    reasons = np.array([["stop", "length", "stop"], ["length", "stop", "stop"], ["stop"] * 3])
    assert kept_completions(rewards, reasons, dynamic_sampling=False, overlong_filter=False).all()
    np.testing.assert_array_equal(kept_completions(rewards, reasons, dynamic_sampling=True, overlong_filter=False),
                                  [[False] * 3, [True] * 3, [False] * 3])
    np.testing.assert_array_equal(kept_completions(rewards, reasons, dynamic_sampling=True, overlong_filter=True),
                                  [[False] * 3, [False, True, True], [False] * 3])
