"""GRPO on a 2 x 2 x 2 mesh (data, fsdp, tensor) of 8 devices: the rollouts sample on the sharded
parameters themselves; the update recomputes their log-probs by replaying the decode (bit for bit),
and a one-device full forward of each checkpointed policy to <= 1e-5."""
import json
import pathlib
import sys
import tempfile

import numpy as np
from flax import nnx

from k3jax.inference import restore_model
from k3jax.sampling import log_softmax
from k3jax.training import RLTrainer, Trainer
from tests.sharding.programs.common import emit, small_k3_config
from tests.train.test_heldout_eval import write_corpus

MESH = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")


def main() -> None:
    root = pathlib.Path(tempfile.mkdtemp())
    corpus = write_corpus(root)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"the {word} is"}) + "\n"
                                                for word in "cat dog mat sun sea sky tree bird".split()))
    common = ["model.vocab_size=258", f"train.compilation_cache={root / 'xla'}", *MESH]
    Trainer(small_k3_config(f"run_dir={root / 'sft'}", "data.kind=text", f"data.path={corpus}", "train.steps=2",
                            "train.eval_batches=0", *common)).run()
    run = root / "grpo"
    RLTrainer(small_k3_config(
        f"run_dir={run}", f"init_from={root / 'sft'}", "train.objective=grpo", "data.kind=prompts",
        f"data.path={root / 'prompts.jsonl'}", "data.seq_len=16", "train.steps=2", "rl.prompts_per_step=2",
        "rl.group_size=4", "rl.max_new_tokens=4", "rl.eval_prompts=0", "rl.reward=tests.train.test_rl_runs:letters",
        "checkpoint.every=1", *common)).run()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    forward = nnx.jit(lambda model, tokens: model(tokens).logits)
    worst = 0.0
    for record in rollouts:
        model = restore_model(run, step=record["policy_step"]).model
        sequence = np.array(record["prompt_tokens"] + record["completion_tokens"], np.int32)
        logits = np.asarray(forward(model, np.pad(sequence, (0, 32 - sequence.size))[None])[0])
        start, count = len(record["prompt_tokens"]) - 1, len(record["completion_tokens"])
        expected = log_softmax(logits[start : start + count])[np.arange(count), record["completion_tokens"]]
        worst = max(worst, float(np.abs(expected - record["logprobs"]).max()))
    emit({"mismatch": max(m["logprob_mismatch"] for m in metrics if "loss" in m), "steps": len(metrics),
          "rollouts": len(rollouts), "policy_vs_one_device": worst,
          "grad_norm": [m["grad_norm"] for m in metrics if "loss" in m]})


if __name__ == "__main__":
    sys.exit(main())
