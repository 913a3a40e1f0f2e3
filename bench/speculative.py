"""Speculative decoding vs plain decoding, side by side in one run (`k3jax.sessions.Speculator`):

    copy     prompt lookup on a copy-heavy task: a model trained to copy a line ("old: <letters>"
             then "new: <the same letters>"), prompted with held-out "old: ...\\nnew: "
    chat     a draft model on the chat demo: the README's chat run as the target, a smaller model
             trained on the same conversations as the draft, prompted with user turns

    bounds   drafts of known continuations (those plain greedy decoding gives) on a random model
             of ``--bounds-config``: every draft accepted, and none (shifted by one): the best and
             worst case of the mechanism itself, no draft model's cost

For each, and for each way of rolling back rejected drafts (`k3jax.config.ROLLBACKS`: the
verify's per-position states, or snapshot and replay): greedy decode tokens/s of B sessions
decoding together (`SessionStore.generate`), plain vs speculative, the ratio, acceptance rate, mean accepted drafts per session-round, draft and verify
seconds, and whether the outputs are equal token for token. Each trial starts from the same
snapshots; the first two (one in each order) compile and are not counted; the variants alternate.

    python -m bench.speculative [--copy-run RUN] [--chat-run RUN --draft-run RUN] [--bounds-config CONFIG]
                                [--sessions 4] [--new-tokens 32] [--k 4] [--trials 3] [--json bench/speculative.json]

The runs (2-core CPU, a few minutes each; commands in `RUNS`) are trained with `python -m train`.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys

import numpy as np

from bench.common import seconds, table, write_json
from k3jax.config import ROLLBACKS, SpeculationConfig
from k3jax.data import load_tokenizer
from k3jax.inference import load_draft, load_run
from k3jax.inference.chat import chat_turns_for
from k3jax.sessions import DraftModel, PromptLookup, SessionStore, Speculator

WARMUP_TRIALS = 2
CHAT = ("data.kind=chat data.path=configs/chat/conversations.jsonl data.tokenizer=configs/chat/tokenizer "
        "data.seq_len=128 data.chat_thinking=false data.chat_thinking_effort=null train.batch_size=8 train.steps=400")
RUNS = {
    "copy": "python -c 'from bench.speculative import copy_corpus; copy_corpus(\"copy.txt\")' && "
            "python -m train configs/tiny.yaml run_dir=RUN data.kind=text data.path=copy.txt data.seq_len=128 "
            "train.batch_size=8 train.steps=800",
    "chat": f"python -m train configs/tiny.yaml run_dir=RUN {CHAT}",
    "draft": f"python -m train configs/tiny.yaml run_dir=RUN {CHAT} model.num_layers=2 model.mla_period=2 "
             "model.attn_res.block_size=2 model.d_model=32",
}


def copy_line(rng: np.random.Generator) -> str:
    return "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(12, 25)))


def copy_corpus(path: str, lines: int = 6000, seed: int = 0) -> None:
    """The copy task's training text: ``old: s`` then ``new: s`` for random letter strings s."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as out:
        for _ in range(lines):
            line = copy_line(rng)
            out.write(f"old: {line}\nnew: {line}\n")


def compare(store: SessionStore, prompts: list, speculators: dict[str, Speculator], new_tokens: int,
            trials: int) -> dict:
    """Plain vs speculative greedy decoding of ``prompts`` (token lists) together, with each of
    ``speculators`` ({rollback: speculator}), medians: {rollback: figures}."""
    sids = [store.open(np.asarray(prompt, np.int32)) for prompt in prompts]
    handles = [store.snapshot(sid) for sid in sids]
    outputs, times = {}, {name: [] for name in ("plain", *speculators)}
    modes = {"plain": lambda: store.generate(sids, new_tokens),
             **{name: (lambda s=speculator: store.generate(sids, new_tokens, speculator=s))
                for name, speculator in speculators.items()}}
    counted = {name: {} for name in speculators}
    for trial in range(trials + WARMUP_TRIALS):
        for name in (list(modes) if trial % 2 == 0 else list(modes)[::-1]):
            for sid, handle in zip(sids, handles):
                store.rollback(sid, handle)
            before = speculators[name].stats.as_dict() if name in speculators else {}
            elapsed = seconds(lambda: outputs.__setitem__(name, modes[name]()))
            if trial >= WARMUP_TRIALS:
                times[name].append(elapsed)
                if name in speculators:
                    after = speculators[name].stats.as_dict()
                    for key in ("rounds", "batched_rounds", "drafted", "accepted", "draft_seconds", "verify_seconds"):
                        counted[name][key] = counted[name].get(key, 0) + after[key] - before[key]
    tokens = len(prompts) * new_tokens
    median = {name: statistics.median(values) for name, values in times.items()}
    return {name: {
        "sessions": len(prompts), "new_tokens": new_tokens, "seconds": {"plain": times["plain"], name: times[name]},
        "plain_tokens_per_s": tokens / median["plain"], "speculative_tokens_per_s": tokens / median[name],
        "speedup": median["plain"] / median[name],
        "acceptance_rate": c["accepted"] / max(c["drafted"], 1),
        "mean_accepted_length": c["accepted"] / max(c["rounds"], 1),
        "draft_seconds": c["draft_seconds"] / trials, "verify_seconds": c["verify_seconds"] / trials,
        "batched_rounds": c["batched_rounds"] / trials,
        # one batched round's verify (and rollback) vs one plain decode step of the same sessions
        "verify_ms_per_round": 1e3 * c["verify_seconds"] / c["batched_rounds"],
        "plain_ms_per_step": 1e3 * median["plain"] / new_tokens,
        "outputs_equal": all(np.array_equal(a, b) for a, b in zip(outputs["plain"], outputs[name])),
    } for name, c in counted.items()}


