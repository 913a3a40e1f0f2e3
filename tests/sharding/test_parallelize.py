"""`k3jax.sharding.parallelize`: parallelism is set on a built model from outside, as static
module attributes that jit sees (one device; tests/sharding/test_multi_device.py runs 8)."""
import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import MeshConfig, MoEConfig, load_config
from k3jax.layers.moe import MoE
from k3jax.model import DecoderLayer, K3Model
from k3jax.sharding import ExpertDispatch, MeshLayout, make_mesh, parallelize
from tests.helpers import MICRO, ROOT
from tests.ops.numpy_moe import capacity_dropped

MODEL_CODE = [*sorted((ROOT / "k3jax" / "layers").rglob("*.py")), *sorted((ROOT / "k3jax" / "ops").rglob("*.py")),
              ROOT / "k3jax" / "model.py"]
MESH = make_mesh(MeshConfig(), jax.devices()[:1])


def imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_model_layers_and_ops_do_not_import_the_sharding_package():
    assert len(MODEL_CODE) > 10
    for path in MODEL_CODE:
        parallel = {name for name in imported_modules(path) if name.startswith(("k3jax.sharding", "k3jax.expert"))}
        assert not parallel, (path, parallel)


def micro_model():
    config = load_config(MICRO).model
    return nnx.eval_shape(lambda: K3Model(config, rngs=nnx.Rngs(0)))


def modules_of(model, kind):
    return [module for _, module in nnx.iter_modules(model) if isinstance(module, kind)]


def test_parallelize_sets_every_layout_and_moe_dispatch_and_changes_the_graph():
    model = micro_model()
    built = nnx.split(model)[0]
    assert {m.expert_dispatch for m in modules_of(model, MoE)} == {None}
    capacity = MeshConfig(moe_dispatch="capacity", capacity_factor=2.0)
    assert parallelize(model, MESH, capacity) is model
    moe_layers, decoder_layers = modules_of(model, MoE), modules_of(model, DecoderLayer)
    assert len(moe_layers) == 3 and len(decoder_layers) == 4          # micro K3: layer 0 is dense
    assert {m.expert_dispatch for m in moe_layers} == {ExpertDispatch(MESH, capacity)}
    assert {m.activation_layout for m in (model, *decoder_layers)} == {MeshLayout(MESH, capacity.rules)}
    on_capacity = nnx.split(model)[0]
    parallelize(model, MESH, MeshConfig(moe_dispatch="local"))
    assert {m.expert_dispatch for m in moe_layers} == {None}
    graphs = [built, on_capacity, nnx.split(model)[0]]
    assert all(a != b for i, a in enumerate(graphs) for b in graphs[i + 1:])


def test_parallelize_needs_a_concrete_mesh():
    with pytest.raises(ValueError, match="needs a concrete jax.sharding.Mesh, got AbstractMesh"):
        parallelize(micro_model(), MESH.abstract_mesh, MeshConfig())


def test_a_jitted_moe_is_retraced_for_each_dispatch_it_is_given():
    """The same nnx.jit function on the same layer: no dispatch, a tight capacity (drops what the
    NumPy capacity rule drops), an ample one (drops nothing and equals the local computation)."""
    moe = MoE(16, MoEConfig(num_experts=8, top_k=2, expert_width=6, latent_dim=8), init_std=0.5, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 16, 16))
    traces = []

    @nnx.jit
    def run(layer, x):
        traces.append(layer.expert_dispatch)
        y, stats = layer(x)
        indices, _, _ = layer.router(x.reshape(-1, 16))
        return y, stats.dropped, indices

    y_local, dropped_local, indices = run(moe, x)
    parallelize(moe, MESH, MeshConfig(moe_dispatch="capacity", capacity_factor=0.25))
    _, dropped_tight, _ = run(moe, x)
    parallelize(moe, MESH, MeshConfig(moe_dispatch="capacity", capacity_factor=4.0))
    y_ample, dropped_ample, _ = run(moe, x)
    assert len(traces) == 3
    assert float(dropped_local) == float(dropped_ample) == 0
    expected = capacity_dropped(indices, shards=1, num_experts=8, capacity_factor=0.25)
    assert expected > 0 and float(dropped_tight) == expected
    np.testing.assert_allclose(y_ample, y_local, rtol=1e-6, atol=1e-6 * float(jnp.abs(y_local).max()))
