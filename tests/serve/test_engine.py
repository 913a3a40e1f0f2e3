"""The engine's bounds: a full queue is a 429 with Retry-After, a cancelled job frees its sessions, a
job past its deadline is a 504, a failing prepare is a 400, and a stream the client closes early is
cancelled, and so is a plain request whose client disconnects -- the engine keeps serving after each."""
import asyncio
import json
import queue
import threading
import time

import numpy as np
import pytest

from eval.serve.engine import Engine, Job, Sequence, close_sessions, token_logprobs
from eval.serve.errors import ServeError
from k3jax.sessions import Sampling, SessionStore, prefill_in_turns
from tests.sessions.conftest import random_tokens


@pytest.fixture(scope="module")
def store(serving):
    """A store of its own over the served model (so the compiled programs are shared)."""
    return SessionStore(serving[1].model)


def job_of(prompt_length: int, max_tokens: int, deadline=None):
    """(job, events): one greedy sequence over a fresh session."""
    events: queue.Queue = queue.Queue()

    def prepare(store):
        return [Sequence(store.open(random_tokens(0, prompt_length)), Sampling(), max_tokens)]

    def finish(store, sequences):
        close_sessions(store, sequences)
        return [s.tokens for s in sequences]
    return Job(prepare, finish, events.put, deadline=deadline), events


def wait_for(events: queue.Queue, kind: str, timeout=120):
    while True:
        event = events.get(timeout=timeout)
        if event[0] in (kind, "error"):
            return event


def test_a_full_queue_is_a_429_with_retry_after_and_the_rest_run(store):
    engine = Engine(store, max_batch=1, max_queue=1)
    try:
        gate = threading.Event()
        engine.call(lambda store: gate.wait(60))          # hold the engine between steps
        first, first_events = job_of(4, 2)
        engine.submit(first)
        with pytest.raises(ServeError) as refused:
            engine.submit(job_of(4, 2)[0])
        assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}
        gate.set()
        assert wait_for(first_events, "result")[0] == "result"
        engine.submit(job_of(4, 2)[0])                       # room again
    finally:
        engine.shutdown(5)


def started_job(engine, tokens: int):
    """``(the store's sessions before, job, its events)`` of a job of ``tokens`` tokens submitted
    to ``engine``, returned once it has sampled its first token."""
    before = engine.call(lambda store: store.sessions()).result()
    job, events = job_of(4, tokens)
    engine.submit(job)
    assert wait_for(events, "token")[0] == "token"
    return before, job, events


def timed_out_and_serving(engine, events: queue.Queue, before: list[int]) -> None:
    """The job of ``events`` ended with a 504, the store holds the sessions ``before`` it again, and
    the engine serves the next job."""
    event = wait_for(events, "result")
    assert event[0] == "error" and event[1].status == 504
    assert engine.call(lambda store: store.sessions()).result() == before
    ok, ok_events = job_of(5, 3)
    engine.submit(ok)
    assert len(wait_for(ok_events, "result")[1][0]) == 3


def test_cancel_frees_the_sessions_and_a_deadline_is_a_504(store):
    engine = Engine(store)
    try:
        before, long, events = started_job(engine, 10_000)
        engine.cancel(long)
        deadline = time.monotonic() + 30
        while engine.call(lambda store: store.sessions()).result() != before:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        late, late_events = job_of(4, 10_000, deadline=time.monotonic() + 0.5)
        engine.submit(late)
        timed_out_and_serving(engine, late_events, before)
    finally:
        engine.shutdown(5)


def test_a_failing_prepare_is_a_400_and_shutdown_answers_waiting_jobs(store):
    engine = Engine(store)
    events: queue.Queue = queue.Queue()
    engine.submit(Job(lambda store: [Sequence(store.open([10**6]), Sampling(), 1)], None, events.put))
    event = wait_for(events, "result")
    assert event[0] == "error" and event[1].status == 400 and "token ids must lie in" in event[1].message
    gate = threading.Event()
    engine.call(lambda store: gate.wait(60))
    waiting, waiting_events = job_of(4, 2)
    engine.submit(waiting)
    threading.Timer(0.5, gate.set).start()
    engine.shutdown(0.1)
    event = wait_for(waiting_events, "result")                # still waiting when the stop came
    assert event[0] == "error" and event[1].status == 503
    with pytest.raises(ServeError) as refused:
        engine.submit(job_of(4, 2)[0])
    assert refused.value.status == 503


