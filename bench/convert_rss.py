"""Peak host RSS and wall time of ``k3jax.convert`` import and export vs checkpoint size.

    python -m bench.convert_rss [--layers 2 4 8] [--work /tmp/k3jax_convert_bench]
                                [--json bench_results/convert_rss.json]

A synthetic Kimi-Linear-shaped checkpoint (d 2304, KDA 32 x 128, MLA without q-LoRA, SwiGLU
experts of width 1024, 3 KDA : 1 MLA) with fewer layers, 32 routed experts instead of 256 and a
32768-token vocabulary, so that a few layers span 1-4 GB of bf16; the largest single tensor is the
embedding / head (151 MB bf16, 302 MB in k3jax's fp32). Each conversion runs in a fresh
subprocess that reports its own peak RSS (``resource.getrusage``); the checkpoints are written
streamed too and deleted afterwards. Prints a table and writes the rows as JSON (atomically).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import resource
import shutil
import subprocess
import sys

import numpy as np

from bench.common import table, timed, write_json


ROOT = pathlib.Path(__file__).resolve().parents[1]


def kimi_linear_shaped(layers: int) -> dict:
    full = [n for n in range(4, layers + 1, 4)] + ([layers] if layers % 4 else [])
    return {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": 32768,
        "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": layers, "num_attention_heads": 32,
        "num_key_value_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True, "num_experts": 32, "num_experts_per_token": 8, "moe_intermediate_size": 1024,
        "num_shared_experts": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "linear_attn_config": {"full_attn_layers": full, "kda_layers": [n for n in range(1, layers + 1) if n not in full],
                               "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
    }


def random_bf16(rng, shape) -> np.ndarray:
    """Incompressible bf16 values of magnitude ~2^-7: random sign and mantissa bits."""
    import ml_dtypes
    bits = rng.integers(0, 2**16, shape, dtype=np.uint16) & np.uint16(0x807F) | np.uint16(120 << 7)
    return bits.view(ml_dtypes.bfloat16)


def write_synthetic(directory: pathlib.Path, layers: int) -> int:
    """Write the checkpoint shard by shard, one tensor at a time; returns its size in bytes."""
    from k3jax.convert.hf_config import model_config_from_hf
    from k3jax.convert.keymap import model_maps
    from k3jax.convert.safetensors_io import INDEX_NAME, plan_shards, write_shard
    hf = kimi_linear_shaped(layers)
    model, _ = model_config_from_hf(hf)
    maps = model_maps(model, "kimi_linear")
    entries = [(m.hf_name, "F32" if m.top == "buffers" else "BF16", m.hf_shape) for m in maps]
    shards = plan_shards(entries, 1 << 30)
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = ((random_bf16(rng, shape) if dtype == "BF16" else np.zeros(shape, np.float32)) for _, dtype, shape in shard)
        write_shard(directory / name, shard, tensors)
        weight_map.update({entry[0]: name for entry in shard})
        total += (directory / name).stat().st_size
    (directory / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(hf))
    return total


def child(command: str, source: str, target: str) -> None:
    """Run one conversion here and print its wall time and this process's peak RSS."""
    import jax
    jax.numpy.zeros(1).block_until_ready()
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if command == "import":
        from k3jax.convert.importer import import_checkpoint as convert
    else:
        from k3jax.convert.exporter import export_checkpoint as convert
    _, wall = timed(lambda: convert(source, target, log=lambda line: None))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"wall_s": wall, "peak_rss_mb": peak / 1024, "baseline_rss_mb": baseline / 1024}))


def measure(command: str, source: pathlib.Path, target: pathlib.Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.convert_rss", "--child", command, str(source), str(target)],
                         cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--work", default="/tmp/k3jax_convert_bench")
    parser.add_argument("--json", default="bench_results/convert_rss.json")
    parser.add_argument("--child", nargs=3, metavar=("COMMAND", "SOURCE", "TARGET"))
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    work = pathlib.Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    rows = []
    try:
        for layers in args.layers:
            hf_dir, run_dir, out_dir = work / f"hf{layers}", work / f"run{layers}", work / f"out{layers}"
            size = write_synthetic(hf_dir, layers)
            imported = measure("import", hf_dir, run_dir)
            shutil.rmtree(hf_dir)
            exported = measure("export", run_dir, out_dir)
            shutil.rmtree(run_dir)
            shutil.rmtree(out_dir)
            rows.append({"layers": layers, "checkpoint_bytes": size, "import": imported, "export": exported})
            print(f"{layers} layers ({size / 1e9:.2f} GB): import {imported['wall_s']:.1f} s, "
                  f"{imported['peak_rss_mb']:.0f} MB; export {exported['wall_s']:.1f} s, "
                  f"{exported['peak_rss_mb']:.0f} MB", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(["layers", "checkpoint (bf16) GB", "import wall s", "import peak RSS MB", "export wall s",
                 "export peak RSS MB", "baseline RSS MB"],
                [[r["layers"], f"{r['checkpoint_bytes'] / 1e9:.2f}", f"{r['import']['wall_s']:.1f}",
                  f"{r['import']['peak_rss_mb']:.0f}", f"{r['export']['wall_s']:.1f}",
                  f"{r['export']['peak_rss_mb']:.0f}", f"{r['import']['baseline_rss_mb']:.0f}"] for r in rows]))
    print(f"wrote {write_json(args.json, {'rows': rows})}")


if __name__ == "__main__":
    main()
