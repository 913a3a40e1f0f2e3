"""One performance table for the README, from one command:

    python -m bench.performance [--contexts 1024 4096 16384] [--kda-shape 1 4096 4 128 128]
                                [--train-steps 40] [--repeats 3] [--out bench/performance.json]

It measures, on this machine's default backend:

    KDA          forward and forward+backward, the chunk form vs fla's torch reference when fla is
                 importable, else vs k3jax's token-serial reference scan (`bench.kda.measure_shape`:
                 interleaved rounds, median per-round ratio)
    train step   tokens/s of the README's main job (configs/tiny.yaml, `bench.cpu_cores.trial`: a
                 fresh ``python -m train`` subprocess, median over steps after the first 10) and
                 its MFU: tokens/s x `k3jax.flops.training_flops` / the measured
                 fp32 matmul rate (`k3jax.flops.measured_peak_flops`, the trainer's default peak)
    inference    prefill tokens/s (one sequence of each context length) and decode tokens/s (one
                 token at a time after that prefill, median of ``--repeats`` x 8 steps) of the tiny
                 K3 (3 KDA : 1 MLA) vs the same width with every layer MLA (model.mla_layers)

and writes the results and the machine they came from to ``--out`` (atomically), then prints the
markdown table.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform

import k3jax  # noqa: F401  (XLA:CPU workaround before JAX starts)
import jax
import jax.numpy as jnp
from flax import nnx

from bench.common import median_step_seconds, seconds, write_json
from bench.cpu_cores import trial
from bench.kda import measure_shape
from k3jax.config import load_config
from k3jax.flops import measured_peak_flops, training_flops
from k3jax.memory import init_memory
from k3jax.model import K3Model

CONFIG = "configs/tiny.yaml"
DECODE_STEPS = 8


def kda_ratios(shape, repeats: int) -> dict:
    """Chunk form vs a reference, forward and forward+backward speed-ups (median of rounds)."""
    if importlib.util.find_spec("fla") is not None:
        raise SystemExit("fla is importable: compare against its chunk_kda with bench.kda_versions (not wired here)")
    _, speedups = measure_shape(tuple(shape), "bounded", [("reference", 64), ("chunk", 64)], repeats, gemm=1.0)
    return {"reference": "k3jax token-serial scan (fla/torch not importable)", "shape": list(shape),
            "forward_speedup": speedups[0]["forward_speedup"],
            "forward_backward_speedup": speedups[0]["forward_backward_speedup"]}


def train_step(steps: int) -> dict:
    """The main job's tokens/s (one device, the trainer's default) and MFU against the matmul rate."""
    config = load_config(CONFIG)
    tokens_per_second = trial(["mesh.cpu_devices=1"], steps, 10, CONFIG)["tokens_per_second"]
    flops = training_flops(config.model, config.data.seq_len).total
    peak = measured_peak_flops(config.model.compute_dtype)
    return {"tokens_per_second": tokens_per_second, "flops_per_token": flops, "peak_flops": peak,
            "mfu": tokens_per_second * flops / peak}


def inference(overrides: list[str], context: int, repeats: int) -> dict:
    """Prefill tokens/s over ``context`` tokens and decode tokens/s right after it (batch 1)."""
    config = load_config(CONFIG, overrides).model
    graph, state = nnx.split(K3Model(config, rngs=nnx.Rngs(0)))

    @jax.jit
    def prefill(state, tokens):
        out = nnx.merge(graph, state)(tokens, memory=init_memory(config, 1, context + repeats * DECODE_STEPS + 1))
        return out.memory, jnp.argmax(out.logits[:, -1:], axis=-1)

    @jax.jit
    def decode(carry, state):
        memory, token = carry
        out = nnx.merge(graph, state)(token, memory=memory)
        return out.memory, jnp.argmax(out.logits[:, -1:], axis=-1)

    tokens = jax.random.randint(jax.random.key(0), (1, context), 0, config.vocab_size)
    jax.block_until_ready(prefill(state, tokens))
    prefill_seconds = min(seconds(prefill, state, tokens) for _ in range(repeats))
    carry = prefill(state, tokens)
    _, decode_seconds = median_step_seconds(decode, carry, state, iters=repeats * DECODE_STEPS - 1)
    return {"context": context, "prefill_tokens_per_s": context / prefill_seconds,
            "decode_tokens_per_s": 1.0 / decode_seconds}


def markdown(result: dict) -> str:
    kda, train = result["kda"], result["train"]
    lines = [f"Measured on {result['machine']} ({result['cpus']} CPUs, load average {result['load_average']:.1f}, "
             f"JAX {result['jax']} {result['backend']}) by `python -m bench.performance`.", "",
             "| measurement | value |", "|---|---|",
             f"| KDA chunk vs {kda['reference']}, {tuple(kda['shape'])}, forward | "
             f"{kda['forward_speedup']:.1f}x |",
             f"| ... forward+backward | {kda['forward_backward_speedup']:.1f}x |",
             f"| train step, {CONFIG} (one device) | {train['tokens_per_second']:,.0f} tokens/s |",
             f"| ... MFU vs the measured fp32 matmul rate ({train['peak_flops'] / 1e9:.0f} GFLOP/s) | "
             f"{100 * train['mfu']:.1f}% |", "",
             "| context | K3 prefill tok/s | all-MLA prefill tok/s | K3 decode tok/s | all-MLA decode tok/s |",
             "|---:|---:|---:|---:|---:|"]
    for k3, mla in zip(result["inference"]["k3"], result["inference"]["all_mla"]):
        lines.append(f"| {k3['context']:,} | {k3['prefill_tokens_per_s']:,.0f} | {mla['prefill_tokens_per_s']:,.0f} | "
                     f"{k3['decode_tokens_per_s']:,.1f} | {mla['decode_tokens_per_s']:,.1f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--kda-shape", type=int, nargs=5, default=[1, 4096, 4, 128, 128])
    parser.add_argument("--train-steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/performance.json")
    args = parser.parse_args(argv)
    num_layers = load_config(CONFIG).model.num_layers
    all_mla = [f"model.mla_layers=[{','.join(map(str, range(num_layers)))}]"]
    loads = [os.getloadavg()[0]]
    result = {"machine": f"{platform.node()} {platform.machine()} {platform.processor()}".strip(),
              "cpus": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
              "kda": kda_ratios(args.kda_shape, args.repeats), "train": train_step(args.train_steps),
              "inference": {"k3": [], "all_mla": []}}
    for context in args.contexts:
        result["inference"]["k3"].append(inference([], context, args.repeats))
        result["inference"]["all_mla"].append(inference(all_mla, context, args.repeats))
        loads.append(os.getloadavg()[0])
        print(f"  measured context {context}", flush=True)
    result["load_average"] = max(loads)
    write_json(args.out, result)
    print(markdown(result))


if __name__ == "__main__":
    main()