def test_token_logprobs_are_the_float64_log_softmax():
    logits = np.random.default_rng(0).standard_normal((3, 11)).astype(np.float32)
    tokens = [4, 0, 10]
    scores = token_logprobs(logits, tokens, top=3)
    reference = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    for row, (score, token) in enumerate(zip(scores, tokens)):
        assert score.logprob == pytest.approx(reference[row, token], abs=1e-12)
        assert [t for t, _ in score.top] == list(np.argsort(-reference[row])[:3])


def test_a_stream_closed_early_is_cancelled(serving):
    client, _, server = serving
    before = server.engine.call(lambda store: len(store.sessions())).result()
    with client.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 200, "stream": True,
                                                        "ignore_eos": True, "temperature": 1.0}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 30
    while server.engine.call(lambda store: len(store.sessions())).result() != before:
        assert time.monotonic() < deadline, "the closed stream's session was not freed"
        time.sleep(0.05)


def test_a_plain_request_whose_client_disconnects_is_cancelled(serving):
    """The app called as uvicorn calls it, with a client that leaves while its request decodes: the
    answer is a 499, the job stops early and its session is freed. The engine is held on a gate
    until the request's first check for a disconnect; the client leaves after that, while tokens
    are coming (the route must look again though events keep arriving)."""
    from tests.serve.conftest import KEY

    client, _, server = serving
    engine = server.engine
    sessions = lambda: engine.call(lambda store: len(store.sessions())).result()
    before, steps, generated = sessions(), engine.counters["decode_steps"], engine.counters["generation_tokens"]
    gate = threading.Event()
    engine.call(lambda store: gate.wait(60))
    body = json.dumps({"prompt": "abc", "max_tokens": 250, "ignore_eos": True, "temperature": 1.0}).encode()
    sent, delivered = [], []

    async def receive():
        if not delivered:
            delivered.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        if not gate.is_set():                        # the first check for a disconnect: let the job run
            gate.set()
        elif engine.counters["decode_steps"] > steps + 3:    # decoding steadily (compiled): the client is gone
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)                    # nothing to read (Starlette cancels this wait)

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(asyncio.wait_for(client.app(scope, receive, send), 120))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    deadline = time.monotonic() + 30
    while sessions() != before:
        assert time.monotonic() < deadline, "the disconnected request's session was not freed"
        time.sleep(0.05)
    assert engine.counters["generation_tokens"] - generated < 250


def test_a_waiting_request_looks_for_its_client_while_tokens_keep_coming():
    """`Server.run` over an engine that sends a token every 5 ms: the client leaves after 0.3 s and
    the request is cancelled (499) within a poll, not when the events pause."""
    from eval.serve.app import DISCONNECT_POLL_SECONDS, Server

    class TokenFlood:
        def __init__(self):
            self.cancelled = threading.Event()

        def submit(self, job):
            def emit():
                while not self.cancelled.wait(0.005):
                    job.notify(("token", 0, 1, None))
            threading.Thread(target=emit, daemon=True).start()

        def cancel(self, job):
            self.cancelled.set()

    class Plan:
        def job(self, notify, deadline):
            return Job(None, None, notify, deadline=deadline)

    class LeavingClient:
        def __init__(self):
            self.leaves = time.monotonic() + 0.3

        async def is_disconnected(self):
            return time.monotonic() > self.leaves

    engine = TokenFlood()
    server = Server(None, engine, None, api_key=None, request_timeout=60)
    client = LeavingClient()
    with pytest.raises(ServeError) as error:
        asyncio.run(asyncio.wait_for(server.run(Plan(), client), 10))
    assert error.value.status == 499 and engine.cancelled.is_set()
    assert time.monotonic() - client.leaves < DISCONNECT_POLL_SECONDS + 0.5


