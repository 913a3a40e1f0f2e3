"""Every accelerator check and benchmark of bench/ in one command: one table, one JSON file.

    python -m bench.gpu [--parts NAME ...] [--budget-s 570] [--out bench/gpu.json]   # one GPU, < 10 min
    python -m bench.gpu --smoke        # tiny sizes on any machine (on CPU the Pallas kernels interpret)

Each part runs in a process of its own, under a time limit (`PARTS`, cut to what is left of
``--budget-s``; with ``--smoke`` `SMOKE_LIMIT_S` each and no overall budget), so a crash, a hang
or running out of device memory costs only that part's rows;
this process starts no JAX backend, and each part has the device to itself. The parts reuse the
topic benchmarks' functions:

    kda-check    Pallas KDA vs the XLA chunk form on the device: values, gradients, bf16 values,
                 finite values and gradients under gates of -1000 (`bench.kda_gpu.check_against_chunk`)
    decode-pool  the pooled decode steps, Pallas vs XLA, other slots untouched
                 (`bench.kda_gpu.check_decode`); the decode step's state bandwidth, Pallas and XLA
                 vs a device copy (`bench.kda_gpu.bench_decode_bandwidth`)
    kda-speed    forward and forward+backward ms, Pallas vs chunk, and fla's Triton kernel where it
                 is importable (`bench.kda_gpu.bench_jax`, `bench_fla`)
    mxfp4        routed experts' forward+backward ms, dense bf16 vs MXFP4 decoded by XLA
                 (`bench.mxfp4_gpu.measure` at its defaults: one device's share of K3's experts)
    train-step   a K3-shaped train step (`K3_SHAPED`) built by the trainer
                 (`bench.step_profile.scratch_trainer`): first call, median step time, tokens/s,
                 model TFLOP/s and MFU against the measured matmul rate (the trainer's default peak:
                 one 2048^3 matmul, which may understate a large GPU's peak)
    sessions     the session store: batched vs one-at-a-time decode, pooled vs gathered, prefix-cache
                 hit vs cold prefill (`bench.sessions.measure` on configs/tiny.yaml)
    sharded-decode  the session store's batched decode on one device and on ``--mesh auto`` over
                 every device: equal greedy tokens, tokens/s of each (`sharded_decode`)
    speculative  speculative vs plain greedy decode of 16 sessions of a random `K3_SHAPED` model with
                 drafts of known continuations, every draft accepted and none
                 (`bench.speculative.bounds_case`): equal outputs, tokens/s, verify vs decode step ms

``--kda-implementation chunk|pallas`` builds the train-step, sessions and speculative parts' models
with those KDA kernels (default auto: Pallas on a GPU, whose Triton compiles ran the first runs' parts
out of time).

A row is a check (pass or FAIL against its tolerance or target) or a figure. Speed targets are
judged on an accelerator only; with ``--smoke`` they are figures. A part that fails, crashes or
runs out of time ends with an ``error`` row. Exits 1 when any row FAILs.

First H200 run (2026-12-04, JAX 0.11.2, 520 s budget; grain carried as wheels): decode-pool and
mxfp4 passed (Pallas decode at 0.75 of a device copy's bandwidth; MXFP4 experts' forward+backward
1.00-1.10x dense bf16); kda-check, kda-speed, train-step and sessions ran out of their limits, all
in Pallas KDA compiles (see `PARTS`). Runtime was not the problem: Pallas forward 1.31 ms vs
chunk 1.79 ms at (1, 1024, 4, 128, 128), equal gradients' time at (1, 128, 2, 64, 64).
Second H200 run (2026-12-04, JAX 0.11.2; sessions, train-step, kda-check under a 540 s budget, KDA
auto = Pallas): all three stopped at their 150 / 240 / 149 s limits, again in compiles (XLA's slow
compile alarm for the train step's loss); ``--kda-implementation chunk`` was added after it, to
tell the compile cost from the runtime, and has not yet run on a GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, Iterator, NamedTuple

import numpy as np

import k3jax  # noqa: F401  (XLA:CPU settings before a part starts the backend; starts none itself)
from bench.common import table, timed, write_json

ITERS = 5                  # timed repetitions per KDA measurement
TRAIN_STEPS = 10           # timed train steps after the first
# K3's layer widths (configs/k3.yaml) at a depth, expert count, vocabulary and sequence that fit
# one H200 with Muon: 4 layers (dense FFN + KDA, 2 x KDA + MoE, MLA + MoE), 16 experts top-8,
# vocabulary 32K, one 2048-token sequence. 4.9B parameters; ``python -m train.plan configs/k3.yaml
# --devices 1`` with these overrides (XLA:CPU's estimate): 38 GiB of parameters and optimizer
# state, 118 GiB at the peak (163 GiB with 4096 tokens). Muon's Newton-Schulz products take 407
# TFLOP per step, the model 48 (`k3jax.flops.training_flops`, all the MFU counts): at one sequence
# per step the optimizer does most of the work.
K3_SHAPED = ("configs/k3.yaml", ["model.num_layers=4", "model.moe.num_experts=16", "model.moe.top_k=8",
                                 "model.vocab_size=32768", "optimizer.name=muon", "train.batch_size=1",
                                 "data.seq_len=2048", "data.num_pairs=512", "data.num_keys=4096",
                                 "data.num_values=4096"])
SMOKE_TRAIN = ("configs/tiny.yaml", ["model.num_layers=2", "model.mla_period=2", "model.attn_res.block_size=2",
                                     "train.batch_size=2", "data.seq_len=32", "data.num_pairs=4"])   # KDA, MLA
SMOKE_MXFP4 = ["--experts", "4", "--width", "64", "--hidden", "64", "--tokens", "64", "--top-k", "2",
               "--tiles", "2", "--rounds", "2"]
SESSIONS = {"sessions": 64, "new_tokens": 8, "prefix": 4096, "trials": 2}
SMOKE_SESSIONS = {"sessions": 4, "new_tokens": 2, "prefix": 64, "trials": 1}


class Row(NamedTuple):
    check: str
    value: float | bool | str
    verdict: str            # "pass", "FAIL" or "figure"


def figure(check: str, value) -> Row:
    return Row(check, value, "figure")


def judged(check: str, value, ok: bool) -> Row:
    return Row(check, value, "pass" if ok else "FAIL")


def speed_target(check: str, value: float, met: bool, smoke: bool) -> Row:
    """A speed target: judged on a device, a figure where the kernels interpret (``--smoke``)."""
    return figure(check, value) if smoke else judged(check, value, met)


def check_rows(results: dict) -> Iterator[Row]:
    """The rows of a `bench.kda_gpu` check's results (its ``failed_checks`` say which fail)."""
    failed = set(results["failed_checks"])
    for name, value in results.items():
        if name not in ("pass", "failed_checks"):
            yield judged(name, value, name not in failed)


