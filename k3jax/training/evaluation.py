"""A run's held-out evaluation: what it needs of the data, the scores of a language-model run's
held-out batches, and how each evaluation is logged.

    heldout_loss = Σ NLL / scored tokens;   heldout_bits_per_byte = Σ NLL / ln 2 / scored bytes

Bits per byte are reported for data with a tokenizer (text, token shards, chat: the UTF-8 bytes of
the tokens in the loss mask, for chat the assistant's output by default), recall for MQAR.
"""
from __future__ import annotations

import numpy as np

from k3jax.config import Config, ConfigError
from k3jax.data import ChatDataset, MQARDataset, PackedDataset, mqar_recall
from k3jax.data.byte_metrics import bits_per_byte, scored_bytes, token_byte_lengths
from k3jax.sharding import to_host

# Data with a tokenizer: their held-out evaluation also reports bits per byte of the scored targets.
TOKENIZED_DATA = (PackedDataset, ChatDataset)


def check_heldout(config: Config, data) -> None:
    """Refuse ``train.eval_batches`` on tokenized data whose held-out split is empty."""
    if config.train.eval_batches and isinstance(data, TOKENIZED_DATA) and not data.num_rows("heldout"):
        raise ConfigError("train.eval_batches", f"{config.train.eval_batches}, but the data's held-out split "
                                                f"is empty; set train.eval_batches=0 or raise data.heldout_fraction")


def byte_lengths_of(data) -> np.ndarray | None:
    """Each token's length in UTF-8 bytes for tokenized data (None for others: no bits per byte)."""
    return token_byte_lengths(data.tokenizer) if isinstance(data, TOKENIZED_DATA) else None


class HeldOutScores:
    """Sums over held-out batches ``0, 1, ...`` of ``data`` (``batch_size`` rows each): the loss and
    tokens the eval step returns, the scored bytes (given ``byte_lengths``), MQAR's correct answers."""

    def __init__(self, data, batch_size: int, byte_lengths: np.ndarray | None):
        self.data, self.batch_size, self.byte_lengths = data, batch_size, byte_lengths
        self.loss_sum = self.count = self.num_bytes = 0.0
        self.correct = self.answers = 0.0

    def add(self, index: int, batch_loss, batch_count, predictions) -> None:
        """Held-out batch ``index``'s eval step results (summed loss, scored tokens, predictions)."""
        self.loss_sum, self.count = self.loss_sum + float(batch_loss), self.count + float(batch_count)
        mqar = isinstance(self.data, MQARDataset)
        if self.byte_lengths is None and not mqar:
            return
        host = self.data.batch(index, self.batch_size, split="heldout")   # every process's rows
        if self.byte_lengths is not None:
            self.num_bytes += scored_bytes(self.byte_lengths, host["targets"], host["loss_mask"])
        if mqar:
            n = float(np.sum(host["loss_mask"]))
            self.correct += mqar_recall(to_host(predictions), host) * n
            self.answers += n

    def result(self) -> dict:
        """``heldout_loss``, ``heldout_tokens``; ``heldout_bytes`` and ``heldout_bits_per_byte`` on
        tokenized data; ``heldout_mqar_recall`` on MQAR."""
        result = {"heldout_loss": self.loss_sum / max(self.count, 1.0), "heldout_tokens": int(self.count)}
        if self.byte_lengths is not None:
            result.update(heldout_bytes=int(self.num_bytes),
                          heldout_bits_per_byte=bits_per_byte(self.loss_sum, self.num_bytes))
        if self.answers:
            result["heldout_mqar_recall"] = self.correct / self.answers
        return result


def evaluation_line(step: int, result: dict) -> str:
    """``step N  held-out loss X  bits/byte Y  recall Z`` (the parts the evaluation has); for RL
    ``step N  held-out greedy reward X  pass P  (n prompts)``."""
    if "heldout_accuracy" in result:
        return (f"step {step}  held-out preference accuracy {result['heldout_accuracy']:.3f}  margin "
                f"{result['heldout_margin']:.4f}  log-prob accuracy {result['heldout_logprob_accuracy']:.3f}  loss {result['heldout_loss']:.4f}  ({result['heldout_pairs']} pairs)")
    if "heldout_reward" in result:
        return (f"step {step}  held-out greedy reward {result['heldout_reward']:.4f}  pass "
                f"{result['heldout_pass']:.3f}  ({result['heldout_prompts']} prompts)")
    parts = [f"step {step}  held-out loss {result['heldout_loss']:.4f}"]
    if "heldout_bits_per_byte" in result:
        parts.append(f"bits/byte {result['heldout_bits_per_byte']:.4f}")
    if "heldout_mqar_recall" in result:
        parts.append(f"MQAR recall {result['heldout_mqar_recall']:.3f}")
    return "  ".join(parts) + f"  ({result['heldout_tokens']} tokens)"


def log_evaluation(step: int, result: dict, log, board, progress) -> None:
    """An evaluation at ``step``: an ``{"kind": "eval"}`` record in ``log`` (a `MetricsLog`) and
    ``board`` (TensorBoard, or None), its `evaluation_line` on ``progress``."""
    record = {"kind": "eval", "step": step, **result}
    log.write(record)
    if board:
        board.write(record)
    progress.write(evaluation_line(step, result))
