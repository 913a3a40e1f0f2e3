"""``python -m eval.chat RUN_DIR``: talk to a trained or imported model, one `SessionStore` session
per conversation.

    python -m eval.chat runs/tiny --max-new-tokens 32 --temperature 0.8 --top-p 0.9
    > hello                     a turn: appended to the current session, then the model answers
    > /fork                     continue in a copy of the current session (the original is kept)
    > /rollback                 undo the last turn (back to the snapshot taken before it)
    > /sessions                 list sessions (* marks the current one); /switch ID changes it
    > /save NAME  /load NAME    write / read every session under --sessions-dir (default RUN_DIR/sessions)
    > /quit                     (or end of input)

On a chat run (``data.kind=chat``, or a model whose tokenizer names K3's chat markers, such as an
imported K3) every turn goes through K3's chat format (`k3jax.inference.chat`): the session holds the
rendered conversation, each line is appended as a user message plus the assistant's generation
prompt, the reply stops at ``<|end_of_msg|>`` and its response text is printed without markup. The
session keeps the reply as the renderer writes it: the sampled ids when they are a prefix of that
rendering (the rest, such as the closing tags of a reply cut short by --max-new-tokens, appended),
else the rendering in place of the sampled ids. So the session's tokens are always
`render_conversation` of the turns so far plus the generation prompt. ``--raw`` (and every other
run) takes turns as `eval.generate` takes prompts (`eval.generate.Codec`): plain text through the
run's tokenizer, or space-separated token ids on MQAR runs, answered with ids. Sampling
flags are those of `k3jax.inference.generation.generate`; ``--prompt-lookup N`` / ``--draft RUN_DIR`` with
``--speculate-k K`` answer by speculative rounds (`eval.flags`). Bad input (a missing checkpoint, a bad flag, an
unknown command or session, a name that exists) prints one ``error:`` line; startup errors exit 2.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

from k3jax.checkpoint import quiet_checkpoint_io
from k3jax.data import DataError
from k3jax.inference import InputError
from k3jax.inference.chat import ChatTurns, chat_turns_for
from k3jax.sampling import check_sampling
from k3jax.sessions import SessionStore, Speculator

from .flags import (OneLineParser, add_placement_flags, add_speculation_flags, is_reporter, load_model, shared_lines,
                    speculation_from)
from .generate import Codec


class ChatInputError(Exception):
    """A bad line or flag: shown as one ``error:`` line."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m eval.chat", description="Chat with a K3-family checkpoint.")
    parser.add_argument("run", metavar="RUN_DIR", help="a run directory, its checkpoints/, or a step directory")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sessions-dir", default=None, help="where /save and /load keep stores (default RUN_DIR/sessions)")
    parser.add_argument("--raw", action="store_true", help="on a chat run: plain-text turns, no chat format")
    add_placement_flags(parser)
    add_speculation_flags(parser)
    args = parser.parse_args(argv)
    try:
        check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as error:
        raise ChatInputError(str(error)) from None
    return args


