"""No request can fail another: whatever one job's preparation, stop rule or finishing raises ends
that job alone with a JSON error while the others run to their end; what a request carries is
bounded (nesting, sizes, rows) before anything renders it; HTTP hygiene (Content-Type, Host, echoed
values, unexpected errors as a JSON 500)."""
import queue
import threading

import pytest

from eval.serve.engine import Engine, Job, Sequence, close_sessions
from eval.serve.errors import ServeError
from k3jax.sessions import Sampling, SessionStore
from tests.serve.test_api import USER, post
from tests.serve.test_engine import started_job, wait_for
from tests.sessions.conftest import random_tokens


@pytest.fixture(scope="module")
def store(serving):
    """A store of its own over the served model (so the compiled programs are shared)."""
    return SessionStore(serving[1].model)


def deep_schema(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def failing_job(where: str, error: Exception):
    """(job, events): one greedy sequence whose ``where`` (prepare, stopped, finish) raises ``error``
    -- after opening its session, so that the engine must close it."""
    events: queue.Queue = queue.Queue()

    def prepare(store):
        sid = store.open(random_tokens(1, 5))
        if where == "prepare":
            store.fork(sid)
            raise error
        return [Sequence(sid, Sampling(), 4)]

    def stopped(sequence):
        if where == "stopped":
            raise error
        return False

    def finish(store, sequences):
        if where == "finish":
            raise error
        close_sessions(store, sequences)
        return "done"
    return Job(prepare, finish, events.put, stopped=stopped), events


@pytest.mark.parametrize("where, error, status", [
    ("prepare", RecursionError("maximum recursion depth exceeded"), 400),
    ("prepare", KeyError("a bug"), 500),
    ("stopped", RecursionError("maximum recursion depth exceeded"), 400),
    ("finish", ValueError("tool call 0 arguments must be a JSON object"), 400),
    ("finish", TypeError("a bug"), 500),
])
def test_an_error_in_one_jobs_work_ends_that_job_alone(store, where, error, status):
    engine = Engine(store)
    try:
        before, long, long_events = started_job(engine, 40)
        bad, bad_events = failing_job(where, error)
        engine.submit(bad)
        answer = wait_for(bad_events, "result", timeout=60)
        assert answer[0] == "error" and answer[1].status == status, answer
        result = wait_for(long_events, "result")
        assert result[0] == "result" and len(result[1][0]) == 40        # the other job ran to its end
        assert engine.call(lambda store: store.sessions()).result() == before   # nothing left open
    finally:
        engine.shutdown(5)


def test_a_job_with_more_rows_than_max_batch_is_refused_at_submit(store):
    engine = Engine(store, max_batch=4)
    try:
        with pytest.raises(ServeError) as refused:
            engine.submit(Job(None, None, None, sequences=5))
        assert refused.value.status == 400 and "at most 4" in refused.value.message
    finally:
        engine.shutdown(1)


def test_a_deeply_nested_tool_schema_is_a_400_naming_it_while_others_run(serving):
    """The audit's critical case: a 1,500-level schema raised RecursionError on the engine thread."""
    client, _, _ = serving
    results = {}
    running = threading.Thread(target=lambda: results.setdefault("long", client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 60, "ignore_eos": True})))
    running.start()
    for path, tools in [("/v1/responses", [{"type": "function", "name": "f", "parameters": deep_schema(750)}]),
                        ("/v1/chat/completions", [{"type": "function", "function": {"name": "f", "parameters":
                                                                                     deep_schema(750)}}]),
                        ("/tokenize", [{"type": "function", "function": {"name": "f", "parameters": deep_schema(750)}}])]:
        body = {"input": "hi"} if path == "/v1/responses" else {"messages": USER}
        response = client.post(path, json={**body, "tools": tools})
        assert response.status_code == 400 and response.headers["content-type"] == "application/json", response.text
        error = response.json()["error"]
        assert "nests deeper than 64 levels" in error["message"] and error["param"].startswith("tools[0].")
    running.join()
    assert results["long"].status_code == 200 and results["long"].json()["usage"]["completion_tokens"] == 60


