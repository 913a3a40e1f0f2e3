"""Kimi K3's chat format ("XTML"): a conversation → segments → token ids and a loss mask.

K3 ships no Jinja chat template: its checkpoint renders conversations with a Python program,
``encoding_k3.py`` (https://huggingface.co/moonshotai/Kimi-K3/blob/main/encoding_k3.py; read here
through vLLM's copy, https://github.com/vllm-project/vllm/blob/main/vllm/tokenizers/encoding_k3.py,
and the tokenizer that calls it, ``tokenization_kimi.py``). These are the rules that program
follows, written out again here:

    message   <|open|>message role="user"<|sep|>CONTENT<|close|>message<|sep|><|end_of_msg|>
              (the same for system; a ``name`` adds ` name="..."` after the role)
    tool      <|open|>message role="tool" tool="NAME" index="I"<|sep|>CONTENT<|close|>message<|sep|><|end_of_msg|>
              I counts the tool results after the latest assistant turn from 1; NAME is the
              message's ``tool`` or ``name``, else the I-th call of that assistant turn
    assistant <|open|>message role="assistant"<|sep|>
                [<|open|>think<|sep|>REASONING<|close|>think<|sep|>]          (only when thinking)
                <|open|>response<|sep|>CONTENT<|close|>response<|sep|>
                [<|open|>tools<|sep|> CALL... <|close|>tools<|sep|>]          (when it has tool_calls)
              <|close|>message<|sep|><|end_of_msg|>
    CALL      <|open|>call tool="NAME" index="J"<|sep|>
                <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|> ...
              <|close|>call<|sep|>
              T is string/number/boolean/null/object/array; a string VALUE is written raw, others as
              JSON; arguments that are a string which is not JSON go in a
              <|open|>json type="object"<|sep|>TEXT<|close|>json<|sep|> element instead
    tools     a record's ``tools`` list: first, a system message of ``type="tool-declare"`` whose
              body is "# Tools\\nHere are the available tools, described in JSONSchema.\\n\\n```json\\n"
              + compact JSON (keys sorted, ``ensure_ascii=False``) + "\\n```"; a system message
              carrying ``tools`` mid-conversation becomes the "## New Tools Available" variant
    effort    with thinking and a thinking_effort (low / high / max; the tokenizer's default is max),
              a system message of ``type="thinking-effort"`` right after the tool declaration
    prompt    generation prompt: <|open|>message role="assistant"<|sep|><|open|>think<|sep|>
              (<|open|>response<|sep|> without thinking)

Attribute values escape ``&`` then ``"``. Tool results that carry a ``tool_call_id`` are put in the
order of the assistant's calls (a run of results with an unknown id is left as it is). Each segment
is tokenized on its own (as the reference's ``_encode_chat_segments`` does): the four markers as
special tokens looked up by name in the tokenizer, everything else as ordinary text, so text that
spells ``<|sep|>`` stays text. There is no BOS.

The loss mask is not part of the reference (its training recipe is not public); here a position
counts when its token is one the model would generate as the assistant: everything of an assistant
message after its first channel tag (``<|open|>think<|sep|>`` or ``<|open|>response<|sep|>``, the end
of the generation prompt) up to and including its ``<|end_of_msg|>`` (``loss="assistant"``), or every
token (``loss="all"``). Not established and so not rendered: images (the reference's media
placeholders), the per-request tool_choice / response_format notes, and the reference's splitting
of runs longer than 25,000 characters before BPE (it changes no ids for ordinary text).
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal, Sequence

import numpy as np

from k3jax.data.errors import DataError
from k3jax.data.tokenizers import TextDecoder

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)
ROLES = ("system", "user", "assistant", "tool")
THINKING_EFFORTS = ("low", "high", "max")
LOSS_MODES = ("assistant", "all")
TOOL_DECLARE_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
NEW_TOOLS_HEADER = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                    "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n")
EFFORT_NOTE = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
               "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
               "Now the system is invoked with `thinking_effort={}`.")


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of the rendering: a marker (one special token) or text, and whether the assistant writes it."""

    text: str
    marker: bool = False
    assistant: bool = False


def _marker(name: str) -> Segment:
    return Segment(name, marker=True)


def _text(text: Any) -> list[Segment]:
    text = str(text)
    return [Segment(text)] if text else []


