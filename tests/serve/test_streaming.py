"""Streamed replies read in linear time (`k3jax.data.chat_format.ReplyReader`, `eval.serve.params`):
the pieces join to the whole decode and the plain reply, with characters and markup split across
tokens; streamed ``/v1/responses`` through the official ``openai`` client; per-request thinking and
effort; usage details."""
import json
import random
import typing

import pytest

from k3jax.data import ByteTokenizer, load_tokenizer
from k3jax.data.chat_format import ChatEncoder, ReplyReader, generation_prompt, render_conversation, reply_segments
from k3jax.data.tokenizers import TextDecoder
from eval.serve.params import HeldText, StopFinder
from tests.data.chat_tokenizer import write_chat_tokenizer
from tests.serve.conftest import KEY

USER = [{"role": "user", "content": "3 QWERTY"}]
TRICKY = "é€😀 a<b> &quot; <|sep|> 中文"      # multi-byte characters, markup-like text


def test_text_decoder_equals_the_whole_decode_for_split_and_invalid_bytes():
    tokenizer, rng = ByteTokenizer(), random.Random(0)
    pool = list("€😀é".encode()) + [0xFF, 0xC3, 0xED, 0xA0, 0x61]
    for _ in range(2000):
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 12))]
        decoder = TextDecoder(tokenizer.token_bytes)
        pieces = [decoder.feed(token) for token in ids]
        assert "".join(pieces) + decoder.flush() == bytes(ids).decode("utf-8", "replace")   # Python's own decode


@pytest.mark.parametrize("thinking", [True, False])
def test_reply_reader_streams_each_channel_exactly(tmp_path, thinking):
    """Byte-level tokens split every multi-byte character and every tag header across tokens."""
    encoder = ChatEncoder(load_tokenizer(write_chat_tokenizer(tmp_path)))
    message = {"role": "assistant", "reasoning_content": "think " + TRICKY, "content": "say " + TRICKY,
               "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": json.dumps({"q": TRICKY})}}]}
    ids = encoder.encode(reply_segments(message, thinking))[0].tolist()
    for cut in (len(ids), len(ids) - 7, len(ids) // 2, 3):        # whole, and cut short anywhere
        reader = ReplyReader(encoder, thinking)
        streamed = [reader.feed(token) for token in ids[:cut]] + [reader.close()]
        whole = encoder.parse_reply(ids[:cut], thinking)
        assert "".join(r for r, _ in streamed) == whole.reasoning and "".join(c for _, c in streamed) == whole.content
        assert reader.reply == whole
    whole = encoder.parse_reply(ids, thinking)
    assert whole.content == message["content"] and whole.reasoning == (message["reasoning_content"] if thinking else "")
    assert whole.tool_calls == [{"name": "f", "arguments": {"q": TRICKY}}]
    assert whole.reasoning_tokens == (len(message["reasoning_content"].encode()) if thinking else 0)


def test_stop_finder_and_held_text_equal_a_search_of_the_whole_text_so_far():
    rng = random.Random(1)
    for _ in range(3000):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 20)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        expected = None                  # a search of the whole text so far, after each piece
        for end in range(len(pieces)):
            so_far = "".join(pieces[: end + 1])
            found = [i for i in (so_far.find(stop) for stop in stops) if i >= 0]
            if found:
                expected = min(found)
                break
        finder, held, seen = StopFinder(stops), HeldText(stops), None
        sent = ""
        for number, piece in enumerate(pieces):
            at = finder.feed(piece)
            seen = at if seen is None else seen
            sent += held.push(piece, final=number == len(pieces) - 1)
        assert seen == expected, (text, stops, pieces)
        assert sent == (text if expected is None else text[:expected])
        assert StopFinder(stops).feed(text) == min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)


