"""The request bodies of the OpenAI-compatible routes as pydantic models, one per endpoint.

    POST /v1/completions        CompletionRequest       POST /tokenize      TokenizeRequest
    POST /v1/chat/completions   ChatRequest             POST /detokenize    DetokenizeRequest
    POST /v1/responses          ResponseRequest

Every model refuses a field it does not know: a 400 naming it, never a field silently dropped.
Fields that OpenAI (or vLLM) defines but this server does not implement are declared with
`unsupported`: null and the value that asks for nothing pass, any other value is a 400 saying it is
not supported. A few fields are read although they change nothing in the output (``user``, chat's
``metadata``): the comment beside each says why. `Request.parse` turns pydantic's
`ValidationError` into the project's one-line 400 (`validation_error`), whose ``param`` is the
field's path (``stream_options.include_usage``, ``messages[2].tool_calls``) -- never FastAPI's 422.

JSON null reads as the field's default, as OpenAI's API does. Numbers are strict: ``true`` is not
1, ``4.0`` is not an integer, NaN and infinities are refused. What needs the model -- its name (a
404 when another is asked for), vocabulary, context length, chat format -- is checked by the plans
(`eval.serve.completions`, `eval.serve.responses`); the values inside chat messages (roles, content
parts, tool calls) by the chat format (`k3jax.data.chat_format`), the one place that knows them.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, PlainSerializer,
                      Strict, Tag, ValidationError, WrapValidator)
from pydantic_core import PydanticCustomError

from k3jax.data.chat_format import THINKING_EFFORTS
from .errors import ServeError
from .limits import clipped, shown

MAX_N = 64              # choices per request
MAX_TOP_LOGPROBS = 20   # as OpenAI
MAX_STOP = 8            # stop strings per request
MAX_PROMPTS = 1024      # prompts in one completions request
MAX_TOOLS = 128         # tools declared in one request
MAX_MESSAGES = 4096     # chat messages (or responses input items) in one request
_NULL_REFUSED = object()


# -------------------------------------------------------------------- field types
def _described(text: str, null: Any = None, *, whole: bool = False) -> WrapValidator:
    """A validator around a field's type: JSON null reads as ``null`` (a 400 when `_NULL_REFUSED`);
    a value the type refuses is one error ``"{text}, got {value}"``. Errors inside the value (a
    list's items, an object's fields) pass through with their own paths, unless ``whole`` (a union
    of plain types, whose errors pydantic files under each member's name)."""
    def validate(value, handler):
        if value is None and null is not _NULL_REFUSED:
            return null
        try:
            return handler(value)
        except ValidationError as error:
            if not whole and all(detail["loc"] for detail in error.errors()):
                raise
            raise PydanticCustomError("invalid_value", "{text}", {"text": f"{text}, got {shown(value)}"}) from None
    return WrapValidator(validate)


def _keep_sent(value, handler):
    handler(value)
    return value


# Checked by the field's type, kept (and dumped) as the client sent it: tools and chat messages reach
# the chat format, and tool declarations the prompt, with their keys in the client's order.
AS_SENT = (WrapValidator(_keep_sent), PlainSerializer(lambda value: value))


def integer(low: int, high: int | None = None, null: int | None = None):
    interval = f"[{low}, {'inf' if high is None else high}]"
    return Annotated[int, Strict(), Field(ge=low, le=high), _described(f"must be an integer in {interval}", null)]


def number(low: float, high: float, null: float, *, open_low: bool = False):
    interval = f"{'(' if open_low else '['}{float(low)}, {float(high)}]"
    bounds = {"gt": low} if open_low else {"ge": low}
    return Annotated[float, Strict(), Field(le=high, allow_inf_nan=False, **bounds),
                     _described(f"must be a number in {interval}", null)]


def flag(null: bool):
    return Annotated[bool, Strict(), _described("must be true or false", null)]


Text = Annotated[str, Strict(), _described("must be a string")]
Name = Annotated[str, Strict(), Field(min_length=1), _described("must be a non-empty string", _NULL_REFUSED)]


def _same(value: Any, expected: Any) -> bool:
    numbers = (int, float)
    if type(value) in numbers and type(expected) in numbers:      # 0 is 0.0, but false is not 0
        return value == expected
    return type(value) is type(expected) and value == expected


def unsupported(*no_ops: Any, why: str):
    """A field OpenAI (or vLLM) defines that this server does not implement: null and ``no_ops``
    (the values that ask for nothing) pass; any other value is a 400 saying it is not supported."""
    allowed = " or ".join(json.dumps(value) for value in no_ops)
    advice = f"leave it out or send {allowed}" if no_ops else "leave it out"

    def check(value):
        if value is None or any(_same(value, expected) for expected in no_ops):
            return value
        raise PydanticCustomError("unsupported", "{text}", {
            "text": f"is not supported by this server ({why}); {advice}, got {shown(value)}"})
    return Annotated[Any, AfterValidator(check)]


def one_of(values: tuple[str, ...], text: str):
    """A string among ``values`` (null: None), else a 400 ``"{text}, got ..."``."""
    def check(value):
        if value not in values:
            raise PydanticCustomError("invalid_value", "{text}", {"text": f"{text}, got {shown(value)}"})
        return value
    return Annotated[str, Strict(), AfterValidator(check), _described(text)]


# K3's chat format renders thinking_effort low, high or max (`k3jax.data.chat_format`); "none": no thinking
Effort = one_of(("none", *THINKING_EFFORTS), f"must be none (no thinking) or one of K3's thinking efforts "
                f"{', '.join(THINKING_EFFORTS)}")


class ChatTemplateKwargs(BaseModel):
    """vLLM's ``chat_template_kwargs`` as K3's chat format reads them: thinking on or off, its effort."""

    model_config = ConfigDict(extra="forbid")

    thinking: flag(None) | None = None
    thinking_effort: one_of(THINKING_EFFORTS, f"must be one of K3's thinking efforts {', '.join(THINKING_EFFORTS)}"
                            ) | None = None


class Reasoning(BaseModel):
    """A responses request's ``reasoning``: its effort, as chat's ``reasoning_effort``."""

    model_config = ConfigDict(extra="forbid")

    effort: Effort | None = None
    summary: unsupported(why="reasoning is returned whole as reasoning_text, not summarized") = None
    generate_summary: unsupported(why="reasoning is returned whole as reasoning_text, not summarized") = None


def _one_or_list(value):
    return [value] if isinstance(value, str) else value


Stop = Annotated[list[Annotated[str, Strict(), Field(min_length=1)]], Field(max_length=MAX_STOP),
                 BeforeValidator(_one_or_list),
                 _described(f"must be a non-empty string or a list of at most {MAX_STOP} of them", [])]
TokenIds = Annotated[list[Annotated[int, Strict()]], Field(min_length=1)]
Prompt = Annotated[Union[Annotated[str, Strict()], TokenIds,
                         Annotated[list[Union[Annotated[str, Strict()], TokenIds]], Field(min_length=1, max_length=MAX_PROMPTS)]],
                   _described(f"must be a string, a list of token ids, or a list of 1 to {MAX_PROMPTS} of either",
                              _NULL_REFUSED, whole=True)]


def _token_key(key: str) -> str:
    if not (isinstance(key, str) and key.lstrip("-").isdigit()):
        raise PydanticCustomError("invalid_value", "{text}", {"text": f"keys must be token ids, got {shown(key)}"})
    return key


LogitBias = Annotated[dict[Annotated[str, AfterValidator(_token_key)], number(-100, 100, 0.0)], Field(max_length=1024),
                      _described("must be an object of token ids (strings) to biases in [-100, 100]", {})]
JsonSchema = Annotated[dict[str, Any], _described("must be an object (a JSON schema)", _NULL_REFUSED)]


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of a JSON schema, any JSON object, a regex, a choice
    list or a Lark grammar that the output (a chat reply's content) must match."""

    model_config = ConfigDict(extra="forbid")

    json_: Annotated[Union[JsonSchema, Annotated[str, Strict()]], Field(alias="json"),
                     _described("must be a JSON schema (an object or its JSON text)")] = None
    json_object: flag(False) = False
    regex: Annotated[str, Strict(), Field(min_length=1), _described("must be a non-empty string")] | None = None
    choice: Annotated[list[Annotated[str, Strict()]], Field(min_length=1, max_length=1024),
                      _described("must be a non-empty list of strings")] | None = None
    grammar: Annotated[str, Strict(), Field(min_length=1), _described("must be a non-empty string (a Lark grammar)")
                       ] | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    schema_: Annotated[JsonSchema, Field(alias="schema")] = {}
    description: Any = None
    strict: flag(False) = False        # read: the reply always keeps to the schema


class ResponseFormat(BaseModel):
    """``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}``."""

    model_config = ConfigDict(extra="forbid")

    type: Annotated[Literal["text", "json_object", "json_schema"],
                    _described("must be 'text', 'json_object' or 'json_schema'", _NULL_REFUSED)]
    json_schema: Annotated[JsonSchemaFormat, _described("must be an object")] | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: that function must be called, once."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: Annotated[NamedFunction, _described("must be an object", _NULL_REFUSED)]


ToolChoice = Annotated[Union[Literal["auto", "none", "required"], NamedToolChoice],
                       _described("must be 'auto', 'none', 'required' or {\"type\": \"function\", \"function\": "
                                  "{\"name\": ...}}", whole=True)]


# -------------------------------------------------------------------- the models
class Request(BaseModel):
    """What every request body has: no unknown field, and ``model``, the served model's name (the
    plan answers another name with a 404)."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Strict(), _described("must be a string", _NULL_REFUSED)] = None

    @classmethod
    def parse(cls, body: Any):
        """``body`` (a decoded JSON object, or already a ``cls``) read into ``cls``, or a `ServeError` 400."""
        if isinstance(body, cls):
            return body
        try:
            return cls.model_validate(body)
        except ValidationError as error:
            raise validation_error(error.errors(include_url=False)) from None


class Sampled(Request):
    """Sampling that every generating route reads: OpenAI's defaults, temperature 1 and top_p 1; no
    seed draws one."""

    temperature: number(0, 2, 1.0) = 1.0
    top_p: number(0, 1, 1.0, open_low=True) = 1.0
    seed: Annotated[int, Strict(), _described("must be an integer")] | None = None
    user: Text | None = None     # read, never used: an end user's id for the provider's abuse monitoring


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: flag(False) = False
    include_obfuscation: unsupported(False, why="stream chunks carry no obfuscation padding") = None


class Choices(Sampled):
    """What completions and chat completions share: n choices, stop strings, streaming, the length."""

    n: integer(1, MAX_N, 1) = 1
    stop: Stop = []
    stream: flag(False) = False
    stream_options: Annotated[StreamOptions, _described("must be an object")] | None = None
    max_tokens: integer(0) | None = None        # None: up to the context's end (completions: 16)
    ignore_eos: flag(False) = False             # vLLM's: keep generating past the end-of-text token
    # the logits options (`k3jax.sampling.adjusted_logits`); token ids are checked against the model by the plan
    presence_penalty: number(-2, 2, 0.0) = 0.0
    frequency_penalty: number(-2, 2, 0.0) = 0.0
    logit_bias: LogitBias = {}
    top_k: integer(-1, None, -1) = -1            # vLLM's: -1 or 0 is no filter
    min_p: number(0, 1, 0.0) = 0.0               # vLLM's
    repetition_penalty: number(0, 10, 1.0, open_low=True) = 1.0     # vLLM's
    stop_token_ids: Annotated[list[Annotated[int, Strict()]], Field(max_length=MAX_STOP),
                              _described(f"must be a list of at most {MAX_STOP} token ids", [])] = []   # vLLM's
    structured_outputs: Annotated[StructuredOutputs, _described("must be an object")] | None = None    # vLLM's

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(Choices):
    """``POST /v1/completions``: one prompt (text or token ids) or a list of them."""

    prompt: Prompt
    echo: flag(False) = False
    logprobs: integer(0, MAX_TOP_LOGPROBS) | None = None
    best_of: unsupported(1, why="each choice is returned; none is picked among several") = None
    suffix: unsupported("", why="no insertion after the completion") = None


Parameters = Annotated[dict[str, Any], _described("must be an object (the JSON schema of the arguments)")] | None


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    description: Any = None
    parameters: Parameters = None
    strict: flag(False) = False          # true: the arguments of every call keep to ``parameters``


class ChatTool(BaseModel):
    """A chat completions tool: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: Annotated[FunctionSpec, _described("must be an object", _NULL_REFUSED)]


ChatTools = Annotated[list[ChatTool], Field(max_length=MAX_TOOLS),
                      _described(f'must be a list of at most {MAX_TOOLS} {{"type": "function", "function": '
                                 '{"name": ...}} objects'), *AS_SENT]


class ChatMessage(BaseModel):
    """A chat message's keys; their values are the chat format's to check (it names the message)."""

    model_config = ConfigDict(extra="forbid")

    role: Any
    content: Any = None
    name: Any = None
    tool_calls: Any = None
    tool_call_id: Any = None
    reasoning_content: Any = None   # an assistant's thinking, as this server returns it
    reasoning: Any = None           # the same under vLLM's name (the chat format reads either)
    tools: Any = None               # K3's chat format: a system message declaring tools mid-conversation
    tool: Any = None                # K3's chat format: the tool a tool result comes from
    annotations: Any = None         # read, not rendered: an earlier reply's citations, sent back with it
    refusal: unsupported("", why="a refusal is not rendered; put it in content") = None
    audio: unsupported(why="no audio") = None
    function_call: unsupported(why="the deprecated function_call; use tool_calls") = None


Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES),
                     _described(f"must be a non-empty list of at most {MAX_MESSAGES} message objects", _NULL_REFUSED),
                     *AS_SENT]


