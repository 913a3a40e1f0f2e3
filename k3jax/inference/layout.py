"""Where a model runs: the device mesh of inference and how the weights and session pools lie on it.

    placement = inference_placement(config.model, "expert=4,tensor=2")   # or "auto", or None: one device
    placement.mesh, placement.mesh_config      # a jax Mesh and the MeshConfig `parallelize` takes
    shardings = placement.shardings(axes, shapes)   # {path: NamedSharding} from logical axes

The inference layout (`INFERENCE_RULES`) differs from training's where decoding wants it to:

    KDA heads, MLA heads, FFN and expert hidden width, vocabulary   over ``tensor``
    routed experts                                                  over ``expert``
    model width of the dense weights, the MoE latent                over ``fsdp`` x ``expert``
                                                                    (weight sharding, as training)
    batch rows (sessions decoded together)                          over ``data``

so every weight but the norms, gates and routers splits over ``expert`` x ``tensor``: memory first
(a model that fits), at the price of gathering each dense weight over the expert axis when a
layer runs (GSPMD). ``data`` copies the model; ``context`` does not exist here: a prefill piece
is at most one KDA chunk. The routed experts go expert-parallel with the capacity
dispatch at capacity factor E / k, where no (token, expert) assignment is ever dropped
(`k3jax.sharding.expert_parallel`): decoding then gives one device's tokens. A mesh whose
``tensor`` size does not divide the KDA or MLA heads, or whose ``expert`` size does not divide the
experts, is refused (`MeshError`, one line) before anything loads.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding

from k3jax.config import AxisRules, MeshConfig, ModelConfig
from k3jax.sharding import make_mesh, named_shardings, partition_spec

INFERENCE_AXES = ("data", "fsdp", "expert", "tensor")
INFERENCE_RULES = AxisRules(batch=("data",), sequence=())


class MeshError(ValueError):
    """A mesh that cannot run a model (one line: the axis and why)."""


def parse_mesh(text: str) -> dict[str, int] | str:
    """``"expert=4,tensor=2"`` -> ``{"expert": 4, "tensor": 2}``; ``"auto"`` stays ``"auto"``."""
    if text.strip() == "auto":
        return "auto"
    sizes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        name = name.strip()
        if name == "context":
            raise MeshError("--mesh: inference has no context axis (a prefill piece is at most one KDA chunk); "
                            f"use {', '.join(INFERENCE_AXES)}")
        if name not in INFERENCE_AXES:
            raise MeshError(f"--mesh: unknown axis {name!r} in {text!r}; axes are {', '.join(INFERENCE_AXES)}")
        if name in sizes:
            raise MeshError(f"--mesh: axis {name} given twice in {text!r}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise MeshError(f"--mesh: {item!r} is not AXIS=N (e.g. expert=4,tensor=2)") from None
        if sizes[name] < 1:
            raise MeshError(f"--mesh: {name} must be a positive device count, got {sizes[name]}")
    if not sizes:
        raise MeshError(f"--mesh: {text!r} names no axis; give AXIS=N,... (e.g. tensor=8) or auto")
    return sizes


def head_counts(config: ModelConfig) -> dict[str, int]:
    """The head counts the ``tensor`` axis must divide: KDA query/key and value heads, MLA heads."""
    counts = {"model.kda.num_heads": config.kda.num_heads, "KDA value heads": config.kda.num_value_heads}
    if config.mla_layer_indices:
        counts["model.mla.num_heads"] = config.mla.num_heads
    return counts


def auto_mesh(config: ModelConfig, device_count: int) -> dict[str, int]:
    """A mesh over ``device_count`` devices for ``config``: ``tensor`` the largest divisor of the
    device count that divides every head count, then ``expert`` the largest divisor of what is left
    that divides the experts, the rest ``data`` (copies of the model serving different sessions)."""
    heads = math.gcd(*head_counts(config).values())
    tensor = max(d for d in range(1, device_count + 1) if device_count % d == 0 and heads % d == 0)
    rest = device_count // tensor
    experts = config.moe.num_experts
    expert = max(d for d in range(1, rest + 1) if rest % d == 0 and experts % d == 0)
    return {"data": rest // expert, "expert": expert, "tensor": tensor}


def check_mesh_fits(config: ModelConfig, sizes: Mapping[str, int]) -> None:
    """`MeshError` (one line) when ``sizes`` cannot hold the model: heads or experts that do not split."""
    tensor, expert = sizes.get("tensor", 1), sizes.get("expert", 1)
    for name, count in head_counts(config).items():
        if count % tensor:
            raise MeshError(f"--mesh tensor={tensor} does not divide {name} = {count}")
    if config.moe.num_experts % expert:
        raise MeshError(f"--mesh expert={expert} does not divide model.moe.num_experts = {config.moe.num_experts}")


@dataclasses.dataclass(frozen=True)
class Placement:
    """A model's place for running: ``mesh`` and the ``mesh_config`` that `parallelize` and the
    sharding rules read (`INFERENCE_RULES`, the dropless capacity dispatch)."""

    mesh: Mesh
    mesh_config: MeshConfig

    @property
    def rules(self) -> AxisRules:
        return self.mesh_config.rules

    def shardings(self, axes: Mapping[str, Sequence[str | None]], shapes: Mapping[str, jax.ShapeDtypeStruct]
                  ) -> dict[str, NamedSharding]:
        """``{path: NamedSharding}`` of flat arrays with these logical axes."""
        return named_shardings(axes, shapes, self.rules, self.mesh)

    def sharding(self, logical_axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
        """The NamedSharding of one array with these logical axes."""
        return NamedSharding(self.mesh, partition_spec(logical_axes, shape, self.rules, self.mesh))

    def describe(self) -> str:
        return " x ".join(f"{name}={size}" for name, size in self.mesh.shape.items() if size > 1) or "1 device"


def mesh_sizes(config: ModelConfig, mesh: str | Mapping[str, int], device_count: int) -> dict[str, int]:
    """``{axis: size}`` of ``mesh`` (``"auto"``, ``"expert=4,tensor=2"`` or ``{axis: size}``; axes
    left out are 1, except ``data``, which takes the devices left over) over ``device_count``
    devices, checked against the model (`MeshError` when it cannot hold it)."""
    sizes = parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh)
    if sizes == "auto":
        sizes = auto_mesh(config, device_count)
    if "data" not in sizes:
        given = math.prod(sizes.values())
        if device_count % given:
            raise MeshError(f"--mesh {_describe(sizes)} is {given} devices, which do not split the "
                            f"{device_count} devices there are")
        sizes = {"data": device_count // given, **sizes}
    if math.prod(sizes.values()) != device_count:
        raise MeshError(f"--mesh {_describe(sizes)} is {math.prod(sizes.values())} devices, but there are "
                        f"{device_count}")
    check_mesh_fits(config, sizes)
    return sizes


def inference_mesh_config(config: ModelConfig, sizes: Mapping[str, int]) -> MeshConfig:
    """The `MeshConfig` of running a model of ``config`` on a mesh of these axis sizes: the
    inference rules, and the routed experts expert-parallel without drops when split."""
    moe, expert = config.moe, sizes.get("expert", 1)
    return MeshConfig(data=sizes.get("data", 1), fsdp=sizes.get("fsdp", 1), expert=expert, context=1,
                      tensor=sizes.get("tensor", 1), rules=INFERENCE_RULES,
                      moe_dispatch="capacity" if expert > 1 else "local",
                      capacity_factor=moe.num_experts / moe.top_k)


def inference_placement(config: ModelConfig, mesh: str | Mapping[str, int],
                        devices: Sequence[jax.Device] | None = None) -> Placement:
    """The `Placement` of a model of ``config`` on ``mesh`` (`mesh_sizes`) over ``devices``
    (default: every device of every process). `MeshError` when it cannot hold it."""
    devices = list(jax.devices() if devices is None else devices)
    mesh_config = inference_mesh_config(config, mesh_sizes(config, mesh, len(devices)))
    return Placement(make_mesh(mesh_config, devices), mesh_config)


def _describe(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{name}={size}" for name, size in sizes.items())