def speculators(store: SessionStore, drafter, args, **options) -> dict[str, Speculator]:
    """One speculator per rollback (`k3jax.config.ROLLBACKS`), each with its own ``drafter()``."""
    return {rollback: Speculator(store, drafter(), SpeculationConfig(k=args.k, rollback=rollback, **options))
            for rollback in ROLLBACKS}


class KnownContinuations:
    """Drafts from the continuations plain greedy decoding gives each prompt (``correct``: every
    draft accepted) or those tokens shifted by one (none accepted): the mechanism's best and worst
    case, whatever the model, with no draft model's cost."""

    def __init__(self, continuations: dict[tuple, list[int]], correct: bool, vocab_size: int):
        self.continuations, self.shift, self.vocab_size = continuations, 0 if correct else 1, vocab_size

    def propose(self, histories, lengths):
        drafts = {}
        for sid, history in histories.items():
            prompt = next(p for p in self.continuations if tuple(history[: len(p)]) == p)
            known = self.continuations[prompt][len(history) - len(prompt) : len(history) - len(prompt) + lengths[sid]]
            drafts[sid] = [(int(token) + self.shift) % self.vocab_size for token in known]
        return drafts

    def keep(self, sid, history):
        pass

    def leave(self, sid):
        pass


def bounds_case(config_path: str, overrides: list[str], args) -> dict:
    """Known-continuation drafts on a random model of ``config_path``: every draft accepted, and none."""
    from flax import nnx

    from k3jax.config import load_config
    from k3jax.model import K3Model

    model = K3Model(load_config(config_path, overrides).model, rngs=nnx.Rngs(0))
    vocab = model.config.vocab_size
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(20, 40, args.sessions)]
    store = SessionStore(model, prefix_cache=False)
    sids = [store.open(np.asarray(prompt, np.int32)) for prompt in prompts]
    plain = store.generate(sids, args.new_tokens + args.k)
    continuations = {tuple(prompt): [int(t) for t in out] for prompt, out in zip(prompts, plain)}
    results = {}
    for name, correct in (("all accepted", True), ("none accepted", False)):
        drafters = functools.partial(KnownContinuations, continuations, correct, vocab)
        results[name] = compare(store, prompts, speculators(store, drafters, args, adaptive=False), args.new_tokens,
                                args.trials)
    return results


def copy_case(run_dir: str, args) -> dict:
    run = load_run(run_dir)
    tokenizer = load_tokenizer(run.config.data.tokenizer)
    rng = np.random.default_rng(1)                                 # other strings than training's seed 0
    prompts = [list(tokenizer.encode(f"old: {copy_line(rng)}\nnew: ")) for _ in range(args.sessions)]
    store = SessionStore(run.model, prefix_cache=False)
    return compare(store, prompts, speculators(store, lambda: PromptLookup(3), args), args.new_tokens, args.trials)


def chat_case(run_dir: str, draft_dir: str, args) -> dict:
    run = load_run(run_dir)
    draft = load_draft(draft_dir, run.config)
    turns = chat_turns_for(run.config)
    rng = np.random.default_rng(1)
    prompts = [turns.user_turn(f"{rng.integers(1, 4)} {copy_line(rng)[:8].upper()}", first=True).tolist()
               for _ in range(args.sessions)]
    store = SessionStore(run.model, prefix_cache=False)
    return compare(store, prompts, speculators(store, lambda: DraftModel(draft), args), args.new_tokens,
                   args.trials)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__.splitlines()[0])
    parser.add_argument("--copy-run", help=RUNS["copy"])
    parser.add_argument("--chat-run", help=RUNS["chat"])
    parser.add_argument("--draft-run", help=RUNS["draft"])
    parser.add_argument("--bounds-config", default="configs/tiny.yaml",
                        help="the random model of the known-continuation bounds (default configs/tiny.yaml)")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--json", default="bench/speculative.json")
    args = parser.parse_args(argv)
    if (args.chat_run is None) != (args.draft_run is None):
        parser.error("--chat-run and --draft-run go together")
    results = {f"bounds, {name}": result for name, result in bounds_case(args.bounds_config, [], args).items()}
    if args.copy_run:
        results["copy (prompt lookup)"] = copy_case(args.copy_run, args)
    if args.chat_run:
        results["chat (draft model)"] = chat_case(args.chat_run, args.draft_run, args)
    print(report(results))
    print(f"wrote {write_json(args.json, {'args': vars(args), 'results': results})}")
    return 0


def report(results: dict) -> str:
    rows = [[name, rollback, f"{r['plain_tokens_per_s']:.1f}", f"{r['speculative_tokens_per_s']:.1f}", f"{r['speedup']:.2f}",
             f"{r['acceptance_rate']:.2f}", f"{r['mean_accepted_length']:.2f}",
             f"{r['draft_seconds']:.2f} / {r['verify_seconds']:.2f}",
             f"{r['verify_ms_per_round']:.1f} / {r['plain_ms_per_step']:.1f}", "yes" if r["outputs_equal"] else "NO"]
            for name, by_rollback in results.items() for rollback, r in by_rollback.items()]
    return table(["case", "rollback", "plain tok/s", "speculative tok/s", "speed-up", "acceptance", "accepted / round",
                  "draft / verify s", "verify ms / plain step ms", "equal"], rows)


if __name__ == "__main__":
    sys.exit(main())