def test_streamed_chat_with_a_stop_string_equals_the_plain_reply(serving):
    client, _, _ = serving
    for seed in range(20):              # an untrained model: a seed whose reply has some content
        request = {"messages": USER, "max_tokens": 48, "temperature": 1.0, "seed": seed,
                   "chat_template_kwargs": {"thinking": False}}
        text = client.post("/v1/chat/completions", json=request).json()["choices"][0]["message"]["content"] or ""
        if len(text) > 4:
            break
    stop = text[2:4]
    plain = client.post("/v1/chat/completions", json={**request, "stop": stop}).json()["choices"][0]
    assert plain["message"]["content"] == text[: text.find(stop)] and plain["finish_reason"] == "stop"
    streamed = ""
    with client.stream("POST", "/v1/chat/completions", json={**request, "stop": stop, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    assert streamed == plain["message"]["content"]


def test_reasoning_effort_and_thinking_are_rendered_per_request(serving):
    """The prompt a request is answered from is K3's rendering with its thinking and effort (the
    effort note does not fit this tiny server's 256-token context: its 400 names the prompt's length)."""
    client, served, _ = serving
    encoder = served.chat.encoder

    def prompt(thinking, effort):
        return encoder.encode(render_conversation(USER, thinking=thinking, thinking_effort=effort)
                              + generation_prompt(thinking))[0].tolist()
    for path, body, thinking, effort in [
            ("/v1/chat/completions", {"reasoning_effort": "high"}, True, "high"),
            ("/v1/chat/completions", {"chat_template_kwargs": {"thinking_effort": "low"}}, True, "low"),
            ("/v1/chat/completions", {"reasoning_effort": "none"}, False, None),
            ("/v1/chat/completions", {"chat_template_kwargs": {"thinking": False}}, False, None),
            ("/v1/chat/completions", {}, True, None),                  # the run's: thinking, no effort note
            ("/v1/responses", {"reasoning": {"effort": "max"}}, True, "max"),
            ("/v1/responses", {"reasoning": {"effort": "none"}}, False, None)]:
        request = {"messages": USER} if path.endswith("completions") else {"input": USER[0]["content"]}
        reply = client.post(path, json={**request, "max_tokens" if "messages" in request else "max_output_tokens": 1,
                                        "temperature": 0, **body})
        expected = len(prompt(thinking, effort))
        if "chat_template_kwargs" in body:       # /tokenize renders them as chat does
            tokens = client.post("/tokenize", json={"messages": USER, **body}).json()["tokens"]
            assert tokens == prompt(thinking, effort)
        if expected >= served.max_model_len:
            assert reply.status_code == 400 and f"({expected} in the prompt" in reply.json()["error"]["message"]
            continue
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        assert usage.get("prompt_tokens", usage.get("input_tokens")) == expected, body
        if path.endswith("completions"):
            assert ("reasoning_content" in reply.json()["choices"][0]["message"]) == thinking
        else:
            assert reply.json()["reasoning"]["effort"] == "none"


def openai_client(client):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key=KEY, http_client=client)


def test_streamed_responses_build_the_stored_response(serving):
    """Through the official client: the events' deltas join to the stored response's texts, every
    event is numbered in order, and the completed response is the one stored (and the one a plain
    request with the same seed gives)."""
    client, served, _ = serving
    api = openai_client(client)
    request = {"model": served.name, "input": "3 QWERTY", "max_output_tokens": 40, "temperature": 1.0}
    events = list(api.responses.create(stream=True, **request, extra_body={"seed": 11}))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed",
                                                                                     "response.incomplete")
    final = events[-1].response
    stored = client.get(f"/v1/responses/{final.id}").json()
    assert final.to_dict() == stored                    # the event carries the stored response as it is
    texts = {"response.reasoning_text.delta": "", "response.output_text.delta": ""}
    for event in events:
        if event.type in texts:
            texts[event.type] += event.delta
    by_type = {item["type"]: item for item in stored["output"]}
    assert texts["response.output_text.delta"] == by_type.get("message", {"content": [{"text": ""}]})["content"][0]["text"]
    assert texts["response.reasoning_text.delta"] == (by_type["reasoning"]["content"][0]["text"] if "reasoning" in by_type else "")
    plain = client.post("/v1/responses", json={**request, "seed": 11}).json()
    assert [item["type"] for item in plain["output"]] == [item["type"] for item in stored["output"]]
    assert [item.get("content") for item in plain["output"]] == [item.get("content") for item in stored["output"]]
    assert plain["usage"]["output_tokens"] == stored["usage"]["output_tokens"]
    details = stored["usage"]["output_tokens_details"]
    assert 0 < details["reasoning_tokens"] <= stored["usage"]["output_tokens"] if texts["response.reasoning_text.delta"] \
        else details["reasoning_tokens"] == 0

    with api.responses.stream(**request, extra_body={"seed": 11}) as stream:   # its accumulator checks each item
        helped = list(stream)
        if helped[-1].type == "response.completed":          # (its final response needs a completed one)
            assert stream.get_final_response().output_text == texts["response.output_text.delta"]
    assert [event.type for event in helped] == kinds


