"""The tool-call round trip through ``python -m eval.serve`` with the official ``openai`` client, on
held-out questions of a run trained on ``configs/chat/calculator.jsonl`` (`configs/chat/make_calculator.py`).

The server is started as a subprocess (``--port 0``; its address read from the ``serving NAME on
http://HOST:PORT/v1`` line on stderr). For each held-out question ("add 12 and 7", ...):

    turn 1   chat.completions.create(messages=[user], tools=[add], temperature=0): a tool call is
             finish_reason "tool_calls" with message.tool_calls[0].function.name == "add"; its
             arguments should be a JSON object {"a": int, "b": int} equal to the question's numbers
    stream   the same request with stream=True: the streamed tool calls (name, arguments) should
             equal turn 1's, and so should the streamed content and finish_reason
    turn 2   add executed on the call's arguments; the assistant message with its tool_calls and a
             tool message (tool_call_id = the call's id) sent back: the final answer should be the sum

Counted: tool calls made, valid JSON arguments, correct arguments, correct final answers (the true
sum, as digits), stream equal to non-stream, chat markup ("<|") in any content or arguments, and
API errors. A turn that goes wrong (no call, malformed arguments, markup, an error) gets its raw
reply in the JSON: the server's own rendering of the request (``POST /tokenize`` with the messages
and tools) sent to ``POST /v1/completions`` at temperature 0 with ``logprobs: 0``, whose token
pieces name the chat markers. The server is stopped with SIGTERM and its exit status reported
(``eval.serve`` drains, then ends by the signal as uvicorn does: Popen's -15, a shell's 143).
Nothing is asserted: the table and the JSON report what happened.

    python -m bench.serve_tools RUN_DIR [--data configs/chat/calculator.jsonl] [--questions 20]
                                        [--max-tokens 256] [--out bench/serve_tools.json]

The held-out questions are the data file's last ``data.heldout_fraction`` of records (the trainer's
held-out split; `k3jax.data.chat.ChatDataset`), with the fraction read from the run's config.yaml;
each request declares the record's own ``tools``, as training rendered them. The JSON has a line per
question and, in full, each question that went wrong.

bench/serve_tools.json: ``--questions 100`` (all held-out questions) on the 500-step run of
`configs/chat/make_calculator.py`'s command, on the shared 2-core CPU: 100 tool calls, 100 valid
JSON arguments, 98 correct arguments and final answers (both misses "a+b=?" questions whose first
number was miscopied: 9 -> 0, 71 -> 17; the answers then echo the tool's sum), streamed = non-streamed
100/100, no markup, no API errors; the server ended by SIGTERM (status -15). Requests took 0.4-1 s
once the server's prefill and decode programs were compiled (the first few took 5-50 s).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import yaml

from bench.common import table, write_json

READY = re.compile(r"serving (\S+) on (http://\S+/v1)")
MARKUP = "<|"


def held_out_records(path, heldout_fraction: float) -> list[dict]:
    """The records `k3jax.data.chat.ChatDataset` holds out: the file's last
    ``floor(heldout_fraction * count)`` (at least one of two or more; none dropped for length)."""
    records = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
    count = len(records)
    heldout = min(max(int(heldout_fraction * count), 1), count - 1) if heldout_fraction and count > 1 else 0
    return records[count - heldout:]


def expected_call(record: dict) -> tuple[dict, str]:
    """The record's first tool call's arguments and the final answer."""
    call = next(m for m in record["messages"] if m.get("tool_calls"))["tool_calls"][0]
    return json.loads(call["function"]["arguments"]), record["messages"][-1]["content"]


class Server:
    """``python -m eval.serve RUN_DIR --port 0`` as a subprocess; stderr kept in ``log``."""

    def __init__(self, run_dir: str, startup_seconds: float):
        self.log: list[str] = []
        self.process = subprocess.Popen([sys.executable, "-m", "eval.serve", run_dir, "--port", "0"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ready = threading.Event()
        self.name = self.base_url = None

        def drain():
            for line in self.process.stderr:
                self.log.append(line.rstrip("\n"))
                match = READY.search(line)
                if match and not ready.is_set():
                    self.name, self.base_url = match.groups()
                    ready.set()
            ready.set()
        threading.Thread(target=drain, daemon=True).start()
        start = time.perf_counter()
        ready.wait(startup_seconds)
        self.startup_seconds = time.perf_counter() - start
        if self.base_url is None:
            self.stop()
            raise SystemExit("the server did not start:\n" + "\n".join(self.log[-20:]))

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then the exit status (None: it did not exit in ``timeout`` seconds and was killed)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None


def calls_of(message) -> list[dict]:
    """A response message's tool calls as plain dicts: id, name, arguments."""
    return [{"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
            for call in (message.tool_calls or [])]


def streamed(client, request: dict) -> dict:
    """The same request with stream=True, its chunks joined: content, tool calls, finish_reason."""
    content, calls, finish, chunks = "", {}, None, 0
    for chunk in client.chat.completions.create(**request, stream=True):
        chunks += 1
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": content, "tool_calls": [calls[index] for index in sorted(calls)], "finish_reason": finish,
            "chunks": chunks}


