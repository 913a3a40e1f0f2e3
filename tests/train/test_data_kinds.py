"""The trainer on prepared token shards: the same losses, bit for bit, as on the text they were made
from, with the batches read ahead on the prefetch thread or in line, straight or resumed."""
import json

import pytest

from k3jax.config import load_config
from k3jax.data.prepare import prepare
from tests.helpers import MICRO
from tests.train.test_heldout_eval import write_corpus
from k3jax.training import Trainer


def losses(run_dir) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(record["step"], record["loss"]) for record in records if "loss" in record]


def train(tmp_path, name, steps, *overrides):
    config = load_config(MICRO, [f"run_dir={tmp_path / name}", "model.vocab_size=258", "data.heldout_fraction=0.2",
                                 f"train.compilation_cache={tmp_path / 'xla'}", f"train.steps={steps}",
                                 "optimizer.schedule_steps=6", *overrides])   # the stop at 3 keeps the schedule
    return Trainer(config).run()


@pytest.mark.slow   # three trainers: ~1 minute of compilation on 2 cores (the second and third hit the cache)
def test_tokens_train_like_their_text_with_or_without_prefetch_and_after_a_resume(tmp_path):
    corpus = write_corpus(tmp_path)
    prepare([str(corpus)], tmp_path / "tokens", shard_tokens=200, log=lambda line: None)
    text = ["data.kind=text", f"data.path={corpus}"]
    tokens = ["data.kind=tokens", f"data.path={tmp_path / 'tokens'}"]
    straight = train(tmp_path, "text", 6, *text, "data.prefetch=0")
    train(tmp_path, "tokens", 3, *tokens, "data.prefetch=2")
    resumed = train(tmp_path, "tokens", 6, *tokens, "data.prefetch=2")
    assert losses(tmp_path / "tokens") == losses(tmp_path / "text") and len(losses(tmp_path / "text")) == 6
    assert resumed["heldout_loss"] == straight["heldout_loss"]
