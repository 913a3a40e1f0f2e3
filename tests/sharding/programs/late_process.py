"""One of two processes reaches a program's first run ``LATE_S`` seconds after the other, as a
slow compile on a loaded host makes it: a sum over all 8 devices of both processes, run through
`k3jax.sharding.compiled_together` (``--together``) or called directly. Prints the sum as JSON.

    python -m tests.sharding.programs.late_process ADDRESS PROCESS_ID [--together]
"""
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.sharding import compiled_together, initialize_distributed

LATE_S = 45.0   # later than gloo's 30 s rendezvous deadline


def main(address: str, process_id: int, together: bool) -> None:
    initialize_distributed(address, 2, process_id)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    local = np.full((jax.local_device_count(),), process_id + 1.0, np.float32)
    values = jax.make_array_from_process_local_data(sharding, local)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))
    if together:
        total = compiled_together(total, "late-process sum")
    if process_id == 1:
        time.sleep(LATE_S)
    print(json.dumps({"sum": float(total(values))}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), "--together" in sys.argv[3:])
