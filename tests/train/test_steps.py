"""The train step's non-finite guard (`k3jax.training.steps.make_train_step`): a step whose loss,
gradient norm or updated parameters are not finite leaves the whole state as it was. A one-matrix
stand-in for the model keeps the compile to a second; the loss is checked against NumPy."""
import types

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from k3jax.training import init_train_state, make_train_step, split_model

VOCAB = 8


class Bigram(nnx.Module):
    """logits[b, t] = W[tokens[b, t]]: the smallest model with the K3 model's call signature."""

    def __init__(self):
        self.table = nnx.Param(jax.random.normal(jax.random.key(0), (VOCAB, VOCAB)))

    def __call__(self, tokens, segment_ids=None):
        return types.SimpleNamespace(logits=self.table[...][tokens], moe_stats=None)


def batch():
    tokens = np.arange(12, dtype=np.int32).reshape(2, 6) % VOCAB
    return {"tokens": tokens, "targets": (tokens + 1) % VOCAB, "loss_mask": np.ones((2, 6), np.float32),
            "segment_ids": np.zeros((2, 6), np.int32)}


def step_once(learning_rate: float):
    parts, params, buffers = split_model(Bigram())
    optimizer = optax.sgd(learning_rate)
    state = init_train_state(params, buffers, optimizer)
    before = jax.tree.map(np.asarray, state.params)
    new_state, metrics = make_train_step(parts, optimizer)(state, batch())
    return before, jax.tree.map(np.asarray, new_state.params), jax.device_get(metrics), new_state


def test_a_finite_step_updates_and_reports_the_numpy_loss():
    before, after, metrics, state = step_once(0.1)
    table = before["table"].astype(np.float64)
    data = batch()
    logits = table[data["tokens"]]
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, data["targets"][..., None], -1).mean()
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["finite"] and int(state.step) == 1 and int(state.skipped) == 0
    assert not np.array_equal(after["table"], before["table"])


@pytest.mark.parametrize("learning_rate", [np.inf, np.nan])
def test_updated_parameters_that_are_not_finite_skip_the_step(learning_rate):
    # The loss and the gradient norm are finite; only the update is not.
    before, after, metrics, state = step_once(learning_rate)
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
    assert not metrics["finite"] and int(state.step) == 0 and int(state.skipped) == 1
    np.testing.assert_array_equal(after["table"], before["table"])
