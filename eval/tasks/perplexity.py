"""Perplexity and bits per byte on held-out text (``--text PATH``) or on the run's own held-out split.

Seed s reads batches ``s * batches_per_seed … (s + 1) * batches_per_seed - 1`` of the split (rows
a pure function of the data definition), at the run's training sequence length. Per seed:

    loss          = sum of masked CE (nats) / scored positions
    perplexity    = exp(loss)
    bits/token    = loss / ln 2
    bits/byte     = sum of masked CE / ln 2 / UTF-8 bytes of the scored target tokens   (text only)

For ``--text`` the whole file is the evaluation set (no held-out cut), tokenized with the run's
tokenizer; for a chat run (``data.kind=chat``) it is a JSONL file of conversations rendered in K3's
chat format with the run's chat settings, and the scored positions are the run's (the assistant's
output by default). On MQAR data only the answer positions are scored (the run's loss), and bits per
byte does not apply.
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from k3jax.data import ChatDataset, DataError, PackedDataset, TextDataset, make_dataset
from k3jax.data.byte_metrics import bits_per_byte, scored_bytes, token_byte_lengths
from ..stats import t_interval
from .common import TaskOutput, TaskSkipped, canonical_json, require_vocabulary, sha256_text


def open_text_dataset(path: str, config) -> TextDataset | ChatDataset:
    """A whole text file (or directory) as one evaluation split ("train", no held-out cut), with the
    run's tokenizer and training sequence length; conversations for a chat run."""
    if config.data.kind == "chat":
        return make_dataset(dataclasses.replace(config.data, path=path, heldout_fraction=0.0))
    return TextDataset(path, config.data.seq_len, heldout_fraction=0.0, tokenizer_path=config.data.tokenizer)


@dataclasses.dataclass(frozen=True)
class PerplexityTask:
    """Loss, perplexity, bits per token and bits per byte over ``batches_per_seed`` batches per seed."""

    name: ClassVar[str] = "perplexity"
    batches_per_seed: int = 4
    batch_size: int = 16

    def _source(self, context):
        """(dataset, split, label) to evaluate: ``--text`` or the run's held-out split."""
        if context.text is not None:
            return context.text, "train", ", ".join(context.text.paths)
        try:
            return make_dataset(context.config.data), "heldout", f"run's held-out {context.config.data.kind} data"
        except DataError as error:
            raise TaskSkipped(f"the run's data cannot be read ({error}); pass --text PATH") from None

    def run(self, context, cost, progress) -> TaskOutput:
        dataset, split, label = self._source(context)
        require_vocabulary(context.config.model.vocab_size, dataset.vocab_size, label)
        byte_lengths = (token_byte_lengths(dataset.tokenizer) if isinstance(dataset, (PackedDataset, ChatDataset))
                        else None)
        progress.reset(total=len(context.seeds) * self.batches_per_seed)
        losses, bytes_scored, tokens_scored = [], [], []
        for seed in context.seeds:
            loss_sum = count = num_bytes = 0.0
            for index in range(self.batches_per_seed):
                batch = dataset.batch(seed * self.batches_per_seed + index, self.batch_size, split)
                out = context.forward(batch, cost)
                loss_sum, count = loss_sum + out.loss_sum, count + out.count
                if byte_lengths is not None:
                    num_bytes += scored_bytes(byte_lengths, batch["targets"], batch["loss_mask"])
                progress.update()
            losses.append(loss_sum)
            tokens_scored.append(count)
            bytes_scored.append(num_bytes)
        per_token = [loss / count for loss, count in zip(losses, tokens_scored)]
        row = {
            "data": label,
            "seq_len": dataset.seq_len,
            "scored_tokens_per_seed": int(tokens_scored[0]),
            "loss_nats": t_interval(per_token),
            "perplexity": t_interval([math.exp(loss) for loss in per_token]),
            "bits_per_token": t_interval([loss / math.log(2) for loss in per_token]),
        }
        if byte_lengths is not None:
            row["bits_per_byte"] = t_interval([bits_per_byte(loss, n) for loss, n in zip(losses, bytes_scored)])
        return TaskOutput([row], sha256_text(canonical_json({"dataset": dataset.content_hash(), "split": split})))
