"""A train step sized before it runs: per-device memory, FLOPs and collective bytes of the compiled
program (`plan_train_step`), read from its input shardings, ``memory_analysis()``,
``cost_analysis()`` and its optimized HLO text (`collective_bytes`). ``python -m train.plan`` prints it.

    parameters, optimizer state   the shards the compiled program takes (its input shardings)
    buffers                       likewise: router biases and, with ``model.moe.expert_format=mxfp4``,
                                  the frozen routed experts (0.53 B/weight: codes + scales; no
                                  optimizer state)
    arguments, outputs, temporaries  ``compiled.memory_analysis()``: temporaries are the
                                  activations and workspace of forward + backward + update;
                                  generated code likewise (it sits in a TPU's HBM)
    FLOPs, bytes accessed         ``compiled.cost_analysis()``, which counts the body of every loop
                                  once (the scanned layers, gradient accumulation, KDA's chunks):
                                  with loops, far less than a step does
    matmul FLOPs                  2 per multiply-add of the traced step, loops times their trip
                                  counts (`k3jax.tpu.matmul_flops`), over the devices
    collectives                   result bytes of every all-to-all / all-gather / all-reduce /
                                  reduce-scatter / collective-permute in the optimized HLO, each
                                  times the trip counts of the loops around it (scanned layers,
                                  gradient accumulation); the all-to-alls of the expert-parallel
                                  shard_map regions (the MoE dispatch) are also counted apart, and
                                  expert all-to-all bytes per token = their per-device bytes *
                                  devices / tokens per step; the collectives of the context-parallel
                                  regions (KDA state passing, conv halo, MLA latent all-gather or
                                  ring, and their backward) are counted apart as "context axis"

A LoRA run (``finetune.lora_rank > 0``) also shows its frozen base: the parameters held without
optimizer state (QLoRA, ``model.moe.expert_format=mxfp4``: with the packed routed experts, which
then count there and not under "buffers"); "parameters" and "optimizer state" are then the
adapters' (and their Adam moments). ``compile=False`` stops before compiling: parameter and
optimizer-state shards only, from the run's shardings.
"""
from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from typing import NamedTuple

