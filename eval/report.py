"""The evaluation report: ``report.json`` (everything, machine-readable) and ``report.md`` (tables).

report.json
    format              "k3jax-eval/1"
    checkpoint          path, run_dir, step, parameters {total, active}, data (the dataset the run
                        trained on, from the checkpoint), config (the run's resolved config)
    environment         jax / flax versions, backend, devices, python
    method              seeds, confidence level, how intervals are computed
    training            summary (the run's summary.json, if any), logged_steps, last logged loss
    tasks.<name>        definition (the frozen fields), content_hash, data_hash, results (rows;
                        each measured value {mean, ci_half_width, ci_low, ci_high, confidence, n,
                        values}), examples, cost {wall_seconds, tokens, estimated_flops}, skipped
    plots               {name: PNG file name}
"""
from __future__ import annotations

import json
import math
import pathlib
import platform
from typing import Any

import flax
import jax

from k3jax.disk import write_atomically
from .stats import CONFIDENCE, Estimate
from .tasks.common import TaskResult

FORMAT = "k3jax-eval/1"


def jsonable(value: Any) -> Any:
    """Plain JSON values: `Estimate`s as dicts, numpy scalars as numbers, non-finite floats as None."""
    if isinstance(value, Estimate):
        return jsonable(value.to_json())
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def task_json(result: TaskResult) -> dict:
    output = result.output
    return {
        "definition": result.definition,
        "content_hash": result.content_hash,
        "data_hash": output.data_hash if output else None,
        "results": output.rows if output else [],
        "examples": output.examples if output else [],
        "cost": result.cost.to_json(),
        "skipped": result.skipped,
    }


def environment() -> dict:
    return {"jax": jax.__version__, "flax": flax.__version__, "backend": jax.default_backend(),
            "devices": [str(device) for device in jax.devices()], "python": platform.python_version()}


def build_report(run, parameters: tuple[int, int], seeds, results: list[TaskResult], training: dict) -> dict:
    """The report as plain JSON values (``run``: an `k3jax.inference.LoadedRun`); ``plots`` is left
    empty for whoever draws them."""
    total, active = parameters
    return jsonable({
        "format": FORMAT,
        "checkpoint": {"path": str(run.checkpoints / str(run.step)), "run_dir": str(run.run_dir), "step": run.step,
                       "parameters": {"total": total, "active": active}, "data": run.meta.get("data"),
                       "config": run.meta.get("config")},
        "environment": environment(),
        "method": {"seeds": list(seeds), "confidence": CONFIDENCE,
                   "interval": "mean over seeds ± half width of the Student-t interval (ddof 1); none for one seed"},
        "training": training,
        "tasks": {result.name: task_json(result) for result in results},
        "plots": {},
    })


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


def format_cell(value: Any) -> str:
    """One table cell: ``mean ± half width`` for measured values, compact numbers otherwise."""
    if isinstance(value, dict) and "mean" in value:
        mean, half = value["mean"], value["ci_half_width"]
        if mean is None:
            return "n/a"
        return format_number(mean) if half is None else f"{format_number(mean)} ± {format_number(half)}"
    if isinstance(value, float):
        return format_number(value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    return "" if value is None else str(value).replace("|", "\\|").replace("\n", "\\n")


def format_number(value: float) -> str:
    """Three decimals below 100, one up to 1e5, scientific beyond (and for tiny non-zero values)."""
    if value != 0 and not 1e-3 <= abs(value) < 1e5:
        return f"{value:.3e}"
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3f}"


def markdown_table(rows: list[dict]) -> list[str]:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(format_cell(row.get(column)) for column in columns) + " |" for row in rows]
    return lines


def cost_line(cost: dict) -> str:
    return (f"cost: {cost['wall_seconds']:.1f} s wall, {cost['tokens']:,} tokens, "
            f"~{cost['estimated_flops']:.3g} FLOPs (estimated)")


def task_markdown(name: str, task: dict) -> list[str]:
    lines = [f"## {name}", ""]
    if task["skipped"]:
        return lines + [f"Skipped: {task['skipped']}", ""]
    definition = ", ".join(f"{key}={value}" for key, value in task["definition"].items())
    lines += [f"Definition: `{definition}`  ", f"Content hash: `{task['content_hash']}`  ", cost_line(task["cost"]), ""]
    lines += markdown_table(task["results"]) + [""]
    for example in task["examples"]:
        expected = "" if example.get("expected_next") is None else f" (expected next: {example['expected_next']})"
        lines += [f"- seed {example['seed']}{expected}: `{format_cell(example['prompt'])}` → "
                  f"`{format_cell(example['continuation'])}`"]
    return lines + ([""] if task["examples"] else [])


def training_markdown(training: dict) -> list[str]:
    summary = training.get("summary") or {}
    facts = [f"{key} {format_cell(value)}" for key, value in summary.items() if isinstance(value, (int, float))]
    lines = ["## training", ""]
    lines.append(f"{training.get('logged_steps', 0)} logged steps; last logged loss "
                 f"{format_cell(training.get('last_loss'))}.  ")
    if facts:
        lines.append("summary.json: " + ", ".join(facts) + ".")
    return lines + [""]


def render_markdown(report: dict) -> str:
    checkpoint, method, env = report["checkpoint"], report["method"], report["environment"]
    lines = [
        f"# Evaluation of `{checkpoint['run_dir']}` at step {checkpoint['step']}", "",
        f"Checkpoint `{checkpoint['path']}`; {checkpoint['parameters']['total']:,} parameters "
        f"({checkpoint['parameters']['active']:,} active).  ",
        f"Seeds {method['seeds']}; each measured value is the mean over seeds ± the half width of its "
        f"{method['confidence']:.0%} Student-t interval.  ",
        f"jax {env['jax']} on {env['backend']} ({', '.join(env['devices'])}).", "",
    ]
    lines += training_markdown(report["training"])
    for name, task in report["tasks"].items():
        lines += task_markdown(name, task)
    if report["plots"]:
        lines += ["## plots", ""] + [f"![{name}]({file})" for name, file in report["plots"].items()] + [""]
    return "\n".join(lines)


def write_report(report: dict, out_dir: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """report.json and report.md in ``out_dir``, each written whole or not at all."""
    json_path, md_path = out_dir / "report.json", out_dir / "report.md"
    write_atomically(json_path, json.dumps(report, indent=2) + "\n")
    write_atomically(md_path, render_markdown(report))
    return json_path, md_path