def _open_tag(tag: str, attrs: Sequence[tuple[str, Any]] = ()) -> list[Segment]:
    """``<|open|>tag key="value"...<|sep|>``, each attribute as four text segments (as the reference)."""
    segments = [_marker(OPEN), *_text(tag)]
    for key, value in attrs:
        escaped = str(value).replace("&", "&amp;").replace('"', "&quot;")
        segments += [*_text(f" {key}"), *_text('="'), *_text(escaped), *_text('"')]
    return segments + [_marker(SEP)]


def _close_tag(tag: str) -> list[Segment]:
    return [_marker(CLOSE), *_text(tag), _marker(SEP)]


def _message(attrs: Sequence[tuple[str, Any]], body: list[Segment]) -> list[Segment]:
    return _open_tag("message", attrs) + body + _close_tag("message") + [_marker(END_OF_MSG)]


def _compact_json(value: Any) -> str:
    return json.dumps(_sorted_keys(value), ensure_ascii=False, separators=(",", ":"))


def _sorted_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _sorted_keys(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(item) for item in value]
    return value


def _content(content: Any, where: str) -> list[Segment]:
    """A message's content: a string, None, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None or isinstance(content, str):
        return _text(content or "")
    if not isinstance(content, list):
        raise DataError(f"{where}: content must be a string, null or a list of text parts")
    segments = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise DataError(f"{where}: only text content parts are supported ({{'type': 'text', 'text': ...}})")
        segments += _text(part["text"])
    return segments


def _argument_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", dict: "object"}.get(type(value), "array")


def _call(call: Any, index: int, where: str) -> list[Segment]:
    """One tool call: its typed arguments, or the raw text of arguments that are not JSON."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise DataError(f"{where}: tool call {index} needs a function name")
    arguments, raw = function.get("arguments"), None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            arguments, raw = {}, arguments
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise DataError(f"{where}: tool call {index} arguments must be a JSON object")
    body = (_open_tag("json", [("type", "object")]) + _text(raw) + _close_tag("json")) if raw is not None else []
    for key, value in arguments.items():
        shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        body += _open_tag("argument", [("key", key), ("type", _argument_type(value))]) + _text(shown) \
            + _close_tag("argument")
    return _open_tag("call", [("tool", function["name"]), ("index", index)]) + body + _close_tag("call")


def _assistant_body(message: dict, thinking: bool, where: str) -> list[Segment]:
    """Channels and tool calls of an assistant message; all of it is the assistant's output."""
    segments = []
    if thinking:
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        segments += _open_tag("think") + (_text(reasoning) if reasoning and str(reasoning).strip() else []) \
            + _close_tag("think")
    segments += _open_tag("response") + _content(message.get("content"), where) + _close_tag("response")
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise DataError(f"{where}: tool_calls must be a list")
    if calls:
        segments += _open_tag("tools")
        for index, call in enumerate(calls, start=1):
            segments += _call(call, index, where)
        segments += _close_tag("tools")
    return segments


def _name_attr(message: dict) -> list[tuple[str, Any]]:
    return [("name", message["name"])] if message.get("name") else []


def order_tool_results(messages: list[dict]) -> list[dict]:
    """Each run of tool results sorted into the order of the preceding assistant's calls, matched by
    ``tool_call_id`` (and named after the matched call); a run with an unmatched id is kept as is."""
    output, calls, index = [], {}, 0
    while index < len(messages):
        message = messages[index]
        if message.get("role") != "tool":
            if message.get("role") == "assistant":
                calls = {}
                for position, call in enumerate(message.get("tool_calls") or [], start=1):
                    if isinstance(call, dict) and call.get("id") is not None:
                        function = call.get("function", call)
                        calls.setdefault(str(call["id"]), (position, function.get("name") if isinstance(function, dict) else None))
            output.append(message)
            index += 1
            continue
        run = []
        while index < len(messages) and messages[index].get("role") == "tool":
            run.append(messages[index])
            index += 1
        matches = [calls.get(str(m.get("tool_call_id", m.get("id")))) for m in run]
        if None in matches:
            output += run
            continue
        for (_, name), message in sorted(zip(matches, run), key=lambda pair: pair[0][0]):
            output.append({**message, "tool": name, **({"name": name} if "name" in message else {})}
                          if name is not None else message)
    return output


