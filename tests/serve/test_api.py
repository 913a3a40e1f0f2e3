"""The server's routes in this process (`fastapi.testclient`), against independent references: the
model's full forward over the whole history (log-probs, greedy tokens), `k3jax.inference.generation`, the chat
format's rendering; statefulness (previous_response_id = the whole history), fork / rollback /
delete, continuous batching, and every bad input a 4xx that leaves the server serving."""
import json
import threading

import numpy as np
import pytest

from k3jax.inference import load_run
from k3jax.data.chat_format import reply_segments
from k3jax.inference.generation import generate
from tests.serve.conftest import KEY

USER = [{"role": "user", "content": "3 QWERTY"}]
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def reference(chat_run):
    """The checkpoint's model, restored independently of the server."""
    return load_run(str(chat_run)).model


def log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def full_forward_logprobs(model, tokens) -> np.ndarray:
    """log p(tokens[t] | tokens[:t]) for t >= 1, from one forward pass over the whole sequence."""
    logits = np.asarray(model(np.asarray(tokens, np.int32)[None]).logits[0])
    return log_softmax(logits[:-1])[np.arange(len(tokens) - 1), np.asarray(tokens[1:])]


def post(client, path, body, status=200):
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    return response.json()


def test_models_health_and_the_api_key(serving, chat_run):
    client, served, _ = serving
    assert post.__name__ and client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [chat_run.name] == [served.name]
    for headers in ({"Authorization": "Bearer wrong"}, {"Authorization": ""}):
        refused = client.get("/v1/models", headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert client.get("/health", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_greedy_completion_equals_generate_and_its_logprobs_the_full_forward(serving, reference):
    client, served, _ = serving
    prompt = served.encode("hello there")
    body = post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2,
                                            "ignore_eos": True})
    expected = np.asarray(generate(reference, prompt, max_new_tokens=6).tokens).tolist()
    (choice,) = body["choices"]
    assert choice["text"] == served.decode(expected) and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [served.piece(t) for t in expected]
    np.testing.assert_allclose(logprobs["token_logprobs"], full_forward_logprobs(reference, prompt + expected)[-6:],
                               rtol=0, atol=2e-5)
    for token_logprob, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert max(top.values()) == pytest.approx(token_logprob, abs=1e-9)     # greedy: the token is the top one
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 6, "total_tokens": len(prompt) + 6,
                             "prompt_tokens_details": {"cached_tokens": 0},    # echo scores every position: no reuse
                             "completion_tokens_details": {"reasoning_tokens": 0}}


def test_echo_scores_the_prompt_like_the_full_forward(serving, reference):
    client, served, _ = serving
    prompts = [served.encode("the cat sat"), served.encode("a dog")]
    body = post(client, "/v1/completions", {"prompt": prompts, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                                            "echo": True})
    for choice, prompt in zip(body["choices"], prompts):
        scores = choice["logprobs"]["token_logprobs"]
        assert scores[0] is None and len(scores) == len(prompt) + 1
        np.testing.assert_allclose(scores[1:-1], full_forward_logprobs(reference, prompt), rtol=0, atol=2e-5)
        assert choice["text"].startswith(served.decode(prompt))


def test_seeded_sampling_repeats_and_each_choice_is_its_own_stream(serving):
    client, _, _ = serving
    request = {"prompt": "abc", "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 3, "ignore_eos": True}
    first, again = post(client, "/v1/completions", request), post(client, "/v1/completions", request)
    texts = [c["text"] for c in first["choices"]]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) == 3
    other = post(client, "/v1/completions", {**request, "seed": 6})
    assert [c["text"] for c in other["choices"]] != texts


def test_stop_strings_cut_the_text(serving):
    client, _, _ = serving
    request = {"prompt": "abc", "max_tokens": 12, "temperature": 1.0, "seed": 1, "ignore_eos": True}
    text = post(client, "/v1/completions", request)["choices"][0]["text"]
    stop = text[3:5]
    assert stop and text.find(stop) == 3, text
    cut = post(client, "/v1/completions", {**request, "stop": [stop]})["choices"][0]
    assert cut["text"] == text[:3] and cut["finish_reason"] == "stop"


