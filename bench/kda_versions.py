"""The chunked KDA of this tree against the one of another git revision, side by side.

    python -m bench.kda_versions REV [--chunk-sizes 16 64] [--rounds 9] [--out FILE]

Loads ``k3jax/ops/kda/chunk.py`` as it is at REV (``git show``) next to the working tree's, runs
both on the same inputs (the shapes and bounded gates of `bench.kda`) in interleaved rounds
(`bench.common.interleaved_times`: the order rotates from round to round), and prints the best
time of each and the median of the per-round time ratios, for the forward and for
forward+backward, with the largest difference between the two versions' results. For
performance work on the chunk form, where this machine's run-to-run noise is larger than the
effects measured. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import interleaved_times, table, write_json
from bench.kda import SHAPES, make_inputs
from k3jax.host import keep_freed_memory
from k3jax.ops.kda import chunk as working_tree

CHUNK_MODULE = "k3jax/ops/kda/chunk.py"


def load_revision(revision: str, directory: pathlib.Path):
    """The chunk module as it is at ``revision``, imported under a private name."""
    source = subprocess.run(["git", "show", f"{revision}:{CHUNK_MODULE}"], capture_output=True, text=True)
    if source.returncode != 0:
        sys.exit(f"error: cannot read {CHUNK_MODULE} at {revision}: {source.stderr.strip()}")
    path = directory / "chunk_at_revision.py"
    path.write_text(source.stdout)
    spec = importlib.util.spec_from_file_location("chunk_at_revision", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(versions, shape, chunk_size: int, rounds: int):
    """Rows for the forward and forward+backward of ``versions`` (name -> module) at one shape."""
    q, k, v, g, beta = make_inputs(shape, "bounded")
    batch, _, heads, key_dim, value_dim = shape
    args = (q * key_dim**-0.5, k, v, g, beta, jnp.zeros((batch, heads, key_dim, value_dim)))

    def forward(module):
        return jax.jit(lambda *a: module.chunk_kda(*a, None, chunk_size)[0])

    def forward_backward(module):
        def loss(*a):
            o, state = module.chunk_kda(*a, None, chunk_size)
            return jnp.sum(o * o) + jnp.sum(state * state)
        return jax.jit(jax.grad(loss, argnums=tuple(range(6))))

    rows = []
    for pass_name, make in (("forward", forward), ("forward+backward", forward_backward)):
        fns = [make(module) for module in versions.values()]
        results = [fn(*args) for fn in fns]
        difference = max(float(jnp.max(jnp.abs(a - b)))
                         for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])))
        times = interleaved_times(fns, args, rounds)
        rows.append(dict(shape=list(shape), chunk_size=chunk_size, measured=pass_name,
                         best_s=dict(zip(versions, times.min(axis=0).tolist())),
                         median_speedup=float(np.median(times[:, 0] / times[:, 1])),
                         max_abs_difference=difference))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", help="git revision whose chunk.py is the baseline")
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default="bench_results/kda_versions.json")
    args = parser.parse_args(argv)
    keep_freed_memory()  # before JAX starts its threads
    with tempfile.TemporaryDirectory() as directory:
        versions = {args.revision: load_revision(args.revision, pathlib.Path(directory)), "working tree": working_tree}
        rows = [row for shape in SHAPES for chunk_size in args.chunk_sizes
                for row in compare(versions, shape, chunk_size, args.rounds)]
    lines = [[str(tuple(r["shape"])), r["chunk_size"], r["measured"],
              *(f"{seconds * 1e3:.1f} ms" for seconds in r["best_s"].values()),
              f"{r['median_speedup']:.2f}x", f"{r['max_abs_difference']:.1e}"] for r in rows]
    headers = ["B,T,H,K,V", "C", "measured", args.revision[:12], "working tree", "speed-up", "max |diff|"]
    print("\n" + table(headers, lines))
    print(f"\nwrote {write_json(args.out, dict(revision=args.revision, rows=rows))}")


if __name__ == "__main__":
    main()
