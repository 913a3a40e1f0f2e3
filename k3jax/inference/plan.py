"""A memory plan for running a model, from shapes alone: per-device bytes of the weights, the
sessions' memory and one step's activations on a mesh (`plan_running`), and, for a layout that
does not fit a device, the knobs that would make it fit (`fitting_knobs`). ``python -m eval.plan``
prints it.

Nothing is allocated and no device is created: the model is built abstractly (`model_weights`,
``nnx.eval_shape``) and laid out on a `jax.sharding.AbstractMesh` by `INFERENCE_RULES`, as
`k3jax.inference.load` restores it and `k3jax.sessions` keeps its sessions. Per device, with
t the mesh's tensor size, B sessions of T tokens and a the compute dtype's bytes:

    weights       sum over the arrays of  prod(shape) / (product of the sizes of the mesh axes its
                  PartitionSpec names) * bytes per element; an array that no axis splits is
                  "replicated" (whole on every device), the others "sharded". Floating parameters
                  and LoRA adapters count in ``dtype`` (cast after loading) or as stored (fp32 in
                  trained and imported runs); router biases fp32; MXFP4 routed experts as uint8
                  codes and E8M0 scales, 1/2 + 1/32 = 17/32 bytes per weight
    KDA states    B * N_kda * HV/t * K * V * 4            fp32, split over the KDA value heads
    conv tails    B * N_kda * (W-1) * C * a               C = 2 H K + HV V; split over tensor like the heads
    MLA pages     B * ceil(T/page) * page * N_mla * L * a page = kda.chunk_size, L = kv_lora + rope;
                                                          replicated
    activations   one batched decode step of the B sessions and one prefill piece (estimates:
                  `step_activations` has the formulas)
    total         weights + sessions + the larger step's activations

The session pools are replicated over data, fsdp and expert (only the KDA states split, over
tensor): data replicas add throughput, not room for sessions. The session store grows its pools
by doubling (`k3jax.sessions.pools`), so its capacity can exceed these counts by up to 2x.
`compiled_activations` compiles the real programs for this process's devices to check the estimate.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding

from k3jax.config import MESH_AXIS_NAMES, FinetuneConfig, ModelConfig
from k3jax.inference.layout import (INFERENCE_AXES, INFERENCE_RULES, MeshError, check_mesh_fits,
                                    inference_mesh_config)
from k3jax.layers.lora import LoRA
from k3jax.layers.params import logical_axes
from k3jax.memory import format_bytes
from k3jax.model import K3Model
from k3jax.sessions import paged
from k3jax.sharding import make_mesh, parallelize
from k3jax.sharding.mesh import axes_size, partition_spec
from k3jax.training.finetune import with_adapters

MXFP4_BYTES_PER_WEIGHT = 17 / 32   # a uint8 code per two weights and an E8M0 scale per 32
ROUTED_AXES = ("experts", "expert_mlp")   # the logical axes of routed-expert weights (dense or MXFP4)


class WeightArray(NamedTuple):
    """One array of a model's state: its flat path, shape, stored dtype, logical axes, and whether
    loading with ``--dtype`` casts it (floating `nnx.Param`s and LoRA adapters, as
    `k3jax.inference.load.cast_weights` does)."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    axes: tuple[str | None, ...]
    castable: bool

    @property
    def routed(self) -> bool:
        return all(axis in self.axes for axis in ROUTED_AXES)


def abstract_running_model(model: ModelConfig, finetune: FinetuneConfig | None = None) -> nnx.Module:
    """The model ``model`` describes, with the LoRA adapters ``finetune`` attaches, as abstract
    arrays (``nnx.eval_shape``: nothing is allocated; K3: about 10 s on one CPU core)."""
    def build():
        built = K3Model(model, rngs=nnx.Rngs(0))
        return with_adapters(built, finetune, seed=0) if finetune is not None and finetune.lora else built

    return nnx.eval_shape(build)


def model_weights(model: ModelConfig, finetune: FinetuneConfig | None = None) -> tuple[WeightArray, ...]:
    """Every array of `abstract_running_model`."""
    return tuple(WeightArray("/".join(map(str, path)), tuple(variable.shape), np.dtype(variable.dtype),
                             logical_axes(variable), _castable(variable))
                 for path, variable in nnx.to_flat_state(nnx.state(abstract_running_model(model, finetune))))


