"""The OpenAI-compatible server (`python -m eval.serve`) as clients see it: throughput under load,
answers to bad input, a full queue, client disconnects and shutdown, in one run.

    python -m bench.serve RUN_DIR [--seconds 60] [--clients 32] [--max-tokens 16] [--out bench/serve.json]
    python -m bench.serve --train-tiny runs/chat ...     # train the README's tiny chat model first

The server runs in a subprocess (``python -m eval.serve RUN_DIR --port 0 --max-batch 64 --max-queue
256 --max-model-len 512 --api-key KEY``; the key goes with every good request, and the 512-token
limit makes a "prompt past the model's limit" cheap to send). ``--train-tiny DIR`` runs the README's
"Conversations" command (the tiny model on ``configs/chat/conversations.jsonl``, 30 steps) into DIR
unless DIR already holds checkpoints.

    warm-up   rounds of a request of each shape (with and without the shared system prompt) one
              after the other, then bursts of 2, 4, 8, ... and ``--clients`` concurrent ones, until
              a round compiles nothing (``--warmup-rounds`` at most): the prefill and the batched
              decode programs (a compile per power-of-two batch and page-count bucket, seconds each
              on a CPU) are compiled before anything is timed; not counted. The server runs with
              ``JAX_LOG_COMPILES=1`` and each table row counts the XLA compilations its log shows
    load      phase A: one client sending chat completions back to back for ``--seconds``;
              phase B: ``--clients`` clients doing the same at once. Prompts are the user turns of
              configs/chat/conversations.jsonl (varied), half of them behind one shared system
              prompt (longer than a KDA chunk, so the prefix cache has something to resume from),
              ``max_tokens`` ``--max-tokens``, temperature 0.7, a seed per request. Per request:
              latency, status, completion tokens (its ``usage``). Per phase: requests, completed
              (200 with usage), failed (another status, or an unreadable 200), lost (sent but no
              answer: a client timeout, the connection closed first), generated tokens/s (over the
              phase's wall time, to its last answer), p50 / p99 latency, and from ``/metrics``
              before and after it the mean decode batch (Δgeneration tokens / Δdecode steps) and
              the prefix-cache hit rate (Δhits / Δlookups). B's tokens/s over A's: what batching
              buys. Phase B starts with the prefix cache phase A left.
    bad input each bad request -> its HTTP status and error body, beside the status the OpenAI API
              gives (the issue's list, and a few more probes of the same kind); last a 30 MiB
              prompt (a body under the limit) while ``GET /health`` is timed beside it. Paths with ``..`` and the 33 MiB bodies are sent over a raw socket (an HTTP client
              would normalise the path or stop at the first refused write). A full queue: a
              second, short-lived server (``--max-queue 1 --max-batch 1``) gets 8 concurrent
              long requests (``max_tokens`` 200, ``ignore_eos``): how many got 429 with
              ``Retry-After`` and that the others completed. Then one good request to the first
              server (it keeps serving).
    disconnect  a streaming request closed after its first chunks (and a plain one whose client
              gives up): the ``k3jax_sessions`` gauge must come back to its earlier value.
    shutdown  SIGTERM; the exit status (`eval.serve.cli` documents ending by the signal: -15 as
              Popen reports it, 143 in a shell), the time it took, and any traceback in its log.

The server's session pools start small and double when running sessions need more room; each
doubling recompiles the prefill and decode programs on the engine thread (the warm-up absorbs
them). The prefix cache only keeps pages the pools have spare, so it never makes them grow: under
steady load the ``compiles`` column stays 0. ``--device-bytes`` passes a budget to the server.

Nothing is asserted: every figure and every answer goes to the tables and to ``--out``.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import pathlib
import platform
import random
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from bench.common import table, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONVERSATIONS = ROOT / "configs" / "chat" / "conversations.jsonl"
# README, "Conversations (data.kind=chat)": the tiny chat model
TRAIN_TINY = ["configs/tiny.yaml", "data.kind=chat", f"data.path={CONVERSATIONS.relative_to(ROOT)}",
              "data.tokenizer=configs/chat/tokenizer", "data.seq_len=128", "data.chat_thinking=false",
              "data.chat_thinking_effort=null", "train.batch_size=8", "train.steps=30"]
SERVING = re.compile(r"serving (\S+) on (http://\S+)/v1")
# 221 tokens of the byte-level tokenizer rendered (298 with a user turn, 77 without): past three
# 64-token KDA chunks, so a later prompt behind it resumes from a cached boundary
SYSTEM = ("You are the assistant of a small counting game. Each user message starts with a digit "
          "followed by a word of capital letters; reply with the digit's name in English, one word, nothing else.")
MAX_BODY = 32 * 2**20
COMPILED = "Finished XLA compilation"
COMPILE_DONE = re.compile(r"Finished XLA compilation of (\S+) in ([0-9.e+-]+) sec")
COMPILE_START = re.compile(r"Compiling (\S+) with global shapes and types \((.*?)\)\. Argument")
COMPILE_LINES = (COMPILED, "Compiling ", "Finished tracing", "Finished jaxpr")


# ---------------------------------------------------------------------------------------------- model
def has_checkpoints(run_dir: pathlib.Path) -> bool:
    folder = run_dir / "checkpoints"
    return folder.is_dir() and any(path.name.isdigit() for path in folder.iterdir())


def prepare_run(args) -> tuple[pathlib.Path, dict]:
    """The run directory to serve, training the tiny chat model into ``--train-tiny`` when asked."""
    if args.train_tiny is None:
        return pathlib.Path(args.run), {"trained": False}
    run_dir = pathlib.Path(args.train_tiny)
    if has_checkpoints(run_dir):
        print(f"{run_dir} already holds checkpoints: not training", file=sys.stderr, flush=True)
        return run_dir, {"trained": False, "train_command": None}
    command = [sys.executable, "-m", "train", TRAIN_TINY[0], f"run_dir={run_dir}", *TRAIN_TINY[1:]]
    print(f"training the tiny chat model: {' '.join(['python', *command[1:]])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return run_dir, {"trained": True, "train_command": " ".join(["python", *command[1:]]),
                     "train_seconds": time.perf_counter() - start}


# ---------------------------------------------------------------------------------------------- server
class ServerProcess:
    """``python -m eval.serve`` in a subprocess; ``url`` (…/v1 left off) and ``name`` once it listens."""

    def __init__(self, run_dir: pathlib.Path, flags: list[str], timeout: float):
        self.command = [sys.executable, "-m", "eval.serve", str(run_dir), "--port", "0", *flags]
        self.started = time.perf_counter()
        # JAX_LOG_COMPILES: each compilation is a line of its log, counted to tell compile time from serving
        self.process = subprocess.Popen(self.command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True, env={**os.environ, "JAX_LOG_COMPILES": "1"})
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.name = self.url = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        if not self.ready.wait(timeout) or self.url is None:
            self.kill()
            raise RuntimeError(f"the server did not start within {timeout:.0f} s (exit {self.process.poll()}):\n"
                               + "".join(self.lines[-30:]))
        self.startup_seconds = time.perf_counter() - self.started

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            match = SERVING.search(line)
            if match and not self.ready.is_set():
                self.name, self.url = match.groups()
                self.ready.set()
        self.ready.set()                # ended before (or after) the ready line

    def compiles(self) -> int:
        """XLA compilations so far (read from its log): a mark for `compiled_since`."""
        return sum(COMPILED in line for line in list(self.lines))

    def compiled_since(self, mark: int) -> dict:
        """The compilations after ``mark`` (a `compiles` value): count, seconds, per function, and the
        argument shapes of the first few."""
        count, seconds, functions, shapes = 0, 0.0, {}, []
        for line in list(self.lines):
            found = COMPILE_DONE.search(line)
            if found:
                count += 1
                if count > mark:
                    seconds += float(found.group(2))
                    functions[found.group(1)] = functions.get(found.group(1), 0) + 1
                continue
            started = COMPILE_START.search(line)
            if started and count >= mark and len(shapes) < 12:
                shapes.append(f"{started.group(1)} {started.group(2)[:240]}")
        return {"compiles": count - mark, "compile_seconds": seconds, "compiled_functions": functions,
                "compiled_shapes": shapes}

    def log_tail(self, count: int) -> list[str]:
        return [line.rstrip() for line in self.lines if not any(mark in line for mark in COMPILE_LINES)][-count:]

    @property
    def host_port(self) -> tuple[str, int]:
        url = httpx.URL(self.url)
        return url.host, url.port

    def stop(self, timeout: float = 120) -> dict:
        """SIGTERM, then wait: the exit status, the seconds it took, the tracebacks in its log."""
        start = time.perf_counter()
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = None
        self.reader.join(timeout=10)
        log = "".join(self.lines)
        return {"exit_code": code, "seconds": time.perf_counter() - start,
                "tracebacks": log.count("Traceback (most recent call last)"),
                "error_lines": [line.rstrip() for line in self.lines if "ERROR" in line or "Error" in line][:20]}

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)


def metrics(client: httpx.Client) -> dict:
    """``/metrics`` as {sample name with its labels: value}."""
    values = {}
    for line in client.get("/metrics", timeout=60).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def metric_delta(before: dict, after: dict) -> dict:
    """What a phase did, read from the server's counters before and after it."""
    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)
    tokens, steps = delta("k3jax_generation_tokens_total"), delta("k3jax_decode_steps_total")
    hits, misses = delta("k3jax_prefix_cache_hits_total"), delta("k3jax_prefix_cache_misses_total")
    return {"generation_tokens": tokens, "decode_steps": steps, "mean_decode_batch": tokens / steps if steps else None,
            "prefix_hits": hits, "prefix_misses": misses,
            "prefix_hit_rate": hits / (hits + misses) if hits + misses else None,
            "prefix_hit_rate_gauge_after": after.get("k3jax_prefix_cache_hit_rate"),
            "prompt_tokens": delta("k3jax_prompt_tokens_total"), "prefill_tokens": delta("k3jax_prefill_tokens_total"),
            "prefix_tokens_reused": delta("k3jax_prefix_tokens_reused_total"),
            "sessions_after": after.get("k3jax_sessions"),
            "device_bytes_after": after.get('k3jax_tier_bytes{tier="device"}'),
            "host_bytes_after": after.get('k3jax_tier_bytes{tier="host"}')}


