"""What the server knows of its model: name, limits, how text becomes token ids and back, and K3's
chat format (`k3jax.inference.chat`) when the run has it.

Text (completions prompts, ``/tokenize``) is encoded with the run's tokenizer, the names of its
special tokens read as those tokens (as Hugging Face tokenizers and vLLM do); chat message content
is always plain text (`k3jax.data.chat_format`). MQAR runs, which have no tokenizer, read and
write space-separated token ids (as `eval.generate`).
"""
from __future__ import annotations

import re

import numpy as np

from k3jax.data import load_tokenizer
from k3jax.data.tokenizers import TextDecoder
from k3jax.data.chat_format import generation_prompt, render_conversation
from k3jax.inference.chat import chat_turns_for
from .errors import ServeError
from .limits import check_text_length


class ServedModel:
    """The loaded run (``run``: an `k3jax.inference.LoadedRun`) as the server presents it."""

    def __init__(self, run, name: str, max_model_len: int, adapters=None, runtime_lora_updates: bool = False):
        """``adapters``: the LoRA adapters served beside the base (`k3jax.inference.adapters.ServedAdapters`);
        ``runtime_lora_updates``: whether requests may load and unload them."""
        config = run.config
        self.run, self.model, self.config, self.name, self.max_model_len = run, run.model, config, name, max_model_len
        self.adapters, self.runtime_lora_updates = adapters, runtime_lora_updates
        self.vocab_size = config.model.vocab_size
        self.chat = chat_turns_for(config)
        has_text = config.data.tokenizer is not None or config.data.kind != "mqar"
        self.tokenizer = load_tokenizer(config.data.tokenizer) if has_text else None
        self.specials = dict(getattr(self.tokenizer, "special_tokens", {}) or {})
        self.special_names = {token: name for name, token in self.specials.items()}
        self._special_pattern = (re.compile("(" + "|".join(map(re.escape, sorted(self.specials, key=len, reverse=True)))
                                            + ")") if self.specials else None)
        eos = self.chat.eos_id if self.chat is not None else getattr(self.tokenizer, "eos_id", None)
        self.eos_id = eos if eos is not None and eos < self.vocab_size else None
        self._grammar_vocabulary = None

    def grammar_vocabulary(self, param: str):
        """The tokenizer as the grammar engine sees it (`k3jax.grammar.grammar_tokenizer`, built on first
        use); a 400 naming ``param`` for a model without text or an end token to end a grammar with."""
        if self.tokenizer is None or self.eos_id is None:
            raise ServeError(400, "constrained output needs a model with a tokenizer and an end token", param=param)
        if self._grammar_vocabulary is None:
            from k3jax.grammar import grammar_tokenizer
            self._grammar_vocabulary = grammar_tokenizer(self.tokenizer, self.vocab_size, self.eos_id)
        return self._grammar_vocabulary

    # ------------------------------------------------------------------ models
    def resolve(self, requested: str | None) -> tuple[str, str] | None:
        """``(name, adapter tag)`` of the model a request names: the base ("" its tag) for its name
        or None, a loaded adapter for its name; None for any other name."""
        if requested is None or requested == self.name:
            return self.name, ""
        adapter = None if self.adapters is None else self.adapters.adapters.get(requested)
        return None if adapter is None else (requested, adapter.tag)

    def model_names(self) -> list[str]:
        """The base's name, then the loaded adapters'."""
        return [self.name, *([] if self.adapters is None else list(self.adapters.adapters))]

    # ------------------------------------------------------------------ text
    def encode(self, text: str) -> list[int]:
        """``text`` -> token ids (special token names as those tokens); a text too long for the
        context at any tokenization is a 400 before tokenizing (`eval.serve.limits`)."""
        check_text_length(text, self.max_model_len, "prompt")
        if self.tokenizer is None:
            try:
                ids = [int(word) for word in text.split()]
            except ValueError:
                raise ServeError(400, "this model reads MQAR token ids: give space-separated integers or a list "
                                 "of token ids", param="prompt") from None
            return self.check_ids(ids, "prompt")
        if self._special_pattern is None:
            return list(self.tokenizer.encode(text))
        ids = []
        for piece in self._special_pattern.split(text):
            ids += [self.specials[piece]] if piece in self.specials else list(self.tokenizer.encode(piece)) if piece else []
        return self.check_ids(ids, "prompt")

    def decode(self, ids) -> str:
        """Token ids -> text (special tokens left out)."""
        ids = [int(i) for i in ids]
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode([i for i in ids if i < getattr(self.tokenizer, "vocab_size", self.vocab_size)
                                      and i not in self.special_names])

    def text_decoder(self):
        """A decoder of this model's ids one at a time (``feed(id) -> text``, ``flush() -> text``)
        whose pieces join to `decode` of the ids."""
        if self.tokenizer is None:
            return IdsText()
        return TextDecoder(self.token_bytes)

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes as `decode` writes them (special tokens and ids past the tokenizer: none)."""
        if token in self.special_names or token >= getattr(self.tokenizer, "vocab_size", self.vocab_size):
            return b""
        return self.tokenizer.token_bytes(token)

    def piece(self, token: int) -> str:
        """One token's text (a special token's name) for log-prob listings."""
        if token in self.special_names:
            return self.special_names[token]
        if self.tokenizer is None:
            return str(token)
        return self.decode([token])

    def check_ids(self, ids, param: str) -> list[int]:
        if not ids:
            raise ServeError(400, f"{param} is empty", param=param)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ServeError(400, f"{param}: token id {bad[0]} is outside [0, {self.vocab_size})", param=param)
        return ids

    def check_length(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens + max_tokens > self.max_model_len:
            raise ServeError(400, f"this model's maximum context length is {self.max_model_len} tokens; the request "
                             f"asks for {prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, {max_tokens} to "
                             f"generate)", param="max_tokens", )

    # ------------------------------------------------------------------ chat
    def require_chat(self):
        if self.chat is None:
            raise ServeError(400, "this model has no chat format (a run trained with data.kind=chat, or a model "
                             "whose tokenizer names K3's chat markers); use /v1/completions", param="messages")
        return self.chat

    def chat_prompt(self, messages: list[dict], tools: list | None, thinking: bool | None = None,
                    effort: str | None = None) -> np.ndarray:
        """The conversation rendered in K3's chat format, then the assistant's generation prompt;
        ``thinking`` None: the run's thinking and effort, else ``thinking`` and ``effort`` (the
        request's: `eval.serve.params.chat_reasoning`)."""
        chat = self.require_chat()
        if thinking is None:
            thinking, effort = chat.thinking, chat.thinking_effort
        for index, message in enumerate(messages if isinstance(messages, list) else []):
            if isinstance(message, dict) and "content" not in message and not message.get("tool_calls"):
                raise ServeError(400, f"messages: message {index} has no content (only an assistant message "
                                 f"with tool_calls may leave it out)", param="messages")
        try:
            segments = render_conversation(messages, tools or None, thinking=thinking, thinking_effort=effort,
                                           where="messages")
        except RecursionError:        # JSON nested inside a string (tool call arguments)
            raise ServeError(400, "messages: a value nests too deeply to render", param="messages") from None
        return chat.encoder.encode(segments + generation_prompt(thinking))[0]


class IdsText:
    """`ServedModel.text_decoder` of a model without a tokenizer: ids as space-separated integers."""

    def __init__(self):
        self.first = True

    def feed(self, token: int) -> str:
        text, self.first = ("" if self.first else " ") + str(int(token)), False
        return text

    def flush(self) -> str:
        return ""
