"""Benchmark of the KDA operator on the local backend: reference scan vs chunked form.

    python -m bench.kda [--out bench_results/kda.json] [--repeats 7] [--quick]

For each shape (B, T, H, K, V) it measures, in one process and in interleaved rounds (each round
runs every implementation once, so the ratios are side by side even on a noisy machine; the
table gives the median and range of the per-round ratios): tokens/s (best round) of the forward
and of forward+backward for each implementation, the chunked
form's achieved GFLOP/s (the algorithm's FLOPs, counted by `chunk_algorithm_flops`) against an
fp32 GEMM rate measured in the same run, and the memory (from the compiled programs) of forward
vs forward+backward at T = 8192: temporaries, and all live bytes. It also measures the rate at
which XLA runs the chunk form's products with the state (16-row batched products, one thread on
XLA:CPU) and reports how much of the time the issue's speed-up targets allow (reference time /
target) those products alone would take. Gates are K3's bounded form;
one extra row times Kimi Linear's unbounded gate at its extreme, where blocks decaying by more
than exp(-80) are computed from exact pairwise decays. The process first calls
`k3jax.host.keep_freed_memory` (both implementations run under it). Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import functools
import platform

import k3jax  # noqa: F401  (XLA:CPU workaround before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

from bench.common import best_time, interleaved_times, table, write_json
from k3jax.host import keep_freed_memory
from k3jax.ops.kda import kda, kda_gate, l2_normalize
from k3jax.ops.kda.chunk import SUB_BLOCK, block_width, chunk_algorithm_flops, effective_chunk_size

SHAPES = [(1, 4096, 4, 128, 128), (4, 2048, 8, 64, 64)]
MEMORY_SHAPE = (1, 8192, 4, 128, 128)
FORWARD_TARGET, FORWARD_BACKWARD_TARGET = 3.0, 15.0  # issue 2: chunk vs reference on 2 CPU cores


def make_inputs(shape, gate: str, seed: int = 0):
    """Random inputs: unit q, k; gates 'bounded' (K3, -5 < g < 0) or 'unbounded' (Kimi Linear, strong)."""
    batch, length, heads, key_dim, value_dim = shape
    keys = jax.random.split(jax.random.key(seed), 6)
    normal = lambda key, s: jax.random.normal(key, s, jnp.float32)  # noqa: E731
    q = l2_normalize(normal(keys[0], (batch, length, heads, key_dim)))
    k = l2_normalize(normal(keys[1], (batch, length, heads, key_dim)))
    v = normal(keys[2], (batch, length, heads, value_dim))
    a_log = jnp.log(jax.random.uniform(keys[3], (heads,), minval=1.0, maxval=16.0))
    raw = normal(keys[4], (batch, length, heads, key_dim)) * (1.0 if gate == "bounded" else 3.0)
    g = kda_gate(raw, a_log, jnp.zeros((heads, key_dim)), lower_bound=-5.0 if gate == "bounded" else None)
    beta = jax.nn.sigmoid(normal(keys[5], (batch, length, heads)))
    return q, k, v, g, beta


def forward_fn(implementation, chunk_size=64):
    return jax.jit(lambda *x: kda(*x, implementation=implementation, chunk_size=chunk_size)[0])


def forward_backward_fn(implementation, chunk_size=64):
    def loss(*x):
        o, state = kda(*x, implementation=implementation, chunk_size=chunk_size)
        return jnp.sum(o * o) + jnp.sum(state * state)

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5))))


def gemm_rate(repeats: int) -> float:
    """Best fp32 GEMM rate (GFLOP/s) over n = 1024 and 2048."""
    rates = []
    for n in (1024, 2048):
        a = jax.random.normal(jax.random.key(n), (n, n), jnp.float32)
        seconds = best_time(jax.jit(lambda x: x @ x), (a,), repeats)
        rates.append(2 * n**3 / seconds / 1e9)
    return max(rates)


def state_product_rate(batch_heads: int, key_dim: int, value_dim: int, repeats: int) -> float:
    """GFLOP/s at which XLA runs the chunk form's products with the state, as inside its scan: a
    loop of dependent batched products ``[B*HV, 16, K] @ [B*HV, K, V]`` and back
    ``[B*HV, 16, V] @ [B*HV, V, K]`` (XLA:CPU runs batched products this small on one thread)."""
    steps = 64
    rows = jax.random.normal(jax.random.key(0), (batch_heads, SUB_BLOCK, key_dim), jnp.float32)
    state = jax.random.normal(jax.random.key(1), (batch_heads, key_dim, value_dim), jnp.float32) / key_dim
    back = jnp.swapaxes(state, 1, 2)

    def chain(rows, state, back):
        product = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
        return jax.lax.fori_loop(0, steps, lambda _, x: product(product(x, state), back), rows)

    seconds = best_time(jax.jit(chain), (rows, state, back), repeats)
    return 2 * 2 * batch_heads * SUB_BLOCK * key_dim * value_dim * steps / seconds / 1e9


def state_product_bound(shape, rate: float, reference: dict) -> dict:
    """How much of the time the speed-up targets allow the state products alone would take.

    The chunk form, whatever its block width, multiplies each token's rows by the state: forward
    K S_in, (Q exp Gamma) S_in and (K exp sigma)^T V~ (3 x 2 K V FLOPs per token and head); its
    backward at least dO S_in^T, dP S_in^T, V~ dS_out^T, (K exp sigma) dS_out, (Q exp Gamma)^T dO and
    (exp(Gamma) K)^T dP (6 more). At ``rate`` these take at least ``flops / rate``; the targets
    allow ``reference time / target``."""
    batch, length, heads, key_dim, value_dim = shape
    per_product = 2 * key_dim * value_dim * batch * length * heads
    bound = {}
    passes = (("forward", 3, FORWARD_TARGET), ("forward_backward", 9, FORWARD_BACKWARD_TARGET))
    for name, products, target in passes:
        seconds = products * per_product / (rate * 1e9)
        allowed = reference[f"{name}_s"] / target
        bound[name] = dict(state_product_s=seconds, target=target, allowed_s=allowed,
                           share_of_allowed=seconds / allowed)
    return dict(shape=list(shape), state_product_gflop_per_s=rate, **bound)


def program_bytes(fn, args) -> dict:
    """Temporary bytes, and all bytes live in the program (arguments + outputs + temporaries), from
    XLA's memory analysis of the compiled program."""
    analysis = fn.lower(*args).compile().memory_analysis()
    temp = int(analysis.temp_size_in_bytes)
    return dict(temp=temp, total=temp + int(analysis.argument_size_in_bytes) + int(analysis.output_size_in_bytes)
                - int(analysis.alias_size_in_bytes))


