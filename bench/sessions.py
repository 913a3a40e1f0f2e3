"""Session-store throughput, measured side by side in one run (`k3jax.sessions.SessionStore`):

    decode   64 sessions of different lengths step together (one batched jitted step per token)
             vs the same 64 sessions decoded one at a time: tokens/s of each and their ratio; and
             the batched step over the pools (the kernels of ``model.kda.implementation``, in
             place) vs the baseline step that gathers a contiguous bank, decodes and scatters it
             back (``store.feeder.gathered_decode``, `k3jax.sessions.paged.decode_step`)
    prefix   opening a session whose prompt starts with a cached 4K-token prefix (prefill only
             the suffix) vs a cold prefill of the same prompt in a store without the cache
    capacity one session's decode step (pooled and gathered) vs the pools' slot capacity
             (`SessionStore.reserve`): where the backend copies the donated pools (XLA on CPU),
             a step costs in proportion to the capacity, which is why a server parks the
             sessions that wait (`SessionStore.park`)

Each trial starts from the same state (sessions rolled back to a snapshot; a fresh cold store),
so the two warm-up trials compile every program the timed trials run. Trials of the two variants
alternate in order; the table reports medians.

    python -m bench.sessions [--config configs/tiny.yaml] [--sessions 64] [--new-tokens 8]
                                [--prefix 4096] [--trials 3] [--parts decode,prefix,capacity]
                                [--capacities 8,64,256,1024] [--json bench/sessions.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np
from flax import nnx

from bench.common import seconds, table, timed, write_json
from k3jax.config import ConfigError, load_config
from k3jax.model import K3Model
from k3jax.sessions import SessionStore

# Uncounted trials first, one in each order: they compile every program, including those for the
# pool capacities the rollbacks grow into, so the timed trials run compiled code only.
WARMUP_TRIALS = 2
PARTS = ("decode", "prefix", "capacity")
CAPACITY_STEPS = 20


def decode_trials(store: SessionStore, sids, handles, new_tokens: int, trials: int) -> dict:
    """Seconds per trial for the batched and the one-at-a-time decode of ``new_tokens`` per session."""
    def reset():
        for sid, handle in zip(sids, handles):
            store.rollback(sid, handle)

    modes = {"batched": (False, lambda: store.generate(sids, new_tokens)),
             "batched_gathered": (True, lambda: store.generate(sids, new_tokens)),
             "one_at_a_time": (False, lambda: [store.generate([sid], new_tokens) for sid in sids])}
    trial_seconds = {name: [] for name in modes}
    for trial in range(trials + WARMUP_TRIALS):
        order = list(modes) if trial % 2 == 0 else list(modes)[::-1]
        for name in order:
            reset()
            store.feeder.gathered_decode = modes[name][0]
            elapsed = seconds(modes[name][1])
            if trial >= WARMUP_TRIALS:
                trial_seconds[name].append(elapsed)
    store.feeder.gathered_decode = False
    return trial_seconds


def open_timed(store: SessionStore, prompt: np.ndarray) -> tuple[float, np.ndarray]:
    """Seconds to open a session on ``prompt`` (closed again) and its last logits."""
    def open_and_read():
        sid = store.open(prompt)
        return sid, store.logits(sid)

    (sid, logits), elapsed = timed(open_and_read)
    store.close(sid)
    return elapsed, logits


def prefix_trials(model, shared: np.ndarray, suffixes: list[np.ndarray], trials: int) -> tuple[dict, float]:
    """Seconds per open for a cold store and for a store holding ``shared`` in its prefix cache;
    also the largest logit difference between the two."""
    warm = SessionStore(model)
    warm.close(warm.open(np.concatenate([shared, suffixes[0]])))
    trial_seconds, difference = {"cold_prefill": [], "prefix_hit": []}, 0.0
    for trial in range(trials + WARMUP_TRIALS):
        prompt = np.concatenate([shared, suffixes[trial % len(suffixes)]])
        stores = {"cold_prefill": SessionStore(model), "prefix_hit": warm}
        order = list(stores) if trial % 2 == 0 else list(stores)[::-1]
        logits = {}
        for name in order:
            elapsed, logits[name] = open_timed(stores[name], prompt)
            if trial >= WARMUP_TRIALS:
                trial_seconds[name].append(elapsed)
        difference = max(difference, float(np.abs(logits["prefix_hit"] - logits["cold_prefill"]).max()))
    return trial_seconds, difference


def capacity_trials(model, capacities: list[int], steps: int) -> list[dict]:
    """Median seconds of one session's decode step, pooled and gathered, for pools of each of
    ``capacities`` slots (four pages a slot)."""
    rows = []
    for capacity in capacities:
        store = SessionStore(model, prefix_cache=False)
        store.reserve(capacity, 4 * capacity)
        sid = store.open(np.arange(1, 6))
        row = {"slot_capacity": store.stats()["slot_capacity"], "pool_mib": store.stats()["device_pool_bytes"] / 2**20}
        for name, gathered in (("pooled", False), ("gathered", True)):
            store.feeder.gathered_decode = gathered
            for _ in range(3):                        # compile
                store.generate([sid], 1)
            row[f"{name}_step_ms"] = 1000 * statistics.median(seconds(store.generate, [sid], 1) for _ in range(steps))
        rows.append(row)
    return rows


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.sessions", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts to run (comma-separated: {', '.join(PARTS)})")
    parser.add_argument("--capacities", default="8,64,256,1024", help="slot capacities of the capacity part")
    parser.add_argument("--json", default="bench/sessions.json")
    args = parser.parse_args(argv)
    if min(args.sessions, args.new_tokens, args.prefix, args.trials) < 1:
        parser.error("--sessions, --new-tokens, --prefix and --trials must be positive")
    args.parts = args.parts.split(",")
    if not args.parts or any(part not in PARTS for part in args.parts):
        parser.error(f"--parts takes some of {', '.join(PARTS)}, got {','.join(args.parts)!r}")
    try:
        args.capacities = [int(c) for c in args.capacities.split(",")]
    except ValueError:
        parser.error(f"--capacities takes comma-separated integers, got {args.capacities!r}")
    if min(args.capacities) < 1:
        parser.error("--capacities must be positive")
    return args


def measure_decode(model, config, sessions: int, new_tokens: int, trials: int) -> dict:
    """The decode part (see the module doc), medians over ``trials``."""
    rng = np.random.default_rng(0)
    page = config.kda.chunk_size
    store = SessionStore(model)
    # lengths spread over one page bucket, so every trial runs the same compiled programs
    lengths = rng.integers(page // 4, page // 2, sessions)
    sids = [store.open(rng.integers(0, config.vocab_size, n)) for n in lengths]
    handles = [store.snapshot(sid) for sid in sids]
    print(f"decode: {sessions} sessions x {new_tokens} tokens, {trials} trials", file=sys.stderr)
    decode = decode_trials(store, sids, handles, new_tokens, trials)
    tokens = sessions * new_tokens
    median = {name: statistics.median(values) for name, values in decode.items()}
    return {
        "sessions": sessions, "new_tokens": new_tokens, "trials": trials, "decode_seconds": decode,
        "batched_tokens_per_s": tokens / median["batched"],
        "one_at_a_time_tokens_per_s": tokens / median["one_at_a_time"],
        "batched_speedup": median["one_at_a_time"] / median["batched"],
        "batched_gathered_tokens_per_s": tokens / median["batched_gathered"],
        "pooled_vs_gathered_speedup": median["batched_gathered"] / median["batched"],
        "kda_implementation": config.kda.implementation,
    }


def measure_prefix(model, config, prefix: int, trials: int) -> dict:
    """The prefix part (see the module doc), medians over ``trials``."""
    rng = np.random.default_rng(1)
    shared = rng.integers(0, config.vocab_size, prefix)
    suffixes = [rng.integers(0, config.vocab_size, 16) for _ in range(trials + WARMUP_TRIALS)]
    print(f"prefix: {prefix} shared + 16 tokens, {trials} trials", file=sys.stderr)
    prefix_seconds, difference = prefix_trials(model, shared, suffixes, trials)
    median = {name: statistics.median(values) for name, values in prefix_seconds.items()}
    return {
        "prefix_tokens": prefix, "suffix_tokens": 16, "prefix_seconds": prefix_seconds,
        "cold_prefill_s": median["cold_prefill"], "prefix_hit_s": median["prefix_hit"],
        "prefix_speedup": median["cold_prefill"] / median["prefix_hit"],
        "prefix_hit_max_logit_difference": difference,
    }


def measure(config, sessions: int, new_tokens: int, prefix: int, trials: int) -> dict:
    """The decode and prefix parts on a model of ``config`` (a `ModelConfig`; `bench.gpu` runs it)."""
    model = K3Model(config, rngs=nnx.Rngs(0))
    return {**measure_decode(model, config, sessions, new_tokens, trials), **measure_prefix(model, config, prefix, trials)}


def result_rows(result: dict, args) -> list[list]:
    """The table's rows for the parts in ``result``."""
    rows = []
    if "batched_speedup" in result:
        rows += [
            ["batched decode, tokens/s", f"{result['batched_tokens_per_s']:.1f}"],
            ["one-at-a-time decode, tokens/s", f"{result['one_at_a_time_tokens_per_s']:.1f}"],
            ["  ratio (batched / one at a time)", f"{result['batched_speedup']:.2f}"],
            ["batched, gather/decode/scatter, tokens/s", f"{result['batched_gathered_tokens_per_s']:.1f}"],
            [f"  ratio (pooled, kda.implementation={result['kda_implementation']} / gathered)",
             f"{result['pooled_vs_gathered_speedup']:.2f}"]]
    if "prefix_speedup" in result:
        rows += [
            [f"cold prefill of {args.prefix}+16 tokens, s", f"{result['cold_prefill_s']:.3f}"],
            ["prefix-cache hit (prefill 16 tokens), s", f"{result['prefix_hit_s']:.3f}"],
            ["  ratio (cold / hit)", f"{result['prefix_speedup']:.2f}"],
            ["hit vs cold, max |logit difference|", f"{result['prefix_hit_max_logit_difference']:.2e}"]]
    for row in result.get("capacity", []):
        rows.append([f"one session's decode step, {row['slot_capacity']} slots ({row['pool_mib']:.0f} MiB of pools), "
                     "ms pooled / gathered", f"{row['pooled_step_ms']:.2f} / {row['gathered_step_ms']:.2f}"])
    return rows


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args.config).model
    except (ConfigError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model = K3Model(config, rngs=nnx.Rngs(0))
    result = {"config": args.config, "parts": args.parts}
    if "decode" in args.parts:
        result.update(measure_decode(model, config, args.sessions, args.new_tokens, args.trials))
    if "prefix" in args.parts:
        result.update(measure_prefix(model, config, args.prefix, args.trials))
    if "capacity" in args.parts:
        print(f"capacity: {args.capacities} slots, {CAPACITY_STEPS} steps each", file=sys.stderr)
        result["capacity"] = capacity_trials(model, args.capacities, CAPACITY_STEPS)
    print(table(["measurement", "value"], result_rows(result, args)))
    print(f"wrote {write_json(args.json, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
