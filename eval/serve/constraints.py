"""What a request asks its output to keep to, as one grammar (`k3jax.grammar`), or None.

    content    ``response_format`` (chat: ``json_object``, ``json_schema``) or vLLM's ``structured_outputs``
               (``json``, ``json_object``, ``regex``, ``choice``, ``grammar``: a Lark grammar in
               llguidance's dialect): the completion's text, or a chat reply's content
    tools      chat ``tool_choice``: ``"required"`` (at least one call; its content empty), a named
               function (exactly one call of it), ``"auto"`` (calls optional); ``parallel_tool_calls:
               false`` (at most one call); a function's ``strict`` (its calls' arguments keep to its
               ``parameters``). A call is written in K3's tool-call markup with its arguments one JSON
               object valid for the function's schema (`k3jax.grammar.reply_grammar`); under ``"auto"``
               a non-strict function may also take K3's typed arguments, unconstrained.

A chat request is constrained when it asks for content, a required or named call, a single call or
a strict function; the whole reply then follows `k3jax.grammar.reply_grammar` (thinking free).
A grammar that does not compile (a bad schema, regex or Lark text) is a 400 naming its field.
"""
from __future__ import annotations

import json

from types import SimpleNamespace

from .errors import ServeError, bad
from .protocol import ChatRequest, Choices, ResponseRequest


def _grammar_module():
    try:
        from k3jax import grammar
    except ImportError as error:         # llguidance is the serve extra's
        raise ServeError(400, f"constrained decoding needs llguidance (pip install 'k3jax[serve]'): {error}",
                         param="response_format") from None
    return grammar


def content_grammar(request: Choices, vocabulary) -> tuple[str, str] | None:
    """(grammar, the field it came from) for the output's text, or None: ``response_format`` (chat)
    or ``structured_outputs``; a 400 when both ask, or when the grammar does not compile for
    ``vocabulary()`` (called only when a grammar is asked for)."""
    format_ = getattr(request, "response_format", None)
    outputs = request.structured_outputs
    if (format_ is None or format_.type == "text") and outputs is None:
        return None
    grammar = _grammar_module()
    asked = []
    if format_ is not None and format_.type != "text":
        if format_.type == "json_object":
            asked.append(("response_format", lambda: grammar.json_schema_grammar(True)))
        elif format_.json_schema is None:
            raise bad("response_format.json_schema", "is required with type 'json_schema'")
        else:
            schema = format_.json_schema.schema_
            asked.append(("response_format.json_schema.schema", lambda: grammar.json_schema_grammar(schema)))
    if outputs is not None:
        kinds = {"json": outputs.json_, "regex": outputs.regex, "choice": outputs.choice, "grammar": outputs.grammar,
                 "json_object": outputs.json_object or None}
        named = [kind for kind, value in kinds.items() if value is not None]
        if len(named) != 1:
            raise bad("structured_outputs", f"give exactly one of {', '.join(kinds)}, got {len(named)}")
        kind, value = named[0], kinds[named[0]]
        build = {"json": lambda: grammar.json_schema_grammar(_schema(value, "structured_outputs.json")),
                 "json_object": lambda: grammar.json_schema_grammar(True),
                 "regex": lambda: grammar.regex_grammar(value), "choice": lambda: grammar.choice_grammar(value),
                 "grammar": lambda: grammar.lark_grammar(value)}[kind]
        asked.append((f"structured_outputs.{kind}", build))
    if len(asked) > 1:
        raise bad(asked[1][0].split(".")[0], f"asks for a format beside {asked[0][0].split('.')[0]}; give one")
    field, build = asked[0]
    return _checked(build, field, vocabulary()), field


def _schema(value, field: str) -> dict:
    if isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as error:
        raise bad(field, f"is not JSON: {error}") from None
    if not isinstance(schema, dict):
        raise bad(field, "must be a JSON schema object")
    return schema


def _checked(build, field: str, vocabulary) -> str:
    """The grammar ``build()`` makes, compiled once for ``vocabulary`` -> a 400 naming ``field`` when it fails."""
    grammar = _grammar_module()
    try:
        text = build()
        grammar.check_grammar(text, vocabulary)
    except (ValueError, TypeError) as error:
        raise bad(field, f"is not a valid grammar: {str(error).strip().splitlines()[0]}") from None
    return text


def chat_grammar(request: ChatRequest, tools: list | None, thinking: bool, vocabulary) -> str | None:
    """The grammar of a chat request's whole reply (module docstring), or None when it asks for
    nothing; ``vocabulary()`` the grammar engine's tokenizer (called only when needed)."""
    content = content_grammar(request, vocabulary)
    choice, single = request.tool_choice or "auto", not request.parallel_tool_calls
    tools = tools or []
    functions = [tool["function"] if "function" in tool else tool for tool in tools]
    if not isinstance(choice, str):
        name = choice.function.name
        functions = [function for function in functions if function["name"] == name]
        if not functions:
            raise bad("tool_choice", f"names the function {name!r}, which is not among the request's tools")
    elif choice == "required" and not functions:
        raise bad("tool_choice", "is 'required' but the request declares no tools")
    strict = any(function.get("strict") for function in functions)
    forced = choice == "required" or not isinstance(choice, str)
    if content is None and not forced and not (functions and (single or strict)):
        return None
    low = 1 if forced else 0
    high = 1 if single or not isinstance(choice, str) else None
    grammar = _grammar_module()
    specs = [grammar.ToolSpec(function["name"], function.get("parameters"),
                              typed=choice == "auto" and not function.get("strict")) for function in functions]
    field = "tools" if content is None else content[1]
    return _checked(lambda: grammar.reply_grammar(thinking, None if content is None else content[0], specs, (low, high)),
                    field, vocabulary())


def response_grammar(request: ResponseRequest, tools: list | None, thinking: bool, vocabulary) -> str | None:
    """The grammar of a ``/v1/responses`` reply: its ``text.format``, ``tool_choice``,
    ``parallel_tool_calls`` and tools' ``strict`` read as chat's ``response_format``, ``tool_choice``
    and ``parallel_tool_calls`` (`chat_grammar`; 400s name the Responses fields)."""
    text_format = request.text.format if request.text is not None else None
    response_format = None
    if text_format is not None:
        schema = None if text_format.type != "json_schema" else SimpleNamespace(schema_=text_format.schema_ or {})
        if text_format.type == "json_schema" and text_format.schema_ is None:
            raise bad("text.format.schema", "is required with type 'json_schema'")
        response_format = SimpleNamespace(type=text_format.type, json_schema=schema)
    choice = request.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = SimpleNamespace(function=SimpleNamespace(name=choice.name))
    chat = SimpleNamespace(response_format=response_format, structured_outputs=None, tool_choice=choice,
                           parallel_tool_calls=request.parallel_tool_calls)
    try:
        return chat_grammar(chat, tools, thinking, vocabulary)
    except ServeError as error:        # chat's field names, as a response calls them
        renamed = _RESPONSE_FIELDS.get(error.param)
        if renamed is None:
            raise
        raise bad(renamed, error.message.removeprefix(f"{error.param}: ")) from None


_RESPONSE_FIELDS = {"response_format": "text.format", "response_format.json_schema.schema": "text.format.schema"}
