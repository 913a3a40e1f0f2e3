"""A 2-layer tiny K3 (1 KDA + 1 MLA layer, vocab 64, KDA chunk and MLA page of 16 tokens) shared by
the session tests, and the contiguous-bank reference they compare with."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import load_config
from k3jax.memory import init_memory
from k3jax.model import K3Model
from tests.helpers import CONFIGS

TINY = ["model.num_layers=2", "model.mla_period=2", "model.attn_res.block_size=2", "model.vocab_size=64",
        "model.kda.chunk_size=16"]


def tiny_config(*overrides):
    return load_config(CONFIGS / "tiny.yaml", TINY + list(overrides)).model


def tiny_model(seed: int = 0) -> K3Model:
    return K3Model(tiny_config(), rngs=nnx.Rngs(seed))


_forward = nnx.jit(lambda model, tokens, memory: model(tokens, memory=memory))


def contiguous_logits(model, tokens, capacity: int = 64) -> np.ndarray:
    """``[T, vocab]``: one prefill of ``tokens`` over an empty contiguous bank (`k3jax.memory`). The
    prefill runs over ``tokens`` padded to the bank's capacity -- by causality the first T logits are
    those of ``tokens`` alone -- so one compiled program serves every length of a capacity."""
    padded = np.zeros(capacity, np.int32)
    padded[: len(tokens)] = tokens
    out = _forward(model, jnp.asarray(padded)[None], init_memory(model.config, 1, capacity))
    return np.asarray(out.logits[0, : len(tokens)])


def contiguous_bank(model, tokens, capacity: int = 64):
    out = _forward(model, jnp.asarray(tokens, jnp.int32)[None], init_memory(model.config, 1, capacity))
    return out.memory


@pytest.fixture(scope="session")
def model():
    return tiny_model()


def random_tokens(seed: int, length: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 64, length).astype(np.int32)
