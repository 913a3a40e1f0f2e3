"""Preference tuning: the packed pairs, and each loss and its gradient against float64 NumPy.

The NumPy side is independent of `k3jax.training.preference`: it finds each pair's sequences by
walking the rows' segment numbers, takes float64 log-softmax log-probs, evaluates the loss formula
of each objective as written in the papers, gets d loss / d (sequence sums) by central differences
in float64 and chains it through the log-softmax's Jacobian (one-hot minus softmax) analytically.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import ConfigError, PreferenceConfig, load_config
from k3jax.data import DataError, PreferenceDataset
from k3jax.training.preference import preference_objective
from tests.helpers import ROOT

RECORDS = [{"prompt": "12+34=", "chosen": "46", "rejected": "45"},
           {"prompt": "7+8=", "chosen": "15", "rejected": "14"},
           {"prompt": "100+1=", "chosen": "101", "rejected": "1001"},
           {"prompt": "9+9=", "chosen": "18", "rejected": "81"},
           {"prompt": "5+5=", "chosen": "10", "rejected": "11"}]
SETTINGS = PreferenceConfig(beta=0.3, simpo_margin=0.4, orpo_weight=0.7)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    return PreferenceDataset(path, 24, heldout_fraction=0.0)


def test_pairs_are_packed_whole_with_the_replies_in_the_loss(pairs):
    batch = pairs.batch(0, pairs.num_rows())
    found, eos = [], pairs.tokenizer.eos_id
    for row in range(batch["tokens"].shape[0]):
        full = np.concatenate([batch["tokens"][row], batch["targets"][row, -1:]])
        segments = np.concatenate([batch["segment_ids"][row], [0]])
        for first in range(1, segments.max() + 1, 2):
            texts = []
            for number in (first, first + 1):
                where = np.flatnonzero(segments == number)
                ids = full[where[0]:where[-1] + 1]   # the row's tokens of the sequence
                scored = batch["targets"][row, where][batch["loss_mask"][row, where] > 0]
                text = lambda x: pairs.tokenizer.decode([int(i) for i in x if i != eos])  # noqa: E731
                texts.append((text(ids), text(scored), scored[-1]))
            found.append(texts)
    expected = {(r["prompt"] + r["chosen"], r["chosen"], r["prompt"] + r["rejected"], r["rejected"]) for r in RECORDS}
    assert {(c[0], c[1], r[0], r[1]) for c, r in found} == expected
    assert all(c[2] == eos and r[2] == eos for c, r in found)   # the reply's EOS is scored too


def numpy_losses(kind: str, pi, rho, lengths) -> np.ndarray:
    """Per-pair losses in float64 from sequence sums ``pi``, ``rho`` ``[pairs, 2]`` and lengths."""
    beta, gamma, lam = SETTINGS.beta, SETTINGS.simpo_margin, SETTINGS.orpo_weight
    log_sigmoid = lambda x: -np.logaddexp(0.0, -x)  # noqa: E731
    if kind == "dpo":
        return -log_sigmoid(beta * ((pi[:, 0] - rho[:, 0]) - (pi[:, 1] - rho[:, 1])))
    if kind == "ipo":
        return ((pi[:, 0] - rho[:, 0]) - (pi[:, 1] - rho[:, 1]) - 1 / (2 * beta)) ** 2
    mean = pi / lengths
    if kind == "simpo":
        return -log_sigmoid(beta * mean[:, 0] - beta * mean[:, 1] - gamma)
    odds = np.exp(mean) / (1 - np.exp(mean))
    return -mean[:, 0] - lam * log_sigmoid(np.log(odds[:, 0] / odds[:, 1]))


def numpy_loss_and_gradient(kind, logits, reference_logits, batch):
    """The mean loss over pairs and its gradient with respect to ``logits``, in float64."""
    def log_softmax(x):
        x = x.astype(np.float64)
        return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)

    logp, ref = log_softmax(logits), log_softmax(reference_logits)
    rows, positions = batch["segment_ids"].shape
    members = []                                         # [(row, positions of c, positions of r)]
    for row in range(rows):
        segments = batch["segment_ids"][row]
        for first in range(1, segments.max() + 1, 2):
            members.append((row, *(np.flatnonzero((segments == n) & (batch["loss_mask"][row] > 0))
                                   for n in (first, first + 1))))
    take = lambda lp, row, where: lp[row, where, batch["targets"][row, where]].sum()  # noqa: E731
    pi = np.array([[take(logp, row, c), take(logp, row, r)] for row, c, r in members])
    rho = np.array([[take(ref, row, c), take(ref, row, r)] for row, c, r in members])
    lengths = np.array([[c.size, r.size] for _, c, r in members], np.float64)
    loss = numpy_losses(kind, pi, rho, lengths).mean()
    step, d_pi = 1e-6, np.zeros_like(pi)
    for index in np.ndindex(*pi.shape):
        up, down = pi.copy(), pi.copy()
        up[index] += step
        down[index] -= step
        d_pi[index] = (numpy_losses(kind, up, rho, lengths).mean() - numpy_losses(kind, down, rho, lengths).mean()) / (2 * step)
    grad = np.zeros_like(logp)
    softmax = np.exp(logp)
    for (row, *sequences), d in zip(members, d_pi):
        for where, d_sum in zip(sequences, d):
            one_hot = np.eye(logp.shape[-1])[batch["targets"][row, where]]
            grad[row, where] += d_sum * (one_hot - softmax[row, where])
    return loss, grad


@pytest.mark.parametrize("kind", ["dpo", "ipo", "simpo", "orpo"])
def test_loss_and_gradient_equal_float64_numpy(pairs, kind):
    batch = {name: jnp.asarray(value) for name, value in pairs.batch(0, pairs.num_rows()).items()}
    rng = np.random.default_rng(1)
    shape = (*batch["tokens"].shape, pairs.vocab_size)
    logits = rng.normal(0, 2, shape).astype(np.float32)
    reference_logits = (logits + rng.normal(0, 0.5, shape)).astype(np.float32)
    reference = jax.nn.log_softmax(jnp.asarray(reference_logits), -1)
    batch["reference_logprobs"] = jnp.take_along_axis(reference, batch["targets"][..., None], -1)[..., 0]
    objective = preference_objective(kind, SETTINGS)

    def mean_loss(x):
        total, count, _ = objective(x, batch)
        return total / count

    loss, grad = jax.value_and_grad(mean_loss)(jnp.asarray(logits))
    expected_loss, expected_grad = numpy_loss_and_gradient(kind, logits, reference_logits,
                                                           {k: np.asarray(v) for k, v in batch.items()})
    np.testing.assert_allclose(float(loss), expected_loss, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-3, atol=2e-6)
    assert np.abs(expected_grad).max() > 1e-3


def test_metrics_are_the_pairs_rewards(pairs):
    batch = {name: jnp.asarray(value) for name, value in pairs.batch(0, pairs.num_rows()).items()}
    logits = jnp.asarray(np.random.default_rng(2).normal(0, 2, (*batch["tokens"].shape, pairs.vocab_size)), jnp.float32)
    batch["reference_logprobs"] = jnp.zeros(batch["tokens"].shape)
    total, count, metrics = preference_objective("dpo", SETTINGS)(logits, batch)
    assert int(count) == len(RECORDS)
    margin = float(metrics["reward_chosen"] - metrics["reward_rejected"])
    np.testing.assert_allclose(float(metrics["margin"]), margin, rtol=1e-5)
    assert 0 <= float(metrics["accuracy"]) <= len(RECORDS)


def test_bad_records_and_combinations_are_refused_in_one_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "chosen": "2"}) + "\n")
    with pytest.raises(DataError, match="bad.jsonl:1: .*'chosen' and 'rejected'"):
        PreferenceDataset(path, 16)
    path.write_text(json.dumps({"prompt": "1+1=", "chosen": {"role": "assistant", "content": "2"}, "rejected": "3"}) + "\n")
    with pytest.raises(DataError, match="message object, which needs a 'messages' prompt"):
        PreferenceDataset(path, 16)
    config = str(ROOT / "configs/pref/addition_dpo.yaml")
    with pytest.raises(ConfigError, match="^init_from: train.objective=dpo"):
        load_config(config)
    with pytest.raises(ConfigError, match="^data.kind: train.objective=orpo tunes on preference pairs"):
        load_config(config, ["train.objective=orpo", "data.kind=text"])
    with pytest.raises(ConfigError, match="^train.objective: data.kind=preferences goes with"):
        load_config(config, ["train.objective=lm"])
    with pytest.raises(ConfigError, match="^preference.beta: must be positive"):
        load_config(config, ["init_from=x", "preference.beta=0"])


@pytest.mark.parametrize("thinking", [False, True])
def test_chat_pairs_are_the_rendered_conversation_with_each_reply(tmp_path, thinking):
    from k3jax.data.chat_format import ChatEncoder, render_conversation
    from k3jax.data.tokenizers import load_tokenizer
    from tests.data.chat_tokenizer import write_chat_tokenizer

    tokenizer = write_chat_tokenizer(tmp_path / "tok")
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+2?"}]
    chosen = {"role": "assistant", "content": "4", "reasoning_content": "two and two"}
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": messages, "chosen": chosen, "rejected": "5"}) + "\n")
    data = PreferenceDataset(path, 512, heldout_fraction=0.0, tokenizer_path=tokenizer, thinking=thinking,
                             thinking_effort=None)
    batch = data.batch(0, 1)
    encoder = ChatEncoder(load_tokenizer(tokenizer))
    for number, reply in ((1, chosen), (2, {"role": "assistant", "content": "5"})):
        ids, flags = encoder.encode(render_conversation(messages + [reply], thinking=thinking, thinking_effort=None))
        where = np.flatnonzero(batch["segment_ids"][0] == number)
        np.testing.assert_array_equal(batch["tokens"][0, where], ids)
        # the loss counts the reply: the rendering's assistant output (the only assistant message)
        np.testing.assert_array_equal(batch["loss_mask"][0, where] > 0, np.append(flags[1:], False))
        assert ids[-1] == encoder.end_of_message_id and flags[-1]
