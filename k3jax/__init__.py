"""k3jax: the Kimi K3 architecture in JAX/Flax."""
import os
from importlib import metadata


def _avoid_xla_cpu_reduce_fusion_crash() -> None:
    """jaxlib 0.10's XLA:CPU segfaults executing some YNNPACK reduce fusions (seen in the KDA
    chunk backward under jit). Turn that fusion type off unless the user already chose YNN
    fusions; it must happen before JAX creates its CPU backend, hence at import."""
    try:
        affected = metadata.version("jaxlib").startswith("0.10.")
    except metadata.PackageNotFoundError:
        affected = False
    flags = os.environ.get("XLA_FLAGS", "")
    if affected and "xla_cpu_experimental_ynn_fusion_type" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_experimental_ynn_fusion_type=-LIBRARY_FUSION_TYPE_REDUCE".strip()


_avoid_xla_cpu_reduce_fusion_crash()

__version__ = "0.1.0"
