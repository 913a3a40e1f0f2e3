"""PEFT adapters out of and into k3jax LoRA runs (`k3jax.convert.peft`): ``export --adapter`` against
the merged export in float64 NumPy, the bit-exact round trip through ``import-adapter``, and bad
input as one line and status 1.

The base is the 12-layer Kimi-Linear-shaped fixture (KDA and MLA layers, a prefix and a scanned body
of two repeats, shared and routed experts) imported from HF; the LoRA run on it holds random
adapters (rank 4, alpha 8) on the default targets and on the routed experts, written as a trainer's
LoRA checkpoint (`write_lora_run`).
"""
import json
import pathlib
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from k3jax.checkpoint import checkpoint_directory
from k3jax.config import config_from_dict, load_config, to_dict
from k3jax.convert.cli import main
from k3jax.convert.exporter import export_checkpoint
from k3jax.convert.importer import import_checkpoint
from k3jax.convert.orbax_stream import StateReader
from k3jax.convert.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, export_adapter, import_adapter, write_lora_run
from k3jax.convert.safetensors_io import SafetensorsCheckpoint
from k3jax.training.finetune import abstract_lora_model, adapted_weights
from tests.convert.hf_fixtures import hf_tensors, write_checkpoint
from tests.convert.test_import_export import kimi_linear_config

QUIET = lambda line: None  # noqa: E731
RANK, ALPHA = 4, 8.0
EXPERT = "model.layers.{layer}.block_sparse_moe.experts.{expert}.w2"


class Runs:
    def __init__(self, root: pathlib.Path):
        self.root = root
        self.hf_dir = write_checkpoint(root / "hf", kimi_linear_config(), hf_tensors(kimi_linear_config(), seed=6))
        self.base = root / "base"
        import_checkpoint(self.hf_dir, self.base, log=QUIET)
        self.lora = root / "lora"
        config = load_config(self.base / "config.yaml")
        run = config_from_dict({**to_dict(config), "init_from": str(self.base), "run_dir": str(self.lora),
                                "finetune": {"lora_rank": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.05,
                                             "lora_routed_experts": True}})
        abstract = abstract_lora_model(run.model, run.finetune, run.train.seed)
        rng = np.random.default_rng(7)
        write_lora_run(self.lora, run, abstract, {name: rng.normal(0, 0.2, value.shape).astype(np.float32)
                                                  for name, value in abstract.adapters.items()})
        self.adapter = root / "adapter"
        export_adapter(self.lora, self.adapter, log=QUIET)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("peft"))


def test_adapter_export_plus_the_base_equals_the_merged_export(runs, tmp_path):
    """For every adapted module, W_hf + (lora_alpha / r) lora_B lora_A in float64 (the plain export of
    the base + the written factors) is the merged export's tensor to fp32 rounding; every other tensor
    of the merged export is the base's."""
    config = json.loads((runs.adapter / ADAPTER_CONFIG).read_text())
    assert {key: config[key] for key in ("peft_type", "r", "lora_alpha", "lora_dropout", "bias", "task_type",
                                         "fan_in_fan_out")} == {
        "peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.05, "bias": "none",
        "task_type": "CAUSAL_LM", "fan_in_fan_out": False}
    assert config["base_model_name_or_path"] == str(runs.hf_dir.resolve())
    factors = load_file(runs.adapter / ADAPTER_WEIGHTS)
    modules = config["target_modules"]
    assert set(factors) == {f"base_model.model.{m}.lora_{f}.weight" for m in modules for f in "AB"}
    assert EXPERT.format(layer=1, expert=7) in modules and "model.layers.3.self_attn.kv_b_proj" in modules

    export_checkpoint(runs.lora, tmp_path / "merged", float32=True, log=QUIET)
    export_checkpoint(runs.base, tmp_path / "plain", float32=True, log=QUIET)
    merged, plain = SafetensorsCheckpoint(tmp_path / "merged"), SafetensorsCheckpoint(tmp_path / "plain")
    assert set(merged.manifest) == set(plain.manifest)
    for module in modules:
        lora_a = factors[f"base_model.model.{module}.lora_A.weight"].astype(np.float64)
        lora_b = factors[f"base_model.model.{module}.lora_B.weight"].astype(np.float64)
        expected = plain.read(module + ".weight").astype(np.float64) + ALPHA / RANK * lora_b @ lora_a
        found = merged.read(module + ".weight").astype(np.float64)
        np.testing.assert_allclose(found, expected, rtol=0, atol=2e-6 * np.abs(expected).max(), err_msg=module)
    for name in set(plain.manifest) - {m + ".weight" for m in modules}:
        assert merged.read(name).tobytes() == plain.read(name).tobytes(), name


def test_routed_experts_export_the_shared_a_per_expert(runs):
    factors = load_file(runs.adapter / ADAPTER_WEIGHTS)
    a = [factors[f"base_model.model.{EXPERT.format(layer=5, expert=e)}.lora_A.weight"] for e in range(8)]
    b = [factors[f"base_model.model.{EXPERT.format(layer=5, expert=e)}.lora_B.weight"] for e in range(8)]
    assert all(x.tobytes() == a[0].tobytes() for x in a)
    assert len({x.tobytes() for x in b}) == 8


def _state(run_dir):
    return StateReader(sorted(checkpoint_directory(run_dir).iterdir())[-1])


