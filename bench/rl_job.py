"""The README's RL job, run for several seeds: SFT, then GRPO; held-out greedy accuracy before and after.

    python -m bench.rl_job [--seeds 3] [--sft configs/rl/addition_sft.yaml] [--grpo configs/rl/addition.yaml]
                           [--runs DIR] [--out bench/rl_job.json] [OVERRIDE ...]

Per seed s, as subprocesses of this tree (``PYTHONPATH`` = the repository):

    python -m train SFT  run_dir=RUNS/sft-s  train.seed=s
    python -m train GRPO run_dir=RUNS/grpo-s train.seed=s init_from=RUNS/sft-s

"before" is the GRPO run's held-out evaluation at step 0 (`RLTrainer.evaluate` of the SFT
parameters: greedy completions of the first ``rl.eval_prompts`` held-out prompts, rewarded; the
config sets ``train.eval_every``), "after" its summary (the final evaluation); each run's largest
``logprob_mismatch`` (recorded vs recomputed log-probs) is reported too, with its largest
``forward_gap`` (the training forward vs the replayed decode, ``rl.update_logprobs=decode``) and the
replay's seconds. Wall times are the whole
commands' (process start, compilation and checkpoints included); ``train_seconds`` the runs' own.
The summary line is the mean over seeds +- the half-width of a two-sided 95% t interval (Student t
quantiles below; n seeds give n - 1 degrees of freedom). The held-out prompts are checked to be
absent from the SFT text first. OVERRIDEs (``key=value``) go to both commands. Runs go under a
temporary directory unless ``--runs`` is given. A benchmark: the tests do not run it.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import table, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Two-sided 95% Student t quantiles t_{0.975, df}, df = 1..30 (beyond: the normal's 1.96).
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def mean_ci(values) -> tuple[float, float]:
    """(mean, half-width of the two-sided 95% t interval); half-width nan for one value."""
    values = list(values)
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan")
    df = len(values) - 1
    quantile = T975[df - 1] if df <= len(T975) else 1.96
    return mean, quantile * statistics.stdev(values) / len(values) ** 0.5


def environment() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run(command: list[str], log: pathlib.Path) -> float:
    """Run ``command`` in the repository, its output into ``log`` -> wall seconds; raise on failure."""
    started = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(command, cwd=ROOT, env=environment(), stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - started
    if code:
        raise SystemExit(f"{' '.join(command)} failed ({code}); see {log}:\n{log.read_text()[-2000:]}")
    return seconds


def check_heldout_unseen(sft_config: str, grpo_config: str, overrides: list[str]) -> int:
    """Raise unless no held-out prompt of the GRPO data occurs in the SFT text -> held-out prompts."""
    from k3jax.config import load_config
    from k3jax.data.prompts import PromptDataset
    from k3jax.data.sources import find_data_files, read_documents

    sft = load_config(sft_config, overrides)
    grpo = load_config(grpo_config, [*overrides, "init_from=unused"])   # only its data settings are read
    prompts = PromptDataset(grpo.data.path, grpo.data.seq_len, heldout_fraction=grpo.data.heldout_fraction)
    documents = [text for file in find_data_files(sft.data.path) for text in read_documents(file, sft.data.jsonl_field)]
    heldout = [p.text for p in prompts.splits["heldout"]]
    starts = {text[:n] for text in documents for n in {len(prompt) for prompt in heldout}}
    leaked = [prompt for prompt in heldout if prompt in starts]
    if leaked:
        raise SystemExit(f"{len(leaked)} held-out prompts begin SFT documents, e.g. {leaked[0]!r}")
    return len(heldout)


def seed_row(seed: int, sft_dir: pathlib.Path, grpo_dir: pathlib.Path, sft_seconds: float,
             grpo_seconds: float) -> dict:
    """One seed's row from its runs' summary.json and the GRPO run's metrics.jsonl (which must
    hold a step-0 evaluation)."""
    sft_summary = json.loads((sft_dir / "summary.json").read_text())
    grpo_summary = json.loads((grpo_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (grpo_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [[r["step"], r["heldout_reward"]] for r in records if r.get("kind") == "eval"]
    if not curve or curve[0][0] != 0:
        raise SystemExit(f"{grpo_dir}: no step-0 evaluation in metrics.jsonl (set train.eval_every)")
    steps = [r for r in records if r.get("kind") != "eval"]
    return {"seed": seed, "before": curve[0][1], "after": grpo_summary["heldout_reward"],
            "logprob_mismatch_max": max(r["logprob_mismatch"] for r in steps),
            "forward_gap_max": max((r["forward_gap"] for r in steps if "forward_gap" in r), default=None),
            "heldout_prompts": grpo_summary["heldout_prompts"],
            "sft_seconds": sft_seconds, "sft_train_seconds": sft_summary["train_seconds"],
            "sft_heldout_loss": sft_summary.get("heldout_loss"),
            "grpo_seconds": grpo_seconds, "grpo_train_seconds": grpo_summary["train_seconds"],
            "grpo_steps": grpo_summary["step"], "heldout_curve": curve,
            "train_reward_first": steps[0]["reward_mean"] if steps else None,
            "train_reward_last": steps[-1]["reward_mean"] if steps else None,
            "rollout_seconds": sum(r["rollout_seconds"] for r in steps),
            "update_seconds": sum(r["update_seconds"] for r in steps),
            "replay_seconds": sum(r.get("replay_seconds", 0.0) for r in steps)}


def run_seed(seed: int, args: argparse.Namespace, runs: pathlib.Path) -> dict:
    """SFT, then GRPO from it, for ``seed`` under ``runs`` -> the seed's `seed_row`."""
    sft_dir, grpo_dir = runs / f"sft-{seed}", runs / f"grpo-{seed}"
    sft_seconds = run([sys.executable, "-m", "train", args.sft, f"run_dir={sft_dir}", f"train.seed={seed}",
                       *args.overrides], runs / f"sft-{seed}.log")
    grpo_seconds = run([sys.executable, "-m", "train", args.grpo, f"run_dir={grpo_dir}", f"train.seed={seed}",
                        f"init_from={sft_dir}", *args.overrides], runs / f"grpo-{seed}.log")
    return seed_row(seed, sft_dir, grpo_dir, sft_seconds, grpo_seconds)


