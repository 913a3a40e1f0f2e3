"""The eval CLI's perplexity and samples tasks on a chat run (``data.kind=chat``): perplexity over the
masked (assistant) positions of the run's held-out conversations and of ``--text`` conversations;
samples prompted in K3's chat format, ending at ``<|end_of_msg|>``."""
import json
import math

import pytest
from flax import nnx
from tqdm import tqdm

from eval.tasks import EvalContext, PerplexityTask, SamplesTask, run_task
from eval.tasks.perplexity import open_text_dataset
from k3jax.config import load_config
from k3jax.data import make_dataset
from k3jax.model import K3Model
from tests.data.chat_tokenizer import write_chat_tokenizer
from tests.helpers import MICRO
from tests.train.test_chat_learning import SMALL, write_conversations


@pytest.mark.slow   # compiles a 2-layer model's forward and its decode step
def test_perplexity_and_samples_read_chat_records(tmp_path):
    data = write_conversations(tmp_path / "chat.jsonl", 40)
    config = load_config(MICRO, SMALL + ["data.kind=chat", f"data.path={data}", "data.seq_len=128",
                                 f"data.tokenizer={write_chat_tokenizer(tmp_path / 'tokenizer')}",
                                 "data.heldout_fraction=0.25", "data.chat_thinking=false",
                                 "data.chat_thinking_effort=null"])
    context = EvalContext(K3Model(config.model, rngs=nnx.Rngs(0)), config, (0,),
                          open_text_dataset(str(write_conversations(tmp_path / "more.jsonl", 8, seed=1)), config))
    own = run_task(PerplexityTask(batches_per_seed=1, batch_size=4), EvalContext(context.model, config, (0,)),
                   tqdm(disable=True))
    heldout = make_dataset(config.data).batch(0, 4, "heldout")
    row = own.output.rows[0]
    assert row["scored_tokens_per_seed"] == int(heldout["loss_mask"].sum()) > 0
    assert row["scored_tokens_per_seed"] < int((heldout["segment_ids"] > 0).sum()) // 2   # not the user's tokens
    assert math.isfinite(row["bits_per_byte"].mean)
    text = run_task(PerplexityTask(batches_per_seed=1, batch_size=4), context, tqdm(disable=True))
    assert text.output.rows[0]["data"].endswith("more.jsonl") and text.content_hash != own.content_hash

    samples = run_task(SamplesTask(text_prompts=("3 QWERTY",), max_new_tokens=2), context, tqdm(disable=True))
    assert samples.skipped is None and samples.output.examples[0]["prompt"] == "3 QWERTY"
    assert json.loads(json.dumps(samples.output.rows[0], default=str))
