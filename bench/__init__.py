"""Benchmarks (``python -m bench.<name>`` from the repository root; not installed with k3jax)."""
