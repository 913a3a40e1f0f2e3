"""Compiling for TPUs on any machine: compile-only TPU devices, the chips' published peaks, and
what the TPU compiler says about a compiled program.

    target = compile_target("v5p:4x4x4")        # 64 compile-only v5p devices (libtpu, no TPU needed)
    mesh = jax.make_mesh(shape, names, devices=target.devices)
    compiled = jax.jit(f).lower(*abstract_inputs_with_shardings_on(mesh)).compile()   # the real TPU compiler
    cost = program_cost(compiled)               # per device: arguments, outputs, temporaries, code; FLOPs, bytes
    seconds = roofline_seconds(cost.flops, cost.bytes_accessed, target)

With the ``tpu`` extra (``pip install -e ".[tpu]"``: ``jax[tpu]``, which brings libtpu), JAX builds
compile-only TPU devices from a topology name (`jax.experimental.topologies`); lowering a program
with shardings on them and calling ``.compile()`` runs libtpu's XLA TPU compiler and Mosaic (Pallas)
here, on a CPU. Nothing runs: ``memory_analysis()`` gives each device's bytes, ``cost_analysis()``
the compiler's FLOP and byte counts, and a Pallas kernel whose blocks do not fit in VMEM is refused.

The roofline of a program on one device is

    t = max(F / P, B / W)         F FLOPs, B bytes accessed (``cost_analysis``), P the device's bf16
                                  peak FLOP/s, W its HBM bandwidth

and the MFU it implies for a model doing F_model useful FLOPs per device is F_model / (t P): an
upper bound (a real step also waits on collectives, the host, and kernels below peak). Custom calls
(Pallas kernels) are opaque to ``cost_analysis``: their FLOPs are not counted, only their operands'
bytes.

Devices vs chips: JAX makes one device per TensorCore that the chip exposes, which is one per chip
on v4 and v5p (megacore), v5e and v6e (one core), and two per chip on TPU7x. Every per-device
figure below is the chip's figure divided by the devices per chip.
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
from typing import NamedTuple

GiB = 1024**3


class Chip(NamedTuple):
    """A TPU generation's published per-chip peaks (and its Pallas VMEM per TensorCore)."""

    name: str              # the topology prefix JAX takes (``v5p`` in ``v5p:4x4x4``)
    device_kind: str       # ``jax.Device.device_kind`` of its devices
    hbm_bytes: float       # HBM per chip
    bf16_flops: float      # dense bf16 peak FLOP/s per chip
    hbm_bandwidth: float   # HBM bytes/s per chip
    vmem_bytes: int        # VMEM per TensorCore (what a Pallas kernel's blocks must fit)
    accelerator_type: str  # a TPU_ACCELERATOR_TYPE of that generation (quiets libtpu's start-up)


# Per chip, from Google Cloud's TPU system-architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p,
# v6e, tpu7x; "Peak compute per chip (bf16)", "HBM capacity", "HBM bandwidth"): v4 275 TFLOP/s,
# 32 GiB, 1,200 GB/s; v5e 197 TFLOP/s, 16 GiB, 819 GB/s; v5p 459 TFLOP/s, 95 GiB, 2,765 GB/s; v6e
# 918 TFLOP/s, 32 GiB, 1,640 GB/s; TPU7x (Ironwood) 2,307 TFLOP/s, 192 GiB, 7,380 GB/s. VMEM per
# TensorCore from JAX's own table (jax/_src/pallas/mosaic/tpu_info.py): 16 / 128 / 64 / 128 / 64 MiB.
CHIPS = {chip.name: chip for chip in (
    Chip("v4", "TPU v4", 32 * GiB, 275e12, 1200e9, 16 * 2**20, "v4-8"),
    Chip("v5e", "TPU v5 lite", 16 * GiB, 197e12, 819e9, 128 * 2**20, "v5litepod-4"),
    Chip("v5p", "TPU v5", 95 * GiB, 459e12, 2765e9, 64 * 2**20, "v5p-8"),
    Chip("v6e", "TPU v6 lite", 32 * GiB, 918e12, 1640e9, 128 * 2**20, "v6e-4"),
    Chip("tpu7x", "TPU7x", 192 * GiB, 2307e12, 7380e9, 64 * 2**20, "tpu7x-8"),
)}

