"""Where a model runs: ``--mesh`` parsed and checked against the model before anything loads,
``--dtype`` casting the weights after they are verified (the 8-device runs are in
tests/sharding/test_inference_mesh.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import load_config
from k3jax.inference import InputError, MeshError, load_run
from k3jax.inference.layout import auto_mesh, inference_mesh_config, mesh_sizes, parse_mesh
from k3jax.layers.moe import RouterBias
from tests.helpers import CONFIGS, rel_err

K3 = load_config(CONFIGS / "k3.yaml").model


def test_parse_mesh():
    assert parse_mesh("expert=4,tensor=2") == {"expert": 4, "tensor": 2}
    assert parse_mesh(" auto ") == "auto"
    for text, message in [("context=2", "no context axis"), ("pipe=2", "unknown axis 'pipe'"),
                          ("tensor=2,tensor=4", "given twice"), ("tensor=x", "not AXIS=N"), ("tensor=0", "positive"),
                          (",", "names no axis")]:
        with pytest.raises(MeshError, match=message):
            parse_mesh(text)


def test_mesh_sizes_fill_data_and_refuse_what_does_not_split():
    assert mesh_sizes(K3, "expert=8,tensor=8", 128) == {"data": 2, "expert": 8, "tensor": 8}
    heads, experts = K3.kda.num_heads, K3.moe.num_experts
    with pytest.raises(MeshError, match="expert=8,tensor=8 is 64 devices, which do not split the 96"):
        mesh_sizes(K3, "expert=8,tensor=8", 96)
    with pytest.raises(MeshError, match=f"tensor=7 does not divide model.kda.num_heads = {heads}"):
        mesh_sizes(K3, {"tensor": 7}, 7)
    with pytest.raises(MeshError, match=f"expert=5 does not divide model.moe.num_experts = {experts}"):
        mesh_sizes(K3, {"expert": 5}, 5)
    with pytest.raises(MeshError, match="data=2,tensor=2 is 4 devices, but there are 8"):
        mesh_sizes(K3, {"data": 2, "tensor": 2}, 8)


def test_auto_mesh_splits_heads_then_experts():
    """tensor: the largest divisor of the device count dividing every head count; expert: of the rest."""
    sizes = auto_mesh(K3, 64)
    heads = np.gcd.reduce([K3.kda.num_heads, K3.kda.num_value_heads, K3.mla.num_heads])
    assert sizes["tensor"] == max(d for d in (1, 2, 4, 8, 16, 32, 64) if heads % d == 0)
    assert sizes["data"] * sizes["expert"] * sizes["tensor"] == 64
    assert K3.moe.num_experts % sizes["expert"] == 0


def test_experts_split_only_without_drops():
    config = inference_mesh_config(K3, {"expert": 8, "tensor": 8})
    assert config.moe_dispatch == "capacity" and config.capacity_factor * K3.moe.top_k >= K3.moe.num_experts
    assert inference_mesh_config(K3, {"tensor": 8}).moe_dispatch == "local"


def test_bad_mesh_is_one_line_before_loading(untrained_run, capsys):
    from eval.generate import main
    assert main([str(untrained_run.path), "--prompt", "1 2", "--mesh", "tensor=2"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --mesh tensor=2 is 2 devices, which do not split the 1 devices there are\n"
    with pytest.raises(InputError, match="--mesh: unknown axis"):
        load_run(str(untrained_run.path), mesh="rows=1")


def test_bfloat16_weights_after_verification(untrained_run):
    """Every parameter is the stored one rounded to bfloat16; router biases stay float32; the
    model computes in bfloat16, its logits near the float32 model's."""
    stored, half = load_run(str(untrained_run.path)), load_run(str(untrained_run.path), dtype="bfloat16")
    assert half.config.model.compute_dtype == "bfloat16" and half.model.config.compute_dtype == "bfloat16"
    expected = dict(nnx.to_flat_state(nnx.state(stored.model, nnx.Param)))
    for path, variable in nnx.to_flat_state(nnx.state(half.model, nnx.Param)):
        assert variable.dtype == jnp.bfloat16, path
        np.testing.assert_array_equal(np.asarray(variable.get_value()),
                                      np.asarray(expected[path].get_value().astype(jnp.bfloat16)), err_msg=str(path))
    assert {variable.dtype for _, variable in nnx.to_flat_state(nnx.state(half.model, RouterBias))} == {jnp.dtype(jnp.float32)}
    tokens = np.arange(1, 17, dtype=np.int32)[None] % untrained_run.config.model.vocab_size
    logits = [np.asarray(jax.jit(lambda m, t: m(t).logits)(run.model, tokens)) for run in (stored, half)]
    assert rel_err(logits[1], logits[0]) < 0.05


@pytest.mark.parametrize("flags, message", [
    (["--num-processes", "2", "--process-id", "0"], "--num-processes and --process-id need --coordinator-address"),
    (["--coordinator-address", "127.0.0.1:1", "--num-processes", "0"], "--num-processes must be at least 1, got 0"),
    (["--coordinator-address", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
     r"--process-id must be in \[0, 2\), got 2"),
    (["--coordinator-address", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"],
     "several processes run one model on a mesh: give --mesh"),
])
def test_bad_process_flags_are_one_line_before_joining(untrained_run, flags, message):
    from eval.flags import join_processes
    from eval.generate import parse_args
    with pytest.raises(InputError, match=message):
        join_processes(parse_args([str(untrained_run.path), "--prompt", "1", *flags]))


def test_processes_that_read_other_state_dirs_all_refuse_and_say_which():
    from eval.serve.cli import disagreement
    assert disagreement(["read ab", "read ab", "read ab"]) is None
    assert disagreement(["read ab", "read cd", "read cd"]) == (
        "processes 1, 2 of 3 read other stored responses there than process 0: every process must read one "
        "directory (on several hosts, a shared filesystem)")
    assert disagreement(["read ab", "error no such file", "read cd"]) == "process 1 of 3 could not read it"
