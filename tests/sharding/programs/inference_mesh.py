"""A model restored onto 8 devices (expert=4 x tensor=2) runs as it does on one device.

The weights: the micro K3 at d = 256 with 8 experts and two heads per mixer, saved at
initialisation, loaded on the mesh: the per-device bytes. The runs: the same at the micro width,
trained a few steps on MQAR, loaded on one device and on the mesh: how the mesh compares with one
device on: the full forward's logits;
eval's MQAR recall and perplexity; `generate` (greedy and sampled); the session store's batched
decode with fork, snapshot and rollback, save and load, device -> host -> disk tiers and a prefix-cache
hit, and its pools' shardings; speculative decoding by prompt lookup; the model in bfloat16 (``--dtype``) on the mesh against float32 on one device.
``eval.chat`` and ``eval.serve`` (driven by the ``openai`` client) on this mesh are checked against
one device in tests/sharding/test_inference_processes.py, with the mesh's 8 devices in two processes:
the same code as one process of 8 devices, and the processes' lockstep besides.
"""
import pathlib
import sys
import tempfile

import jax
import numpy as np
from flax import nnx

from eval.cli import evaluate
from eval.tasks import MQARLengthTask, PerplexityTask
from k3jax.config import SpeculationConfig
from k3jax.inference import generate, load_run
from k3jax.sessions import SessionStore, Speculator
from k3jax.training import Trainer
from tests.helpers import rel_err
from tests.sharding.programs.common import emit, small_k3_config

MESH = "expert=4,tensor=2"
EXPERTS = "model.moe.num_experts=8"
WIDE = ("model.d_model=256", "model.moe.expert_width=64", "model.moe.latent_dim=64", "model.dense_width=256")
TASKS = [PerplexityTask(batches_per_seed=1, batch_size=8),
         MQARLengthTask(length_multipliers=(1,), rows_per_seed=16, batch_size=8)]
PROMPTS = [[5, 9, 12, 5, 9], [7, 3, 3, 8, 1, 4, 4, 2, 9, 9, 11, 30, 2], [100, 101]]


def weight_bytes(model) -> dict:
    """Total bytes of the weights, the largest per-device share and the fully replicated bytes."""
    per_device: dict = {}
    total = replicated = 0
    for leaf in jax.tree.leaves(nnx.state(model)):
        total += leaf.nbytes
        replicated += leaf.nbytes if leaf.sharding.is_fully_replicated else 0
        for shard in leaf.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    return {"total": total, "largest_device": max(per_device.values()), "replicated": replicated,
            "devices": len(per_device)}


def report_values(report: dict) -> dict:
    """``{task/metric: value}`` of a report's numbers."""
    values = {}

    def walk(prefix, node):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}/{key}", value)
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(f"{prefix}/{index}", value)
        elif isinstance(node, float) and "seconds" not in prefix and "per_s" not in prefix:
            values[prefix] = node
    walk("", report.get("tasks", report))
    return values


def session_work(model, speculate: bool) -> dict:
    """Tokens of a store's work: batched greedy and sampled decode, fork, snapshot and rollback
    (and the pools' shardings after it)."""
    store = SessionStore(model)
    sids = [store.open(prompt) for prompt in PROMPTS]
    out = {"greedy": [t.tolist() for t in store.generate(sids, 6)]}
    out["logits"] = np.asarray(store.logits(sids[0])).tolist()     # after the same tokens on both
    out["sampled"] = [t.tolist() for t in store.generate(sids, 6, temperature=1.0, top_p=0.9, seed=3)]
    fork = store.fork(sids[1])
    handle = store.snapshot(sids[1])
    out["fork"] = [t.tolist() for t in store.generate([fork, sids[1]], 5)]
    store.rollback(sids[1], handle)
    out["after_rollback"] = store.generate([sids[1]], 5)[0].tolist()
    saved = pathlib.Path(tempfile.mkdtemp()) / "store"
    store.save(saved)                   # every value read back from the pools
    loaded = SessionStore.load(model, saved)   # and written into new ones on use
    out["after_load"] = [t.tolist() for t in loaded.generate(sorted(loaded.sessions()), 4)]
    pools, shardings = store._device.arrays, store._device.shardings
    out["pool_specs"] = None if shardings is None else [str(sharding.spec) for sharding in shardings]
    out["pools_kept"] = shardings is None or all(array.sharding.is_equivalent_to(sharding, array.ndim)
                                                 for array, sharding in zip(pools, shardings))
    if speculate:
        speculator = Speculator.of(store, SpeculationConfig(prompt_lookup=3, k=3))
        sid = store.open(PROMPTS[0] * 3)
        out["speculative"] = store.generate([sid], 8, speculator=speculator)[0].tolist()
    out.update(tiered_work(model))
    return out