def prefilling_job(seed: int, prompt_length: int, max_tokens: int, turn_tokens: int, notify, deadline=None):
    """A job whose random prompt of ``prompt_length`` tokens (none cached: a ``seed`` of its own) is
    prefilled in turns of ``turn_tokens``."""
    def prepare(store):
        sid = yield from prefill_in_turns(store, random_tokens(seed, prompt_length), turn_tokens)
        return [Sequence(sid, Sampling(), max_tokens)]

    def finish(store, sequences):
        close_sessions(store, sequences)
        return [s.tokens for s in sequences]
    return Job(prepare, finish, notify, deadline=deadline)


def test_a_small_request_is_not_stuck_behind_a_long_prefill(store):
    """Admitted together, a long prompt's prefill turns and a short request's work interleave: the
    short one finishes before the long one samples anything (one prefill in a go would not let it)."""
    engine = Engine(store)
    try:
        order, done = [], threading.Event()
        gate = threading.Event()
        engine.call(lambda store: gate.wait(60))           # both arrive before either is admitted
        engine.submit(prefilling_job(101, 8 * store.page_size, 2, 16, lambda event: order.append(("long", event[0]))))
        engine.submit(prefilling_job(102, 8, 2, 16, lambda event: (order.append(("short", event[0])),
                                                               event[0] == "result" and done.set())))
        gate.set()
        assert done.wait(120)
        assert ("short", "result") in order and ("long", "token") not in order[: order.index(("short", "result"))]
    finally:
        engine.shutdown(30)


def test_a_deadline_passing_inside_one_prompts_prefill_is_a_504(store, monkeypatch):
    """Each turn of the prefill feeds one chunk and takes 0.1 s: the deadline stops the job after a
    few of its 11 turns, its session closed, and the engine serves the next job."""
    extend = store.extend

    def slow_extend(sid, tokens):
        time.sleep(0.1)
        return extend(sid, tokens)
    monkeypatch.setattr(store, "extend", slow_extend)
    fed = store.feeder.counts["prefill_tokens"]
    engine = Engine(store)
    try:
        before = engine.call(lambda store: store.sessions()).result()
        events: queue.Queue = queue.Queue()
        length = 12 * store.page_size
        engine.submit(prefilling_job(103, length, 2, 16, events.put, deadline=time.monotonic() + 0.35))
        timed_out_and_serving(engine, events, before)
        assert 0 < store.feeder.counts["prefill_tokens"] - fed <= length // 2 + 5   # (+ the next job's 5 tokens)
    finally:
        engine.shutdown(5)


def test_a_job_that_fits_passes_one_waiting_for_room_a_bounded_number_of_times(store, monkeypatch):
    """max_batch 2 with one sequence decoding: a two-sequence job waits for room, a one-sequence job
    behind it runs at once -- until the waiting one has been passed `MAX_BYPASSES` times."""
    from eval.serve import engine as engine_module
    monkeypatch.setattr(engine_module, "MAX_BYPASSES", 1)
    engine = Engine(store, max_batch=2)
    try:
        _, long, _ = started_job(engine, 10_000)
        pair, pair_events = job_of(4, 2)
        pair.sequences = 2                          # it claims the whole batch (prepare opens one)
        engine.submit(pair)
        small, small_events = job_of(4, 2)
        engine.submit(small)
        assert wait_for(small_events, "result")[0] == "result"      # passed the waiting pair
        later, later_events = job_of(4, 2)
        engine.submit(later)                        # the pair was passed once: its turn comes first
        time.sleep(1.0)
        assert pair_events.empty() and later_events.empty()
        engine.cancel(long)
        assert wait_for(pair_events, "result")[0] == "result"
        assert wait_for(later_events, "result")[0] == "result"
    finally:
        engine.shutdown(5)
