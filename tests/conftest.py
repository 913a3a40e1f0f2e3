"""Test configuration: fp32 CPU runs; k3jax is imported first so its XLA:CPU workaround applies."""
import k3jax  # noqa: F401  (sets XLA flags before JAX creates a backend)
