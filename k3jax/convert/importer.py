"""Import a Hugging Face K3 / Kimi Linear checkpoint into a k3jax run directory, streamed.

    python -m k3jax.convert import HF_DIR OUT_DIR [key=value ...]

Every HF tensor is read once (its shard opened for that read only), converted to its k3jax layout
(`k3jax.convert.keymap`) in fp32 — the model's parameter dtype, in which bf16 and decoded MXFP4
values are exact — and written straight
into its region of the checkpoint (`k3jax.convert.orbax_stream`), so peak host memory is about one
tensor in its HF and k3jax forms, whatever the model's depth. MXFP4 routed experts are kept packed
(``model.moe.expert_format: mxfp4``, the default when ``config.json`` has the release's
``quantization_config``): their codes and scales are copied byte for byte into the buffers; with
``model.moe.expert_format=dense`` they are decoded exactly (`k3jax.convert.mxfp4`). The run directory::

    OUT_DIR/config.yaml                  the resolved config (model from config.json, key=value applied)
    OUT_DIR/checkpoints/0/               params, buffers (router biases; packed MXFP4 experts), the
                                         MXFP4 scales of experts decoded to dense
    OUT_DIR/tokenizer/                   tiktoken.model, tokenizer_config.json (when HF_DIR has them)
    OUT_DIR/hf_source/                   the source config.json and tensor manifest (for export)

It is what `k3jax.inference.restore_model`, ``python -m eval``, ``init_from=`` and
`k3jax.inference.generation.generate` read; the optimizer state starts fresh. Everything is written under a
temporary name (``.<name>.partial-import`` beside OUT_DIR) and renamed at the end: a failed import
leaves nothing that looks complete, and removes its partial directory; one a killed import left is
removed by the next import of the same OUT_DIR (`k3jax.convert.processes.PartialDirectory`).
Several hosts share an import as the processes of one jax.distributed run
(`k3jax.convert.processes`, `import_share_in_group`).
"""
from __future__ import annotations

import json
import pathlib
import re
import shutil
from typing import Callable, Sequence

import jax
import numpy as np
import yaml
from jax.sharding import AbstractMesh, AxisType

from k3jax.config import Config, ConfigError, config_from_dict, to_dict
from k3jax.convert.errors import ConvertError, conversion_error, require_new
from k3jax.convert.hf_config import HFConfigError, checkpoint_flavour, model_config_from_hf
from k3jax.convert.keymap import TensorMap, is_vision, model_maps, mxfp4_names
from k3jax.convert.mxfp4 import decode_mxfp4
from k3jax.convert.orbax_stream import LeafSpec, StreamedStateWriter, merge_process_stores, summed_checksums
from k3jax.convert.processes import (ImportGroup, PartialDirectory, check_same_inputs, inputs_fingerprint,
                                     one_line, partial_directory)
from k3jax.convert.safetensors_io import SafetensorsCheckpoint, TensorInfo
from k3jax.data.tokenizers import BPE_FILE_NAME, TOKENIZER_CONFIG_NAME
from k3jax.sharding.mesh import MESH_AXES, axes_size, partition_spec
from k3jax.training import abstract_model

FLOAT_DTYPES = ("BF16", "F16", "F32")
SOURCE_DIR, TOKENIZER_DIR = "hf_source", "tokenizer"
SCALES = "mxfp4_scales"      # top-level state item: the E8M0 scales experts arrived with [.., out, in/32]


def to_k3jax(hf_value: np.ndarray, spec: TensorMap) -> np.ndarray:
    """An HF tensor (any float dtype) in the k3jax layout of ``spec``, fp32."""
    if spec.layout == "packed":
        return np.asarray(hf_value, np.uint8)
    value = np.asarray(hf_value, np.float32)
    if spec.layout == "linear":
        return value.T.reshape(spec.shape)
    if spec.layout == "narrow":
        return value.reshape(-1)[: spec.shape[0]]
    return value.reshape(spec.shape)


def _first(names, limit: int = 3) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _check_tensor(spec: TensorMap, info: TensorInfo, name: str, dtypes: Sequence[str], shape: tuple[int, ...]) -> None:
    if info.dtype not in dtypes:
        raise ConvertError(f"tensor {name} in shard {info.shard}: dtype {info.dtype}, expected {' or '.join(dtypes)}")
    if spec.layout == "narrow":
        ok = int(np.prod(info.shape)) >= spec.shape[0] and sum(n != 1 for n in info.shape) <= 1
    else:
        ok = tuple(info.shape) == tuple(shape)
    if not ok:
        raise ConvertError(f"tensor {name} in shard {info.shard}: shape {list(info.shape)}, expected {list(shape)}"
                           + (" (or zero-padded)" if spec.layout == "narrow" else ""))


