"""The README's main job, this source tree against an earlier commit, side by side.

    python -m bench.main_job [--baseline REF] [--trials 2] [--steps N] [--out bench/main_job.json]

Runs ``python -m train configs/tiny.yaml`` as the README gives it (1600 steps, its own logging,
evaluation and checkpoints; ``--steps N`` shortens it) from a checkout of ``--baseline`` (a git
worktree in a temporary directory, removed afterwards) and from this tree, alternating (baseline,
this tree, baseline, ...) so that the slow spells of a shared machine fall on both alike. Per run:
the median of its logged tokens/s after the first two records (the first steps compile), its
training wall time (compilation included, as the job's own summary reports it) and its held-out
MQAR recall. The table gives each tree's median over its trials and this tree's ratio to the
baseline.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import subprocess
import tempfile

from bench.common import table, write_json
from bench.cpu_cores import trial

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="HEAD~1", help="git commit to compare against")
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="shorten the job to N steps")
    parser.add_argument("--out", default="bench/main_job.json")
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="k3jax-baseline-") as scratch:
        baseline = pathlib.Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(baseline), commit], cwd=ROOT, check=True)
        try:
            trees = {f"baseline {commit}": baseline, "this tree": ROOT}
            results = {name: [] for name in trees}
            loads = [os.getloadavg()[0]]
            for index in range(args.trials):
                for name, tree in trees.items():
                    results[name].append(trial([], args.steps, 2, args.config, tree))
                    loads.append(os.getloadavg()[0])
                    print(f"trial {index + 1} {name}: {results[name][-1]}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=ROOT, check=False)
    median = lambda name, key: statistics.median(t[key] for t in results[name])  # noqa: E731
    base, this = trees
    print(f"{args.config}, {args.steps or 'all its'} steps, {args.trials} trials per tree, {os.cpu_count()} CPUs, "
          f"load average {min(loads):.1f}-{max(loads):.1f}")
    print(table(["tree", "tokens/s (median)", "training s (median)", "held-out recall", "tokens/s vs baseline"],
                [[name, f"{median(name, 'tokens_per_second'):,.0f}", f"{median(name, 'train_seconds'):.0f}",
                  " / ".join(f"{t['heldout_mqar_recall']:.3f}" for t in results[name]),
                  f"{median(name, 'tokens_per_second') / median(base, 'tokens_per_second'):.2f}x"]
                 for name in trees]))
    write_json(args.out, {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "baseline": commit, "config": args.config, "steps": args.steps,
                          "load_average": [min(loads), max(loads)], "trials": results,
                          "tokens_per_second_ratio": median(this, "tokens_per_second") / median(base, "tokens_per_second")})


if __name__ == "__main__":
    main()