class ChatRequest(Choices):
    """``POST /v1/chat/completions``: messages (and tools) in K3's chat format."""

    messages: Messages
    tools: ChatTools | None = None
    tool_choice: ToolChoice | None = None
    max_completion_tokens: integer(0) | None = None      # OpenAI's newer name for max_tokens (wins over it)
    logprobs: flag(False) = False
    top_logprobs: integer(0, MAX_TOP_LOGPROBS, 0) = 0
    # read, never used: tags OpenAI keeps with a stored completion (store: true is refused below)
    metadata: Annotated[dict[str, Any], _described("must be an object")] | None = None
    parallel_tool_calls: flag(True) = True
    response_format: Annotated[ResponseFormat, _described("must be an object")] | None = None
    reasoning_effort: Effort | None = None       # None: the run's (data.chat_thinking_effort)
    chat_template_kwargs: Annotated[ChatTemplateKwargs, _described("must be an object")] | None = None   # vLLM's
    store: unsupported(False, why="chat completions are not stored; /v1/responses stores responses") = None


# -------------------------------------------------------------------- /v1/responses
class Part(BaseModel):
    """A text part of a responses message's content."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["input_text", "output_text", "text"]
    text: Annotated[str, Strict()]
    annotations: Any = None     # read, not rendered: an earlier output's citations, sent back with it
    logprobs: Any = None        # read, not rendered: an earlier output's log-probs, sent back with it


def _text_parts(value):
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["message"] = "message"
    role: Annotated[Literal["user", "system", "developer", "assistant"],
                    _described("must be user, system, developer or assistant", _NULL_REFUSED)]
    content: Annotated[list[Part], BeforeValidator(_text_parts),
                       _described("must be a string or a list of input_text / output_text parts", _NULL_REFUSED)]
    id: Any = None              # an earlier output item's id and status, sent back with it: not rendered
    status: Any = None


class ReasoningText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["reasoning_text"] = "reasoning_text"
    text: Annotated[str, Strict()]


class ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["reasoning"]
    content: Annotated[list[ReasoningText], _described("must be a list of reasoning_text parts", [])] = []
    summary: Any = None         # not rendered (this server's summaries are empty)
    id: Any = None
    status: Any = None
    encrypted_content: unsupported(why="reasoning is sent back as text") = None


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function_call"]
    call_id: Annotated[str, Strict()]
    name: Annotated[str, Strict()]
    arguments: Annotated[str, Strict()] = ""
    id: Any = None
    status: Any = None


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function_call_output"]
    call_id: Annotated[str, Strict()]
    output: Any = None          # a string, or any JSON (rendered as its JSON text)
    id: Any = None
    status: Any = None


ITEM_TYPES = {"message": MessageItem, "reasoning": ReasoningItem, "function_call": FunctionCallItem,
              "function_call_output": FunctionCallOutputItem}


ITEM_TAG = "item:"      # an input item's tag: pydantic puts it in an error's location, `field_path` leaves it out


def _item_type(item) -> str | None:
    if isinstance(item, dict):
        return f"{ITEM_TAG}{item.get('type', 'message')}"
    return None if getattr(item, "type", None) is None else f"{ITEM_TAG}{item.type}"


InputItem = Annotated[Union[tuple(Annotated[model, Tag(f"{ITEM_TAG}{name}")] for name, model in ITEM_TYPES.items())],
                      Discriminator(_item_type)]


def _user_text(value):
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


class ResponseTool(BaseModel):
    """A responses tool: ``{"type": "function", "name", "description", "parameters", "strict"}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: Name
    description: Any = None
    parameters: Parameters = None
    strict: flag(False) = False        # its calls' arguments keep to ``parameters`` (`eval.serve.constraints`)


