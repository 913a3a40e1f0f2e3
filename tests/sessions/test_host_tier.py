"""The host tier's memory kind: detection from a device's memories (fake device lists), JAX's
pinned_host memory where the device has it (the CPU backend does) and host numpy otherwise, each
holding what it is given and serving a spilled session that continues exactly."""
import jax
import numpy as np
import pytest

from k3jax.sessions import SessionStore
from k3jax.sessions.tiers import HostTier, HostValue, pinned_host_available
from tests.sessions.conftest import contiguous_logits, random_tokens


class FakeMemory:
    def __init__(self, kind):
        self.kind = kind


class FakeDevice:
    def __init__(self, kinds=None):
        self.kinds = kinds

    def addressable_memories(self):
        if self.kinds is None:
            raise NotImplementedError("no memory kinds on this backend")
        return [FakeMemory(kind) for kind in self.kinds]


def test_detection_follows_the_device_memories():
    assert pinned_host_available(FakeDevice(["device", "pinned_host", "unpinned_host"]))
    assert not pinned_host_available(FakeDevice(["device", "unpinned_host"]))
    assert not pinned_host_available(FakeDevice(None))
    assert not pinned_host_available(object())
    assert HostTier(FakeDevice(["device"])).kind == "numpy"


def value(seed=0) -> HostValue:
    rng = np.random.default_rng(seed)
    return HostValue(*(rng.standard_normal(shape).astype(np.float32) for shape in ((2, 3), (1, 4), (1, 5, 2))))


def test_each_tier_holds_the_values_it_is_given():
    pinned, fallback = HostTier(jax.devices()[0]), HostTier(FakeDevice(["device"]))
    assert pinned.kind == "pinned_host"              # the CPU backend has a pinned_host memory
    original = value()
    held = pinned.put(original)
    assert all(a.sharding.memory_kind == "pinned_host" for a in held)
    on_device = pinned.to_device(held.state)
    assert on_device.sharding.memory_kind == jax.devices()[0].default_memory().kind
    numpy_held = fallback.put(HostValue(*map(jax.numpy.asarray, original)))
    assert all(type(a) is np.ndarray for a in numpy_held)
    for got in (held, numpy_held):
        for a, b in zip(got, original):
            np.testing.assert_array_equal(np.asarray(a), b)
        assert got.nbytes == original.nbytes


@pytest.mark.slow   # 15-60 s of the default set's CPU: in .ci/run's slow set
@pytest.mark.parametrize("kinds", [None, ["device", "pinned_host"]], ids=["numpy", "pinned_host"])
def test_a_spilled_session_continues_exactly(model, kinds):
    probe = SessionStore(model)
    store = SessionStore(model, device_bytes=probe.slot_bytes + 2 * probe.page_bytes)
    if kinds is None:
        store._host_tier = HostTier(FakeDevice(["device", "unpinned_host"]))
    prompts = [random_tokens(seed, 6) for seed in (1, 2)]
    first, second = (store.open(p) for p in prompts)      # opening the second spills the first
    stats = store.stats()
    assert stats["spills_to_host"] >= 1 and stats["host_memory"] == ("numpy" if kinds is None else "pinned_host")
    turn = random_tokens(3, 3)
    logits = store.append(first, turn)                      # comes back from the host tier
    np.testing.assert_allclose(logits, contiguous_logits(model, np.concatenate([prompts[0], turn]))[6:],
                               rtol=1e-5, atol=1e-5)
    assert store.stats()["loads_from_host"] >= 1 and second in store.sessions()
