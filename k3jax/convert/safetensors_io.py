"""Sharded safetensors checkpoints: a validated reader (``safetensors.safe_open``, numpy) and a
streaming shard writer.

A Hugging Face checkpoint directory holds ``model.safetensors.index.json``
(``{"weight_map": {tensor name: shard file}}``) and the shards, or a single ``model.safetensors``.
A shard is ``u64 header length | JSON header {name: {dtype, shape, data_offsets}} | raw bytes``;
the writer emits the header first (every shape and dtype is known in advance) and then each
tensor as it is produced, so a shard never has to be held in memory.
"""
from __future__ import annotations

import json
import os
import pathlib
import struct
from typing import Iterator, NamedTuple

import ml_dtypes  # noqa: F401 - registers bfloat16 & co. with numpy, which safetensors' numpy API needs
import numpy as np
from safetensors import safe_open

from k3jax.convert.errors import ConvertError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
          "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "I32": np.dtype(np.int32), "I64": np.dtype(np.int64),
          "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class TensorInfo(NamedTuple):
    dtype: str            # safetensors dtype name ("BF16", "U8", ...)
    shape: tuple[int, ...]
    shard: str            # file name inside the checkpoint directory


def read_json(path: pathlib.Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConvertError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConvertError(f"{path}: not readable JSON ({' '.join(str(error).split())[:200]})") from None
    except RecursionError:
        raise ConvertError(f"{path}: nested too deeply to be a checkpoint's JSON") from None
    if not isinstance(data, dict):
        raise ConvertError(f"{path}: expected a JSON object")
    return data


class SafetensorsCheckpoint:
    """The tensors of a checkpoint directory: ``manifest`` (name -> `TensorInfo`, from the shard
    headers, validated against the index) and ``read(name)`` (one tensor, read once)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = pathlib.Path(directory)
        index = self.directory / INDEX_NAME
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConvertError(f"{index}: no 'weight_map' of tensor names to shard files")
            for name, shard in weight_map.items():
                if not isinstance(shard, str) or pathlib.PurePath(shard).name != shard or shard in ("", ".", ".."):
                    raise ConvertError(f"{index}: tensor {name} maps to {str(shard)[:80]!r}, not a shard file name "
                                       f"in {self.directory}")
        elif (self.directory / SINGLE_NAME).exists():
            weight_map = None
        else:
            raise ConvertError(f"{self.directory}: neither {INDEX_NAME} nor {SINGLE_NAME}")
        shards = sorted(set(weight_map.values())) if weight_map else [SINGLE_NAME]
        self.manifest: dict[str, TensorInfo] = {}
        for shard in shards:
            for name, info in self._shard_header(shard).items():
                self.manifest[name] = info
        if weight_map:
            self._check_against_index(weight_map)

    def _shard_header(self, shard: str) -> dict[str, TensorInfo]:
        path = self.directory / shard
        if not path.is_file():
            raise ConvertError(f"shard {shard} is missing from {self.directory}")
        try:
            with safe_open(path, "numpy") as handle:
                return {name: TensorInfo(handle.get_slice(name).get_dtype(), tuple(handle.get_slice(name).get_shape()), shard)
                        for name in handle.keys()}
        except Exception as error:  # noqa: BLE001 - safetensors raises its own error types
            raise ConvertError(f"shard {shard} is truncated or not a safetensors file: {' '.join(str(error).split())}") from None

    def _check_against_index(self, weight_map: dict) -> None:
        for name, shard in weight_map.items():
            found = self.manifest.get(name)
            if found is None or found.shard != shard:
                where = "no shard" if found is None else f"shard {found.shard}"
                raise ConvertError(f"tensor {name}: the index names shard {shard}, but it is in {where}")
        extra = sorted(set(self.manifest) - set(weight_map))
        if extra:
            raise ConvertError(f"shard {self.manifest[extra[0]].shard} holds {len(extra)} tensors the index does "
                               f"not list (first: {extra[0]})")

    def read(self, name: str) -> np.ndarray:
        """One tensor as a numpy array (bf16 as ``ml_dtypes.bfloat16``)."""
        info = self.manifest[name]
        try:
            with safe_open(self.directory / info.shard, "numpy") as handle:
                return handle.get_tensor(name)
        except Exception as error:  # noqa: BLE001
            raise ConvertError(f"tensor {name} in shard {info.shard} cannot be read: {' '.join(str(error).split())}") from None


def plan_shards(tensors: list[tuple[str, str, tuple[int, ...]]], max_bytes: int) -> list[list[tuple[str, str, tuple[int, ...]]]]:
    """Split ``(name, dtype, shape)`` entries, in order, into shards of at most ``max_bytes``
    (a tensor larger than that gets a shard of its own)."""
    shards, current, size = [], [], 0
    for entry in tensors:
        nbytes = DTYPES[entry[1]].itemsize * int(np.prod(entry[2], dtype=np.int64))
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    return shards + [current] if current else shards


def write_shard(path: pathlib.Path, entries: list[tuple[str, str, tuple[int, ...]]],
                tensors: Iterator[np.ndarray]) -> None:
    """Write one safetensors file from its ``(name, dtype, shape)`` entries and the arrays in the
    same order, each written as soon as it arrives."""
    header, offset = {}, 0
    for name, dtype, shape in entries:
        nbytes = DTYPES[dtype].itemsize * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for (name, dtype, shape), array in zip(entries, tensors, strict=True):
            if array.dtype != DTYPES[dtype] or tuple(array.shape) != tuple(shape):
                raise ConvertError(f"tensor {name}: produced {array.dtype}{list(array.shape)}, expected {dtype}{list(shape)}")
            handle.write(np.ascontiguousarray(array).tobytes())