class ResponseTextFormat(BaseModel):
    """A response's ``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "name", "schema", "strict"}`` (chat's ``response_format``, flattened)."""

    model_config = ConfigDict(extra="forbid")

    type: Annotated[Literal["text", "json_object", "json_schema"],
                    _described("must be 'text', 'json_object' or 'json_schema'", _NULL_REFUSED)]
    name: Name | None = None
    schema_: Annotated[Optional[JsonSchema], Field(alias="schema")] = None
    description: Any = None
    strict: flag(False) = False        # read: the reply always keeps to the schema


class ResponseText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Annotated[ResponseTextFormat, _described("must be an object")] | None = None
    verbosity: unsupported("medium", why="the reply's length is the model's") = None


class ResponseNamedTool(BaseModel):
    """``{"type": "function", "name": ...}``: that function must be called, once."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: Name


ResponseToolChoice = Annotated[Union[Literal["auto", "none", "required"], ResponseNamedTool],
                               _described("must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                                          "\"name\": ...}", whole=True)]


class ResponseRequest(Sampled):
    """``POST /v1/responses``: a turn of a stored conversation."""

    input: Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES), BeforeValidator(_user_text),
                     _described(f"must be a string or a non-empty list of at most {MAX_MESSAGES} items", _NULL_REFUSED)]
    instructions: Text | None = None
    tools: Annotated[list[ResponseTool], Field(max_length=MAX_TOOLS),
                     _described(f'must be a list of at most {MAX_TOOLS} {{"type": "function", "name": ...}} objects'),
                     *AS_SENT] | None = None
    previous_response_id: Text | None = None
    store: flag(True) = True
    max_output_tokens: integer(1) | None = None
    metadata: Annotated[dict[str, Any], _described("must be an object")] | None = None   # echoed in the response
    stream: flag(False) = False
    tool_choice: ResponseToolChoice | None = None
    parallel_tool_calls: flag(True) = True
    truncation: unsupported("disabled", why="a conversation past the context is refused, not cut") = None
    reasoning: Annotated[Reasoning, _described("must be an object")] | None = None
    text: Annotated[ResponseText, _described("must be an object")] | None = None
    include: unsupported([], why="the response carries no extra data") = None
    background: unsupported(False, why="each response is answered while the client waits") = None
    top_logprobs: unsupported(0, why="log-probs are offered on /v1/chat/completions") = None


# -------------------------------------------------------------------- /tokenize, /detokenize
class TokenizeRequest(Request):
    """vLLM's ``POST /tokenize``: a text prompt, or chat messages (and tools) rendered with the
    assistant's generation prompt."""

    prompt: Annotated[str, Strict(), _described("give a string prompt or messages")] | None = None
    messages: Messages = None     # (absent: a text prompt)
    tools: ChatTools | None = None
    chat_template_kwargs: Annotated[ChatTemplateKwargs, _described("must be an object")] | None = None   # as chat's
    add_special_tokens: unsupported(False, why="no special token is added; name one in the text to have it") = None
    add_generation_prompt: unsupported(True, why="messages are always rendered with the generation prompt") = None
    return_token_strs: unsupported(False, why="only token ids are returned") = None


