"""Shared pieces of the multi-device programs (run as ``python -m tests.sharding.programs.NAME``
with ``--xla_force_host_platform_device_count=8``; each prints one JSON object on its last line)."""
import json

from k3jax.config import MeshConfig, load_config
from tests.helpers import MICRO

# The trainer tests' micro K3 with two heads per mixer (so "tensor" splits heads) and a batch
# that splits over 8 devices.
SMALL_K3 = ("train.batch_size=8", "model.kda.num_heads=2", "model.mla.num_heads=2")


def small_k3_config(*overrides: str):
    return load_config(MICRO, [*SMALL_K3, *overrides])


def mesh_config(**fields) -> MeshConfig:
    """A mesh config with the default rules; unnamed axes have size 1."""
    return MeshConfig(**{"data": 1, **fields})


def emit(result: dict) -> None:
    print(json.dumps(result), flush=True)
