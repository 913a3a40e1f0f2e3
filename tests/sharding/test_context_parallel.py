"""Context parallelism for KDA (k3jax.sharding.context) on 8 fake CPU devices in a subprocess:
outputs, final state, gradients and the short convolution with the sequence split over 2, 4 and 8
shards equal one device (relative <= 1e-5), documents ending inside shards and at a shard boundary."""
import json

import pytest

from tests.sharding.test_multi_device import finish, start, ROOT

TOLERANCE = 1e-5


@pytest.mark.slow
def test_kda_and_conv_across_2_4_8_context_shards_equal_one_device():
    results = json.loads(finish(start([str(ROOT / "tests" / "sharding" / "programs" / "context_kda.py")])).splitlines()[-1])
    assert sorted(results) == ["2", "4", "8"]
    for size, errors in results.items():
        assert all(error <= TOLERANCE for error in errors.values()), (size, errors)


@pytest.mark.slow
def test_kda_and_mla_layers_with_context_parallel_equal_one_device():
    """The layers as `parallelize` equips them (`ContextParallel` over 4 shards; MLA all-gathered
    and ring-passed): outputs and the gradients of the input and every parameter."""
    results = json.loads(finish(start([str(ROOT / "tests" / "sharding" / "programs" / "context_layers.py")])).splitlines()[-1])
    assert sorted(results) == ["kda", "mla", "mla_ring"]
    assert all(error <= TOLERANCE for error in results.values()), results
