"""``python -m eval.generate RUN_DIR --prompt TEXT [--prompt TEXT ...] | --prompt-file FILE``:
continue prompts with a trained checkpoint.

    python -m eval.generate runs/text --prompt "Once upon a time" --max-new-tokens 64 --temperature 0.8 --top-p 0.9
    python -m eval.generate runs/text --prompt-file prompts.txt --seed 3        # one prompt per line
    python -m eval.generate runs/default --prompt "3 17 250"                    # MQAR runs: token ids
    python -m eval.generate runs/chat --prompt "3 QWERTY"                       # chat runs: a user turn
    python -m eval.generate runs/chat --prompt "3 QWERTY" --raw                 # ... or plain text
    python -m eval.generate runs/text --prompt-file prompts.txt --prompt-lookup 3   # speculative (`eval.flags`)

Chat runs (``data.kind=chat``, or a model whose tokenizer names K3's chat markers, such as an
imported K3) take each prompt as a user turn in K3's chat format followed by the assistant's
generation prompt, stop at ``<|end_of_msg|>`` and print the reply's response text without markup
(`k3jax.inference.chat`); ``--raw`` treats them as text runs. Text runs (and raw ones) encode and decode
with the run's tokenizer (``data.tokenizer``; bytes by default) and stop a sample at its EOS; MQAR
runs take and print space-separated token ids. All prompts go in one batch, whatever their lengths
(`k3jax.inference.generation.generate`). Prints one continuation per line, in prompt order. Bad input (no checkpoint, an empty prompt file, a token id out of range, a bad
flag) ends with one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

from k3jax.checkpoint import quiet_checkpoint_io
from k3jax.data import DataError, load_tokenizer
from k3jax.inference import InputError
from k3jax.inference.chat import chat_turns_for

from .flags import OneLineParser, add_placement_flags, add_speculation_flags, is_reporter, load_model, speculation_from


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m eval.generate", description="Continue prompts with a checkpoint.")
    parser.add_argument("run", metavar="RUN_OR_CHECKPOINT_DIR")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    source.add_argument("--prompt-file", help="a UTF-8 file with one prompt per line")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest good one)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--raw", action="store_true",
                        help="on a chat run: plain-text prompts and continuations, no chat format")
    add_placement_flags(parser)
    add_speculation_flags(parser)
    return parser.parse_args(argv)


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        return args.prompt
    try:
        lines = pathlib.Path(args.prompt_file).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"--prompt-file {args.prompt_file}: {getattr(error, 'strerror', None) or error}") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise InputError(f"--prompt-file {args.prompt_file} holds no prompt")
    return prompts


class Codec:
    """Prompts to token ids and back: K3's chat format for chat runs (unless ``raw``), the run's
    tokenizer for text, token-shard and raw chat runs, space-separated ids for MQAR runs."""

    def __init__(self, config, raw: bool = False):
        self.chat = None if raw else chat_turns_for(config)
        self.text = self.chat is None and (config.data.kind != "mqar" or config.data.tokenizer is not None)
        self.tokenizer = load_tokenizer(config.data.tokenizer) if self.text else None
        self.eos_id = self.chat.eos_id if self.chat is not None else self.tokenizer.eos_id if self.text else None

    def encode(self, prompt: str) -> list[int]:
        if self.chat is not None:
            return self.chat.user_turn(prompt).tolist()
        if self.text:
            return list(self.tokenizer.encode(prompt))
        try:
            return [int(word) for word in prompt.split()]
        except ValueError:
            raise InputError(f"this run's data are MQAR token ids; give space-separated integers, "
                                 f"got {prompt!r}") from None

    def decode(self, ids: list[int]) -> str:
        if self.chat is not None:
            return self.chat.reply_text(ids)
        if self.text:
            return self.tokenizer.decode([i for i in ids if i != self.eos_id])
        return " ".join(map(str, ids))


def main(argv: list[str] | None = None) -> int:
    from k3jax.inference.generation import generate

    quiet_checkpoint_io()
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        prompts = read_prompts(args)
        run = load_model(args)
        codec = Codec(run.config, raw=args.raw)
        ids = [codec.encode(prompt) for prompt in prompts]
        speculation, draft = speculation_from(args, run.config)
        out = generate(run.model, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_id=codec.eos_id,
                       speculation=speculation, draft=draft)
    except (InputError, DataError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    for row in range(len(prompts) if is_reporter() else 0):
        print(codec.decode(tokens[row, : lengths[row]].tolist()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
