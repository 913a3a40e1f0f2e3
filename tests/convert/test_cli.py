"""``python -m k3jax.convert`` end to end in subprocesses: import, then the evaluator, the trainer's
``init_from`` and export read the run as they are; bad input is one line and status 1."""
import json
import subprocess
import sys

import pytest

from tests.convert.hf_fixtures import hf_tensors, write_checkpoint, write_tokenizer
from tests.convert.test_bad_input import small_config
from tests.helpers import ROOT

pytestmark = pytest.mark.slow


def run(*args, timeout=900):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    hf_dir = write_checkpoint(root / "hf", small_config(), hf_tensors(small_config(), seed=4))
    write_tokenizer(hf_dir)
    notes = root / "notes.txt"
    notes.write_text("the heat of the day, the thin thread. " * 200)
    result = run("-m", "k3jax.convert", "import", str(hf_dir), str(root / "run"), f"data.path={notes}",
                 "data.seq_len=16", "train.batch_size=2")
    assert result.returncode == 0, result.stderr
    return root, hf_dir, notes


def test_eval_reads_an_imported_run(imported):
    root, _, notes = imported
    result = run("-m", "eval", str(root / "run"), "--tasks", "perplexity,samples", "--seeds", "1", "--text", str(notes),
                 "--no-progress", "--out", str(root / "eval"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (root / "eval").is_dir() and any((root / "eval").iterdir())


def test_init_from_an_imported_run(imported):
    root, _, _ = imported
    result = run("-m", "train", str(root / "run" / "config.yaml"), f"run_dir={root / 'finetune'}",
                 f"init_from={root / 'run'}", "train.steps=2", "train.eval_batches=0", "logging.progress=false",
                 "train.compilation_cache=null")
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((root / "finetune" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2
    result = run("-m", "k3jax.convert", "export", str(root / "finetune"), str(root / "finetuned_hf"))   # a trainer checkpoint
    assert result.returncode == 0, result.stderr
    exported = json.loads((root / "finetuned_hf" / "model.safetensors.index.json").read_text())["weight_map"]
    source = json.loads((root / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(exported) == set(source)


def test_export_command_and_bad_input(imported, tmp_path):
    root, hf_dir, _ = imported
    result = run("-m", "k3jax.convert", "export", str(root / "run"), str(tmp_path / "hf_out"))
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "hf_out" / "config.json").read_text()) == small_config()
    for args, words in [(["import", str(tmp_path / "nowhere"), str(tmp_path / "x")], "no such directory"),
                        (["import", str(hf_dir), str(root / "run")], "already exists"),
                        (["export", str(hf_dir), str(tmp_path / "y")], "not a readable k3jax run")]:
        result = run("-m", "k3jax.convert", *args)
        assert result.returncode == 1
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("k3jax-convert: error:") and words in lines[0], result.stderr
