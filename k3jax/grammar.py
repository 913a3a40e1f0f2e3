"""Constrained decoding: a grammar says which tokens may come next, and sampling keeps to them.

    vocabulary = grammar_tokenizer(tokenizer, vocab_size, eos_id)   # once per model (~1 s for a large BPE)
    grammar = json_schema_grammar(schema)                            # or regex_, choice_, lark_grammar, reply_grammar
    check_grammar(grammar, vocabulary)                               # ValueError with the engine's message
    constraint = Constraint(vocabulary, grammar)                     # one per sequence
    Sampling(..., constraint=constraint)                             # `k3jax.sessions.Sampling`

The grammar engine is llguidance (https://github.com/guidance-ai/llguidance): JSON schemas, regular
expressions and Lark grammars (with ``%json`` and ``@name`` references to sub-grammars) compiled
lazily against the tokenizer, with a token mask in microseconds; a Rust wheel with no Python
dependencies (xgrammar, the other engine vLLM offers, pulls in torch, triton and transformers).

A `Constraint` is one sequence's parser state. The store asks it for the packed bitmask of the
tokens allowed next (`allowed`), which the compiled decode step applies to the logits
(`k3jax.sampling.adjusted_logits`: -inf where a bit is clear), and advances it with each token the
sequence keeps (`advance`; a speculative round takes back the drafts it rejects, `rollback`). The
end token ``eos_id`` is allowed exactly when the grammar accepts what was written, and is the only
token allowed once the grammar can take nothing more, so a sequence that stops at ``eos_id``
(the server's stop id) ends where the grammar ends. A parser that fails (a grammar past the
engine's limits) allows only ``eos_id``, ending that sequence alone.

`reply_grammar` writes K3's assistant reply (`k3jax.data.chat_format`) as a Lark grammar: the
thinking channel free, then the response channel's content (free text, or a sub-grammar: a JSON
schema, a regex, ...), then optionally the tool calls, each ``<|open|>call tool="NAME" index="I"<|sep|>``
holding its arguments as one ``<|open|>json type="object"<|sep|>`` element constrained by the
function's JSON schema (the form `ChatEncoder.parse_reply` reads back as the call's arguments).
"""
from __future__ import annotations

import json
from typing import NamedTuple, Sequence

import numpy as np
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from k3jax.data.chat_format import CLOSE, OPEN, SEP

ARGUMENTS_TAG = 'json type="object"'      # a call's arguments as one JSON object (`k3jax.data.chat_format`)
JSON_OPTIONS = {"whitespace_flexible": False}   # compact JSON: no unbounded runs of whitespace


class _ByteTable:
    """`k3jax.data.tokenizers.ByteTokenizer` as llguidance's tokenizer protocol: bytes 0-255, then
    the special tokens (their names after the 0xff byte that marks a special token there)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.eos_token_id, self.bos_token_id = tokenizer.eos_id, tokenizer.bos_id
        names = {tokenizer.bos_id: b"[BOS]", tokenizer.eos_id: b"[EOS]"}
        self.tokens = [bytes([i]) for i in range(256)] + [b"\xff" + names.get(i, b"<[%d]>" % i)
                                                          for i in range(256, vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


def grammar_tokenizer(tokenizer, vocab_size: int, eos_id: int) -> LLTokenizer:
    """llguidance's view of ``tokenizer`` (`k3jax.data.tokenizers`: bytes or tiktoken BPE) over the
    model's ``vocab_size`` ids (ids past the tokenizer's are never allowed), ending at ``eos_id``."""
    encoding = getattr(tokenizer, "_encoding", None)
    if encoding is not None:
        return LLTokenizer.from_tiktoken(encoder=encoding._mergeable_ranks, special_tokens=encoding._special_tokens,
                                         pattern=encoding._pat_str, eos_token=eos_id, n_vocab=vocab_size)
    return LLTokenizer(TokenizerWrapper(_ByteTable(tokenizer, vocab_size)), n_vocab=vocab_size, eos_token=eos_id)


# ---------------------------------------------------------------------- grammars
def _grammar(*entries: dict) -> str:
    """llguidance's grammar JSON of ``entries`` (the first is the start; the others named, for ``@name``)."""
    return json.dumps({"grammars": list(entries)})


def _entry(grammar: str) -> dict:
    """The start entry of a one-grammar JSON text (to name it and nest it in another)."""
    return json.loads(grammar)["grammars"][0]


def json_schema_grammar(schema) -> str:
    """Text that is one JSON value valid for ``schema`` (a dict; ``True``/``{}``: any JSON object)."""
    schema = {"type": "object"} if schema is True or schema == {} else schema
    return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def regex_grammar(pattern: str) -> str:
    """Text that matches ``pattern`` (whole)."""
    return LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: Sequence[str]) -> str:
    """Text that is one of ``choices``."""
    return lark_grammar("start: " + " | ".join(json.dumps(choice) for choice in choices))


def lark_grammar(lark: str) -> str:
    """Text in the language of a Lark grammar (llguidance's dialect; its ``start`` rule)."""
    return _grammar({"lark_grammar": lark})


def check_grammar(grammar: str, vocabulary: LLTokenizer) -> None:
    """ValueError with llguidance's message when ``grammar`` does not compile for ``vocabulary``."""
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, vocabulary)
    if failed:
        raise ValueError(messages[0].strip().splitlines()[0])


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _attribute(value: str) -> str:
    """An attribute value escaped as the chat format writes it."""
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _open(header: str) -> str:
    return f"<{OPEN[1:-1]}> {_literal(header)} <{SEP[1:-1]}>"


def _close(tag: str) -> str:
    return f"<{CLOSE[1:-1]}> {_literal(tag)} <{SEP[1:-1]}>"