# ---------------------------------------------------------------------------------------------- load
def user_turns() -> list[str]:
    turns = []
    for line in CONVERSATIONS.read_text(encoding="utf-8").splitlines():
        for message in json.loads(line)["messages"]:
            if message["role"] == "user" and isinstance(message.get("content"), str):
                turns.append(message["content"])
    return turns


class Requests:
    """Chat completion bodies: a user turn drawn at random, half behind the shared system prompt, a
    new seed each."""

    def __init__(self, name: str, max_tokens: int, ignore_eos: bool, seed: int = 0):
        self.name, self.max_tokens, self.ignore_eos = name, max_tokens, ignore_eos
        self.turns = user_turns()
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.count = 0

    def next(self, system: bool | None = None) -> tuple[dict, bool]:
        with self.lock:
            self.count += 1
            seed, turn = self.count, self.random.choice(self.turns)
            system = self.random.random() < 0.5 if system is None else system
        messages = ([{"role": "system", "content": SYSTEM}] if system else []) + [{"role": "user", "content": turn}]
        body = {"model": self.name, "messages": messages, "max_tokens": self.max_tokens, "temperature": 0.7,
                "seed": seed}
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body, system


LOST = (httpx.TimeoutException, httpx.RemoteProtocolError, httpx.ReadError)


