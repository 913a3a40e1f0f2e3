"""The speculative decoding flags of ``eval.generate`` and ``eval.chat``:

    --prompt-lookup N      drafts copied from the conversation itself (n-grams of up to N tokens)
    --draft RUN_DIR        drafts from a smaller model: a k3jax run with the same tokenizer
    --speculate-k K        drafts per round, at most (default 4; adaptive)
    --speculate-rollback states|replay
                           how rejected drafts are undone (default states: the verify keeps every
                           position's KDA state; replay: feed the kept tokens again, less memory)

Greedy output is token for token what the plain flags print; sampled output follows the same
distribution (`k3jax.speculative`). A bad combination, a draft run that does not load, or one
with another vocabulary or tokenizer is one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse

from k3jax.data.tokenizers import same_tokenizer
from k3jax.speculative import ROLLBACKS, Speculation

from .loading import EvalInputError, load_run


def add_speculation_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding")
    drafts = group.add_mutually_exclusive_group()
    drafts.add_argument("--prompt-lookup", type=int, metavar="N", default=None,
                        help="draft by prompt lookup: copy what followed the last n-gram (n <= N) earlier on")
    drafts.add_argument("--draft", metavar="RUN_DIR", default=None,
                        help="draft with a smaller model: a run directory with the same tokenizer")
    group.add_argument("--speculate-k", type=int, metavar="K", default=4, help="drafts per round, at most (default 4)")
    group.add_argument("--speculate-rollback", choices=ROLLBACKS, default=ROLLBACKS[0],
                       help="undo rejected drafts from the verify's per-position states (default) or by replaying "
                            "the kept tokens (no per-position memory)")


def speculation_from(args: argparse.Namespace, config) -> Speculation | None:
    """The `Speculation` the flags ask for on a run of ``config`` (None: none asked for)."""
    if args.prompt_lookup is None and args.draft is None:
        if args.speculate_k != 4 or args.speculate_rollback != ROLLBACKS[0]:
            raise EvalInputError("--speculate-k and --speculate-rollback need --prompt-lookup or --draft")
        return None
    draft = None
    if args.draft is not None:
        run = load_run(args.draft)
        if run.config.model.vocab_size != config.model.vocab_size or \
                not same_tokenizer(run.config.data.tokenizer, config.data.tokenizer):
            raise EvalInputError(f"--draft {args.draft}: its vocabulary ({run.config.model.vocab_size} tokens, "
                                 f"tokenizer {run.config.data.tokenizer!r}) is not the run's "
                                 f"({config.model.vocab_size}, {config.data.tokenizer!r})")
        draft = run.model
    try:
        return Speculation(prompt_lookup=args.prompt_lookup, draft=draft, k=args.speculate_k,
                           rollback=args.speculate_rollback)
    except ValueError as error:
        raise EvalInputError(f"{error} (--prompt-lookup N >= 1, --speculate-k K >= 1)") from None
