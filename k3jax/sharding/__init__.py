"""Parallelism, applied to the model from outside (the model names logical axes only).

    mesh.py            the device mesh, logical axis rules -> shardings of parameters, optimizer
                       state and batches, multi-process data movement
    expert_parallel.py the expert-parallel MoE dispatch (capacity / ragged all-to-all)
    parallelize.py     `parallelize(model, mesh, mesh_config)`: activation layouts and expert
                       dispatch stored on the model's modules
    lost_peers.py      one line instead of JAX's fatal log when a peer process dies
"""
from k3jax.sharding.expert_parallel import (DISPATCHES, ExpertDispatch, ExpertPlacement, expert_dispatch,
                                            expert_parallel_experts, expert_placement)
from k3jax.sharding.mesh import (MESH_AXES, AnyMesh, StepShardings, abstract, axes_size, batch_sharding,
                                 check_run_fits, compiled_together, global_batch, initialize_distributed,
                                 make_mesh, mesh_shape, named_shardings, optimizer_shardings, partition_spec, process_rows,
                                 state_shardings, step_shardings, to_host, wait_for_all_processes)
from k3jax.sharding.parallelize import MeshLayout, parallelize

__all__ = [
    "DISPATCHES", "ExpertDispatch", "ExpertPlacement", "expert_dispatch", "expert_parallel_experts",
    "expert_placement", "MESH_AXES", "AnyMesh", "StepShardings", "abstract", "axes_size", "batch_sharding",
    "check_run_fits", "compiled_together", "global_batch", "initialize_distributed", "make_mesh", "mesh_shape",
    "named_shardings", "optimizer_shardings", "partition_spec", "process_rows", "state_shardings", "step_shardings", "to_host",
    "wait_for_all_processes",
    "MeshLayout", "parallelize",
]
