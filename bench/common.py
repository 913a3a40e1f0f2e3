"""What the benchmarks share: timing (best, median, interleaved rounds), JSON results, tables.

Run the benchmarks from the repository root (``python -m bench.kda``, ...); this folder is not
installed with the package.
"""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np


def timed(fn: Callable, *args) -> tuple[Any, float]:
    """``(fn(*args), seconds)``: the result and the wall time of one call, waiting for any JAX
    arrays in the result (``jax.block_until_ready``; other values pass through)."""
    start = time.perf_counter()
    result = jax.block_until_ready(fn(*args))
    return result, time.perf_counter() - start


def seconds(fn: Callable, *args) -> float:
    """Wall time of one call ``fn(*args)`` (see ``timed``)."""
    return timed(fn, *args)[1]


def best_time(fn: Callable, args: Sequence, repeats: int) -> float:
    """Minimum wall time over ``repeats`` runs after one compile-and-warm-up run."""
    jax.block_until_ready(fn(*args))
    return min(seconds(fn, *args) for _ in range(repeats))


def median_seconds(fn: Callable, *args, iters: int) -> tuple[float, float]:
    """(first call incl. compile, median of ``iters`` timed calls) in seconds."""
    first = seconds(fn, *args)
    return first, statistics.median(seconds(fn, *args) for _ in range(iters))


def median_step_seconds(step: Callable, carry: Any, *args, iters: int) -> tuple[Any, float]:
    """(last carry, median seconds of ``carry = step(carry, *args)``) over ``iters`` timed steps after
    one compile-and-warm-up step: for a step whose output is its next input (a state it donates
    and updates in place, like a decode step)."""
    carry = jax.block_until_ready(step(carry, *args))
    times = []
    for _ in range(iters):
        carry, elapsed = timed(step, carry, *args)
        times.append(elapsed)
    return carry, statistics.median(times)


def median_synchronized_seconds(fn: Callable[[], Any], synchronize: Callable[[], None], *, iters: int,
                                warmup: int = 1) -> float:
    """Median wall time of ``fn(); synchronize()`` over ``iters`` calls after ``warmup`` untimed ones:
    for a framework whose work is asynchronous and waited for by a call (torch: ``torch.cuda.synchronize``)."""
    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_times(fns: Sequence[Callable], args: Sequence, rounds: int) -> np.ndarray:
    """Wall times ``[rounds, len(fns)]`` after one compile-and-warm-up run each. Every round runs
    each function once, in turn, so the slow spells of a noisy machine fall on all of them alike
    and the per-round ratios stay comparable; the order rotates from round to round, so no
    function always follows the same one (after the reference's forward+backward, which frees a
    gigabyte of per-token states, the next program runs slower)."""
    for fn in fns:
        jax.block_until_ready(fn(*args))
    times = np.empty((rounds, len(fns)))
    for r in range(rounds):
        for step in range(len(fns)):
            i = (r + step) % len(fns)
            times[r, i] = seconds(fns[i], *args)
    return times


def write_json(path: str | os.PathLike, data: Any) -> pathlib.Path:
    """Write ``data`` as indented JSON to ``path`` atomically (a temporary name renamed at the end),
    creating its directory; non-JSON values are written as their ``str``."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(data, indent=2, default=str))
    os.replace(temporary, path)
    return path


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    """A text table: the first ``left`` columns left-aligned, the others right-aligned, each as wide
    as its widest cell (cells are formatted by the caller)."""
    cells = [[str(cell) for cell in row] for row in (headers, *rows)]
    widths = [max(len(row[column]) for row in cells) for column in range(len(headers))]

    def line(row):
        return "  ".join(cell.ljust(width) if column < left else cell.rjust(width)
                         for column, (cell, width) in enumerate(zip(row, widths))).rstrip()

    return "\n".join([line(cells[0]), "-" * len(line(cells[0])), *map(line, cells[1:])])
