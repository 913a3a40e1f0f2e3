"""The grain pipeline under the packed-text datasets: which row each global row index reads.

    order = grain.MapDataset.range(n).shuffle(seed=split_seed(seed, split))
    order[i]   the row global index i reads: place ``i % n`` of epoch ``i // n``'s permutation of the n rows

grain's shuffle permutes each epoch with a bijective index hash seeded by ``split_seed + epoch``
(``index_shuffle``: O(1) memory however many rows, no permutation array), and the range wraps a
global index round the epoch, so ``order`` is an endless random-access stream whose element ``i`` is
a pure function of ``(seed, split, i)``. A process looks up only the indices `shard_row_indices`
gives it and gathers those rows from the random-access token stream in one vectorized
`k3jax.data.packing.pack_rows` (6x the rows/s of mapping a per-row source through grain and
stacking, measured here), so the rows of a batch do not depend on the number of processes, and a
resumed run reads the same rows from the same step.

grain is imported when a row order is first built (its import takes ~2 s of CPU), so runs on the
embedded MQAR task do not pay for it.
"""
from __future__ import annotations

import functools

import numpy as np

from k3jax.data.batching import SPLITS


def split_seed(seed: int, split: str) -> int:
    """A 32-bit shuffle seed for ``(seed, split)``; hashed, so that ``split_seed + epoch`` (grain's
    per-epoch seed) of one split does not meet another split's."""
    return int(np.random.SeedSequence([seed, SPLITS.index(split)]).generate_state(1)[0])


@functools.lru_cache(maxsize=32)
def shuffled_row_order(num_rows: int, seed: int, split: str):
    """The endless ``grain.MapDataset`` of row numbers in shuffled epochs (see the module docstring);
    built once per ``(num_rows, seed, split)``."""
    import grain

    return grain.MapDataset.range(num_rows).shuffle(seed=split_seed(seed, split))


def rows_at(order, indices: np.ndarray) -> np.ndarray:
    """The row numbers (int64) that global row ``indices`` read in ``order``."""
    return np.fromiter((order[int(index)] for index in indices), dtype=np.int64, count=len(indices))