def kda_check(smoke: bool) -> Iterator[Row]:
    from bench.kda_gpu import check_against_chunk

    yield from check_rows(check_against_chunk(smoke))


def decode_pool(smoke: bool) -> Iterator[Row]:
    from bench.kda_gpu import DECODE_FRACTION_OF_COPY, bench_decode_bandwidth, check_decode

    yield from check_rows(check_decode(smoke))
    result = bench_decode_bandwidth(smoke, ITERS)
    sessions = f"{result['sessions']} sessions x {result['value_heads']} heads"
    for implementation in ("pallas", "reference"):
        yield figure(f"{implementation} decode step ms, {sessions}", result[f"{implementation} step ms"])
        yield figure(f"{implementation} state GB/s", result[f"{implementation} GB/s"])
    yield figure("device copy GB/s", result["copy GB/s"])
    fraction = result["pallas fraction of copy"]
    yield speed_target(f"pallas / copy bandwidth (target >= {DECODE_FRACTION_OF_COPY:g})", fraction,
                       fraction >= DECODE_FRACTION_OF_COPY, smoke)
    yield figure("pallas conv pool step ms", result["pallas conv step ms"])


def timing_rows(shape: str, implementation: str, times: dict) -> Iterator[Row]:
    for key in ("fwd ms", "fwd+bwd ms"):
        yield figure(f"{shape} {implementation} {key}", times[key])


