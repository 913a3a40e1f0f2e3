"""Bad input at the Python API is a clear ValueError before anything runs (outside jit); inside
jit, where values cannot be checked, it gives NaN, never plausible numbers. Generation takes
prompts of different lengths, each continued exactly as alone, with few compiles."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.inference import generation
from k3jax.inference.generation import generate, prompt_bucket
from k3jax.memory import init_memory
from k3jax.model import K3Model
from tests.test_model import continue_, micro_config

VOCAB = 256


@pytest.fixture(scope="module")
def model():
    return K3Model(micro_config(f"model.vocab_size={VOCAB}"), rngs=nnx.Rngs(0))


def _bank(model, batch=2, length=8):
    return init_memory(model.config, batch, length)


def _bad_model_calls(model):
    tokens = jnp.ones((2, 4), jnp.int32)
    other = micro_config(f"model.vocab_size={VOCAB}", "model.kda.head_dim=8")
    full = continue_(model, tokens, _bank(model, length=6)).memory           # 4 of 6 slots used
    return {
        "id >= vocab": (lambda: model(tokens.at[0, 1].set(VOCAB)), r"token ids must be in \[0, 256\).*to 256"),
        "id -1": (lambda: model(tokens.at[1, 0].set(-1)), r"token ids must be in \[0, 256\).*from -1"),
        "float tokens": (lambda: model(tokens.astype(jnp.float32)), "integer ids"),
        "bank of another config": (lambda: model(tokens, memory=init_memory(other, 2, 8)),
                                   r"memory.kda.state is float32\[.*a bank from another config"),
        "bank of another batch": (lambda: model(tokens, memory=_bank(model, batch=3)), "another config or batch"),
        "not a bank": (lambda: model(tokens, memory={"kda": 1}), "must be a k3jax.memory.Memory"),
        "bank full": (lambda: model(tokens, memory=full), "holds 6 tokens per sequence; 4 are used and 4 more"),
    }


@pytest.mark.parametrize("case", ["id >= vocab", "id -1", "float tokens", "bank of another config",
                                  "bank of another batch", "not a bank", "bank full"])
def test_bad_model_input_is_a_clear_value_error(case, model):
    call, message = _bad_model_calls(model)[case]
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.slow   # 15-60 s of the default set's CPU: in .ci/run's slow set
def test_inside_jit_out_of_range_ids_and_an_overflowing_bank_give_nan_not_numbers(model):
    tokens = jnp.ones((2, 4), jnp.int32)
    out = continue_(model, tokens.at[0, 2].set(VOCAB + 5), _bank(model))
    logits = np.asarray(out.logits)
    assert np.isnan(logits[0, 2:]).all() and np.isfinite(logits[1]).all()    # the bad row only (NaN may reach
                                                                             # earlier slots through attention)
    memory = continue_(model, tokens, _bank(model, length=6)).memory          # 4 of 6 slots
    step = continue_(model, tokens[:, :2], memory)                            # fills the bank exactly
    assert np.isfinite(np.asarray(step.logits)).all()
    over = continue_(model, tokens[:, :1], step.memory)                       # one token too many
    assert np.isnan(np.asarray(over.logits)).all()


def _bad_generate_calls(model):
    prompt = [3, 4, 5]
    return {
        "id >= vocab": (lambda: generate(model, [3, VOCAB], max_new_tokens=2), r"in \[0, 256\)"),
        "negative id in a ragged batch": (lambda: generate(model, [[3, 4], [-2]], max_new_tokens=2), "from -2"),
        "empty prompt": (lambda: generate(model, [[3, 4], []], max_new_tokens=2), "at least 1 token"),
        "3-D prompt": (lambda: generate(model, np.ones((1, 2, 3), np.int32), max_new_tokens=2), r"\[T\] or \[B, T\]"),
        "eos out of range": (lambda: generate(model, prompt, max_new_tokens=2, eos_id=VOCAB), "eos_id"),
        "max_new_tokens 0": (lambda: generate(model, prompt, max_new_tokens=0), "max_new_tokens"),
        "negative temperature": (lambda: generate(model, prompt, max_new_tokens=2, temperature=-1), "temperature"),
        "top_p 0": (lambda: generate(model, prompt, max_new_tokens=2, top_p=0.0), "top_p"),
        "float tokens": (lambda: generate(model, [1.5, 2.0], max_new_tokens=2), "integer ids"),
        "fractional max_new_tokens": (lambda: generate(model, prompt, max_new_tokens=2.5), "max_new_tokens"),
        "NaN temperature": (lambda: generate(model, prompt, max_new_tokens=2, temperature=float("nan")), "temperature"),
        "text temperature": (lambda: generate(model, prompt, max_new_tokens=2, temperature="hot"), "temperature"),
        "fractional top_k": (lambda: generate(model, prompt, max_new_tokens=2, top_k=1.5), "top_k"),
        "text seed": (lambda: generate(model, prompt, max_new_tokens=2, seed="a"), "seed"),
        "a bank larger than the device": (lambda: generate(model, prompt, max_new_tokens=2**40), "more than the device"),
    }


@pytest.mark.parametrize("case", ["id >= vocab", "negative id in a ragged batch", "empty prompt", "3-D prompt",
                                  "eos out of range", "max_new_tokens 0", "negative temperature", "top_p 0",
                                  "float tokens", "fractional max_new_tokens", "NaN temperature", "text temperature",
                                  "fractional top_k", "text seed", "a bank larger than the device"])
def test_bad_generate_input_is_a_clear_value_error(case, model):
    call, message = _bad_generate_calls(model)[case]
    with pytest.raises(ValueError, match=message):
        call()


def greedy_alone(model, prompt, steps, capacity):
    """The reference: prefill the unpadded prompt into a bank of its own (``capacity`` tokens, the
    same for every prompt so the decode step compiles once), then argmax decode steps."""
    out = continue_(model, jnp.asarray([prompt], jnp.int32), init_memory(model.config, 1, capacity))
    tokens = []
    for _ in range(steps):
        tokens.append(int(jnp.argmax(out.logits[0, -1])))
        out = continue_(model, jnp.asarray([[tokens[-1]]], jnp.int32), out.memory)
    return tokens


@pytest.mark.slow   # 15-60 s of the default set's CPU: in .ci/run's slow set
def test_ragged_prompts_continue_each_as_if_alone(model):
    prompts = [[7, 8, 9, 10, 11], [12], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]   # buckets to 16
    steps = 3
    batch = generate(model, prompts, max_new_tokens=steps)
    assert batch.tokens.shape == (3, steps)
    capacity = max(map(len, prompts)) + steps
    for row, prompt in enumerate(prompts):
        assert np.asarray(batch.tokens[row]).tolist() == greedy_alone(model, prompt, steps, capacity), row


@pytest.mark.slow   # 15-60 s of the default set's CPU: in .ci/run's slow set
def test_prompt_lengths_are_bucketed_so_few_programs_compile(model):
    assert [prompt_bucket(n) for n in (1, 8, 9, 16, 17, 100)] == [8, 8, 16, 16, 32, 128]
    lengths = np.random.default_rng(0).integers(1, 31, size=20)
    before = generation._generate._cache_size()
    for length in lengths:
        out = generate(model, list(range(1, int(length) + 1)), max_new_tokens=2)
        assert out.tokens.shape == (2,)
    compiles = generation._generate._cache_size() - before
    assert compiles <= len({prompt_bucket(int(n)) for n in lengths}) <= 3, compiles