def send(client: httpx.Client, body: dict) -> dict:
    """One chat completion: its latency, status, completion tokens and outcome (completed, failed, lost)."""
    start = time.perf_counter()
    record = {"start": start, "status": None, "completion_tokens": 0, "error": None}
    try:
        response = client.post("/v1/chat/completions", json=body)
        record["status"] = response.status_code
        if response.status_code == 200:
            record["completion_tokens"] = response.json()["usage"]["completion_tokens"]
            record["outcome"] = "completed"
        else:
            record["outcome"], record["error"] = "failed", response.text[:200]
    except LOST as error:
        record["outcome"], record["error"] = "lost", f"{type(error).__name__}: {error}"
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
        record["outcome"], record["error"] = "failed", f"{type(error).__name__}: {error}"
    record["end"] = time.perf_counter()
    record["latency"] = record["end"] - start
    return record


def run_clients(server: ServerProcess, headers: dict, requests: Requests, clients: int, seconds: float,
                timeout: float) -> tuple[list[dict], float]:
    """``clients`` threads, each sending back to back until ``seconds`` have passed -> (records,
    phase start). A request still unanswered when its thread is given up on counts as lost."""
    records, lock = [], threading.Lock()
    pending: dict[int, float] = {}
    start = time.perf_counter()
    deadline = start + seconds

    def client_loop(index: int) -> None:
        with httpx.Client(base_url=server.url, headers=headers, timeout=httpx.Timeout(timeout, connect=30)) as client:
            while time.perf_counter() < deadline:
                body, system = requests.next()
                pending[index] = time.perf_counter()
                record = send(client, body)
                record.update(client=index, system=system)
                with lock:
                    records.append(record)
                    pending.pop(index, None)

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.perf_counter()) + timeout + 30)
    with lock:
        for index, sent in pending.items():     # threads that never came back
            records.append({"client": index, "start": sent, "end": None, "latency": None, "status": None,
                            "completion_tokens": 0, "outcome": "lost", "error": "no answer when the phase ended"})
    return records, start


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def summarize(records: list[dict], start: float, clients: int, seconds: float) -> dict:
    completed = [r for r in records if r["outcome"] == "completed"]
    ends = [r["end"] for r in records if r["end"] is not None]
    wall = (max(ends) - start) if ends else seconds
    tokens = sum(r["completion_tokens"] for r in completed)
    latencies = [r["latency"] for r in completed]
    statuses = {}
    for record in records:
        statuses[str(record["status"])] = statuses.get(str(record["status"]), 0) + 1
    return {"clients": clients, "seconds": seconds, "wall_seconds": wall, "requests": len(records),
            "completed": len(completed), "failed": sum(r["outcome"] == "failed" for r in records),
            "lost": sum(r["outcome"] == "lost" for r in records), "statuses": statuses,
            "generated_tokens": tokens, "tokens_per_second": tokens / wall if wall > 0 else None,
            "requests_per_second": len(completed) / wall if wall > 0 else None,
            "mean_completion_tokens": tokens / len(completed) if completed else None,
            "latency_p50": percentile(latencies, 50), "latency_p99": percentile(latencies, 99),
            "latency_max": max(latencies) if latencies else None,
            "with_system_prompt": sum(1 for r in records if r.get("system")),
            "errors": sorted({r["error"] for r in records if r["error"]})[:10]}


def burst(server, headers, requests: Requests, count: int, timeout: float) -> list[str]:
    """``count`` requests at once, one per client -> their outcomes."""
    outcomes = [None] * count

    def one(index):
        with httpx.Client(base_url=server.url, headers=headers, timeout=timeout) as client:
            outcomes[index] = send(client, requests.next()[0])["outcome"]
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 30)
    return outcomes


def warm_up(server, headers, requests: Requests, clients: int, timeout: float, max_rounds: int) -> dict:
    """Untimed rounds that compile what the phases run, until a round compiles nothing (at most
    ``max_rounds``): each shape (with and without the system prompt) in turn, then bursts of 2, 4, 8,
    ... and ``clients`` concurrent requests (the decode step compiles per power-of-two batch and
    page-count bucket)."""
    sizes = sorted({2**k for k in range(1, clients.bit_length()) if 2**k < clients} | {clients} - {1})
    rounds = []
    for _ in range(max_rounds):
        start, compiled = time.perf_counter(), server.compiles()
        outcomes = []
        with httpx.Client(base_url=server.url, headers=headers, timeout=timeout) as client:
            for system in (False, True):
                outcomes.append(send(client, requests.next(system)[0])["outcome"])
        for size in sizes:
            outcomes += burst(server, headers, requests, size, timeout)
        rounds.append({"requests": len(outcomes), "completed": outcomes.count("completed"),
                       "seconds": time.perf_counter() - start, **server.compiled_since(compiled)})
        print(f"warm-up round {len(rounds)}: {rounds[-1]['requests']} requests, {rounds[-1]['seconds']:.1f} s, "
              f"{rounds[-1]['compiles']} compilations {rounds[-1]['compiled_functions']}", file=sys.stderr, flush=True)
        if rounds[-1]["compiles"] == 0:
            break
    return {"bursts": [1, 1, *sizes], "rounds": rounds, "requests": sum(r["requests"] for r in rounds),
            "seconds": sum(r["seconds"] for r in rounds), "quiet": rounds[-1]["compiles"] == 0}


