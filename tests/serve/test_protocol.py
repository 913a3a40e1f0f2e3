"""The request models (`eval.serve.protocol`): an unknown field refused naming it, each option the
server does not implement refused at any value but its no-op, nested errors named by their path,
the honoured fields' defaults, ranges and strictness -- on the models directly, through an app whose
model is never reached (every request here is refused before it is), and a few accepted through the
server over the micro chat checkpoint. Never a 422: always the project's 400 body."""
import pytest

from eval.serve.errors import ServeError
from eval.serve.protocol import (ChatRequest, CompletionRequest, DetokenizeRequest, ResponseRequest, TokenizeRequest,
                                 field_path)

USER = [{"role": "user", "content": "3 QWERTY"}]
MINIMAL = {CompletionRequest: {"prompt": "x"}, ChatRequest: {"messages": USER}, ResponseRequest: {"input": "x"},
           TokenizeRequest: {"prompt": "x"}, DetokenizeRequest: {"tokens": [1, 2]}}
ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest, "/v1/responses": ResponseRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def refused(model, body) -> ServeError:
    with pytest.raises(ServeError) as error:
        model.parse(body)
    assert error.value.status == 400 and error.value.kind == "invalid_request_error"
    return error.value


@pytest.mark.parametrize("model", list(MINIMAL), ids=lambda model: model.__name__)
def test_an_unknown_field_is_refused_by_name_and_the_minimal_body_accepted(model):
    assert isinstance(model.parse(MINIMAL[model]), model)
    error = refused(model, {**MINIMAL[model], "foo": 1})
    assert error.param == "foo" and error.message == "unknown field 'foo': this server does not read it; leave it out"


def top(model, name):
    return model, name, lambda value: {**MINIMAL[model], name: value}


# (model, the field's path, the body with the field at a value, values that pass, a value refused)
UNSUPPORTED = [
    (*top(CompletionRequest, "best_of"), [1], 3),
    (*top(CompletionRequest, "suffix"), [""], "the end"),
    (*top(ChatRequest, "store"), [False], True),
    (ChatRequest, "stream_options.include_obfuscation",
     lambda value: {"messages": USER, "stream_options": {"include_obfuscation": value}}, [False], True),
    (ChatRequest, "messages[1].refusal",
     lambda value: {"messages": USER + [{"role": "assistant", "content": "x", "refusal": value}]}, [""], "no"),
    (ChatRequest, "messages[0].audio", lambda value: {"messages": [{**USER[0], "audio": value}]}, [], {"id": "a"}),
    (ChatRequest, "messages[0].function_call", lambda value: {"messages": [{**USER[0], "function_call": value}]},
     [], {"name": "f", "arguments": "{}"}),
    (*top(ResponseRequest, "truncation"), ["disabled"], "auto"),
    (ResponseRequest, "reasoning.summary", lambda value: {"input": "x", "reasoning": {"summary": value}}, [], "auto"),
    (ResponseRequest, "text.verbosity", lambda value: {"input": "x", "text": {"verbosity": value}}, ["medium"], "low"),
    (*top(ResponseRequest, "include"), [[]], ["reasoning.encrypted_content"]),
    (*top(ResponseRequest, "background"), [False], True),
    (*top(ResponseRequest, "top_logprobs"), [0], 5),
    (ResponseRequest, "input[0].encrypted_content",
     lambda value: {"input": [{"type": "reasoning", "content": [], "encrypted_content": value}]}, [], "gAAAA"),
    (*top(TokenizeRequest, "add_special_tokens"), [False], True),
    (*top(TokenizeRequest, "add_generation_prompt"), [True], False),
    (*top(TokenizeRequest, "return_token_strs"), [False], True),
]


@pytest.mark.parametrize("model, path, body, accepted, refused_value", UNSUPPORTED,
                         ids=[f"{entry[0].__name__}-{entry[1]}" for entry in UNSUPPORTED])
def test_an_unsupported_option_passes_at_its_no_op_and_is_refused_otherwise(model, path, body, accepted, refused_value):
    for value in [None, *accepted]:
        assert isinstance(model.parse(body(value)), model), value
    error = refused(model, body(refused_value))
    assert error.param == path
    assert error.message.startswith(f"{path}: is not supported by this server (")
    assert error.message.endswith(f", got {refused_value!r}")


def test_false_is_not_the_no_op_zero():
    assert refused(CompletionRequest, {"prompt": "x", "presence_penalty": False}).param == "presence_penalty"


def test_the_logits_options_read_with_their_defaults():
    request = CompletionRequest.parse({"prompt": "x"})
    assert (request.presence_penalty, request.frequency_penalty, request.logit_bias, request.top_k, request.min_p,
            request.repetition_penalty, request.stop_token_ids, request.structured_outputs) == \
        (0.0, 0.0, {}, -1, 0.0, 1.0, [], None)
    chat = ChatRequest.parse({**CHAT, "logit_bias": {"5": 1}, "parallel_tool_calls": False, "tool_choice": "required",
                              "response_format": {"type": "json_object"}})
    assert (chat.logit_bias, chat.parallel_tool_calls, chat.tool_choice, chat.response_format.type) == \
        ({"5": 1.0}, False, "required", "json_object")


