"""Constrained decoding through the server (`eval.serve.constraints`, `k3jax.grammar`) on an
untrained model (random weights: nothing but the constraint makes its output valid): json_schema
replies validate with `jsonschema`, forced tool calls are valid calls of the right function with
arguments valid for its schema, regex and choice outputs match, a constraint the greedy output
already keeps leaves it unchanged, speculative constrained greedy equals plain constrained greedy,
and each malformed constraint is a 400 naming its field.

The server serves `plain_chat_run` (no thinking: the reply opens its response channel, so the
whole reply is under the grammar)."""
import json
import re

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from tests.serve.conftest import KEY  # noqa: E402
from tests.serve.test_api import post  # noqa: E402

USER = [{"role": "user", "content": "Fill in the form."}]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                                               "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "boolean"}},
        "required": ["x", "y"], "additionalProperties": False},
        "color": {"enum": ["red", "green", "blue"]}},
     "required": ["point", "color"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": 10, "maximum": 99},
                                      "ok": {"type": "boolean"}},
     "required": ["score", "ok"], "additionalProperties": False},
]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def constrained_server(run, *flags):
    from fastapi.testclient import TestClient

    from eval.serve.cli import build, parse_args

    app, _, _ = build(parse_args([str(run), "--api-key", KEY, "--max-model-len", "1024", "--max-batch", "8", *flags]))
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


@pytest.fixture(scope="module")
def client(plain_chat_run):
    yield from constrained_server(plain_chat_run)


def chat(client, status=200, **body):
    return post(client, "/v1/chat/completions", {"messages": USER, "max_tokens": 120, **body}, status)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_replies_validate(client, schema):
    """Greedy and sampled (several seeds) replies parse as JSON valid for the schema and end with ``stop``."""
    response_format = {"type": "json_schema", "json_schema": {"name": "form", "schema": schema, "strict": True}}
    for settings in ({"temperature": 0}, {"temperature": 1.0, "seed": 1, "n": 2}):
        for choice in chat(client, response_format=response_format, **settings)["choices"]:
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_json_object_and_structured_outputs(client):
    reply = chat(client, response_format={"type": "json_object"}, temperature=0, max_tokens=200)["choices"][0]
    if reply["finish_reason"] == "stop":
        assert isinstance(json.loads(reply["message"]["content"]), dict)
    for seed in range(2):
        content = chat(client, structured_outputs={"regex": "[a-c]{2,4}-[0-9]{3}"}, temperature=1.0,
                       seed=seed)["choices"][0]["message"]["content"]
        assert re.fullmatch("[a-c]{2,4}-[0-9]{3}", content), content
        content = chat(client, structured_outputs={"choice": ["yes", "no", "maybe so"]}, temperature=1.0,
                       seed=seed)["choices"][0]["message"]["content"]
        assert content in ("yes", "no", "maybe so")
    content = chat(client, structured_outputs={"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]/'},
                   temperature=0)["choices"][0]["message"]["content"]
    assert re.fullmatch(r"\(\d(\+\d)*\)", content), content
    text = post(client, "/v1/completions", {"prompt": "x", "max_tokens": 40, "temperature": 0,
                                            "structured_outputs": {"regex": "[0-9]{3}"}})["choices"][0]["text"]
    assert re.fullmatch("[0-9]{3}", text), text


def test_forced_tool_calls_are_valid_calls(client):
    """``required``: at least one call, each of a declared tool with valid arguments; a named choice:
    exactly that function once; ``parallel_tool_calls: false``: never more than one call."""
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, CLOCK)}
    for seed in range(2):
        for choice_setting, parallel, names in (("required", True, {"get_weather", "get_time"}),
                                                ("required", False, {"get_weather", "get_time"}),
                                                ({"type": "function", "function": {"name": "get_time"}}, True,
                                                 {"get_time"})):
            body = chat(client, tools=[WEATHER, CLOCK], tool_choice=choice_setting, parallel_tool_calls=parallel,
                        temperature=1.0, seed=seed, max_tokens=300)
            choice = body["choices"][0]
            calls = choice["message"]["tool_calls"]
            assert calls, choice
            assert choice["finish_reason"] == "tool_calls" and len(calls) == 1 or parallel and choice_setting == "required"
            # (several calls may run to max_tokens: the untrained model calls on)
            for call in calls:
                assert call["function"]["name"] in names
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


ASCII = {str(token): 30 for token in range(ord(" "), ord("~") + 1)}   # the untrained model writes text under it