_TOPOLOGY = re.compile(r"^([a-z0-9]+):(\d+(?:x\d+){1,2})$")


class TargetError(ValueError):
    """A TPU target that cannot be built (unknown topology, no libtpu); the message is one line."""


class Target(NamedTuple):
    """Compile-only TPU devices of one topology."""

    topology: str
    chip: Chip
    chips: int
    devices: tuple

    @property
    def devices_per_chip(self) -> int:
        return len(self.devices) // self.chips

    @property
    def device_hbm(self) -> float:
        return self.chip.hbm_bytes / self.devices_per_chip

    @property
    def device_flops(self) -> float:
        return self.chip.bf16_flops / self.devices_per_chip

    @property
    def device_bandwidth(self) -> float:
        return self.chip.hbm_bandwidth / self.devices_per_chip

    def describe(self) -> str:
        """``v5p:4x4x4: 64 v5p chips, 64 devices``."""
        per = f", {self.devices_per_chip} devices per chip" if self.devices_per_chip > 1 else ""
        return f"{self.topology}: {self.chips} {self.chip.name} chips, {len(self.devices)} devices{per}"


def parse_topology(topology: str) -> tuple[Chip, tuple[int, ...]]:
    """``(chip, dims)`` of a topology name such as ``v5p:4x4x4`` or ``v6e:4x4``; TargetError otherwise."""
    match = _TOPOLOGY.match(topology.strip().lower())
    if not match:
        raise TargetError(f"--tpu {topology!r}: expected GENERATION:AxB or GENERATION:AxBxC, e.g. v5p:4x4x4 "
                          f"or v6e:4x4 (generations: {', '.join(CHIPS)})")
    name, dims = match.group(1), tuple(int(d) for d in match.group(2).split("x"))
    if name not in CHIPS:
        raise TargetError(f"--tpu {topology!r}: unknown TPU generation {name!r}; known: {', '.join(CHIPS)}")
    return CHIPS[name], dims


def libtpu_missing() -> str | None:
    """Why TPU programs cannot be compiled here (one line), or None when libtpu is installed."""
    if importlib.util.find_spec("libtpu") is None:
        return 'compiling for TPU needs libtpu: pip install -e ".[tpu]" (jax[tpu])'
    return None


def compile_target(topology: str) -> Target:
    """The compile-only devices of ``topology`` (e.g. ``v5p:4x4x4``: 64 v5p chips), one-line
    TargetError for a malformed or unknown name, a topology libtpu refuses, or a missing libtpu.

    Sets, where unset, ``TPU_WORKER_HOSTNAMES`` and ``TPU_ACCELERATOR_TYPE`` (without them libtpu
    prints five lines of warnings about the TPU it looks for on this host when it loads) and
    ``ALLOW_MULTIPLE_LIBTPU_LOAD`` (libtpu otherwise takes a host-wide lock file, so a second process
    compiling for TPU would fail while one runs; compile-only devices never touch a TPU)."""
    chip, dims = parse_topology(topology)
    missing = libtpu_missing()
    if missing:
        raise TargetError(missing)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", chip.accelerator_type)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax
    from jax.experimental import topologies

    name = f"{chip.name}:{'x'.join(map(str, dims))}"
    try:
        devices = topologies.get_topology_desc(topology_name=name, platform="tpu").devices
    except jax.errors.JaxRuntimeError as error:
        raise TargetError(f"--tpu {topology!r}: libtpu refuses it: {str(error).splitlines()[0]}") from None
    return Target(name, chip, math.prod(dims), tuple(devices))