IMPLEMENTATIONS = (("reference", 64), ("chunk", 64), ("chunk", 32), ("chunk", 16))


def measure_shape(shape, gate, implementations, repeats: int, gemm: float):
    """Rows (best time of each implementation) and the per-round chunk/reference speed-ups."""
    args = make_inputs(shape, gate)
    batch, length = shape[:2]
    forward = interleaved_times([forward_fn(i, c) for i, c in implementations], args, repeats)
    both = interleaved_times([forward_backward_fn(i, c) for i, c in implementations], args, repeats)
    rows = []
    for column, (implementation, chunk_size) in enumerate(implementations):
        row = dict(shape=list(shape), gate=gate, implementation=implementation, chunk_size=chunk_size,
                   forward_s=forward[:, column].min(), forward_backward_s=both[:, column].min(),
                   forward_s_rounds=forward[:, column].tolist(), forward_backward_s_rounds=both[:, column].tolist())
        row.update(forward_tokens_per_s=batch * length / row["forward_s"],
                   forward_backward_tokens_per_s=batch * length / row["forward_backward_s"])
        if implementation == "chunk":
            # The FLOPs of the algorithm as executed: state passes every `block_width` tokens.
            flops = chunk_algorithm_flops(*shape, block_width(effective_chunk_size(length, chunk_size)))
            rate = flops / row["forward_s"] / 1e9
            row.update(forward_gflop=flops / 1e9, forward_gflop_per_s=rate, fraction_of_gemm=rate / gemm)
        rows.append(row)
        print(f"  measured {implementation:9s} C={chunk_size:<3d} {gate:9s} {shape}", flush=True)
    speedups = []
    if implementations[0][0] == "reference":
        for column, (_, chunk_size) in enumerate(implementations[1:], start=1):
            speedup = dict(shape=list(shape), chunk_size=chunk_size)
            for name, times in (("forward", forward), ("forward_backward", both)):
                ratios = times[:, 0] / times[:, column]
                speedup.update({f"{name}_best_speedup": float(times[:, 0].min() / times[:, column].min()),
                                f"{name}_speedup": float(np.median(ratios)),
                                f"{name}_speedup_range": [float(ratios.min()), float(ratios.max())]})
            speedups.append(speedup)
    return rows, speedups