def _castable(variable: nnx.Variable) -> bool:
    """Whether loading with ``--dtype`` casts it (`k3jax.inference.load.cast_weights`)."""
    return isinstance(variable, (nnx.Param, LoRA)) and jnp.issubdtype(variable.dtype, jnp.floating)


def abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
    """A mesh of these axis sizes (axes left out are 1) without devices."""
    return AbstractMesh(tuple(sizes.get(name, 1) for name in MESH_AXIS_NAMES), MESH_AXIS_NAMES)


def _spec_sizes(spec, rank: int, mesh: AbstractMesh) -> tuple[int, ...]:
    """How many ways each of an array's ``rank`` dimensions splits under PartitionSpec ``spec``."""
    entries = tuple(spec) + (None,) * (rank - len(spec))
    return tuple(axes_size(mesh, (entry,) if isinstance(entry, str) else entry or ()) for entry in entries)


def shard_shape(axes: Sequence[str | None], shape: Sequence[int], mesh: AbstractMesh) -> tuple[int, ...]:
    """One device's block of an array with these logical axes (`INFERENCE_RULES`)."""
    ways = _spec_sizes(partition_spec(axes, shape, INFERENCE_RULES, mesh), len(shape), mesh)
    return tuple(size // split for size, split in zip(shape, ways))


def local_width(axis: str, size: int, mesh: AbstractMesh) -> int:
    """``size`` divided by the mesh axes the logical ``axis`` splits it over (a width on one device)."""
    return shard_shape((axis,), (size,), mesh)[0]


def _layer_of(path: str) -> str:
    """The layer an array belongs to: ``body/layers/3/mixer/q_proj`` -> ``body/layers/3``; a
    top-level array (``embedding``) is its own."""
    parts = path.split("/")
    return "/".join(parts[: parts.index("layers") + 2]) if "layers" in parts else path


class WeightBytes(NamedTuple):
    """One device's weight bytes: whole ``replicated`` arrays, its blocks of the ``sharded`` ones,
    ``cast``: its floating weights in the compute dtype when they are held in another (the casts
    XLA may materialise), ``gathered``: the largest layer's fsdp-split weights whole (fsdp > 1),
    ``sliced``: the two largest routed-expert arrays of one scanned layer (this device's blocks),
    which the scan slices out of the stacked weights into copies where the expert product is a
    kernel (on TPU: the ragged dot, a Mosaic kernel, reads whole operands; the gate and up
    projections are sliced together)."""

    replicated: float
    sharded: float
    cast: float
    gathered: float
    sliced: float = 0.0

    @property
    def total(self) -> float:
        return self.replicated + self.sharded


def weight_bytes(weights: Sequence[WeightArray], mesh: AbstractMesh, dtype: str | None, compute_dtype: str,
                 mxfp4_experts: bool) -> WeightBytes:
    """`WeightBytes` of ``weights`` on ``mesh``, floating weights in ``dtype`` (None: as stored);
    with ``mxfp4_experts``, floating routed-expert weights count as packed MXFP4 (17/32 B per
    weight: what ``model.moe.expert_format=mxfp4`` would hold)."""
    replicated = sharded = cast = 0.0
    layers: dict[str, float] = {}
    routed: dict[str, list[float]] = {}
    compute = np.dtype(compute_dtype)
    for array in weights:
        spec = partition_spec(array.axes, array.shape, INFERENCE_RULES, mesh)
        ways = _spec_sizes(spec, len(array.shape), mesh)
        local = math.prod(array.shape) // math.prod(ways)
        if mxfp4_experts and array.routed and jnp.issubdtype(array.dtype, jnp.floating):
            size = local * MXFP4_BYTES_PER_WEIGHT
        else:
            held = np.dtype(dtype) if dtype and array.castable else array.dtype
            size = local * held.itemsize
            cast += local * compute.itemsize if array.castable and held != compute else 0
        if math.prod(ways) == 1:
            replicated += size
        else:
            sharded += size
        depth = array.shape[0] if array.axes[:1] == ("layers",) else 1
        if any("fsdp" in ((entry,) if isinstance(entry, str) else entry or ()) for entry in spec):
            layers[_layer_of(array.path)] = layers.get(_layer_of(array.path), 0.0) + size * mesh.shape["fsdp"] / depth
        if array.routed and depth > 1:
            routed.setdefault(_layer_of(array.path), []).append(size / depth)
    sliced = max((sum(sorted(sizes)[-2:]) for sizes in routed.values()), default=0.0)
    return WeightBytes(replicated, sharded, cast, max(layers.values(), default=0.0), sliced)


class Block(NamedTuple):
    """One device's block of an array: its shape and bytes per element."""

    shape: tuple[int, ...]
    itemsize: int

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


class SessionBytes(NamedTuple):
    """One device's blocks of B sessions' memory: KDA states, conv tails, MLA latent pages."""

    kda_states: Block
    conv_tails: Block
    mla_pages: Block

    @property
    def total(self) -> int:
        return sum(block.bytes for block in self)


def session_bytes(model: ModelConfig, mesh: AbstractMesh, batch: int, context: int) -> SessionBytes:
    """One device's blocks of the pools `k3jax.sessions.paged.empty_pools` lays out for ``batch``
    slots and ``batch * ceil(context / page)`` pages (`POOL_AXES`, the inference rules); the MLA
    pages' block as [layers, pages, page, L] (a page is one row of the pool, whole on every device)."""
    page = model.kda.chunk_size
    pools = paged.empty_pools(model, batch, batch * math.ceil(context / page), page)
    state, conv, latent = (Block(shard_shape(axes, array.shape, mesh), np.dtype(array.dtype).itemsize)
                           for axes, array in zip(paged.POOL_AXES, pools))
    return SessionBytes(state, conv, latent._replace(shape=(*latent.shape[:2], page, latent.shape[2] // page)))


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _moe_layers(model: ModelConfig) -> int:
    return model.num_layers - model.dense_layers


class StepShape(NamedTuple):
    """What one call runs on one device (the letters of `step_activations`)."""

    rows: int         # R: sequences in the call (the decode batch bucket: padding rows run too)
    local_rows: int   # r: this device's rows (R split over data where it divides)
    tokens: int       # tau: this device's token rows
    sequences: int    # s: sequences whose pages one MLA layer reads here
    dispatched: int   # n: token rows this device sends into the expert dispatch
    slots: int        # S: cache slots of the page bucket


def step_shape(model: ModelConfig, mesh: AbstractMesh, batch: int, context: int, prefill: bool) -> StepShape:
    """The `StepShape` of a decode step of ``batch`` sessions (R = next_pow2(B), r = R/D, tau = r,
    s = r, n = ceil(R / (e D))) or of a prefill piece of one session (R = 1, tau = c = kda.chunk_size,
    s = 1, n = ceil(c / (e D))), at ``context`` tokens: S = next_pow2(ceil(T / page)) * page."""
    chunk, data, expert = model.kda.chunk_size, mesh.shape["data"], mesh.shape["expert"]
    rows = 1 if prefill else next_power_of_two(batch)
    local_rows = rows if rows % data else rows // data
    tokens = chunk if prefill else local_rows
    return StepShape(rows, local_rows, tokens, 1 if prefill else local_rows,
                     math.ceil(rows * (chunk if prefill else 1) / (expert * data)),
                     next_power_of_two(math.ceil(context / chunk)) * chunk)


def _kda_layer(model: ModelConfig, mesh: AbstractMesh, shape: StepShape, prefill: bool, a: int) -> float:
    kda = model.kda
    heads, value_heads = local_width("heads", kda.num_heads, mesh), local_width("value_heads", kda.num_value_heads, mesh)
    projections = shape.tokens * (2 * heads + 4 * value_heads) * kda.head_dim * (a + 4)
    if prefill:
        return projections + value_heads * kda.chunk_size * (kda.chunk_size + 4 * kda.head_dim) * 4
    return projections + 2 * shape.local_rows * value_heads * kda.head_dim * kda.head_dim * 4


def _mla_layer(model: ModelConfig, mesh: AbstractMesh, shape: StepShape, a: int) -> float:
    mla = model.mla
    if not model.mla_layer_indices:
        return 0.0
    block = key_block(model, shape.slots)
    per_token = 2 * mla.qk_head_dim + 2 * mla.latent_width + mla.value_head_dim + 2 * block
    return (2 * shape.sequences * block * mla.latent_width * a
            + shape.tokens * local_width("heads", mla.num_heads, mesh) * per_token * 4)


def key_block(model: ModelConfig, slots: int) -> int:
    """bk: the cache slots `k3jax.ops.attention.paged_attention` reads at a time over pages of the
    session store's page size (c, the KDA chunk) for a page bucket of ``slots`` S."""
    page = model.kda.chunk_size
    return min(slots, max(1, model.mla.attention_block_size // page) * page)


def _ffn_layer(model: ModelConfig, mesh: AbstractMesh, shape: StepShape, a: int) -> float:
    moe, tokens, expert = model.moe, shape.tokens, mesh.shape["expert"]
    dense = tokens * (model.d_model + 3 * local_width("mlp", model.dense_width, mesh)) * a if model.dense_layers else 0
    if not _moe_layers(model):
        return dense
    latent = moe.latent_dim or model.d_model
    hidden = local_width("expert_mlp", moe.expert_width, mesh)
    shared = local_width("mlp", moe.shared_width, mesh) if moe.shared_width else 0
    routed = tokens * (2 * moe.num_experts * 4 + (2 * latent + 3 * shared) * a)
    if expert > 1:
        routed += moe.num_experts * shape.dispatched * (4 * latent + 3 * hidden) * a
    elif moe.expert_matmul == "dense":
        routed += (tokens * moe.num_experts * (latent + 3 * hidden) + 3 * moe.num_experts * latent * hidden) * a
    else:
        routed += tokens * moe.top_k * (2 * latent + 3 * hidden) * a
    if moe.expert_format == "mxfp4":
        routed += 2 * min(moe.expert_tile, moe.num_experts // expert) * latent * hidden * a
    return max(dense, routed)


def step_activations(model: ModelConfig, mesh: AbstractMesh, batch: int, context: int, weights: WeightBytes,
                     prefill: bool) -> float:
    """An estimate of one device's live activation and temporary bytes in one batched decode step
    of ``batch`` sessions at ``context`` tokens (``prefill`` False) or in one prefill piece of one
    session (True: at most one KDA chunk of c tokens): the largest set one layer holds at once
    (the layers run one after another; XLA frees a layer's intermediates before the next) plus what
    the whole call holds,

        step = stream + max(KDA, MLA, FFN) + logits + casts + gathered + sliced + sampling (decode) | bank (prefill)

    a the compute dtype's bytes; e, D the mesh's expert and data sizes; "/t" a width divided by the
    mesh axes its logical axis takes (heads, vocabulary, FFN and expert widths: tensor); R, r, tau,
    s, n, S the rows, this device's rows and token rows, gathered sequences, dispatched tokens and
    cache slots of `step_shape`:

        stream   = (N_src + 3) tau d 4              the fp32 residual stream: block-AttnRes sources
                                                    (N_src = ceil(L / block), else 0), the partial
                                                    sum, a layer's input and its normed copy
        KDA      = tau (2H + 4HV)/t K (a + 4)       q, k, v, forget gate, output gate and output in
                                                    the compute dtype and fp32
                   + 2 r HV/t K V 4                 decode: the rows' states read and written
                   + HV/t c (c + 4K) 4              prefill: one chunk's intra-chunk matrices
        MLA      = 2 s bk L a                       one key block of pages read from the pool, and
                                                    its value slice (bk = `key_block`: the pages of
                                                    blk slots, at most S; the pages are read where
                                                    they lie, never gathered whole)
                   + tau H/t (2(n+rho) + 2L + V + 2 bk) 4   queries, absorbed queries, mixed
                                                    latents, outputs, a key block's scores and weights
        FFN      = max(dense: tau (d + 3F/t) a,
                       MoE: tau (2E 4 + (2l + 3F_sh/t) a)   router scores, latent down/up, shared
                            + E n (4l + 3m/t) a     e > 1: the capacity dispatch at capacity factor
                                                    E/k (C = n rows per expert and device): send,
                                                    receive, expert-output and return buffers and
                                                    the hidden units
                            | tau k (2l + 3m/t) a   e = 1 with ragged_dot: the sorted rows
                            | tau E (l + 3m/t) a + 3 E l m/t a   e = 1 with dense experts: every
                                                    expert on every token, the weights side by side
                            + 2 tile l m/t a)       MXFP4: one tile of experts decoded
        logits   = tau V/t (a + 4)
        casts    = `WeightBytes.cast`               weights held in another dtype than the compute
                                                    dtype, cast (XLA may hoist the casts of the
                                                    scanned layers' weights out of the loop)
        gathered = `WeightBytes.gathered`           fsdp > 1: one layer's weights all-gathered
        sliced   = `WeightBytes.sliced`             a scanned layer's gate and up routed experts
                                                    sliced out of the stacked weights (on TPU the
                                                    expert product is a kernel, and XLA copies its
                                                    operands out of the stack: 2 x 288 MiB of the
                                                    609 MiB Kimi Linear's compiled decode step
                                                    holds at tensor=4)
        sampling = 4 R V 4                          decode: the last logits sorted for top-k / top-p
        bank     = 2 (N_kda HV/t K V 4 + N_kda (W-1) C a)   prefill: the session's KDA states and
                                                    conv tails gathered and scattered back (its MLA
                                                    pages are read and written in the pool)

    An estimate: compilers fuse and schedule differently. Against XLA:CPU's compiled programs
    (`compiled_activations`; the tiny and micro configs, 8 to 32 sessions of 1K to 4K tokens) it
    was 0.9x-1.5x what they allocate on one or two devices in fp32; with an expert axis GSPMD also
    split the sessions' rows over it and the programs took 0.4x-0.6x of the estimate; XLA:CPU
    computes bf16 in fp32, so its bf16 programs took 2.2x-2.4x the estimate.
    """
    a = np.dtype(model.compute_dtype).itemsize
    shape = step_shape(model, mesh, batch, context, prefill)
    kda = model.kda
    num_mla = len(model.mla_layer_indices)
    num_kda = model.num_layers - num_mla
    sources = math.ceil(model.num_layers / model.attn_res.block_size) if model.attn_res.kind == "block" else 0
    stream = (sources + 3) * shape.tokens * model.d_model * 4
    layer = max(_kda_layer(model, mesh, shape, prefill, a), _mla_layer(model, mesh, shape, a),
                _ffn_layer(model, mesh, shape, a))
    logits = shape.tokens * local_width("vocab", model.vocab_size, mesh) * (a + 4)
    if prefill:
        value_heads = local_width("value_heads", kda.num_value_heads, mesh)
        whole = 2 * (num_kda * value_heads * kda.head_dim * kda.head_dim * 4 + num_kda * (kda.conv_size - 1) * kda.conv_width * a)
    else:
        whole = 4 * shape.rows * model.vocab_size * 4
    return stream + layer + logits + weights.cast + weights.gathered + weights.sliced + whole


@dataclasses.dataclass(frozen=True)
class RunningPlan:
    """One device's bytes for running ``batch`` sessions of ``context`` tokens on a mesh of
    ``sizes``, weights in ``dtype`` (None: as stored), computing in ``compute_dtype``."""

    sizes: dict
    batch: int
    context: int
    dtype: str | None
    compute_dtype: str
    weights: WeightBytes
    sessions: SessionBytes
    decode: float
    prefill: float
    device_memory: float | None

    @property
    def devices(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def total(self) -> float:
        return self.weights.total + self.sessions.total + max(self.decode, self.prefill)

    @property
    def fits(self) -> bool | None:
        """Whether the total fits ``device_memory`` (None: no memory given)."""
        return None if self.device_memory is None else self.total <= self.device_memory


def plan_running(model: ModelConfig, weights: Sequence[WeightArray], sizes: dict[str, int], batch: int,
                 context: int, dtype: str | None = None, device_memory: float | None = None) -> RunningPlan:
    """The `RunningPlan` of ``model`` (its arrays ``weights``, `model_weights`) on a mesh of
    ``sizes`` (`k3jax.inference.layout.mesh_sizes`) for ``batch`` sessions of ``context`` tokens,
    floating weights cast to ``dtype`` (None: as stored; given, it is also the compute dtype, as
    ``--dtype`` sets it when loading), against ``device_memory`` bytes per device (None: no verdict)."""
    held = weight_bytes(weights, abstract_mesh(sizes), dtype, dtype or model.compute_dtype,
                        model.moe.expert_format == "mxfp4")
    return _planned(model, sizes, held, batch, context, dtype, device_memory)


def _planned(model: ModelConfig, sizes: dict[str, int], held: WeightBytes, batch: int, context: int,
             dtype: str | None, device_memory: float | None) -> RunningPlan:
    """`plan_running` with the weights' bytes already counted."""
    running = model if dtype is None else dataclasses.replace(model, compute_dtype=dtype)
    mesh = abstract_mesh(sizes)
    decode, prefill = (step_activations(running, mesh, batch, context, held, prefill) for prefill in (False, True))
    return RunningPlan(dict(sizes), batch, context, dtype, running.compute_dtype, held,
                       session_bytes(running, mesh, batch, context), decode, prefill, device_memory)


def mesh_layouts(model: ModelConfig, devices: int, replicas: bool = True) -> list[dict[str, int]]:
    """Every mesh of ``devices`` devices over the inference axes that can hold ``model``
    (`check_mesh_fits`), as ``{axis: size}``; without ``replicas`` only those with data = 1."""
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    layouts = []
    for fsdp, expert, tensor in itertools.product(divisors, repeat=3):
        if devices % (fsdp * expert * tensor) or (not replicas and fsdp * expert * tensor < devices):
            continue
        sizes = {"data": devices // (fsdp * expert * tensor), "fsdp": fsdp, "expert": expert, "tensor": tensor}
        try:
            check_mesh_fits(model, sizes)
        except MeshError:
            continue
        layouts.append(sizes)
    return layouts


def describe_mesh(sizes: dict[str, int]) -> str:
    """``expert=8,tensor=8`` (axes of size 1 left out; ``data=1`` for one device)."""
    return ",".join(f"{axis}={sizes[axis]}" for axis in INFERENCE_AXES if sizes.get(axis, 1) > 1) or "data=1"


def _best_mesh(model: ModelConfig, weights, plan: RunningPlan, devices: int, replicas: bool) -> RunningPlan | None:
    """The plan on the mesh of ``devices`` devices (`mesh_layouts`) with the smallest total that
    fits, if any."""
    plans = [plan_running(model, weights, sizes, plan.batch, plan.context, plan.dtype, plan.device_memory)
             for sizes in mesh_layouts(model, devices, replicas)]
    fitting = [candidate for candidate in plans if candidate.fits]
    return min(fitting, key=lambda candidate: candidate.total, default=None)


def _largest_fitting(fits, low: int, high: int) -> int | None:
    """The largest n in [low, high] with ``fits(n)`` (monotone: true up to some n), or None."""
    if not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def fitting_knobs(model: ModelConfig, weights: Sequence[WeightArray], plan: RunningPlan,
                  max_devices: int = 4096) -> list[str]:
    """What would make ``plan`` fit its device memory, each alone: fewer sessions (the most that
    fit), a shorter context (the longest, in whole pages), another mesh of the same devices (the
    one with the smallest total), ``--dtype bfloat16`` (floating weights held in fp32), MXFP4
    routed experts (dense ones), more devices (the fewest, doubling up to ``max_devices``, and
    their mesh without data replicas, which hold everything again)."""
    def fits(batch: int, context: int) -> bool:
        return _planned(model, plan.sizes, plan.weights, batch, context, plan.dtype, plan.device_memory).fits

    knobs = []
    batch = _largest_fitting(lambda b: fits(b, plan.context), 1, plan.batch - 1) if plan.batch > 1 else None
    if batch:
        knobs.append(f"--batch {batch}")
    page = model.kda.chunk_size
    pages = math.ceil(plan.context / page)
    fitting_pages = _largest_fitting(lambda p: fits(plan.batch, p * page), 1, pages - 1) if pages > 1 else None
    if fitting_pages:
        knobs.append(f"--context {fitting_pages * page}")
    other = _best_mesh(model, weights, plan, plan.devices, replicas=True)
    if other is not None:
        knobs.append(f"--mesh {describe_mesh(other.sizes)} ({_size(other.total)})")
    if (plan.dtype or "float32") != "bfloat16" and any(w.castable and w.dtype == np.float32 for w in weights):
        cast = plan_running(model, weights, plan.sizes, plan.batch, plan.context, "bfloat16", plan.device_memory)
        if cast.fits:
            knobs.append(f"--dtype bfloat16 ({_size(cast.total)})")
    if model.moe.expert_format == "dense" and _moe_layers(model) and model.moe.expert_matmul == "ragged_dot":
        packed_model = dataclasses.replace(model, moe=dataclasses.replace(model.moe, expert_format="mxfp4"))
        packed = plan_running(packed_model, weights, plan.sizes, plan.batch, plan.context, plan.dtype,
                              plan.device_memory)
        if packed.fits:
            knobs.append(f"model.moe.expert_format=mxfp4 (MXFP4 experts: {_size(packed.total)})")
    devices = plan.devices * 2
    while devices <= max_devices:
        more = _best_mesh(model, weights, plan, devices, replicas=False)
        if more is not None:
            knobs.append(f"{devices} devices (--mesh {describe_mesh(more.sizes)}: {_size(more.total)})")
            break
        devices *= 2
    return knobs


def refusal(model: ModelConfig, weights: Sequence[WeightArray], plan: RunningPlan) -> str | None:
    """One line refusing a plan that does not fit its device memory, naming what it holds and the
    knobs that would make it fit (`fitting_knobs`); None when it fits or no memory is given."""
    if plan.fits is not False:
        return None
    knobs = fitting_knobs(model, weights, plan)
    step = max(plan.decode, plan.prefill)
    sessions = f"{plan.batch} session{'s' * (plan.batch > 1)} of {plan.context} tokens"
    return (f"{sessions} on --mesh {describe_mesh(plan.sizes)} do{'es' * (plan.batch == 1)} not fit: "
            f"{_size(plan.total)} per device > {_size(plan.device_memory)} (weights {_size(plan.weights.total)}, "
            f"sessions {_size(plan.sessions.total)}, activations {_size(step)}); "
            + ("it would fit with " + ", or ".join(knobs) if knobs else
               "no batch, context, mesh, dtype or device count up to 4096 makes it fit"))


def _size(value: float) -> str:
    return format_bytes(value).strip()


def compiled_activations(model: ModelConfig, sizes: dict[str, int], batch: int, context: int,
                         dtype: str | None = None, finetune: FinetuneConfig | None = None,
                         devices: Sequence[jax.Device] | None = None) -> tuple[float, float]:
    """``(decode, prefill)``: the temporaries plus the new outputs (``memory_analysis()``: temp +
    output - aliased) of the session store's compiled batched decode step of ``batch`` sessions at
    ``context`` tokens and of one prefill piece, on the first ``prod(sizes)`` of ``devices``
    (default: this process's; fake CPU devices or compile-only TPU devices will do), from abstract
    weights and pools: the figures `step_activations` estimates, as that platform's compiler
    allocates them."""
    if dtype is not None:
        model = dataclasses.replace(model, compute_dtype=dtype)
    mesh_config = inference_mesh_config(model, sizes)
    mesh = make_mesh(mesh_config, list(devices or jax.devices())[: math.prod(sizes.values())])

    def placed(axes, shape, kind):
        return jax.ShapeDtypeStruct(shape, kind, sharding=NamedSharding(mesh, partition_spec(axes, shape,
                                                                                            INFERENCE_RULES, mesh)))

    def held(variable):
        kind = dtype if dtype is not None and _castable(variable) else variable.dtype
        return placed(logical_axes(variable), variable.shape, kind)

    graphdef, state = nnx.split(parallelize(abstract_running_model(model, finetune), mesh, mesh_config))
    state = nnx.from_flat_state([(path, v.replace(held(v))) for path, v in nnx.to_flat_state(state)])
    graph, page = paged.StaticGraph(graphdef), model.kda.chunk_size
    rows, pages = next_power_of_two(batch), next_power_of_two(math.ceil(context / page))
    shapes = paged.empty_pools(model, rows, batch * pages, page)
    pools = paged.Pools(*(placed(axes, s.shape, s.dtype) for axes, s in zip(paged.POOL_AXES, shapes)))

    def ints(*shape, kind=jnp.int32):
        return jax.ShapeDtypeStruct(shape, kind)

    sampling = paged.RowSampling(ints(rows, kind=jnp.uint32), ints(rows, kind=jnp.uint32),
                                 ints(rows, kind=jnp.float32), ints(rows), ints(rows, kind=jnp.float32))
    decode = paged.decode_step.lower(graph, state, pools, ints(rows), ints(rows, pages), ints(rows),
                                     ints(rows, model.vocab_size, kind=jnp.float32), sampling)
    prefill = paged.prefill_piece.lower(graph, state, pools, ints(), ints(pages), ints(), ints(page))
    return tuple(_new_bytes(program.compile().memory_analysis()) for program in (decode, prefill))


def _new_bytes(memory) -> float:
    return float(memory.temp_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes)
