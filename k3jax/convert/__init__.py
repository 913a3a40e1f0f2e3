"""Conversion between Hugging Face checkpoints (Kimi K3, Kimi Linear) and k3jax runs.

`k3jax.convert.hf_config`: ``config.json`` <-> `k3jax.config.ModelConfig`.
`k3jax.convert.keymap`: HF tensor names <-> regions of k3jax parameters (SPEC §7).
`k3jax.convert.mxfp4`: the routed experts' MXFP4 codec.
`k3jax.convert.safetensors_io`, `k3jax.convert.orbax_stream`: tensor-at-a-time reading and writing.
`k3jax.convert.importer` / `exporter` / `cli`: ``python -m k3jax.convert import|export ...``.
`k3jax.convert.peft`: a LoRA run's adapters as a PEFT LoRA adapter and back (``export --adapter``, ``import-adapter``).
"""
