"""Prompts and replies in K3's chat format for running a chat model (`eval.generate`, `eval.chat`,
the server, the samples task, the benchmarks), on a run trained on conversations or a model whose
tokenizer names K3's markers.

    user turn  render_conversation([{"role": "user", "content": TEXT}]) + generation_prompt
               (the thinking-effort note only on a conversation's first turn, as the renderer
               writes it once at the start)
    stop       <|end_of_msg|>
    reply      the text of the reply's response channel (`ChatEncoder.reply_message`), no markup

A conversation built turn by turn from these pieces, each reply as `reply_segments` renders it,
is token for token `render_conversation` of its messages followed by the generation prompt.
Thinking and the thinking-effort note follow the run's ``data.chat_thinking`` and
``data.chat_thinking_effort``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from k3jax.data import load_tokenizer
from k3jax.data.chat_format import MARKERS, ChatEncoder, generation_prompt, render_conversation, reply_segments


class ChatTurns:
    """Token ids of user turns and of replies in K3's chat format, with one tokenizer."""

    def __init__(self, tokenizer, thinking: bool = True, thinking_effort: str | None = "max"):
        self.encoder = ChatEncoder(tokenizer)
        self.tokenizer, self.thinking, self.thinking_effort = tokenizer, thinking, thinking_effort
        self.eos_id = self.encoder.end_of_message_id

    def user_turn(self, text: str, first: bool = True) -> np.ndarray:
        """A user message (opening the conversation when ``first``) and the assistant's generation prompt."""
        segments = render_conversation([{"role": "user", "content": text}], thinking=self.thinking,
                                       thinking_effort=self.thinking_effort if first else None)
        return self.encoder.encode(segments + generation_prompt(self.thinking))[0]

    def reply_message(self, ids: Sequence[int]) -> dict:
        return self.encoder.reply_message(ids, self.thinking)

    def reply_text(self, ids: Sequence[int]) -> str:
        """The reply's response text, without markup."""
        return self.reply_message(ids)["content"]

    def rendered_reply(self, ids: Sequence[int]) -> np.ndarray:
        """The ids the renderer writes for the message the reply ``ids`` writes, closed by ``<|end_of_msg|>``."""
        return self.encoder.encode(reply_segments(self.reply_message(ids), self.thinking))[0]

    def decode(self, ids: Sequence[int]) -> str:
        """``ids`` decoded as they are (markers left out), without ids beyond the tokenizer's vocabulary."""
        return self.tokenizer.decode([i for i in ids if i < self.tokenizer.vocab_size])


def chat_turns_for(config) -> ChatTurns | None:
    """K3's chat format for a run trained on conversations (``data.kind=chat``) or one whose tokenizer
    names K3's markers (an imported K3); None for other runs."""
    data = config.data
    if data.kind != "chat" and data.tokenizer is None:
        return None
    tokenizer = load_tokenizer(data.tokenizer)
    if data.kind != "chat" and not all(marker in getattr(tokenizer, "special_tokens", {}) for marker in MARKERS):
        return None
    return ChatTurns(tokenizer, data.chat_thinking, data.chat_thinking_effort)