def run(repeats: int, quick: bool):
    gemm = gemm_rate(repeats)
    shapes = [(1, 1024, 2, 64, 64)] if quick else SHAPES
    rows, speedups, bounds = [], [], []
    for shape in shapes:
        shape_rows, shape_speedups = measure_shape(shape, "bounded", IMPLEMENTATIONS, repeats, gemm)
        rows += shape_rows
        speedups += shape_speedups
        rate = state_product_rate(shape[0] * shape[2], shape[3], shape[4], repeats)
        bounds.append(state_product_bound(shape, rate, shape_rows[0]))
    rows += measure_shape(shapes[0], "unbounded", [("chunk", 64)], repeats, gemm)[0]
    memory_args = make_inputs((1, 1024, 2, 64, 64) if quick else MEMORY_SHAPE, "bounded")
    forward, both = (program_bytes(fn("chunk"), memory_args) for fn in (forward_fn, forward_backward_fn))
    memory = dict(
        shape=list(MEMORY_SHAPE) if not quick else [1, 1024, 2, 64, 64],
        forward_temp_bytes=forward["temp"], forward_backward_temp_bytes=both["temp"],
        ratio=both["temp"] / forward["temp"],
        forward_total_bytes=forward["total"], forward_backward_total_bytes=both["total"],
        total_ratio=both["total"] / forward["total"],
    )
    return dict(gemm_gflop_per_s=gemm, rows=rows, ratios=speedups, state_product_bounds=bounds, memory=memory)


def print_table(result):
    print(f"\nfp32 GEMM rate measured in this run: {result['gemm_gflop_per_s']:.1f} GFLOP/s "
          f"({jax.devices()[0].platform}, {jax.device_count()} device(s))")
    rows = []
    for r in result["rows"]:
        measured_rate = "forward_gflop_per_s" in r
        rows.append([str(tuple(r["shape"])), r["gate"], r["implementation"],
                     r["chunk_size"] if r["implementation"] == "chunk" else "",
                     f"{r['forward_tokens_per_s']:.0f}", f"{r['forward_backward_tokens_per_s']:.0f}",
                     f"{r['forward_gflop_per_s']:.1f}" if measured_rate else "",
                     f"{100 * r['fraction_of_gemm']:.1f}%" if measured_rate else ""])
    print(table(["B,T,H,K,V", "gate", "impl", "C", "fwd tok/s", "fwd+bwd tok/s", "GFLOP/s", "% GEMM"], rows))
    print("\nchunk vs reference in this run: best time / best time; then the median (min-max) of the "
          "ratios within each interleaved round")
    for r in result["ratios"]:
        (f_lo, f_hi), (b_lo, b_hi) = r["forward_speedup_range"], r["forward_backward_speedup_range"]
        print(f"  {tuple(r['shape'])} chunk C={r['chunk_size']}: forward {r['forward_best_speedup']:.2f}x; "
              f"{r['forward_speedup']:.2f}x ({f_lo:.2f}-{f_hi:.2f})   forward+backward "
              f"{r['forward_backward_best_speedup']:.1f}x; {r['forward_backward_speedup']:.1f}x "
              f"({b_lo:.1f}-{b_hi:.1f})")
    print("\nthe chunk form's products with the state alone (3 forward, 6 more backward) at the rate XLA runs "
          "them in this run, against the time each target allows (reference best time / target)")
    for b in result["state_product_bounds"]:
        f, fb = b["forward"], b["forward_backward"]
        print(f"  {tuple(b['shape'])} {b['state_product_gflop_per_s']:.1f} GFLOP/s: forward "
              f"{1e3 * f['state_product_s']:.1f} of {1e3 * f['allowed_s']:.1f} ms for {f['target']:.0f}x "
              f"({100 * f['share_of_allowed']:.0f}%); forward+backward {1e3 * fb['state_product_s']:.1f} of "
              f"{1e3 * fb['allowed_s']:.1f} ms for {fb['target']:.0f}x ({100 * fb['share_of_allowed']:.0f}%)")
    m = result["memory"]
    mib = 2**20
    print(f"\nmemory at {tuple(m['shape'])}, chunk 64: temporaries forward {m['forward_temp_bytes'] / mib:.0f} MiB, "
          f"forward+backward {m['forward_backward_temp_bytes'] / mib:.0f} MiB ({m['ratio']:.2f}x); "
          f"with arguments and outputs {m['forward_total_bytes'] / mib:.0f} MiB vs "
          f"{m['forward_backward_total_bytes'] / mib:.0f} MiB ({m['total_ratio']:.2f}x)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_results/kda.json", help="where to write the JSON results")
    parser.add_argument("--repeats", type=int, default=7,
                        help="interleaved rounds of timings, for the forward and for forward+backward")
    parser.add_argument("--quick", action="store_true", help="one small shape, for a smoke run")
    args = parser.parse_args(argv)
    allocator_tuned = keep_freed_memory()  # before JAX starts its threads; applies to both implementations
    result = run(args.repeats, args.quick)
    result["environment"] = dict(jax=jax.__version__, backend=jax.default_backend(),
                                 processor=platform.processor() or platform.machine(),
                                 cpu_count=len(jax.devices("cpu")), keep_freed_memory=allocator_tuned)
    print_table(result)
    print(f"\nwrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
