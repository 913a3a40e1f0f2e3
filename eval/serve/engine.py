"""The serving engine: one thread owns the model's `SessionStore` and runs continuous batching.

    submit(job)   any thread; past ``max_queue`` waiting jobs -> `ServeError` 429
    each turn     expire jobs past their deadline; admit waiting jobs while their sequences stay
                  within ``max_batch`` (one that fits may pass one that does not, a bounded number
                  of times: `Engine._admit`); one turn of each admitted job's preparation (``job.prepare
                  (store)`` prefills, opening or forking sessions -> its `Sequence`s; a generator
                  prefills a long prompt in turns of about `PREFILL_TURN_TOKENS`); one
                  `SessionStore.step` over every running sequence (requests join and leave between
                  steps); each token goes to its job's ``notify``; a job whose sequences all ended
                  runs ``job.finish(store)`` and sends its result

So a long prefill holds no one up: it advances one turn at a time beside every other job's
prefill turns and decode steps (chunked prefill), and a deadline is checked at every turn.

With a ``speculator`` (`k3jax.sessions.speculate.Speculator`) each turn is one speculative round
instead: every running sequence emits one or more tokens (up to its remaining ``max_tokens``, none
after a stop id), with the tokens, text and log-probs plain steps would give (greedy: the same
tokens; sampled: the same distribution). A sequence asking for top log-prob alternatives needs the
logits of every position, so it takes a plain step beside the round. A stop string completed
inside a round ends the sequence there: its session is rolled back to before the round and fed the
kept tokens, holding exactly what plain decoding would have fed.

Everything that touches the store runs on this thread (`Engine.call` for one-off work: forking a
stored response, reading the store's stats), so the store needs no lock. A cancelled job (its client
went away) or one past its deadline is aborted between steps and its sessions closed.

Events a job's ``notify`` receives, in order: ``("token", index, token, logprob)`` per sampled token
(``logprob`` a `TokenLogprob` when the sequence asked for log-probs, else None), ``("end", index,
finish_reason)`` per sequence, then ``("result", value)`` -- or ``("error", ServeError)`` at any point.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import inspect
import logging
import queue
import threading
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from k3jax.sampling import log_softmax
from k3jax.sessions import Sampling, SessionStore, prefill_in_turns
from .errors import ServeError, job_error, server_error

log = logging.getLogger("k3jax.serve")

PREFILL_TURN_TOKENS = 512   # prompt tokens a job prefills per engine turn (`k3jax.sessions.prefill_in_turns`)
MAX_BYPASSES = 64           # jobs that may be admitted ahead of a waiting one too large for the batch's room


class TokenLogprob(NamedTuple):
    """The log-probability of a token under the model (log-softmax of its logits, no temperature or
    top-p), and the ``top`` (token, log-prob) pairs, most likely first."""

    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: np.ndarray, tokens, top: int) -> list[TokenLogprob]:
    """`TokenLogprob` of ``tokens[i]`` under ``logits[i]`` ``[N, vocab]`` (float64 log-softmax)."""
    logprobs = log_softmax(np.asarray(logits).reshape(len(tokens), -1))
    result = []
    for row, token in zip(logprobs, tokens):
        best = np.argsort(-row, kind="stable")[:top] if top else []
        result.append(TokenLogprob(float(row[token]), [(int(i), float(row[i])) for i in best]))
    return result


@dataclasses.dataclass
class Sequence:
    """One sequence being decoded (a choice of a request) in session ``sid``."""

    sid: int
    sampling: Sampling
    max_tokens: int
    stop_ids: frozenset = frozenset()
    top_logprobs: int | None = None        # None: no log-probs; k: the token's and the k most likely
    text_stops: bool = False               # its job's ``stopped`` may end it inside a speculative round
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)   # a TokenLogprob per token (with top_logprobs)
    finish_reason: str | None = None


class Job:
    """One request's work on the engine thread.

    ``prepare(store) -> [Sequence]`` prefills (may raise `ServeError` or ValueError, a 400); a
    generator function's ``prepare`` yields between its turns of work and returns the sequences;
    ``stopped(sequence) -> bool`` says whether text-level stop conditions end a sequence after its
    latest token; ``finish(store, sequences) -> result`` runs when every sequence has ended (close
    or keep the sessions); ``abort(store, sequences)`` when the job is cancelled or fails (close
    them). ``sequences`` counts the sequences ``prepare`` will make (for ``max_batch``); ``adapter``
    is the tag of the LoRA adapter its sessions run on ("" the base)."""

    def __init__(self, prepare: Callable, finish: Callable, notify: Callable, *, sequences: int = 1,
                 stopped: Callable | None = None, abort: Callable | None = None, deadline: float | None = None,
                 adapter: str = ""):
        self.prepare, self.finish, self.notify, self.sequences = prepare, finish, notify, sequences
        self.adapter = adapter
        self.stopped = stopped or (lambda sequence: False)
        self.abort = abort or close_sessions
        self.deadline = deadline
        self.cancelled = False
        self.running: list[Sequence] = []
        self.bypassed = 0                   # jobs admitted ahead of it while it waited for room
        self.preparation = None             # while admitted and preparing: its generator
        self.opened: set[int] = set()       # sessions its work opened (closed if it fails)


def close_sessions(store: SessionStore, sequences) -> None:
    for sequence in sequences:
        if sequence.sid in store.sessions():
            store.close(sequence.sid)


def open_in_turns(store: SessionStore, prompt: list[int], adapter: str = ""):
    """A generator opening a session on ``prompt`` (served by LoRA adapter ``adapter``, "" the base)
    in turns (`prefill_in_turns`, a `Job`'s ``prepare`` yields from it) -> (the session, how many prompt tokens were resumed from the prefix
    cache rather than prefilled: the rise of the store's ``prefix_tokens_reused`` counter across the
    first turn, whose `SessionStore.open` alone looks the prefix up; other jobs run only at yields)."""
    before = store.stats()["prefix_tokens_reused"]
    turns = prefill_in_turns(store, prompt, PREFILL_TURN_TOKENS, adapter=adapter)
    try:
        next(turns)
    except StopIteration as done:
        return done.value, store.stats()["prefix_tokens_reused"] - before
    cached = store.stats()["prefix_tokens_reused"] - before
    yield
    sid = yield from turns
    return sid, cached


class Engine:
    """The loop thread over ``store``; see the module docstring."""

    def __init__(self, store: SessionStore, *, max_batch: int = 64, max_queue: int = 256, speculator=None):
        """``speculator``: a `k3jax.sessions.speculate.Speculator` over ``store`` (None: plain steps)."""
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
        self.store, self.max_batch, self.max_queue, self.speculator = store, max_batch, max_queue, speculator
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: collections.deque[Job] = collections.deque()
        self._queued = 0                      # submitted and not yet admitted (guarded by _lock)
        self._lock = threading.Lock()
        self._accepting = True
        self._preparing: list[Job] = []       # admitted, prefilling in turns
        self._jobs: list[Job] = []            # admitted, running
        self.counters = collections.Counter()
        self.last_batch = 0
        self._thread = threading.Thread(target=self._loop, name="k3jax-serve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def submit(self, job: Job) -> None:
        """Queue ``job``: a 400 when it brings more sequences than ``max_batch`` (they could never
        decode together), a 503 once shutting down, a 429 past ``max_queue`` waiting jobs."""
        if job.sequences > self.max_batch:
            raise ServeError(400, f"the request asks for {job.sequences} sequences (prompts x n); this server "
                             f"decodes at most {self.max_batch} together (--max-batch)", param="n")
        with self._lock:
            if not self._accepting:
                raise ServeError(503, "the server is shutting down", "server_error")
            if self._queued >= self.max_queue:
                raise ServeError(429, f"the queue is full ({self.max_queue} requests waiting); retry later",
                                 "rate_limit_error", headers={"Retry-After": "1"})
            self._queued += 1
        self._inbox.put(("job", job))

    def cancel(self, job: Job) -> None:
        """Abort ``job`` between steps (its client went away); nothing is sent to it afterwards."""
        job.cancelled = True
        self._inbox.put(("cancel", job))

    def call(self, function: Callable[[SessionStore], Any]) -> concurrent.futures.Future:
        """Run ``function(store)`` on the engine thread, between steps -> a future of its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", function, future))
        return future

    def uses_adapter(self, tag: str) -> bool:
        """Whether an admitted job (preparing or running) runs on adapter ``tag`` (engine thread)."""
        return any(job.adapter == tag for job in (*self._preparing, *self._jobs))

    @property
    def queue_depth(self) -> int:
        return self._queued

    def speculation(self) -> dict | None:
        """The speculator's counters (`k3jax.speculative.SpeculationStats.as_dict`); None when
        speculation is off. Read on the engine thread (`call`) for a consistent set."""
        return None if self.speculator is None else self.speculator.stats.as_dict()

    def shutdown(self, drain_seconds: float, on_stop: Callable[[SessionStore], None] | None = None) -> None:
        """Stop accepting jobs; let running and waiting ones finish for up to ``drain_seconds``,
        answer the rest with 503; run ``on_stop(store)`` (saving state) on the engine thread; stop."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + drain_seconds
        while time.monotonic() < deadline and (self._jobs or self._preparing or self._waiting or self._queued):
            time.sleep(0.05)
        self._inbox.put(("stop", on_stop))
        self._thread.join()

    # ------------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        while True:
            for command in self._commands(block=not self._jobs and not self._preparing and not self._waiting):
                if command[0] == "stop":
                    self._stop(command[1])
                    return
                self._handle(command)
            try:
                self._expire()
                self._admit()
                for job in list(self._preparing):
                    self._advance(job)
                if self._jobs:
                    self._step()
            except Exception as error:              # the batched step itself: fail the running jobs, keep serving
                log.exception("engine step failed")
                for job in list(self._jobs):
                    self._fail(job, server_error(error))

    def _commands(self, block: bool):
        """The inbox's commands: waiting up to 0.5 s for the first when ``block`` (nothing to run)."""
        try:
            yield self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                yield self._inbox.get_nowait()
        except queue.Empty:
            return

    def _handle(self, command) -> None:
        kind = command[0]
        if kind == "job":
            self._waiting.append(command[1])
        elif kind == "cancel":
            job = command[1]
            if job in self._waiting:
                self._waiting.remove(job)
                self._dequeued()
            if job in self._jobs or job in self._preparing:
                self._drop(job)
        elif kind == "call":
            _, function, future = command
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(function(self.store))
                except BaseException as error:   # handed to the caller
                    future.set_exception(error)

    def _dequeued(self) -> None:
        with self._lock:
            self._queued -= 1

    def _expire(self) -> None:
        now = time.monotonic()
        for job in [job for job in (*self._waiting, *self._preparing, *self._jobs)
                    if job.deadline is not None and now > job.deadline]:
            if job in self._waiting:
                self._waiting.remove(job)
                self._dequeued()
                self.counters["timeouts"] += 1
                job.notify(("error", ServeError(504, "the request passed its deadline while queued", "timeout_error")))
            else:
                self.counters["timeouts"] += 1
                self._fail(job, ServeError(504, "the request passed its deadline", "timeout_error"))

    def _running_sequences(self) -> int:
        """The sequences of running jobs, and those preparing jobs will bring."""
        return sum(len(job.running) for job in self._jobs) + sum(job.sequences for job in self._preparing)

    def _admit(self) -> None:
        """Admit waiting jobs in order while their sequences fit ``max_batch``. A job that fits may
        pass the first one that does not, up to `MAX_BYPASSES` times in all; then nothing passes it
        until it runs (a small request is not stuck behind a large one, nor a large one starved)."""
        blocked = None
        for job in list(self._waiting):
            if job.cancelled:
                self._waiting.remove(job)
                self._dequeued()
                continue
            if (self._jobs or self._preparing) and self._running_sequences() + job.sequences > self.max_batch:
                if blocked is None:
                    blocked = job
                    if job.bypassed >= MAX_BYPASSES:
                        return
                continue
            if blocked is not None:
                blocked.bypassed += 1
            self._waiting.remove(job)
            self._dequeued()
            prepared, preparation = self._alone(job, lambda: job.prepare(self.store))
            if not prepared:
                continue
            if inspect.isgenerator(preparation):
                job.preparation = preparation
                self._preparing.append(job)
            else:
                self._start(job, list(preparation))

    def _advance(self, job: Job) -> None:
        """One turn of ``job``'s preparation; at its end the job runs."""
        def turn():
            try:
                next(job.preparation)
            except StopIteration as done:
                return list(done.value)
            return None
        advanced, running = self._alone(job, turn)
        if not advanced or running is not None:
            self._preparing.remove(job)
            job.preparation = None
        if advanced and running is not None:
            self._start(job, running)

    def _start(self, job: Job, running: list[Sequence]) -> None:
        """``job`` prepared: its ``running`` sequences join the decode (those of no tokens end now)."""
        job.running = running
        self.counters["prompt_tokens"] += sum(len(self.store.tokens(s.sid)) for s in job.running)
        self._jobs.append(job)
        for index, sequence in enumerate(job.running):
            if sequence.max_tokens == 0:
                sequence.finish_reason = "length"
                job.notify(("end", index, "length"))
        self._finish_if_done(job)

    def _step(self) -> None:
        """One turn of every running sequence: a plain step, or a speculative round (see the
        module docstring); each emitted token is delivered until its sequence ends."""
        live = [(job, index, sequence) for job in self._jobs for index, sequence in enumerate(job.running)
                if sequence.finish_reason is None]
        sequences = [sequence for _, _, sequence in live]
        if self.speculator is None:
            emitted, snapshots = self._plain_step(sequences), {}
        else:
            plain = [sequence for sequence in sequences if sequence.top_logprobs]
            speculative = [sequence for sequence in sequences if not sequence.top_logprobs]
            snapshots = {sequence.sid: self.store.snapshot(sequence.sid) for sequence in speculative
                         if sequence.text_stops}
            emitted = {**self._plain_step(plain), **self._round(speculative)}
        self.last_batch = len(emitted)
        self.counters["decode_steps"] += 1
        for job, index, sequence in live:
            if job not in self._jobs:               # failed on an earlier sequence of this step
                continue
            tokens = emitted.get(sequence.sid, [])
            delivered = 0
            try:
                while delivered < len(tokens) and sequence.finish_reason is None:
                    self._deliver(job, index, sequence, *tokens[delivered])
                    delivered += 1
                if delivered < len(tokens):
                    self._cut_back(sequence.sid, snapshots[sequence.sid], [token for token, _ in tokens[:delivered]])
            except Exception as error:              # its stop rule or its client's queue: this job's alone
                self._fail(job, self._failure(error))
            self.counters["generation_tokens"] += delivered
        for job in list(self._jobs):
            self._finish_if_done(job)

    def _plain_step(self, sequences: list[Sequence]) -> dict[int, list[tuple[int, TokenLogprob | None]]]:
        """One `SessionStore.step` over ``sequences`` -> {session id: [(token, its `TokenLogprob`
        or None)]} for those that stepped (the store may leave some out for lack of room)."""
        if not sequences:
            return {}
        before = {sequence.sid: self.store.logits(sequence.sid) for sequence in sequences
                  if sequence.top_logprobs is not None}
        tokens = self.store.step({sequence.sid: sequence.sampling for sequence in sequences})
        emitted = {}
        for sequence in sequences:
            if sequence.sid in tokens:
                token = tokens[sequence.sid]
                logprob = None if sequence.top_logprobs is None else \
                    token_logprobs(before[sequence.sid][None], [token], sequence.top_logprobs)[0]
                emitted[sequence.sid] = [(token, logprob)]
        return emitted

    def _round(self, sequences: list[Sequence]) -> dict[int, list[tuple[int, TokenLogprob | None]]]:
        """One `Speculator.round` over ``sequences`` (none asks for top alternatives; each with its
        own stop ids) -> as `_plain_step`. A round the device budget cannot hold raises ValueError
        with every session as it was (the running jobs fail, as after any failed step)."""
        if not sequences:
            return {}
        results = self.speculator.round({sequence.sid: sequence.sampling for sequence in sequences},
                                        limits={s.sid: s.max_tokens - len(s.tokens) for s in sequences},
                                        stop_ids={s.sid: s.stop_ids for s in sequences})
        emitted = {}
        for sequence in sequences:
            result = results[sequence.sid]
            emitted[sequence.sid] = [(token, None if sequence.top_logprobs is None else TokenLogprob(logprob, []))
                                     for token, logprob in zip(result.tokens, result.logprobs)]
        return emitted

    def _deliver(self, job: Job, index: int, sequence: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        """``token`` to its sequence and job; the sequence ends after a stop id or stop string, or
        at ``max_tokens``."""
        sequence.tokens.append(token)
        if logprob is not None:
            sequence.logprobs.append(logprob)
        job.notify(("token", index, token, logprob))
        if token in sequence.stop_ids or job.stopped(sequence):
            sequence.finish_reason = "stop"
        elif len(sequence.tokens) >= sequence.max_tokens:
            sequence.finish_reason = "length"
        if sequence.finish_reason is not None:
            self._leave([sequence])
            job.notify(("end", index, sequence.finish_reason))

    def _cut_back(self, sid: int, handle, kept: list[int]) -> None:
        """Session ``sid`` back to ``handle`` (its snapshot from before the round) and fed the
        ``kept`` tokens of the round: the ones after a stop string are not in its history."""
        self.store.rollback(sid, handle)
        self.store.append(sid, kept)

    def _leave(self, sequences) -> None:
        """The speculator forgets ``sequences`` (ended, cancelled or failed)."""
        if self.speculator is not None:
            for sequence in sequences:
                self.speculator.leave(sequence.sid)

    def _finish_if_done(self, job: Job) -> None:
        if job in self._jobs and all(sequence.finish_reason is not None for sequence in job.running):
            self._jobs.remove(job)
            finished, result = self._alone(job, lambda: job.finish(self.store, job.running))
            if finished:
                job.notify(("result", result))

    def _alone(self, job: Job, work: Callable[[], Any]) -> tuple[bool, Any]:
        """``work()``, a step of ``job``'s own (a turn of its preparation, or its finishing) ->
        (True, its result); the sessions it opened join ``job.opened``. Whatever it raises ends this
        job alone: the sessions it and the job's earlier turns opened, and the job's, are closed,
        the job is answered with the error (`job_error`) -> (False, None)."""
        before = set(self.store.sessions())
        try:
            result = work()
        except Exception as error:
            job.opened |= set(self.store.sessions()) - before
            failure = self._failure(error)
            self._close_opened(job)
            job.notify(("error", failure))
            return False, None
        job.opened |= set(self.store.sessions()) - before
        return True, result

    def _close_opened(self, job: Job) -> None:
        """Close what is left of the sessions ``job`` opened and its running ones."""
        left = job.opened | {sequence.sid for sequence in job.running}
        for sid in left & set(self.store.sessions()):
            self.store.close(sid)

    def _failure(self, error: Exception) -> ServeError:
        """`job_error` of what one job's work raised; an unexpected one (a 500) logged with its traceback."""
        failure = job_error(error)
        if failure.status >= 500:
            log.error("a request failed on the engine thread", exc_info=error)
        return failure

    def _drop(self, job: Job) -> None:
        if job in self._preparing:                  # mid-preparation: no sequence runs yet
            self._preparing.remove(job)
            job.preparation.close()
            self._close_opened(job)
            return
        self._jobs.remove(job)
        self._leave(job.running)
        job.abort(self.store, job.running)

    def _fail(self, job: Job, error: ServeError) -> None:
        if job in self._jobs or job in self._preparing:
            self._drop(job)
        job.notify(("error", error))

    def _stop(self, on_stop) -> None:
        for job in list(self._waiting):
            job.notify(("error", ServeError(503, "the server shut down before the request ran", "server_error")))
            self._dequeued()
        self._waiting.clear()
        for job in [*self._preparing, *self._jobs]:
            self._fail(job, ServeError(503, "the server shut down during the request", "server_error"))
        while True:                                 # answer what is still in the inbox
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if command[0] == "job":
                self._dequeued()
                command[1].notify(("error", ServeError(503, "the server is shutting down", "server_error")))
            elif command[0] == "call":
                self._handle(command)
        if on_stop is not None:
            on_stop(self.store)
