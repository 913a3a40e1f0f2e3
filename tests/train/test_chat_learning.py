"""Fine-tuning on conversations (``data.kind=chat``): the loss counts only what the assistant writes.

The user turns are a key digit and random capital letters (noise no model can predict); the
assistant answers the key's fixed word. Training the micro model lowers the held-out loss, and the
loss and bits per byte the trainer reports equal a float64 NumPy cross-entropy over the assistant's
tokens alone (and the UTF-8 bytes of those tokens: 1 per byte token, 0 for the chat markers).
"""
import json
import pathlib

import jax
import numpy as np
import pytest

from k3jax.config import load_config
from tests.data.chat_tokenizer import write_chat_tokenizer
from tests.helpers import MICRO
from tests.train.test_heldout_eval import numpy_bits_per_byte
from k3jax.training import Trainer

SMALL = ["model.num_layers=2", "model.mla_period=2", "model.dense_layers=2"]   # KDA then MLA, dense: fast to compile
WORDS = ["zero", "one", "two", "three"]


def write_conversations(path: pathlib.Path, count: int, seed: int = 0) -> pathlib.Path:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(count):
        key = int(rng.integers(len(WORDS)))
        noise = "".join(chr(c) for c in rng.integers(ord("A"), ord("Z") + 1, size=12))
        lines.append(json.dumps({"messages": [{"role": "user", "content": f"{key} {noise}"},
                                              {"role": "assistant", "content": WORDS[key]}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return -np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]


@pytest.mark.slow   # one trainer (two compilations) and 80 steps
def test_assistant_loss_falls_and_user_noise_is_not_counted(tmp_path):
    data = write_conversations(tmp_path / "chat.jsonl", 200)
    config = load_config(MICRO, SMALL + [f"run_dir={tmp_path / 'run'}", "data.kind=chat", f"data.path={data}",
                                 f"data.tokenizer={write_chat_tokenizer(tmp_path / 'tokenizer')}",
                                 "data.seq_len=128", "data.heldout_fraction=0.1", "data.chat_thinking=false",
                                 "data.chat_thinking_effort=null", "train.steps=80", "train.batch_size=8",
                                 "train.eval_batches=1", "checkpoint.every=1000", "train.compilation_cache=null"])
    trainer = Trainer(config)
    before = trainer.evaluate()["heldout_loss"]
    summary = trainer.run()
    after = summary["heldout_loss"]
    assert after < 0.4 * before, (before, after)

    batch = trainer.data.batch(0, config.train.batch_size, "heldout")
    mask, targets = batch["loss_mask"], batch["targets"]
    capitals = (targets >= ord("A")) & (targets <= ord("Z"))
    assert capitals.any() and not (capitals & (mask > 0)).any()      # user noise is never a scored target
    assert (targets[mask > 0] == trainer.data.encoder.end_of_message_id).any()   # the turn's end is scored
    forward = jax.jit(lambda params, buffers, tokens, segment_ids:
                      trainer.parts.merge(params, buffers)(tokens, segment_ids=segment_ids).logits)
    logits = np.asarray(forward(trainer.state.params, trainer.state.buffers, batch["tokens"], batch["segment_ids"]))
    losses = nll(logits, targets)
    assistant_only = float(np.sum(losses * mask) / np.sum(mask))
    np.testing.assert_allclose(after, assistant_only, rtol=1e-5)
    np.testing.assert_allclose(summary["heldout_bits_per_byte"], numpy_bits_per_byte(logits, targets, mask)[1], rtol=1e-5)
    assert summary["heldout_bytes"] == int(np.sum((targets < 256) * mask)) < summary["heldout_tokens"]   # markers: 0 bytes
    every_token = float(np.mean(losses[batch["segment_ids"] > 0]))
    assert every_token > 2 * assistant_only          # counting the noise would report a much larger loss