_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT_NUMBER = re.compile(r"\.experts\.(\d+)\.")


def check_counts(model, manifest: dict[str, TensorInfo]) -> None:
    """The config's layer and routed-expert counts against the numbers the checkpoint's index uses
    (``layers.{i}.``, ``experts.{e}.``), before any per-layer or per-expert structure is built."""
    names = [name for name in manifest if not is_vision(name)]
    for what, pattern, count in (("layers", _LAYER_NUMBER, model.num_layers),
                                 ("routed experts", _EXPERT_NUMBER, model.moe.num_experts)):
        numbers = {int(match.group(1)) for name in names if (match := pattern.search(name))}
        held = max(numbers) + 1 if numbers else 0
        if held != count:
            raise ConvertError(f"config.json describes {count} {what}, but the checkpoint's index holds "
                               f"tensors of {held}")


def plan_import(maps: list[TensorMap], manifest: dict[str, TensorInfo]) -> tuple[set[str], int]:
    """Check the checkpoint against the model: ``(names of experts stored as MXFP4, vision tensors
    skipped)``; a missing, unexpected, misshapen or mistyped tensor raises `ConvertError`."""
    expected, packed = set(), set()
    for spec in maps:
        packed_name, scale_name = mxfp4_names(spec.hf_name)
        if spec.expert and packed_name in manifest:
            out, inputs = spec.hf_shape
            _check_tensor(spec, manifest[packed_name], packed_name, ("U8",), (out, inputs // 2))
            if scale_name not in manifest:
                raise ConvertError(f"tensor {scale_name} is missing (its weight_packed is in shard {manifest[packed_name].shard})")
            _check_tensor(spec, manifest[scale_name], scale_name, ("U8",), (out, inputs // 32))
            expected |= {packed_name, scale_name}
            packed.add(spec.hf_name)
        else:
            expected.add(spec.hf_name)
            if spec.hf_name in manifest:
                dtypes = ("U8",) if spec.layout == "packed" else FLOAT_DTYPES
                _check_tensor(spec, manifest[spec.hf_name], spec.hf_name, dtypes, spec.hf_shape)
    missing = expected - set(manifest)
    if missing:
        raise ConvertError(f"{len(missing)} tensors the config needs are missing: {_first(missing)}")
    vision = {name for name in manifest if is_vision(name)}
    unexpected = set(manifest) - expected - vision
    if unexpected:
        raise ConvertError(f"{len(unexpected)} unexpected tensors (not in this config's model): {_first(unexpected)}")
    return packed, len(vision)


def _leaf_specs(abstract: dict, maps: list[TensorMap], packed: set[str]) -> dict[str, dict[str, LeafSpec]]:
    """Shapes (fp32; scales uint8) and region chunks of every array the import writes, from the
    abstract ``{"params": ..., "buffers": ...}`` of the model."""
    leaves: dict[str, dict[str, LeafSpec]] = {"params": {}, "buffers": {}}
    for spec in maps:
        full = tuple(abstract[spec.top][spec.key].shape)
        chunks = (1,) * len(spec.index) + spec.shape
        dtype = np.uint8 if spec.layout == "packed" else np.float32
        leaves[spec.top][spec.key] = LeafSpec(full, np.dtype(dtype), chunks)
        if spec.hf_name in packed:
            out, inputs = spec.hf_shape
            lead = full[: len(spec.index)]
            leaves.setdefault(SCALES, {})[spec.key] = LeafSpec(
                (*lead, out, inputs // 32), np.dtype(np.uint8), (1,) * len(lead) + (out, inputs // 32))
    return leaves


def target_mesh(mesh_config) -> AbstractMesh:
    """The abstract mesh (no devices) the ``mesh.*`` sizes describe; the -1 axis counts as 1 (with
    the default rules it is the data axis, which no parameter is split over)."""
    sizes = tuple(max(size, 1) for size in mesh_config.sizes.values())
    return AbstractMesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def with_shard_chunks(leaves: dict[str, dict[str, LeafSpec]], axes: dict[str, dict[str, tuple]],
                      mesh_config) -> dict[str, dict[str, LeafSpec]]:
    """``leaves`` with each array's chunks cut to its shard on the target mesh (`target_mesh`,
    PartitionSpecs from ``mesh_config.rules`` and the arrays' logical ``axes`` per top-level
    item), so every device of that mesh restores its shard from whole chunks."""
    mesh = target_mesh(mesh_config)
    resized = {top: dict(specs) for top, specs in leaves.items()}
    for top, top_axes in axes.items():
        for key, names in top_axes.items():
            spec = leaves[top][key]
            partition = partition_spec(names, spec.shape, mesh_config.rules, mesh)
            parts = [axes_size(mesh, entry if isinstance(entry, tuple) else (entry,)) if entry else 1
                     for entry in partition]
            chunks = tuple(min(chunk, size // count) for chunk, size, count in zip(spec.chunks, spec.shape, parts))
            resized[top][key] = spec._replace(chunks=chunks)
    return resized


def process_share(maps: list[TensorMap], process: int, num_processes: int) -> list[TensorMap]:
    """The tensors process ``process`` of ``num_processes`` imports: every N-th in checkpoint order
    (neighbouring layers' tensors go to different processes)."""
    return maps[process::num_processes]


def _write_tensors(writer: StreamedStateWriter, maps: list[TensorMap], checkpoint: SafetensorsCheckpoint,
                   packed: set[str], log: Callable[[str], None], check: Callable[[], None] = lambda: None) -> None:
    """Read each tensor of ``maps`` once and write it (MXFP4 experts decoded, their scales kept);
    ``check`` runs before each (it raises to stop, e.g. when another import process failed). On any
    error the writes in flight are let land first (`StreamedStateWriter.settle`), so the caller can
    remove the partial directory with nothing still writing into it."""
    try:
        for count, spec in enumerate(maps, 1):
            check()
            if spec.hf_name in packed:
                packed_name, scale_name = mxfp4_names(spec.hf_name)
                scale = checkpoint.read(scale_name)
                value = decode_mxfp4(checkpoint.read(packed_name), scale)
                writer.write(SCALES, spec.key, spec.index, scale)
            else:
                value = checkpoint.read(spec.hf_name)
            if spec.layout == "narrow" and np.any(np.asarray(value, np.float32).reshape(-1)[spec.shape[0]:]):
                log(f"warning: {spec.hf_name} has non-zero entries past its {spec.shape[0]} heads; they are "
                    f"dropped (export writes zeros there)")
            writer.write(spec.top, spec.key, spec.index, to_k3jax(value, spec))
            del value
            if count % 1000 == 0:
                log(f"  {count}/{len(maps)} tensors")
        writer.flush()
    except BaseException:
        writer.settle()
        raise


def import_share_in_group(partial: PartialDirectory, leaves, share: list[TensorMap], checkpoint, packed: set[str],
                          log, group: ImportGroup, fingerprint: str, finish) -> None:
    """This process's part of an import by the processes of ``group`` (`k3jax.convert.processes`).

    Process 0 claims the partial directory (removing a stale one) and publishes ``ready`` with
    its inputs' ``fingerprint``; every other process checks it against its own and then writes.
    Each writes ``share`` into its own store of the shared partial directory and publishes its
    checksum sums; process 0 waits for all of them, merges the stores (`merge_process_stores`),
    calls ``finish(temporary, writer, checksums)``, renames the directory to OUT_DIR and
    publishes ``finished``, which the others wait for. An error anywhere stops every process
    (`ImportGroup.check`; `stop_group`)."""
    if group.primary:
        partial.claim(log)
        group.publish("ready", fingerprint)
    else:
        check_same_inputs(fingerprint, group.wait(["ready"])[0], group.process)
    writer = StreamedStateWriter(partial.path / "checkpoints" / "0", leaves, process=group.process,
                                 num_processes=group.count)
    _write_tensors(writer, share, checkpoint, packed, log, check=group.check)
    group.publish(f"done/{group.process}", json.dumps(writer.checksums()))
    if not group.primary:
        group.wait(["finished"])
        return
    parts = group.wait([f"done/{i}" for i in range(group.count)])
    merge_process_stores(writer.state_dir)
    finish(partial.path, writer, summed_checksums([json.loads(part) for part in parts]))
    partial.publish()
    group.publish("finished")


def stop_group(group: ImportGroup, partial: PartialDirectory, error: BaseException, log) -> None:
    """After ``error`` in this process of ``group``: tell the others, and on process 0 wait for
    them to stop, then remove the partial directory it claimed."""
    group.fail(one_line(error))
    if not group.primary:
        return
    silent = group.wait_stopped()
    if partial.claimed and silent:
        log(f"left {partial.path}: import process {silent[0]} did not report that it stopped; "
            f"the next import of {partial.out_dir} removes it")
    elif partial.claimed:
        partial.remove()


def _copy_tokenizer(hf_dir: pathlib.Path, target: pathlib.Path) -> pathlib.Path | None:
    """Copy K3's ``tiktoken.model`` (and ``tokenizer_config.json``) into ``target``; its path, or None."""
    if not (hf_dir / BPE_FILE_NAME).is_file():
        return None
    target.mkdir()
    for name in (BPE_FILE_NAME, TOKENIZER_CONFIG_NAME):
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, target / name)
    return target


def _resolved_config(hf: dict, out_dir: pathlib.Path, tokenizer: bool, overrides: Sequence[str]):
    try:
        model, carried = model_config_from_hf(hf)
    except HFConfigError as error:
        raise ConvertError(f"config.json: {error}") from None
    data = {"model": to_dict(model), "run_dir": str(out_dir)}
    if quantized_experts(hf):
        data["model"]["moe"]["expert_format"] = "mxfp4"      # keep the release's experts packed
    if tokenizer:
        data["data"] = {"tokenizer": str(out_dir / TOKENIZER_DIR / BPE_FILE_NAME)}
    if any(o.split("=", 1)[0].strip() == "data.path" for o in overrides):
        data.setdefault("data", {})["kind"] = "text"
    try:
        return config_from_dict(data, overrides), carried
    except ConfigError as error:
        raise ConvertError(f"override: {error}") from None


def quantized_experts(hf: dict) -> bool:
    """Whether ``config.json`` declares MXFP4 routed experts (a ``quantization_config``, top level or
    in ``text_config``; `k3jax.convert.hf_config` accepts only the release's MXFP4 one)."""
    text = hf.get("text_config")
    return "quantization_config" in hf or (isinstance(text, dict) and "quantization_config" in text)


def read_hf_config(path: pathlib.Path) -> tuple[dict, str]:
    """``(config.json mapping, checkpoint flavour)``; one-line `ConvertError` when unusable."""
    try:
        hf = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConvertError(f"{path}: not readable JSON ({' '.join(str(error).split())})") from None
    try:
        return hf, checkpoint_flavour(hf)
    except HFConfigError as error:
        raise ConvertError(f"{path.name}: {error}") from None


def hf_run_config(hf_config_path, run_dir, overrides: Sequence[str] = ()) -> Config:
    """The k3jax config an import of ``hf_config_path`` (a config.json) into ``run_dir`` would use,
    without reading any tensor (MXFP4 experts kept packed when the file declares them)."""
    hf, _ = read_hf_config(pathlib.Path(hf_config_path))
    return _resolved_config(hf, pathlib.Path(run_dir), False, overrides)[0]


def write_run_config(hf_config_path, out_yaml, overrides: Sequence[str] = ()) -> None:
    """`hf_run_config` as YAML at ``out_yaml`` (for ``python -m train.plan`` or the trainer)."""
    out_yaml = pathlib.Path(out_yaml).expanduser().resolve()
    require_new(out_yaml)
    config = hf_run_config(hf_config_path, out_yaml.parent / out_yaml.stem, overrides)
    out_yaml.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


def import_checkpoint(hf_dir, out_dir, overrides: Sequence[str] = (), log: Callable[[str], None] = print,
                      group: ImportGroup | None = None) -> dict:
    """Convert ``hf_dir`` into the run directory ``out_dir`` (which must not exist); returns a summary.

    With a ``group`` (the processes of a jax.distributed run, `ImportGroup.joined`), every process
    runs this with the same arguments and writes its share of the tensors (`process_share`);
    process 0 finalises (`import_share_in_group`); an error in any process stops all (`stop_group`)."""
    out_dir = pathlib.Path(out_dir).expanduser().resolve()
    if group is None:
        return _import_checkpoint(pathlib.Path(hf_dir), out_dir, overrides, log, None, None)
    partial = PartialDirectory(out_dir)
    try:
        return _import_checkpoint(pathlib.Path(hf_dir), out_dir, overrides, log, group, partial)
    except BaseException as error:
        stop_group(group, partial, error, log)
        converted = conversion_error(out_dir, error)      # a full disk, another write error: one line
        if converted is None:
            raise
        raise converted from None


def _tensor_maps(config: Config, flavour: str) -> list[TensorMap]:
    """The HF tensor -> k3jax parameter maps of ``config``'s model (no head when it is tied to the embedding)."""
    maps = model_maps(config.model, flavour)
    if getattr(config.model, "tie_embeddings", False):
        maps = [spec for spec in maps if spec.key != "lm_head"]     # the head is the embedding
    return maps


def _write_run_files(temporary: pathlib.Path, hf_dir: pathlib.Path, manifest: dict[str, TensorInfo],
                     config: Config) -> None:
    """The imported run directory's files beside its checkpoint: the tokenizer, the HF config and
    the text model's tensor list (``source/``), and ``config.yaml``."""
    _copy_tokenizer(hf_dir, temporary / TOKENIZER_DIR)
    (temporary / SOURCE_DIR).mkdir()
    shutil.copyfile(hf_dir / "config.json", temporary / SOURCE_DIR / "config.json")
    tensors = {name: {"dtype": info.dtype, "shape": list(info.shape)} for name, info in manifest.items()
               if not is_vision(name)}
    (temporary / SOURCE_DIR / "tensors.json").write_text(json.dumps(tensors))
    (temporary / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


def _import_checkpoint(hf_dir: pathlib.Path, out_dir: pathlib.Path, overrides, log, group: ImportGroup | None,
                       partial: PartialDirectory | None) -> dict:
    process, num_processes = (group.process, group.count) if group else (0, 1)
    require_new(out_dir)
    if not hf_dir.is_dir():
        raise ConvertError(f"{hf_dir}: no such directory")
    hf_config_path = hf_dir / "config.json"
    hf, flavour = read_hf_config(hf_config_path)
    has_tokenizer = (hf_dir / BPE_FILE_NAME).is_file()
    config, _ = _resolved_config(hf, out_dir, has_tokenizer, overrides)
    checkpoint = SafetensorsCheckpoint(hf_dir)
    check_counts(config.model, checkpoint.manifest)
    maps = _tensor_maps(config, flavour)
    packed, vision = plan_import(maps, checkpoint.manifest)
    if vision:
        log(f"skipping {vision} vision tensors (k3jax imports the text model)")
    parts, params, buffers = abstract_model(config.model)
    abstract = {"params": params, "buffers": buffers}
    uncovered = sorted((set(params) | set(buffers)) - {spec.key for spec in maps})
    if uncovered:
        raise ConvertError(f"no HF tensor fills k3jax parameter {uncovered[0]} ({len(uncovered)} in all)")

    leaves = with_shard_chunks(_leaf_specs(abstract, maps, packed),
                               {"params": parts.params.axes(), "buffers": parts.buffers.axes()}, config.mesh)
    meta = {"config": to_dict(config), "data_position": 0, "optimizer_step": 0, "jax_version": jax.__version__,
            "imported_from": str(hf_dir.resolve())}
    share = process_share(maps, process, num_processes)
    if group is None:
        with partial_directory(out_dir, log) as temporary:
            writer = StreamedStateWriter(temporary / "checkpoints" / "0", leaves)
            _write_tensors(writer, share, checkpoint, packed, log)
            _write_run_files(temporary, hf_dir, checkpoint.manifest, config)
            writer.finish(meta, writer.checksums())
    else:
        def finish(temporary, writer, checksums):
            _write_run_files(temporary, hf_dir, checkpoint.manifest, config)
            writer.finish(meta, checksums)
        fingerprint = inputs_fingerprint(hf_config_path.read_bytes(), checkpoint.manifest, out_dir, overrides)
        import_share_in_group(partial, leaves, share, checkpoint, packed, log, group, fingerprint, finish)
    kept = sum(spec.layout == "packed" for spec in maps) // 2
    summary = {"run_dir": str(out_dir), "flavour": flavour, "tensors": len(checkpoint.manifest) - vision,
               "mxfp4_experts": len(packed) + kept, "mxfp4_kept_packed": kept > 0, "vision_skipped": vision,
               "tokenizer": has_tokenizer}
    how = "kept packed" if kept else "decoded"
    log(f"imported {summary['tensors']} tensors ({len(packed) + kept} MXFP4 expert weights {how}) into {out_dir}")
    return summary