class DetokenizeRequest(Request):
    """vLLM's ``POST /detokenize``."""

    tokens: Annotated[list[Annotated[int, Strict()]], _described("must be a list of token ids", _NULL_REFUSED)]


# -------------------------------------------------------------------- pydantic's errors -> a 400
ERROR_PHRASES = {"bool_type": "must be true or false", "string_type": "must be a string", "int_type": "must be an integer",
                 "float_type": "must be a number", "list_type": "must be a list", "dict_type": "must be an object",
                 "model_type": "must be an object", "model_attributes_type": "must be an object",
                 "union_tag_not_found": "must be an object", "string_too_short": "must not be empty"}


def field_path(loc) -> str:
    """A pydantic error location as the request's field path: ``input[2].content`` (the tag of a
    responses input item's type, which pydantic puts after the item's index, left out)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not part.startswith(ITEM_TAG):
            path += f".{part}" if path else part
    return path


def validation_error(details: list[dict]) -> ServeError:
    """Pydantic's error details (of a `ValidationError`, or FastAPI's) -> one 400 for the first,
    its ``param`` the field's path."""
    detail = details[0]
    path, kind = clipped(field_path(detail["loc"])), detail["type"]
    if kind == "extra_forbidden":
        return ServeError(400, f"unknown field {path!r}: this server does not read it; leave it out", param=path)
    if kind in ("invalid_value", "unsupported"):
        text = detail["msg"]
    elif kind == "missing":
        text = "is required"
    elif kind == "union_tag_invalid":
        expected = ", ".join(map(repr, ITEM_TYPES))
        text = f"unsupported item type {detail['ctx']['tag'].removeprefix(ITEM_TAG)!r} (expected {expected})"
    elif kind in ERROR_PHRASES:
        text = f"{ERROR_PHRASES[kind]}, got {shown(detail.get('input'))}"
    else:
        text = detail["msg"][:1].lower() + detail["msg"][1:]
    if not path:
        return ServeError(400, f"the request body {text}")
    return ServeError(400, f"{path}: {text}", param=path)