def test_metrics_have_the_latency_histograms_and_the_old_counters(serving):
    client, _, _ = serving
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "temperature": 0})
    text = client.get("/metrics").text
    for name in ("k3jax_requests_total", "k3jax_generation_tokens_total", "k3jax_prefix_cache_hits_total",
                 "k3jax_time_to_first_token_seconds_count", "k3jax_inter_token_latency_seconds_bucket",
                 "k3jax_e2e_request_latency_seconds_sum"):
        assert name in text, name
    count = float(next(line.split()[-1] for line in text.splitlines()
                       if line.startswith("k3jax_e2e_request_latency_seconds_count")))
    assert count >= 1


def test_cors_is_off_by_default_and_answers_the_allowed_origins(chat_run):
    from fastapi.testclient import TestClient

    from eval.serve.cli import build, parse_args

    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    for extra, allowed in (([], False), (["--allowed-origins", "http://app.example"], True)):
        app, _, _ = build(parse_args([str(chat_run), "--api-key", KEY, "--max-model-len", "256", *extra]))
        with TestClient(app) as client:
            response = client.options("/v1/chat/completions", headers=preflight)
            assert (response.headers.get("access-control-allow-origin") == "http://app.example") == allowed
            assert (response.status_code == 200) == allowed


def test_a_streamed_response_that_fails_ends_with_response_failed(serving):
    client, _, _ = serving
    events = []
    with client.stream("POST", "/v1/responses", json={"input": "x", "stream": True,
                                                      "previous_response_id": "resp_" + "0" * 32}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    for name, data in zip(lines[::2], lines[1::2]):
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    assert [event["type"] for event in events] == ["response.created", "response.in_progress", "response.failed"]
    assert [event["sequence_number"] for event in events] == [0, 1, 2]
    types = pytest.importorskip("openai.types.responses")
    types.ResponseFailedEvent.model_validate(events[-1])          # the official type, every field
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "no stored response" in failed["error"]["message"]
    assert client.post("/v1/responses", json={"input": "x", "max_output_tokens": 1}).status_code == 200   # serving on


def test_response_events_of_a_reply_with_a_tool_call_are_the_official_types(serving):
    """A canned reply (reasoning, content, a tool call; every character split across byte tokens)
    through `ResponseEvents`: each event validates as the ``openai`` client's `ResponseStreamEvent`,
    the deltas join to the items' texts and arguments, and every item of the body is added and done
    at its own output index, in order."""
    types = pytest.importorskip("openai.types.responses")
    from eval.serve.completions import tool_calls
    from eval.serve.engine import Sequence
    from eval.serve.responses import ResponseEvents, ResponsePlan

    _, served, server = serving
    message = {"role": "assistant", "reasoning_content": "think " + TRICKY, "content": "say " + TRICKY,
               "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": "é"}'}}]}
    ids = served.chat.encoder.encode(reply_segments(message, True))[0].tolist()
    plan = ResponsePlan(served, {"input": "x", "tools": [{"type": "function", "name": "add"}]}, server.responses)
    state = ResponseEvents(plan)
    events = state.opening() + [event for token in ids for event in state.on(("token", 0, token, None))]
    events += state.on(("end", 0, "stop"))
    reader = plan.reader()
    for token in ids:
        reader.feed(token)
    reader.close()
    sequence = Sequence(0, None, 100, tokens=ids, finish_reason="stop")
    body = plan.body(reader.reply, reader.order, tool_calls(reader.reply.tool_calls), sequence)
    events += state.on(("result", body))
    union = typing.get_args(types.ResponseStreamEvent)[0]          # Annotated[Union[...], discriminator]
    kinds = {typing.get_args(model.model_fields["type"].annotation)[0]: model for model in typing.get_args(union)}
    for event in events:
        kinds[event["type"]].model_validate(event)      # the official type of its kind, every field
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert [item["type"] for item in body["output"]] == ["reasoning", "message", "function_call"]
    added = [(e["output_index"], e["item"]["id"]) for e in events if e["type"] == "response.output_item.added"]
    done = [(e["output_index"], e["item"]) for e in events if e["type"] == "response.output_item.done"]
    assert added == [(index, item["id"]) for index, item in enumerate(body["output"])]
    assert done == list(enumerate(body["output"]))
    joined = {kind: "".join(e.get("delta", "") for e in events if e["type"] == kind)
              for kind in ("response.reasoning_text.delta", "response.output_text.delta",
                           "response.function_call_arguments.delta")}
    assert joined == {"response.reasoning_text.delta": message["reasoning_content"],
                      "response.output_text.delta": message["content"],
                      "response.function_call_arguments.delta": json.dumps({"a": 1, "b": "é"}, ensure_ascii=False)}
    assert events[-1]["type"] == "response.completed" and events[-1]["response"] is body
