"""LoRA adapters out of and into k3jax LoRA runs, in Hugging Face PEFT's layout.

    python -m k3jax.convert export RUN_DIR OUT_DIR --adapter          a LoRA run's adapters -> PEFT
    python -m k3jax.convert import-adapter PEFT_DIR RUN_DIR OUT_DIR   a PEFT adapter on RUN_DIR -> a LoRA run

PEFT adapts a HF module's weight W_hf [out, in] (``y = x W_hf^T``) by ``(lora_alpha / r) lora_B lora_A``,
lora_A [r, in], lora_B [out, r]; k3jax adapts the weight W [in..., out...] by ``(alpha / r) A B``, A [in..., r],
B [r, out...] (`k3jax.layers.lora`). The keymap's ``linear`` layout is W_hf = flat(W)^T, the leading
``in_dims`` axes flattened into ``in`` and the rest into ``out`` (per-head weights flattened as the base
weight is), so with the same r and alpha (`peft_factors`; `k3jax_factors` is its exact inverse, fp32):

    lora_A = flat(A)^T [r, in]      lora_B = flat(B)^T [out, r]      lora_B lora_A = flat(A B)^T

Export writes ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``, ``lora_dropout``,
``target_modules``: the full HF names of the adapted modules, ``bias: none``, ``task_type: CAUSAL_LM``,
``fan_in_fan_out: false``, ``base_model_name_or_path``: the HF directory the base run was imported from when
its metadata records one, else null) and ``adapter_model.safetensors`` (fp32,
``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``); no base weight.

Routed experts (``finetune.lora_routed_experts``): k3jax shares one A [in, r] among a layer's experts and
holds one B_e per expert, W_e + s A B_e. PEFT has no shared factor, so every expert module
``experts.{e}.w1|w3|w2`` gets its own pair: lora_A = the shared A (repeated), lora_B = B_e^T — the same
update. Import takes routed experts only in that form: the experts of one weight must carry bit-equal
lora_A (else one line naming ``lora_routed_experts``); every routed expert is then adapted, and an expert
the adapter leaves out gets B_e = 0.

Import reads a PEFT LoRA adapter for the HF model RUN_DIR (a plain, not LoRA, k3jax run) holds and writes
OUT_DIR, a LoRA run on RUN_DIR: ``config.yaml`` (RUN_DIR's config with ``init_from: RUN_DIR`` and
``finetune``: r, alpha, dropout, ``lora_targets`` the adapted weights' paths) and ``checkpoints/0``: the
adapters (fp32), RUN_DIR's router biases and the base's record (path, step, fingerprint), which
`k3jax.inference.restore_model` (``python -m eval``, ``eval.generate``) checks. A scanned weight the adapter
covers at some repeats (HF layers) only gets A = B = 0 at the others. No optimizer state is written: the run
is for evaluation and export. PEFT variants that are not W + (alpha / r) B A (DoRA, rsLoRA, per-module
ranks or alphas, trained biases, modules_to_save) are refused in one line.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Callable, NamedTuple

import jax
import numpy as np
import yaml
from safetensors import safe_open

from k3jax.checkpoint import CHECKSUMS
from k3jax.config import ConfigError, FinetuneConfig, config_from_dict, to_dict
from k3jax.convert.errors import ConvertError, atomic_directory, require_new
from k3jax.convert.exporter import hf_description, lora_base, read_run, to_hf
from k3jax.convert.importer import FLOAT_DTYPES, to_k3jax
from k3jax.convert.keymap import TensorMap, model_maps
from k3jax.convert.orbax_stream import LeafSpec, StateReader, StreamedStateWriter
from k3jax.convert.safetensors_io import DTYPES, read_json, write_shard
from k3jax.layers.lora import ADAPTER_SUFFIX

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
FACTORS = (".lora_A.weight", ".lora_B.weight")
# adapter_config.json fields whose update is not W + (lora_alpha / r) lora_B lora_A on the listed modules
UNSUPPORTED = ("use_dora", "use_rslora", "fan_in_fan_out", "lora_bias", "rank_pattern", "alpha_pattern",
               "modules_to_save", "layer_replication")


class AdapterMap(NamedTuple):
    module: str        # the HF module ("model.layers.0.self_attn.q_proj")
    spec: TensorMap    # the region of the adapted k3jax weight (keymap, "linear")
    routed: bool       # a routed expert: A is shared by the experts of spec.index[:-1]

    @property
    def a_index(self) -> tuple[int, ...]:
        return self.spec.index[:-1] if self.routed else self.spec.index


def adapter_maps(model, flavour: str, adapted: dict[str, bool]) -> list[AdapterMap]:
    """The HF module of every region of the weights ``adapted`` (``{path: routed}``), in checkpoint
    order; routed experts as their dense ``experts.{e}.w*`` modules, whatever their stored format."""
    dense = dataclasses.replace(model, moe=dataclasses.replace(model.moe, expert_format="dense"))
    maps = [AdapterMap(spec.hf_name.removesuffix(".weight"), spec, adapted[spec.key])
            for spec in model_maps(dense, flavour) if spec.key in adapted and spec.layout == "linear"]
    missing = set(adapted) - {m.spec.key for m in maps}
    if missing:
        raise ConvertError(f"adapted weight {sorted(missing)[0]} has no HF linear module to carry its adapter")
    return maps


def peft_names(module: str) -> tuple[str, str]:
    return tuple(PEFT_PREFIX + module + factor for factor in FACTORS)


def peft_factors(item: AdapterMap, a: np.ndarray, b: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``(lora_A [r, in], lora_B [out, r])`` = (flat(A)^T, flat(B)^T) of one region's k3jax factors."""
    out, inputs = item.spec.hf_shape
    return to_hf(a, item.spec, (rank, inputs)), to_hf(b, item.spec, (out, rank))


