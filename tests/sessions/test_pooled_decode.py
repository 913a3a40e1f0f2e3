"""The batched decode over the pools (`paged.decode_step`, the kernels of the model's
``kda.implementation``) against the baseline step that gathers the contiguous bank, decodes with
the "reference" implementation and scatters back: sessions of different lengths in non-contiguous
slots and pages of random pools, a 6-layer model whose depth scan runs twice (KDA layers before
and inside the scanned body), the XLA forms and both Pallas kernel families in interpret mode;
and the store's generate on either path."""
import contextlib
import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.model import K3Model, layer_groups
from k3jax.ops.kda.pallas import forced_kernels
from k3jax.sessions import SessionStore, paged
from tests.sessions.conftest import random_tokens, tiny_config

# Slow: each compiles the 6-layer model's decode twice (the store tests run the pooled step by default).
pytestmark = pytest.mark.slow
# (model.kda.implementation, Pallas family forced in interpret mode or None)
KERNELS = {"chunk": ("chunk", None), "pallas-gpu": ("pallas", "gpu"), "pallas-tpu": ("pallas", "tpu")}
SLOTS, PAGES, PAGE = 6, 8, 16
LENGTHS = [5, 17, 33, 0]                                   # the last row pads the batch of 4


@functools.cache
def deep_model(implementation: str) -> K3Model:
    """The same 6-layer model (same seed, so the same parameters) with ``implementation``."""
    model = K3Model(tiny_config("model.num_layers=6", f"model.kda.implementation={implementation}"),
                    rngs=nnx.Rngs(1))
    assert layer_groups(model.config).repeats == 2
    return model


def random_step(config, seed=0):
    """Random pools and one step's inputs: sessions in slots 4, 0, 2 (slot 5 pads the batch) whose
    pages are scattered over the pool; page id PAGES marks the end of a table."""
    rng = np.random.default_rng(seed)
    shapes = paged.empty_pools(config, SLOTS, PAGES, PAGE)
    pools = paged.Pools(*(jnp.asarray(0.5 * rng.standard_normal(a.shape), a.dtype) for a in shapes))
    tables = np.full((4, 4), PAGES, np.int32)
    tables[0, :1], tables[1, :2], tables[2, :3] = [6], [3, 1], [0, 7, 2]
    logits = rng.standard_normal((4, config.vocab_size)).astype(np.float32)
    inputs = (jnp.asarray([4, 0, 2, 5], jnp.int32), jnp.asarray(tables), jnp.asarray(LENGTHS, jnp.int32),
              jnp.asarray(logits), paged.RowSampling(jnp.zeros(4, jnp.uint32), jnp.arange(4, dtype=jnp.uint32),
                                                     jnp.zeros(4), jnp.zeros(4, jnp.int32), jnp.ones(4)))
    return pools, inputs


def run_step(model, params, pools, inputs, gathered):
    """``model``'s decode step (its kda.implementation) with the parameters ``params``."""
    copy = paged.Pools(*(jnp.array(a) for a in pools))     # the step donates its pools
    return paged.decode_step(paged.StaticGraph(nnx.split(model)[0]), params, copy, *inputs, gathered=gathered)


@pytest.mark.parametrize("kernels", KERNELS)
def test_pooled_step_equals_the_gather_decode_scatter_step(kernels):
    implementation, backend = KERNELS[kernels]
    model = deep_model(implementation)
    params = nnx.split(model)[1]
    pools, inputs = random_step(model.config)
    tokens_ref, logits_ref, pools_ref = run_step(deep_model("reference"), params, pools, inputs, True)
    with contextlib.nullcontext() if backend is None else forced_kernels(backend):
        tokens, logits, new_pools = run_step(model, params, pools, inputs, False)
    np.testing.assert_array_equal(tokens, tokens_ref)
    np.testing.assert_allclose(logits[:3], logits_ref[:3], rtol=1e-6, atol=1e-6)
    # Slot 5 is the padding row's, garbage by design (`paged`): its latent row is dropped, which the
    # gathered bank still attends to and the pages read in place do not, so its states differ.
    kept = [0, 1, 2, 3, 4]
    for name, got, want, before in zip(paged.Pools._fields, new_pools, pools_ref, pools):
        got, want, before = (np.asarray(a)[kept] if name != "latent" else a for a in (got, want, before))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=name)
        assert not np.array_equal(got, before), f"the step wrote nothing into the {name} pool"
    untouched = [1, 3]                                     # slots of no row of the batch
    np.testing.assert_array_equal(np.asarray(new_pools.state)[untouched], np.asarray(pools.state)[untouched])


def test_generate_is_the_same_on_either_decode_path(model):
    store = SessionStore(model)
    sids = [store.open(random_tokens(seed, length)) for seed, length in enumerate((5, 3, 9))]
    store.close(sids[1])
    sids = [sids[0], sids[2], store.open(random_tokens(7, 2))]
    handles = [store.snapshot(sid) for sid in sids]
    outputs = []
    for gathered in (True, False):
        for sid, handle in zip(sids, handles):
            store.rollback(sid, handle)
        store.feeder.gathered_decode = gathered
        outputs.append((store.generate(sids, 3), np.stack([store.logits(sid) for sid in sids])))
    (new_ref, logits_ref), (new, logits) = outputs
    for a, b in zip(new, new_ref):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(logits, logits_ref, rtol=1e-6, atol=1e-6)
