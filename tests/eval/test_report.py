"""A full evaluation with small task definitions writes report.json, report.md and the plots."""
import json

import jax
import numpy as np
import pytest

from k3jax.memory import init_memory
from eval.cli import evaluate, open_text
from k3jax.inference import load_run
from eval.tasks import PerplexityTask
from eval.tasks.decode_cost import all_mla_config


def bank_bytes(config, context):
    return sum(leaf.nbytes for leaf in jax.tree.leaves(init_memory(config, 1, context)))


def test_files_are_written(small_report):
    data, out = small_report
    assert json.loads((out / "report.json").read_text()) == data
    for name in ("training_loss", "accuracy_vs_length", "decode_cost"):
        assert data["plots"][name] == f"{name}.png"
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (out / "report.md").read_text()
    for name, task in data["tasks"].items():
        assert f"## {name}" in markdown and task["content_hash"] in markdown


def test_every_task_reports_hash_cost_and_seeded_intervals(small_report):
    data, _ = small_report
    assert data["method"]["seeds"] == [0, 1] and data["checkpoint"]["step"] == 200
    assert set(data["tasks"]) == {"perplexity", "mqar", "passkey", "decode_cost", "samples"}
    for name, task in data["tasks"].items():
        assert task["skipped"] is None, name
        assert len(task["content_hash"]) == 64
        assert task["cost"]["wall_seconds"] > 0 and task["cost"]["tokens"] > 0 and task["cost"]["estimated_flops"] > 0
        measured = [value for row in task["results"] for value in row.values() if isinstance(value, dict)]
        assert measured and all(value["n"] == 2 and len(value["values"]) == 2 for value in measured), name
    assert len(data["tasks"]["passkey"]["results"]) == 3                       # 2 depths + "all"
    assert len(data["tasks"]["samples"]["examples"]) == 2 * 2


def test_decode_cost_memory_comes_from_the_two_banks(small_report, trained_run):
    data, _ = small_report
    config = trained_run.config.model
    for row in data["tasks"]["decode_cost"]["results"]:
        assert row["k3_bank_bytes"] == bank_bytes(config, row["context"])
        assert row["all_mla_bank_bytes"] == bank_bytes(all_mla_config(config), row["context"])
        assert row["memory_ratio"] == pytest.approx(row["k3_bank_bytes"] / row["all_mla_bank_bytes"])
        assert row["k3_latency_ms"]["mean"] > 0 and row["all_mla_latency_ms"]["mean"] > 0
    assert all_mla_config(config).mla_layer_indices == (0, 1)


def test_bits_per_byte_on_a_text_file(trained_run, tmp_path):
    text = tmp_path / "heldout.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    run = load_run(str(trained_run.path))
    data, _ = evaluate(run, [PerplexityTask(batches_per_seed=1, batch_size=32)], 2,
                       text=open_text(str(text), run.config), show_progress=False)
    row = data["tasks"]["perplexity"]["results"][0]
    assert row["data"] == str(text)
    # byte tokens: one byte per scored token except the document's EOS, so bits/byte >= bits/token
    assert row["bits_per_byte"]["mean"] >= row["bits_per_token"]["mean"] > 0
    assert np.isfinite(row["perplexity"]["mean"])
