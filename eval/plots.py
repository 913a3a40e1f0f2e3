"""PNG figures of a report (matplotlib, Agg backend): the run's training loss, accuracy vs length,
decode latency and memory vs context. Each figure is drawn only when its data is there.

Error bars are the reported confidence intervals.
"""
from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from k3jax.disk import write_atomically  # noqa: E402


def _means_and_errors(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """Means of ``row[key]`` and their interval half widths (0 where there is none)."""
    means = [row[key]["mean"] for row in rows]
    return means, [row[key]["ci_half_width"] or 0.0 for row in rows]


def _save(figure, path: pathlib.Path) -> None:
    """The figure as a PNG at ``path``, written whole or not at all."""
    figure.tight_layout()
    try:
        write_atomically(path, lambda file: figure.savefig(file, format="png", dpi=120))
    finally:
        plt.close(figure)


def plot_training_loss(records: list[dict], evaluated_step: int, path: pathlib.Path) -> bool:
    """Training loss vs step from the run's metrics.jsonl records, the evaluated step marked."""
    points = [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]
    if not points:
        return False
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(*zip(*points), lw=1.2)
    axis.axvline(evaluated_step, color="k", ls="--", lw=1, label=f"evaluated checkpoint (step {evaluated_step})")
    axis.legend()
    axis.set(xlabel="step", ylabel="training loss (nats)", title="training loss")
    axis.grid(alpha=0.3)
    _save(figure, path)
    return True


def plot_accuracy_vs_length(tasks: dict, path: pathlib.Path) -> bool:
    """MQAR recall vs sequence length and passkey accuracy (all depths) vs context length."""
    panels = []
    mqar, passkey = tasks.get("mqar"), tasks.get("passkey")
    if mqar and mqar["results"]:
        panels.append(("MQAR recall (held-out)", "sequence length (tokens)", mqar["results"], "seq_len", "recall"))
    if passkey and passkey["results"]:
        rows = [row for row in passkey["results"] if row["depth"] == "all"]
        panels.append(("passkey retrieval (all depths)", "context length (tokens)", rows, "context_length", "accuracy"))
    if not panels:
        return False
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for axis, (title, xlabel, rows, x_key, y_key) in zip(axes[0], panels):
        means, errors = _means_and_errors(rows, y_key)
        axis.errorbar([row[x_key] for row in rows], means, yerr=errors, marker="o", capsize=4)
        if "chance" in rows[0]:
            axis.plot([row[x_key] for row in rows], [row["chance"] for row in rows], "k--", lw=1, label="chance")
            axis.legend()
        axis.set_xscale("log", base=2)
        axis.set(xlabel=xlabel, ylabel="accuracy", title=title, ylim=(-0.02, 1.02))
        axis.grid(alpha=0.3)
    _save(figure, path)
    return True


def plot_decode_cost(task: dict | None, path: pathlib.Path) -> bool:
    """Per-token decode latency and memory-bank size vs context, this model vs all-MLA."""
    if not task or not task["results"]:
        return False
    rows = task["results"]
    contexts = [row["context"] for row in rows]
    figure, (latency_axis, memory_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for model, label in (("k3", "this model"), ("all_mla", "all-MLA, same width")):
        means, errors = _means_and_errors(rows, f"{model}_latency_ms")
        latency_axis.errorbar(contexts, means, yerr=errors, marker="o", capsize=4, label=label)
        memory_axis.plot(contexts, [row[f"{model}_bank_bytes"] / 2**20 for row in rows], marker="o", label=label)
    latency_axis.set(xlabel="context (tokens)", ylabel="ms per decoded token", title="decode latency")
    memory_axis.set(xlabel="context (tokens)", ylabel="memory bank (MiB per sequence)", title="memory bank")
    memory_axis.set_yscale("log")
    for axis in (latency_axis, memory_axis):
        axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
        axis.legend()
    _save(figure, path)
    return True


def write_plots(tasks: dict, records: list[dict], evaluated_step: int, out_dir: pathlib.Path) -> dict[str, str]:
    """Draw every figure whose data exists; ``{name: file name}`` of those written."""
    figures = {
        "training_loss": lambda path: plot_training_loss(records, evaluated_step, path),
        "accuracy_vs_length": lambda path: plot_accuracy_vs_length(tasks, path),
        "decode_cost": lambda path: plot_decode_cost(tasks.get("decode_cost"), path),
    }
    return {name: f"{name}.png" for name, draw in figures.items() if draw(out_dir / f"{name}.png")}
