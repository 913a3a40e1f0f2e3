"""Config schema: the shipped files (SPEC §6), overrides, base files, one-line errors."""
import pytest

from k3jax.config import ConfigError, load_config
from tests.helpers import CONFIGS


def load(name, *overrides):
    return load_config(CONFIGS / name, list(overrides)).model


def test_k3_matches_spec_table():
    m = load("k3.yaml")
    assert (m.num_layers, m.d_model, m.vocab_size) == (93, 7168, 163840)
    assert m.mla_layer_indices == tuple(range(3, 92, 4)) + (92,) and len(m.mla_layer_indices) == 24
    assert (m.kda.num_heads, m.kda.head_dim, m.kda.conv_size, m.kda.gate, m.kda.lower_bound, m.kda.output_gate) == \
        (96, 128, 4, "lower_bound", -5.0, "full")
    assert (m.mla.num_heads, m.mla.q_lora_rank, m.mla.kv_lora_rank, m.mla.output_gate) == (96, 1536, 512, True)
    assert (m.mla.nope_head_dim, m.mla.rope_head_dim, m.mla.value_head_dim) == (128, 64, 128)
    assert (m.attn_res.kind, m.attn_res.block_size, m.dense_width, m.activation) == ("block", 12, 33792, "situ")
    assert (m.moe.num_experts, m.moe.top_k, m.moe.expert_width, m.moe.latent_dim, m.moe.latent_norm) == \
        (896, 16, 3072, 3584, True)
    assert (m.moe.shared_width, m.moe.routed_scale, m.moe.balancing) == (6144, 1.0, "quantile")


def test_kimi_linear_matches_spec_table():
    m = load("kimi-linear-48b.yaml")
    assert (m.num_layers, m.d_model, m.vocab_size) == (27, 2304, 163840)
    assert m.mla_layer_indices == (3, 7, 11, 15, 19, 23, 26)
    assert (m.kda.num_heads, m.kda.gate, m.kda.output_gate) == (32, "softplus", "low_rank")
    assert (m.mla.num_heads, m.mla.q_lora_rank, m.mla.output_gate, m.attn_res.kind) == (32, None, False, "none")
    assert (m.dense_width, m.activation, m.moe.num_experts, m.moe.top_k, m.moe.expert_width) == \
        (9216, "swiglu", 256, 8, 1024)
    assert (m.moe.latent_dim, m.moe.shared_width, m.moe.routed_scale, m.moe.balancing) == (None, 1024, 2.446, "sign")


def test_tiny_inherits_from_k3_and_keeps_every_feature():
    m = load("tiny.yaml")
    assert m.mla_layer_indices == (3,) and m.num_layers == 4
    assert m.kda.gate == "lower_bound" and m.kda.output_gate == "full"
    assert m.mla.q_lora_rank is not None and m.mla.output_gate
    assert m.attn_res.kind == "block" and m.dense_layers == 1 and m.activation == "situ"
    assert m.moe.latent_dim is not None and m.moe.latent_norm and m.moe.shared_width and m.moe.balancing == "quantile"
    assert m.vocab_size == 640 and m.compute_dtype == "float32"


def test_overrides_parse_yaml_scalars_and_lists():
    m = load("tiny.yaml", "model.moe.top_k=3", "model.num_layers=8", "model.mla_layers=[3,7]", "model.kda.lower_bound=-3",
             "model.compute_dtype=bfloat16", "model.mla.q_lora_rank=null")
    assert (m.moe.top_k, m.mla_layers, m.kda.lower_bound, m.compute_dtype) == (3, (3, 7), -3.0, "bfloat16")
    assert m.mla.q_lora_rank is None