def k3jax_factors(item: AdapterMap, lora_a: np.ndarray, lora_b: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``(A [in..., r], B [r, out...])`` of one region from PEFT's factors (the inverse of `peft_factors`)."""
    spec, n = item.spec, item.spec.in_dims
    return (to_k3jax(lora_a, spec._replace(shape=(*spec.shape[:n], rank))),
            to_k3jax(lora_b, spec._replace(shape=(rank, *spec.shape[n:]))))


def peft_config(finetune: FinetuneConfig, modules: list[str], base_model: str | None) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": finetune.lora_rank, "lora_alpha": finetune.lora_alpha, "lora_dropout": finetune.lora_dropout,
            "target_modules": modules, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "modules_to_save": None, "inference_mode": True}


def export_adapter(run_dir, out_dir, log: Callable[[str], None] = print) -> dict:
    """Write the adapters of the LoRA run ``run_dir``'s latest checkpoint as a PEFT adapter in ``out_dir``."""
    out_dir = pathlib.Path(out_dir).expanduser().resolve()
    require_new(out_dir)
    run_dir, config, step_dir, meta = read_run(run_dir)
    if not config.finetune.lora:
        raise ConvertError(f"{run_dir}: not a LoRA run (finetune.lora_rank is 0): --adapter exports a LoRA run's adapters")
    base = lora_base(config, step_dir, meta)
    maps = adapter_maps(config.model, hf_description(config, base.run_dir)[1], base.adapted)
    rank = config.finetune.lora_rank
    reader = StateReader(step_dir, meta.get(CHECKSUMS))
    entries = [(name, "F32", shape) for m in maps
               for name, shape in zip(peft_names(m.module), ((rank, m.spec.hf_shape[1]), (m.spec.hf_shape[0], rank)))]

    def tensors():
        for m in maps:
            yield from peft_factors(m, reader.read("params", f"{m.spec.key}{ADAPTER_SUFFIX}/a", m.a_index),
                                    reader.read("params", f"{m.spec.key}{ADAPTER_SUFFIX}/b", m.spec.index), rank)

    modules = [m.module for m in maps]
    with atomic_directory(out_dir) as temporary:
        write_shard(temporary / ADAPTER_WEIGHTS, entries, tensors())
        reader.verify()
        config_json = peft_config(config.finetune, modules, base.meta.get("imported_from"))
        (temporary / ADAPTER_CONFIG).write_text(json.dumps(config_json, indent=2))
    log(f"exported the adapters of {len(modules)} modules (r={rank}) to {out_dir}")
    return {"out_dir": str(out_dir), "modules": len(modules), "tensors": len(entries)}


