"""KDA kernels on one GPU: correctness against the XLA chunk path, speed, decode bandwidth.

    python -m bench.kda_gpu --out kda_gpu.json           # H100/H200: about 3-4 minutes
    python -m bench.kda_gpu --smoke --out smoke.json     # tiny shapes, any machine (CPU: interpret)

Sections, each isolated (a failure is printed and recorded, the rest still run) and skipped
once the time budget (--budget-s) is spent:
  1. correctness  "pallas" vs "chunk" on the device: values and gradients (fp32 inputs, odd T,
                  grouped values, packed segments, initial state, unbounded gates), bf16 values,
                  and finite values/gradients with gates of -1000;
  2. decode       `kda_pool_step` / `conv_pool_step` "pallas" vs "reference" (XLA), other slots untouched;
  3. bandwidth    the decode kernel at 256 sessions: state bytes moved per second against a
                  device-to-device copy measured in the same run (target >= 60%);
  4. speed        forward and forward+backward at (B, T, H, K, V) = (1, 8192, 16, 128, 128) and
                  (8, 4096, 32, 128, 128), q/k/v in bf16 (gates and beta fp32, as the layer makes
                  them), "pallas" vs "chunk", and fla's Triton `chunk_kda` when importable.
Prints a table at the end and writes everything as JSON to --out.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave memory for fla's torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import median_seconds, median_step_seconds, median_synchronized_seconds, write_json  # noqa: E402
from k3jax.ops.kda import kda, kda_gate  # noqa: E402
from k3jax.ops.kda.decode_pool import conv_pool_step, kda_pool_step  # noqa: E402

SPEED_SHAPES = [(1, 8192, 16, 128, 128), (8, 4096, 32, 128, 128)]
SMOKE_SPEED_SHAPES = [(1, 80, 2, 16, 16)]
TOLERANCE = {"values": 2e-4, "gradients": 1e-3, "bf16_values": 2e-2}
DECODE_TOLERANCE = {"kda o": 2e-2, "kda written states": 1e-5, "conv y": 2e-2}
# Speed targets: Pallas forward+backward at least 2x faster than the chunk form and at most 1.5x
# fla's time; the decode step moving its states at >= 60% of a device copy's bandwidth.
SPEEDUP_OVER_CHUNK, TIME_OVER_FLA, DECODE_FRACTION_OF_COPY = 2.0, 1.5, 0.6


def log(message: str) -> None:
    print(message, flush=True)


def rel_err(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def failed_checks(results: dict, tolerance) -> list[str]:
    """The checks in ``results`` that failed: a False flag, or an error above ``tolerance(name)``
    or NaN."""
    return [name for name, value in results.items()
            if (not value if isinstance(value, bool) else not value <= tolerance(name))]


def chunk_tolerance(name: str) -> float:
    """The tolerance of one `check_against_chunk` error, by its kind."""
    return (TOLERANCE["bf16_values"] if name.startswith("bf16") else
            TOLERANCE["gradients"] if name.startswith("grad") else TOLERANCE["values"])


class Report:
    """Runs sections under a time budget, records results and failures, writes JSON after each."""

    def __init__(self, out_path: str, budget_s: float):
        self.out_path, self.budget_s, self.start = out_path, budget_s, time.perf_counter()
        self.data = {"environment": {}, "sections": {}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def run(self, name: str, fn, *args):
        if self.elapsed() > self.budget_s:
            log(f"[{self.elapsed():6.1f}s] SKIPPED {name}: time budget of {self.budget_s:.0f}s spent")
            self.data["sections"][name] = {"status": "skipped"}
            return None
        log(f"[{self.elapsed():6.1f}s] {name} ...")
        began = time.perf_counter()
        try:
            result = fn(*args)
            entry = {"status": "ok", "result": result}
            log(f"[{self.elapsed():6.1f}s] {name}: ok {json.dumps(result, default=str)}")
        except Exception as error:  # noqa: BLE001  (one failure must not hide the other sections)
            entry = {"status": "failed", "error": f"{type(error).__name__}: {error}"[:4000],
                     "traceback": traceback.format_exc()[-4000:]}
            result = None
            log(f"[{self.elapsed():6.1f}s] FAILED {name}: {entry['error'][:2000]}")
            log(entry["traceback"][-2500:])
        entry["seconds"] = round(time.perf_counter() - began, 2)
        self.data["sections"][name] = entry
        self.write()
        return result

    def write(self) -> None:
        write_json(self.out_path, self.data)


def kda_inputs(seed, batch, length, heads, value_heads, key_dim, value_dim, *, dtype, gate="bounded"):
    """Random KDA inputs on the default device: unit q/k, gates from `kda_gate` (K3's bounded or
    Kimi Linear's unbounded form), beta in (0, 1)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 7)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32)  # noqa: E731
    raw = 3.0 * normal(keys[3], (batch, length, value_heads, key_dim))
    a_log = jnp.log(jax.random.uniform(keys[4], (value_heads,), minval=1.0, maxval=16.0))
    bound = -5.0 if gate == "bounded" else None
    return dict(
        q=unit(normal(keys[0], (batch, length, heads, key_dim))).astype(dtype),
        k=unit(normal(keys[1], (batch, length, heads, key_dim))).astype(dtype),
        v=normal(keys[2], (batch, length, value_heads, value_dim)).astype(dtype),
        g=kda_gate(raw, a_log, normal(keys[5], (value_heads, key_dim)), lower_bound=bound),
        beta=jax.nn.sigmoid(normal(keys[6], (batch, length, value_heads))),
    )


def _loss_and_outputs(implementation, x, initial_state, segment_ids, cotangent):
    o, state = kda(**x, initial_state=initial_state, segment_ids=segment_ids, implementation=implementation)
    loss = jnp.vdot(o.astype(jnp.float32), cotangent) + jnp.sum(state * state)
    return loss, (o, state)


def check_against_chunk(smoke: bool):
    """Pallas vs the XLA chunk path on this device: values, gradients, bf16, extreme gates."""
    batch, length, heads, value_heads, dim = (1, 45, 1, 2, 16) if smoke else (2, 300, 2, 4, 128)
    x = kda_inputs(0, batch, length, heads, value_heads, dim, dim, dtype=jnp.float32, gate="unbounded")
    initial_state = jax.random.normal(jax.random.PRNGKey(1), (batch, value_heads, dim, dim))
    lengths = [length // 3, 2, length - length // 3 - 2]       # three documents, one of two tokens
    segment_ids = jnp.asarray(np.repeat(np.arange(3), lengths)[None].repeat(batch, 0))
    cotangent = jax.random.normal(jax.random.PRNGKey(2), (batch, length, value_heads, dim))
    results = {}

    def grads(implementation, inputs):
        fn = jax.grad(functools.partial(_loss_and_outputs, implementation), argnums=(0, 1), has_aux=True)
        return jax.jit(fn)(inputs, initial_state, segment_ids, cotangent)

    (g_pallas, s_pallas), (o_pallas, st_pallas) = grads("pallas", x)
    (g_chunk, s_chunk), (o_chunk, st_chunk) = grads("chunk", x)
    results["fp32 o"] = rel_err(o_pallas, o_chunk)
    results["fp32 final_state"] = rel_err(st_pallas, st_chunk)
    for name in x:
        results[f"grad {name}"] = rel_err(g_pallas[name], g_chunk[name])
    results["grad initial_state"] = rel_err(s_pallas, s_chunk)

    bf16 = {n: (a.astype(jnp.bfloat16) if n in ("q", "k", "v") else a) for n, a in x.items()}
    run = jax.jit(lambda x, s, ids, implementation: kda(**x, initial_state=s, segment_ids=ids,
                                                         implementation=implementation), static_argnums=3)
    results["bf16 o"] = rel_err(run(bf16, initial_state, segment_ids, "pallas")[0],
                                run(bf16, initial_state, segment_ids, "chunk")[0])

    extreme = dict(x, g=x["g"].at[:, length // 5 : length // 2].set(-1000.0))
    (g_extreme, _), (o_extreme, _) = grads("pallas", extreme)
    results["extreme gates finite"] = bool(all(np.isfinite(np.asarray(a)).all()
                                               for a in [o_extreme, *g_extreme.values()]))
    failed = failed_checks(results, chunk_tolerance)
    results["pass"] = not failed
    results["failed_checks"] = failed
    return results


def check_decode(smoke: bool):
    """Pallas pool steps vs the XLA ("reference") gather/step/scatter form; untouched slots bit-identical."""
    slots_total, sessions, heads, value_heads, dim = (8, 3, 1, 2, 16) if smoke else (64, 16, 4, 8, 128)
    rng = np.random.default_rng(0)
    slots = jnp.asarray(rng.permutation(slots_total)[:sessions], jnp.int32)
    x = kda_inputs(3, sessions, 1, heads, value_heads, dim, dim, dtype=jnp.bfloat16)
    token = {n: a[:, 0] for n, a in x.items()}
    pool = jax.random.normal(jax.random.PRNGKey(4), (slots_total, value_heads, dim, dim))
    step = jax.jit(lambda pool, slots, token, implementation: kda_pool_step(
        pool, slots, **token, implementation=implementation), static_argnums=3)
    o_pallas, pool_pallas = step(pool, slots, token, "pallas")
    o_reference, pool_reference = step(pool, slots, token, "reference")
    untouched = np.setdiff1d(np.arange(slots_total), np.asarray(slots))
    channels = 3 * heads * dim
    tails = jax.random.normal(jax.random.PRNGKey(5), (slots_total, 3, channels)).astype(jnp.bfloat16)
    x_conv = jax.random.normal(jax.random.PRNGKey(6), (sessions, channels)).astype(jnp.bfloat16)
    weight = jax.random.normal(jax.random.PRNGKey(7), (channels, 4))
    conv = jax.jit(lambda tails, slots, x, weight, implementation: conv_pool_step(
        tails, slots, x, weight, implementation=implementation), static_argnums=4)
    y_pallas, tails_pallas = conv(tails, slots, x_conv, weight, "pallas")
    y_reference, tails_reference = conv(tails, slots, x_conv, weight, "reference")
    results = {
        "kda o": rel_err(o_pallas.astype(jnp.float32), o_reference.astype(jnp.float32)),
        "kda written states": rel_err(pool_pallas[slots], pool_reference[slots]),
        "kda untouched slots identical": bool(np.array_equal(np.asarray(pool_pallas)[untouched],
                                                             np.asarray(pool)[untouched])),
        "conv y": rel_err(y_pallas.astype(jnp.float32), y_reference.astype(jnp.float32)),
        "conv tails identical to reference": bool(np.array_equal(np.asarray(tails_pallas, np.float32),
                                                                 np.asarray(tails_reference, np.float32))),
    }
    failed = failed_checks(results, DECODE_TOLERANCE.get)
    results["pass"] = not failed
    results["failed_checks"] = failed
    return results


def bench_decode_bandwidth(smoke: bool, iters: int):
    """Decode at 256 sessions: state bytes read+written per second vs a device copy (x + 1)."""
    sessions, slots_total, value_heads, dim = (4, 8, 2, 16) if smoke else (256, 512, 32, 128)
    heads = value_heads
    slots = jnp.asarray(np.random.default_rng(1).permutation(slots_total)[:sessions], jnp.int32)
    x = kda_inputs(8, sessions, 1, heads, value_heads, dim, dim, dtype=jnp.bfloat16)
    token = {n: a[:, 0] for n, a in x.items()}
    state_bytes = 2 * sessions * value_heads * dim * dim * 4          # each addressed state read + written
    results = {"sessions": sessions, "value_heads": value_heads, "state_bytes_per_step": state_bytes}
    for implementation in ("pallas", "reference"):
        step = jax.jit(lambda pool, slots, token: kda_pool_step(pool, slots, **token,
                                                                implementation=implementation)[1],
                       donate_argnums=0)
        pool = jnp.zeros((slots_total, value_heads, dim, dim), jnp.float32)
        pool, seconds = median_step_seconds(step, pool, slots, token, iters=iters)
        results[f"{implementation} step ms"] = seconds * 1e3
        results[f"{implementation} GB/s"] = state_bytes / seconds / 1e9
        del pool
    copy_source = jnp.zeros((state_bytes // 8,), jnp.float32)        # state_bytes / 2 bytes: read + write
    _, copy_seconds = median_seconds(jax.jit(lambda a: a + 1.0), copy_source, iters=iters)
    results["copy GB/s"] = state_bytes / copy_seconds / 1e9
    results["pallas fraction of copy"] = results["pallas GB/s"] / results["copy GB/s"]

    channels = 3 * heads * dim
    tails = jnp.zeros((slots_total, 3, channels), jnp.bfloat16)
    x_conv = jnp.ones((sessions, channels), jnp.bfloat16)
    weight = jnp.ones((channels, 4), jnp.float32)
    conv = jax.jit(lambda tails, slots, x, weight: conv_pool_step(tails, slots, x, weight,
                                                                  implementation="pallas")[1],
                   donate_argnums=0)
    _, conv_seconds = median_step_seconds(conv, tails, slots, x_conv, weight, iters=iters)
    results["pallas conv step ms"] = conv_seconds * 1e3
    return results


def bench_jax(shape, implementation, iters):
    batch, length, heads, dim, _ = shape
    x = kda_inputs(9, batch, length, heads, heads, dim, dim, dtype=jnp.bfloat16)
    cotangent = jax.random.normal(jax.random.PRNGKey(10), (batch, length, heads, dim)).astype(jnp.bfloat16)
    forward = jax.jit(lambda x: kda(**x, implementation=implementation))

    def loss(x, cotangent):
        o, state = kda(**x, implementation=implementation)
        return jnp.vdot(o.astype(jnp.float32), cotangent.astype(jnp.float32)) + jnp.sum(state)

    both = jax.jit(jax.grad(loss))
    compile_fwd, fwd = median_seconds(forward, x, iters=iters)
    compile_both, fwd_bwd = median_seconds(both, x, cotangent, iters=iters)
    return {"fwd ms": fwd * 1e3, "fwd+bwd ms": fwd_bwd * 1e3,
            "first fwd call s": compile_fwd, "first fwd+bwd call s": compile_both}


def bench_fla(shape, iters):
    """fla's Triton chunk_kda on the same shapes (torch, bf16 q/k/v, fp32 gates and beta)."""
    import torch
    from fla.ops.kda import chunk_kda

    batch, length, heads, dim, _ = shape
    torch.manual_seed(0)
    normal = lambda *size: torch.randn(*size, device="cuda", dtype=torch.float32)  # noqa: E731
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    q = unit(normal(batch, length, heads, dim)).to(torch.bfloat16).requires_grad_()
    k = unit(normal(batch, length, heads, dim)).to(torch.bfloat16).requires_grad_()
    v = normal(batch, length, heads, dim).to(torch.bfloat16).requires_grad_()
    g = (-5.0 * torch.sigmoid(3.0 * normal(batch, length, heads, dim))).requires_grad_()   # K3's bounded gate
    beta = torch.sigmoid(normal(batch, length, heads)).requires_grad_()
    d_o = normal(batch, length, heads, dim).to(torch.bfloat16)

    def forward():
        return chunk_kda(q, k, v, g, beta, scale=dim**-0.5, output_final_state=True)

    def forward_backward():
        o, state = forward()
        torch.autograd.backward([o, state], [d_o, torch.ones_like(state)])

    results = {}
    for name, fn in (("fwd", lambda: torch.no_grad()(forward)()), ("fwd+bwd", forward_backward)):
        seconds = median_synchronized_seconds(fn, torch.cuda.synchronize, iters=iters, warmup=2)  # 2: autotuning
        results[f"{name} ms"] = seconds * 1e3
    del q, k, v, g, beta, d_o
    torch.cuda.empty_cache()
    return results


def fla_available() -> bool:
    try:
        import torch
        from fla.ops.kda import chunk_kda  # noqa: F401
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001  (any import problem means: not available)
        return False


def environment():
    device = jax.devices()[0]
    return {"jax": jax.__version__, "backend": jax.default_backend(), "device": str(device),
            "device_kind": getattr(device, "device_kind", "?"), "python": platform.python_version(),
            "pallas mode": "compiled" if jax.default_backend() in ("gpu", "tpu") else "interpret",
            "fla": fla_available()}


def print_table(report: Report, shapes) -> None:
    sections = report.data["sections"]
    log("\n" + "=" * 96)
    log(f"{'shape (B,T,H,K,V)':<24}{'impl':<8}{'fwd ms':>12}{'fwd+bwd ms':>14}"
        f"{'fwd speedup':>14}{'fwd+bwd speedup':>18}")
    for shape in shapes:
        rows = {impl: (sections.get(f"speed {shape} {impl}") or {}).get("result")
                for impl in ("pallas", "chunk", "fla")}
        chunk = rows["chunk"] or {}
        for impl, row in rows.items():
            if row is None:
                status = (sections.get(f"speed {shape} {impl}") or {}).get("status", "not run")
                log(f"{str(shape):<24}{impl:<8}{status:>12}")
                continue
            speedups = [chunk.get(key, float("nan")) / row[key] for key in ("fwd ms", "fwd+bwd ms")]
            log(f"{str(shape):<24}{impl:<8}{row['fwd ms']:>12.2f}{row['fwd+bwd ms']:>14.2f}"
                f"{speedups[0]:>13.2f}x{speedups[1]:>17.2f}x")
    log(f"(speedup = chunk time / this time; targets: pallas fwd+bwd >= {SPEEDUP_OVER_CHUNK:g}x chunk, "
        f"within {TIME_OVER_FLA:g}x of fla)")
    decode = (sections.get("decode bandwidth") or {}).get("result")
    if decode:
        log(f"decode, {decode['sessions']} sessions x {decode['value_heads']} heads: pallas "
            f"{decode['pallas GB/s']:.0f} GB/s ({decode['pallas step ms']:.3f} ms/step), reference "
            f"{decode['reference GB/s']:.0f} GB/s, copy {decode['copy GB/s']:.0f} GB/s -> pallas at "
            f"{100 * decode['pallas fraction of copy']:.0f}% of copy (target >= {DECODE_FRACTION_OF_COPY:.0%}); "
            f"conv pool step {decode['pallas conv step ms']:.3f} ms")
    for name in ("correctness: pallas vs chunk", "correctness: decode pool"):
        entry = sections.get(name) or {}
        verdict = (entry.get("result") or {}).get("pass") if entry.get("status") == "ok" else entry.get("status")
        log(f"{name}: {'PASS' if verdict is True else 'FAIL' if verdict is False else verdict}")
    failed = [name for name, entry in sections.items() if entry.get("status") == "failed"]
    log(f"failed sections: {failed or 'none'}")
    log("=" * 96)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="path of the JSON report")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (a dry run on any machine)")
    parser.add_argument("--budget-s", type=float, default=270.0, help="skip sections once this many seconds passed")
    parser.add_argument("--iters", type=int, default=5, help="timed repetitions per measurement")
    args = parser.parse_args(argv)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        print(f"error: the directory of --out does not exist: {out_dir}", file=sys.stderr)
        return 2

    report = Report(args.out, args.budget_s)
    report.data["environment"] = environment()
    log(f"environment: {json.dumps(report.data['environment'])}")
    if report.data["environment"]["backend"] != "gpu" and not args.smoke:
        log("warning: no GPU backend; the kernels run in interpret mode (use --smoke for a quick dry run)")
    shapes = SMOKE_SPEED_SHAPES if args.smoke else SPEED_SHAPES
    report.run("correctness: pallas vs chunk", check_against_chunk, args.smoke)
    report.run("correctness: decode pool", check_decode, args.smoke)
    report.run("decode bandwidth", bench_decode_bandwidth, args.smoke, args.iters)
    for shape in shapes:
        for implementation in ("pallas", "chunk"):
            report.run(f"speed {shape} {implementation}", bench_jax, shape, implementation, args.iters)
        if report.data["environment"]["fla"]:
            report.run(f"speed {shape} fla", bench_fla, shape, args.iters)
    report.data["total_seconds"] = round(report.elapsed(), 1)
    report.write()
    print_table(report, shapes)
    log(f"wrote {args.out} after {report.elapsed():.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