@pytest.mark.parametrize("override, key, words", [
    ("model.moe.topk=4", "model.moe.topk", "did you mean 'top_k'"),
    ("model.attn_res.kindd=none", "model.attn_res.kindd", "did you mean 'kind'"),
    ("modle.d_model=8", "modle", "did you mean 'model'"),
    ("model.moe.top_k=5", "model.moe.top_k", "num_experts = 4"),
    ("model.kda.value_heads=3", "model.kda.value_heads", "multiple of num_heads"),
    ("model.mla_layers=[1,2]", "model.mla_layers", "last layer 3"),
    ("model.mla_layers=[3,5]", "model.mla_layers", "outside"),
    ("model.kda.gate=sofplus", "model.kda.gate", "did you mean 'softplus'"),
    ("model.kda.lower_bound=2", "model.kda.lower_bound", "negative"),
    ("model.d_model=0", "model.d_model", "positive"),
    ("model.num_layers=eight", "model.num_layers", "expected int"),
    ("model.moe.latent_dim=null", "model.moe.latent_norm", "latent_dim"),
    ("model.attn_res.kind=blocks", "model.attn_res.kind", "did you mean 'block'"),
    ("model.kda=3", "model.kda", "mapping"),
    ("model.kda.chunk_size=48", "model.kda.chunk_size", "power of two >= 16"),
    ("model.kda.implementation=xla", "model.kda.implementation", "'auto'"),
    ("finetune.lora_rank=-2", "finetune.lora_rank", "non-negative"),
    ("finetune.lora_dropout=1.5", "finetune.lora_dropout", "[0, 1)"),
    ("finetune.lora_alpha=0", "finetune.lora_alpha", "positive"),
    ("finetune.lora_targets=['axis:']", "finetune.lora_targets[0]", "axis:NAME"),
    ("finetune.lora_rnak=4", "finetune.lora_rnak", "did you mean 'lora_rank'"),
])
def test_errors_are_one_line_and_name_the_dotted_key(override, key, words):
    with pytest.raises(ConfigError) as info:
        load("tiny.yaml", override)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{key}: ") and words in message, message
    assert isinstance(info.value, ValueError) and info.value.key == key


@pytest.mark.parametrize("implementation", ["auto", "reference", "chunk", "pallas"])
def test_kda_implementation_is_selectable(implementation):
    assert load("tiny.yaml", f"model.kda.implementation={implementation}").kda.implementation == implementation


def test_missing_key_bad_override_and_base_loops(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="includes itself"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("model:\n  d_model: 8\n")
    with pytest.raises(ConfigError, match=r"^model.vocab_size: required key is missing$"):
        load_config(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(CONFIGS / "tiny.yaml", ["model.d_model"])
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


def test_finetune_defaults_to_full_training_and_scales_lora_by_alpha_over_rank():
    assert not load_config(CONFIGS / "tiny.yaml").finetune.lora
    finetune = load_config(CONFIGS / "tiny.yaml", ["finetune.lora_rank=8", "finetune.lora_alpha=4"]).finetune
    assert finetune.lora and finetune.lora_scale == 0.5
    assert finetune.lora_targets == ("mixer/*_proj", "ffn/shared/w_*", "ffn/w_*") and not finetune.update_router_bias


def _alias_bomb(levels: int = 7) -> str:
    """A YAML value whose aliases expand to 9^levels leaves (never expanded by a correct loader; the
    old error message expanded it: 4.6 GB at 9^9)."""
    rows = ["[&l0 [x, x, x, x, x, x, x, x, x]"]
    rows += [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return ", ".join(rows) + "]"


@pytest.mark.parametrize("where", ["optimizer:\n  learning_rate: {bomb}\n", "model:\n  kda:\n    implementation: {bomb}\n",
                                   "finetune:\n  lora_targets: {bomb}\n", "? {bomb}\n: 1\n"])
def test_an_alias_bomb_is_refused_in_one_short_line_without_expanding_it(tmp_path, where):
    path = tmp_path / "bomb.yaml"
    path.write_text(f"base: {CONFIGS / 'tiny.yaml'}\n" + where.format(bomb=_alias_bomb()))
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert len(str(error.value)) < 600 and "\n" not in str(error.value)


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1e999"])
def test_non_finite_numbers_are_refused(value):
    with pytest.raises(ConfigError, match="optimizer.learning_rate: must be a finite number"):
        load_config("configs/tiny.yaml", [f"optimizer.learning_rate={value}"])


def test_non_utf8_and_deeply_nested_files_are_one_line_errors(tmp_path):
    (tmp_path / "latin1.yaml").write_bytes("run_dir: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(tmp_path / "latin1.yaml")
    (tmp_path / "deep.yaml").write_text("run_dir: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(tmp_path / "deep.yaml")