def stream_events(client, path, body) -> list[dict]:
    events = []
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def test_streamed_chat_equals_the_plain_reply(serving):
    client, _, _ = serving
    request = {"messages": USER, "max_tokens": 12, "temperature": 0.8, "seed": 3}
    plain = post(client, "/v1/chat/completions", request)
    (choice,) = plain["choices"]
    chunks = stream_events(client, "/v1/chat/completions", {**request, "stream_options": {"include_usage": True}})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"])
    assert text == (choice["message"]["content"] or "") and reasoning == choice["message"]["reasoning_content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == choice["finish_reason"]
    usage = chunks[-1]["usage"]          # the plain reply left its prompt in the prefix cache: resumed from there
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
    assert {**usage, "prompt_tokens_details": None} == {**plain["usage"], "prompt_tokens_details": None}
    streamed = stream_events(client, "/v1/completions", {"prompt": "abc", "max_tokens": 5, "temperature": 0})
    assert "".join(c["choices"][0]["text"] for c in streamed) == \
        post(client, "/v1/completions", {"prompt": "abc", "max_tokens": 5, "temperature": 0})["choices"][0]["text"]


def test_a_reply_with_tool_calls_becomes_openai_tool_calls_without_markup(serving):
    from eval.serve.completions import ChatPlan

    _, served, _ = serving
    message = {"role": "assistant", "reasoning_content": "use the tool", "content": "",
               "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": "x"}'}}]}
    ids = served.chat.encoder.encode(reply_segments(message, True))[0].tolist()
    plan = ChatPlan(served, {"messages": USER, "tools": [{"type": "function", "function": {"name": "add"}}]})
    reply, reason = plan.message(served.chat.encoder.parse_reply(ids), "stop")
    assert reason == "tool_calls" and reply["content"] is None and reply["reasoning_content"] == "use the tool"
    (call,) = reply["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 3, "b": "x"}
    cut, reason = plan.message(served.chat.encoder.parse_reply(ids[:-9]), "length")
    assert reason == "length" and "<|" not in json.dumps(cut)


def responses(client, **body):
    return post(client, "/v1/responses", {"max_output_tokens": 10, "temperature": 0, **body})


def output_text(response) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


def first_message(response) -> dict:
    """The assistant message a response's output items write (as its stored session renders it)."""
    output = response["output"]
    message = {"role": "assistant", "content": output_text(response),
               "reasoning_content": "".join(part["text"] for item in output if item["type"] == "reasoning"
                                            for part in item["content"])}
    calls = [{"type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return {**message, "tool_calls": calls} if calls else message


def prefilled(client) -> int:
    line = [l for l in client.get("/metrics").text.splitlines() if l.startswith("k3jax_prefill_tokens_total")]
    return int(float(line[0].split()[-1]))


def test_previous_response_id_equals_the_whole_history_without_prefilling_it(serving):
    client, served, _ = serving
    first = responses(client, input="3 QWERTY")
    before = prefilled(client)
    turn = [{"role": "user", "content": "and again"}]
    continued = responses(client, input=turn, previous_response_id=first["id"])
    new_tokens = prefilled(client) - before
    whole = responses(client, input=[{"role": "user", "content": "3 QWERTY"}, *first["output"], *turn], store=False)
    details = "input_tokens_details"           # what each resumed: the stored session, the prefix cache
    assert output_text(continued) == output_text(whole)
    assert {**continued["usage"], details: None} == {**whole["usage"], details: None}
    stored = served.chat.encoder.encode(reply_segments(first_message(first), True))[0]
    assert continued["usage"][details]["cached_tokens"] == first["usage"]["input_tokens"] + len(stored)
    assert new_tokens < continued["usage"]["input_tokens"] - first["usage"]["input_tokens"] + 8, new_tokens
    assert client.get(f"/v1/responses/{continued['id']}").json()["id"] == continued["id"]


def test_branches_rollback_fork_and_delete(serving):
    client, _, _ = serving
    root = responses(client, input="1 ABC")
    left = responses(client, input="left", previous_response_id=root["id"], temperature=1.0, seed=1)
    right = responses(client, input="right", previous_response_id=root["id"], temperature=1.0, seed=1)  # rollback
    again = responses(client, input="left", previous_response_id=root["id"], temperature=1.0, seed=1)
    assert output_text(again) == output_text(left)                     # the root is unchanged by its branches
    fork = client.post(f"/v1/responses/{root['id']}/fork").json()
    assert fork["forked_from"] == root["id"] and fork["id"] != root["id"]
    from_fork = responses(client, input="left", previous_response_id=fork["id"], temperature=1.0, seed=1)
    assert output_text(from_fork) == output_text(left)
    assert client.delete(f"/v1/responses/{left['id']}").json() == {"id": left["id"], "object": "response",
                                                                   "deleted": True}
    gone = client.get(f"/v1/responses/{left['id']}")
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
    assert client.get(f"/v1/responses/{right['id']}").status_code == 200


def test_concurrent_requests_decode_together_and_equal_their_solo_results(serving):
    client, _, server = serving
    requests = [{"prompt": f"prompt {i}", "max_tokens": 16, "temperature": 1.0, "seed": i, "ignore_eos": True}
                for i in range(4)]
    solo = [post(client, "/v1/completions", r)["choices"][0]["text"] for r in requests]
    steps = server.engine.counters["decode_steps"]
    results = [None] * 4
    barrier = threading.Barrier(4)

    def send(index):
        barrier.wait()
        results[index] = post(client, "/v1/completions", requests[index])["choices"][0]["text"]
    threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == solo
    assert server.engine.counters["decode_steps"] - steps < 4 * 16      # some steps served several requests


def test_tokenizer_endpoints_use_the_models_tokenizer(serving):
    client, served, _ = serving
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|end_of_msg|>" and info["model_max_length"] == 256
    tokens = post(client, "/tokenize", {"prompt": "hi<|end_of_msg|>"})["tokens"]
    assert tokens == served.tokenizer.encode("hi") + [served.specials["<|end_of_msg|>"]]
    assert post(client, "/detokenize", {"tokens": tokens})["prompt"] == "hi"
    chat = post(client, "/tokenize", {"messages": USER})
    assert chat["tokens"] == served.chat_prompt(USER, None).tolist() and chat["count"] == len(chat["tokens"])


BAD = [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", [1, 2], 400, "must be a JSON object"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/completions", {}, 400, "prompt: is required"),
    ("/v1/completions", {"prompt": "x" * 300}, 400, "maximum context length is 256"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 300}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": [5, 9999]}, 400, "outside [0, 512)"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt: must be"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n: must be an integer"),
    ("/v1/completions", b'{"prompt": "x", "temperature": Infinity}', 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "seed": "s"}, 400, "seed"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "unknown role"),
    ("/v1/chat/completions", {"messages": USER, "tools": "add"}, 400, "tools"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "message 0 has no content"),
    ("/tokenize", {"messages": [{"role": "user", "content": 5}]}, 400, "content must be"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": ""}}]}, 400, "tools"),
    ("/tokenize", {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 3}, 400, "needs logprobs"),
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_" + "0" * 32}, 404, "no stored response"),
    ("/v1/responses", {"input": "x", "previous_response_id": "../../etc/passwd"}, 404, "no stored response"),
    ("/v1/responses", {"input": [{"type": "image"}]}, 400, "unsupported item type"),
    ("/v1/responses", {"input": "x", "stream": "yes"}, 400, "stream: must be true or false"),
    ("/v1/chat/completions", {"messages": USER, "reasoning_effort": "medium"}, 400, "reasoning_effort: must be none"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"thinking": False}, "reasoning_effort": "low"},
     400, "needs thinking"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"enable_thinking": True}}, 400,
     "chat_template_kwargs.enable_thinking"),
    ("/v1/responses", {"input": "x", "reasoning": {"effort": "minimal"}}, 400, "reasoning.effort"),
    ("/v1/responses", {"input": "x", "reasoning": {"summary": "auto"}}, 400, "reasoning.summary"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "outside"),
]


@pytest.mark.parametrize("path, body, status, words", BAD, ids=[f"{i:02d}" for i in range(len(BAD))])
def test_bad_requests_get_an_openai_error_and_the_server_keeps_serving(serving, path, body, status, words):
    client, _, _ = serving
    response = client.post(path, content=body, headers=JSON) if isinstance(body, bytes) else client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] and set(error) == {"message", "type", "param", "code"}


def test_unknown_routes_and_methods_and_the_serving_after_bad_input(serving):
    client, _, _ = serving
    assert client.get("/v1/nothing").status_code == 404
    assert client.get("/v1/completions").status_code == 405
    assert client.delete("/v1/responses/resp_nope").status_code == 404
    assert post(client, "/v1/completions", {"prompt": "x", "max_tokens": 1})["choices"][0]["finish_reason"]
    text = client.get("/metrics").text
    assert 'k3jax_requests_total{route="/v1/completions",status="400"}' in text
    assert "k3jax_prefix_cache_hit_rate" in text and 'k3jax_tier_bytes{tier="device"}' in text