def raw_reply(http: httpx.Client, model: str, messages: list, tools: list | None, max_tokens: int) -> dict:
    """The reply's raw tokens: the server's rendering of the request, completed at temperature 0, each
    token's piece (the chat markers by name)."""
    try:
        prompt = http.post("/tokenize", json={"model": model, "messages": messages, "tools": tools}).json()["tokens"]
        body = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "logprobs": 0}).json()
        pieces = body["choices"][0]["logprobs"]["tokens"]
        return {"prompt_tokens": len(prompt), "text": "".join(pieces), "finish_reason": body["choices"][0]["finish_reason"]}
    except Exception as error:   # noqa: BLE001 - report, don't fail the benchmark
        return {"error": repr(error)}


def error_text(error: Exception) -> str:
    status = getattr(error, "status_code", None)
    return f"{type(error).__name__}" + (f" {status}" if status else "") + f": {error}"


def parsed_arguments(call: dict | None):
    """A tool call's arguments as JSON (None without a call, or when they do not parse)."""
    try:
        return json.loads(call["arguments"]) if call else None
    except json.JSONDecodeError:
        return None


def compare_stream(client, request: dict, choice, calls: list[dict], result: dict, markup: list[bool]) -> None:
    """``request`` again with stream=True: into ``result`` the stream and whether it equals the turn-1
    reply ``choice`` with its ``calls`` (tool calls, content, finish_reason), or the error; whether
    its content holds chat markup onto ``markup``."""
    try:
        stream = streamed(client, request)
        result["stream"] = stream
        result["stream_equal"] = ([(c["name"], c["arguments"]) for c in stream["tool_calls"]]
                                  == [(c["name"], c["arguments"]) for c in calls]
                                  and stream["content"] == (choice.message.content or "")
                                  and stream["finish_reason"] == choice.finish_reason)
        markup.append(MARKUP in stream["content"])
    except Exception as error:   # noqa: BLE001
        result["errors"].append(f"stream: {error_text(error)}")
        result["stream_equal"] = False


