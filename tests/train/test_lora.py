"""LoRA fine-tuning end to end (subprocesses): a micro model trained on text, then adapters on it.

The loss falls; every base parameter is bit-identical afterwards; the adapter checkpoints are a
fraction of the base's; a resumed run ends bit for bit where an unbroken one does; a different
base is refused in one line; export-with-merge then re-import gives the fine-tuned model's logits.
"""
import json
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.checkpoint import RunCheckpoints
from tests.helpers import MICRO, ROOT

pytestmark = pytest.mark.slow   # subprocesses

LORA = ("finetune.lora_rank=4", "finetune.lora_alpha=8", "finetune.lora_dropout=0.1", "finetune.lora_routed_experts=true",
        "optimizer.learning_rate=2e-2", "optimizer.warmup_steps=0", "optimizer.schedule_steps=8",
        "checkpoint.every=4")


def train(run_dir, cache, corpus, *overrides):
    command = [sys.executable, "-m", "train", MICRO, f"run_dir={run_dir}", f"train.compilation_cache={cache}",
               "data.kind=text", f"data.path={corpus}", "data.seq_len=32", "train.eval_batches=0", *overrides]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)


def losses(run_dir) -> list[float]:
    lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in sorted(map(json.loads, lines), key=lambda r: r["step"])]


def saved_state(run_dir):
    checkpoints = RunCheckpoints(pathlib.Path(run_dir) / "checkpoints", read_only=True)
    try:
        return checkpoints.read_state(checkpoints.latest_step())
    finally:
        checkpoints.close()


def directory_bytes(path) -> int:
    return sum(p.stat().st_size for p in pathlib.Path(path).rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    cache = root / "xla"
    corpus = root / "corpus.txt"
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat and then ran to see the dog who was happy".split()
    corpus.write_text("\n".join(" ".join(rng.choice(words, 10)) for _ in range(300)))
    result = train(root / "base", cache, corpus, "train.steps=2")
    assert result.returncode == 0, result.stderr[-2000:]
    result = train(root / "ft", cache, corpus, f"init_from={root / 'base'}", "train.steps=8", *LORA)
    assert result.returncode == 0, result.stderr[-2000:]
    return root, cache, corpus


def test_lora_lowers_the_loss_and_leaves_the_base_bit_identical(runs):
    from k3jax.inference import restore_model

    root, _, _ = runs
    curve = losses(root / "ft")
    assert len(curve) == 8 and curve[-1] < curve[0] - 0.1, curve
    base, tuned = restore_model(root / "base"), restore_model(root / "ft")
    base_params = nnx.to_flat_state(nnx.state(base.model, nnx.Param))
    tuned_params = dict(nnx.to_flat_state(nnx.state(tuned.model, nnx.Param)))
    assert len(base_params) == len(tuned_params)
    for path, variable in base_params:
        np.testing.assert_array_equal(np.asarray(tuned_params[path].get_value()), np.asarray(variable.get_value()),
                                      err_msg="/".join(map(str, path)))
    tokens = jnp.arange(40).reshape(2, 20) % 200
    assert float(jnp.max(jnp.abs(tuned.model(tokens).logits - base.model(tokens).logits))) > 1e-3   # adapters learned
    state = saved_state(root / "ft")
    assert all(key.endswith(("_lora/a", "_lora/b")) for key in state["params"])   # adapters only
    assert state["params"] and jax.tree.leaves(state["opt_state"])
    adapter_bytes, base_bytes = directory_bytes(root / "ft/checkpoints/8"), directory_bytes(root / "base/checkpoints/2")
    adapter_arrays, base_arrays = (sum(np.asarray(x).nbytes for x in jax.tree.leaves(state[key]))
                                   for state, key in ((state, "params"), (saved_state(root / "base"), "params")))
    print(f"adapter checkpoint {adapter_bytes} bytes on disk ({adapter_arrays} bytes of adapters), "
          f"full checkpoint {base_bytes} bytes ({base_arrays} bytes of parameters)")
    # At this micro scale a checkpoint's bytes on disk are mostly Orbax's fixed files (~1.2 MB either
    # way, and the adapter run's can be the larger), so only the stored arrays are compared.
    assert adapter_arrays * 4 < base_arrays


def test_lora_resume_is_exact_and_a_different_base_is_refused(runs):
    root, cache, corpus = runs
    result = train(root / "resumed", cache, corpus, f"init_from={root / 'base'}", "train.steps=4", *LORA)
    assert result.returncode == 0, result.stderr[-2000:]
    result = train(root / "resumed", cache, corpus, f"init_from={root / 'base'}", "train.steps=8", *LORA)
    assert result.returncode == 0, result.stderr[-2000:]
    whole, resumed = saved_state(root / "ft"), saved_state(root / "resumed")
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    shutil.copytree(root / "base", root / "other_base")
    result = train(root / "other_base", cache, corpus, "train.steps=3")   # one more step: another base
    assert result.returncode == 0, result.stderr[-2000:]
    result = train(root / "ft", cache, corpus, f"init_from={root / 'other_base'}", "train.steps=9", *LORA)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds adapters for a different base" in lines[0], result.stderr
    assert max(int(p.name) for p in (root / "ft/checkpoints").iterdir() if p.name.isdigit()) == 8   # nothing lost


def test_export_merges_the_adapters_and_reimports_as_the_fine_tuned_model(runs):
    from k3jax.convert.exporter import export_checkpoint
    from k3jax.convert.importer import import_checkpoint
    from k3jax.inference import restore_model

    root, _, _ = runs
    export_checkpoint(root / "ft", root / "hf", float32=True, log=lambda line: None)
    import_checkpoint(root / "hf", root / "merged", ["model.compute_dtype=float32"], log=lambda line: None)
    merged, tuned = restore_model(root / "merged").model, restore_model(root / "ft").model
    tokens = jnp.arange(48).reshape(2, 24) % 200
    np.testing.assert_allclose(merged(tokens).logits, tuned(tokens).logits, rtol=0, atol=1e-5)
