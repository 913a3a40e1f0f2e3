"""The README's RL job under GRPO-family variants, same seed, reward curves side by side.

    python -m bench.rl_variants --sft runs/addition_sft [--config configs/rl/addition.yaml] [--runs DIR]
                                [--out bench/rl_variants.json] [--variant NAME=OVERRIDE[,OVERRIDE...]]...

Each variant runs ``python -m train CONFIG init_from=SFT run_dir=RUNS/NAME train.log_every=1
OVERRIDE...`` as a subprocess (``PYTHONPATH`` = the repository), all with the config's
``train.seed`` (the same sampling keys: step n of every variant starts from the same SFT policy and
draws from the same streams; the variants' samples diverge as their policies do). Default variants:
plain GRPO and GRPO with DAPO's dynamic sampling (``rl.dynamic_sampling=true``). The table gives, per
variant, the training reward's mean over steps 1-25, 26-50, ... (metrics.jsonl's ``reward_mean``),
the held-out greedy accuracy at each evaluation, the groups dropped (dynamic sampling) and refilled
from more rounds (``rl.resample_rounds``) and the wall time. A benchmark: the tests do not run it.
"""
from __future__ import annotations

import argparse
import json
import pathlib

from bench.common import table, write_json
from bench.pref_job import train

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_VARIANTS = ["grpo=", "dynamic_sampling=rl.dynamic_sampling=true"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", required=True, help="the SFT run (configs/rl/addition_sft.yaml's)")
    parser.add_argument("--config", default="configs/rl/addition.yaml")
    parser.add_argument("--runs", default="runs/rl_variants")
    parser.add_argument("--out", default=str(ROOT / "bench/rl_variants.json"))
    parser.add_argument("--variant", action="append", help="NAME=OVERRIDE[,OVERRIDE...] (repeatable)")
    parser.add_argument("--window", type=int, default=25, help="steps per reward-mean column")
    args = parser.parse_args(argv)
    results = {}
    for variant in args.variant or DEFAULT_VARIANTS:
        name, _, overrides = variant.partition("=")
        overrides = [o for o in overrides.split(",") if o]
        run_dir = pathlib.Path(args.runs) / name
        seconds = train(args.config, run_dir, [f"init_from={args.sft}", "train.log_every=1", *overrides])
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if r.get("kind") != "eval"]
        results[name] = {"overrides": overrides, "seconds": seconds,
                         "reward_mean": [r["reward_mean"] for r in steps],
                         "groups_dropped": [r.get("groups_dropped") for r in steps],
                         "groups_resampled": [r.get("groups_resampled") for r in steps],
                         "heldout": {r["step"]: r["heldout_pass"] for r in records if r.get("kind") == "eval"}}
    length = max(len(r["reward_mean"]) for r in results.values())
    windows = [(start, min(start + args.window, length)) for start in range(0, length, args.window)]
    rows = []
    for name, result in results.items():
        curve = result["reward_mean"]
        means = [sum(curve[a:b]) / max(len(curve[a:b]), 1) for a, b in windows]
        dropped, resampled = ([v for v in result[key] if v is not None]
                              for key in ("groups_dropped", "groups_resampled"))
        rows.append([name, *(f"{m:.3f}" for m in means),
                     " ".join(f"{v:.3f}" for v in result["heldout"].values()),
                     f"{sum(dropped)}" if dropped else "-", f"{sum(resampled)}" if resampled else "-",
                     f"{result['seconds']:.0f}"])
    print(table(["variant", *(f"reward {a + 1}-{b}" for a, b in windows), "held-out greedy (each eval)",
                 "groups dropped", "groups resampled", "wall s"], rows))
    write_json(args.out, {"config": args.config, "sft": args.sft, "variants": results})


if __name__ == "__main__":
    main()