def kda_speed(smoke: bool) -> Iterator[Row]:
    from bench.kda_gpu import (SMOKE_SPEED_SHAPES, SPEED_SHAPES, SPEEDUP_OVER_CHUNK, TIME_OVER_FLA, bench_fla,
                               bench_jax, fla_available)

    with_fla = fla_available()
    for shape in SMOKE_SPEED_SHAPES if smoke else SPEED_SHAPES:
        name = "BTHKV " + "x".join(map(str, shape))
        times = {}
        for implementation in ("chunk", "pallas"):
            times[implementation] = bench_jax(shape, implementation, ITERS)
            yield from timing_rows(name, implementation, times[implementation])
        speedup = times["chunk"]["fwd+bwd ms"] / times["pallas"]["fwd+bwd ms"]
        yield speed_target(f"{name} pallas fwd+bwd speed-up over chunk (target >= {SPEEDUP_OVER_CHUNK:g})",
                           speedup, speedup >= SPEEDUP_OVER_CHUNK, smoke)
        if with_fla:
            times["fla"] = bench_fla(shape, ITERS)
            yield from timing_rows(name, "fla", times["fla"])
            ratio = times["pallas"]["fwd+bwd ms"] / times["fla"]["fwd+bwd ms"]
            yield speed_target(f"{name} pallas / fla fwd+bwd time (target <= {TIME_OVER_FLA:g})", ratio,
                               ratio <= TIME_OVER_FLA, smoke)


def mxfp4(smoke: bool) -> Iterator[Row]:
    from bench.mxfp4_gpu import measure, parse_args

    args = parse_args(SMOKE_MXFP4 if smoke else [])
    result = measure(args)
    shape = f"{args.experts} experts {args.width}->{args.hidden}, {args.tokens} tokens top-{args.top_k}"
    dense = result["median_seconds"]["bf16 dense"]
    for name, seconds in result["median_seconds"].items():
        yield figure(f"{name} fwd+bwd ms ({shape})", 1e3 * seconds)
        if name != "bf16 dense":
            yield figure(f"{name} time / bf16 dense", seconds / dense)


def train_step(smoke: bool) -> Iterator[Row]:
    from bench.step_profile import scratch_trainer, step_inputs, step_seconds
    from k3jax.flops import measured_peak_flops, training_flops

    config_path, overrides = SMOKE_TRAIN if smoke else K3_SHAPED
    overrides = [*overrides, f"model.kda.implementation={kda_implementation()}"]
    with scratch_trainer(config_path, ["train.compilation_cache=null", *overrides]) as trainer:
        config = trainer.config
        state, batch = step_inputs(trainer)
        (state, metrics), first = timed(trainer.train_step, state, batch)
        yield figure(f"{'smoke-sized' if smoke else 'K3-shaped'} step ({config_path}, KDA "
                     f"{config.model.kda.implementation}): tokens per step",
                     config.train.batch_size * config.data.seq_len)
        yield figure("first step s (compiles)", first)
        finite = bool(metrics["finite"]) and bool(np.isfinite(metrics["loss"]))
        yield judged("first step's loss finite", finite, finite)
        state, times = step_seconds(trainer.train_step, state, batch, TRAIN_STEPS)
    step = statistics.median(times)
    tokens_per_second = config.train.batch_size * config.data.seq_len / step
    model_flops = tokens_per_second * training_flops(config.model, config.data.seq_len).total
    peak = measured_peak_flops(config.model.compute_dtype)
    yield figure(f"step ms (median of {TRAIN_STEPS})", 1e3 * step)
    yield figure("tokens/s", tokens_per_second)
    yield figure("model TFLOP/s", model_flops / 1e12)
    yield figure(f"MFU vs the measured {config.model.compute_dtype} matmul rate ({peak / 1e12:.3g} TFLOP/s)",
                 model_flops / peak)


