"""What an evaluation costs: wall seconds, tokens through the model and estimated FLOPs (counted by
`k3jax.flops`: ``forward_flops(config, T).total`` per token of a full pass over T tokens,
``decode_flops(config, c).total`` per decode token at context c)."""
from __future__ import annotations

import dataclasses


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
