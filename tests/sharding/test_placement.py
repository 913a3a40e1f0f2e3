"""Placement rules, expert-parallel bookkeeping and the planner's HLO reading, on one device
(abstract meshes stand in for real ones; tests/sharding/test_multi_device.py runs 8 devices;
tests/sharding/test_parallelize.py sets models up for a mesh)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from k3jax.config import ConfigError, MeshConfig, load_config
from k3jax.sharding import (MESH_AXES, batch_sharding, expert_placement, mesh_shape, partition_spec,
                            state_shardings)
from k3jax.sharding.expert_parallel import capacity_slots, expert_capacity, local_expert_grouping
from k3jax.training import init_train_state, plan
from k3jax.training.optim import build_optimizer

RULES = MeshConfig().rules


def abstract_mesh(data=1, fsdp=1, expert=1, tensor=1, context=1):
    return AbstractMesh((data, fsdp, expert, context, tensor), MESH_AXES, axis_types=(AxisType.Auto,) * 5)


MESH = abstract_mesh(data=2, fsdp=2, expert=4, tensor=2)


@pytest.mark.parametrize("axes, shape, expected", [
    (("layers", "experts", "latent", "expert_mlp"), (3, 8, 16, 32), P(None, "expert", "fsdp", "tensor")),
    (("embed", "latent"), (32, 16), P(("fsdp", "expert"), None)),            # fsdp is taken by embed
    (("embed", "experts"), (32, 8), P(("fsdp", "expert"), None)),            # so is expert
    (("experts", "expert_mlp"), (6, 32), P(None, "tensor")),                   # 4 does not divide 6
    (("vocab", "embed"), (1000, 64), P("tensor", ("fsdp", "expert"))),
    (("embed", "heads", "head_dim"), (64, 3, 16), P(("fsdp", "expert"), None, None)),   # 2 does not divide 3
    (("embed",), (6,), P("fsdp")),                                             # 2 x 4 does not divide 6
    (("batch",), (16,), P(("data", "fsdp", "expert"))),
    (("batch",), (4,), P(("data", "fsdp"))),                                  # expert would need 16 rows
])
def test_partition_spec_takes_rule_axes_that_are_free_and_divide(axes, shape, expected):
    assert partition_spec(axes, shape, RULES, MESH) == expected


def test_partition_spec_rejects_unknown_names_and_wrong_ranks():
    with pytest.raises(ValueError, match="no sharding rule for the logical axis 'embd'"):
        partition_spec(("embd",), (8,), RULES, MESH)
    with pytest.raises(ValueError, match="do not match shape"):
        partition_spec(("embed",), (8, 8), RULES, MESH)


def test_rules_from_config_remap_axes():
    config = load_config("tests/train/micro.yaml", ["mesh.rules.embed=[]", "mesh.rules.mlp=[fsdp, tensor]"])
    assert partition_spec(("embed", "mlp"), (32, 64), config.mesh.rules, MESH) == P(None, ("fsdp", "tensor"))


def test_mesh_shape_fills_one_axis_and_names_bad_sizes():
    assert mesh_shape(MeshConfig(data=-1, expert=4), 32) == {"data": 8, "fsdp": 1, "expert": 4, "context": 1,
                                                              "tensor": 1}
    assert mesh_shape(MeshConfig(data=2, fsdp=2, expert=2, tensor=1), 8) == {"data": 2, "fsdp": 2, "expert": 2,
                                                                             "context": 1, "tensor": 1}
    assert mesh_shape(MeshConfig(data=-1, context=4), 8)["data"] == 2
    with pytest.raises(ConfigError, match="^mesh: 6 devices do not split over data=-1 x fsdp=1 x expert=4"):
        mesh_shape(MeshConfig(expert=4), 6)
    with pytest.raises(ConfigError, match="^mesh: at most one mesh axis may be -1"):
        load_config("tests/train/micro.yaml", ["mesh.fsdp=-1"])
    with pytest.raises(ConfigError, match=r"^mesh.rules.embed\[0\]: 'fsdpp' is not one of .* did you mean 'fsdp'"):
        load_config("tests/train/micro.yaml", ["mesh.rules.embed=[fsdpp]"])


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizer_state_follows_its_parameter(name):
    params = {"w": jnp.zeros((32, 64)), "norm": jnp.zeros((32,)), "experts": jnp.zeros((8, 16, 32))}
    axes = {"w": ("embed", "mlp"), "norm": ("embed",), "experts": ("experts", "latent", "expert_mlp")}
    optimizer = build_optimizer(name=name, schedule=optax.constant_schedule(1e-3), axes=axes)
    state = jax.eval_shape(lambda: init_train_state(params, {}, optimizer))
    shardings = state_shardings(state, axes, {}, RULES, MESH)
    expected = {"w": P(("fsdp", "expert"), "tensor"), "norm": P(("fsdp", "expert")),
                "experts": P("expert", "fsdp", "tensor")}
    assert {path: s.spec for path, s in shardings.params.items()} == expected
    moments = 0
    for path, sharding in jax.tree_util.tree_flatten_with_path(shardings.opt_state)[0]:
        names = [key.key for key in path if isinstance(getattr(key, "key", None), str) and key.key in params]
        if names:
            moments += 1
            assert sharding.spec == expected[names[-1]], path
        else:
            assert sharding.spec == P(), path
    assert moments >= len(params)
    assert shardings.step.spec == P() and shardings.skipped.spec == P()


def test_batches_split_over_the_batch_axes_of_size_above_one_and_the_sequence_over_context():
    assert batch_sharding(abstract_mesh(data=2, expert=4), RULES).spec == P(("data", "expert"))
    assert batch_sharding(abstract_mesh(), RULES).spec == P(None)
    assert batch_sharding(abstract_mesh(data=2, context=4), RULES).spec == P(("data",), ("context",))
    assert partition_spec(("batch", "sequence", None), (4, 64, 32), RULES,
                          abstract_mesh(data=2, context=4)) == P("data", "context", None)


def test_expert_placement_splits_tokens_over_expert_then_batch_axes_and_the_hidden_width_over_the_rest():
    config = MeshConfig(moe_dispatch="capacity", capacity_factor=2.0)
    placement = expert_placement(MESH, config, 64, 32)
    assert (placement.tokens, placement.experts, placement.hidden) == (("data", "fsdp", "expert"), ("expert",),
                                                                       ("tensor",))
    assert (placement.dispatch, placement.capacity_factor) == ("capacity", 2.0)
    assert expert_placement(MESH, config, 8, 3).tokens == ("data", "expert")   # experts first: fsdp would make 16
    assert expert_placement(MESH, config, 8, 3).hidden == ()                   # 2 does not divide 3
    with pytest.raises(ValueError, match="do not split over the expert axes"):
        expert_placement(MESH, config, 6, 32)
    with_context = abstract_mesh(data=2, expert=2, context=2)   # flattened [B, T] rows: batch, then sequence
    assert expert_placement(with_context, config, 64, 32).tokens == ("data", "expert", "context")


def numpy_slots(indices, num_experts, capacity):
    """First come, first served in assignment order a = t*k + i."""
    taken = np.zeros(num_experts, int)
    slots, kept = [], []
    for expert in np.asarray(indices).reshape(-1):
        kept.append(taken[expert] < capacity)
        slots.append(expert * capacity + taken[expert] if kept[-1] else num_experts * capacity)
        taken[expert] += 1
    return np.array(slots), np.array(kept)


@pytest.mark.parametrize("capacity", [1, 3, 40])
def test_capacity_slots_serve_assignments_in_order(capacity):
    indices = np.random.default_rng(0).integers(0, 6, size=(20, 2))
    indices[:, 1] = (indices[:, 0] + 1 + indices[:, 1] % 5) % 6          # distinct experts per token
    slots, kept = capacity_slots(jnp.asarray(indices, jnp.int32), 6, capacity)
    expected_slots, expected_kept = numpy_slots(indices, 6, capacity)
    np.testing.assert_array_equal(slots, expected_slots)
    np.testing.assert_array_equal(kept, expected_kept)


def test_expert_capacity_rule():
    assert expert_capacity(16, 2, 8, 1.25) == math.ceil(1.25 * 16 * 2 / 8) == 5
    assert expert_capacity(16, 2, 8, 8 / 2) == 16                          # E / k: every token fits
    assert expert_capacity(1, 1, 64, 0.1) == 1


def test_local_expert_grouping_orders_the_receive_buffer_by_local_expert():
    counts_from = np.array([[2, 0, 1], [1, 3, 0]])                        # 2 sources x 3 local experts
    order, sizes = local_expert_grouping(jnp.asarray(counts_from), buffer_rows=9)
    labels = np.repeat(np.tile(np.arange(3), 2), counts_from.reshape(-1))   # local expert of each stored row
    labels = np.concatenate([labels, np.full(9 - labels.size, 3)])         # padding last
    np.testing.assert_array_equal(order, np.argsort(labels, kind="stable"))
    np.testing.assert_array_equal(sizes, counts_from.sum(0))


HLO = """\
HloModule jit_step, entry_computation_layout={()->f32[]}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %all-to-all = (f32[1,8]{1,0}, f32[1,8]{1,0}, f32[1,8]{1,0}, f32[1,8]{1,0}) all-to-all(%a, %b, %c, %d), \
channel_id=1, metadata={op_name="jit(step)/while/body/shard_map/all_to_all"}
  %all-to-all.1 = f32[2,8]{1,0} all-to-all(%e), channel_id=4, dimensions={0}, metadata={op_name="jit(step)/add"}
  %fusion = bf16[4,8]{1,0} fusion(%x), kind=kLoop, calls=%fused
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %y)
}

%fused (q: bf16[4,8]) -> bf16[4,8] {
  %all-gather = bf16[16,8]{1,0} all-gather(%q), channel_id=2, dimensions={0}
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[4,8]) -> f32[] {
  %while = (s32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"7"}}
  %all-reduce = f32[] all-reduce(%s), channel_id=3, to_apply=%add
}
"""


def test_collective_bytes_count_each_loop_trip():
    totals = plan.collective_bytes(HLO)
    assert totals["all-to-all"] == 7 * 4 * 8 * 4 + 7 * 2 * 8 * 4
    assert totals[plan.EXPERT_ALL_TO_ALL] == 7 * 4 * 8 * 4
    assert totals["all-gather"] == 7 * 16 * 8 * 2
    assert totals["all-reduce"] == 4
    assert totals["reduce-scatter"] == totals["collective-permute"] == 0