def sessions(smoke: bool) -> Iterator[Row]:
    from bench.sessions import measure
    from k3jax.config import load_config

    sizes = SMOKE_SESSIONS if smoke else SESSIONS
    config = load_config("configs/tiny.yaml", [f"model.kda.implementation={kda_implementation()}"])
    result = measure(config.model, **sizes)
    yield figure(f"batched decode tokens/s, {sizes['sessions']} sessions", result["batched_tokens_per_s"])
    yield figure("one-at-a-time decode tokens/s", result["one_at_a_time_tokens_per_s"])
    yield figure(f"pooled ({result['kda_implementation']}) / gathered decode speed", result["pooled_vs_gathered_speedup"])
    yield figure(f"cold prefill s, {sizes['prefix']}+16 tokens", result["cold_prefill_s"])
    yield figure("prefix-cache hit s (prefill 16 tokens)", result["prefix_hit_s"])
    yield figure("prefix hit vs cold, max |logit difference|", result["prefix_hit_max_logit_difference"])


SHARDED_DECODE = {"sessions": 16, "prompt": 256, "new_tokens": 64}
SMOKE_SHARDED_DECODE = {"sessions": 4, "prompt": 16, "new_tokens": 8}


def sharded_decode(smoke: bool) -> Iterator[Row]:
    """The session store's batched greedy decode of a random configs/tiny.yaml model on one device
    and on the ``--mesh auto`` mesh of every device (`k3jax.inference.place_model`): the same
    tokens, and tokens/s of each."""
    import jax
    import numpy as np
    from flax import nnx

    from k3jax.config import load_config
    from k3jax.inference import inference_placement, place_model
    from k3jax.model import K3Model
    from k3jax.sessions import SessionStore

    sizes = SMOKE_SHARDED_DECODE if smoke else SHARDED_DECODE
    config = load_config("configs/tiny.yaml", [f"model.kda.implementation={kda_implementation()}"]).model
    model = K3Model(config, rngs=nnx.Rngs(0))
    placement = inference_placement(config, "auto")
    prompts = np.random.default_rng(0).integers(1, config.vocab_size, (sizes["sessions"], sizes["prompt"]))
    tokens, speeds = [], []
    for name, runner in (("one device", model), (placement.describe(), place_model(model, placement))):
        store = SessionStore(runner, prefix_cache=False)
        sids = [store.open(prompt) for prompt in prompts]
        store.generate(sids, 2)                                   # compiles
        start = time.perf_counter()
        tokens.append(np.stack(store.generate(sids, sizes["new_tokens"])))
        speeds.append(sizes["sessions"] * sizes["new_tokens"] / (time.perf_counter() - start))
        yield figure(f"{name}: batched decode tokens/s, {sizes['sessions']} sessions", speeds[-1])
    same = bool(np.array_equal(*tokens))
    yield judged(f"--mesh auto ({len(jax.devices())} devices) greedy = one device", same, same)


KDA_IMPLEMENTATION_VARIABLE = "K3JAX_BENCH_KDA_IMPLEMENTATION"   # --kda-implementation, to the parts


def kda_implementation() -> str:
    """The KDA implementation the train-step, sessions and speculative parts build their models with."""
    return os.environ.get(KDA_IMPLEMENTATION_VARIABLE, "auto")


SPECULATIVE = {"sessions": 16, "new_tokens": 32, "k": 4, "trials": 2}
SMOKE_SPECULATIVE = {"sessions": 2, "new_tokens": 8, "k": 2, "trials": 1}