def tool_history(user: dict, content, calls: list[dict], call_id: str, total: int) -> list[dict]:
    """Turn 2's messages: the question, the assistant's reply with its tool calls, the tool's result."""
    return [user, {"role": "assistant", "content": content,
                   "tool_calls": [{"id": c["id"], "type": "function",
                                   "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]},
            {"role": "tool", "tool_call_id": call_id, "content": str(total)}]


def question(client, http, model: str, record: dict, max_tokens: int) -> dict:
    """One held-out question through the whole round trip."""
    user, tools = record["messages"][0], record.get("tools")
    expected_arguments, expected_answer = expected_call(record)
    request = {"model": model, "messages": [user], "tools": tools, "temperature": 0, "max_tokens": max_tokens}
    result = {"question": user["content"], "expected_arguments": expected_arguments, "expected_answer": expected_answer,
              "errors": []}
    try:
        start = time.perf_counter()
        first = client.chat.completions.create(**request)
        result["turn1_seconds"] = time.perf_counter() - start
    except Exception as error:   # noqa: BLE001
        result["errors"].append(f"turn 1: {error_text(error)}")
        result["raw_turn1"] = raw_reply(http, model, [user], tools, max_tokens)
        return result
    choice = first.choices[0]
    calls = calls_of(choice.message)
    result.update(finish_reason=choice.finish_reason, content=choice.message.content, tool_calls=calls)
    call = calls[0] if calls else None
    result["tool_call"] = choice.finish_reason == "tool_calls" and call is not None and call["name"] == "add"
    arguments = parsed_arguments(call)
    valid = (isinstance(arguments, dict) and set(arguments) == {"a", "b"}
             and all(isinstance(v, int) and not isinstance(v, bool) for v in arguments.values()))
    result["valid_arguments"] = result["tool_call"] and valid
    result["correct_arguments"] = result["valid_arguments"] and arguments == expected_arguments
    markup = [MARKUP in (choice.message.content or "")] + [MARKUP in c["name"] + c["arguments"] for c in calls]

    compare_stream(client, request, choice, calls, result, markup)
    result["final_answer_correct"] = False
    if result["valid_arguments"]:
        total = arguments["a"] + arguments["b"]          # the tool, executed
        history = tool_history(user, choice.message.content, calls, call["id"], total)
        try:
            second = client.chat.completions.create(model=model, messages=history, tools=tools, temperature=0,
                                                    max_tokens=max_tokens)
            answer = second.choices[0]
            result.update(tool_result=str(total), final_answer=answer.message.content,
                          final_finish_reason=answer.finish_reason, final_tool_calls=calls_of(answer.message))
            result["final_answer_correct"] = (answer.message.content or "").strip() == expected_answer
            markup.append(MARKUP in (answer.message.content or ""))
        except Exception as error:   # noqa: BLE001
            result["errors"].append(f"turn 2: {error_text(error)}")
            result["raw_turn2"] = raw_reply(http, model, history, tools, max_tokens)
    result["markup"] = any(markup)
    if not result["valid_arguments"] or result["markup"] or not result.get("stream_equal"):
        result["raw_turn1"] = raw_reply(http, model, [user], tools, max_tokens)
    return result


FLAGS = ("tool_call", "valid_arguments", "correct_arguments", "final_answer_correct", "stream_equal", "markup")


def summary(result: dict) -> dict:
    """A question's line in the JSON: what was asked, the call's arguments, the answer, the flags."""
    calls = result.get("tool_calls") or []
    return {"question": result["question"], "arguments": calls[0]["arguments"] if calls else None,
            "final_answer": result.get("final_answer"), "turn1_seconds": round(result.get("turn1_seconds", 0), 3),
            **{flag: bool(result.get(flag)) for flag in FLAGS}}


def went_wrong(result: dict) -> bool:
    return bool(result["errors"]) or result.get("markup") or not all(
        result.get(flag) for flag in FLAGS if flag != "markup")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.serve_tools", description=__doc__.split("\n")[0])
    parser.add_argument("run", metavar="RUN_DIR")
    parser.add_argument("--data", default="configs/chat/calculator.jsonl", help="the run's conversations")
    parser.add_argument("--questions", type=int, default=20, help="held-out questions asked (default 20)")
    parser.add_argument("--max-tokens", type=int, default=256, help="per reply (default 256)")
    parser.add_argument("--startup-seconds", type=float, default=600.0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    import openai

    config = yaml.safe_load((pathlib.Path(args.run) / "config.yaml").read_text())
    fraction = config.get("data", {}).get("heldout_fraction", 0.05)
    records = held_out_records(args.data, fraction)[:args.questions]
    server = Server(args.run, args.startup_seconds)
    print(f"server {server.name} at {server.base_url} ready in {server.startup_seconds:.1f} s; "
          f"{len(records)} held-out questions", file=sys.stderr)
    results, start = [], time.perf_counter()
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=600)
        with httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=600) as http:
            for number, record in enumerate(records):
                results.append(question(client, http, server.name, record, args.max_tokens))
                r = results[-1]
                print(f"  {number + 1:>3}  {r['question']!r:<26} call={r.get('tool_calls')} "
                      f"answer={r.get('final_answer')!r}", file=sys.stderr)
    finally:
        seconds = time.perf_counter() - start
        exit_status = server.stop()
    count = len(results)

    def total(key):
        return sum(bool(r.get(key)) for r in results)

    counts = {"tool_calls_made": total("tool_call"), "valid_json_arguments": total("valid_arguments"),
              "correct_arguments": total("correct_arguments"), "correct_final_answers": total("final_answer_correct"),
              "stream_equals_non_stream": total("stream_equal"), "markup_in_content": total("markup"),
              "api_errors": sum(len(r["errors"]) for r in results)}
    print(table(["held-out questions", f"of {count}"], [[name.replace("_", " "), value] for name, value in counts.items()]))
    ended = ("did not exit" if exit_status is None else f"ended by signal {-exit_status} (shell status {128 - exit_status})"
             if exit_status < 0 else f"exit status {exit_status}")
    print(f"server after SIGTERM: {ended}; {seconds:.1f} s for {count} questions")
    if args.out:
        result = {"run": args.run, "data": args.data, "heldout_fraction": fraction, "questions": count,
                  "counts": counts, "server_exit_status": exit_status, "seconds": seconds,
                  "server_startup_seconds": server.startup_seconds, "server_log_tail": server.log[-20:],
                  "results": [summary(r) for r in results],
                  "went_wrong": [r for r in results if went_wrong(r)]}   # in full, with the raw replies
        print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