CHAT = {"messages": USER}
NESTED = [
    (ChatRequest, {**CHAT, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage", "must be true or false, got 'yes'"),
    (ChatRequest, {**CHAT, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats", None),
    (ChatRequest, {"messages": USER + ["hi"]}, "messages[1]", "must be an object, got 'hi'"),
    (ChatRequest, {"messages": [{**USER[0], "colour": "red"}]}, "messages[0].colour", None),
    (ChatRequest, {**CHAT, "tools": [{"type": "function", "function": {"name": 5}}]},
     "tools[0].function.name", "must be a non-empty string, got 5"),
    (ChatRequest, {**CHAT, "tools": [{"type": "function", "function": {"name": "add", "colour": 1}}]},
     "tools[0].function.colour", None),
    (ResponseRequest, {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input[0].content[0].text", "must be a string, got 5"),
    (ResponseRequest, {"input": [USER[0], {"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
     "input[1].arguments", "must be a string, got {}"),
    (ResponseRequest, {"input": [{"role": "robot", "content": "x"}]},
     "input[0].role", "must be user, system, developer or assistant, got 'robot'"),
    (ResponseRequest, {"input": [USER[0], {"type": "image"}]}, "input[1]",
     "unsupported item type 'image' (expected 'message', 'reasoning', 'function_call', 'function_call_output')"),
    (CompletionRequest, {"prompt": "x", "stop": ["a", ""]}, "stop[1]", "must not be empty, got ''"),
    (DetokenizeRequest, {"tokens": [1, 2.5]}, "tokens[1]", "must be an integer, got 2.5"),
]


@pytest.mark.parametrize("model, body, path, text", NESTED, ids=[entry[2] for entry in NESTED])
def test_an_error_inside_an_object_or_list_names_its_path(model, body, path, text):
    error = refused(model, body)
    assert error.param == path
    expected = f"unknown field {path!r}: this server does not read it; leave it out" if text is None else f"{path}: {text}"
    assert error.message == expected


def test_the_path_leaves_out_the_item_type_pydantic_files_errors_under():
    assert field_path(("input", 0, "item:message", "role")) == "input[0].role"
    assert field_path(("messages", 2, "function_call")) == "messages[2].function_call"   # a field named as an item type


def test_the_honoured_fields_keep_their_defaults_and_null_reads_as_the_default():
    for body in ({"prompt": "x"}, {"prompt": "x", "n": None, "temperature": None, "top_p": None, "stop": None,
                                   "stream": None, "echo": None, "max_tokens": None, "seed": None}):
        request = CompletionRequest.parse(body)
        assert (request.n, request.temperature, request.top_p, request.stop, request.stream, request.echo,
                request.max_tokens, request.logprobs, request.seed, request.include_usage) == \
            (1, 1.0, 1.0, [], False, False, None, None, None, False)
    chat = ChatRequest.parse({**CHAT, "top_logprobs": None, "logprobs": None})
    assert (chat.logprobs, chat.top_logprobs, chat.tools, chat.tool_choice) == (False, 0, None, None)
    response = ResponseRequest.parse({"input": "x", "store": None})
    assert response.store is True and response.max_output_tokens is None
    assert CompletionRequest.parse({"prompt": "x", "stop": "END"}).stop == ["END"]
    assert CompletionRequest.parse({"prompt": "x", "temperature": 0}).temperature == 0.0


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x", "n": 65}, "n: must be an integer in [1, 64], got 65"),
    ({"prompt": "x", "n": 4.0}, "n: must be an integer in [1, 64], got 4.0"),
    ({"prompt": "x", "n": True}, "n: must be an integer in [1, 64], got True"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens: must be an integer in [0, inf], got '5'"),
    ({"prompt": "x", "logprobs": 21}, "logprobs: must be an integer in [0, 20], got 21"),
    ({"prompt": "x", "temperature": 2.5}, "temperature: must be a number in [0.0, 2.0], got 2.5"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature: must be a number in [0.0, 2.0], got nan"),
    ({"prompt": "x", "top_p": 0}, "top_p: must be a number in (0.0, 1.0], got 0"),
    ({"prompt": "x", "seed": True}, "seed: must be an integer, got True"),
    ({"prompt": "x", "stream": "yes"}, "stream: must be true or false, got 'yes'"),
    ({"prompt": "x", "model": None}, "model: must be a string, got None"),
    ({"prompt": [1, True]}, "prompt: must be a string, a list of token ids, or a list of 1 to 1024 of either, got [1, True]"),
    ({"prompt": "x", "stop": ["s"] * 9}, "stop: must be a non-empty string or a list of at most 8 of them, got "
                                         "['s', 's', 's', 's', 's', 's', 's', 's', 's']"),
    ({}, "prompt: is required"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty: must be a number in [-2.0, 2.0], got 2.5"),
    ({"prompt": "x", "top_k": -2}, "top_k: must be an integer in [-1, inf], got -2"),
    ({"prompt": "x", "min_p": 1.5}, "min_p: must be a number in [0.0, 1.0], got 1.5"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty: must be a number in (0.0, 10.0], got 0"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias.5: must be a number in [-100.0, 100.0], got 101"),
    ({"prompt": "x", "stop_token_ids": [1.5]}, "stop_token_ids[0]: must be an integer, got 1.5"),
])
def test_the_honoured_fields_keep_their_ranges_and_strictness(body, message):
    error = refused(CompletionRequest, body)
    assert error.message == message and error.param == message.split(":")[0]


def test_tools_and_messages_reach_the_chat_format_as_sent():
    tools = [{"function": {"parameters": {"type": "object"}, "name": "add"}, "type": "function"}]
    messages = [{"content": "hi", "role": "user"}]
    request = ChatRequest.parse({"messages": messages, "tools": tools})
    assert request.tools == tools and list(request.tools[0]["function"]) == ["parameters", "name"]
    assert request.messages == messages and list(request.messages[0]) == ["content", "role"]
    assert ChatRequest.parse({"messages": messages, "tools": []}).tools == []


# -------------------------------------------------------------------- through the app
class Unreached:
    """The served model of an app whose every request here is refused before the model is read."""

    name = "m"

    def __getattr__(self, attribute):
        raise AssertionError(f"the model was read ({attribute}) for a request its checks refuse")


@pytest.fixture(scope="module")
def checks_only():
    from fastapi.testclient import TestClient

    from eval.serve.app import Server, create_app

    server = Server(Unreached(), None, None, api_key=None, request_timeout=10)
    with TestClient(create_app(server)) as client:
        yield client


@pytest.mark.parametrize("path", list(ROUTES))
def test_each_route_refuses_an_unknown_field_with_the_openai_error_body(checks_only, path):
    response = checks_only.post(path, json={**MINIMAL[ROUTES[path]], "foo": 1})
    assert response.status_code == 400
    assert response.json() == {"error": {"message": "unknown field 'foo': this server does not read it; leave it out",
                                         "type": "invalid_request_error", "param": "foo", "code": 400}}


REFUSED = [(path, body(value), name) for model, name, body, _, value in UNSUPPORTED
           for path in [next(p for p, m in ROUTES.items() if m is model)]] + [
    (path, body, name) for model, body, name, _ in NESTED for path in [next(p for p, m in ROUTES.items() if m is model)]]


@pytest.mark.parametrize("path, body, param", REFUSED, ids=[f"{p}-{name}" for p, _, name in REFUSED])
def test_no_refusal_is_a_422_and_each_names_its_param(checks_only, path, body, param):
    response = checks_only.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400 and param in error["message"]
    assert "\n" not in error["message"]


def test_the_body_checks_of_read_body_stay(checks_only):
    json_type = {"Content-Type": "application/json"}
    deep = checks_only.post("/v1/chat/completions", content=b"[" * 100000 + b"]" * 100000, headers=json_type)
    assert deep.status_code == 400
    assert deep.json()["error"]["message"] == "the request body nests deeper than 64 levels of objects and lists"
    malformed = checks_only.post("/v1/completions", content=b'{"prompt": ', headers=json_type)
    assert malformed.status_code == 400 and "not valid JSON" in malformed.json()["error"]["message"]
    listed = checks_only.post("/tokenize", json=["x"])
    assert listed.status_code == 400 and listed.json()["error"]["message"] == "the request body must be a JSON object"
    big = checks_only.post("/detokenize", content=b" " * (32 * 2**20 + 1), headers=json_type)
    assert big.status_code == 413


def test_the_model_is_checked_after_the_fields(checks_only):
    response = checks_only.post("/v1/completions", json={"prompt": "x", "model": "gpt-4", "n": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


# -------------------------------------------------------------------- accepted by the real server
def test_no_op_values_of_unsupported_options_are_served(serving):
    client, served, _ = serving
    chat = client.post("/v1/chat/completions", json={
        "messages": USER, "max_tokens": 2, "temperature": 0, "presence_penalty": 0, "frequency_penalty": 0.0,
        "logit_bias": {}, "parallel_tool_calls": True, "response_format": {"type": "text"}, "store": False,
        "user": "someone", "metadata": {"run": "test"}, "stream_options": {"include_usage": False}})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 2
    completion = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1, "best_of": 1, "suffix": "",
                                                      "top_k": -1, "min_p": 0, "repetition_penalty": 1})
    assert completion.status_code == 200 and len(completion.json()["choices"]) == 1
    response = client.post("/v1/responses", json={"input": "x", "max_output_tokens": 2, "stream": False,
                                                  "tool_choice": "auto", "truncation": "disabled", "store": False,
                                                  "metadata": {"run": "test"}})
    assert response.status_code == 200 and response.json()["metadata"] == {"run": "test"}
    tokens = client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False})    # lm-eval's request
    assert tokens.status_code == 200 and tokens.json()["tokens"] == served.encode("hi")
