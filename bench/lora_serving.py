"""Several LoRA adapters served over one base (`k3jax.inference.adapters`, ``eval.serve --lora``): what
the adapter banks cost in the batched decode step and in a prefill, side by side in one run.

The base is an untrained `configs/tiny.yaml` run; each adapter a LoRA run of random factors on the
default targets (`k3jax.convert.peft.write_lora_run`). Three ways of serving, each with its own
`SessionStore`:

    plain        the base model, no bank (``eval.serve`` without ``--lora``)
    banks, base  the model with banks of ``--adapters`` slots of rank ``--rank``, every row on the base
    banks, mixed the same banks, rows cycling over the base and every adapter (one batch, all adapters)

For each ``--batch``: median decode tokens/s of ``--steps`` store steps over ``--trials`` trials, the
three ways taking turns; then the median seconds of a ``--prefill``-token prefill (the prefix cache
off), plain vs on an adapter. Nothing is asserted: the table and the JSON report what happened.

    python -m bench.lora_serving [--batch 1 8 32] [--adapters 4] [--rank 16] [--steps 16] [--trials 5]
                                 [--prefill 512] [--json bench/lora_serving.json] [OVERRIDE ...]

``OVERRIDE``s (``key=value``) change the base's config, e.g. ``model.d_model=512`` for a model
wider than the banks' rank N * R.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import numpy as np

from bench.common import table, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]


def make_runs(root: pathlib.Path, adapters: int, rank: int, overrides: list[str]) -> tuple[pathlib.Path, dict[str, str]]:
    """An untrained tiny base run (``overrides`` applied) and ``adapters`` LoRA runs of random factors on it."""
    from k3jax.config import config_from_dict, load_config, to_dict
    from k3jax.convert.peft import write_lora_run
    from k3jax.training import Trainer
    from k3jax.training.finetune import abstract_lora_model

    base = root / "base"
    trainer = Trainer(load_config(ROOT / "configs" / "tiny.yaml", [*overrides, f"run_dir={base}",
                                                                    "checkpoint.async_save=false", "logging.progress=false"]))
    trainer.save(force=True)
    trainer.checkpoints.wait()
    trainer.close()
    runs = {}
    for number in range(adapters):
        config = config_from_dict({**to_dict(load_config(base / "config.yaml")), "init_from": str(base),
                                   "run_dir": str(root / f"lora{number}"),
                                   "finetune": {"lora_rank": rank, "lora_alpha": 2.0 * rank}})
        lora = abstract_lora_model(config.model, config.finetune, config.train.seed)
        rng = np.random.default_rng(number)
        write_lora_run(root / f"lora{number}", config, lora,
                       {key: rng.normal(0, 0.05, value.shape).astype(np.float32) for key, value in lora.adapters.items()})
        runs[f"lora{number}"] = str(root / f"lora{number}")
    return base, runs


def measure(base: pathlib.Path, runs: dict[str, str], batches: list[int], steps: int, trials: int,
            prefill: int) -> dict:
    from k3jax.inference import load_run
    from k3jax.inference.adapters import ServedAdapters
    from k3jax.sessions import Sampling, SessionStore

    plain = SessionStore(load_run(str(base)).model, prefix_cache=False)
    banked_run = load_run(str(base))
    served = ServedAdapters.attach(banked_run, runs)
    banked = SessionStore(banked_run.model, prefix_cache=False)
    banked.serve_adapters(served.tags())
    tags = [""] + [served.tag(name) for name in runs]
    rng = np.random.default_rng(0)
    decode = []
    for batch in batches:
        prompts = [rng.integers(1, 250, 32).tolist() for _ in range(batch)]
        sessions = {"plain": (plain, [plain.open(p) for p in prompts]),
                    "banks, base": (banked, [banked.open(p) for p in prompts]),
                    "banks, mixed": (banked, [banked.open(p, adapter=tags[i % len(tags)]) for i, p in enumerate(prompts)])}

        def run_steps(way: str) -> float:
            store, sids = sessions[way]
            start = time.perf_counter()
            for _ in range(steps):
                store.step({sid: Sampling() for sid in sids})
            return batch * steps / (time.perf_counter() - start)

        for way in sessions:                              # compile and warm up
            run_steps(way)
        speeds = {way: [] for way in sessions}
        for trial in range(trials):
            order = list(sessions)[trial % 3:] + list(sessions)[: trial % 3]
            for way in order:
                speeds[way].append(run_steps(way))
        medians = {way: statistics.median(values) for way, values in speeds.items()}
        decode.append({"batch": batch, "tokens_per_second": medians,
                       "ratio_to_plain": {way: medians[way] / medians["plain"] for way in medians}})
        for store, sids in sessions.values():
            for sid in sids:
                store.close(sid)

    prompt = rng.integers(1, 250, prefill).tolist()

    def prefill_seconds(store, tag) -> float:
        start = time.perf_counter()
        store.close(store.open(prompt, adapter=tag))
        return time.perf_counter() - start
    prefill_ways = {"plain": (plain, ""), "on an adapter": (banked, tags[1])}
    for store, tag in prefill_ways.values():
        prefill_seconds(store, tag)
    times = {way: statistics.median(prefill_seconds(*prefill_ways[way]) for _ in range(trials)) for way in prefill_ways}
    bank_bytes = sum(variable.get_value().nbytes for bank in served.banks.values() for variable in (bank.a, bank.b))
    return {"d_model": banked_run.config.model.d_model, "decode": decode, "prefill": {"tokens": prefill, "seconds": times,
                                          "ratio_to_plain": times["on an adapter"] / times["plain"]},
            "banks": {"weights": len(served.banks), "slots": len(runs) + 1, "rank": served.rank, "bytes": bank_bytes}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--json", default="bench/lora_serving.json")
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="key=value for the base's config")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        base, runs = make_runs(pathlib.Path(root), args.adapters, args.rank, args.overrides)
        result = measure(base, runs, args.batch, args.steps, args.trials, args.prefill)
    ways = list(result["decode"][0]["tokens_per_second"])
    print(table(["batch", *(f"{way} tok/s" for way in ways), *(f"{way} / plain" for way in ways[1:])],
                [[row["batch"], *(f"{row['tokens_per_second'][w]:.0f}" for w in ways),
                  *(f"{row['ratio_to_plain'][w]:.2f}" for w in ways[1:])] for row in result["decode"]]))
    prefill = result["prefill"]
    print(f"\nprefill of {prefill['tokens']} tokens: plain {prefill['seconds']['plain']:.3f} s, on an adapter "
          f"{prefill['seconds']['on an adapter']:.3f} s ({prefill['ratio_to_plain']:.2f}x)")
    banks = result["banks"]
    print(f"banks: {banks['weights']} weights x {banks['slots']} slots of rank {banks['rank']}, "
          f"{banks['bytes'] / 2**20:.1f} MiB; d_model {result['d_model']}")
    write_json(args.json, {"args": vars(args), **result})


if __name__ == "__main__":
    main()
