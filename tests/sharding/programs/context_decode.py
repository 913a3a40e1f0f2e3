"""Prefill with the sequence split over a `context` mesh axis, then decode, against one device.

The micro K3 is `parallelize`d for mesh.context = 2 and 4; a packed prompt batch (a document
boundary inside a shard and one exactly at the middle, a boundary of both splits) is prefilled
into a fresh memory bank with the tokens laid out [rows, sequence over context]. The bank it
returns -- KDA states, conv tails, MLA latent caches, lengths and document starts -- is compared
with a one-device prefill's, then both decode the same greedy continuation (the one-device
model's choices) step by step, and the logits are compared at every step. Prints, per mesh, the
largest relative error of each bank part and of the prefill and decode logits, and whether the
integer bookkeeping is identical.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.memory import init_memory
from k3jax.model import K3Model
from k3jax.sharding import batch_sharding, make_mesh, named_shardings, parallelize
from k3jax.training import split_model
from tests.helpers import relative_error
from tests.sharding.programs.common import emit, mesh_config, small_k3_config

PROMPT, ROWS, NEW_TOKENS = 64, 2, 6
OVERRIDES = ("model.kda.chunk_size=16", "model.mla.attention_block_size=16")


def prompt_batch(vocab: int):
    """Two rows: documents of 21 + 43 tokens (the boundary inside a shard) and 32 + 32 (at the
    middle); tokens [ROWS, PROMPT] int32 and segment ids."""
    segments = np.stack([np.repeat([1, 2], [21, 43]), np.repeat([1, 2], [32, 32])]).astype(np.int32)
    tokens = np.asarray(jax.random.randint(jax.random.key(3), (ROWS, PROMPT), 0, vocab), np.int32)
    return tokens, segments


@jax.jit
def prefill(model, tokens, segments, memory):
    out = model(tokens, memory=memory, segment_ids=segments)
    return out.logits, out.memory


@jax.jit
def decode(model, token, memory):
    out = model(token[:, None], memory=memory)
    return out.logits[:, -1], out.memory


def bank_errors(bank, reference) -> dict:
    """Relative error of each float part of the bank; whether the int32 bookkeeping is identical."""
    bank, reference = jax.device_get((bank, reference))
    return {"kda_state": relative_error(bank.kda.state, reference.kda.state),
            "kda_conv": relative_error(bank.kda.conv, reference.kda.conv),
            "mla_latent": relative_error(bank.mla.latent, reference.mla.latent),
            "bookkeeping_equal": bool(np.array_equal(bank.mla.length, reference.mla.length)
                                      and np.array_equal(bank.mla.document_start, reference.mla.document_start))}


def main():
    config = small_k3_config(*OVERRIDES)
    model = K3Model(config.model, rngs=nnx.Rngs(0))
    tokens, segments = prompt_batch(config.model.vocab_size)
    empty = init_memory(config.model, ROWS, PROMPT + NEW_TOKENS)
    logits, bank = prefill(model, tokens, segments, empty)
    choices, step_logits, memory = [], [], bank
    token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    for _ in range(NEW_TOKENS):
        choices.append(token)
        next_logits, memory = decode(model, token, memory)
        step_logits.append(next_logits)
        token = jnp.argmax(next_logits, axis=-1).astype(jnp.int32)

    parts, params, buffers = split_model(model)
    results = {}
    for contexts in (2, 4):
        mesh_cfg = mesh_config(context=contexts)
        mesh = make_mesh(mesh_cfg, jax.devices()[:contexts])
        placed = parts.merge(jax.device_put(params, named_shardings(parts.params.axes(), params, mesh_cfg.rules, mesh)),
                             jax.device_put(buffers, named_shardings(parts.buffers.axes(), buffers, mesh_cfg.rules, mesh)))
        parallel = parallelize(placed, mesh, mesh_cfg)
        layout = batch_sharding(mesh, mesh_cfg.rules)
        mesh_logits, mesh_bank = prefill(parallel, jax.device_put(tokens, layout), jax.device_put(segments, layout),
                                         empty)
        errors = bank_errors(mesh_bank, bank)
        errors["prefill_logits"] = relative_error(jax.device_get(mesh_logits), jax.device_get(logits))
        errors["sequence_split"] = "context" in str(layout.spec)
        memory, decode_errors = mesh_bank, []
        for token, want in zip(choices, step_logits):
            got, memory = decode(parallel, token, memory)
            decode_errors.append(relative_error(jax.device_get(got), jax.device_get(want)))
        errors["decode_logits"] = max(decode_errors)
        results[f"context={contexts}"] = errors
        print(contexts, errors, file=sys.stderr, flush=True)
    emit(results)


if __name__ == "__main__":
    main()