def tiered_work(model) -> dict:
    """Tokens of sessions that move device -> host -> disk and back (a device budget of one
    session, a host budget of one more, a disk tier) and of a prompt that resumes from a cached
    prefix (in a store without budgets, which would drop the cache's entries first); the tiers'
    and the cache's counters say they did."""
    probe = SessionStore(model)
    long_prompt = (PROMPTS[1] * 3)[:model.config.kda.chunk_size + 5]     # a whole chunk: a cached boundary
    store = SessionStore(model, device_bytes=probe.slot_bytes + 2 * probe.page_bytes,
                         host_bytes=probe.slot_bytes + 2 * probe.page_bytes, disk_dir=tempfile.mkdtemp())
    sids = [store.open(prompt) for prompt in (long_prompt, PROMPTS[0], PROMPTS[2])]
    tiers = [store.generate([sid], 4)[0].tolist() for sid in sids]          # each comes back on use
    counts = store.stats()
    cached = SessionStore(model)                                            # room for the prefix entries
    cached.open(long_prompt)
    resumed = cached.open(long_prompt[:model.config.kda.chunk_size] + [7, 7])
    tiers.append(cached.generate([resumed], 4)[0].tolist())
    counts["prefix_hits"] = cached.stats()["prefix_hits"]
    return {"tiers": tiers, "tiers_counts": {key: counts[key] > 0 for key in
                                             ("spills_to_host", "spills_to_disk", "loads_from_host",
                                              "loads_from_disk", "prefix_hits")}}


def largest_difference(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def main() -> None:
    root = pathlib.Path(tempfile.mkdtemp())
    Trainer(small_k3_config(f"run_dir={root / 'wide'}", EXPERTS, *WIDE)).save(force=True)
    wide = load_run(str(root / "wide"), mesh=MESH)
    Trainer(small_k3_config(f"run_dir={root / 'run'}", "train.steps=6", "train.eval_batches=0", EXPERTS)).run()
    one, sharded = load_run(str(root / "run")), load_run(str(root / "run"), mesh=MESH)
    tokens = np.asarray([PROMPTS[1] * 4], np.int32)
    forward = jax.jit(lambda model, t: model(t).logits)
    reports = [evaluate(run, TASKS, 1, show_progress=False)[0] for run in (one, sharded)]
    values = [report_values(report) for report in reports]
    generated = [generate(run.model, np.asarray(PROMPTS[:1] * 2), max_new_tokens=6).tokens.tolist() for run in (one, sharded)]
    sampled = [generate(run.model, np.asarray(PROMPTS[:1] * 2), max_new_tokens=6, temperature=1.0, seed=5).tokens.tolist()
               for run in (one, sharded)]
    work = [session_work(run.model, speculate=True) for run in (one, sharded)]
    half = load_run(str(root / "run"), mesh=MESH, dtype="bfloat16")
    half_logits = forward(half.model, tokens)
    emit({
        "bytes": weight_bytes(wide.model),
        "mesh": sharded.placement.describe(),
        "logits": largest_difference(forward(one.model, tokens), forward(sharded.model, tokens)),
        "eval_keys": sorted(values[0]) == sorted(values[1]) and len(values[0]) > 0,
        "eval": max(abs(values[0][key] - values[1][key]) / max(abs(values[0][key]), 1e-30) for key in values[0]),
        "generate": generated[0] == generated[1], "sampled": sampled[0] == sampled[1],
        "store": {key: work[0][key] == work[1][key] for key in ("greedy", "sampled", "fork", "after_rollback",
                                                                 "after_load", "speculative", "tiers")},
        "tiers_counts": [one_work["tiers_counts"] for one_work in work],
        "store_logits": largest_difference(work[0]["logits"], work[1]["logits"]),
        "pool_specs": work[1]["pool_specs"], "pools_kept": work[1]["pools_kept"],
        "bf16_dtypes": sorted({str(leaf.dtype) for leaf in jax.tree.leaves(nnx.state(half.model))}),
        "bf16_sharded_alike": all(a.sharding.is_equivalent_to(b.sharding, a.ndim) for a, b in
                                  zip(jax.tree.leaves(nnx.state(half.model)), jax.tree.leaves(nnx.state(sharded.model)))),
        "bf16_logits": rel_err(half_logits, forward(one.model, tokens)),
        "devices": len(jax.devices()),
    })


if __name__ == "__main__":
    sys.exit(main())