def speculative(smoke: bool) -> Iterator[Row]:
    from types import SimpleNamespace

    from bench.speculative import bounds_case

    config_path, overrides = SMOKE_TRAIN if smoke else K3_SHAPED
    sizes = SMOKE_SPECULATIVE if smoke else SPECULATIVE
    results = bounds_case(config_path, [*overrides, f"model.kda.implementation={kda_implementation()}"],
                          SimpleNamespace(**sizes))
    rows = [(name, rollback, result) for name, by_rollback in results.items() for rollback, result in by_rollback.items()]
    for name, rollback, result in rows:
        shape = f"{name}, {rollback} rollback, {sizes['sessions']} sessions, k={sizes['k']}"
        yield judged(f"{shape}: speculative greedy = plain greedy", result["outputs_equal"], result["outputs_equal"])
        yield figure(f"{shape}: plain / speculative tokens/s",
                     f"{result['plain_tokens_per_s']:.1f} / {result['speculative_tokens_per_s']:.1f}")
        yield figure(f"{shape}: speed-up", result["speedup"])
        yield figure(f"{shape}: verify ms per round / plain ms per step",
                     f"{result['verify_ms_per_round']:.2f} / {result['plain_ms_per_step']:.2f}")


class Part(NamedTuple):
    name: str
    rows: Callable[[bool], Iterator[Row]]
    limit_s: float        # its process's wall-clock limit, start-up and compiles included


# Cheapest first: on the first H200 run (2026-12-04) Triton took 13-18 s to compile each Pallas KDA
# forward and 94 s its backward even at (1, 128, 2, 64, 64), so the parts that compile it come last
# and get the rest of the budget.
PARTS = [Part("decode-pool", decode_pool, 60), Part("mxfp4", mxfp4, 50), Part("sessions", sessions, 150),
         Part("train-step", train_step, 240), Part("kda-check", kda_check, 240), Part("kda-speed", kda_speed, 200),
         Part("speculative", speculative, 240), Part("sharded-decode", sharded_decode, 150)]
DEVICE_BUDGET_S = 570      # all parts of a device run together: under 10 minutes with the start-up
MIN_PART_S = 20            # a part is skipped when less of the budget is left
# --smoke: each part's limit (CPU compiles and interpreted kernels take minutes on a busy machine),
# no overall budget, and LLVM's optimisation off, as in the tests (less compile time, same results).
SMOKE_LIMIT_S = 900
SMOKE_XLA_FLAG = "--xla_backend_optimization_level=0"


def write_rows(part: Part, smoke: bool, path: str) -> None:
    """Run ``part`` here, writing JSON lines to ``path`` as it goes: each row (the last one an
    ``error`` row if the part raised), then the device. The device is asked for last, once the
    part has imported its modules: `bench.kda_gpu` sets how JAX allocates before JAX starts."""
    import jax

    with open(path, "w") as out:
        def emit(record: dict) -> None:
            out.write(json.dumps(record, default=str) + "\n")
            out.flush()

        try:
            for row in part.rows(smoke):
                emit(row._asdict())
        except Exception as error:  # noqa: BLE001  (the failure is this part's last row)
            traceback.print_exc()
            emit(Row("error", f"{type(error).__name__}: {error}"[:500], "FAIL")._asdict())
        device = jax.devices()[0]
        emit({"device": getattr(device, "device_kind", str(device)), "backend": jax.default_backend(),
              "jax": jax.__version__})


def child_environment(smoke: bool) -> dict:
    if not smoke:
        return dict(os.environ)
    return {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {SMOKE_XLA_FLAG}".strip()}


def run_part(part: Part, smoke: bool, limit_s: float) -> dict:
    """``part`` in a child process under ``limit_s``: its device, rows and seconds."""
    with tempfile.TemporaryDirectory(prefix="k3jax-bench-gpu-") as directory:
        path = os.path.join(directory, "rows.jsonl")
        command = [sys.executable, "-m", "bench.gpu", "--part", part.name, "--rows", path]
        command += ["--smoke"] if smoke else []
        started = time.perf_counter()
        try:
            status = subprocess.run(command, timeout=limit_s, env=child_environment(smoke)).returncode
            problem = None if status == 0 else f"the process exited with status {status}"
        except subprocess.TimeoutExpired:
            problem = f"stopped at its {limit_s:.0f} s limit"
        seconds = time.perf_counter() - started
        records = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()] \
            if os.path.exists(path) else []
    rows = [record for record in records if "check" in record]
    rows += [Row("error", problem, "FAIL")._asdict()] if problem else []
    device = next((record for record in records if "device" in record), None)
    return {"part": part.name, "seconds": round(seconds, 1), "limit_s": round(limit_s), "device": device, "rows": rows}


