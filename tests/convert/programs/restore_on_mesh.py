"""Restore an imported run's parameters onto the mesh its config names (run with 8 fake CPU
devices): ``python -m tests.convert.programs.restore_on_mesh RUN_DIR OUT.npz``. Writes the
restored values and prints one JSON line: device count, how many arrays are split over devices."""
import json
import sys

import jax
import numpy as np

from k3jax.checkpoint import restore_subtree
from k3jax.config import load_config
from k3jax.sharding.mesh import make_mesh, named_shardings
from k3jax.training import abstract_model


def main(run_dir: str, out: str) -> None:
    config = load_config(f"{run_dir}/config.yaml")
    mesh = make_mesh(config.mesh)
    parts, params, _ = abstract_model(config.model, mesh, config.mesh)
    shardings = named_shardings(parts.params.axes(), params, config.mesh.rules, mesh)
    abstract = {key: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings[key]) for key, a in params.items()}
    restored, _ = restore_subtree(run_dir, "params", abstract)     # verified against the checksums
    split = sum(not a.sharding.is_fully_replicated and a.sharding == shardings[key] for key, a in restored.items())
    np.savez(out, **{key.replace("/", "|"): np.asarray(a) for key, a in restored.items()})
    print(json.dumps({"devices": jax.device_count(), "split_arrays": split, "arrays": len(restored)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
