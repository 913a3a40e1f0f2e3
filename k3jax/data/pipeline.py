"""The grain pipeline under the packed-text datasets: a random-access row source, a seeded shuffle per epoch.

    rows = grain.MapDataset.source(PackedRows(stream, seq_len)).shuffle(split_seed(seed, split))
    rows[i]   the row global index i reads: place ``i % n`` of epoch ``i // n``'s permutation of the n rows

grain's shuffle permutes each epoch with a bijective index hash seeded by ``split_seed + epoch``
(``index_shuffle``: O(1) memory however many rows, no permutation array), and its source wraps a
global index round the epoch, so ``rows`` is an endless, random-access stream whose element ``i`` is a
pure function of ``(seed, split, i)``. A process reads only the indices `shard_row_indices` gives it,
so the rows of a batch do not depend on the number of processes, and a resumed run reads the same
rows from the same step.

grain is imported when a pipeline is first built (its import takes ~2 s of CPU), so runs on the
embedded MQAR task do not pay for it.
"""
from __future__ import annotations

import numpy as np

from k3jax.data.batching import SPLITS, Batch
from k3jax.data.packing import TokenStream, pack_rows


class PackedRows:
    """Row ``r`` of a token stream (`k3jax.data.packing.pack_rows`) as a grain random-access data source."""

    def __init__(self, stream: TokenStream, seq_len: int):
        self.stream, self.seq_len = stream, seq_len

    def __len__(self) -> int:
        return self.stream.num_rows(self.seq_len)

    def __getitem__(self, row: int) -> Batch:
        """The row's ``tokens``, ``targets``, ``loss_mask`` and ``segment_ids``, each ``[seq_len]``."""
        packed = pack_rows(self.stream, np.array([row], dtype=np.int64), self.seq_len)
        return {key: value[0] for key, value in packed.items()}


def split_seed(seed: int, split: str) -> int:
    """A 32-bit shuffle seed for ``(seed, split)``; hashed, so that ``split_seed + epoch`` (grain's
    per-epoch seed) of one split does not meet another split's."""
    return int(np.random.SeedSequence([seed, SPLITS.index(split)]).generate_state(1)[0])


def shuffled_row_stream(stream: TokenStream, seq_len: int, seed: int, split: str):
    """The endless shuffled ``grain.MapDataset`` of ``stream``'s rows (see the module docstring)."""
    import grain

    return grain.MapDataset.source(PackedRows(stream, seq_len)).shuffle(seed=split_seed(seed, split))


def stack_rows(rows: list[Batch]) -> Batch:
    """Rows (dicts of ``[T]`` arrays) stacked into a batch (dict of ``[R, T]`` arrays)."""
    return {key: np.stack([row[key] for row in rows]) for key in rows[0]}
