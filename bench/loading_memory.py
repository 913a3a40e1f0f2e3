"""Peak host memory while `k3jax.inference.load_run` restores a model onto one device, a mesh of
one process, and a mesh of two processes.

    python -m bench.loading_memory [--d-model 1024] [--work /tmp/k3jax_loading_bench]
                                   [--json bench_results/loading_memory.json]

A 4-layer micro-K3 widened to ``--d-model`` (8 experts; about 0.9 GB in fp32 at 1024) is saved
once, untrained. Each load runs in a fresh subprocess (CPU devices, whose memory is the process's
own) that samples its resident memory every 2 ms while `load_run` runs and reports the growth
over what it held before (JAX started, devices made), next to the bytes of the shards it ends up
holding and the largest array of the model, with the arrays read by one Orbax restore and in
groups (`k3jax.checkpoint.RESTORE_GROUP_BYTES`) side by side. The bound to compare with is one
array plus this process's shards. Prints a table and writes the rows as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import threading
import time

from bench.common import table, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]
MICRO = ROOT / "tests" / "train" / "micro.yaml"
CASES = (("one device", 1, 1, None), ("1 process x 8 devices", 1, 8, "expert=4,tensor=2"),
         ("2 processes x 4 devices", 2, 4, "expert=4,tensor=2"))
WHOLE = 2**62          # --group-bytes for one Orbax restore of every array (as before the groups)


def widened(d_model: int) -> list[str]:
    """Overrides of the micro config: every width scaled from ``d_model``, 8 heads, 8 experts."""
    return [f"model.d_model={d_model}", f"model.dense_width={4 * d_model}", "model.kda.num_heads=8",
            f"model.kda.head_dim={d_model // 8}", "model.mla.num_heads=8", f"model.mla.q_lora_rank={d_model // 2}",
            f"model.mla.kv_lora_rank={d_model // 2}", "model.moe.num_experts=8", f"model.moe.expert_width={2 * d_model}",
            f"model.moe.latent_dim={d_model}"]


def save_model(run_dir: pathlib.Path, d_model: int) -> None:
    from k3jax.config import load_config
    from k3jax.training import Trainer
    Trainer(load_config(MICRO, [f"run_dir={run_dir}", *widened(d_model)])).save(force=True)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_load(run_dir: str, mesh: str | None, group_bytes: int) -> dict:
    """In a child: the resident memory's peak growth during `load_run` with Orbax restores of
    ``group_bytes`` each (`k3jax.checkpoint.RESTORE_GROUP_BYTES`), this process's shard bytes and
    the largest array's bytes."""
    import jax
    from flax import nnx

    from k3jax import checkpoint
    from k3jax.inference import load_run

    checkpoint.RESTORE_GROUP_BYTES = group_bytes
    jax.devices()
    before, peak, done = resident_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident_bytes())
            time.sleep(0.002)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    run = load_run(run_dir, mesh=mesh)
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    arrays = [leaf for leaf in jax.tree.leaves(nnx.state(run.model)) if isinstance(leaf, jax.Array)]
    shards = sum(shard.data.nbytes for array in arrays for shard in array.addressable_shards)
    return {"peak_growth": max(peak[0], resident_bytes()) - before, "shards": shards,
            "largest_array": max(array.nbytes for array in arrays), "model": sum(a.nbytes for a in arrays),
            "seconds": seconds}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_case(run_dir: pathlib.Path, processes: int, devices: int, mesh: str | None, group_bytes: int) -> list[dict]:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    command = [sys.executable, "-m", "bench.loading_memory", "--child", str(run_dir), "--group-bytes",
               str(group_bytes)] + (["--mesh", mesh] if mesh else [])
    address = f"127.0.0.1:{free_port()}"
    jobs = [subprocess.Popen(command + (["--coordinator-address", address, "--num-processes", str(processes),
                                         "--process-id", str(index)] if processes > 1 else []),
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for index in range(processes)]
    results = []
    for job in jobs:
        out, err = job.communicate(timeout=1800)
        if job.returncode != 0:
            raise SystemExit(f"a load failed:\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def child(args: argparse.Namespace) -> None:
    if args.coordinator_address:
        from k3jax.sharding import initialize_distributed
        initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
    print(json.dumps(measure_load(args.child, args.mesh, args.group_bytes)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--work", default="/tmp/k3jax_loading_bench")
    parser.add_argument("--json", default="bench_results/loading_memory.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--group-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mesh", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator-address", help=argparse.SUPPRESS)
    parser.add_argument("--num-processes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    work = pathlib.Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    save_model(work / "run", args.d_model)
    from k3jax.checkpoint import RESTORE_GROUP_BYTES
    rows, records = [], []
    gb = 1e9
    for name, processes, devices, mesh in CASES:
        for reads, group_bytes in (("one restore", WHOLE), (f"groups of {RESTORE_GROUP_BYTES >> 20} MiB", RESTORE_GROUP_BYTES)):
            for index, result in enumerate(run_case(work / "run", processes, devices, mesh, group_bytes)):
                bound = result["shards"] + result["largest_array"]
                rows.append([name, index, reads, f"{result['model'] / gb:.2f}", f"{result['shards'] / gb:.2f}",
                             f"{result['largest_array'] / gb:.3f}", f"{result['peak_growth'] / gb:.2f}",
                             f"{result['peak_growth'] / bound:.2f}", f"{result['seconds']:.1f}"])
                records.append({"case": name, "process": index, "mesh": mesh, "group_bytes": group_bytes, **result})
    print(table(["load", "process", "reads", "model GB", "its shards GB", "largest array GB", "peak RSS growth GB",
                 "growth / (shards + array)", "s"], rows))
    print(f"wrote {write_json(args.json, {'d_model': args.d_model, 'rows': records})}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
