"""Shared helpers for layer tests: parameter values as float64 arrays, relative error."""
import numpy as np
from flax import nnx


def param_values(module: nnx.Module) -> dict:
    """``{name: float64 array}`` of a layer's directly owned parameters."""
    return {".".join(map(str, path)): np.asarray(v[...], np.float64)
            for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def rel_err(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / np.abs(expected).max())
