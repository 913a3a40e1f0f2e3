"""The batched decode over the pools (`paged.decode_step` with pool kernels) against the reference
step that gathers the contiguous bank, decodes and scatters back: several sessions of different
lengths in non-contiguous slots, a 6-layer model whose depth scan runs twice, the XLA kernels and
both Pallas kernel families in interpret mode; and the store's generate on either path."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.memory import PoolKernel
from k3jax.model import K3Model, layer_groups
from k3jax.sessions import SessionStore, paged
from tests.sessions.conftest import random_tokens, tiny_config

KERNELS = [PoolKernel("xla"), PoolKernel("pallas", "gpu", True), PoolKernel("pallas", "tpu", True)]
KERNEL_IDS = ["xla", "pallas-gpu", "pallas-tpu"]


@pytest.fixture(scope="module")
def deep_store():
    """A store over a 6-layer model (KDA layers before and inside the scanned body) holding
    sessions of 5, 17 and 33 tokens in slots 0, 2 and 4 (slots 1 and 3 closed)."""
    model = K3Model(tiny_config("model.num_layers=6"), rngs=nnx.Rngs(1))
    assert layer_groups(model.config).repeats == 2
    store = SessionStore(model)
    sids = [store.open(random_tokens(seed, length)) for seed, length in enumerate((5, 3, 17, 4, 33))]
    store.close(sids[1])
    store.close(sids[3])
    return store, [sids[0], sids[2], sids[4]]


def step_inputs(store, sids):
    """The arguments of one decode step over ``sids`` padded to a batch of 4 (`SessionStore._decode`)."""
    values = [store._sessions[sid] for sid in sids]
    pages = paged.next_power_of_two(max(-(-(v.length + 1) // store.page_size) for v in values))
    slots = [v.slot for v in values] + store._scratch_slots(1)
    assert slots[:3] == [0, 2, 4]
    tables = np.stack([store._table(v.pages, pages) for v in values] + [store._table([], pages)])
    logits = np.stack([v.logits for v in values] + [np.zeros_like(values[0].logits)])
    return (jnp.asarray(slots, jnp.int32), jnp.asarray(tables), jnp.asarray([v.length for v in values] + [0], jnp.int32),
            jnp.asarray(logits, jnp.float32), jnp.uint32(0), jnp.asarray(sids + [0], jnp.uint32),
            (jnp.float32(0.0), jnp.int32(0), jnp.float32(1.0)))


def run_step(store, inputs, kernel):
    pools = paged.Pools(*(jnp.array(a) for a in store._pools))   # a copy: the step donates its pools
    return paged.decode_step(store._graphdef, store._params, pools, *inputs, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
def test_pooled_step_equals_the_gather_decode_scatter_step(deep_store, kernel):
    store, sids = deep_store
    inputs = step_inputs(store, sids)
    tokens_ref, logits_ref, pools_ref = run_step(store, inputs, None)
    tokens, logits, pools = run_step(store, inputs, kernel)
    np.testing.assert_array_equal(tokens, tokens_ref)
    np.testing.assert_allclose(logits, logits_ref, rtol=1e-6, atol=1e-6)
    for name, got, want, before in zip(paged.Pools._fields, pools, pools_ref, store._pools):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=name)
        assert not np.array_equal(got, before), f"the step wrote nothing into the {name} pool"


def test_generate_is_the_same_on_either_decode_path(deep_store):
    store, sids = deep_store
    handles = [store.snapshot(sid) for sid in sids]
    outputs = {}
    for kernel in (None, PoolKernel("xla")):
        for sid, handle in zip(sids, handles):
            store.rollback(sid, handle)
        store.decode_kernel = kernel
        new = store.generate(sids, 4)
        outputs[kernel] = (new, [store.logits(sid) for sid in sids])
    store.decode_kernel = PoolKernel()
    (new_ref, logits_ref), (new, logits) = outputs[None], outputs[PoolKernel("xla")]
    for a, b in zip(new, new_ref):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(np.stack(logits), np.stack(logits_ref), rtol=1e-6, atol=1e-6)
