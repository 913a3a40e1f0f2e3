"""What ``python -m eval`` prints at the end: every task's results table, and why passkey is near 0
on a model trained on MQAR ids."""
from types import SimpleNamespace

from eval.cli import results_text


def test_results_tables_are_printed_and_passkey_on_mqar_is_explained():
    task = {"skipped": None, "cost": {"wall_seconds": 2.5}, "results": [{"length": 64, "recall": 0.75}]}
    report = {"tasks": {"mqar": task, "passkey": dict(task), "perplexity": {"skipped": "no --text given"}}}
    text = results_text(report, SimpleNamespace(data=SimpleNamespace(kind="mqar"))).splitlines()
    assert text[0] == "mqar (2.5 s):" and text[1].startswith("| length | recall |") and "0.75" in text[3]
    assert "trained on MQAR token ids, not text" in text[-2]
    assert text[-1] == "perplexity: skipped (no --text given)"
    text = results_text(report, SimpleNamespace(data=SimpleNamespace(kind="text")))
    assert "MQAR token ids" not in text