def test_a_constraint_the_greedy_output_keeps_changes_nothing(client):
    """Unconstrained greedy text (ASCII under a logit bias), then the same request held to a regex
    that this text keeps (itself, escaped, then anything), or to at most one tool call: the same reply."""
    free = chat(client, temperature=0, max_tokens=16, logit_bias=ASCII)["choices"][0]
    text = free["message"]["content"]
    assert text and free["finish_reason"] == "length"
    held = chat(client, temperature=0, max_tokens=16, logit_bias=ASCII,
                structured_outputs={"regex": re.escape(text) + "(.|\\n)*"})["choices"][0]
    assert held["message"] == free["message"]
    completion = {"prompt": "x", "max_tokens": 16, "temperature": 0, "logit_bias": ASCII}
    free = post(client, "/v1/completions", completion)["choices"][0]["text"]
    held = post(client, "/v1/completions", {**completion, "structured_outputs": {"regex": re.escape(free) + ".*"}})
    assert held["choices"][0]["text"] == free
    for tool in (WEATHER, {**WEATHER, "function": {**WEATHER["function"], "strict": True}}):
        single = chat(client, temperature=0, max_tokens=16, logit_bias=ASCII, tools=[tool], parallel_tool_calls=False)
        plain = chat(client, temperature=0, max_tokens=16, logit_bias=ASCII, tools=[tool])
        assert single["choices"][0]["message"] == plain["choices"][0]["message"]


def test_logits_options_are_honoured(client):
    """logit_bias +100 on one token makes greedy write it; stop_token_ids end there."""
    text = post(client, "/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0,
                                            "logit_bias": {str(ord("q")): 100}})["choices"][0]["text"]
    assert text == "qqqq"
    body = post(client, "/v1/completions", {"prompt": "x", "max_tokens": 8, "temperature": 0,
                                            "logit_bias": {str(ord("q")): 100}, "stop_token_ids": [ord("q")]})
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 1
    for options in ({"top_k": 1}, {"min_p": 1.0}):      # both keep only the top token: greedy
        sampled = post(client, "/v1/completions", {"prompt": "x", "max_tokens": 6, "temperature": 1.0, "seed": 3,
                                                   **options})["choices"][0]["text"]
        greedy = post(client, "/v1/completions", {"prompt": "x", "max_tokens": 6, "temperature": 0})["choices"][0]
        assert sampled == greedy["text"]


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "a["}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_bad_constraints_are_400s_naming_the_field(client, body, param):
    error = chat(client, status=400, **body)["error"]
    assert error["param"] == param, error
    assert chat(client, temperature=0, max_tokens=2)["choices"]       # still serving


def respond(client, status=200, **body):
    response = client.post("/v1/responses", json={"input": "Fill in the form.", "store": False, **body})
    assert response.status_code == status, response.text
    return response.json()


def test_responses_keep_to_text_format_and_tool_choice(client):
    """``/v1/responses`` under ``text.format`` json_schema (the output text validates), ``tool_choice``
    required and named (function calls of the declared tools, arguments valid), echoed in the body;
    a bad schema and an unknown named function are 400s naming the Responses fields."""
    flat = [{"type": "function", **tool["function"]} for tool in (WEATHER, CLOCK)]
    schemas = {tool["name"]: tool["parameters"] for tool in flat}
    for seed in range(2):
        body = respond(client, text={"format": {"type": "json_schema", "name": "form", "schema": SCHEMAS[0],
                                                "strict": True}}, temperature=1.0, seed=seed, max_output_tokens=300)
        (message,) = [item for item in body["output"] if item["type"] == "message"]
        jsonschema.validate(json.loads(message["content"][0]["text"]), SCHEMAS[0])
        assert body["text"]["format"]["type"] == "json_schema"
        for choice, names in (("required", set(schemas)), ({"type": "function", "name": "get_time"}, {"get_time"})):
            body = respond(client, tools=flat, tool_choice=choice, parallel_tool_calls=False, temperature=1.0,
                           seed=seed, max_output_tokens=300)
            calls = [item for item in body["output"] if item["type"] == "function_call"]
            assert len(calls) == 1 and calls[0]["name"] in names, body["output"]
            jsonschema.validate(json.loads(calls[0]["arguments"]), schemas[calls[0]["name"]])
            assert body["tool_choice"] == choice and body["parallel_tool_calls"] is False
    bad = respond(client, 400, text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}})
    assert bad["error"]["param"] == "text.format.schema", bad
    bad = respond(client, 400, tools=flat, tool_choice={"type": "function", "name": "nope"})
    assert bad["error"]["param"] == "tool_choice", bad


@pytest.fixture(scope="module")
def drafted(plain_chat_run):
    """A server drafting with its own model: its drafts are the unconstrained greedy tokens."""
    yield from constrained_server(plain_chat_run, "--speculate-k", "2", "--draft", str(plain_chat_run))


@pytest.mark.slow
def test_speculative_constrained_greedy_equals_plain_constrained_greedy(client, drafted):
    for schema in SCHEMAS[:2]:
        body = {"response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}},
                "temperature": 0}
        assert chat(drafted, **body)["choices"][0]["message"] == chat(client, **body)["choices"][0]["message"]
    body = {"tools": [WEATHER, CLOCK], "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0,
            "max_tokens": 300}
    plain, speculative = chat(client, **body)["choices"][0]["message"], chat(drafted, **body)["choices"][0]["message"]
    assert [c["function"] for c in plain["tool_calls"]] == [c["function"] for c in speculative["tool_calls"]]
