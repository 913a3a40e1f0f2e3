"""Training and evaluation data: host-side NumPy batches that resume from ``(seed, step)`` alone.

    MQARDataset(seq_len, num_pairs=16, num_keys=256, num_values=256, ...)   generated recall task
    TextDataset(path, seq_len, seed=0, heldout_fraction=0.05, ...)         local text / JSON(L)

    ds.batch(step, batch_size, split="train", process_index=0, process_count=1) -> dict of [B/P, T]
        tokens, targets (int32), loss_mask (float32), segment_ids (int32; 0 = padding)
    ds.vocab_size, ds.describe(), ds.content_hash();   splits: "train", "heldout"

Bad input raises `DataError` (a ValueError) with a one-line message naming the file.
"""
from k3jax.data.batching import SPLITS, Batch, Dataset
from k3jax.data.errors import DataError
from k3jax.data.mqar import MQARDataset, mqar_recall
from k3jax.data.text import TextDataset
from k3jax.data.tokenizers import ByteTokenizer, TiktokenTokenizer, Tokenizer, load_tokenizer

__all__ = ["SPLITS", "Batch", "Dataset", "DataError", "MQARDataset", "mqar_recall", "TextDataset",
           "ByteTokenizer", "TiktokenTokenizer", "Tokenizer", "load_tokenizer"]
