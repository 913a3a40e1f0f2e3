"""Autoregressive generation on the memory bank: one prefill, then one-token decode steps.

    model = K3Model(load_config("configs/tiny.yaml").model, rngs=nnx.Rngs(0))
    out = generate(model, prompt, max_new_tokens=64, temperature=0.8, top_p=0.9, seed=0, eos_id=2)
    out.tokens[b, :out.lengths[b]]                      # the new tokens of sequence b
    out = generate(model, [[5, 6, 7], [8, 9]], max_new_tokens=16)   # prompts of different lengths

Prompts are left-padded to a shared bucket length (the next power of two, at least 8), so that
prompts of any length reuse a few compiled programs. The padding is its own packed document
(segment id 0) and the prompt another (1): at the boundary the KDA state and convolution window
restart and MLA hides the padded slots, so each sequence continues exactly as if it were alone.

The whole loop is one jitted program (`lax.while_loop` over decode steps) that stops when every
sequence has produced ``eos_id`` or after ``max_new_tokens``; each step samples from the fp32
logits (`k3jax.sampling.sample_logits`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import SpeculationConfig
from k3jax.memory import init_memory, memory_bytes, memory_limit
from k3jax.model import K3Model, check_token_range
from k3jax.sampling import check_sampling, is_integer, sample_logits

MIN_PROMPT_BUCKET = 8


class Generation(NamedTuple):
    """tokens ``[B, max_new_tokens]`` (after a sequence's EOS: ``eos_id``, or 0 without one);
    lengths ``[B]``: new tokens per sequence, its EOS included."""

    tokens: jax.Array
    lengths: jax.Array


def check_bank_fits(config, sequences: int, length: int, what: str) -> None:
    """ValueError when a memory bank of ``sequences`` x ``length`` tokens could not fit on the device
    at all (checked from shapes, before anything is allocated)."""
    needed = sequences * sum(memory_bytes(config, length).values())
    limit = memory_limit()
    if needed > limit:
        raise ValueError(f"{what}: a memory bank of {sequences} sequence(s) x {length} tokens needs "
                         f"{needed / 2**30:.1f} GiB, more than the device holds ({limit / 2**30:.1f} GiB)")


def check_program_fits(compiled, what: str) -> None:
    """ValueError when a compiled program's buffers (arguments, outputs and temporaries, by XLA's
    memory analysis; aliased ones once) exceed the device's memory -- before it runs, so that a
    request too long for the device is one line instead of an out-of-memory failure. A backend
    without the analysis passes."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return
    needed = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes + analysis.temp_size_in_bytes
              - analysis.alias_size_in_bytes)
    limit = memory_limit()
    if needed > limit:
        raise ValueError(f"{what}: the generation needs {needed / 2**30:.1f} GiB of device memory, more than the "
                         f"device holds ({limit / 2**30:.1f} GiB)")


def prompt_bucket(length: int) -> int:
    """The padded length of a prompt of ``length`` tokens: the next power of two, at least 8."""
    return max(MIN_PROMPT_BUCKET, 1 << (length - 1).bit_length())


def pad_prompts(prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, segment_ids)`` ``[B, bucket]`` int32: each prompt right-aligned after padding
    (token 0, segment 0); the prompt's own tokens have segment id 1."""
    lengths = [len(prompt) for prompt in prompts]
    if not prompts or min(lengths) < 1:
        raise ValueError(f"need at least one prompt and every prompt at least 1 token long, got lengths {lengths}")
    width = prompt_bucket(max(lengths))
    tokens = np.zeros((len(prompts), width), np.int32)
    segments = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt):] = np.asarray(prompt, np.int64)
        segments[row, width - len(prompt):] = 1
    return tokens, segments