class ToolSpec(NamedTuple):
    """A function a call may name: its ``name``, the JSON ``schema`` of its arguments (None: any
    object), and whether K3's ``typed`` arguments (``<|open|>argument key="K" type="T"<|sep|>``,
    unconstrained) may stand instead of the JSON object."""

    name: str
    schema: dict | None = None
    typed: bool = False


def reply_grammar(thinking: bool, content: str | None = None, tools: Sequence[ToolSpec] = (),
                  calls: tuple[int, int | None] = (0, None)) -> str:
    """K3's assistant reply after the generation prompt (`k3jax.data.chat_format.generation_prompt`):

        reply     [THINK </think>] <response> CONTENT </response> [TOOLS] </message>     (then the end token)
        TOOLS     <tools> CALL{min,max} </tools>
        CALL      <call tool="NAME" index="I"> <json type="object"> ARGUMENTS </json> </call>

    THINK is free text (only with ``thinking``); CONTENT the ``content`` grammar (a grammar text,
    e.g. `json_schema_grammar`; None: free text); ``tools`` (`ToolSpec`) the functions a call may
    name; ``calls`` (min, max; None: no limit) how many.
    With calls required (min > 0) the content is empty; with content constrained and calls allowed
    a reply is either the content (and maybe calls) or calls alone."""
    low, high = calls
    if not tools:
        low, high = 0, 0
    entries, rules = [], []
    if content is not None:
        entries.append({**_entry(content), "name": "content"})
    body = "@content" if content is not None else "TEXT"
    tools_allowed = high is None or high > 0
    alternatives = []
    if low == 0:
        alternatives.append(f"{body} {_close('response')}" + (" tools?" if tools_allowed else ""))
    if tools_allowed and (low > 0 or content is not None):
        alternatives.append(f"{_close('response')} tools")
    prefix = f"TEXT {_close('think')} {_open('response')} " if thinking else ""
    rules.append(f"start: {prefix}reply {_close('message')}")
    rules.append("reply: " + " | ".join(alternatives))
    if tools_allowed:
        repeat = "" if high == 1 else ("+" if high is None else f"{{1,{high}}}")
        rules.append(f"tools: {_open('tools')} call{repeat} {_close('tools')}")
        index = _literal("1") if high == 1 else "INDEX"
        names = []
        for number, tool in enumerate(tools):
            entries.append({**_entry(json_schema_grammar(tool.schema or True)), "name": f"arguments{number}"})
            names.append(f"call{number}")
            header = f'call tool="{_attribute(tool.name)}" index="'
            arguments = f"{_open(ARGUMENTS_TAG)} @arguments{number} {_close('json')}"
            if tool.typed:
                arguments = f"({arguments} | typed*)"
            rules.append(f"call{number}: <{OPEN[1:-1]}> {_literal(header)} {index} {_literal(chr(34))} <{SEP[1:-1]}> "
                         f"{arguments} {_close('call')}")
        rules.append("call: " + " | ".join(names))
        rules.append("INDEX: /[1-9][0-9]*/")
        if any(tool.typed for tool in tools):
            rules.append(f"typed: <{OPEN[1:-1]}> {_literal('argument key=' + chr(34))} ATTRIBUTE "
                         f"{_literal(chr(34) + ' type=' + chr(34))} ATTRIBUTE {_literal(chr(34))} <{SEP[1:-1]}> "
                         f"TEXT {_close('argument')}")
            rules.append('ATTRIBUTE: /[^"]*/')
    rules.append(r"TEXT: /(.|\n)*/")
    return _grammar({"lark_grammar": "\n".join(rules) + "\n"}, *entries)


# ---------------------------------------------------------------------- a sequence's state
class Constraint:
    """One sequence's grammar state over ``vocabulary`` (`grammar_tokenizer`); see the module docstring."""

    def __init__(self, vocabulary: LLTokenizer, grammar: str):
        self.vocabulary = vocabulary
        self.matcher = LLMatcher(vocabulary, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(self.matcher.get_error().strip().splitlines()[0])
        self.ended = False          # the end token was taken

    def allowed(self, words: int) -> np.ndarray:
        """The tokens allowed next, packed int32 ``[words]`` (`k3jax.sampling.pack_bits`' layout):
        only the end token once the parser failed, stopped or took the end token."""
        packed = np.zeros(words, np.int32)
        if self.ended or self.matcher.is_error() or self.matcher.is_stopped():
            eos = self.vocabulary.eos_token
            packed[eos // 32] = np.int32(np.uint32(1 << (eos % 32)).view(np.int32))
            return packed
        mask = np.frombuffer(self.matcher.compute_bitmask(), np.int32)
        packed[: min(words, mask.size)] = mask[:words]
        return packed

    def advance(self, tokens: Sequence[int]) -> int:
        """Take ``tokens`` (as far as the grammar allows; the end token where the grammar accepts) ->
        how many it took."""
        if self.ended:
            return 0
        tokens = [int(t) for t in tokens]
        taken = self.matcher.try_consume_tokens(tokens)
        if taken < len(tokens) and tokens[taken] == self.vocabulary.eos_token and not self.matcher.is_error() \
                and (self.matcher.is_accepting() or self.matcher.is_stopped()):
            self.ended, taken = True, taken + 1      # kept here: the matcher does not count an end token
        return taken

    def rollback(self, count: int) -> None:
        """Take back the last ``count`` tokens."""
        if count and self.ended:
            self.ended, count = False, count - 1
        if count and not self.matcher.rollback(count):
            raise ValueError(f"the grammar state cannot take back {count} tokens: {self.matcher.get_error()}")
