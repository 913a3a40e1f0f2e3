"""Export a k3jax run directory as a Hugging Face checkpoint, streamed.

    python -m k3jax.convert export RUN_DIR HF_DIR [--mxfp4] [--float32]

Writes safetensors shards (``model-0000i-of-0000n.safetensors``), ``model.safetensors.index.json``,
``config.json`` (`k3jax.convert.hf_config.hf_config_from_model`, with the fields an imported run
carried over) and the tokenizer files. Tensors are bf16 by default; a run imported from HF keeps
each tensor's source dtype and shape (e.g. the zero-padded ``A_log``); ``float32`` writes every
tensor that is not MXFP4-packed in fp32. With ``mxfp4`` the routed
experts are packed (`k3jax.convert.mxfp4`) and ``quantization_config`` is the source's (or the
release's compressed-tensors MXFP4 description); an expert that arrived as MXFP4 and was not
changed comes back bit for bit. A model whose experts are held packed (``moe.expert_format:
mxfp4``) writes its codes and scales as they are with ``mxfp4``, decoded to bf16 without. Vision tensors are not exported (k3jax holds the text model only).

Each tensor is read from the checkpoint as one region and written to its shard as soon as it is
converted, so the host holds about one tensor at a time. The output appears under its name only
when complete.

A LoRA run (`k3jax.training.finetune`) exports as a normal checkpoint: each adapted weight region is read
from the base the run recorded and merged, W' = W + (alpha / r) A B in fp32, then cast; the router
biases are the run's. The HF description and the tokenizer come from the base run. A QLoRA run's
adapted MXFP4 experts are decoded and merged one expert at a time, W_e' = decode(codes_e) + s A B_e,
then written dense (bf16, or fp32 with ``float32``) or, with ``mxfp4``, re-packed:
``encode_mxfp4(W_e', preferred=the base's scales)`` (`k3jax.convert.mxfp4`).
``--adapter`` writes a LoRA run's adapters alone, in PEFT's layout (`k3jax.convert.peft`).
"""
from __future__ import annotations

import itertools
import json
import pathlib
import shutil
from typing import Callable, Iterator, NamedTuple

import numpy as np

from k3jax.checkpoint import CHECKSUMS, CheckpointError, checkpoint_directory, latest_meta
from k3jax.config import ConfigError, config_from_dict
from k3jax.convert.errors import ConvertError, atomic_directory, require_new
from k3jax.convert.hf_config import HFConfigError, checkpoint_flavour, hf_config_from_model, model_config_from_hf
from k3jax.convert.importer import SCALES, SOURCE_DIR, TOKENIZER_DIR
from k3jax.convert.keymap import TensorMap, model_maps, mxfp4_names
from k3jax.convert.mxfp4 import decode_mxfp4, encode_mxfp4
from k3jax.convert.orbax_stream import StateReader
from k3jax.convert.safetensors_io import DTYPES, INDEX_NAME, plan_shards, write_shard

FP32_DEFAULT = ("A_log", "dt_bias", "e_score_correction_bias")   # kept in fp32 by the reference code
DEFAULT_SHARD_BYTES = 5 * 2**30
MXFP4_QUANTIZATION = {     # the release's compressed-tensors description (SPEC §7), when the source had none
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized",
                                  "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                                              "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"}}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp.*", "re:.*gate$", "re:.*routed_expert.*",
               "re:.*lm_head.*", "re:.*vision.*"],
}


