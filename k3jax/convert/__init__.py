"""Conversion between Hugging Face checkpoints (Kimi K3, Kimi Linear) and k3jax runs.

`k3jax.convert.hf_config`: ``config.json`` <-> `k3jax.config.ModelConfig`.
"""