def read_peft_config(peft_dir: pathlib.Path) -> tuple[int, float, float]:
    """``(r, lora_alpha, lora_dropout)`` of a plain LoRA ``adapter_config.json`` (PEFT's defaults 8, 8, 0)."""
    path = peft_dir / ADAPTER_CONFIG
    data = read_json(path)
    if data.get("peft_type") != "LORA":
        raise ConvertError(f"{path}: peft_type {data.get('peft_type')!r}; k3jax imports 'LORA' adapters")
    for field in UNSUPPORTED:
        if data.get(field):
            raise ConvertError(f"{path}: {field} is set; k3jax imports plain LoRA (W + lora_alpha / r B A)")
    if data.get("bias", "none") != "none":
        raise ConvertError(f"{path}: bias {data['bias']!r}; k3jax imports adapters without biases ('none')")
    rank, alpha, rate = data.get("r", 8), data.get("lora_alpha", 8), data.get("lora_dropout", 0.0) or 0.0
    if not (isinstance(rank, int) and rank > 0 and isinstance(alpha, (int, float)) and alpha > 0
            and isinstance(rate, (int, float))):
        raise ConvertError(f"{path}: r {rank!r}, lora_alpha {alpha!r}, lora_dropout {rate!r} are not a LoRA's")
    return rank, float(alpha), float(rate)


def read_peft_tensors(peft_dir: pathlib.Path) -> dict[str, np.ndarray]:
    path = peft_dir / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ConvertError(f"{path}: no such file (k3jax reads PEFT's safetensors adapters)")
    try:
        with safe_open(path, "numpy") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error types
        raise ConvertError(f"{path}: truncated or not a safetensors file ({' '.join(str(error).split())[:200]})") from None


def _pairs(tensors: dict[str, np.ndarray], maps: dict[str, AdapterMap], rank: int):
    """``[(AdapterMap, lora_A, lora_B)]`` of the adapter's tensors, each checked: a LoRA factor's
    name, a module k3jax can adapt, both factors, a float dtype, shapes [r, in] and [out, r]."""
    floats = {DTYPES[name] for name in FLOAT_DTYPES}
    modules: dict[str, dict[int, np.ndarray]] = {}
    for name, value in tensors.items():
        factor = next((i for i, end in enumerate(FACTORS) if name.endswith(end)), None)
        if not name.startswith(PEFT_PREFIX) or factor is None:
            raise ConvertError(f"tensor {name}: not a LoRA factor (base_model.model.<module>.lora_A|lora_B.weight)")
        module = name[len(PEFT_PREFIX):-len(FACTORS[factor])]
        if module not in maps:
            raise ConvertError(f"tensor {name}: {module} is not a module k3jax can adapt in this model")
        if value.dtype not in floats:
            raise ConvertError(f"tensor {name}: dtype {value.dtype}, expected {' or '.join(FLOAT_DTYPES)}")
        out, inputs = maps[module].spec.hf_shape
        expected = ((rank, inputs), (out, rank))[factor]
        if tuple(value.shape) != expected:
            raise ConvertError(f"tensor {name}: shape {list(value.shape)}, expected {list(expected)} "
                               f"(r={rank} in {ADAPTER_CONFIG})")
        modules.setdefault(module, {})[factor] = value
    for module, factors in modules.items():
        if len(factors) < 2:
            raise ConvertError(f"tensor {peft_names(module)[1 - min(factors)]} is missing (its pair is there)")
    return [(maps[module], factors[0], factors[1]) for module, factors in modules.items()]


