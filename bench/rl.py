"""RL rollout throughput, side by side in one run (`k3jax.training.rollout.Rollout`):

    forked     each prompt prefilled once, its session forked G - 1 times (KDA state copied, MLA
               pages shared), all P x G completions decoded together
    separate   the same prompts prefilled G times each (one session per completion, no fork), the
               same P x G completions decoded together -- the "G independent prefills" of engines
               that sample a group as G requests

Both sample the same tokens (the streams are the same; `tests/train/test_rollout.py` checks that
they are equal bit for bit), so the work differs only in the prefills. Reported: seconds per
rollout (median of the timed trials, after warm-up trials that compile every program), completion
tokens/s, prefilled tokens, MLA pages held at the end of decoding, and the ratio. With ``--run
RUN_DIR`` (an RL run) it also reports the rollout vs update share of that run's steps (from its
metrics.jsonl, the first step -- compilation -- left out).

    python -m bench.rl [--config configs/tiny.yaml] [--prompts 4] [--group 8] [--prompt-tokens 512]
                       [--new-tokens 16] [--trials 3] [--run RUN_DIR] [--json bench/rl.json]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile

import numpy as np
from flax import nnx

from bench.common import table, timed, write_json
from k3jax.config import ConfigError, load_config
from k3jax.data import PromptDataset
from k3jax.model import K3Model
from k3jax.training.metrics import read_metrics
from k3jax.training.rollout import Rollout, SamplingSettings

WARMUP_TRIALS = 2
WORDS = "the of and to in is was for on that with as by at from his her it an be this are".split()


def prompts_file(directory: pathlib.Path, count: int, tokens: int, seed: int = 0) -> pathlib.Path:
    """``count`` prompts of ``tokens`` bytes of words each (the byte tokenizer: one token per byte)."""
    rng = np.random.default_rng(seed)
    path = directory / "prompts.jsonl"
    lines = []
    for _ in range(count):
        text = ""
        while len(text) < tokens:
            text += str(rng.choice(WORDS)) + " "
        lines.append(json.dumps({"prompt": text[:tokens], "answer": ""}))
    path.write_text("\n".join(lines) + "\n")
    return path


def rollout_trials(model, data, prompts, group: int, settings: SamplingSettings, trials: int) -> dict:
    """Per variant: the seconds of each timed trial, prefilled tokens, pages held after decoding."""
    results = {name: {"seconds": []} for name in ("forked", "separate")}
    for trial in range(trials + WARMUP_TRIALS):
        order = ["forked", "separate"] if trial % 2 == 0 else ["separate", "forked"]
        for name in order:
            rollout = Rollout(model, data, settings, reward=lambda *args: 0.0)
            pages = []
            step = rollout.store.step

            def counting_step(sampling, step=step, store=rollout.store):
                tokens = step(sampling)
                pages.append(store.stats()["pages_in_use"])
                return tokens

            rollout.store.step = counting_step
            groups, elapsed = timed(lambda: rollout.sample(prompts, group, seed=trial, fork=name == "forked"))
            if trial >= WARMUP_TRIALS:
                results[name]["seconds"].append(elapsed)
            results[name].update(prefill_tokens=rollout.store.stats()["prefill_tokens"], peak_pages=max(pages),
                                 completion_tokens=sum(c.length for g in groups for c in g))
    return results


def run_shares(run_dir: str) -> dict:
    """Rollout and update seconds of an RL run's steps (the first, which compiles, left out); of the
    update's, the decode replay's (``rl.update_logprobs=decode``; 0 without)."""
    steps = [m for m in read_metrics(run_dir) if "rollout_seconds" in m][1:]
    if not steps:
        raise SystemExit(f"error: {run_dir} has no RL steps after its first in metrics.jsonl")
    rollout = sum(m["rollout_seconds"] for m in steps)
    update = sum(m["update_seconds"] for m in steps)
    replay = sum(m.get("replay_seconds", 0.0) for m in steps)
    return {"run": run_dir, "steps": len(steps), "rollout_seconds": rollout, "update_seconds": update,
            "replay_seconds": replay, "rollout_share": rollout / (rollout + update),
            "replay_share": replay / (rollout + update)}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.rl", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--run", help="an RL run directory: also report its rollout vs update share")
    parser.add_argument("--json", default="bench/rl.json")
    args = parser.parse_args(argv)
    if min(args.prompts, args.group, args.prompt_tokens, args.new_tokens, args.trials) < 1:
        parser.error("--prompts, --group, --prompt-tokens, --new-tokens and --trials must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args.config).model
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model = K3Model(config, rngs=nnx.Rngs(0))
    settings = SamplingSettings(temperature=1.0, top_k=None, top_p=1.0, max_new_tokens=args.new_tokens)
    with tempfile.TemporaryDirectory() as directory:
        path = prompts_file(pathlib.Path(directory), args.prompts, args.prompt_tokens)
        data = PromptDataset(path, args.prompt_tokens + args.new_tokens, heldout_fraction=0)
        prompts = data.prompts(0, args.prompts)
        print(f"{args.prompts} prompts x {args.group} samples, {args.prompt_tokens} prompt + {args.new_tokens} "
              f"new tokens, {args.trials} trials", file=sys.stderr)
        results = rollout_trials(model, data, prompts, args.group, settings, args.trials)
    rows = []
    for name, result in results.items():
        result["median_seconds"] = statistics.median(result["seconds"])
        result["completion_tokens_per_s"] = result["completion_tokens"] / result["median_seconds"]
        rows.append([name, f"{result['median_seconds']:.2f}", f"{result['completion_tokens_per_s']:.0f}",
                     str(result["prefill_tokens"]), str(result["peak_pages"])])
    speedup = results["separate"]["median_seconds"] / results["forked"]["median_seconds"]
    print(table(["rollout", "seconds", "completion tok/s", "prefilled tokens", "MLA pages held"], rows))
    print(f"forked / separate tokens/s: {speedup:.2f}x")
    output = {"config": args.config, "prompts": args.prompts, "group": args.group,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "trials": args.trials,
              **results, "forked_speedup": speedup}
    if args.run:
        output["run"] = run_shares(args.run)
        share = output["run"]
        print(f"{args.run}: rollout {share['rollout_seconds']:.1f} s, update {share['update_seconds']:.1f} s (of it "
              f"replay {share['replay_seconds']:.1f} s) over {share['steps']} steps: rollout share "
              f"{share['rollout_share']:.1%}, replay share {share['replay_share']:.1%}")
    write_json(args.json, output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