def test_deep_json_inside_a_string_is_rendered_as_raw_text(serving):
    """Tool call arguments too deep for ``json.loads`` (which the body check cannot see inside a
    string) render as raw text, as arguments that are not JSON do: no RecursionError escapes."""
    client, served, _ = serving
    arguments = "[" * 5000 + "]" * 5000
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]
    count = post(client, "/tokenize", {"messages": messages})["count"]
    assert count > 10_000
    response = client.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 400 and "maximum context length" in response.json()["error"]["message"]


BOUNDED = [
    ("/v1/responses", {"input": "x" * 300}, 400, "maximum context length is 256"),   # was: 300 tokens prefilled, 200
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 3}, 400, "decodes at most 8 together"),
    ("/tokenize", {"prompt": "x" * (256 * 64 + 1)}, 400, "cannot fit"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f",
                                                                                        "parameters": "nope"}}]},
     400, "tools[0].function.parameters: must be an object"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": "nope"}]},
     400, "tools[0].parameters: must be an object"),
    ("/v1/chat/completions", {"messages": USER * 5000}, 400, "at most 4096"),
]


@pytest.mark.parametrize("path, body, status, words", BOUNDED, ids=[f"{i:02d}" for i in range(len(BOUNDED))])
def test_what_a_request_carries_is_bounded(serving, path, body, status, words):
    client, _, _ = serving
    response = client.post(path, json=body)
    assert response.status_code == status and words in response.json()["error"]["message"], response.text


def test_http_hygiene_content_type_echoes_and_unexpected_errors(serving, monkeypatch):
    client, served, _ = serving
    plain = client.post("/v1/completions", content=b'{"prompt": "x"}', headers={"Content-Type": "text/plain"})
    assert plain.status_code == 415 and plain.json()["error"]["param"] == "Content-Type"
    charset = client.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": 1}',
                          headers={"Content-Type": "application/json; charset=utf-8"})
    assert charset.status_code == 200
    huge = "resp_" + "0" * 60_000
    for response in (client.get(f"/v1/responses/{huge}"), client.post("/v1/responses", json={
            "input": "x", "previous_response_id": huge}), client.post("/v1/completions", json={"prompt": "x", "model": huge})):
        assert response.status_code == 404 and len(response.text) < 600, response.text[:200]
    monkeypatch.setattr(served, "decode", lambda ids: 1 / 0)        # a bug in a route
    broken = client.post("/detokenize", json={"tokens": [1]})
    assert broken.status_code == 500 and broken.json()["error"]["message"] == "internal error: ZeroDivisionError"
    monkeypatch.undo()
    assert post(client, "/detokenize", {"tokens": [104, 105]})["prompt"] == "hi"


def test_allowed_hosts_refuse_another_host_header(chat_run):
    from fastapi.testclient import TestClient

    from eval.serve.cli import build, parse_args

    app, _, _ = build(parse_args([str(chat_run), "--allowed-hosts", "localhost,127.0.0.1", "--max-model-len", "64"]))
    with TestClient(app, base_url="http://localhost:8000") as client:
        assert client.get("/health").status_code == 200
        assert client.get("/health", headers={"Host": "127.0.0.1:8000"}).status_code == 200
        refused = client.get("/health", headers={"Host": "evil.example"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "Host"


def test_a_request_of_many_prompts_checks_its_deadline_between_them(serving):
    """Its prefills stop at the deadline (a 504) instead of holding the engine for all of them."""
    import time

    from eval.serve.completions import CompletionPlan

    class SlowStore:                      # each prefill takes 0.1 s
        opened = 0

        def open(self, prompt):
            time.sleep(0.1)
            SlowStore.opened += 1
            return SlowStore.opened

        def stats(self):                  # read around each open: the prompt tokens the cache resumed
            return {"prefix_tokens_reused": 0}

    plan = CompletionPlan(serving[1], {"prompt": ["a"] * 8, "max_tokens": 1})
    plan.job(lambda event: None, time.monotonic() + 0.25)
    with pytest.raises(ServeError) as late:
        plan.prepare(SlowStore())
    assert late.value.status == 504 and SlowStore.opened == 3


def test_a_client_leaving_mid_upload_is_a_499_not_a_500():
    import asyncio

    from starlette.requests import Request

    from eval.serve.server import read_body

    messages = [{"type": "http.request", "body": b'{"prompt": ', "more_body": True}, {"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [
        (b"content-type", b"application/json")]}
    with pytest.raises(ServeError) as left:
        asyncio.run(read_body(Request(scope, receive)))
    assert left.value.status == 499