def to_hf(value: np.ndarray, spec: TensorMap, hf_shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of `k3jax.convert.importer.to_k3jax`: the HF layout (fp32) of a k3jax region."""
    value = np.asarray(value, np.float32)
    if spec.layout == "linear":
        return value.reshape(hf_shape[1], hf_shape[0]).T
    if spec.layout == "narrow":
        padded = np.zeros(int(np.prod(hf_shape)), np.float32)
        padded[: value.size] = value.reshape(-1)
        return padded.reshape(hf_shape)
    return value.reshape(hf_shape)


def _entries(maps, manifest: dict, mxfp4: bool, float32: bool = False) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, dtype, shape)`` of every exported tensor, in order (``float32``: every unpacked one F32)."""
    entries = []
    for spec in maps:
        if spec.layout == "packed":
            if mxfp4:
                entries.append((spec.hf_name, "U8", spec.hf_shape))
            elif spec.key.endswith("_packed"):       # one dense weight [out, in] per codes + scales pair
                out, half = spec.hf_shape
                entries.append((spec.hf_name.removesuffix("_packed"), "F32" if float32 else "BF16", (out, 2 * half)))
            continue
        if spec.expert and mxfp4:
            out, inputs = spec.hf_shape
            packed, scale = mxfp4_names(spec.hf_name)
            entries += [(packed, "U8", (out, inputs // 2)), (scale, "U8", (out, inputs // 32))]
            continue
        source = manifest.get(spec.hf_name)
        default = "F32" if spec.key.rsplit("/", 1)[-1] in FP32_DEFAULT else "BF16"
        dtype = "F32" if float32 else source["dtype"] if source else default
        shape = tuple(source["shape"]) if source and spec.layout == "narrow" else spec.hf_shape
        entries.append((spec.hf_name, dtype, shape))
    return entries


def _tensors(maps, entries, reader: StateReader, mxfp4: bool) -> Iterator[np.ndarray]:
    """The exported arrays in `_entries` order, one region read at a time."""
    shapes = {name: (dtype, shape) for name, dtype, shape in entries}
    for spec in maps:
        if spec.layout == "packed":
            merged = _merged_packed(reader, spec, mxfp4)
            if merged is not None:
                yield merged if mxfp4 else merged.astype(DTYPES[shapes[spec.hf_name.removesuffix("_packed")][0]])
            elif mxfp4:
                yield np.asarray(reader.read(spec.top, spec.key, spec.index), np.uint8)
            elif spec.key.endswith("_packed"):
                weight = spec.key.removesuffix("_packed")
                codes, scales = (np.asarray(reader.read(spec.top, weight + part, spec.index), np.uint8)
                                 for part in ("_packed", "_scale"))
                yield decode_mxfp4(codes, scales).astype(DTYPES[shapes[spec.hf_name.removesuffix("_packed")][0]])
            continue
        value = reader.read(spec.top, spec.key, spec.index)
        if spec.expert and mxfp4:
            preferred = reader.read(SCALES, spec.key, spec.index) if reader.has(SCALES, spec.key) else None
            packed, scale = encode_mxfp4(to_hf(value, spec, spec.hf_shape), preferred)
            yield packed
            yield scale
            continue
        dtype, shape = shapes[spec.hf_name]
        yield to_hf(value, spec, shape).astype(DTYPES[dtype])


def _merged_packed(reader, spec: TensorMap, mxfp4: bool) -> np.ndarray | None:
    """A QLoRA run's adapted MXFP4 expert region as exported: with ``mxfp4`` the codes (``_packed``)
    or scales (``_scale``) of the merged weight re-packed, without it the merged weight (fp32,
    from the ``_packed`` region); None when ``reader`` merges no adapter into this expert weight."""
    weight = spec.key.removesuffix("_packed").removesuffix("_scale")
    if not isinstance(reader, MergedAdapters) or weight not in reader.adapted:
        return None
    if not mxfp4 and spec.key.endswith("_scale"):
        return None
    merged = reader.merged_expert(weight, spec.index)
    if not mxfp4:
        return merged
    preferred = np.asarray(reader.base.read(spec.top, weight + "_scale", spec.index), np.uint8)
    packed, scale = encode_mxfp4(merged, preferred)
    return packed if spec.key.endswith("_packed") else scale


def _set_quantization(hf: dict, mxfp4: bool) -> dict:
    """``hf`` with ``quantization_config`` where the source had it (or at the top level) when
    exporting MXFP4 experts, and without it otherwise."""
    sections = [hf] + ([hf["text_config"]] if isinstance(hf.get("text_config"), dict) else [])
    found = [s for s in sections if "quantization_config" in s]
    if not mxfp4:
        for section in found:
            section.pop("quantization_config")
    elif not found:
        hf["quantization_config"] = MXFP4_QUANTIZATION
    return hf


def _run_model(run_dir: pathlib.Path):
    """``(config, step directory, metadata)`` of the latest checkpoint of a run."""
    try:
        step, meta = latest_meta(run_dir)
        return config_from_dict(meta["config"]), checkpoint_directory(run_dir) / str(step), meta
    except (CheckpointError, ConfigError, KeyError) as error:
        raise ConvertError(f"{run_dir}: not a readable k3jax run ({error})") from None


class MergedAdapters:
    """A `StateReader` of a LoRA run's model: its base's arrays, with each adapted weight region
    merged with its adapter, W + s A B in fp32 (routed experts: W_e + s A B_e, A shared), and the
    run's router biases."""

    def __init__(self, base: StateReader, adapters: StateReader, adapted: dict[str, bool], scale: float):
        self.base, self.adapters, self.adapted, self.scale = base, adapters, adapted, scale

    def _own(self, top: str, key: str) -> bool:
        """Whether the run holds ``key`` itself (its router biases), not its base (QLoRA: the codes)."""
        return top == "buffers" and self.adapters.has(top, key)

    def verify(self) -> None:
        """`StateReader.verify` of the base and of the adapters."""
        self.base.verify()
        self.adapters.verify()

    def has(self, top: str, key: str) -> bool:
        return self._own(top, key) or self.base.has(top, key)

    def read(self, top: str, key: str, index: tuple[int, ...] = ()) -> np.ndarray:
        if self._own(top, key):
            return self.adapters.read(top, key, index)
        value = self.base.read(top, key, index)
        if top != "params" or key not in self.adapted:
            return value
        return value.astype(np.float32) + self.scale * self._delta(key, index)

    def _delta(self, key: str, index: tuple[int, ...]) -> np.ndarray:
        """A B of the region ``index`` of adapted weight ``key`` ([in, out]; routed: A B_e, A shared)."""
        a = self.adapters.read("params", f"{key}_lora/a", index[:-1] if self.adapted[key] else index)
        b = self.adapters.read("params", f"{key}_lora/b", index)
        return np.tensordot(a.astype(np.float32), b.astype(np.float32), axes=1)

    def merged_expert(self, key: str, index: tuple[int, ...]) -> np.ndarray:
        """decode(codes_e) + s (A B_e)^T [out, in] fp32 of the MXFP4 expert weight ``key`` (``.../w_gate``)."""
        codes, scales = (np.asarray(self.base.read("buffers", key + part, index), np.uint8)
                         for part in ("_packed", "_scale"))
        return decode_mxfp4(codes, scales) + self.scale * self._delta(key, index).T


class LoRABase(NamedTuple):
    """Where a LoRA run's base is (its run directory, step and that step's metadata) and the weights
    the run adapts (``{weight path: routed}``, `k3jax.training.finetune.adapted_weights`)."""

    run_dir: pathlib.Path
    step: int
    meta: dict
    adapted: dict[str, bool]


def lora_base(config, step_dir: pathlib.Path, meta: dict) -> LoRABase:
    """The base a LoRA checkpoint's ``meta`` records (checked to hold the run's model) and its adapted weights."""
    from k3jax.training.finetune import BASE_META, adapted_weights

    base = meta.get(BASE_META)
    if not isinstance(base, dict):
        raise ConvertError(f"{step_dir}: a LoRA checkpoint without its base's record ({BASE_META})")
    base_dir = pathlib.Path(base["init_from"])
    try:
        _, base_meta = latest_meta(base_dir, base["step"])
    except CheckpointError as error:
        raise ConvertError(f"the LoRA run's base: {error}") from None
    base_config = config_from_dict(base_meta["config"])
    if base_config.model != config.model:
        raise ConvertError(f"the LoRA run's base {base_dir} step {base['step']} holds a different model")
    try:
        adapted = dict(adapted_weights(config.model, config.finetune))
    except ConfigError as error:
        raise ConvertError(f"{step_dir}: {error}") from None
    return LoRABase(base_dir, base["step"], base_meta, adapted)


def _lora_reader(config, step_dir: pathlib.Path, meta: dict) -> tuple[MergedAdapters, pathlib.Path]:
    """The merging reader of a LoRA run's latest checkpoint, and its base's run directory."""
    base = lora_base(config, step_dir, meta)
    reader = MergedAdapters(StateReader(checkpoint_directory(base.run_dir) / str(base.step), base.meta.get(CHECKSUMS)),
                            StateReader(step_dir, meta.get(CHECKSUMS)), base.adapted, config.finetune.lora_scale)
    return reader, base.run_dir


def hf_description(config, model_dir: pathlib.Path, mxfp4: bool = False) -> tuple[dict, str, dict]:
    """``(config.json mapping, checkpoint flavour, source tensor manifest)`` of a run's model: the HF
    fields an imported run carried over (``model_dir/hf_source``), else the defaults."""
    source = model_dir / SOURCE_DIR
    carried, manifest = None, {}
    try:
        if (source / "config.json").is_file():
            carried = model_config_from_hf(json.loads((source / "config.json").read_text()))[1]
            manifest = json.loads((source / "tensors.json").read_text())
        hf = _set_quantization(hf_config_from_model(config.model, carried), mxfp4)
        return hf, checkpoint_flavour(hf), manifest
    except (HFConfigError, OSError, json.JSONDecodeError) as error:
        raise ConvertError(f"{model_dir}: cannot describe the model as a HF config.json ({error})") from None


def read_run(run_dir) -> tuple[pathlib.Path, object, pathlib.Path, dict]:
    """``(run directory resolved, config, latest step directory, metadata)`` of an existing run."""
    run_dir = pathlib.Path(run_dir).expanduser().resolve()
    if not run_dir.is_dir():
        raise ConvertError(f"{run_dir}: no such directory")
    return (run_dir, *_run_model(run_dir))


def export_checkpoint(run_dir, hf_dir, *, mxfp4: bool = False, float32: bool = False,
                      shard_bytes: int = DEFAULT_SHARD_BYTES, log: Callable[[str], None] = print) -> dict:
    """Write the latest checkpoint of ``run_dir`` as a HF checkpoint in ``hf_dir`` (which must not exist)."""
    hf_dir = pathlib.Path(hf_dir).expanduser().resolve()
    require_new(hf_dir)
    run_dir, config, step_dir, meta = read_run(run_dir)
    model_dir = run_dir
    if config.finetune.lora:
        reader, model_dir = _lora_reader(config, step_dir, meta)
    else:
        reader = StateReader(step_dir, meta.get(CHECKSUMS))
    hf, flavour, manifest = hf_description(config, model_dir, mxfp4)
    maps = [spec for spec in model_maps(config.model, flavour) if reader.has(spec.top, spec.key)]
    entries = _entries(maps, manifest, mxfp4, float32)
    shards = plan_shards(entries, shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    total = sum(DTYPES[dtype].itemsize * int(np.prod(shape, dtype=np.int64)) for _, dtype, shape in entries)
    with atomic_directory(hf_dir) as temporary:
        tensors = _tensors(maps, entries, reader, mxfp4)
        for name, shard in zip(names, shards):
            write_shard(temporary / name, shard, itertools.islice(tensors, len(shard)))
            log(f"  wrote {name} ({len(shard)} tensors)")
        reader.verify()   # every array read whole against its saved checksum: a corrupted one exports nothing
        weight_map = {entry[0]: name for name, shard in zip(names, shards) for entry in shard}
        (temporary / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (temporary / "config.json").write_text(json.dumps(hf, indent=2))
        if (model_dir / TOKENIZER_DIR).is_dir():
            for path in (model_dir / TOKENIZER_DIR).iterdir():
                shutil.copyfile(path, temporary / path.name)
    log(f"exported {len(entries)} tensors in {len(shards)} shards to {hf_dir}"
        + (" (routed experts MXFP4)" if mxfp4 else ""))
    return {"hf_dir": str(hf_dir), "tensors": len(entries), "shards": len(shards), "bytes": total}