def validate_messages(messages: Any, where: str) -> list[dict]:
    """``messages`` as a list of objects with a known role, or a `DataError` naming the message."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of message objects")
    for number, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}: message {number} is not an object")
        role = message.get("role")
        if role not in ROLES:
            raise DataError(f"{where}: message {number} has unknown role {role!r} (expected {', '.join(ROLES)})")
    return messages


def render_conversation(messages: list[dict], tools: list | None = None, *, thinking: bool = True,
                        thinking_effort: str | None = "max", where: str = "conversation") -> list[Segment]:
    """The segments of a whole conversation (no generation prompt), assistant output flagged."""
    if thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise DataError(f"thinking_effort must be one of {', '.join(THINKING_EFFORTS)} or null, got {thinking_effort!r}")
    messages = order_tool_results(validate_messages(messages, where))
    segments = _tool_declaration(tools, TOOL_DECLARE_HEADER) if tools else []
    if thinking and thinking_effort is not None:
        segments += _message([("role", "system"), ("type", "thinking-effort")], _text(EFFORT_NOTE.format(thinking_effort)))
    calls, tool_index = [], 0
    for number, message in enumerate(messages):
        role, here = message["role"], f"{where}: message {number}"
        if role == "system" and message.get("tools"):
            segments += _tool_declaration(message["tools"], NEW_TOOLS_HEADER)
        elif role in ("system", "user"):
            segments += _message([("role", role), *_name_attr(message)], _content(message.get("content"), here))
        elif role == "tool":
            tool_index += 1
            name = message.get("tool", message.get("name"))
            if name is None and tool_index <= len(calls) and isinstance(calls[tool_index - 1], dict):
                name = calls[tool_index - 1].get("function", calls[tool_index - 1]).get("name")
            if name is None:
                raise DataError(f"{here}: a tool result needs a 'name' or a matching assistant tool call")
            segments += _message([("role", "tool"), ("tool", name), ("index", tool_index)],
                                 _content(message.get("content"), here))
        else:
            calls, tool_index = message.get("tool_calls") or [], 0
            output = _assistant_body(message, thinking, here)
            opening = _open_tag("message", [("role", "assistant"), *_name_attr(message)]) + output[:3]
            written = output[3:] + _close_tag("message") + [_marker(END_OF_MSG)]
            segments += opening + [dataclasses.replace(segment, assistant=True) for segment in written]
    return segments


def _tool_declaration(tools: Any, header: str) -> list[Segment]:
    if not isinstance(tools, list):
        raise DataError(f"tools must be a list of tool specs, got {type(tools).__name__}")
    return _message([("role", "system"), ("type", "tool-declare")],
                    _text(f"{header}```json\n{_compact_json(tools)}\n```"))


def generation_prompt(thinking: bool = True) -> list[Segment]:
    """What precedes the assistant's output: an open assistant message and its first channel."""
    return _open_tag("message", [("role", "assistant")]) + _open_tag("think" if thinking else "response")


def reply_segments(message: dict, thinking: bool = True) -> list[Segment]:
    """What the assistant writes after `generation_prompt` to produce ``message`` (its rendering by
    `render_conversation` without the prompt), ending in ``<|end_of_msg|>``."""
    return render_conversation([message], thinking=thinking, thinking_effort=None)[len(generation_prompt(thinking)):]


def rendered_text(segments: Sequence[Segment]) -> str:
    """The rendering as one string (for reading and comparing; tokenize with `ChatEncoder`)."""
    return "".join(segment.text for segment in segments)


