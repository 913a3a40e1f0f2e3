"""FLOP counts of a K3 model, the one home for them: per token, by part, 2 FLOPs per multiply-add.

    forward_flops(config, T)    a full-sequence pass over T tokens (training, prefill, scoring)
    training_flops(config, T)   3 x the forward: the backward takes two products per forward
                                product, one for the inputs' gradient and one for the weights'
    decode_flops(config, c)     one decode token with c tokens already in the memory bank

Each returns a `FlopsPerToken` (``.total``, or a part by name). The parts:

    weights    2 * active parameters: every projection (KDA, MLA with its LoRA factors, the dense
               FFN, the shared experts, the router, the latent down / up projections of LatentMoE
               and the routed experts at top_k / num_experts of their size), the conv taps, the
               norm gains and the LM head; the input embedding is a lookup (excluded unless tied)
    mla        per MLA layer. Forward: 2 H (qk_head_dim + value_head_dim) (T + 1) / 2, the scores
               and the weighted values over the causal context, (T + 1) / 2 keys on average.
               Decode, absorbed form: 2 H (2 kv_lora + r) c, the scores against the cached
               [c~ | k_r] and the mix of c~
    kda        per KDA layer. Forward: the chunk algorithm (`chunk_algorithm_flops`) with the state
               passed every `block_width` tokens as this implementation does, / T. Decode:
               8 HV K V (the decay, S^T k, the rank-1 write, the read)
    attn_res   6 d per source of every AttnRes Mix: each source's RMS and score (4 d) and the
               weighted sum (2 d); the same in both modes

Not counted: softmax, activations, gates and other elementwise work (a few FLOPs per element),
the loss. An implementation that computes more (every expert on every token with
``expert_matmul: dense``, the full T x T square of dense attention, the masked halves of the chunk
form's C x C products) executes more than this model count.

The trainer's utilisation divides ``training_flops(...).total`` x tokens/s by a peak:
``logging.peak_tflops`` or `measured_peak_flops`.
"""
from __future__ import annotations

import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.model import param_counts
from k3jax.ops.kda.chunk import block_width, chunk_algorithm_flops, effective_chunk_size


class FlopsPerToken(NamedTuple):
    """FLOPs per token, by part (see the module docstring)."""

    weights: float
    mla: float
    kda: float
    attn_res: float

    @property
    def total(self) -> float:
        return sum(self)

    def scaled(self, factor: float) -> FlopsPerToken:
        return FlopsPerToken(*(factor * part for part in self))


@functools.lru_cache(maxsize=16)
def active_parameters(config: ModelConfig) -> int:
    """`k3jax.model.param_counts`' active count, cached per (frozen, hashable) config."""
    return param_counts(config)[1]


def attn_res_mix_sources(config: ModelConfig) -> list[int]:
    """The number of sources of every AttnRes Mix one forward computes (SPEC §3): the attention
    Mix of each layer after the first, the FFN Mix of each layer and the output Mix; each reads
    the closed blocks so far plus the partial sum. Empty for ``attn_res: none``."""
    if config.attn_res.kind != "block":
        return []
    size, mixes, blocks = config.attn_res.block_size, [], 0
    for layer in range(config.num_layers):
        if blocks:
            mixes.append(blocks + 1)        # the mixer's input (layer 0 has no closed block yet)
        blocks += layer % size == 0         # p is appended as a source when a block starts
        mixes.append(blocks + 1)            # the FFN's input
    return mixes + [blocks + 1]             # the head's input


def _attn_res(config: ModelConfig) -> float:
    return 6.0 * config.d_model * sum(attn_res_mix_sources(config))


def forward_flops(config: ModelConfig, seq_len: int) -> FlopsPerToken:
    """Forward FLOPs per token over sequences of ``seq_len`` tokens."""
    mla, kda = config.mla, config.kda
    num_mla = len(config.mla_layer_indices)
    chunk = block_width(effective_chunk_size(seq_len, kda.chunk_size))
    delta_rule = chunk_algorithm_flops(1, seq_len, kda.num_value_heads, kda.head_dim, kda.head_dim, chunk) / seq_len
    return FlopsPerToken(
        weights=2.0 * active_parameters(config),
        mla=num_mla * 2.0 * mla.num_heads * (mla.qk_head_dim + mla.value_head_dim) * (seq_len + 1) / 2,
        kda=(config.num_layers - num_mla) * delta_rule,
        attn_res=_attn_res(config))


def training_flops(config: ModelConfig, seq_len: int) -> FlopsPerToken:
    """Training FLOPs per token: 3 x `forward_flops`."""
    return forward_flops(config, seq_len).scaled(3.0)


def decode_flops(config: ModelConfig, context: int) -> FlopsPerToken:
    """FLOPs of one decode token with ``context`` tokens in the memory bank."""
    mla, kda = config.mla, config.kda
    num_mla = len(config.mla_layer_indices)
    return FlopsPerToken(
        weights=2.0 * active_parameters(config),
        mla=num_mla * 2.0 * mla.num_heads * (2 * mla.kv_lora_rank + mla.rope_head_dim) * context,
        kda=(config.num_layers - num_mla) * 8.0 * kda.num_value_heads * kda.head_dim * kda.head_dim,
        attn_res=_attn_res(config))


def measured_peak_flops(dtype: str) -> float:
    """An attainable peak FLOP rate: the best of three 2048^3 matmuls in ``dtype`` on the default device."""
    a = jnp.ones((2048, 2048), dtype)
    matmul = jax.jit(lambda x: x @ x)
    jax.block_until_ready(matmul(a))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(matmul(a))
        best = min(best, time.perf_counter() - start)
    return 2 * 2048**3 / best
