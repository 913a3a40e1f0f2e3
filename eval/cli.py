"""``python -m eval RUN_OR_CHECKPOINT_DIR``: evaluate a trainer checkpoint and write a report.

    python -m eval runs/tiny                                     # latest checkpoint, every task, 3 seeds
    python -m eval runs/tiny --step 600 --tasks mqar,decode_cost --seeds 5 --out /tmp/tiny-eval
    python -m eval runs/tiny/checkpoints/600 --tasks perplexity --text notes.txt

The model is rebuilt from the config saved in the checkpoint and restored onto this process's
devices. Tasks (see `eval.tasks`): perplexity, mqar, passkey, decode_cost, samples, sessions. Each runs
once per seed (0 … N-1) and reports mean ± 95% Student-t interval, its frozen definition's
content hash and its cost. Writes ``report.json``, ``report.md`` and PNG plots into ``--out``
(default ``<run>/eval``). Bad input (a missing or corrupted checkpoint, an unknown task, a bad
argument) ends with one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

from tqdm import tqdm

from k3jax.checkpoint import quiet_checkpoint_io
from k3jax.data import DataError
from k3jax.disk import disk_full, free_space
from k3jax.host import keep_freed_memory
from k3jax.inference import InputError, LoadedRun
from k3jax.model import param_counts
from k3jax.training import read_metrics
from .flags import OneLineParser, add_placement_flags, is_reporter, load_model
from .report import build_report, markdown_table, write_report
from .tasks import TASKS, EvalContext, run_task
from .tasks.perplexity import open_text_dataset

TASK_NAMES = tuple(TASKS)   # in the order they run


def _int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value
    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m eval", description="Evaluate a K3-family checkpoint.")
    parser.add_argument("run", metavar="RUN_OR_CHECKPOINT_DIR", help="a run directory, its checkpoints/, or a step directory")
    parser.add_argument("--step", type=_int_at_least(0), default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--tasks", default=",".join(TASK_NAMES), help=f"comma-separated, from {', '.join(TASK_NAMES)}")
    parser.add_argument("--seeds", type=_int_at_least(1), default=3, help="runs per task (seeds 0 … N-1; default 3)")
    parser.add_argument("--out", default=None, help="output directory (default: <run>/eval)")
    parser.add_argument("--text", default=None, help="held-out text file or directory for perplexity / bits per byte")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_placement_flags(parser)
    return parser.parse_args(argv)


def parse_tasks(text: str) -> list[str]:
    """Task names from a comma-separated list, in the order they run."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in TASK_NAMES]
    if unknown or not names:
        raise InputError(f"unknown task {unknown[0]!r}; choose from {', '.join(TASK_NAMES)}" if unknown
                             else f"no task given; choose from {', '.join(TASK_NAMES)}")
    return [name for name in TASK_NAMES if name in names]


def prepare_out_dir(path: pathlib.Path) -> pathlib.Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InputError(f"cannot create output directory {path}: {error.strerror or error}") from None
    return path


def open_text(path: str, config):
    """The ``--text`` evaluation set, or a one-line `InputError`."""
    try:
        return open_text_dataset(path, config)
    except DataError as error:
        raise InputError(f"--text: {error}") from None


def training_record(run_dir: pathlib.Path) -> tuple[dict, list[dict]]:
    """``(report's training section, metrics.jsonl records)`` of the run (empty when absent)."""
    records = read_metrics(run_dir)
    summary_path = run_dir / "summary.json"
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.exists() else None
    except (OSError, ValueError):
        summary = None
    losses = [r["loss"] for r in records if isinstance(r.get("loss"), (int, float))]
    return {"summary": summary, "logged_steps": len(losses), "last_loss": losses[-1] if losses else None}, records


def evaluate(run: LoadedRun, tasks: list, seeds: int, *, text=None, show_progress: bool = True) -> tuple[dict, list]:
    """Run ``tasks`` (task definitions, `eval.tasks`) on ``run``'s model with seeds 0 … seeds-1 ->
    (the report, the run's training records for its plots)."""
    context = EvalContext(run.model, run.config, tuple(range(seeds)), text)
    results = []
    for task in tasks:
        with tqdm(desc=task.name, unit="step", file=sys.stderr, disable=not show_progress, dynamic_ncols=True) as bar:
            results.append(run_task(task, context, bar))
    training, records = training_record(run.run_dir)
    return build_report(run, param_counts(run.config.model), context.seeds, results, training), records


def write_outputs(report: dict, records: list, step: int, out_dir: pathlib.Path) -> None:
    """The plots, report.json and report.md into ``out_dir`` (each file whole or not at all); a
    failed write is a one-line `InputError` (a full disk named as one)."""
    from .plots import write_plots   # matplotlib loads only when there is something to draw

    try:
        report["plots"] = write_plots(report["tasks"], records, step, out_dir)
        write_report(report, out_dir)
    except OSError as error:
        reason = f"no space left on device ({free_space(out_dir)} free)" if disk_full(error) else error.strerror or error
        raise InputError(f"cannot write the report into {out_dir}: {reason}; the results are above") from None


def results_text(report: dict, config) -> str:
    """Each task's results table (mean ± 95% interval per column), as printed at the end."""
    lines = []
    for name, task in report["tasks"].items():
        if task["skipped"]:
            lines.append(f"{name}: skipped ({task['skipped']})")
            continue
        lines.append(f"{name} ({task['cost']['wall_seconds']:.1f} s):")
        lines += markdown_table(task["results"])
        if name == "passkey" and config.data.kind == "mqar":
            lines.append("(this model was trained on MQAR token ids, not text: passkey accuracy near 0 is expected)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()  # before JAX starts its threads
    quiet_checkpoint_io()
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        task_names = parse_tasks(args.tasks)
        run = load_model(args)
        text = open_text(args.text, run.config) if args.text else None
        out_dir = prepare_out_dir(pathlib.Path(args.out) if args.out else run.run_dir / "eval")
    except InputError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    tasks = [TASKS[name]() for name in task_names]
    report, records = evaluate(run, tasks, args.seeds, text=text, show_progress=not args.no_progress and is_reporter())
    if not is_reporter():   # the other processes of a multi-process mesh ran the same tasks
        return 0
    print(results_text(report, run.config), flush=True)      # before any write: a failed one loses no result
    try:
        write_outputs(report, records, run.step, out_dir)
    except InputError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    print(f"wrote {out_dir / 'report.json'}, {out_dir / 'report.md'} and {len(report['plots'])} plots")
    return 0