class ChatEncoder:
    """Segments → token ids with a tokenizer that names K3's four markers among its special tokens."""

    def __init__(self, tokenizer):
        specials = getattr(tokenizer, "special_tokens", {})
        missing = [name for name in MARKERS if name not in specials]
        if missing:
            raise DataError(f"the tokenizer ({tokenizer.describe().get('path', tokenizer.describe()['kind'])}) has "
                            f"no special token {missing[0]}; K3's chat format needs {', '.join(MARKERS)} "
                            f"(set data.tokenizer to K3's tiktoken.model beside its tokenizer_config.json)")
        self.tokenizer = tokenizer
        self.marker_ids = {name: specials[name] for name in MARKERS}
        self.end_of_message_id = self.marker_ids[END_OF_MSG]

    def encode(self, segments: Sequence[Segment], loss: Literal["assistant", "all"] = "assistant"
               ) -> tuple[np.ndarray, np.ndarray]:
        """``(ids int32 [N], loss bool [N])``: True where the token is assistant output (every token for
        ``loss="all"``)."""
        if loss not in LOSS_MODES:
            raise DataError(f"chat loss must be one of {', '.join(LOSS_MODES)}, got {loss!r}")
        ids, flags = [], []
        for segment in segments:
            piece = [self.marker_ids[segment.text]] if segment.marker else self.tokenizer.encode(segment.text)
            ids += piece
            flags += [segment.assistant or loss == "all"] * len(piece)
        return np.asarray(ids, np.int32), np.asarray(flags, bool)

    def reply_message(self, ids: Sequence[int], thinking: bool = True) -> dict:
        """The assistant message that a reply (the ids sampled after `generation_prompt`) writes
        (`parse_reply`): ``content``, ``reasoning_content`` (with thinking) and ``tool_calls`` (when
        it made well-formed calls). A reply cut short keeps the text it has."""
        return self.parse_reply(ids, thinking).message(thinking)

    def parse_reply(self, ids: Sequence[int], thinking: bool = True) -> "Reply":
        """Read a reply back into its parts: the text of its ``think`` and ``response`` channels, and
        its tool calls -- the inverse of `reply_segments` for a reply the renderer could write
        (`ReplyReader` fed every id, then closed)."""
        reader = ReplyReader(self, thinking)
        for token in ids:
            reader.feed(int(token))
        reader.close()
        return reader.reply


class ReplyReader:
    """A reply read as it is sampled, one token at a time, in time linear in its length (what a
    streamed reply needs): `feed` returns the text a token adds to the reasoning and to the content.

    Tags nest as the renderer writes them (module docstring); text outside a channel, tags of
    unknown names and what follows ``<|end_of_msg|>`` are left out. A call is kept when it is
    closed, names its tool and each typed argument's text reads as its type (a string raw, the
    others as JSON); otherwise it is counted in ``Reply.malformed`` with the reason. Text between
    two markers is decoded as one run (`TextDecoder`: a character split across tokens is whole;
    bytes that are not UTF-8 at a marker or at the end are U+FFFD); ids beyond the tokenizer's
    vocabulary are left out. ``reasoning_tokens`` counts the text tokens of the ``think`` channel."""

    def __init__(self, encoder: ChatEncoder, thinking: bool = True):
        self.encoder, self.reply = encoder, Reply()
        self.names = {token: name for name, token in encoder.marker_ids.items()}
        self.text = TextDecoder(encoder.tokenizer.token_bytes)
        self.header: list[str] | None = None    # a tag's text between its marker and <|sep|>, as read
        self.opening, self.call = False, None
        self.stack = [None, "think" if thinking else "response"]   # None: outside every element
        self.channels = {"think": [], "response": []}               # their text, joined by `close`
        self.order: list[str] = []           # the channels in the order their text began
        self.reasoning_tokens = 0

    def feed(self, token: int) -> tuple[str, str]:
        """``token`` read -> (text it added to the reasoning, text it added to the content)."""
        if self.reply.finished:
            return "", ""
        marker = self.names.get(token)
        if marker is None:
            if token >= self.encoder.tokenizer.vocab_size:
                return "", ""
            if self.header is None and self.stack[-1] == "think":
                self.reasoning_tokens += 1
            return self._add(self.text.feed(token))
        added = self._add(self.text.flush())
        self._marker(marker)
        return added

    def close(self) -> tuple[str, str]:
        """The end of the reply: the text still carried (U+FFFD for an incomplete character), and a
        call left open counted as malformed; ``reply`` then holds the channels' text. Returns what
        `feed` does."""
        added = self._add(self.text.flush())
        self._drop_open_call()
        self.reply.reasoning, self.reply.content = ("".join(self.channels[name]) for name in ("think", "response"))
        self.reply.reasoning_tokens = self.reasoning_tokens
        return added

    def _add(self, text: str) -> tuple[str, str]:
        if not text:
            return "", ""
        where = self.stack[-1]
        if self.header is not None:
            self.header.append(text)
        elif where in self.channels:
            if not self.channels[where]:
                self.order.append(where)
            self.channels[where].append(text)
            return (text, "") if where == "think" else ("", text)
        elif self.call is not None and where in ("argument", "json"):
            self.call.parts.append(text)
        return "", ""

    def _marker(self, marker: str) -> None:
        if marker == END_OF_MSG:
            self.reply.finished = True
            self._drop_open_call()
        elif marker in (OPEN, CLOSE):
            self.header, self.opening = [], marker == OPEN
        elif self.header is not None:         # SEP ends a tag: <|open|>NAME attrs<|sep|> or <|close|>NAME<|sep|>
            name, attributes = tag_header("".join(self.header))
            self.header = None
            self._tag(name, attributes)

    def _drop_open_call(self) -> None:
        """The reply ended inside a call: it is counted as malformed."""
        if self.call is not None:
            self.reply.malformed.append("a tool call was cut short")
            self.call = None

    def _tag(self, name: str, attributes: dict) -> None:
        stack, call = self.stack, self.call
        if self.opening:
            stack.append(name)
            if name == "call":
                self.call = _CallReader(attributes.get("tool"))
            elif call is not None and name in ("argument", "json"):
                call.begin(name, attributes)
            return
        while len(stack) > 1 and stack[-1] != name:   # a tag left open closes with its parent
            stack.pop()
        if len(stack) > 1:
            stack.pop()
        if call is not None and name in ("argument", "json"):
            call.end()
        elif call is not None and name == "call":
            self.reply.add_call(call)
            self.call = None


