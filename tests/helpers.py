"""What many tests share: the repository's paths, float64 error measures, layer parameters as
arrays and a jitted layer call."""
import pathlib

import numpy as np
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
MICRO = ROOT / "tests" / "train" / "micro.yaml"     # the trainer tests' micro K3 (every feature, toy width)


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def relative_error(value, reference) -> float:
    """||value - reference|| / ||reference|| (Frobenius), in float64."""
    value, reference = np.asarray(value, np.float64), np.asarray(reference, np.float64)
    return float(np.linalg.norm(value - reference) / max(np.linalg.norm(reference), 1e-30))


def param_values(module: nnx.Module) -> dict:
    """``{name: float64 array}`` of a layer's directly owned parameters."""
    return {".".join(map(str, path)): np.asarray(v[...], np.float64)
            for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def call_layer(layer, x, memory=None, segment_ids=None):
    """``layer(x, memory, segment_ids)``, jitted."""
    return nnx.jit(lambda m, *a: m(*a))(layer, x, memory, segment_ids)
