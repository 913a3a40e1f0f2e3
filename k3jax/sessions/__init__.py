"""Sessions over the memory bank: a store of conversations with a prefix cache, snapshots, forks,
rollback, device/host/disk tiers and one batched decode step (`k3jax.sessions.store`, whose
docstring maps the package's modules, one job each)."""
from k3jax.sessions.batching import Sampling
from k3jax.sessions.speculate import DraftModel, PromptLookup, RoundResult, Speculator
from k3jax.sessions.store import SessionStore, Snapshot, model_fingerprint, prefill_in_turns
from k3jax.sessions.tiers import DiskTierError

__all__ = ["DiskTierError", "DraftModel", "PromptLookup", "RoundResult", "Sampling", "SessionStore", "Snapshot", "Speculator",
           "model_fingerprint", "prefill_in_turns"]
