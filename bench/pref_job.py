"""The README's preference job: DPO (or another ``train.objective``) from the addition SFT model;
held-out preference accuracy, margin and greedy task accuracy before and after.

    python -m bench.pref_job --sft runs/addition_sft [--config configs/pref/addition_dpo.yaml]
                             [--runs DIR] [--out bench/pref_job.json] [OVERRIDE ...]

Runs ``python -m train CONFIG init_from=SFT run_dir=RUNS/pref OVERRIDE...`` as a subprocess
(``PYTHONPATH`` = the repository; without ``--sft`` it first trains ``configs/rl/addition_sft.yaml``
into ``RUNS/sft``). "before" / "after" of the preference scores are the run's held-out evaluations
at step 0 and at the end (metrics.jsonl): ``heldout_accuracy`` (implicit reward of the chosen
reply above the rejected one's; 0 at step 0, where every DPO reward is 0), ``heldout_margin``,
``heldout_logprob_accuracy`` (the policy's own sequence log-prob of the chosen reply above the
rejected one's). The greedy task accuracy is `RLTrainer.evaluate` of ``configs/rl/addition.yaml``
(greedy completions of its 256 held-out problems, the same problems as the pairs' held-out split,
rewarded by exact match) with ``init_from`` the SFT run and then the preference run. A benchmark:
the tests do not run it.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

from bench.common import table, write_json
from bench.rl_job import environment

ROOT = pathlib.Path(__file__).resolve().parents[1]


def train(config: str, run_dir: pathlib.Path, overrides: list[str]) -> float:
    """Run ``python -m train``; its wall seconds."""
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "train", config, f"run_dir={run_dir}", *overrides], cwd=ROOT,
                            env=environment(), capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{config} failed:\n{result.stderr[-3000:]}")
    return time.perf_counter() - started


def greedy_accuracy(run: pathlib.Path, scratch: pathlib.Path) -> float:
    """Held-out greedy exact-match accuracy of ``run`` on the RL job's 256 held-out problems."""
    from k3jax.config import load_config
    from k3jax.training import RLTrainer

    config = load_config(ROOT / "configs/rl/addition.yaml", [f"init_from={run}", f"run_dir={scratch}",
                                                              "logging.progress=false"])
    trainer = RLTrainer(config)
    try:
        return trainer.evaluate()["heldout_pass"]
    finally:
        trainer.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", help="the SFT run (default: train configs/rl/addition_sft.yaml first)")
    parser.add_argument("--config", default="configs/pref/addition_dpo.yaml")
    parser.add_argument("--runs")
    parser.add_argument("--out", default=str(ROOT / "bench/pref_job.json"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    runs = pathlib.Path(args.runs or tempfile.mkdtemp(prefix="pref-job-"))
    sft = pathlib.Path(args.sft) if args.sft else runs / "sft"
    sft_seconds = None if args.sft else train("configs/rl/addition_sft.yaml", sft, [])
    seconds = train(args.config, runs / "pref", [f"init_from={sft}", *args.overrides])
    evaluations = [json.loads(line) for line in (runs / "pref/metrics.jsonl").read_text().splitlines()]
    evaluations = [record for record in evaluations if record.get("kind") == "eval"]
    before, after = evaluations[0], evaluations[-1]
    greedy = {"before": greedy_accuracy(sft, runs / "greedy-sft"), "after": greedy_accuracy(runs / "pref", runs / "greedy-pref")}
    names = ("heldout_accuracy", "heldout_margin", "heldout_logprob_accuracy", "heldout_loss")
    rows = [[name, f"{before[name]:.4f}", f"{after[name]:.4f}"] for name in names]
    rows.append(["greedy task accuracy", f"{greedy['before']:.4f}", f"{greedy['after']:.4f}"])
    print(table([f"{args.config} {' '.join(args.overrides)}", f"step {before['step']}", f"step {after['step']}"], rows))
    print(f"preference run {seconds:.0f} s wall; curve: " + ", ".join(
        f"{r['step']}: acc {r['heldout_accuracy']:.3f} margin {r['heldout_margin']:.3f}" for r in evaluations))
    write_json(args.out, {"config": args.config, "overrides": args.overrides, "sft": str(sft),
                          "sft_seconds": sft_seconds, "seconds": seconds, "evaluations": evaluations,
                          "greedy_accuracy": greedy})


if __name__ == "__main__":
    main()