class _CallReader:
    """One ``call`` element as it is read: its tool, typed arguments, or the raw ``json`` text."""

    def __init__(self, tool: str | None):
        self.tool, self.arguments, self.raw, self.errors = tool, {}, None, []
        self.parts, self.current = [], None      # the text of the current argument, as read

    def begin(self, element: str, attributes: dict) -> None:
        self.parts, self.current = [], (element, attributes)

    def end(self) -> None:
        if self.current is None:
            return
        (element, attributes), text = self.current, "".join(self.parts)
        self.current = None
        if element == "json":            # raw text: kept unless it is JSON other than an object
            try:
                value = json.loads(text)
            except (json.JSONDecodeError, RecursionError):
                value = {}
            if not isinstance(value, dict):
                self.errors.append(f"its json arguments are {_argument_type(value)}, not an object")
            self.raw = text
            return
        key, kind = attributes.get("key"), attributes.get("type", "string")
        if key is None:
            self.errors.append("an argument without a key")
        elif kind == "string":
            self.arguments[key] = text
        else:
            try:
                value = json.loads(text)
            except (json.JSONDecodeError, RecursionError):
                self.errors.append(f"argument {key!r} is not {kind} JSON")
                return
            if _argument_type(value) != kind:
                self.errors.append(f"argument {key!r} is {_argument_type(value)}, its tag says {kind}")
            else:
                self.arguments[key] = value


@dataclasses.dataclass
class Reply:
    """A reply read back (`ChatEncoder.parse_reply`). ``tool_calls`` are ``{"name", "arguments"}``
    with arguments a dict (or a string, for a call written as raw ``json`` text); ``finished``:
    the reply ended with ``<|end_of_msg|>``; ``reasoning_tokens``: its text tokens in ``think``."""

    content: str = ""
    reasoning: str = ""
    reasoning_tokens: int = 0
    tool_calls: list = dataclasses.field(default_factory=list)
    malformed: list = dataclasses.field(default_factory=list)
    finished: bool = False

    def add_call(self, call: _CallReader) -> None:
        if not call.tool:
            call.errors.insert(0, "a call without a tool name")
        if call.errors:
            self.malformed.append(f"tool call {len(self.tool_calls) + len(self.malformed) + 1}: {call.errors[0]}")
        else:
            self.tool_calls.append({"name": call.tool, "arguments": call.raw if call.raw is not None else call.arguments})

    def message(self, thinking: bool = True) -> dict:
        """The assistant message as `render_conversation` takes it (calls in OpenAI's form, their
        arguments a JSON string)."""
        message = {"role": "assistant", "content": self.content}
        if thinking:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]
                                                  if isinstance(call["arguments"], str)
                                                  else json.dumps(call["arguments"], ensure_ascii=False)}}
                for call in self.tool_calls]
        return message


def tag_header(header: str) -> tuple[str, dict]:
    """A tag's text between its marker and ``<|sep|>`` -> (name, attributes, unescaped):
    ``call tool="f" index="1"`` -> ("call", {"tool": "f", "index": "1"})."""
    name, _, rest = header.strip().partition(" ")
    attributes = {key: value.replace("&quot;", '"').replace("&amp;", "&")
                  for key, value in re.findall(r'([^\s=]+)="([^"]*)"', rest)}
    return name, attributes