def test_round_trip_gives_the_runs_adapters_bit_for_bit(runs, tmp_path):
    summary = import_adapter(runs.adapter, runs.base, tmp_path / "imported", log=QUIET)
    original, imported = load_config(runs.lora / "config.yaml"), load_config(tmp_path / "imported" / "config.yaml")
    assert (imported.finetune.lora_rank, imported.finetune.lora_alpha, imported.finetune.lora_dropout) == (RANK, ALPHA, 0.05)
    assert imported.init_from == str(runs.base.resolve())
    assert adapted_weights(imported.model, imported.finetune) == adapted_weights(original.model, original.finetune)
    assert summary["weights"] == len(adapted_weights(original.model, original.finetune))
    abstract = abstract_lora_model(original.model, original.finetune, original.train.seed)
    source, copy = _state(runs.lora), _state(tmp_path / "imported")
    for top, names in (("params", abstract.adapters), ("buffers", abstract.buffers)):
        for name in names:
            a, b = source.read(top, name), copy.read(top, name)
            assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), name


@pytest.mark.slow   # compiles the model's forward twice
def test_imported_adapter_loads_as_the_lora_run(runs, tmp_path):
    import jax.numpy as jnp
    from k3jax.inference import restore_model

    import_adapter(runs.adapter, runs.base, tmp_path / "imported", log=QUIET)
    tokens = jnp.asarray(np.arange(24).reshape(2, 12) * 7 % 500)
    tuned, imported = restore_model(runs.lora).model, restore_model(tmp_path / "imported").model
    np.testing.assert_array_equal(np.asarray(imported(tokens).logits), np.asarray(tuned(tokens).logits))


def _rewrite(directory: pathlib.Path, config=None, tensors=None) -> None:
    if config is not None:
        path = directory / ADAPTER_CONFIG
        path.write_text(json.dumps(config(json.loads(path.read_text()))))
    if tensors is not None:
        path = directory / ADAPTER_WEIGHTS
        save_file(tensors(load_file(path)), path)


def _set(**fields):
    return lambda config: {**config, **fields}


def _renamed(old: str, new: str):
    return lambda tensors: {new if name == old else name: value for name, value in tensors.items()}


def _changed(name: str, change):
    return lambda tensors: {**tensors, name: change(tensors[name])}


Q = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
ROUTED = "base_model.model." + EXPERT.format(layer=1, expert=3) + ".lora_A.weight"
IMPORT_CASES = {
    "peft_type": (dict(config=_set(peft_type="IA3")), "peft_type 'IA3'"),
    "dora": (dict(config=_set(use_dora=True)), "use_dora is set"),
    "rslora": (dict(config=_set(use_rslora=True)), "use_rslora is set"),
    "bias": (dict(config=_set(bias="lora_only")), "bias 'lora_only'"),
    "rank_pattern": (dict(config=_set(rank_pattern={"q_proj": 8})), "rank_pattern is set"),
    "rank": (dict(config=_set(r=8)), "(r=8 in adapter_config.json)"),
    "shape": (dict(tensors=_changed(Q.format("B"), lambda x: x[:-1])), f"tensor {Q.format('B')}: shape"),
    "dtype": (dict(tensors=_changed(Q.format("A"), lambda x: x.astype(np.int32))), "dtype int32"),
    "unknown module": (dict(tensors=_renamed(Q.format("A"), "base_model.model.lm_head.lora_A.weight")),
                       "lm_head is not a module k3jax can adapt"),
    "not a factor": (dict(tensors=_renamed(Q.format("A"), Q.format("A").replace("lora_A", "lora_embedding_A"))),
                     "not a LoRA factor"),
    "half a pair": (dict(tensors=lambda t: {n: v for n, v in t.items() if n != Q.format("B")}),
                    f"tensor {Q.format('B')} is missing"),
    "routed A": (dict(tensors=_changed(ROUTED, lambda x: x + 1)), "lora_routed_experts shares one A"),
}


def _one_line(capsys, argv, words) -> None:
    assert main(argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k3jax-convert: error:") and words in lines[0], lines


@pytest.mark.parametrize("case", IMPORT_CASES)
def test_bad_adapter_is_one_line(runs, tmp_path, capsys, case):
    damage, words = IMPORT_CASES[case]
    adapter = pathlib.Path(shutil.copytree(runs.adapter, tmp_path / "adapter"))
    _rewrite(adapter, **damage)
    _one_line(capsys, ["import-adapter", str(adapter), str(runs.base), str(tmp_path / "out")], words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]     # nothing under OUT_DIR, no leftovers


@pytest.mark.parametrize("missing", [ADAPTER_CONFIG, ADAPTER_WEIGHTS])
def test_missing_adapter_file_is_one_line(runs, tmp_path, capsys, missing):
    adapter = pathlib.Path(shutil.copytree(runs.adapter, tmp_path / "adapter"))
    (adapter / missing).unlink()
    _one_line(capsys, ["import-adapter", str(adapter), str(runs.base), str(tmp_path / "out")], "no such file")
    (adapter / ADAPTER_WEIGHTS).write_bytes(b"\x10\x00\x00\x00")
    if missing == ADAPTER_WEIGHTS:
        _one_line(capsys, ["import-adapter", str(adapter), str(runs.base), str(tmp_path / "out")], "not a safetensors")
    assert not (tmp_path / "out").exists()


def test_bad_runs_are_one_line(runs, tmp_path, capsys):
    _one_line(capsys, ["export", str(runs.base), str(tmp_path / "out"), "--adapter"], "not a LoRA run")
    _one_line(capsys, ["export", str(runs.lora), str(tmp_path / "out"), "--adapter", "--float32"], "do not apply")
    _one_line(capsys, ["export", str(runs.lora), str(runs.adapter), "--adapter"], "already exists")
    _one_line(capsys, ["import-adapter", str(runs.adapter), str(runs.lora), str(tmp_path / "out")], "a LoRA run")
    assert list(tmp_path.iterdir()) == []
