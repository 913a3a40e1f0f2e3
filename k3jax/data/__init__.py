"""Training and evaluation data: host-side NumPy batches that resume from ``(seed, step)`` alone.

    MQARDataset(seq_len, num_pairs=16, num_keys=256, num_values=256, ...)   generated recall task
    TextDataset(path, seq_len, seed=0, heldout_fraction=0.05, ...)         local text / JSON(L) / Parquet
    TokensDataset(path, seq_len, seed=0, heldout_fraction=0.05, ...)       shards of `python -m k3jax.data.prepare`
    ChatDataset(path, seq_len, tokenizer_path=..., loss="assistant", ...)  JSONL / Parquet conversations, K3's chat format
    PromptDataset(path, seq_len, tokenizer_path=..., ...)                  prompts with answers, for RL (not batches:
                                                                           ds.prompts(step, count))
    PreferenceDataset(path, seq_len, tokenizer_path=..., ...)              preference pairs (chosen, rejected), packed

    ds.batch(step, batch_size, split="train", process_index=0, process_count=1) -> dict of [B/P, T]
        tokens, targets (int32), loss_mask (float32), segment_ids (int32; 0 = padding)
    ds.vocab_size, ds.describe(), ds.content_hash();   splits: "train", "heldout"

    make_dataset(config.data)  -> the dataset a run's `k3jax.config.DataConfig` describes
    Prefetcher(read_batch, start, stop, depth)  -> batches read ahead on a thread (`k3jax.data.prefetch`)

Bad input raises `DataError` (a ValueError) with a one-line message naming the file.
"""
from k3jax.data.batching import SPLITS, Batch, Dataset
from k3jax.data.chat import ChatDataset
from k3jax.data.errors import DataError
from k3jax.data.mqar import MQARDataset, mqar_recall
from k3jax.data.prefetch import Prefetcher
from k3jax.data.preferences import PreferenceDataset
from k3jax.data.prompts import Prompt, PromptDataset
from k3jax.data.text import PackedDataset, TextDataset
from k3jax.data.tokens import TokensDataset
from k3jax.data.tokenizers import ByteTokenizer, TiktokenTokenizer, Tokenizer, load_tokenizer

__all__ = ["SPLITS", "Batch", "ChatDataset", "Dataset", "DataError", "MQARDataset", "mqar_recall", "PackedDataset",
           "PreferenceDataset", "Prefetcher", "Prompt", "PromptDataset", "TextDataset", "TokensDataset",
           "ByteTokenizer", "TiktokenTokenizer", "Tokenizer", "load_tokenizer", "make_dataset"]


def make_dataset(data_config, seq_len: int | None = None) -> Dataset:
    """The dataset of a `k3jax.config.DataConfig` (optionally at another sequence length)."""
    seq_len = seq_len or data_config.seq_len
    if data_config.kind == "mqar":
        return MQARDataset(seq_len, num_pairs=data_config.num_pairs, num_keys=data_config.num_keys,
                           num_values=data_config.num_values, num_queries=data_config.num_queries,
                           num_filler=data_config.num_filler, noise_vocab_size=data_config.noise_vocab_size,
                           seed=data_config.seed)
    if data_config.kind == "chat":
        return ChatDataset(data_config.path, seq_len, seed=data_config.seed,
                           heldout_fraction=data_config.heldout_fraction, tokenizer_path=data_config.tokenizer,
                           loss=data_config.chat_loss, overflow=data_config.chat_overflow,
                           thinking=data_config.chat_thinking, thinking_effort=data_config.chat_thinking_effort)
    if data_config.kind == "prompts":
        return PromptDataset(data_config.path, seq_len, seed=data_config.seed,
                             heldout_fraction=data_config.heldout_fraction, tokenizer_path=data_config.tokenizer,
                             thinking=data_config.chat_thinking, thinking_effort=data_config.chat_thinking_effort)
    if data_config.kind == "preferences":
        return PreferenceDataset(data_config.path, seq_len, seed=data_config.seed,
                                 heldout_fraction=data_config.heldout_fraction, tokenizer_path=data_config.tokenizer,
                                 overflow=data_config.chat_overflow, thinking=data_config.chat_thinking,
                                 thinking_effort=data_config.chat_thinking_effort)
    if data_config.kind == "tokens":
        return TokensDataset(data_config.path, seq_len, seed=data_config.seed,
                             heldout_fraction=data_config.heldout_fraction, tokenizer_path=data_config.tokenizer)
    return TextDataset(data_config.path, seq_len, seed=data_config.seed,
                       heldout_fraction=data_config.heldout_fraction, jsonl_field=data_config.jsonl_field,
                       tokenizer_path=data_config.tokenizer)
