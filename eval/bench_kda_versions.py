"""The chunked KDA of this tree against the one of another git revision, side by side.

    python -m eval.bench_kda_versions REV [--chunk-sizes 16 64] [--rounds 9] [--out FILE]

Loads ``k3jax/ops/kda/chunk.py`` as it is at REV (``git show``) next to the working tree's, runs
both on the same inputs (the shapes and bounded gates of `eval.bench_kda`) in interleaved rounds
(`eval.bench_kda.interleaved_times`: the order rotates from round to round), and prints the best
time of each and the median of the per-round time ratios, for the forward and for
forward+backward, with the largest difference between the two versions' results. For
performance work on the chunk form, where this machine's run-to-run noise is larger than the
effects measured. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench_kda import SHAPES, interleaved_times, make_inputs
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
    print(f"\n{'B,T,H,K,V':22s} {'C':>3s} {'measured':17s} {args.revision[:12]:>12s} {'working tree':>13s} "
          f"{'speed-up':>9s} {'max |diff|':>10s}")
    for r in rows:
        old, new = r["best_s"].values()
        print(f"{str(tuple(r['shape'])):22s} {r['chunk_size']:3d} {r['measured']:17s} {old * 1e3:9.1f} ms "
              f"{new * 1e3:10.1f} ms {r['median_speedup']:8.2f}x {r['max_abs_difference']:10.1e}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(revision=args.revision, rows=rows), indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
