"""Decode cost vs context: per-token latency and memory-bank bytes, this model beside a same-width
model whose every layer is MLA.

The all-MLA model is the run's model config with ``mla_layers = all layers``, random weights:
decode cost does not depend on the weights. Neither model prefills the context. Instead the
memory bank is filled synthetically (`synthetic_memory`): a bank of capacity c (the context)
whose KDA states and conv tails are random and whose MLA caches hold c - warmup - timed random
latent rows (length set accordingly). Then, for one sequence, ``warmup_steps`` decode steps run
(the first compiles) and ``timed_steps`` more are timed, each feeding back its argmax token and
the donated bank; latency = their wall time / timed_steps. A decode step attends over the whole
cache buffer (masked past ``length``), so its cost is that of a bank holding c tokens.

Bank bytes per sequence come from the bank's shapes (`k3jax.memory.memory_bytes`). Seed s sets the
random fill and repeats the timing; the latency ratio's interval is over per-seed ratios.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.flops import decode_flops
from k3jax.memory import KDAMemory, Memory, MLAMemory, init_memory, memory_bytes
from k3jax.model import K3Model

from ..stats import t_interval
from .common import TaskOutput, canonical_json, sha256_text


def all_mla_config(config: ModelConfig) -> ModelConfig:
    """``config`` with every layer MLA (same width, heads, feed-forward and residual stream)."""
    return dataclasses.replace(config, mla_layers=tuple(range(config.num_layers)))


def synthetic_memory(config: ModelConfig, capacity: int, filled: int, key: jax.Array) -> Memory:
    """A one-sequence bank of ``capacity`` tokens whose states are random and whose MLA caches
    hold ``filled`` random rows, as if ``filled`` tokens had been prefilled."""
    empty = init_memory(config, 1, capacity)
    state_key, conv_key, latent_key = jax.random.split(key, 3)
    normal = lambda k, like: jax.random.normal(k, like.shape, jnp.float32).astype(like.dtype)  # noqa: E731
    written = jnp.arange(capacity)[None, None, :, None] < filled
    latent = jnp.where(written, normal(latent_key, empty.mla.latent), 0).astype(empty.mla.latent.dtype)
    return Memory(
        kda=KDAMemory(state=normal(state_key, empty.kda.state), conv=normal(conv_key, empty.kda.conv)),
        mla=MLAMemory(latent=latent, length=jnp.full_like(empty.mla.length, filled),
                      document_start=empty.mla.document_start),
    )


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _decode_step(graphdef, state, token, memory):
    """One decode step of one sequence: -> (greedy next token [1], updated bank)."""
    out = nnx.merge(graphdef, state)(token[:, None], memory=memory)
    return jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32), out.memory


def bank_bytes(config: ModelConfig, context: int) -> int:
    return sum(memory_bytes(config, context).values())


@dataclasses.dataclass(frozen=True)
class DecodeCostTask:
    """Decode latency and bank bytes at each context length, this model vs all-MLA."""

    name: ClassVar[str] = "decode_cost"
    context_lengths: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768)
    warmup_steps: int = 2
    timed_steps: int = 16

    def __post_init__(self):
        if self.warmup_steps < 1 or self.timed_steps < 1:
            raise ValueError(f"need warmup_steps >= 1 and timed_steps >= 1, got {self.warmup_steps}, {self.timed_steps}")
        if min(self.context_lengths) <= self.warmup_steps + self.timed_steps:
            raise ValueError(f"context lengths must exceed warmup_steps + timed_steps = "
                             f"{self.warmup_steps + self.timed_steps}, got {min(self.context_lengths)}")

    def _latency_ms(self, split_model, config: ModelConfig, context: int, seed: int, cost) -> float:
        """Mean milliseconds per decode step with a synthetically filled bank of ``context`` tokens."""
        graphdef, state = split_model
        filled = context - self.warmup_steps - self.timed_steps
        memory = synthetic_memory(config, context, filled, jax.random.key(seed))
        # committed like the step's outputs, so the warm-up compiles the one program the timed steps run
        memory, token = jax.device_put((memory, jnp.zeros((1,), jnp.int32)), jax.devices()[0])
        for _ in range(self.warmup_steps):
            token, memory = _decode_step(graphdef, state, token, memory)
        jax.block_until_ready(token)
        started = time.perf_counter()
        for _ in range(self.timed_steps):
            token, memory = _decode_step(graphdef, state, token, memory)
        jax.block_until_ready(token)
        elapsed = time.perf_counter() - started
        cost.add(self.warmup_steps + self.timed_steps, decode_flops(config, context).total)
        return 1e3 * elapsed / self.timed_steps

    def run(self, context, cost, progress) -> TaskOutput:
        k3_config = context.config.model
        mla_config = all_mla_config(k3_config)
        models = {"k3": (k3_config, nnx.split(context.model)),
                  "all_mla": (mla_config, nnx.split(K3Model(mla_config, rngs=nnx.Rngs(0))))}
        progress.reset(total=len(self.context_lengths) * len(context.seeds) * len(models))
        rows = []
        for length in self.context_lengths:
            latency = {name: [] for name in models}
            for seed in context.seeds:
                for name, (config, parts) in models.items():
                    latency[name].append(self._latency_ms(parts, config, length, seed, cost))
                    progress.update()
            k3_bytes, mla_bytes = bank_bytes(k3_config, length), bank_bytes(mla_config, length)
            rows.append({
                "context": length,
                "k3_latency_ms": t_interval(latency["k3"]),
                "all_mla_latency_ms": t_interval(latency["all_mla"]),
                "latency_ratio": t_interval([a / b for a, b in zip(latency["k3"], latency["all_mla"])]),
                "k3_bank_bytes": k3_bytes,
                "all_mla_bank_bytes": mla_bytes,
                "memory_ratio": k3_bytes / mla_bytes,
                "k3_decode_flops": decode_flops(k3_config, length).total,
                "all_mla_decode_flops": decode_flops(mla_config, length).total,
            })
        data = {"fill": "synthetic: random KDA states and conv tails, random MLA latent rows", "batch": 1,
                "k3_model": dataclasses.asdict(k3_config)}
        return TaskOutput(rows, sha256_text(canonical_json(data)))
