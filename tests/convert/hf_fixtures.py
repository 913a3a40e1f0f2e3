"""Tiny Hugging Face checkpoints in the release format (SPEC §7), written by the tests.

Tensors get random values at sensible scales (bf16 unless noted); the K3-shaped checkpoint
stores its routed experts as MXFP4 (random codes and E8M0 scales, as compressed-tensors packs
them), a zero-padded ``A_log``, and a few vision-tower tensors; the Kimi-Linear-shaped one is bf16
with fp32 ``A_log`` [1, 1, H, 1] / ``dt_bias`` and ships a tokenizer (``tiktoken.model`` with the
256 single bytes and a few merges, plus ``tokenizer_config.json``).
"""
import base64
import json
import pathlib

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from k3jax.convert.hf_config import checkpoint_flavour, model_config_from_hf
from k3jax.convert.keymap import model_maps, mxfp4_names

BF16 = ml_dtypes.bfloat16
VISION = {"vision_tower.patch_embed.proj.weight": (8, 3), "vision_tower.encoder.blocks.0.wqkv.weight": (6, 2),
          "mm_projector.proj.0.weight": (4, 8)}     # release names (tests/convert/release_names.py)


def _value(rng, name, shape, spec):
    """Random values for one tensor, by what it is."""
    leaf = spec.key.rsplit("/", 1)[-1]
    if leaf == "A_log":
        return np.log(rng.uniform(1, 16, shape))
    if leaf == "dt_bias":
        return rng.normal(0, 0.5, shape)
    if leaf in ("query",):
        return rng.normal(0, 0.5, shape)
    if leaf.endswith("norm") or leaf in ("key_norm", "latent_norm_weight", "input_norm", "post_attention_norm", "final_norm"):
        return 1 + rng.normal(0, 0.1, shape)
    if leaf.endswith("_conv"):
        return rng.uniform(-0.5, 0.5, shape)
    if leaf == "e_score_correction_bias":
        return rng.normal(0, 0.05, shape)
    if leaf == "embedding":
        return rng.normal(0, 1, shape)
    return rng.normal(0, 1, shape) / np.sqrt(shape[-1])     # [out, in]: unit-variance outputs


def hf_tensors(hf: dict, *, seed: int = 0, mxfp4: bool = False, padded_a_log: int | None = None,
               float32=("A_log", "dt_bias")) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint for ``hf`` (config.json dict) by its HF name."""
    rng = np.random.default_rng(seed)
    model, _ = model_config_from_hf(hf)
    tensors = {}
    for spec in model_maps(model, checkpoint_flavour(hf)):
        if spec.key == "lm_head" and model.tie_embeddings:
            continue
        if spec.expert and mxfp4:
            out, inputs = spec.hf_shape
            packed, scale = mxfp4_names(spec.hf_name)
            tensors[packed] = rng.integers(0, 256, (out, inputs // 2), dtype=np.uint8)
            tensors[scale] = rng.integers(122, 126, (out, inputs // 32), dtype=np.uint8)
            continue
        shape = spec.hf_shape
        value = _value(rng, spec.hf_name, shape, spec)
        if spec.layout == "narrow" and padded_a_log:
            value = np.concatenate([value.reshape(-1), np.zeros(padded_a_log - value.size)])
        leaf = spec.key.rsplit("/", 1)[-1]
        tensors[spec.hf_name] = value.astype(np.float32 if leaf in float32 or leaf == "e_score_correction_bias" else BF16)
    return tensors


def write_checkpoint(directory: pathlib.Path, hf: dict, tensors: dict[str, np.ndarray], *, shards: int = 3) -> pathlib.Path:
    """config.json, ``shards`` safetensors files and their index."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf, indent=1))
    names = list(tensors)
    per_shard = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        part = names[i * per_shard:(i + 1) * per_shard]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({name: tensors[name] for name in part}, directory / file)
        weight_map.update({name: file for name in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def write_tokenizer(directory: pathlib.Path) -> None:
    """A byte-level BPE of 256 single bytes plus merges of " t", "he" and " the"; specials named by
    a tokenizer_config.json ([BOS], [EOS], <|im_end|>; EOS is <|im_end|>)."""
    tokens = [bytes([b]) for b in range(256)] + [b" t", b"he", b" the"]
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(tokens)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(n): {"content": "[BOS]", "special": True},
                                 str(n + 1): {"content": "[EOS]", "special": True},
                                 str(n + 2): {"content": "<|im_end|>", "special": True}},
        "bos_token": "[BOS]", "eos_token": {"content": "<|im_end|>"}}))