COLLECTIVES = ("all-to-all", "ragged-all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")
EXPERT_ALL_TO_ALL = "all-to-all in shard_map"    # the expert dispatch (k3jax.sharding.expert_parallel)
CONTEXT_AXIS = "context axis"                    # k3jax.sharding.context's regions (its name scope)
CONTEXT_SCOPE = "context_parallel"               # = k3jax.sharding.context.CONTEXT_SCOPE (not imported: no JAX yet)
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%\S+ = (.*?) ([a-z][a-z0-9-]*)\(")
_ARRAY_TYPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_CALLEES = re.compile(r"\b(condition|body|calls|to_apply|branch_computations|called_computations)="
                      r"(\{[^}]*\}|%[\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
BATCH_DTYPES = {"tokens": "int32", "targets": "int32", "loss_mask": "float32", "segment_ids": "int32"}


def type_bytes(hlo_type: str) -> float:
    """Bytes of an HLO result type: an array (``f32[8,16]{1,0}``) or a tuple of arrays."""
    total = 0.0
    for dtype, dims in _ARRAY_TYPE.findall(hlo_type):
        size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
        if size is not None:
            total += size * math.prod(int(d) for d in dims.split(",") if d)
    return total


class _Instruction(NamedTuple):
    opcode: str
    result_bytes: float
    callees: tuple[tuple[str, int], ...]    # (computation, times run per execution of this instruction)
    op_name: str                            # the JAX operation it came from ("" when not recorded)


def _parse_hlo(text: str) -> tuple[dict[str, list[_Instruction]], str]:
    """Computations of an HLO module text and the entry computation's name."""
    computations: dict[str, list[_Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
            continue
        match = _INSTRUCTION.match(line)
        if current is None or not match:
            continue
        trip = _TRIP_COUNT.search(line)
        callees = []
        for role, names in _CALLEES.findall(line):
            repeats = int(trip.group(1)) if trip and role in ("body", "condition") else 1
            callees += [(name.strip().lstrip("%"), repeats) for name in names.strip("{}").split(",") if name.strip()]
        op_name = _OP_NAME.search(line)
        current.append(_Instruction(match.group(2), type_bytes(match.group(1)), tuple(callees),
                                    op_name.group(1) if op_name else ""))
    return computations, entry


def collective_bytes(hlo_text: str) -> dict[str, float]:
    """Result bytes per device of each collective kind in one execution of an optimized HLO module,
    counting an instruction inside a loop once per trip (``known_trip_count``); all-to-alls that
    come from shard_map regions are also summed under ``EXPERT_ALL_TO_ALL``, and every collective of
    the context-parallel regions under ``CONTEXT_AXIS``."""
    computations, entry = _parse_hlo(hlo_text)
    runs: dict[str, float] = defaultdict(float)

    def visit(name: str, times: float) -> None:
        runs[name] += times
        for instruction in computations.get(name, ()):
            for callee, repeats in instruction.callees:
                visit(callee, times * repeats)

    visit(entry, 1.0)
    totals = dict.fromkeys((*COLLECTIVES, EXPERT_ALL_TO_ALL, CONTEXT_AXIS), 0.0)
    for name, instructions in computations.items():
        for instruction in instructions:
            if instruction.opcode not in COLLECTIVES:
                continue
            moved = instruction.result_bytes * runs.get(name, 0.0)
            totals[instruction.opcode] += moved
            if instruction.opcode.endswith("all-to-all") and "shard_map" in instruction.op_name:
                totals[EXPERT_ALL_TO_ALL] += moved
            if CONTEXT_SCOPE in instruction.op_name:
                totals[CONTEXT_AXIS] += moved
    return totals


class Plan(NamedTuple):
    """Per-device figures of one compiled train step (bytes unless named otherwise)."""

    devices: int
    mesh: dict
    tokens_per_step: int
    parameters: float
    optimizer_state: float
    buffers: float
    arguments: float
    outputs: float
    aliased: float
    temporaries: float
    flops: float
    collectives: dict
    compile_seconds: float
    frozen_parameters: float = 0.0     # a LoRA run's base (no optimizer state)
    trainable_count: int = 0           # parameters the optimizer trains (all devices)
    frozen_count: int = 0              # parameters held frozen (all devices)
    bytes_accessed: float = math.nan   # ``cost_analysis()``: bytes read and written per step
    matmul_flops: float = math.nan     # `k3jax.tpu.matmul_flops` of the traced step, per device
    generated_code: float = math.nan   # the program's code (on a TPU it occupies HBM too)

    @property
    def peak(self) -> float:
        """Arguments + outputs not aliased to them + temporaries: the step's live bytes at most."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @property
    def resident(self) -> float:
        """Parameters, frozen base, optimizer state and buffers: the bytes a device holds between steps."""
        return self.parameters + self.frozen_parameters + self.optimizer_state + self.buffers

    @property
    def context_bytes_per_token(self) -> float:
        """Bytes the context-parallel regions move per token of the step, over all devices."""
        return self.collectives[CONTEXT_AXIS] * self.devices / self.tokens_per_step

    @property
    def all_to_all_bytes_per_token(self) -> float:
        """Bytes the expert dispatch moves per token of the step, over all devices."""
        return self.collectives[EXPERT_ALL_TO_ALL] * self.devices / self.tokens_per_step


def _shard_bytes(abstract_tree, shardings) -> float:
    import jax
    import numpy as np

    return float(sum(math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                     for x, s in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings))))


def _count(tree) -> int:
    import jax

    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def _frozen_weights(layout) -> int:
    """Weights of a LoRA run's frozen base (all devices): its parameters' elements, and for packed
    MXFP4 experts (QLoRA) two weights per code byte (their scale bytes are not weights)."""
    from k3jax.layers.moe import ExpertCodes

    codes = set(layout.parts.frozen.keys_of(ExpertCodes))
    per_element = {key: (2 if key.endswith("_packed") else 0) if key in codes else 1 for key in layout.frozen}
    return sum(per_element[key] * math.prod(value.shape) for key, value in layout.frozen.items())


def plan_train_step(config, compile: bool = True, devices=None) -> Plan:
    """Compile ``config``'s train step for ``devices`` (default: the current ones; e.g. compile-only
    TPU devices, `k3jax.tpu.compile_target`) from abstract inputs only, and measure it; without
    ``compile`` only the resident shards (parameters, frozen base, optimizer state)."""
    import jax

    from k3jax.sharding import mesh_shape
    from k3jax.tpu import matmul_flops, program_cost
    from k3jax.training.layout import lay_out_run
    from k3jax.training.steps import make_train_step

    layout = lay_out_run(config, devices)
    rows, length = config.train.batch_size, config.data.seq_len
    mesh, state = layout.mesh, layout.state
    frozen = () if layout.frozen is None else (layout.frozen,)
    resident = dict(
        devices=mesh.size, mesh=mesh_shape(config.mesh, mesh.size), tokens_per_step=rows * length,
        parameters=_shard_bytes(state.params, layout.shardings.state.params),
        optimizer_state=_shard_bytes(state.opt_state, layout.shardings.state.opt_state),
        buffers=_shard_bytes(state.buffers, layout.shardings.state.buffers),
        frozen_parameters=_shard_bytes(layout.frozen, layout.shardings.frozen) if frozen else 0.0,
        trainable_count=_count(state.params), frozen_count=_frozen_weights(layout) if frozen else 0)
    if not compile:
        unmeasured = dict.fromkeys(("arguments", "outputs", "aliased", "temporaries", "flops", "compile_seconds"),
                                   math.nan)
        return Plan(**resident, **unmeasured, collectives={})
    batch = {name: jax.ShapeDtypeStruct((rows, length), dtype, sharding=layout.shardings.batch)
             for name, dtype in BATCH_DTYPES.items()}
    step = make_train_step(layout.parts, layout.optimizer, accumulation=config.train.grad_accum,
                           schedule=layout.schedule, shardings=layout.shardings)
    started = time.perf_counter()
    traced = step.trace(layout.state, batch, *frozen)
    compiled = traced.lower().compile()
    seconds = time.perf_counter() - started
    cost = program_cost(compiled)
    return Plan(
        **resident,
        arguments=cost.arguments, outputs=cost.outputs, aliased=cost.aliased, temporaries=cost.temporaries,
        flops=cost.flops, bytes_accessed=cost.bytes_accessed, generated_code=cost.generated_code,
        matmul_flops=matmul_flops(traced.jaxpr) / mesh.size,
        collectives=collective_bytes(compiled.as_text()),
        compile_seconds=seconds,
    )
