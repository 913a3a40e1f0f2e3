"""k3jax.tpu: programs compiled for a TPU generation on compile-only devices (the ``tpu`` extra).

The TPU compiler runs here, on the CPU: the KDA Pallas kernels (Mosaic) compile within the core's
VMEM, an oversized Pallas block is refused, and a tiny sharded train step fits a v5e's HBM with the
FLOPs an independent count predicts. Skipped, with the reason, where libtpu is not installed.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3jax.tpu import TargetError, compile_target, kernel_vmem_bytes, libtpu_missing, parse_topology

pytestmark = [pytest.mark.slow, pytest.mark.skipif(libtpu_missing() is not None, reason=str(libtpu_missing()))]

TOPOLOGY = "v5e:2x2"


@pytest.fixture(scope="module")
def target():
    return compile_target(TOPOLOGY)


def one_device(target):
    return NamedSharding(Mesh(np.array(target.devices[:1]), ("one",)), P())


def test_bad_topologies_are_one_line_errors():
    for name, words in (("v5e", "expected GENERATION:AxB"), ("v9:2x2", "unknown TPU generation"),
                        ("v5e:3x3", "libtpu refuses it")):
        with pytest.raises(TargetError, match=words) as error:
            compile_target(name)
        assert "\n" not in str(error.value)
    assert parse_topology("v5p:4x4x4")[1] == (4, 4, 4)


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
