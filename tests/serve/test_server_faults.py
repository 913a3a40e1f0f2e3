"""``python -m eval.serve`` under faults, as a process: a deeply nested body is a JSON 400 and the
same keep-alive connection goes on serving; a kill -9 loses no acknowledged stored response (the
restart continues each exactly as the killed server would have); SIGTERM ends an open stream with
an error event and ``[DONE]`` after the drain."""
import http.client
import json
import os
import signal
import time
import urllib.parse

import pytest

from tests.serve.test_server_process import KEY, ServerProcess

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow      # starts servers in subprocesses

HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def connection(server) -> http.client.HTTPConnection:
    parts = urllib.parse.urlparse(server.url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)


def deep_tools(levels: int) -> str:
    """Tools whose schema nests ``levels`` objects: 1,500 decode as JSON but exhausted the recursion
    of the chat format's rendering (before: a text/plain 500, then a reset keep-alive connection)."""
    schema = '{"a": ' * levels + "1" + "}" * levels
    return '[{"type": "function", "function": {"name": "f", "parameters": ' + schema + "}}]"


def test_nesting_keep_alive_kill_9_and_sigterm_streams(plain_chat_run, tmp_path, xla_cache):
    state = tmp_path / "state"
    flags = ("--api-key", KEY, "--state-dir", state, "--max-model-len", "2048", "--drain-seconds", "1")
    server = ServerProcess(xla_cache, plain_chat_run, *flags)
    try:
        link = connection(server)                  # one keep-alive connection for all of these
        for body in ('{"messages": [{"role": "user", "content": "x"}], "tools": ' + deep_tools(1500) + "}",
                     '{"messages": ' + "[" * 5000 + "]" * 5000 + "}"):
            for path in ("/v1/chat/completions", "/tokenize"):
                link.request("POST", path, body=body, headers=HEADERS)
                response = link.getresponse()
                answer = response.read()
                assert response.status == 400 and response.getheader("content-type") == "application/json", answer
                assert b"nests deeper than 64 levels" in answer
        link.request("GET", "/v1/models", headers=HEADERS)
        assert link.getresponse().status == 200                               # the connection still serves

        client = server.client()
        acknowledged = [client.responses.create(model=server.name, input=f"{i} QWERTY", max_output_tokens=6,
                                                temperature=0) for i in range(3)]
        expected = {first.id: client.responses.create(model=server.name, input="again", previous_response_id=first.id,
                                                      max_output_tokens=8, temperature=0, store=False).output_text
                    for first in acknowledged}
    finally:
        server.process.send_signal(signal.SIGKILL)                            # no drain, no save
        server.process.wait(timeout=60)
    assert not (state / "state.json").exists()
    (state / "tier" / "value-0123abcd.npz").write_bytes(b"a spill file of the killed server")

    again = ServerProcess(xla_cache, plain_chat_run, *flags)
    try:
        client = again.client()
        for first in acknowledged:                                            # every acknowledged one, exactly
            assert client.responses.retrieve(first.id).id == first.id
            continued = client.responses.create(model=again.name, input="again", previous_response_id=first.id,
                                                max_output_tokens=8, temperature=0, store=False)
            assert continued.output_text == expected[first.id]
        assert not (state / "tier" / "value-0123abcd.npz").exists()

        link = connection(again)
        link.request("POST", "/v1/completions", headers=HEADERS, body=json.dumps(
            {"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True, "temperature": 1.0}))
        stream = link.getresponse()
        assert stream.status == 200
        first_line = stream.readline()
        assert first_line.startswith(b"data: ")
        started = time.monotonic()
        again.process.send_signal(signal.SIGTERM)
        events = [line.strip() for line in stream.read().split(b"\n") if line.strip()]
        assert time.monotonic() - started < 30
    finally:
        code = again.stop()
    assert events[-1] == b"data: [DONE]", events[-3:]
    ended = json.loads(events[-2].removeprefix(b"data: "))
    assert ended["error"]["code"] == 503 and "shut down" in ended["error"]["message"], ended
    assert code == -signal.SIGTERM, "".join(again.lines)
    assert any("saved 3 stored responses" in line for line in again.lines), again.lines
    assert os.path.exists(state / "state.json")