def import_adapter(peft_dir, run_dir, out_dir, log: Callable[[str], None] = print) -> dict:
    """Write ``out_dir``, a LoRA run on ``run_dir`` whose adapters are those of the PEFT adapter ``peft_dir``."""
    from k3jax.training.finetune import abstract_lora_model, adapted_weights

    peft_dir, out_dir = (pathlib.Path(p).expanduser().resolve() for p in (peft_dir, out_dir))
    require_new(out_dir)
    if not peft_dir.is_dir():
        raise ConvertError(f"{peft_dir}: no such directory")
    rank, alpha, rate = read_peft_config(peft_dir)
    run_dir, config, _, _ = read_run(run_dir)
    if config.finetune.lora:
        raise ConvertError(f"{run_dir}: a LoRA run; give the run that holds the adapter's base model")
    maps = adapter_maps(config.model, hf_description(config, run_dir)[1], dict(adapted_weights(config.model, None)))
    pairs = _pairs(read_peft_tensors(peft_dir), {m.module: m for m in maps}, rank)
    if not pairs:
        raise ConvertError(f"{peft_dir / ADAPTER_WEIGHTS}: holds no LoRA factors")
    keys = {m.spec.key: m.routed for m, _, _ in pairs}
    try:
        finetune = FinetuneConfig(lora_rank=rank, lora_alpha=alpha, lora_dropout=rate,
                                  lora_targets=tuple(key for key, routed in keys.items() if not routed),
                                  lora_routed_experts=any(keys.values()))
        run = config_from_dict({**to_dict(config), "finetune": to_dict(finetune), "init_from": str(run_dir),
                                "run_dir": str(out_dir)})
    except ConfigError as error:
        raise ConvertError(f"{peft_dir / ADAPTER_CONFIG}: {error}") from None
    lora = abstract_lora_model(run.model, run.finetune, run.train.seed)
    named = {f"{key}{ADAPTER_SUFFIX}/{f}" for key in keys for f in "ab"}
    if set(lora.adapters) != named:
        raise ConvertError(f"the adapted modules select other k3jax weights than they name "
                           f"({sorted(set(lora.adapters) ^ named)[0]})")
    factors = {name: np.zeros(value.shape, np.float32) for name, value in lora.adapters.items()}
    shared: dict[tuple[str, tuple[int, ...]], str] = {}
    for item, lora_a, lora_b in pairs:
        a, b = k3jax_factors(item, lora_a, lora_b, rank)
        a_name, b_name = (f"{item.spec.key}{ADAPTER_SUFFIX}/{f}" for f in "ab")
        first = shared.setdefault((a_name, item.a_index), item.module)
        if first != item.module and not np.array_equal(factors[a_name][item.a_index], a):
            raise ConvertError(f"{item.module}: lora_A differs from {first}'s; k3jax's lora_routed_experts shares "
                               f"one A among a layer's experts")
        factors[a_name][item.a_index] = a
        factors[b_name][item.spec.index] = b

    write_lora_run(out_dir, run, lora, factors, adapter_from=str(peft_dir))
    log(f"imported the adapters of {len(pairs)} modules (r={rank}) into {out_dir}, a LoRA run on {run_dir}")
    return {"run_dir": str(out_dir), "modules": len(pairs), "weights": len(keys)}


def write_lora_run(out_dir: pathlib.Path, run, lora, factors: dict[str, np.ndarray], **meta) -> None:
    """Write ``out_dir`` (atomically): a LoRA run of config ``run`` on the base run ``run.init_from``
    (its latest checkpoint), whose checkpoint 0 holds ``factors`` (``{"<weight>_lora/a"|"/b": fp32}``,
    shaped as ``lora.adapters``, `k3jax.training.finetune.abstract_lora_model` of ``run``), the base's
    router biases and its record (path, step, fingerprint: the base is read once, as a resume reads
    it), plus ``meta``; and its ``config.yaml``."""
    from k3jax.checkpoint import latest_meta
    from k3jax.training.finetune import BASE_META, base_fingerprint, restore_base

    for name, value in lora.adapters.items():
        if name not in factors or factors[name].shape != tuple(value.shape):
            raise ConvertError(f"adapter {name}: {'missing' if name not in factors else list(factors[name].shape)}, "
                               f"expected {list(value.shape)}")
    base_dir = pathlib.Path(run.init_from)
    step, _ = latest_meta(base_dir)
    frozen, buffers = restore_base(base_dir, step, lora.parts, lora.frozen, lora.buffers)
    meta = {"config": to_dict(run), "data_position": 0, "optimizer_step": 0, "jax_version": jax.__version__,
            BASE_META: {"init_from": str(base_dir), "step": step, "fingerprint": base_fingerprint(frozen)}, **meta}
    del frozen
    arrays = {"params": {name: np.asarray(factors[name], np.float32) for name in lora.adapters},
              "buffers": {key: np.asarray(value) for key, value in buffers.items()}}
    leaves = {top: {key: LeafSpec(value.shape, value.dtype, value.shape) for key, value in group.items()}
              for top, group in arrays.items()}
    with atomic_directory(out_dir) as temporary:
        writer = StreamedStateWriter(temporary / "checkpoints" / "0", leaves)
        try:
            for top, group in arrays.items():
                for key, value in group.items():
                    writer.write(top, key, (), value)
            writer.finish(meta, writer.checksums())
        except BaseException:
            writer.settle()
            raise
        (temporary / "config.yaml").write_text(yaml.safe_dump(to_dict(run), sort_keys=False))