def run_parts(parts: list[Part], smoke: bool, budget_s: float | None) -> list[dict]:
    """Each part in turn, under its limit cut to what is left of ``budget_s`` (None: no budget)."""
    started = time.perf_counter()
    results = []
    for part in parts:
        limit_s = SMOKE_LIMIT_S if smoke else part.limit_s
        left = math.inf if budget_s is None else budget_s - (time.perf_counter() - started)
        if left < MIN_PART_S:
            results.append({"part": part.name, "seconds": 0.0, "limit_s": 0, "device": None,
                            "rows": [Row("error", f"skipped: {left:.0f} s of the budget left", "FAIL")._asdict()]})
            continue
        print(f"[{time.perf_counter() - started:6.1f} s] {part.name} (limit {min(limit_s, left):.0f} s)",
              file=sys.stderr, flush=True)
        results.append(run_part(part, smoke, min(limit_s, left)))
    return results


def shown(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def report(results: list[dict], smoke: bool, seconds: float) -> str:
    devices = {f"{r['device']['device']} ({r['device']['backend']}, JAX {r['device']['jax']})"
               for r in results if r["device"]}
    rows = [[result["part"], row["check"], shown(row["value"]), row["verdict"]]
            for result in results for row in result["rows"]]
    failed = sum(row[3] == "FAIL" for row in rows)
    return "\n".join([f"{', '.join(sorted(devices)) or 'no device reported'}{' --smoke' if smoke else ''}: "
                      f"{len(results)} parts in {seconds:.0f} s, {failed} rows FAIL",
                      table(["part", "check", "value", "result"], rows, left=2)])


def main(argv=None) -> int:
    names = [part.name for part in PARTS]
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (any machine; Pallas interprets on CPU)")
    parser.add_argument("--parts", nargs="+", choices=names, default=names, help="the parts to run (default: all)")
    parser.add_argument("--budget-s", type=float, help=f"wall-clock budget of all parts together (default: "
                                                       f"{DEVICE_BUDGET_S} s; none with --smoke)")
    parser.add_argument("--kda-implementation", choices=("auto", "chunk", "pallas"), default="auto",
                        help="the KDA kernels of the train-step, sessions and speculative parts' models (default: auto)")
    parser.add_argument("--out", default="bench/gpu.json")
    parser.add_argument("--part", choices=names, help=argparse.SUPPRESS)   # a child process: run this part
    parser.add_argument("--rows", help=argparse.SUPPRESS)                  # ... writing its rows here
    args = parser.parse_args(argv)
    if args.part:
        write_rows(PARTS[names.index(args.part)], args.smoke, args.rows)
        return 0
    os.environ[KDA_IMPLEMENTATION_VARIABLE] = args.kda_implementation
    budget_s = args.budget_s or (None if args.smoke else DEVICE_BUDGET_S)
    started = time.perf_counter()
    results = run_parts([part for part in PARTS if part.name in args.parts], args.smoke, budget_s)
    seconds = time.perf_counter() - started
    print(report(results, args.smoke, seconds))
    path = write_json(args.out, {"smoke": args.smoke, "budget_s": budget_s, "seconds": round(seconds, 1),
                                 "kda_implementation": args.kda_implementation,
                                 "parts": results})
    print(f"wrote {path}")
    return int(any(row["verdict"] == "FAIL" for result in results for row in result["rows"]))


if __name__ == "__main__":
    sys.exit(main())