def load_phase(name, server, headers, requests, clients, seconds, timeout) -> dict:
    with httpx.Client(base_url=server.url, headers=headers) as client:
        before, compiled = metrics(client), server.compiles()
        records, start = run_clients(server, headers, requests, clients, seconds, timeout)
        after = metrics(client)
    result = {"phase": name, **summarize(records, start, clients, seconds), **metric_delta(before, after),
              **server.compiled_since(compiled)}
    print(f"phase {name}: {result['completed']}/{result['requests']} completed, "
          f"{result['tokens_per_second'] or 0:.1f} tokens/s, {result['compiles']} compilations "
          f"{result['compiled_functions']}", file=sys.stderr, flush=True)
    return result


# ---------------------------------------------------------------------------------------------- bad input
def raw_http(host: str, port: int, method: str, path: str, headers: dict, body_size: int = 0,
             chunked: bool = False, timeout: float = 120) -> dict:
    """A request written to a socket as given (no path normalisation), ``body_size`` bytes of body
    (``chunked``: without a Content-Length); the body stops at the first answer from the server."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
                 "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
        if body_size and chunked:
            lines.append("Transfer-Encoding: chunked")
        elif body_size or method == "POST":
            lines.append(f"Content-Length: {body_size}")
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        sent, piece, write_error = 0, b" " * 2**20, None
        while sent < body_size:
            if select.select([sock], [], [], 0)[0]:
                break                      # the server answered before the whole body
            part = piece[: min(len(piece), body_size - sent)]
            try:
                sock.sendall(b"%x\r\n%b\r\n" % (len(part), part) if chunked else part)
            except OSError as error:       # it closed the connection; its answer may still be readable
                write_error = f"{type(error).__name__} after {sent} bytes"
                break
            sent += len(part)
        else:
            if chunked and body_size:
                sock.sendall(b"0\r\n\r\n")
        response = http.client.HTTPResponse(sock, method=method)
        try:
            response.begin()
            text = response.read().decode("utf-8", "replace")
        except OSError as error:
            return {"status": None, "body": f"no answer: {type(error).__name__}: {error}", "body_sent": sent,
                    "write_error": write_error}
        return {"status": response.status, "body": text, "retry_after": response.getheader("retry-after"),
                "body_sent": sent, "write_error": write_error}
    finally:
        sock.close()


def bad_requests(name: str) -> list[tuple]:
    """(description, method, path, body: JSON value / bytes / None, expected status, headers override)."""
    user = [{"role": "user", "content": "3 QWERTY"}]
    chat = {"model": name, "messages": user, "max_tokens": 4}
    completion = {"model": name, "prompt": "3 QWERTY", "max_tokens": 4}
    return [*_bad_bodies(name, chat), *_bad_settings(chat, completion), *_bad_messages(chat, user),
            *_bad_routes(name, chat)]


def _bad_bodies(name: str, chat: dict) -> list[tuple]:
    """Bodies that are not JSON objects, an unknown model, a request without its prompt or messages."""
    return [
        ("malformed JSON", "POST", "/v1/chat/completions", b'{"messages": [', 400, None),
        ("body not an object (a list)", "POST", "/v1/chat/completions", [1, 2], 400, None),
        ("body not UTF-8", "POST", "/v1/chat/completions", b'{"messages": "\xff\xfe"}', 400, None),
        ("JSON nested 100000 deep", "POST", "/v1/chat/completions", b"[" * 100000 + b"]" * 100000, 400, None),
        ("unknown model", "POST", "/v1/chat/completions", {**chat, "model": "gpt-4"}, 404, None),
        ("completions without prompt", "POST", "/v1/completions", {"model": name}, 400, None),
        ("chat without messages", "POST", "/v1/chat/completions", {"model": name}, 400, None),
    ]


def _bad_settings(chat: dict, completion: dict) -> list[tuple]:
    """Prompts past the model's limit and generation settings out of range or of the wrong type."""
    return [
        ("prompt of 600 tokens (limit 512)", "POST", "/v1/completions", {**completion, "prompt": "x" * 600}, 400, None),
        ("chat turn of 600 tokens (limit 512)", "POST", "/v1/chat/completions",
         {**chat, "messages": [{"role": "user", "content": "x" * 600}]}, 400, None),
        ("max_tokens 100000", "POST", "/v1/chat/completions", {**chat, "max_tokens": 100000}, 400, None),
        ("max_tokens -1", "POST", "/v1/chat/completions", {**chat, "max_tokens": -1}, 400, None),
        ("max_tokens 4.5", "POST", "/v1/chat/completions", {**chat, "max_tokens": 4.5}, 400, None),
        ("token id 99999 (out of range)", "POST", "/v1/completions", {**completion, "prompt": [5, 99999]}, 400, None),
        ("token id -1", "POST", "/v1/completions", {**completion, "prompt": [5, -1]}, 400, None),
        ("empty prompt", "POST", "/v1/completions", {**completion, "prompt": ""}, 400, None),
        ("n=0", "POST", "/v1/chat/completions", {**chat, "n": 0}, 400, None),
        ("n=65", "POST", "/v1/chat/completions", {**chat, "n": 65}, 400, None),
        ("temperature=-1", "POST", "/v1/chat/completions", {**chat, "temperature": -1}, 400, None),
        ("temperature NaN", "POST", "/v1/completions",
         json.dumps({**completion, "temperature": "x"}).replace('"x"', "NaN").encode(), 400, None),
        ("top_p=0", "POST", "/v1/chat/completions", {**chat, "top_p": 0}, 400, None),
        ("logprobs=99 (completions)", "POST", "/v1/completions", {**completion, "logprobs": 99}, 400, None),
        ("top_logprobs=99 (chat)", "POST", "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 99},
         400, None),
        ('stop=[""]', "POST", "/v1/chat/completions", {**chat, "stop": [""]}, 400, None),
        ("stop=5", "POST", "/v1/chat/completions", {**chat, "stop": 5}, 400, None),
        ("seed a string", "POST", "/v1/chat/completions", {**chat, "seed": "s"}, 400, None),
        ("stream a string", "POST", "/v1/chat/completions", {**chat, "stream": "yes"}, 400, None),
        ("stream_options not an object", "POST", "/v1/chat/completions",
         {**chat, "stream": True, "stream_options": 3}, 400, None),
    ]


