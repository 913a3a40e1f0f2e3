"""``/v1/completions`` and ``/v1/chat/completions``: a request read into a plan, the plan's work on
the engine thread (`Job`), its response body, and its streamed chunks.

Completions: one prompt (text, token ids) or a list of them; ``n`` choices each, the first choice of
a prompt prefilled and the others forked from it (KDA state copied, MLA pages shared). ``echo``
with ``logprobs`` scores the prompt too (``token_logprobs[0]`` is null), which is what
lm-evaluation-harness's loglikelihood requests read. Chat: the messages (and ``tools``) rendered
in K3's chat format with the generation prompt (with the request's thinking and effort); the reply
read back (`ChatEncoder.parse_reply`) into ``content``, ``reasoning_content`` and ``tool_calls`` --
never chat markup in ``content``. Streams and stop strings read each token once (`StreamState`:
`ReplyReader` or `CompletionText`, and `eval.serve.params.HeldText`), in time linear in the reply.
"""
from __future__ import annotations

import json
import time
import uuid

import numpy as np

from k3jax.data import DataError
from k3jax.data.chat_format import ReplyReader
from k3jax.sessions import prefill_in_turns
from .engine import PREFILL_TURN_TOKENS, Job, Sequence, close_sessions, open_in_turns, token_logprobs
from .errors import ServeError, bad, error_body
from .model import ServedModel
from .params import HeldText, StopFinder
from .protocol import ChatRequest, Choices, CompletionRequest
from . import constraints, params


def _prompts(served: ServedModel, prompt) -> list[list[int]]:
    """A checked ``prompt`` (text, token ids, or a list of either) -> token id lists."""
    if isinstance(prompt, str):
        return [served.encode(prompt)]
    if isinstance(prompt[0], int):
        return [served.check_ids(prompt, "prompt")]
    return [ids for entry in prompt for ids in _prompts(served, entry)]


