"""Typed, frozen configuration: YAML files + ``key=value`` overrides, validated into dataclasses.

    cfg = load_config("configs/tiny.yaml", overrides=["model.num_layers=8", "model.mla_layers=[3,7]"])
    cfg.model.kda.num_heads

A YAML file may name another as ``base: other.yaml`` (relative to itself); its keys are merged
over the base's (mappings merge key by key, everything else is replaced). Overrides are
``dotted.key=value`` with the value parsed as a YAML scalar or list.

Every section is a frozen dataclass; the loader converts nested mappings by the dataclass field
types, so a later section (train, data, ...) is one more dataclass field on `Config`. An unknown
key, a wrong type or an invalid value raises a one-line `ConfigError` naming the full dotted key
(with a close-match suggestion for misspelt keys).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import pathlib
import reprlib
import types
import typing
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """An invalid configuration: ``key`` is the dotted path of the offending entry."""

    def __init__(self, key: str, message: str):
        self.key, self.message = key, message
        super().__init__(f"{key}: {message}" if key else message)

    def under(self, prefix: str) -> "ConfigError":
        """The same error with its key placed under section ``prefix``."""
        return ConfigError(f"{prefix}.{self.key}" if self.key else prefix, self.message)


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(key, message)


# Counts beyond any model: every per-layer and per-expert structure is refused above these before
# it is built (a config.json with 10^7 layers once took 17 GB of host memory before any error).
MAX_LAYERS = 4096
MAX_EXPERTS = 65536


def _at_most(section, name: str, limit: int) -> None:
    value = getattr(section, name)
    _require(value <= limit, name, f"{value} is more than any model has (at most {limit})")


def _positive(section, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None:
            _require(value > 0, name, f"must be positive, got {value}")


# ---------------------------------------------------------------------------------------------
# Model schema (SPEC §§1-6)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention (SPEC §1). The low-rank gates have rank ``head_dim``."""

    num_heads: int                        # H (query/key heads)
    head_dim: int                         # K = V
    value_heads: int | None = None        # HV = m * H (grouped values); None: H
    conv_size: int = 4                    # W, causal depthwise conv taps
    gate: Literal["softplus", "lower_bound"] = "lower_bound"
    lower_bound: float = -5.0             # b of the lower_bound gate
    output_gate: Literal["full", "low_rank"] = "full"
    output_norm_eps: float = 1e-5         # of the per-head output RMSNorm (SPEC §1.6)
    chunk_size: int = 64                  # tokens per chunk, a power of two >= 16 (k3jax.ops.kda.kda)
    # the KDA kernels of the forward, the one-token decode and the pooled decode (k3jax.ops.kda);
    # auto: Pallas kernels where lowered for a GPU, the XLA forms on CPU and TPU (k3jax.ops.kda)
    implementation: Literal["auto", "reference", "chunk", "pallas"] = "auto"

    def __post_init__(self):
        _positive(self, "num_heads", "head_dim", "value_heads", "conv_size", "chunk_size", "output_norm_eps")
        _require(self.value_heads is None or self.value_heads % self.num_heads == 0, "value_heads",
                 f"{self.value_heads} is not a multiple of num_heads = {self.num_heads}")
        _require(self.lower_bound < 0, "lower_bound", f"must be negative, got {self.lower_bound}")
        _require(self.chunk_size >= 16 and self.chunk_size & (self.chunk_size - 1) == 0, "chunk_size",
                 f"must be a power of two >= 16, got {self.chunk_size}")

    @property
    def num_value_heads(self) -> int:
        return self.value_heads or self.num_heads

    @property
    def key_width(self) -> int:
        """P = H K, the width of the q and k projections."""
        return self.num_heads * self.head_dim

    @property
    def value_width(self) -> int:
        """HV V, the width of the v projection, the gates and the output."""
        return self.num_value_heads * self.head_dim

    @property
    def conv_width(self) -> int:
        """Channels of the q|k|v short convolution (and of its carried tail)."""
        return 2 * self.key_width + self.value_width


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Gated Multi-head Latent Attention without positional encoding (SPEC §2)."""

    num_heads: int
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None        # None: a full-rank query projection
    nope_head_dim: int = 128              # n
    rope_head_dim: int = 64               # r (learned, never rotated)
    value_head_dim: int = 128             # V
    output_gate: bool = False             # o <- o * sigmoid(W_g x)
    norm_eps: float = 1e-6                # of the q_a / kv_a RMSNorms
    attention_implementation: Literal["dense", "xla", "cudnn", "splash"] | None = None   # None: by platform
    attention_block_size: int = 512       # query / key block of the xla (blockwise) attention

    def __post_init__(self):
        _positive(self, "num_heads", "kv_lora_rank", "q_lora_rank", "nope_head_dim", "value_head_dim", "norm_eps",
                  "attention_block_size")
        _require(self.rope_head_dim >= 0, "rope_head_dim", f"must be non-negative, got {self.rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.nope_head_dim + self.rope_head_dim

    @property
    def latent_width(self) -> int:
        """Values cached per token: the latent c plus the shared key slice k_r."""
        return self.kv_lora_rank + self.rope_head_dim


@dataclasses.dataclass(frozen=True)
class AttnResConfig:
    """Residual stream (SPEC §3): ``block`` Attention Residuals or the plain PreNorm ``none``."""

    kind: Literal["block", "none"] = "block"
    block_size: int = 12                  # layers per block

    def __post_init__(self):
        _positive(self, "block_size")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Routed experts (SPEC §4): Stable LatentMoE when ``latent_dim`` is set, else plain MoE."""

    num_experts: int
    top_k: int
    expert_width: int                     # m
    latent_dim: int | None = None         # l; None: plain MoE
    latent_norm: bool = False             # RMSNorm before W_up (Stable LatentMoE)
    num_shared_experts: int = 0           # one shared GLU of width num_shared_experts * m
    routed_scale: float = 1.0
    router_score: Literal["sigmoid", "softmax"] = "sigmoid"   # s = sigmoid(W_r x) or softmax over experts
    renormalize: bool = True              # p = s_sel / sum(s_sel) * routed_scale; false: p = s_sel * routed_scale
    expert_groups: int = 1                # grouped top-k (DeepSeek-V3): E experts in this many equal groups,
    topk_groups: int = 1                  # the best `topk_groups` groups by their top-2 biased scores, top-k in them
    router_bias_in_weights: bool = False  # the Kimi Linear HF quirk (SPEC §4); vLLM's behaviour is False
    balancing: Literal["quantile", "sign"] = "quantile"
    bias_update_rate: float = 1e-3        # of the `sign` balancer
    quantile_bins: int | None = None      # `quantile` from per-expert histograms of this many bins, summed
                                          # over data-parallel shards; None: exact, from all token scores
    expert_matmul: Literal["ragged_dot", "dense"] = "ragged_dot"   # dense: every expert on every token
    # Routed experts' storage: "dense" (in the model's dtype) or "mxfp4" (packed E2M1 codes + E8M0 scales,
    # SPEC §7, frozen: `k3jax.ops.mxfp4`), decoded `expert_tile` experts at a time by the XLA path or
    # inside the Pallas grouped matmul (`mxfp4_implementation`; auto: XLA until the TPU kernel is verified).
    expert_format: Literal["dense", "mxfp4"] = "dense"
    expert_tile: int = 8
    mxfp4_implementation: Literal["auto", "xla", "pallas"] = "auto"

    def __post_init__(self):
        _at_most(self, "num_experts", MAX_EXPERTS)
        _positive(self, "num_experts", "top_k", "expert_width", "latent_dim", "routed_scale", "bias_update_rate",
                  "quantile_bins", "expert_groups", "topk_groups", "expert_tile")
        _require(self.expert_format != "mxfp4" or self.expert_matmul == "ragged_dot", "expert_matmul",
                 "mxfp4 experts are decoded per tile by the grouped (ragged_dot) matmul; 'dense' would decode them all")
        _require(self.num_shared_experts >= 0, "num_shared_experts", f"must be non-negative, got {self.num_shared_experts}")
        _require(self.top_k < self.num_experts, "top_k",
                 f"must be below num_experts = {self.num_experts} (the balancer ranks a top-(k+1)), got {self.top_k}")
        _require(not self.latent_norm or self.latent_dim is not None, "latent_norm",
                 "needs a latent_dim (plain MoE has no latent norm)")
        _require(self.num_experts % self.expert_groups == 0, "expert_groups",
                 f"must divide num_experts = {self.num_experts}, got {self.expert_groups}")
        _require(self.topk_groups <= self.expert_groups, "topk_groups",
                 f"must be at most expert_groups = {self.expert_groups}, got {self.topk_groups}")
        _require(self.expert_groups == 1 or self.num_experts // self.expert_groups >= 2, "expert_groups",
                 f"groups need at least 2 experts each (a group scores by its top 2), got "
                 f"{self.num_experts // self.expert_groups}")
        selectable = self.topk_groups * (self.num_experts // self.expert_groups)
        _require(selectable > self.top_k, "topk_groups",
                 f"the {self.topk_groups} selected groups hold {selectable} experts, need more than "
                 f"top_k = {self.top_k} (the balancer ranks a top-(k+1))")

    @property
    def shared_width(self) -> int | None:
        return self.num_shared_experts * self.expert_width or None


def periodic_mla_layers(num_layers: int, period: int, last_layer: bool) -> tuple[int, ...]:
    """The MLA layers of the periodic placement: p-1, 2p-1, ... below ``num_layers``, plus the
    last layer when ``last_layer``; increasing."""
    layers = set(range(period - 1, num_layers, period))
    if last_layer:
        layers.add(num_layers - 1)
    return tuple(sorted(layers))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The K3 stack (SPEC §§0-6)."""

    vocab_size: int
    d_model: int
    num_layers: int
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig
    dense_width: int                      # width of the dense FFN of the first `dense_layers` layers
    mla_period: int = 4                   # layers p-1, 2p-1, ... are MLA (3 KDA : 1 MLA for p = 4)
    mla_layers: tuple[int, ...] | None = None   # explicit MLA layers (replaces mla_period's placement)
    last_layer_full_attention: bool = True
    dense_layers: int = 1
    activation: Literal["situ", "swiglu"] = "situ"
    situ_beta: float = 4.0                # SiTU-GLU (SPEC §4): beta of the gate factor,
    situ_linear_beta: float | None = 25.0  # beta_lin of the linear factor (None: u passes unclipped)
    attn_res: AttnResConfig = AttnResConfig()
    norm_eps: float = 1e-5
    init_std: float = 0.02                # linear weights, truncated normal
    embed_init_std: float = 1.0
    tie_embeddings: bool = False          # true: lm_head is the transposed embedding (one parameter)
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    # Activation checkpointing of the scanned period (`k3jax.model.REMAT_POLICIES`): "none" keeps
    # every activation for the backward pass, "full" keeps only the residual stream entering each
    # period and recomputes the rest, "dots" also keeps the matmul outputs.
    remat: Literal["none", "full", "dots"] = "none"

    def __post_init__(self):
        _at_most(self, "num_layers", MAX_LAYERS)
        _positive(self, "vocab_size", "d_model", "num_layers", "dense_width", "mla_period", "norm_eps",
                  "init_std", "embed_init_std", "situ_beta", "situ_linear_beta")
        _require(0 <= self.dense_layers <= self.num_layers, "dense_layers",
                 f"must be in [0, num_layers = {self.num_layers}], got {self.dense_layers}")
        if self.mla_layers is not None:
            for index in self.mla_layers:
                _require(0 <= index < self.num_layers, "mla_layers",
                         f"layer {index} is outside [0, num_layers = {self.num_layers})")
            _require(list(self.mla_layers) == sorted(set(self.mla_layers)), "mla_layers",
                     f"must be increasing without repeats, got {list(self.mla_layers)}")
            _require(not self.last_layer_full_attention or self.num_layers - 1 in self.mla_layers, "mla_layers",
                     f"must end with the last layer {self.num_layers - 1} when last_layer_full_attention is set")

    @property
    def mla_layer_indices(self) -> tuple[int, ...]:
        """The MLA layers, in order: the explicit list, or every `mla_period`-th layer (plus the last)."""
        if self.mla_layers is not None:
            return tuple(self.mla_layers)
        return periodic_mla_layers(self.num_layers, self.mla_period, self.last_layer_full_attention)

    def is_mla(self, layer: int) -> bool:
        return layer in self.mla_layer_indices

    def is_dense(self, layer: int) -> bool:
        return layer < self.dense_layers

    @property
    def pattern_period(self) -> int:
        """Layers per repeating unit of the mixer pattern and the AttnRes blocks (for scanning)."""
        if self.attn_res.kind == "block":
            return math.lcm(self.mla_period, self.attn_res.block_size)
        return self.mla_period


# ---------------------------------------------------------------------------------------------
# Run schema: data, optimizer, training loop, checkpoints, logging
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Training data: the embedded MQAR task (`k3jax.data.MQARDataset`), local text
    (`k3jax.data.TextDataset`: text, JSONL or Parquet files, a directory or a glob), token shards
    written by ``python -m k3jax.data.prepare`` (`k3jax.data.TokensDataset`), conversations in
    K3's chat format (`k3jax.data.ChatDataset`: JSONL or Parquet ``messages`` records), or prompts
    with answers for reinforcement learning (`k3jax.data.PromptDataset`: ``prompt`` or ``messages``
    records with an ``answer``; ``train.objective=grpo``), or preference pairs
    (`k3jax.data.PreferenceDataset`: ``prompt`` or ``messages`` records with ``chosen`` and
    ``rejected`` replies; ``train.objective`` dpo, ipo, orpo or simpo)."""

    kind: Literal["mqar", "text", "tokens", "chat", "prompts", "preferences"] = "mqar"
    seq_len: int = 128
    seed: int = 0
    prefetch: int = 2                     # batches read ahead of the train step on a thread; 0: off
    # mqar
    num_pairs: int = 16
    num_keys: int = 256
    num_values: int = 256
    num_queries: int | None = None
    num_filler: int = 0
    noise_vocab_size: int = 64
    # text and tokens
    path: str | None = None               # text: file, directory or glob; tokens: prepare's output directory
    jsonl_field: str = "text"             # the text's JSON field, or Parquet column
    tokenizer: str | None = None          # a tiktoken BPE file (K3's tiktoken.model); None: bytes
    heldout_fraction: float = 0.05
    # chat and chat prompts (path, tokenizer and heldout_fraction as for text; the tokenizer must name K3's markers)
    chat_loss: Literal["assistant", "all"] = "assistant"    # which tokens the loss counts
    chat_overflow: Literal["truncate", "drop"] = "truncate"  # a conversation (preferences: a pair) longer than seq_len + 1
    chat_thinking: bool = True                              # render the <think> channel (K3's default)
    chat_thinking_effort: Literal["low", "high", "max"] | None = "max"   # None: no thinking-effort note

    def __post_init__(self):
        _positive(self, "seq_len", "num_pairs", "num_keys", "num_values", "num_queries")
        _require(self.kind == "mqar" or self.path is not None, "path",
                 f"{self.kind} data needs a path ({'file, directory or glob' if self.kind != 'tokens' else 'a prepared directory'})")
        _require(0.0 <= self.heldout_fraction < 1.0, "heldout_fraction", f"must be in [0, 1), got {self.heldout_fraction}")
        _require(self.prefetch >= 0, "prefetch", f"must be non-negative (0: off), got {self.prefetch}")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """`k3jax.training.optim`: AdamW, or per-head Muon for matrices with AdamW for the rest."""

    name: Literal["adamw", "muon"] = "adamw"
    learning_rate: float = 1e-3
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2           # wsd: the final fraction of steps that decays
    schedule_steps: int | None = None     # the schedule's horizon; None: train.steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float | None = 1.0         # global norm; None: no clipping

    def __post_init__(self):
        _positive(self, "learning_rate", "eps", "grad_clip", "schedule_steps")
        _require(self.warmup_steps >= 0, "warmup_steps", f"must be non-negative, got {self.warmup_steps}")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        _require(0.0 < self.decay_fraction <= 1.0, "decay_fraction", f"must be in (0, 1], got {self.decay_fraction}")
        _require(self.weight_decay >= 0, "weight_decay", f"must be non-negative, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            _require(0.0 <= getattr(self, name) < 1.0, name, f"must be in [0, 1), got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training loop. ``objective``: ``lm`` minimises the masked next-token loss of the data;
    ``grpo`` is reinforcement learning on prompts (`k3jax.training.rl`, settings in `RLConfig`):
    a step samples ``rl.prompts_per_step`` x ``rl.group_size`` completions, rewards them and makes
    ``rl.updates_per_rollout`` optimizer updates on them (``batch_size`` is then unused); ``dpo``,
    ``ipo``, ``orpo`` and ``simpo`` tune on preference pairs (`k3jax.training.preference`, settings
    in `PreferenceConfig`, ``data.kind=preferences``)."""

    objective: Literal["lm", "grpo", "dpo", "ipo", "orpo", "simpo"] = "lm"
    steps: int = 1000
    batch_size: int = 32                  # sequences per optimizer step (global)
    grad_accum: int = 1                   # micro-batches per step
    seed: int = 0                         # parameter initialisation
    log_every: int = 10
    eval_batches: int = 8                 # held-out batches of each evaluation (at the end, and every eval_every)
    eval_every: int = 0                   # evaluate on the held-out split every N steps too; 0: only at the end
    max_nonfinite_steps: int = 5          # consecutive skipped steps before the run stops
    compilation_cache: str | None = "~/.cache/k3jax/xla"   # persistent XLA cache; None: off
    resume_step: int | None = None        # resume from this checkpoint; None: the newest one that restores
    allow_data_change: bool = False       # resume even though the data settings or content changed

    def __post_init__(self):
        _positive(self, "steps", "batch_size", "grad_accum", "log_every", "max_nonfinite_steps")
        _require(self.resume_step is None or self.resume_step >= 0, "resume_step",
                 f"must be non-negative, got {self.resume_step}")
        _require(self.eval_batches >= 0, "eval_batches", f"must be non-negative, got {self.eval_batches}")
        _require(self.eval_every >= 0, "eval_every", f"must be non-negative (0: off), got {self.eval_every}")
        _require(not self.eval_every or self.eval_batches, "eval_every",
                 f"{self.eval_every} needs train.eval_batches > 0 (the batches each evaluation reads)")
        _require(self.batch_size % self.grad_accum == 0, "grad_accum",
                 f"must divide batch_size = {self.batch_size}, got {self.grad_accum}")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints in ``<run_dir>/checkpoints``."""

    every: int = 200                      # steps between saves (also at the end and on SIGTERM/SIGINT)
    keep: int = 3                         # most recent checkpoints kept
    async_save: bool = True

    def __post_init__(self):
        _positive(self, "every", "keep")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    progress: bool = True                 # a progress bar on stderr
    tensorboard: bool = False             # event files in <run_dir>/tensorboard (needs tensorboardX)
    peak_tflops: float | None = None      # the device's peak for utilisation; None: measured matmul rate

    def __post_init__(self):
        _positive(self, "peak_tflops")


# Default adapter targets: every KDA / MLA projection, the shared experts, the dense FFN.
DEFAULT_LORA_TARGETS = ("mixer/*_proj", "ffn/shared/w_*", "ffn/w_*")


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """LoRA fine-tuning on a frozen base (`k3jax.training.finetune`); ``lora_rank`` 0 trains every parameter.

    ``lora_targets`` select the adapted weights among those a layer can adapt (`k3jax.layers.lora`):
    a glob over the weight's parameter path matched at any depth (``mixer/q_proj`` matches
    ``body/layers/0/mixer/q_proj``), or ``axis:NAME``, every adaptable weight with logical axis NAME.
    ``lora_routed_experts`` also adapts the routed experts (one A [in, r] shared by the experts,
    B [E, r, out] per expert). The routers' selection biases stay frozen unless
    ``update_router_bias``: then the aux-free balancer keeps updating them (they never have
    optimizer state either way)."""

    lora_rank: int = 0
    lora_alpha: float = 16.0              # the adapter output is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0             # dropout on the adapter's input while training
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    lora_routed_experts: bool = False
    update_router_bias: bool = False

    def __post_init__(self):
        _require(self.lora_rank >= 0, "lora_rank", f"must be non-negative (0: full fine-tuning), got {self.lora_rank}")
        _positive(self, "lora_alpha")
        _require(0.0 <= self.lora_dropout < 1.0, "lora_dropout", f"must be in [0, 1), got {self.lora_dropout}")
        _require(self.lora_rank == 0 or bool(self.lora_targets) or self.lora_routed_experts, "lora_targets",
                 "names no weight to adapt")
        for index, target in enumerate(self.lora_targets):
            _require(bool(target.strip()) and target != "axis:", f"lora_targets[{index}]",
                     f"must be a path glob or axis:NAME, got {target!r}")

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank


Rollback = Literal["states", "replay"]   # how rejected drafts are undone (`SpeculationConfig.rollback`)
ROLLBACKS = typing.get_args(Rollback)


@dataclasses.dataclass(frozen=True)
class SpeculationConfig:
    """Speculative decoding (`k3jax.sessions.speculate`; the rules: `k3jax.speculative`), declared
    once for every program that decodes: ``rl.speculation`` of a GRPO run and the flags of
    ``eval.generate``, ``eval.chat`` and ``eval.serve`` (the ``flag`` of each field; `eval.flags`).

    Drafts come from ``prompt_lookup`` (what followed the latest earlier occurrence of the last n
    tokens, n <= this) or from ``draft``, a smaller model: the newest checkpoint of that run
    directory, which must read the same token ids (`k3jax.inference.load.draft_mismatch`); at most
    one of the two, neither: no speculation. Up to ``k`` drafts a round (adapted per sequence when
    ``adaptive``); rejected ones undone as ``rollback`` says: ``states`` (the verify keeps every
    position's KDA state; faster) or ``replay`` (the kept tokens are fed again; no per-position
    memory). Greedy output is unchanged; sampled output keeps its distribution."""

    prompt_lookup: int | None = dataclasses.field(default=None, metadata={
        "flag": "--prompt-lookup", "metavar": "N",
        "help": "draft by prompt lookup: copy what followed the last n-gram (n <= N) earlier in the sequence"})
    draft: str | None = dataclasses.field(default=None, metadata={
        "flag": "--draft", "metavar": "RUN_DIR", "help": "draft with a smaller model: a run directory with the same tokenizer"})
    k: int = dataclasses.field(default=4, metadata={
        "flag": "--speculate-k", "metavar": "K", "help": "drafts per round, at most (adapted per sequence)"})
    rollback: Rollback = dataclasses.field(default="states", metadata={
        "flag": "--speculate-rollback",
        "help": "undo rejected drafts from the verify's per-position KDA states (states, faster) or by "
                "replaying the kept tokens (replay: no per-position memory)"})
    adaptive: bool = dataclasses.field(default=True, metadata={
        "flag": "--speculate-adaptive",
        "help": "adapt each sequence's draft length to its acceptance, pausing drafting where it fails "
                "(--no-speculate-adaptive: always k)"})

    def __post_init__(self):
        _positive(self, "prompt_lookup", "k")
        _require(self.prompt_lookup is None or self.draft is None, "draft",
                 "drafts come from prompt_lookup or a draft model, not both: unset one")
        _require(self.draft is None or bool(self.draft.strip()), "draft", "must name a run directory")

    @property
    def enabled(self) -> bool:
        """Whether a draft source is set."""
        return self.prompt_lookup is not None or self.draft is not None


@dataclasses.dataclass(frozen=True)
class RewardTermConfig:
    """One of ``rl.rewards``: a reward (built-in name or ``module:function`` called on a batch) and its weight."""

    name: str
    weight: float = 1.0

    def __post_init__(self):
        _require(bool(self.name.strip()), "name", "must name a built-in reward or module:function")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Reinforcement learning (``train.objective=grpo``; `k3jax.training.rl`). Each step samples
    ``group_size`` completions of each of ``prompts_per_step`` prompts (one prefill per prompt, its
    memory forked), rewards them, and updates the policy with the clipped policy-gradient loss of
    GRPO on group-relative advantages (``grpo``: (r - mean) / (std + 1e-6) over the group;
    ``dr_grpo``: r - mean), optionally with the KL penalty to the reference policy (``init_from``'s
    parameters; with LoRA the frozen base, adapters off).

    ``reward``: ``exact_match`` (when unset) | ``contains`` | ``numeric`` | ``math``
    (`k3jax.training.rewards`) or ``module:function`` called with ``(prompt, completion, record)``;
    or ``rewards``: several, ``[{name, weight}, ...]``, summed with their weights (a ``module:function``
    there is called once per step on the batch). ``environment``: a multi-turn
    tool environment for chat prompts, ``calculator`` or ``module:Class`` (`k3jax.training.environments`);
    it gives the reward then. A completion counts as a success (pass@1, pass@G) when its reward is at
    least ``pass_threshold``.

    ``update_logprobs``: where the values of the update's log-probs come from (their gradient is the
    training forward's either way; `k3jax.training.grpo`): ``decode`` replays the rollout's decode
    on the sampled tokens at the update's parameters (one teacher-forced decode pass per update; on
    a rollout's first update they equal the recorded log-probs bit for bit and the ratio is 1),
    ``forward`` takes the training forward's (no replay; they differ from the recorded ones by fp32
    rounding, up to about 1e-5 at logits of 30).

    ``speculation``: speculative rollouts (`SpeculationConfig`; the recorded log-probs stay the
    policy's), e.g. ``rl.speculation.prompt_lookup=2`` or ``rl.speculation.draft=runs/small``.

    The GRPO family (`k3jax.training.grpo`'s equations): ``clip_low`` / ``clip_high`` (DAPO's
    clip-higher), ``ratio=sequence`` (GSPO), ``loss_average`` ``token`` | ``sequence`` | ``dr_grpo``,
    ``dynamic_sampling`` (drop groups without reward spread; with ``resample_rounds`` = N > 0, refill
    them from up to N more rounds of fresh prompts), ``overlong_filter`` and
    ``overlong_penalty`` (DAPO's length handling)."""

    reward: str | None = None             # None: exact_match (unless rewards)
    rewards: tuple[RewardTermConfig, ...] = ()
    environment: str | None = None
    prompts_per_step: int = 8
    group_size: int = 8                   # G completions per prompt, >= 2
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    max_new_tokens: int = 32              # per completion (all turns together with an environment)
    advantage: Literal["grpo", "dr_grpo"] = "grpo"
    clip: float = 0.2                     # the ratio is clipped to [1 - clip, 1 + clip]
    clip_low: float | None = None         # DAPO's separate bounds: [1 - clip_low, 1 + clip_high] (None: clip)
    clip_high: float | None = None
    ratio: Literal["token", "sequence"] = "token"   # per-token ratio (GRPO) or GSPO's per-sequence one
    loss_average: Literal["token", "sequence", "dr_grpo"] = "token"   # over all completion tokens, per
                                          # sequence first, or over rows x max_new_tokens (Dr. GRPO's constant)
    dynamic_sampling: bool = False        # DAPO: groups whose rewards are all equal leave the update
    resample_rounds: int = 0              # DAPO: with dynamic_sampling, up to N more rounds of fresh prompts
                                          # refill the update with groups that have reward spread (0: drop only)
    overlong_filter: bool = False         # DAPO: completions cut at the length limit leave the update
    overlong_penalty: int = 0             # DAPO's soft overlong penalty over the last N tokens before max_new_tokens (0: off)
    kl_coef: float = 0.0                  # weight of the k3 estimate of KL(policy || reference) per token
    updates_per_rollout: int = 1          # optimizer updates on each rollout (later ones: ratio to the recorded log-probs)
    update_logprobs: Literal["decode", "forward"] = "decode"   # the update's log-prob values: the rollout's decode
                                          # replayed (equal to the recorded ones) or the training forward (no replay)
    tool_retries: int = 2                 # resamples of a turn whose tool call fails to parse or validate
    max_turns: int = 4                    # assistant turns per completion with an environment
    eval_prompts: int = 32                # held-out prompts of each greedy evaluation (train.eval_every, the end)
    pass_threshold: float = 1.0
    reward_timeout: float | None = 60.0   # seconds a reward or environment call may take (null: unbounded)
    speculation: SpeculationConfig = SpeculationConfig()

    def __post_init__(self):
        _positive(self, "prompts_per_step", "max_new_tokens", "updates_per_rollout", "max_turns", "top_k",
                  "temperature", "clip", "reward_timeout")
        _require(self.group_size >= 2, "group_size",
                 f"must be at least 2 (advantages are relative to the group), got {self.group_size}")
        _require(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.kl_coef >= 0, "kl_coef", f"must be non-negative, got {self.kl_coef}")
        _require(self.tool_retries >= 0, "tool_retries", f"must be non-negative, got {self.tool_retries}")
        _require(self.eval_prompts >= 0, "eval_prompts", f"must be non-negative, got {self.eval_prompts}")
        _require(self.reward is None or bool(self.reward.strip()), "reward", "must name a built-in reward or module:function")
        _require(self.reward is None or not self.rewards, "rewards", "set rl.reward or rl.rewards, not both")
        _require(self.environment is None or not self.rewards, "rewards",
                 "a tool environment gives the reward (rl.environment); leave rl.rewards empty")
        for name in ("clip_low", "clip_high"):
            _require(getattr(self, name) is None or getattr(self, name) > 0, name,
                     f"must be positive (or null: rl.clip), got {getattr(self, name)}")
        _require(self.clip_range[0] < 1, "clip_low", f"must be below 1 (the ratio's lower bound 1 - clip_low > 0), "
                                                     f"got {self.clip_range[0]}")
        _require(self.resample_rounds >= 0, "resample_rounds", f"must be non-negative, got {self.resample_rounds}")
        _require(not self.resample_rounds or self.dynamic_sampling, "resample_rounds",
                 "refills the groups dynamic sampling leaves out; set rl.dynamic_sampling=true")
        _require(0 <= self.overlong_penalty < self.max_new_tokens, "overlong_penalty",
                 f"must be in [0, rl.max_new_tokens = {self.max_new_tokens}), got {self.overlong_penalty}")

    @property
    def clip_range(self) -> tuple[float, float]:
        """``(clip_low, clip_high)``, each ``rl.clip`` where unset."""
        return (self.clip if self.clip_low is None else self.clip_low,
                self.clip if self.clip_high is None else self.clip_high)

    @property
    def rows(self) -> int:
        """Completions per step: the rows of each update."""
        return self.prompts_per_step * self.group_size


PREFERENCE_OBJECTIVES = ("dpo", "ipo", "orpo", "simpo")
REFERENCE_OBJECTIVES = ("dpo", "ipo")     # those that score against a reference policy


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    """Preference tuning (``train.objective`` dpo | ipo | orpo | simpo; `k3jax.training.preference`
    gives the losses). ``beta``: DPO's and IPO's beta, SimPO's; ``simpo_margin``: SimPO's gamma;
    ``orpo_weight``: ORPO's lambda, the weight of its odds-ratio term beside the chosen reply's NLL."""

    beta: float = 0.1
    simpo_margin: float = 0.5
    orpo_weight: float = 0.1

    def __post_init__(self):
        _positive(self, "beta", "orpo_weight")
        _require(self.simpo_margin >= 0, "simpo_margin", f"must be non-negative, got {self.simpo_margin}")


MESH_AXIS_NAMES = ("data", "fsdp", "expert", "context", "tensor")   # the mesh's axes, outermost first
MeshAxis = Literal["data", "fsdp", "expert", "context", "tensor"]


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Logical axis name (`k3jax.layers.params`, plus "batch" for the batch dimension of the data)
    -> the mesh axes it is split over, in order. A mesh axis already used by an earlier dimension
    of the same array, or one whose size does not divide the dimension, is skipped. By default
    the expert axis also shards the model width of every non-expert weight (FSDP over
    fsdp x expert), the batch splits over data x fsdp x expert and the sequence (the second
    dimension of batches and activations) over context."""

    batch: tuple[MeshAxis, ...] = ("data", "fsdp", "expert")
    sequence: tuple[MeshAxis, ...] = ("context",)
    vocab: tuple[MeshAxis, ...] = ("tensor",)
    embed: tuple[MeshAxis, ...] = ("fsdp", "expert")
    heads: tuple[MeshAxis, ...] = ("tensor",)
    value_heads: tuple[MeshAxis, ...] = ("tensor",)
    head_dim: tuple[MeshAxis, ...] = ()
    conv: tuple[MeshAxis, ...] = ()
    q_lora: tuple[MeshAxis, ...] = ()
    kv_lora: tuple[MeshAxis, ...] = ()
    gate_rank: tuple[MeshAxis, ...] = ()
    mlp: tuple[MeshAxis, ...] = ("tensor",)
    experts: tuple[MeshAxis, ...] = ("expert",)
    expert_mlp: tuple[MeshAxis, ...] = ("tensor",)
    latent: tuple[MeshAxis, ...] = ("fsdp",)
    layers: tuple[MeshAxis, ...] = ()
    lora_rank: tuple[MeshAxis, ...] = ()  # the rank of LoRA adapters (`k3jax.layers.lora`): replicated
    lora_slots: tuple[MeshAxis, ...] = ()  # the adapters of a serving bank (`k3jax.layers.lora.AdapterBank`): replicated

    def __post_init__(self):
        for field in dataclasses.fields(self):
            axes = getattr(self, field.name)
            _require(len(set(axes)) == len(axes), field.name, f"names a mesh axis twice: {list(axes)}")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh (`k3jax.sharding`): one size per axis, -1 (at most one axis) for the devices
    left over; the sizes must multiply to the device count. ``rules`` place the model on it.
    ``context`` > 1 splits each sequence over that many devices (`k3jax.sharding.context`: KDA
    state passing and the conv halo, MLA over the all-gathered compact latent)."""

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    context: int = 1
    tensor: int = 1
    rules: AxisRules = AxisRules()
    # How MoE layers reach experts split over the rules' "experts" axes (`k3jax.sharding.expert_parallel`):
    # "local" computes every expert where the tokens are (GSPMD gathers the expert weights);
    # "capacity" ships latents with all_to_all into fixed per-expert buffers and drops the
    # overflow (runs on every platform); "ragged" is dropless with ragged_all_to_all (GPU/TPU).
    moe_dispatch: Literal["local", "capacity", "ragged"] = "local"
    capacity_factor: float = 1.25         # capacity: C = ceil(factor * n k / E) rows per expert and
                                          # source device (n its tokens); factor >= E / k never drops
    # How MLA layers see the keys of other context shards (`k3jax.sharding.context`): "all_gather"
    # the compact latent once per layer, or pass it around a "ring" (same bytes, O(T / context) keys held).
    context_attention: Literal["all_gather", "ring"] = "all_gather"
    # XLA:CPU devices of a one-process run whose mesh is the default (every axis 1, data -1), the
    # batch split over them: "auto" one per core the process may run on (the largest count that
    # divides the micro-batch), N that many (`k3jax.host.use_cpu_cores`). Ignored on other
    # platforms and where the device count is already chosen. Default 1: on the shared 2-core
    # machine "auto" (2 devices) trained configs/tiny.yaml at 0.73x the tokens/s of one device at
    # load average 4-6 and 0.29x at 13-23 (bench.cpu_cores, README "Performance").
    cpu_devices: Literal["auto"] | int = 1

    def __post_init__(self):
        _require(self.cpu_devices == "auto" or self.cpu_devices > 0, "cpu_devices",
                 f"must be 'auto' or a positive device count, got {self.cpu_devices!r}")
        for name in MESH_AXIS_NAMES:
            size = getattr(self, name)
            _require(size == -1 or size > 0, name, f"must be positive or -1 (the rest of the devices), got {size}")
        _positive(self, "capacity_factor")
        _require(list(self.sizes.values()).count(-1) <= 1, "", "at most one mesh axis may be -1")

    @property
    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_AXIS_NAMES}


@dataclasses.dataclass(frozen=True)
class Config:
    """The root: one field per section."""

    model: ModelConfig
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    mesh: MeshConfig = MeshConfig()
    finetune: FinetuneConfig = FinetuneConfig()
    rl: RLConfig = RLConfig()
    preference: PreferenceConfig = PreferenceConfig()
    run_dir: str = "runs/default"         # checkpoints, the resolved config and metrics
    init_from: str | None = None          # fine-tune: parameters from this run or checkpoint directory

    def __post_init__(self):
        grpo, prompts = self.train.objective == "grpo", self.data.kind == "prompts"
        _require(grpo == prompts, "train.objective" if prompts else "data.kind",
                 "data.kind=prompts goes with train.objective=grpo" if prompts
                 else "train.objective=grpo samples from prompts: set data.kind=prompts")
        preference, pairs = self.train.objective in PREFERENCE_OBJECTIVES, self.data.kind == "preferences"
        _require(preference == pairs, "train.objective" if pairs else "data.kind",
                 f"data.kind=preferences goes with train.objective {' | '.join(PREFERENCE_OBJECTIVES)}" if pairs
                 else f"train.objective={self.train.objective} tunes on preference pairs: set data.kind=preferences")
        _require(self.train.objective not in REFERENCE_OBJECTIVES or self.init_from is not None, "init_from",
                 f"train.objective={self.train.objective} scores against the policy it starts from: set init_from=RUN_DIR")
        if not grpo:
            return
        _require(self.init_from is not None, "init_from",
                 "train.objective=grpo fine-tunes a trained policy: set init_from=RUN_DIR")
        _require(self.rl.rows % self.train.grad_accum == 0, "train.grad_accum",
                 f"must divide the rows of an update, rl.prompts_per_step x rl.group_size = {self.rl.rows}, "
                 f"got {self.train.grad_accum}")
        _require(self.finetune.lora_dropout == 0, "finetune.lora_dropout",
                 "must be 0 for train.objective=grpo: dropout would make the update's log-probs differ from the rollout's")


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    """A short repr of a parsed YAML value for an error message: bounded in depth and length, so a
    nested or aliased value (a YAML alias bomb) is never expanded."""
    shown = reprlib.Repr()
    shown.maxlevel, shown.maxlist, shown.maxtuple, shown.maxdict = 2, 4, 4, 4
    shown.maxstring = shown.maxother = 60
    return shown.repr(value)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp, key: str) -> Any:
    """``value`` (parsed YAML) as type ``tp``, or a ConfigError naming ``key``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _convert(value, option, key)
            except ConfigError as error:
                errors.append(error)
        raise errors[0] if len(errors) == 1 else ConfigError(key, f"{_shown(value)} is not one of {[_type_name(o) for o in options]}")
    if origin is Literal:
        if not isinstance(value, (str, int, float, bool)) or value not in args:
            close = difflib.get_close_matches(_shown(value), [str(a) for a in args], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(key, f"{_shown(value)} is not one of {list(args)}{hint}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected a list, got {_shown(value)}")
        return tuple(_convert(item, args[0], f"{key}[{i}]") for i, item in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if tp is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:   # ints, and YAML 1.1 exponents without a dot ("1e-5"), which PyYAML reads as strings
            value = float(value)
        except (ValueError, OverflowError):
            raise ConfigError(key, f"expected float, got {_shown(value)}") from None
        if not math.isfinite(value):
            raise ConfigError(key, f"must be a finite number, got {value}")
        return value
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(key, f"expected {tp.__name__}, got {_shown(value)}")
    return value


def _build(cls, data: Any, prefix: str):
    """Construct dataclass ``cls`` from mapping ``data``; keys are reported under ``prefix``."""
    join = lambda name: f"{prefix}.{name}" if prefix else name  # noqa: E731
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"expected a mapping of {cls.__name__} fields, got {_shown(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for name in data:
        if not isinstance(name, str):
            raise ConfigError(prefix, f"keys must be names, got {_shown(name)}")
        if name not in fields:
            close = difflib.get_close_matches(str(name), fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; {cls.__name__} keys: {', '.join(fields)}"
            raise ConfigError(join(name), f"unknown key{hint}")
    missing = [name for name, f in fields.items() if name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(join(missing[0]), "required key is missing")
    values = {name: _convert(value, hints[name], join(name)) for name, value in data.items()}
    try:
        return cls(**values)
    except ConfigError as error:
        raise error.under(prefix) if prefix else error


def _merge(base: dict, update: dict) -> dict:
    """``update`` over ``base``: mappings merge key by key, other values replace."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_yaml(path: pathlib.Path, seen: tuple[pathlib.Path, ...] = ()) -> dict:
    """The mapping in ``path`` merged over the file its ``base:`` key names, recursively."""
    path = path.resolve()
    if path in seen:
        raise ConfigError("base", f"{path} includes itself")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as error:
        raise ConfigError("", f"cannot read config {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ConfigError("", f"{path} is not UTF-8 text (byte {error.start})") from None
    except yaml.YAMLError as error:
        raise ConfigError("", f"{path} is not valid YAML: {' '.join(str(error).split())[:300]}") from None
    except RecursionError:
        raise ConfigError("", f"{path} is nested too deeply to be a config") from None
    if not isinstance(data, dict):
        raise ConfigError("", f"{path} must hold a mapping at the top level")
    base = data.pop("base", None)
    if base is None:
        return data
    return _merge(_read_yaml(path.parent / base, (*seen, path)), data)


def apply_override(data: dict, override: str) -> dict:
    """``data`` with one ``dotted.key=value`` set (the value parsed as YAML)."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError("", f"override {override!r} is not of the form dotted.key=value")
    try:
        value = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError):
        raise ConfigError(key, f"cannot parse the value {_shown(text)}") from None
    update = value
    for part in reversed(key.split(".")):
        update = {part: update}
    return _merge(data, update)


RENAMED_KEYS = {   # a key of an earlier release -> its name now (configs saved in checkpoints keep loading)
    "rl.prompt_lookup": "rl.speculation.prompt_lookup",
    "rl.draft": "rl.speculation.draft",
    "rl.speculate_k": "rl.speculation.k",
    "rl.speculate_rollback": "rl.speculation.rollback",
}


def _renamed(data: dict) -> dict:
    """``data`` with every key of `RENAMED_KEYS` moved to its new name."""
    for old, new in RENAMED_KEYS.items():
        *section, name = old.split(".")
        holder = data
        for part in section:
            holder = holder.get(part) if isinstance(holder, dict) else None
        if isinstance(holder, dict) and name in holder:
            holder = dict(holder)
            value = holder.pop(name)
            data = _merge(_set_path(data, section, holder), _set_path({}, new.split("."), value))
    return data


def _set_path(data: dict, path: typing.Sequence[str], value) -> dict:
    """A copy of ``data`` with ``value`` at the dotted ``path`` (replacing what was there)."""
    if not path:
        return value
    head, *rest = path
    inner = data.get(head) if isinstance(data.get(head), dict) else {}
    return {**data, head: _set_path(inner, rest, value)}


def config_from_dict(data: dict, overrides: typing.Sequence[str] = ()) -> Config:
    """Validate a parsed mapping (plus overrides) into a `Config`; keys of an earlier release are
    read under their new names (`RENAMED_KEYS`)."""
    for override in overrides:
        data = apply_override(data, override)
    return _build(Config, _renamed(data), "")


# The example configs (``configs/*.yaml`` in the repository) ship with the package: in the wheel as
# ``k3jax/configs/``, in the repository beside ``k3jax/``.
_PACKAGE = pathlib.Path(__file__).resolve().parent
PACKAGED_CONFIGS = next((folder for folder in (_PACKAGE / "configs", _PACKAGE.parent / "configs") if folder.is_dir()),
                        _PACKAGE / "configs")


def packaged_config_names() -> list[str]:
    """The shipped configs' names (file names without ``.yaml``), sorted."""
    return sorted(path.stem for path in PACKAGED_CONFIGS.glob("*.yaml"))


def resolve_config(argument: str) -> pathlib.Path:
    """The config argument of the programs: ``argument`` when that file exists, else the shipped
    config of that name (``tiny``, ``tiny.yaml`` and ``configs/tiny.yaml`` from a directory without
    that file all name the shipped ``tiny.yaml``); a one-line `ConfigError` otherwise."""
    path = pathlib.Path(argument).expanduser()
    if path.is_file():
        return path
    name = path.name[:-len(".yaml")] if path.name.endswith(".yaml") else path.name
    if name in packaged_config_names():
        return PACKAGED_CONFIGS / f"{name}.yaml"
    raise ConfigError("", f"config {argument!r}: no such file, and not a packaged config "
                          f"(packaged: {', '.join(packaged_config_names()) or 'none'})")


def load_config(path: str | pathlib.Path, overrides: typing.Sequence[str] = ()) -> Config:
    """Read ``path`` (following ``base:``), apply ``key=value`` overrides, validate."""
    return config_from_dict(_read_yaml(pathlib.Path(path)), overrides)


def to_dict(config) -> dict:
    """A plain mapping (YAML-ready) of any config section."""
    def plain(value):
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value
    return plain(dataclasses.asdict(config))
