"""Shared pieces of the multi-device programs (run as ``python -m tests.sharding.programs.NAME``
with ``--xla_force_host_platform_device_count=8``; each prints one JSON object on its last line)."""
import json
import pathlib

import numpy as np

from k3jax.config import MeshConfig, load_config

MICRO = pathlib.Path(__file__).resolve().parents[2] / "train" / "micro.yaml"
# The trainer tests' micro K3 with two heads per mixer (so "tensor" splits heads) and a batch
# that splits over 8 devices.
SMALL_K3 = ("train.batch_size=8", "model.kda.num_heads=2", "model.mla.num_heads=2")


def small_k3_config(*overrides: str):
    return load_config(MICRO, [*SMALL_K3, *overrides])


def mesh_config(**fields) -> MeshConfig:
    """A mesh config with the default rules; unnamed axes have size 1."""
    return MeshConfig(**{"data": 1, **fields})


def relative_error(value, reference) -> float:
    """||value - reference|| / ||reference|| in float64."""
    value, reference = np.asarray(value, np.float64), np.asarray(reference, np.float64)
    return float(np.linalg.norm(value - reference) / max(np.linalg.norm(reference), 1e-30))


def emit(result: dict) -> None:
    print(json.dumps(result), flush=True)