class _Choices:
    """What completions and chat share: n choices per prompt, their sampling and stop rules."""

    chunk_object: str       # the ``object`` of a streamed chunk

    def __init__(self, served: ServedModel, request: Choices, prompts: list[list[int]], max_tokens_default: int | None,
                 max_tokens: int | None):
        self.served, self.prompts = served, prompts
        self.model, self.adapter = params.model_choice(request, served)
        self.n = request.n
        self.temperature, self.top_p, self.seed = params.sampling(request)
        self.stops = request.stop
        self.stream, self.include_usage = request.stream, request.include_usage
        longest = max(len(p) for p in prompts)
        room = served.max_model_len - longest
        if room < 0:
            served.check_length(longest, 0)
        default = room if max_tokens_default is None else min(max_tokens_default, room)
        self.max_tokens = default if max_tokens is None else max_tokens
        for prompt in prompts:
            served.check_length(len(prompt), self.max_tokens)
        self.ignore_eos = request.ignore_eos
        self.created = int(time.time())
        self.cached_tokens = 0        # prompt tokens resumed from the prefix cache (`prepare`)
        self.watches: dict[int, list] = {}     # session id -> [reader, StopFinder, tokens read] (`stopped`)
        self.options = params.logits_options(request, served.vocab_size)
        self.stop_token_ids = frozenset(request.stop_token_ids)
        self.grammar: str | None = None         # the output's grammar (`eval.serve.constraints`): set by the plan

    def constrain(self, grammar: str | None, param: str) -> None:
        """Every choice keeps to ``grammar`` (None: nothing); ``ignore_eos`` cannot stand beside it."""
        if grammar is not None and self.ignore_eos:
            raise ServeError(400, "ignore_eos: the output ends where its grammar ends; leave ignore_eos out",
                             param="ignore_eos")
        self.grammar, self.grammar_param = grammar, param

    def sequence(self, sid: int, choice: int, top_logprobs: int | None, generated_from: int) -> Sequence:
        """Choice ``choice`` in session ``sid`` (whose prompt is its first ``generated_from`` tokens)."""
        stop_ids = frozenset() if self.ignore_eos or self.served.eos_id is None else frozenset([self.served.eos_id])
        constraint = None
        if self.grammar is not None:
            from k3jax.grammar import Constraint
            constraint = Constraint(self.served.grammar_vocabulary(self.grammar_param), self.grammar)
        sampling = params.choice_sampling(self.temperature, self.top_p, self.seed, choice, self.options, generated_from,
                                          constraint)
        return Sequence(sid, sampling, self.max_tokens, stop_ids | self.stop_token_ids, top_logprobs,
                        text_stops=bool(self.stops))

    def cut(self, text: str) -> str:
        """``text`` up to its first stop string."""
        found = StopFinder(self.stops).feed(text) if self.stops else None
        return text if found is None else text[:found]

    def stopped(self, sequence: Sequence) -> bool:
        """Whether a stop string has appeared in the sequence's text (each token read once: a reader
        and a `StopFinder` per sequence, kept on the engine thread)."""
        if not self.stops:
            return False
        watch = self.watches.setdefault(sequence.sid, [self.reader(), StopFinder(self.stops), 0])
        reader, finder, read = watch
        watch[2] = len(sequence.tokens)
        return any(finder.feed(reader.feed(token)[1]) is not None for token in sequence.tokens[read:])

    def usage(self, sequences, reasoning_tokens: int = 0) -> dict:
        """OpenAI's usage, with the prompt tokens resumed from the prefix cache (``cached_tokens``)
        and the completion tokens written in the thinking channel (``reasoning_tokens``)."""
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(s.tokens) for s in sequences)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}

    # ---------------------------------------------------------------- streaming
    named_events, done_marker = False, True      # server-sent events "data: ..." ending in "[DONE]" (`Server.chunks`)

    def opening_chunks(self, state) -> list[dict]:
        """The chunks a stream starts with, before any token."""
        return []

    def closing_chunks(self, event: tuple) -> list[dict]:
        """The chunks of the job's end: its error, or (``stream_options.include_usage``) a last
        chunk with no choices and the request's usage."""
        if event[0] == "error":
            return [error_body(event[1])]
        if event[0] == "result" and self.include_usage:
            return [{"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                     "choices": [], "usage": event[1]["usage"]}]
        return []


class CompletionPlan(_Choices):
    """A ``/v1/completions`` request."""

    object = chunk_object = "text_completion"

    def __init__(self, served: ServedModel, body: dict | CompletionRequest):
        request = CompletionRequest.parse(body)
        super().__init__(served, request, _prompts(served, request.prompt), 16, request.max_tokens)
        self.echo = request.echo
        self.logprobs = request.logprobs
        self.id = f"cmpl-{uuid.uuid4().hex}"
        grammar = constraints.content_grammar(request, lambda: served.grammar_vocabulary("structured_outputs"))
        if grammar is not None:
            self.constrain(*grammar)
        self.prompt_scores: dict[int, list] = {}

    def job(self, notify, deadline) -> Job:
        return Job(self.prepare, self.finish, notify, sequences=len(self.prompts) * self.n, stopped=self.stopped,
                   deadline=deadline, adapter=self.adapter)

    # ---------------------------------------------------------------- engine thread
    def prepare(self, store):
        """Each prompt prefilled in turns (``echo`` with ``logprobs``: scored), its other choices
        forked: a generator (`Job`); a failure here closes what was opened (the engine's)."""
        sequences = []
        for number, prompt in enumerate(self.prompts):
            if self.echo and self.logprobs is not None:
                first = store.open(prompt[:1], adapter=self.adapter)   # every prompt position's logits: no prefix reuse
                logits = [store.logits(first)[None]]
                yield from prefill_in_turns(store, prompt[1:], PREFILL_TURN_TOKENS, sid=first, logits=logits)
                scores = token_logprobs(np.concatenate(logits)[:-1], prompt[1:], self.logprobs) if len(prompt) > 1 else []
                self.prompt_scores[number] = [None] + scores
            else:
                first, cached = yield from open_in_turns(store, prompt, self.adapter)
                self.cached_tokens += cached
            sids = [first] + [store.fork(first) for _ in range(self.n - 1)]
            sequences += [self.sequence(sid, choice, self.logprobs, len(prompt)) for choice, sid in enumerate(sids)]
        return sequences

    def reader(self) -> "CompletionText":
        return CompletionText(self.served, None if self.ignore_eos else self.served.eos_id)

    def finish(self, store, sequences) -> dict:
        close_sessions(store, sequences)
        choices = [self.choice(index, sequence) for index, sequence in enumerate(sequences)]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(sequences)}

    # ---------------------------------------------------------------- bodies
    def generated(self, sequence: Sequence) -> tuple[list[int], str]:
        """The tokens the choice's text shows (EOS left out) and that text, cut at a stop string."""
        tokens = [t for t in sequence.tokens if t != self.served.eos_id or self.ignore_eos]
        return tokens, self.cut(self.served.decode(tokens))

    def choice(self, index: int, sequence: Sequence) -> dict:
        number = index // self.n
        tokens, text = self.generated(sequence)
        prompt_text = self.served.decode(self.prompts[number]) if self.echo else ""
        logprobs = None
        if self.logprobs is not None:
            pieces, scores = [], []
            if self.echo:
                pieces += list(self.prompts[number])
                scores += self.prompt_scores.get(number) or [None] * len(self.prompts[number])
            pieces += sequence.tokens
            scores += sequence.logprobs
            logprobs = self.logprobs_body(pieces, scores)
        return {"index": index, "text": prompt_text + text, "logprobs": logprobs,
                "finish_reason": sequence.finish_reason}

    def logprobs_body(self, tokens: list[int], scores: list) -> dict:
        """The legacy completions ``logprobs`` object: tokens, token_logprobs, top_logprobs, text_offset."""
        pieces = [self.served.piece(t) for t in tokens]
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        top = []
        for score in scores:
            if score is None:
                top.append(None)
                continue
            entry = {}
            for token, value in score.top:
                entry.setdefault(self.served.piece(token), value)
            top.append(entry)
        return {"tokens": pieces, "token_logprobs": [None if s is None else s.logprob for s in scores],
                "top_logprobs": top, "text_offset": offsets}

    # ---------------------------------------------------------------- streaming
    def stream_state(self) -> "StreamState":
        return StreamState(self, len(self.prompts) * self.n)

    def stream_chunks(self, state: "StreamState", event: tuple) -> list[dict]:
        """The chunks an engine event streams: each token its text (maybe empty), the end the rest."""
        if event[0] == "token":
            _, index, token, logprob = event
            return [self.chunk(index, state.advance(index, token)[1], logprob, token)]
        if event[0] == "end":
            _, index, reason = event
            return [self.chunk(index, state.advance(index, None)[1], finish_reason=reason)]
        return self.closing_chunks(event)

    def chunk(self, index: int, delta: str, logprob=None, token: int | None = None, finish_reason=None) -> dict:
        logprobs = None
        if logprob is not None and token is not None:
            logprobs = self.logprobs_body([token], [logprob])
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [{"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


class CompletionText:
    """A completion's text read one token at a time (`ServedModel.text_decoder`; ``skip``, the EOS
    id, left out), with `ReplyReader`'s interface: ``feed(token)`` / ``close()`` -> ("", text added)."""

    def __init__(self, served: ServedModel, skip: int | None):
        self.decoder, self.skip = served.text_decoder(), skip

    def feed(self, token: int) -> tuple[str, str]:
        return "", "" if token == self.skip else self.decoder.feed(token)

    def close(self) -> tuple[str, str]:
        return "", self.decoder.flush()


class StreamState:
    """Per choice of a streamed request: its reader (`ReplyReader` or `CompletionText`: each token
    read once, so a stream costs time linear in its length) and its content held back for stop
    strings (`HeldText`); reasoning is sent as it comes."""

    def __init__(self, plan, choices: int):
        self.readers = [plan.reader() for _ in range(choices)]
        self.content = [HeldText(plan.stops) for _ in range(choices)]

    def advance(self, index: int, token: int | None) -> tuple[str, str]:
        """(reasoning, content) to send after ``token`` (None: the end, the rest)."""
        reader = self.readers[index]
        reasoning, content = reader.feed(token) if token is not None else reader.close()
        return reasoning, self.content[index].push(content, final=token is None)


class ChatPlan(_Choices):
    """A ``/v1/chat/completions`` request."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, served: ServedModel, body: dict | ChatRequest):
        request = ChatRequest.parse(body)
        self.chat = served.require_chat()
        self.thinking, self.effort = params.chat_reasoning(request.reasoning_effort, request.chat_template_kwargs,
                                                            self.chat)
        tools = None if request.tool_choice == "none" else request.tools or None
        try:
            prompt = served.chat_prompt(request.messages, tools, self.thinking, self.effort)
        except DataError as error:
            raise ServeError(400, str(error), param="messages") from None
        max_tokens = request.max_tokens if request.max_completion_tokens is None else request.max_completion_tokens
        super().__init__(served, request, [prompt.tolist()], None, max_tokens)
        self.logprobs, self.top_logprobs = request.logprobs, request.top_logprobs
        if self.top_logprobs and not self.logprobs:
            raise bad("top_logprobs", "needs logprobs: true")
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.constrain(constraints.chat_grammar(request, tools, self.chat.thinking,
                                                lambda: served.grammar_vocabulary("response_format")), "response_format")

    def job(self, notify, deadline) -> Job:
        return Job(self.prepare, self.finish, notify, sequences=self.n, stopped=self.stopped, deadline=deadline,
                   adapter=self.adapter)

    def prepare(self, store):
        """The prompt prefilled in turns, its other choices forked: a generator (`Job`)."""
        first, self.cached_tokens = yield from open_in_turns(store, self.prompts[0], self.adapter)
        sids = [first] + [store.fork(first) for _ in range(self.n - 1)]
        return [self.sequence(sid, choice, self.top_logprobs if self.logprobs else None, len(self.prompts[0]))
                for choice, sid in enumerate(sids)]

    def reader(self) -> ReplyReader:
        return ReplyReader(self.chat.encoder, self.thinking)

    def finish(self, store, sequences) -> dict:
        for sequence in sequences:       # the next turn re-sends this history: let it resume here
            store.cache_prefix(sequence.sid)
        close_sessions(store, sequences)
        replies = [self.chat.encoder.parse_reply(sequence.tokens, self.thinking) for sequence in sequences]
        choices = [self.choice(index, sequence, reply) for index, (sequence, reply) in enumerate(zip(sequences, replies))]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(sequences, sum(reply.reasoning_tokens for reply in replies))}

    def message(self, reply, finish_reason: str) -> tuple[dict, str]:
        """The assistant message of a finished choice's `Reply` and its finish reason."""
        content = self.cut(reply.content)
        message = {"role": "assistant", "content": content}
        if self.thinking:
            message["reasoning_content"] = reply.reasoning
        reason = finish_reason
        if reply.tool_calls and content == reply.content:
            message["tool_calls"] = tool_calls(reply.tool_calls)
            message["content"] = content or None
            if reason == "stop":
                reason = "tool_calls"
        return message, reason

    def choice(self, index: int, sequence: Sequence, reply) -> dict:
        message, reason = self.message(reply, sequence.finish_reason)
        logprobs = {"content": self.logprob_entries(sequence.tokens, sequence.logprobs)} if self.logprobs else None
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def logprob_entries(self, tokens, scores) -> list[dict]:
        def entry(token, value):
            piece = self.served.piece(token)
            return {"token": piece, "logprob": value, "bytes": list(piece.encode())}
        return [{**entry(token, score.logprob), "top_logprobs": [entry(t, v) for t, v in score.top]}
                for token, score in zip(tokens, scores)]

    # ---------------------------------------------------------------- streaming
    def stream_state(self) -> StreamState:
        return StreamState(self, self.n)

    def opening_chunks(self, state) -> list[dict]:
        return [self.chunk(index, {"role": "assistant", "content": ""}) for index in range(self.n)]

    def stream_chunks(self, state: StreamState, event: tuple) -> list[dict]:
        """The chunks an engine event streams: a token's new reasoning or content (or log-prob);
        the end the rest, the tool calls and the finish reason."""
        if event[0] == "token":
            _, index, token, logprob = event
            delta = self.delta(*state.advance(index, token))
            logprobs = {"content": self.logprob_entries([token], [logprob])} if logprob else None
            return [self.chunk(index, delta, logprobs)] if delta or logprobs else []
        if event[0] == "end":
            _, index, reason = event
            delta = self.delta(*state.advance(index, None))
            message, reason = self.message(state.readers[index].reply, reason)
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            return [self.chunk(index, delta, None, reason)]
        return self.closing_chunks(event)

    def delta(self, reasoning: str, content: str) -> dict:
        return {**({"reasoning_content": reasoning} if reasoning and self.thinking else {}),
                **({"content": content} if content else {})}

    def chunk(self, index: int, delta: dict, logprobs=None, finish_reason=None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def tool_calls(calls: list[dict]) -> list[dict]:
    """Parsed calls as OpenAI ``tool_calls``: an id each, arguments as a JSON string."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"] if isinstance(call["arguments"], str)
                          else json.dumps(call["arguments"], ensure_ascii=False)}}
            for call in calls]