def _as_prompt_list(prompt_tokens) -> tuple[list[np.ndarray], bool]:
    """``(prompts, single)``: a ``[T]`` array (single), a ``[B, T]`` array or a list of token lists."""
    ragged = isinstance(prompt_tokens, (list, tuple)) and prompt_tokens and all(
        isinstance(p, (list, tuple, np.ndarray, jax.Array)) for p in prompt_tokens)
    if ragged:
        prompts = [np.asarray(p) for p in prompt_tokens]
        if any(p.ndim != 1 or p.size == 0 for p in prompts):
            raise ValueError(f"a list of prompts must hold 1-D token lists of at least 1 token each, got lengths "
                             f"{[p.size for p in prompts]}")
        return prompts, False
    array = np.asarray(prompt_tokens)
    if array.ndim not in (1, 2) or array.shape[-1] < 1:
        raise ValueError(f"prompt_tokens must have shape [T] or [B, T] with T >= 1 (or be a list of token lists), "
                         f"got {array.shape}")
    return (list(array) if array.ndim == 2 else [array]), array.ndim == 1


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens"))
def _generate(graphdef, state, prompt, segments, key, sampling, eos_id, *, max_new_tokens):
    model = nnx.merge(graphdef, state)
    batch, prompt_length = prompt.shape
    memory = init_memory(model.config, batch, prompt_length + max_new_tokens - 1)
    out = model(prompt, memory=memory, segment_ids=segments)
    fill = jnp.maximum(eos_id, 0)

    def emit(index, tokens, logits, done, key):
        """Sample token ``index`` of every unfinished sequence (``fill`` for finished ones)."""
        key, sample_key = jax.random.split(key)
        token = jnp.where(done, fill, sample_logits(logits, sample_key, *sampling))
        return token, tokens.at[:, index].set(token), done | (token == eos_id), key

    def step(carry):
        index, tokens, memory, logits, done, key = carry
        token, tokens, done, key = emit(index, tokens, logits, done, key)
        out = model(token[:, None], memory=memory)
        return index + 1, tokens, out.memory, out.logits[:, -1], done, key

    def running(carry):
        index, *_, done, _ = carry
        return (index < max_new_tokens - 1) & ~jnp.all(done)

    tokens = jnp.full((batch, max_new_tokens), fill, jnp.int32)
    done = jnp.zeros((batch,), bool)
    carry = (jnp.zeros((), jnp.int32), tokens, out.memory, out.logits[:, -1], done, key)
    index, tokens, _, logits, done, key = jax.lax.while_loop(running, step, carry)
    tokens = emit(index, tokens, logits, done, key)[1]      # the last token needs no forward pass
    is_eos = tokens == eos_id
    lengths = jnp.where(jnp.any(is_eos, axis=-1), jnp.argmax(is_eos, axis=-1) + 1, max_new_tokens)
    return Generation(tokens, lengths.astype(jnp.int32))


def generate(
    model: K3Model,
    prompt_tokens,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_id: int | None = None,
    speculation: SpeculationConfig | None = None,
    draft=None,
) -> Generation:
    """Continue ``prompt_tokens``: ``[T]``, ``[B, T]``, or a list of B token lists of any lengths
    >= 1 (ids in ``[0, vocab_size)``). Each sequence continues as if it were generated alone.

    The memory bank holds bucket + max_new_tokens - 1 tokens (`prompt_bucket`). Same arguments give
    the same tokens. Compiles once per model structure, batch size, prompt bucket and
    ``max_new_tokens``; the sampling settings, seed and EOS are runtime values. Bad arguments
    raise ValueError before anything runs.

    ``speculation`` (a `k3jax.config.SpeculationConfig` with a draft source; ``draft``: the model
    of its ``draft`` run, `k3jax.inference.load_draft`): speculative decoding over a session store
    instead (`speculative_generate`): greedy output is token for token the same; sampled output
    follows the same distribution with other random numbers.
    """
    prompts, squeeze = _as_prompt_list(prompt_tokens)
    if not all(np.issubdtype(p.dtype, np.integer) for p in prompts):
        raise ValueError("prompt tokens must be integer ids")
    for prompt in prompts:
        check_token_range(prompt, model.config.vocab_size)
    if eos_id is not None and not (is_integer(eos_id) and 0 <= eos_id < model.config.vocab_size):
        raise ValueError(f"eos_id must be an integer in [0, {model.config.vocab_size}), got {eos_id!r}")
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
    check_bank_fits(model.config, len(prompts), prompt_bucket(max(p.size for p in prompts)) + max_new_tokens - 1,
                    f"max_new_tokens={max_new_tokens}")
    if speculation is not None:
        result = speculative_generate(model, prompts, speculation, draft, max_new_tokens, temperature, top_k, top_p,
                                      seed, eos_id)
        return Generation(result.tokens[0], result.lengths[0]) if squeeze else result
    sampling = (jnp.float32(temperature), jnp.int32(top_k or 0), jnp.float32(1.0 if top_p is None else top_p))
    prompt, segments = pad_prompts(prompts)
    graphdef, state = nnx.split(model)
    arguments = (graphdef, state, prompt, segments, jax.random.key(seed), sampling, jnp.int32(-1 if eos_id is None else eos_id))
    check_program_fits(_generate.lower(*arguments, max_new_tokens=max_new_tokens).compile(),   # the call reuses it
                       f"max_new_tokens={max_new_tokens}")
    result = _generate(*arguments, max_new_tokens=max_new_tokens)
    return Generation(result.tokens[0], result.lengths[0]) if squeeze else result


def speculative_generate(model: K3Model, prompts: list[np.ndarray], speculation: SpeculationConfig, draft,
                         max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None, seed: int,
                         eos_id: int | None) -> Generation:
    """`generate` by speculative rounds: the prompts open sessions of a store of their own
    (`k3jax.sessions.speculate.Speculator`), all of them speculating together."""
    from k3jax.sessions import SessionStore, Speculator

    store = SessionStore(model, fingerprint="generate", prefix_cache=False)
    sids = [store.open(prompt.astype(np.int32)) for prompt in prompts]
    outputs = store.generate(sids, max_new_tokens, temperature, top_k, top_p, seed, eos_id,
                             speculator=Speculator.of(store, speculation, draft))
    tokens = np.full((len(prompts), max_new_tokens), max(eos_id or 0, 0), np.int32)
    for row, output in enumerate(outputs):
        tokens[row, : output.size] = output
    return Generation(jnp.asarray(tokens), jnp.asarray([output.size for output in outputs], jnp.int32))