def report(args: argparse.Namespace, rows: list[dict], loads: list[float], heldout: int) -> None:
    """Print the seeds' table with the mean ± 95% CI over seeds and the gain; write ``args.out``."""
    summary = {key: mean_ci(row[key] for row in rows) for key in ("before", "after", "sft_seconds", "grpo_seconds")}
    summary["gain"] = mean_ci(row["after"] - row["before"] for row in rows)
    fmt = lambda key, spec: f"{summary[key][0]:{spec}} ± {summary[key][1]:{spec}}"  # noqa: E731
    print(f"{args.sft} then {args.grpo}, {args.seeds} seeds, {os.cpu_count()} CPUs, "
          f"load average {min(loads):.1f}-{max(loads):.1f}")
    print(table(["seed", "before", "after", "SFT s", "GRPO s"],
                [[row["seed"], f"{row['before']:.3f}", f"{row['after']:.3f}", f"{row['sft_seconds']:.0f}",
                  f"{row['grpo_seconds']:.0f}"] for row in rows]
                + [["mean ± 95% CI", fmt("before", ".3f"), fmt("after", ".3f"), fmt("sft_seconds", ".0f"),
                    fmt("grpo_seconds", ".0f")]]))
    print(f"gain (after - before): {fmt('gain', '.3f')}")
    write_json(args.out, {"sft_config": args.sft, "grpo_config": args.grpo, "overrides": args.overrides,
                          "seeds": args.seeds, "heldout_prompts_checked_unseen": heldout,
                          "ci": "mean ± half-width of the two-sided 95% Student t interval over seeds",
                          "summary": {key: {"mean": m, "ci95": h} for key, (m, h) in summary.items()},
                          "runs": rows, "cpus": os.cpu_count(), "load_average": [min(loads), max(loads)],
                          "platform": platform.platform(), "python": platform.python_version()})
    print(f"wrote {args.out}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sft", default="configs/rl/addition_sft.yaml")
    parser.add_argument("--grpo", default="configs/rl/addition.yaml")
    parser.add_argument("--runs", default=None, help="run directories go here (default: a temporary directory)")
    parser.add_argument("--out", default="bench/rl_job.json")
    parser.add_argument("overrides", nargs="*", help="key=value settings for both commands")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    heldout = check_heldout_unseen(args.sft, args.grpo, args.overrides)
    print(f"{heldout} held-out prompts, none of them in the SFT text", flush=True)
    scratch = None if args.runs else tempfile.TemporaryDirectory(prefix="k3jax-rl-job-")
    runs = pathlib.Path(args.runs or scratch.name).resolve()
    runs.mkdir(parents=True, exist_ok=True)
    rows, loads = [], [os.getloadavg()[0]]
    try:
        for seed in range(args.seeds):
            rows.append(run_seed(seed, args, runs))
            loads.append(os.getloadavg()[0])
            row = rows[-1]
            print(f"seed {seed}: before {row['before']:.3f}  after {row['after']:.3f}  SFT {row['sft_seconds']:.0f} s  "
                  f"GRPO {row['grpo_seconds']:.0f} s  (held-out curve {row['heldout_curve']})", flush=True)
    finally:
        if scratch is not None:
            scratch.cleanup()
    report(args, rows, loads, heldout)


if __name__ == "__main__":
    main()
