"""Running a model on a mesh of 8 fake CPU devices (expert=4 x tensor=2) equals running it on one:
``tests/sharding/programs/inference_mesh.py`` in a subprocess (the device count is fixed when JAX
starts). One process: the slow set runs it beside other tests, not alone as it runs the
cooperating processes of `serial`."""
import pytest

from tests.sharding.test_multi_device import program, program_result

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def result():
    return program_result(program("inference_mesh"))


def test_weights_split_over_every_device(result):
    sizes = result["bytes"]
    assert result["mesh"] == "expert=4 x tensor=2" and sizes["devices"] == 8
    assert sizes["largest_device"] <= 1.15 * sizes["total"] / 8 + sizes["replicated"], sizes
    assert sizes["replicated"] < 0.01 * sizes["total"], sizes      # norms, gates, routers only


def test_eval_generate_and_sessions_equal_one_device(result):
    assert result["logits"] <= 1e-5 and result["store_logits"] <= 1e-5
    assert result["eval_keys"] and result["eval"] <= 1e-5, result["eval"]     # MQAR recall, perplexity
    assert result["generate"] and result["sampled"]
    assert result["store"] == {key: True for key in ("greedy", "sampled", "fork", "after_rollback", "after_load",
                                                   "speculative", "tiers")}
    assert result["tiers_counts"] == [dict.fromkeys(("spills_to_host", "spills_to_disk", "loads_from_host",
                                                     "loads_from_disk", "prefix_hits"), True)] * 2
    # KDA states and conv tails over the heads, the MLA latent replicated; no program moved them
    assert result["pool_specs"] == ["P(None, None, 'tensor', None, None)",
                                    "P(None, None, None, 'tensor')", "P(None, None, None)"]
    assert result["pools_kept"]


def test_bfloat16_weights(result):
    assert result["bf16_dtypes"] == ["bfloat16", "float32"]     # router biases stay float32
    assert result["bf16_sharded_alike"] and result["bf16_logits"] <= 0.05, result["bf16_logits"]


def test_kda_and_splash_attention_run_on_each_devices_heads():
    """`HeadParallel` (tests/sharding/programs/head_parallel.py): every KDA op and MLA's splash
    attention on data=2 x tensor=4 equal the op on whole arrays (splash: XLA's attention), gradients
    too, and so does the micro K3 with splash attention; parallelize sets it on every mesh but where
    the heads and channels would split unalike or a context axis splits the sequence."""
    found = program_result(program("head_parallel"))
    kda_ops = {f"{impl}/{op}" for impl in ("chunk", "pallas", "tpu-pallas")
               for op in ("kda", "kda_step", "kda_pool_step", "conv_pool_step")}
    assert set(found["errors"]) == kda_ops | {"splash/attention"}
    assert found["splash_model"] <= 1e-5, found["splash_model"]
    assert found["mla_layers"] == {"data=2,tensor=4": ["4"], "context=2,tensor=4": ["None"]}
    assert max(found["errors"].values()) <= 1e-5, found["errors"]
    assert max(found["gradients"].values()) <= 1e-5, found["gradients"]
    assert found["pool_spec"] == ["P(None, 'tensor')"]          # each device updated its own heads' rows
    assert found["layers"] == {"data=2,tensor=4": ["4"], "data=8": ["1"],   # rows split, heads whole
                               "tensor=8": ["None"],             # 4 heads but 8-way channels: whole arrays
                               "context=2,tensor=4": ["None"]}   # the context-parallel calls instead