class Chat:
    """The state of one chat: the store, the current session and each session's undo snapshots."""

    def __init__(self, model, codec: Codec | None, args: argparse.Namespace, sessions_dir: pathlib.Path,
                 turns: ChatTurns | None = None, speculation=None, draft=None):
        """``turns``: K3's chat format for every turn; None: ``codec`` encodes turns as they are.
        ``speculation`` (a `k3jax.config.SpeculationConfig`; ``draft``: its draft run's model): replies
        by speculative rounds."""
        self.model, self.codec, self.args, self.sessions_dir, self.turns = model, codec, args, sessions_dir, turns
        self.store, self.current, self.undo = SessionStore(model), None, {}
        self.speculation, self.draft, self._speculator = speculation, draft, None

    def speculator(self) -> Speculator | None:
        """The speculator of the current store (a new one after /load replaced the store)."""
        if self.speculation is None:
            return None
        if self._speculator is None or self._speculator.store is not self.store:
            self._speculator = Speculator.of(self.store, self.speculation, self.draft)
        return self._speculator

    def turn(self, line: str) -> str:
        if not line:
            return ""
        tokens = self.codec.encode(line) if self.turns is None else self.turns.user_turn(line, first=self.current is None)
        if self.current is None:
            self.current = self.store.open(tokens)
            self.undo[self.current] = []
        else:
            self.undo.setdefault(self.current, []).append(self.store.snapshot(self.current))
            self.store.append(self.current, tokens)
        before_reply = self.store.snapshot(self.current) if self.turns is not None else None
        args = self.args
        eos_id = self.codec.eos_id if self.turns is None else self.turns.eos_id
        new = self.store.generate([self.current], args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_id=eos_id,
                                  speculator=self.speculator())[0]
        if self.turns is None:
            return self.codec.decode(new)
        self._keep_rendered_reply(new, before_reply)
        return self.turns.reply_text(new)

    def _keep_rendered_reply(self, new, before_reply) -> None:
        """Leave the session ending in the renderer's rendering of the reply ``new`` (see the module docstring)."""
        rendered = self.turns.rendered_reply(new)
        if np.array_equal(rendered[:len(new)], new):
            if rendered.size > len(new):
                self.store.append(self.current, rendered[len(new):])
            return
        self.store.rollback(self.current, before_reply)
        self.store.append(self.current, rendered)

    def command(self, line: str) -> str | None:
        """Run a /command; returns what to print (None: quit)."""
        name, _, argument = line[1:].partition(" ")
        argument = argument.strip()
        if name == "quit":
            return None
        if name == "sessions":
            return "\n".join(f"{'*' if sid == self.current else ' '} {sid}: {len(self.store.tokens(sid))} tokens"
                             for sid in self.store.sessions()) or "no sessions"
        if name == "switch":
            self.current = self._session_id(argument)
            return f"session {self.current}"
        if name in ("save", "load") and not argument:
            raise ChatInputError(f"/{name} needs a NAME")
        if name == "save":
            self.store.save(self.sessions_dir / argument)
            return f"saved {len(self.store.sessions())} sessions to {self.sessions_dir / argument}"
        if name == "load":
            self.store = SessionStore.load(self.model, self.sessions_dir / argument)
            self.current, self.undo = min(self.store.sessions(), default=None), {}
            return f"loaded {len(self.store.sessions())} sessions; current {self.current}"
        if self.current is None:
            raise ChatInputError(f"/{name}: no session yet (type a turn first)")
        if name == "fork":
            fork = self.store.fork(self.current)
            self.undo[fork], self.current = [], fork
            return f"forked: now in session {fork}"
        if name == "rollback":
            if not self.undo.get(self.current):
                raise ChatInputError("nothing to roll back in this session")
            self.store.rollback(self.current, self.undo[self.current].pop())
            return f"rolled back to {len(self.store.tokens(self.current))} tokens"
        raise ChatInputError(f"unknown command /{name}; see python -m eval.chat --help")

    def _session_id(self, text: str) -> int:
        if not text.isdigit() or int(text) not in self.store.sessions():
            raise ChatInputError(f"no session {text!r}; /sessions lists them")
        return int(text)


def main(argv: list[str] | None = None, stdin=None, stdout=None) -> int:
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    quiet_checkpoint_io()
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        run = load_model(args)
        turns = None if args.raw else chat_turns_for(run.config)
        codec = Codec(run.config, raw=True) if turns is None else None
        speculation, draft = speculation_from(args, run.config)
    except (ChatInputError, InputError, DataError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    sessions_dir = pathlib.Path(args.sessions_dir) if args.sessions_dir else run.run_dir / "sessions"
    sessions_dir.mkdir(parents=True, exist_ok=True)
    chat = Chat(run.model, codec, args, sessions_dir, turns, speculation, draft)
    try:
        chat.store.check_length(args.max_new_tokens + 1)
    except ValueError as error:
        print(f"error: --max-new-tokens {args.max_new_tokens}: {error}", file=sys.stderr, flush=True)
        return 2
    for line in shared_lines(stdin):   # process 0 reads, every process of a mesh runs the turn
        line = line.strip()
        try:
            reply = chat.command(line) if line.startswith("/") else chat.turn(line)
        except (ChatInputError, InputError, ValueError, OSError) as error:   # one line; the chat goes on
            reply = f"error: {error}"
        if reply is None:
            break
        if is_reporter():
            print(reply, file=stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
