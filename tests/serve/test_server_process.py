"""``python -m eval.serve`` as users run it, driven by the official ``openai`` client: chat (plain and
streamed), completions with logprobs and echo, a tool round trip, stateful responses; SIGTERM
drains a running request and saves stored responses, which the next start continues exactly."""
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from tests.helpers import ROOT

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow      # starts servers in subprocesses

KEY = "secret"
SERVING = re.compile(r"serving (\S+) on (http://\S+/v1)")


class ServerProcess:
    """``python -m eval.serve`` in a subprocess; ``url`` once it listens."""

    def __init__(self, cache, *args):
        """``cache``: the compiled programs' directory (shared by a test's servers)."""
        self.process = subprocess.Popen([sys.executable, "-m", "eval.serve", *map(str, args), "--port", "0",
                                         "--compilation-cache", str(cache)],
                                        cwd=ROOT, stderr=subprocess.PIPE, text=True)
        self.lines = []
        for line in self.process.stderr:
            self.lines.append(line)
            match = SERVING.search(line)
            if match:
                self.name, self.url = match.groups()
                break
        else:
            raise AssertionError("the server did not start:\n" + "".join(self.lines))
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.process.stderr), daemon=True)
        self.reader.start()

    def client(self):
        return openai.OpenAI(base_url=self.url, api_key=KEY, max_retries=0, timeout=300)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=300)
        self.reader.join(timeout=10)
        return code


def test_the_openai_client_against_the_server_and_a_restart(plain_chat_run, tmp_path, xla_cache):
    chat_run = plain_chat_run
    state = tmp_path / "state"
    server = ServerProcess(xla_cache, chat_run, "--api-key", KEY, "--state-dir", state, "--max-model-len", "1024")
    try:
        client = server.client()
        assert [m.id for m in client.models.list()] == [server.name]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()

        messages = [{"role": "user", "content": "3 QWERTY"}]
        plain = client.chat.completions.create(model=server.name, messages=messages, max_tokens=12, temperature=0)
        stream = client.chat.completions.create(model=server.name, messages=messages, max_tokens=12, temperature=0,
                                                stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert streamed == (plain.choices[0].message.content or "")
        assert "<|" not in (plain.choices[0].message.content or "")
        generated = subprocess.run([sys.executable, "-m", "eval.generate", str(chat_run), "--prompt", "3 QWERTY",
                                    "--max-new-tokens", "12"], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert generated.returncode == 0, generated.stderr
        assert plain.choices[0].message.content and generated.stdout.rstrip("\n") == plain.choices[0].message.content

        tools = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
            "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
        history = messages + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "7"}]
        answered = client.chat.completions.create(model=server.name, messages=history, tools=tools, max_tokens=8,
                                                  temperature=0)
        assert answered.choices[0].finish_reason in ("stop", "length", "tool_calls")

        completion = client.completions.create(model=server.name, prompt="the cat", max_tokens=2, temperature=0,
                                               logprobs=1, echo=True)
        logprobs = completion.choices[0].logprobs
        assert logprobs.token_logprobs[0] is None and len(logprobs.tokens) == len("the cat") + 2

        first = client.responses.create(model=server.name, input="3 QWERTY", max_output_tokens=8, temperature=0)
        expected = client.responses.create(model=server.name, input="again", previous_response_id=first.id,
                                           max_output_tokens=8, temperature=0, store=False)

        long_request, started = {}, threading.Event()

        def long_stream():
            pieces = client.completions.create(model=server.name, prompt="x", max_tokens=150, temperature=1.0,
                                               seed=0, extra_body={"ignore_eos": True}, stream=True)
            reasons = []
            for chunk in pieces:
                started.set()
                reasons += [c.finish_reason for c in chunk.choices]
            long_request["finish"] = reasons[-1]
        thread = threading.Thread(target=long_stream)
        thread.start()
        assert started.wait(timeout=300)                       # SIGTERM while it streams
    finally:
        code = server.stop()
    thread.join(timeout=300)
    assert code == -signal.SIGTERM, "".join(server.lines)      # uvicorn ends by the signal, after shutting down
    assert long_request.get("finish") == "length"             # drained: it ran to its end
    assert any("saved" in line and "stored responses" in line for line in server.lines), server.lines

    again = ServerProcess(xla_cache, chat_run, "--api-key", KEY, "--state-dir", state, "--max-model-len", "1024")
    try:
        client = again.client()
        assert client.responses.retrieve(first.id).id == first.id
        continued = client.responses.create(model=again.name, input="again", previous_response_id=first.id,
                                            max_output_tokens=8, temperature=0)
        assert continued.output_text == expected.output_text
    finally:
        assert again.stop() == -signal.SIGTERM
    assert os.path.exists(state / "state.json")
    assert any(xla_cache.iterdir())                   # --compilation-cache: the programs were kept
