"""k3jax.tpu: programs compiled for a TPU generation on compile-only devices (the ``tpu`` extra).

The TPU compiler runs here, on the CPU: the KDA Pallas kernels (Mosaic) compile within the core's
VMEM, an oversized Pallas block is refused, and a tiny sharded train step fits a v5e's HBM with the
FLOPs an independent count predicts (slow; skipped, with the reason, where libtpu is not installed).
The arithmetic (topology names, the roofline, the traced FLOP count) is checked everywhere.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3jax.tpu import (CHIPS, Target, TargetError, compile_target, implied_mfu, kernel_vmem_bytes, libtpu_missing,
                       matmul_flops, parse_topology, roofline_seconds)

needs_libtpu = pytest.mark.skipif(libtpu_missing() is not None, reason=str(libtpu_missing()))

TOPOLOGY = "v5e:2x2"


def test_topology_names_parse_or_fail_in_one_line():
    assert parse_topology("v5p:4x4x4") == (CHIPS["v5p"], (4, 4, 4))
    assert parse_topology("TPU7x:2x2x1") == (CHIPS["tpu7x"], (2, 2, 1))
    for name, words in (("v5e", "expected GENERATION:AxB"), ("v9:2x2", "unknown TPU generation 'v9'"),
                        ("v5e:2x", "expected GENERATION:AxB")):
        with pytest.raises(TargetError, match=words) as error:
            parse_topology(name)
        assert "\n" not in str(error.value)


def test_roofline_and_mfu_per_device_of_a_two_core_chip():
    """TPU7x: 2 devices per chip, so each has half the chip's peak and bandwidth."""
    target = Target("tpu7x:2x2x1", CHIPS["tpu7x"], 4, tuple(range(8)))
    assert target.devices_per_chip == 2 and target.device_hbm == 96 * 2**30
    flops, bytes_accessed = 2307e12 / 2, 7380e9 / 2 * 3   # 1 s of compute, 3 s of HBM traffic
    assert roofline_seconds(flops, bytes_accessed, target) == pytest.approx(3.0)
    assert implied_mfu(flops, 3.0, target) == pytest.approx(1 / 3)


def test_matmul_flops_counts_scans_times_their_length():
    """2 n^3 per product, times the scan's 10 steps; the cond's costlier branch; none for elementwise."""
    def step(x, w):
        return jnp.tanh(x @ w), None

    def program(x, ws, flag):
        y = jax.lax.scan(step, x, ws)[0]
        return jax.lax.cond(flag, lambda y: y @ y @ y, lambda y: y, y)

    n = 32
    jaxpr = jax.make_jaxpr(program)(jnp.zeros((n, n)), jnp.zeros((10, n, n)), True)
    assert matmul_flops(jaxpr) == 2 * n**3 * (10 + 2)


@pytest.fixture(scope="module")
def target():
    return compile_target(TOPOLOGY)


def one_device(target):
    return NamedSharding(Mesh(np.array(target.devices[:1]), ("one",)), P())


@pytest.mark.slow
@needs_libtpu
def test_a_topology_libtpu_refuses_is_one_line():
    with pytest.raises(TargetError, match="libtpu refuses it") as error:
        compile_target("v5e:3x3")                                       # not whole hosts of 2x2 chips
    assert "\n" not in str(error.value)


@pytest.mark.slow
@needs_libtpu
def test_kda_pallas_kernels_compile_within_vmem(target):
    """Forward and backward Mosaic kernels at Kimi Linear's head shape (128) and chunk (64)."""
    from k3jax.ops.kda import kda

    sharding = one_device(target)
    token = (1, 256, 4, 128)
    args = [jax.ShapeDtypeStruct(token, dtype, sharding=sharding)
            for dtype in (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, jnp.float32)]
    args.append(jax.ShapeDtypeStruct(token[:3], jnp.float32, sharding=sharding))

    def loss(*inputs):
        return kda(*inputs, implementation="pallas", chunk_size=64)[0].astype(jnp.float32).sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile()
    vmem = kernel_vmem_bytes(compiled)
    assert len(vmem) == 2                                               # the forward and the backward kernel
    assert all(0 < used < target.chip.vmem_bytes for used in vmem)


@pytest.mark.slow
@needs_libtpu
def test_an_oversized_pallas_block_is_refused(target):
    """An 8192 x 8192 fp32 block (256 MiB, double-buffered in and out) cannot fit 128 MiB of VMEM."""
    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    def call(x, block):
        spec = pl.BlockSpec((block, block), lambda i: (i, 0))
        return pl.pallas_call(copy, grid=(x.shape[0] // block,), in_specs=[spec], out_specs=spec,
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    x = jax.ShapeDtypeStruct((16384, 8192), jnp.float32, sharding=one_device(target))
    assert jax.jit(lambda x: call(x, 512)).lower(x).compile() is not None
    with pytest.raises(Exception, match="(?i)vmem|exceed|memory"):
        jax.jit(lambda x: call(x, 8192)).lower(x).compile()


@pytest.mark.slow
@needs_libtpu
def test_tiny_sharded_train_step_fits_and_counts_its_flops(target):
    """The tiny K3's train step (AdamW: less to compile than Muon) over 4 v5e devices (fsdp=4): its
    compiled bytes per device are positive and below the chip's HBM; the compiler's FLOPs and the traced matmul FLOPs
    (`k3jax.tpu.matmul_flops`) are both within [1, 2] x the model's own count (`k3jax.flops`: 2 per
    weight per token, attention and KDA by formula, x 3 for the backward), since the implementation
    does more than the model needs (full squares of the chunk form and attention, every expert on
    every token: 1.38-1.46x on XLA:CPU; measured here 1.29x and 1.34x). The step has no loop of more
    than one trip (4 layers are one period, 64 tokens one KDA chunk), so the compiler's count, which
    takes a loop body once, covers all of it."""
    from k3jax.config import load_config
    from k3jax.flops import training_flops
    from k3jax.training.plan import plan_train_step
    from tests.helpers import CONFIGS

    config = load_config(CONFIGS / "tiny.yaml", ["mesh.fsdp=4", "mesh.data=1", "optimizer.name=adamw"])
    plan = plan_train_step(config, devices=target.devices)
    assert 0 < plan.peak + plan.generated_code < target.device_hbm
    assert plan.arguments >= plan.parameters + plan.optimizer_state
    model = training_flops(config.model, config.data.seq_len).total * plan.tokens_per_step / plan.devices
    assert 1.0 * model <= plan.flops <= 2.0 * model, (plan.flops, model)
    assert 1.0 * model <= plan.matmul_flops <= 2.0 * model, (plan.matmul_flops, model)


@pytest.mark.slow
@needs_libtpu
def test_splash_attention_compiles_head_parallel_under_a_mesh(target):
    """The tiny K3 with MLA's splash attention, its heads over tensor=2 of 4 v5e devices: the train
    step compiles (the Mosaic kernel on whole arrays is refused: "Mosaic kernels cannot be
    automatically partitioned"; `parallelize` runs it on each device's heads)."""
    from k3jax.config import load_config
    from k3jax.training.plan import plan_train_step
    from tests.helpers import CONFIGS

    config = load_config(CONFIGS / "tiny.yaml", ["mesh.tensor=2", "mesh.data=2", "optimizer.name=adamw",
                                                 "model.mla.attention_implementation=splash", "data.seq_len=128"])
    plan = plan_train_step(config, devices=target.devices)
    assert 0 < plan.peak + plan.generated_code < target.device_hbm
