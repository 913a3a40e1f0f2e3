"""What an evaluation costs: wall seconds, tokens through the model and estimated FLOPs.

FLOPs count 2 per multiply-add, as `k3jax.training.training_flops_per_token` does:

    forward over T tokens, per token   = training_flops_per_token(config, T) / 3
                                         (that estimate is 3 x the forward in every term)
    one decode token at context c      = 2 * active parameters
                                         + per MLA layer, absorbed form: 2 H (2 kv_lora + r) c
                                           (scores against the cached [c~ | k_r], mix of c~)
                                         + per KDA layer: 8 HV K V (decay, S^T k, the rank-1
                                           write, the read)
"""
from __future__ import annotations

import dataclasses

from k3jax.config import ModelConfig
from k3jax.training import active_parameters, training_flops_per_token


def forward_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Estimated forward FLOPs per token of a full-sequence pass over ``seq_len`` tokens."""
    return training_flops_per_token(config, seq_len) / 3


def decode_flops_per_token(config: ModelConfig, context: int) -> float:
    """Estimated FLOPs of one decode step with ``context`` tokens in the memory bank."""
    active = active_parameters(config)
    mla, kda = config.mla, config.kda
    num_mla = len(config.mla_layer_indices)
    attention = 2 * mla.num_heads * (2 * mla.kv_lora_rank + mla.rope_head_dim) * context
    delta_rule = 8 * kda.num_value_heads * kda.head_dim * kda.head_dim
    return 2 * active + num_mla * attention + (config.num_layers - num_mla) * delta_rule


@dataclasses.dataclass
class Cost:
    """A running total of one task's cost (wall time is set by whoever runs the task)."""

    wall_seconds: float = 0.0
    tokens: int = 0
    flops: float = 0.0

    def add(self, tokens: int, flops_per_token: float) -> None:
        self.tokens += int(tokens)
        self.flops += tokens * flops_per_token

    def to_json(self) -> dict:
        return {"wall_seconds": self.wall_seconds, "tokens": self.tokens, "estimated_flops": self.flops}
