"""Preference tuning end to end (subprocesses): a micro model fine-tuned on 2-digit addition text, then
DPO on pairs (chosen = the sum, rejected = a near miss: the sum with a stray "!" before its end, a
difference a micro model can learn in a few steps and carry to held-out pairs) in full and with LoRA.

Held-out preference accuracy, margin and the policy's own log-prob accuracy rise from the step-0
evaluation; the LoRA run leaves every base parameter bit-identical and trains only its adapters;
ORPO (no reference) runs and lowers its loss.
"""
import json
import random

import numpy as np
import pytest
from flax import nnx

from tests.helpers import MICRO
from tests.train.test_lora import saved_state
from tests.train.test_qlora import run

pytestmark = pytest.mark.slow   # subprocesses


def problems(count: int, seed: int) -> list[tuple[str, str, str]]:
    """(prompt, answer, near miss) of 2-digit additions."""
    rng, out = random.Random(seed), []
    for _ in range(count):
        a, b = rng.randrange(100), rng.randrange(100)
        out.append((f"{a}+{b}=", str(a + b), f"{a + b}!"))
    return out


def train(root, run_dir, *overrides):
    return run("-m", "train", str(MICRO), f"run_dir={root / run_dir}", f"train.compilation_cache={root / 'xla'}",
               "data.tokenizer=null", "model.vocab_size=258", "logging.progress=false", *overrides)


def evaluations(run_dir) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("kind") == "eval"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference")
    (root / "sft.jsonl").write_text("".join(json.dumps({"text": p + a}) + "\n" for p, a, _ in problems(400, 0)))
    (root / "pairs.jsonl").write_text("".join(json.dumps({"prompt": p, "chosen": a, "rejected": w}) + "\n"
                                              for p, a, w in problems(160, 1)))
    train(root, "sft", "data.kind=text", f"data.path={root / 'sft.jsonl'}", "data.seq_len=32", "train.steps=30",
          "train.eval_batches=0", "checkpoint.every=30")
    return root


PAIRS = ("train.objective=dpo", "data.kind=preferences", "data.seq_len=32", "data.heldout_fraction=0.2",
         "train.batch_size=8", "train.eval_batches=2", "train.eval_every=10", "train.log_every=1",
         "optimizer.learning_rate=3e-3", "optimizer.warmup_steps=0", "optimizer.schedule_steps=null",
         "optimizer.schedule=constant", "checkpoint.every=20")


def test_dpo_raises_heldout_accuracy_and_margin(root):
    train(root, "dpo", f"init_from={root / 'sft'}", f"data.path={root / 'pairs.jsonl'}", "train.steps=20", *PAIRS)
    first, *_, last = evaluations(root / "dpo")
    assert first["step"] == 0 and last["step"] == 20
    assert first["heldout_margin"] == 0 and first["heldout_accuracy"] == 0 and first["heldout_loss"] == pytest.approx(np.log(2))
    assert last["heldout_margin"] > 0.05 and last["heldout_accuracy"] > 0.7, last
    assert last["heldout_logprob_accuracy"] >= first["heldout_logprob_accuracy"], (first, last)
    steps = [json.loads(line) for line in (root / "dpo/metrics.jsonl").read_text().splitlines() if '"eval"' not in line]
    assert {"reward_chosen", "reward_rejected", "margin", "accuracy", "pairs"} <= set(steps[0])


def test_dpo_with_lora_keeps_the_base_bit_identical(root):
    from k3jax.inference import restore_model

    train(root, "dpo_lora", f"init_from={root / 'sft'}", f"data.path={root / 'pairs.jsonl'}", "train.steps=10",
          "finetune.lora_rank=4", "finetune.lora_alpha=8", *PAIRS)
    last = evaluations(root / "dpo_lora")[-1]
    assert last["heldout_margin"] > 0, last                     # the adapters learned against the base as reference
    base, tuned = restore_model(root / "sft").model, restore_model(root / "dpo_lora").model
    after = dict(nnx.to_flat_state(nnx.state(tuned, nnx.Param)))
    for path, variable in nnx.to_flat_state(nnx.state(base, nnx.Param)):
        np.testing.assert_array_equal(np.asarray(after[path].get_value()), np.asarray(variable.get_value()))
    assert all(key.endswith(("_lora/a", "_lora/b")) for key in saved_state(root / "dpo_lora")["params"])


def test_orpo_needs_no_reference_and_lowers_its_loss(root):
    train(root, "orpo", f"data.path={root / 'pairs.jsonl'}", f"init_from={root / 'sft'}", "train.steps=10",
          *PAIRS, "train.objective=orpo")
    first, *_, last = evaluations(root / "orpo")
    assert last["heldout_loss"] < first["heldout_loss"] and last["heldout_margin"] > first["heldout_margin"]