def _bad_messages(chat: dict, user: list) -> list[tuple]:
    """Chat messages and tools the API refuses (and one the renderer accepts: bad tool-call JSON)."""
    return [
        ("messages: unknown role", "POST", "/v1/chat/completions",
         {**chat, "messages": [{"role": "robot", "content": "x"}]}, 400, None),
        ("messages empty", "POST", "/v1/chat/completions", {**chat, "messages": []}, 400, None),
        ("messages a string", "POST", "/v1/chat/completions", {**chat, "messages": "hello"}, 400, None),
        ("message without content", "POST", "/v1/chat/completions", {**chat, "messages": [{"role": "user"}]},
         400, None),
        ("message content a number", "POST", "/v1/chat/completions",
         {**chat, "messages": [{"role": "user", "content": 5}]}, 400, None),
        ("message a string, not an object", "POST", "/v1/chat/completions", {**chat, "messages": ["hi"]}, 400, None),
        # K3's renderer writes arguments that are not JSON as raw text (k3jax.data.chat_format)
        ("tool call with bad arguments JSON", "POST", "/v1/chat/completions",
         {**chat, "messages": user + [{"role": "assistant", "content": None, "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]}, 200, None),
        ("tools not a list", "POST", "/v1/chat/completions", {**chat, "tools": "add"}, 400, None),
        ("tools: [{}] (no function)", "POST", "/v1/chat/completions", {**chat, "tools": [{}]}, 400, None),
        ("tool_choice 'required'", "POST", "/v1/chat/completions", {**chat, "tool_choice": "required"}, 400, None),
    ]


def _bad_routes(name: str, chat: dict) -> list[tuple]:
    """Responses that do not exist, paths that climb out, unknown routes and methods, bodies over the
    size limit, a missing or wrong API key."""
    return [
        ("unknown previous_response_id", "POST", "/v1/responses",
         {"model": name, "input": "x", "previous_response_id": "resp_" + "0" * 32}, 404, None),
        ('previous_response_id "../x"', "POST", "/v1/responses",
         {"model": name, "input": "x", "previous_response_id": "../x"}, 404, None),
        ("GET /v1/responses/../../etc/passwd (raw path)", "GET", "/v1/responses/../../etc/passwd", None, 404, None),
        ("GET /v1/responses/..%2F..%2Fetc%2Fpasswd", "GET", "/v1/responses/..%2F..%2Fetc%2Fpasswd", None, 404, None),
        ("DELETE /v1/responses/resp_nope", "DELETE", "/v1/responses/resp_nope", None, 404, None),
        ("responses: input a number", "POST", "/v1/responses", {"model": name, "input": 5}, 400, None),
        ("unknown route GET /v1/nothing", "GET", "/v1/nothing", None, 404, None),
        ("wrong method GET /v1/chat/completions", "GET", "/v1/chat/completions", None, 405, None),
        ("body of 33 MiB with Content-Length", "POST", "/v1/chat/completions", ("big", False), 413, None),
        ("body of 33 MiB chunked (no length)", "POST", "/v1/chat/completions", ("big", True), 413, None),
        ("no API key", "POST", "/v1/chat/completions", chat, 401, {}),
        ("wrong API key", "POST", "/v1/chat/completions", chat, 401, {"Authorization": "Bearer wrong"}),
        ("no API key on /metrics", "GET", "/metrics", None, 401, {}),
    ]


def send_bad(server: ServerProcess, headers: dict, request: tuple) -> dict:
    description, method, path, body, expected, override = request
    sent_headers = headers if override is None else override
    start = time.perf_counter()
    try:
        if isinstance(body, tuple) or ".." in path:
            size, chunked = (MAX_BODY + 2**20, body[1]) if isinstance(body, tuple) else (0, False)
            answer = raw_http(*server.host_port, method, path, sent_headers, size, chunked)
            status, text, retry = answer["status"], answer["body"], answer.get("retry_after")
        else:
            with httpx.Client(base_url=server.url, headers=sent_headers, timeout=120) as client:
                if isinstance(body, bytes):
                    response = client.request(method, path, content=body, headers={"Content-Type": "application/json"})
                elif body is None:
                    response = client.request(method, path)
                else:
                    response = client.request(method, path, json=body)
            status, text, retry = response.status_code, response.text, response.headers.get("retry-after")
    except (httpx.HTTPError, OSError) as error:
        status, text, retry = None, f"{type(error).__name__}: {error}", None
    return {"request": description, "method": method, "path": path, "expected": expected, "status": status,
            "as_expected": status == expected, "body": text[:300], "retry_after": retry,
            "seconds": time.perf_counter() - start}


def blocking_probe(server: ServerProcess, headers: dict, name: str) -> dict:
    """A completions prompt of 30 MiB of text (under the body limit, past the model's): its answer,
    and the slowest ``GET /health`` answer while the server reads, tokenizes and refuses it (the
    HTTP side is one event loop: work done in a route holds every other request)."""
    body = json.dumps({"model": name, "prompt": "x" * (30 * 2**20), "max_tokens": 1}).encode()
    answer, done = {}, threading.Event()

    def big():
        start = time.perf_counter()
        try:
            with httpx.Client(base_url=server.url, headers=headers, timeout=300) as client:
                response = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            answer.update(status=response.status_code, body=response.text[:300])
        except httpx.HTTPError as error:
            answer.update(status=None, body=f"{type(error).__name__}: {error}")
        answer["seconds"] = time.perf_counter() - start
        done.set()
    health = []
    thread = threading.Thread(target=big, daemon=True)
    with httpx.Client(base_url=server.url, headers=headers, timeout=300) as client:
        thread.start()
        while not done.is_set():
            start = time.perf_counter()
            client.get("/health")
            health.append(time.perf_counter() - start)
            time.sleep(0.05)
    thread.join()
    return {"request": "prompt of 30 MiB text (body under 32 MiB)", "method": "POST", "path": "/v1/completions",
            "expected": 400, "status": answer["status"], "as_expected": answer["status"] == 400, "body": answer["body"],
            "retry_after": None, "seconds": answer["seconds"], "health_checks": len(health),
            "health_max_seconds": max(health) if health else None}


def queue_overflow(run_dir, key: str, args) -> dict:
    """A second server with room for one running and one waiting request, and 8 long requests at once."""
    flags = ["--max-queue", "1", "--max-batch", "1", "--max-model-len", str(args.max_model_len), "--api-key", key]
    print("queue overflow: starting a second server (--max-queue 1 --max-batch 1)", file=sys.stderr, flush=True)
    server = ServerProcess(run_dir, flags, args.startup_timeout)
    headers = {"Authorization": f"Bearer {key}"}
    try:
        body = {"model": server.name, "messages": [{"role": "user", "content": "3 QWERTY"}], "max_tokens": 200,
                "temperature": 0.7, "ignore_eos": True}
        results, barrier = [None] * 8, threading.Barrier(8)

        def one(index):
            with httpx.Client(base_url=server.url, headers=headers, timeout=args.client_timeout) as client:
                barrier.wait()
                start = time.perf_counter()
                try:
                    response = client.post("/v1/chat/completions", json={**body, "seed": index})
                    tokens = response.json().get("usage", {}).get("completion_tokens") if response.status_code == 200 else None
                    results[index] = {"status": response.status_code, "retry_after": response.headers.get("retry-after"),
                                      "completion_tokens": tokens, "body": response.text[:200] if response.status_code != 200 else None}
                except httpx.HTTPError as error:
                    results[index] = {"status": None, "body": f"{type(error).__name__}: {error}"}
                results[index]["seconds"] = time.perf_counter() - start
        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(args.client_timeout + 30)
        results = [r or {"status": None, "body": "no answer"} for r in results]
        with httpx.Client(base_url=server.url, headers=headers) as client:
            queue_metrics = metrics(client)
    finally:
        stopped = server.stop()
    refused = [r for r in results if r["status"] == 429]
    return {"requests": len(results), "max_tokens": 200, "ignore_eos": True,
            "completed": sum(r["status"] == 200 and r.get("completion_tokens") == 200 for r in results),
            "status_429": len(refused), "retry_after": sorted({str(r["retry_after"]) for r in refused}),
            "other": sum(r["status"] not in (200, 429) for r in results), "results": results,
            "requests_total_after": {k: v for k, v in queue_metrics.items() if k.startswith("k3jax_requests_total")},
            "startup_seconds": server.startup_seconds, "shutdown": stopped}


# ---------------------------------------------------------------------------------------------- disconnects
def sessions_gauge(client: httpx.Client) -> float:
    return metrics(client)["k3jax_sessions"]


def wait_for_sessions(client: httpx.Client, value: float, seconds: float) -> tuple[float, float | None]:
    """Poll the sessions gauge until it equals ``value`` -> (last reading, seconds it took or None)."""
    start = time.perf_counter()
    while True:
        now = sessions_gauge(client)
        if now == value:
            return now, time.perf_counter() - start
        if time.perf_counter() - start > seconds:
            return now, None
        time.sleep(0.2)


CANCELLED = 'k3jax_requests_total{route="/v1/chat/completions",status="499"}'
DISCONNECT_TOKENS = 400


def abandoned(client: httpx.Client, leave, wait: float) -> dict:
    """``leave()`` starts a request of ``DISCONNECT_TOKENS`` tokens and walks away from it -> the
    sessions gauge before, while it ran and after, how long its sessions took to come back, and the
    tokens the server generated meanwhile (all of them: it was not cancelled, it ran to its end)."""
    before_metrics = metrics(client)
    before = before_metrics["k3jax_sessions"]
    detail, during = leave(lambda: sessions_gauge(client))
    closed = time.perf_counter()
    after, took = wait_for_sessions(client, before, wait)
    after_metrics = metrics(client)
    generated = after_metrics["k3jax_generation_tokens_total"] - before_metrics["k3jax_generation_tokens_total"]
    return {**detail, "sessions_before": before, "sessions_while_running": during, "sessions_after": after,
            "freed": took is not None, "seconds_to_free": took, "seconds_since_close": time.perf_counter() - closed,
            "generated_tokens": generated, "max_tokens": DISCONNECT_TOKENS,
            "cancelled": took is not None and generated < DISCONNECT_TOKENS,
            "counted_499": after_metrics.get(CANCELLED, 0.0) - before_metrics.get(CANCELLED, 0.0)}


def disconnects(server: ServerProcess, headers: dict, name: str, wait: float) -> list[dict]:
    """A streamed request and a plain one, each abandoned mid-generation: are they cancelled, do their
    sessions come back?"""
    body = {"model": name, "messages": [{"role": "user", "content": "3 QWERTY"}], "max_tokens": DISCONNECT_TOKENS,
            "temperature": 0.7, "seed": 1, "ignore_eos": True}

    def stream_then_close(gauge):
        """Read the stream until the request holds its session (the gauge one up), then close it."""
        chunks, during, before = 0, None, gauge()
        with httpx.Client(base_url=server.url, headers=headers, timeout=120) as streamer, \
                streamer.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            status = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    chunks += 1
                    during = gauge()
                    if during > before or line == "data: [DONE]":
                        break
        return {"request": "stream closed after its first chunks", "status": status, "chunks_read": chunks}, during

    def give_up_early(gauge):
        """A plain request whose client times out after 0.3 s (the server polls for a disconnect every 0.1 s)."""
        outcome, done, during = [], threading.Event(), gauge()

        def post():
            with httpx.Client(base_url=server.url, headers=headers, timeout=httpx.Timeout(0.3, connect=30)) as quitter:
                try:
                    outcome.append(f"answered {quitter.post('/v1/chat/completions', json=body).status_code}")
                except httpx.TimeoutException:
                    outcome.append("client timed out after 0.3 s")
            done.set()
        threading.Thread(target=post, daemon=True).start()
        while not done.wait(0.1):
            during = max(during, gauge())
        return {"request": "plain request, client gives up after 0.3 s", "status": outcome[0]}, during

    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as client:
        return [abandoned(client, leave, wait) for leave in (stream_then_close, give_up_early)]


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("run", nargs="?", metavar="RUN_DIR", help="the run to serve")
    parser.add_argument("--train-tiny", metavar="DIR", help="train the README's tiny chat model into DIR first "
                        "(skipped when DIR holds checkpoints) and serve it")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each load phase (default 60)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients of phase B (default 32)")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of the load requests (default 16)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="load requests generate all --max-tokens tokens (ignore_eos), not stopping at the reply's end")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--max-queue", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--api-key", default="bench-key")
    parser.add_argument("--device-bytes", default=None,
                        help="the server's --device-bytes (default: none; a budget caps the pools)")
    parser.add_argument("--client-timeout", type=float, default=300.0,
                        help="seconds a client waits for an answer before counting the request lost (default 300)")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--warmup-rounds", type=int, default=6,
                        help="warm-up rounds at most; it stops after a round that compiles nothing (default 6)")
    parser.add_argument("--skip-queue-overflow", action="store_true", help="do not start the second server")
    parser.add_argument("--out", default="bench/serve.json")
    args = parser.parse_args(argv)
    if (args.run is None) == (args.train_tiny is None):
        parser.error("give RUN_DIR or --train-tiny DIR (one of them)")
    if args.seconds <= 0 or min(args.clients, args.max_tokens, args.max_batch, args.max_queue, args.max_model_len) < 1:
        parser.error("--seconds, --clients, --max-tokens, --max-batch, --max-queue and --max-model-len must be positive")
    return args


def fmt(value, spec=".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_tables(result: dict) -> None:
    """The run's tables and lines: load, bad input (a full queue, the good request after), disconnects, shutdown."""
    _print_load(result)
    _print_bad_input(result)
    _print_disconnects_and_shutdown(result)


def _print_load(result: dict) -> None:
    """The warm-up line, then phases A and B: requests, tokens/s, latency, batching, prefix cache, compilations."""
    a, b = result["phases"]
    print(f"\nload: chat completions, max_tokens {result['max_tokens']}"
          f"{' (ignore_eos)' if result['ignore_eos'] else ''}, temperature 0.7, half behind a shared system prompt; "
          f"server --max-batch {result['server_flags']['max_batch']} --max-queue {result['server_flags']['max_queue']} "
          f"--max-model-len {result['server_flags']['max_model_len']}"
          + (f" --device-bytes {result['server_flags']['device_bytes']}" if result['server_flags']['device_bytes'] else ""))
    warmup = result["warmup"]
    print(f"warm-up first, not counted: {warmup['requests']} requests in {len(warmup['rounds'])} rounds "
          f"(bursts of {', '.join(map(str, warmup['bursts']))}), {warmup['seconds']:.0f} s, "
          f"{sum(r['compiles'] for r in warmup['rounds'])} XLA compilations; "
          + ("its last round compiled nothing" if warmup["quiet"] else "STILL COMPILING in its last round"))
    print(table(["phase", "clients", "requests", "completed", "failed", "lost", "tokens", "tokens/s", "tokens/req",
                 "p50 s", "p99 s", "mean batch", "prefix hits", "compiles", "compile s"],
                [[f"{p['phase']}", p["clients"], p["requests"], p["completed"], p["failed"], p["lost"],
                  int(p["generated_tokens"]), fmt(p["tokens_per_second"]), fmt(p["mean_completion_tokens"]),
                  fmt(p["latency_p50"], ".3f"), fmt(p["latency_p99"], ".3f"), fmt(p["mean_decode_batch"], ".2f"),
                  fmt(None if p["prefix_hit_rate"] is None else 100 * p["prefix_hit_rate"], ".0f") + "%", p["compiles"],
                  fmt(p["compile_seconds"])]
                 for p in (a, b)]))
    print(f"tokens/s B / A: {fmt(result['tokens_per_second_ratio'], '.2f')}x")
    for p in (a, b):
        if p["compiles"]:
            print(f"phase {p['phase']} includes {p['compiles']} XLA compilations ({p['compile_seconds']:.1f} s on the "
                  f"engine thread, every running request waiting): {p['compiled_functions']}")


def _print_bad_input(result: dict) -> None:
    """Each bad request's answer, the server's health while the 30 MiB prompt was read, the full
    queue's answers and the good request after them."""
    print("\nbad input (the server's answers)")
    print(table(["request", "expected", "status", "", "error body"],
                [[r["request"], r["expected"], r["status"], "ok" if r["as_expected"] else "UNEXPECTED",
                  " ".join(r["body"].split())[:100]] for r in result["bad_input"]], left=1))
    probe = result["bad_input"][-1]
    if probe.get("health_max_seconds") is not None:
        print(f"while the 30 MiB prompt was read and refused ({probe['seconds']:.2f} s): {probe['health_checks']} "
              f"GET /health, the slowest {probe['health_max_seconds']:.2f} s")
    overflow = result.get("queue_overflow")
    if overflow:
        print(f"\nfull queue: a second server (--max-queue 1 --max-batch 1), {overflow['requests']} concurrent "
              f"requests of max_tokens {overflow['max_tokens']} (ignore_eos)")
        print(table(["answer", "requests"],
                    [["200, all 200 tokens", overflow["completed"]],
                     [f"429, Retry-After {', '.join(overflow['retry_after']) or '-'}", overflow["status_429"]],
                     ["other", overflow["other"]]]))
    after = result["after_bad_input"]
    print(f"\nafter the bad input, a good request: {after['status']} "
          f"({after['completion_tokens']} tokens, {after['latency']:.2f} s, {after['compiles']} compilations)")


def _print_disconnects_and_shutdown(result: dict) -> None:
    """The sessions gauge around each disconnect, SIGTERM's exit, the server's 5xx answers."""
    print(f"\nclient disconnects: requests of {DISCONNECT_TOKENS} tokens (ignore_eos) left early; k3jax_sessions gauge")
    print(table(["request", "before", "while running", "after", "freed in s", "tokens generated", "cancelled"],
                [[d["request"], fmt(d["sessions_before"], ".0f"), fmt(d.get("sessions_while_running"), ".0f"),
                  fmt(d["sessions_after"], ".0f"), fmt(d["seconds_to_free"], ".2f") if d["freed"] else "NOT FREED",
                  int(d["generated_tokens"]), "yes" if d["cancelled"] else "NO (ran to its end)"]
                 for d in result["disconnects"]]))
    stop = result["shutdown"]
    print(f"\nSIGTERM: exit status {stop['exit_code']} after {stop['seconds']:.1f} s "
          f"(-15: ended by the signal, as eval.serve documents); tracebacks in its log: {stop['tracebacks']}")
    if result["server_5xx"]:
        print(f"5xx answers counted by the server: {result['server_5xx']}")


def measure(server: ServerProcess, args, run_dir: pathlib.Path, headers: dict, result: dict) -> None:
    """Everything measured on a started ``server``, into ``result``: warm-up, load phases A and B,
    bad input (with the full queue's second server), the good request after it, disconnects, the
    server's request counts."""
    requests = Requests(server.name, args.max_tokens, args.ignore_eos)
    timeout = args.client_timeout
    print("warm-up (compiling)", file=sys.stderr, flush=True)
    result["warmup"] = warm_up(server, headers, requests, args.clients, timeout, args.warmup_rounds)
    phases = [load_phase("A", server, headers, requests, 1, args.seconds, timeout),
              load_phase("B", server, headers, requests, args.clients, args.seconds, timeout)]
    result["phases"] = phases
    rates = [p["tokens_per_second"] for p in phases]
    result["tokens_per_second_ratio"] = rates[1] / rates[0] if all(rates) else None
    result["load_average_after_load"] = os.getloadavg()[0]

    print("bad input", file=sys.stderr, flush=True)
    result["bad_input"] = [send_bad(server, headers, request) for request in bad_requests(server.name)]
    result["bad_input"].append(blocking_probe(server, headers, server.name))
    if not args.skip_queue_overflow:
        result["queue_overflow"] = queue_overflow(run_dir, args.api_key, args)
    compiled = server.compiles()
    with httpx.Client(base_url=server.url, headers=headers, timeout=timeout) as client:
        after = send(client, requests.next(True)[0])
    result["after_bad_input"] = {**{k: after[k] for k in ("status", "outcome", "completion_tokens", "latency", "error")},
                                 **server.compiled_since(compiled)}

    print("client disconnects", file=sys.stderr, flush=True)
    result["disconnects"] = disconnects(server, headers, server.name, wait=30.0)
    with httpx.Client(base_url=server.url, headers=headers) as client:
        final = metrics(client)
    result["requests_total"] = {k: v for k, v in final.items() if k.startswith("k3jax_requests_total")}
    result["server_5xx"] = {k: v for k, v in result["requests_total"].items() if re.search(r'status="5\d\d"', k)}


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    run_dir, training = prepare_run(args)
    key = args.api_key
    headers = {"Authorization": f"Bearer {key}"}
    flags = ["--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue),
             "--max-model-len", str(args.max_model_len), "--api-key", key]
    if args.device_bytes is not None:
        flags += ["--device-bytes", args.device_bytes]
    result = {"run_dir": str(run_dir), **training, "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "load_average_start": os.getloadavg()[0], "max_tokens": args.max_tokens,
              "ignore_eos": args.ignore_eos, "temperature": 0.7, "system_prompt": SYSTEM,
              "server_flags": {"max_batch": args.max_batch, "max_queue": args.max_queue,
                               "max_model_len": args.max_model_len, "api_key": True,
                               "device_bytes": args.device_bytes}}
    print(f"starting the server on {run_dir}", file=sys.stderr, flush=True)
    server = ServerProcess(run_dir, flags, args.startup_timeout)
    try:
        result.update(server_command=" ".join(["python", *server.command[1:]]).replace(key, "KEY"),
                      model=server.name, startup_seconds=server.startup_seconds)
        measure(server, args, run_dir, headers, result)
    except BaseException:
        result["shutdown"] = server.stop()
        result["server_log_tail"] = server.log_tail(40)
        print(f"stopped early; what was measured: {write_json(args.out, result)}", file=sys.stderr)
        raise
    result["shutdown"] = server.stop()
    result["server_log_tail"] = server.log_tail(40)
    result["compiles_total"] = server.compiles()
    print_tables(result)
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