class ProgramCost(NamedTuple):
    """What the compiler says about one compiled program, per device (bytes, FLOPs)."""

    arguments: float
    outputs: float
    aliased: float
    temporaries: float
    generated_code: float
    flops: float
    bytes_accessed: float

    @property
    def peak(self) -> float:
        """Arguments + outputs not aliased to them + temporaries + code: the most the program holds."""
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.generated_code


def program_cost(compiled) -> ProgramCost:
    """`ProgramCost` of a ``jax.stages.Compiled`` (``memory_analysis()``, ``cost_analysis()``)."""
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis() or {}
    return ProgramCost(
        arguments=float(memory.argument_size_in_bytes), outputs=float(memory.output_size_in_bytes),
        aliased=float(memory.alias_size_in_bytes), temporaries=float(memory.temp_size_in_bytes),
        generated_code=float(memory.generated_code_size_in_bytes),
        flops=float(cost.get("flops", 0.0)), bytes_accessed=float(cost.get("bytes accessed", 0.0)))


def roofline_seconds(flops: float, bytes_accessed: float, target: Target) -> float:
    """max(F / P, B / W) on one device of ``target`` (module docstring)."""
    return max(flops / target.device_flops, bytes_accessed / target.device_bandwidth)


def implied_mfu(model_flops: float, seconds: float, target: Target) -> float:
    """F_model / (t P): the model FLOP utilisation of a device doing ``model_flops`` in ``seconds``."""
    return model_flops / (seconds * target.device_flops)


_SCOPED_MEMORY = re.compile(r'"used_scoped_memory_configs":\[(.*?)\]')
_SIZE = re.compile(r'"size":"(\d+)"')


def kernel_vmem_bytes(compiled) -> list[int]:
    """VMEM each Mosaic kernel (``tpu_custom_call``) of a compiled TPU program uses, as the compiler
    reports it (its ``used_scoped_memory_configs``), in program order."""
    return [sum(int(size) for size in _SIZE.findall(match.group(1)))
            for line in compiled.as_text().splitlines() if 'custom_call_target="tpu_custom_call"' in line
            for match in [_SCOPED_MEMORY.search(line)] if match]


def _dot_flops(eqn) -> float:
    """2 x output elements x contracted size of one ``dot_general``."""
    (lhs_contracting, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs.shape[d] for d in lhs_contracting)


def _jaxpr_of(value):
    return getattr(value, "jaxpr", value)   # a ClosedJaxpr's jaxpr, or a Jaxpr


def matmul_flops(jaxpr) -> float:
    """Matmul FLOPs (2 per multiply-add of every ``dot_general``) of a traced program, over all devices:
    a ``scan`` body times its length, a Pallas kernel times its grid, a ``shard_map`` body (one shard's
    shapes) times the devices of its manual axes, the costlier branch of a ``cond``, other sub-programs
    once (a ``while`` body too: its trip count is not in the jaxpr).

    The compiler's ``cost_analysis()`` counts every loop body once, whatever its trip count, and sees
    nothing inside a Pallas kernel; this count is what a program with scanned layers, chunk loops or
    Pallas kernels multiplies."""
    total = 0.0
    for eqn in _jaxpr_of(jaxpr).eqns:
        name, params = eqn.primitive.name, eqn.params
        if name == "dot_general":
            total += _dot_flops(eqn)
        elif name == "scan":
            total += params["length"] * matmul_flops(params["jaxpr"])
        elif name == "pallas_call":
            total += math.prod(params["grid_mapping"].grid) * matmul_flops(params["jaxpr"])
        elif name == "cond":
            total += max(matmul_flops(branch) for branch in params["branches"])
        elif name == "shard_map":
            mesh = params["mesh"]
            total += math.prod(mesh.shape[axis] for axis in params["newly_manual_axes"]) * matmul_flops(params["jaxpr"])
        else:
            from jax.extend.core import jaxprs_in_params

            total += sum(matmul_flops(sub) for sub in jaxprs_in_params(params))
    return total
