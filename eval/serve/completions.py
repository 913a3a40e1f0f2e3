"""``/v1/completions`` and ``/v1/chat/completions``: a request read into a plan, the plan's work on
the engine thread (`Job`), its response body, and its streamed chunks.

Completions: one prompt (text, token ids) or a list of them; ``n`` choices each, the first choice of
a prompt prefilled and the others forked from it (KDA state copied, MLA pages shared). ``echo``
with ``logprobs`` scores the prompt too (``token_logprobs[0]`` is null), which is what
lm-evaluation-harness's loglikelihood requests read. Chat: the messages (and ``tools``) rendered
in K3's chat format with the generation prompt; the reply read back (`ChatEncoder.parse_reply`)
into ``content``, ``reasoning_content`` and ``tool_calls`` -- never chat markup in ``content``.
"""
from __future__ import annotations

import json
import time
import uuid

import numpy as np

from k3jax.data import DataError
from .engine import Job, Sequence, check_deadline, close_sessions, token_logprobs
from .errors import ServeError, bad
from .model import ServedModel
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
        self.first_stop = params.text_stop(self.stops)
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

    def text_of(self, tokens: list[int]) -> str:
        return self.served.decode(tokens)

    def usage(self, sequences) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(s.tokens) for s in sequences)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ---------------------------------------------------------------- streaming
    def opening_chunks(self) -> list[dict]:
        """The chunks a stream starts with, before any token."""
        return []

    def usage_chunk(self, usage: dict) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the request's usage."""
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.served.name,
                "choices": [], "usage": usage}


class CompletionPlan(_Choices):
    """A ``/v1/completions`` request."""

    object = chunk_object = "text_completion"

    def __init__(self, served: ServedModel, body: dict | CompletionRequest):
        request = CompletionRequest.parse(body)
        params.check_model(request, served.name)
        super().__init__(served, request, _prompts(served, request.prompt), 16, request.max_tokens)
        self.echo = request.echo
        self.logprobs = request.logprobs
        self.id = f"cmpl-{uuid.uuid4().hex}"
        grammar = constraints.content_grammar(request, lambda: served.grammar_vocabulary("structured_outputs"))
        if grammar is not None:
            self.constrain(*grammar)
        self.prompt_scores: dict[int, list] = {}
        self.deadline: float | None = None       # the job's (`job`)

    def job(self, notify, deadline) -> Job:
        self.deadline = deadline
        return Job(self.prepare, self.finish, notify, sequences=len(self.prompts) * self.n, stopped=self.stopped,
                   deadline=deadline)

    # ---------------------------------------------------------------- engine thread
    def prepare(self, store) -> list[Sequence]:
        """Each prompt prefilled (``echo`` with ``logprobs``: scored), its other choices forked; the
        deadline checked between prompts (a failure here closes what was opened: the engine's)."""
        sequences = []
        for number, prompt in enumerate(self.prompts):
            check_deadline(self.deadline)
            if self.echo and self.logprobs is not None:
                first = store.open(prompt[:1])         # every prompt position's logits: no prefix reuse
                logits = [store.logits(first)[None]] + ([store.append(first, prompt[1:])] if len(prompt) > 1 else [])
                scores = token_logprobs(np.concatenate(logits)[:-1], prompt[1:], self.logprobs) if len(prompt) > 1 else []
                self.prompt_scores[number] = [None] + scores
            else:
                first = store.open(prompt)
            sids = [first] + [store.fork(first) for _ in range(self.n - 1)]
            sequences += [self.sequence(sid, choice, self.logprobs, len(prompt)) for choice, sid in enumerate(sids)]
        return sequences

    def stopped(self, sequence: Sequence) -> bool:
        return bool(self.stops) and self.first_stop(self.text_of(sequence.tokens)) is not None

    def finish(self, store, sequences) -> dict:
        close_sessions(store, sequences)
        choices = [self.choice(index, sequence) for index, sequence in enumerate(sequences)]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.served.name,
                "choices": choices, "usage": self.usage(sequences)}

    # ---------------------------------------------------------------- bodies
    def generated(self, sequence: Sequence) -> tuple[list[int], str]:
        """The tokens the choice's text shows (EOS left out) and that text, cut at a stop string."""
        tokens = [t for t in sequence.tokens if t != self.served.eos_id or self.ignore_eos]
        text = self.text_of(tokens)
        cut = self.first_stop(text) if self.stops else None
        return tokens, text if cut is None else text[:cut]

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
    def stream_state(self) -> "StreamText":
        return StreamText(self, len(self.prompts) * self.n)

    def stream_chunks(self, state: "StreamText", event: tuple) -> list[dict]:
        """The chunks an engine event streams: each token its text (maybe empty), the end the rest."""
        if event[0] == "token":
            _, index, token, logprob = event
            return [self.chunk(index, state.advance(index, token), logprob, token)]
        if event[0] == "end":
            _, index, reason = event
            return [self.chunk(index, state.advance(index, None, final=True), finish_reason=reason)]
        return []

    def chunk(self, index: int, delta: str, logprob=None, token: int | None = None, finish_reason=None) -> dict:
        logprobs = None
        if logprob is not None and token is not None:
            logprobs = self.logprobs_body([token], [logprob])
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.served.name,
                "choices": [{"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


class StreamText:
    """Per choice, the text sent so far: each new token sends what is certain (no trailing partial
    UTF-8 character, nothing a stop string could still claim)."""

    def __init__(self, plan, choices: int):
        self.plan, self.tokens, self.sent = plan, [[] for _ in range(choices)], [""] * choices
        self.hold = max((len(s) - 1 for s in plan.stops), default=0)

    def advance(self, index: int, token: int, final: bool = False) -> str:
        if token is not None:
            self.tokens[index].append(token)
        text = self.current(index)
        cut = self.plan.first_stop(text) if self.plan.stops else None
        if cut is not None:
            text = text[:cut]
        elif not final:
            text = text.rstrip("\ufffd")
            text = text[: max(len(self.sent[index]), len(text) - self.hold)]
        delta = text[len(self.sent[index]):] if text.startswith(self.sent[index]) else ""
        self.sent[index] += delta
        return delta

    def current(self, index: int) -> str:
        tokens = [t for t in self.tokens[index] if t != self.plan.served.eos_id or self.plan.ignore_eos]
        return self.plan.text_of(tokens)


class ChatPlan(_Choices):
    """A ``/v1/chat/completions`` request."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, served: ServedModel, body: dict | ChatRequest):
        request = ChatRequest.parse(body)
        params.check_model(request, served.name)
        self.chat = served.require_chat()
        tools = None if request.tool_choice == "none" else request.tools or None
        try:
            prompt = served.chat_prompt(request.messages, tools)
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
        return Job(self.prepare, self.finish, notify, sequences=self.n, stopped=self.stopped, deadline=deadline)

    def prepare(self, store) -> list[Sequence]:
        first = store.open(self.prompts[0])
        sids = [first] + [store.fork(first) for _ in range(self.n - 1)]
        return [self.sequence(sid, choice, self.top_logprobs if self.logprobs else None, len(self.prompts[0]))
                for choice, sid in enumerate(sids)]

    def reply(self, tokens):
        return self.chat.encoder.parse_reply(tokens, self.chat.thinking)

    def text_of(self, tokens: list[int]) -> str:
        return self.reply(tokens).content

    def stopped(self, sequence: Sequence) -> bool:
        return bool(self.stops) and self.first_stop(self.text_of(sequence.tokens)) is not None

    def finish(self, store, sequences) -> dict:
        for sequence in sequences:       # the next turn re-sends this history: let it resume here
            store.cache_prefix(sequence.sid)
        close_sessions(store, sequences)
        choices = [self.choice(index, sequence) for index, sequence in enumerate(sequences)]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.served.name,
                "choices": choices, "usage": self.usage(sequences)}

    def message(self, tokens: list[int], finish_reason: str) -> tuple[dict, str]:
        """The assistant message of a finished choice's ``tokens`` and its finish reason."""
        reply = self.reply(tokens)
        content = reply.content
        cut = self.first_stop(content) if self.stops else None
        if cut is not None:
            content = content[:cut]
        message = {"role": "assistant", "content": content}
        if self.chat.thinking:
            message["reasoning_content"] = reply.reasoning
        reason = finish_reason
        if reply.tool_calls and cut is None:
            message["tool_calls"] = tool_calls(reply.tool_calls)
            message["content"] = content or None
            if reason == "stop":
                reason = "tool_calls"
        return message, reason

    def choice(self, index: int, sequence: Sequence) -> dict:
        message, reason = self.message(sequence.tokens, sequence.finish_reason)
        logprobs = {"content": self.logprob_entries(sequence.tokens, sequence.logprobs)} if self.logprobs else None
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def logprob_entries(self, tokens, scores) -> list[dict]:
        def entry(token, value):
            piece = self.served.piece(token)
            return {"token": piece, "logprob": value, "bytes": list(piece.encode())}
        return [{**entry(token, score.logprob), "top_logprobs": [entry(t, v) for t, v in score.top]}
                for token, score in zip(tokens, scores)]

    # ---------------------------------------------------------------- streaming
    def stream_state(self) -> "StreamReply":
        return StreamReply(self)

    def opening_chunks(self) -> list[dict]:
        return [self.chunk(index, {"role": "assistant", "content": ""}) for index in range(self.n)]

    def stream_chunks(self, state: "StreamReply", event: tuple) -> list[dict]:
        """The chunks an engine event streams: a token's new reasoning or content (or log-prob);
        the end the rest, the tool calls and the finish reason."""
        if event[0] == "token":
            _, index, token, logprob = event
            delta = state.advance(index, token)
            logprobs = {"content": self.logprob_entries([token], [logprob])} if logprob else None
            return [self.chunk(index, delta, logprobs)] if delta or logprobs else []
        if event[0] == "end":
            _, index, reason = event
            delta = state.advance(index, None, final=True)
            message, reason = self.message(state.tokens[index], reason)
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            return [self.chunk(index, delta, None, reason)]
        return []

    def chunk(self, index: int, delta: dict, logprobs=None, finish_reason=None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.served.name,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


class StreamReply:
    """Per choice, the reasoning and content sent so far (the reply re-read after each token)."""

    def __init__(self, plan: ChatPlan):
        self.plan = plan
        self.tokens = [[] for _ in range(plan.n)]
        self.sent = [{"reasoning_content": "", "content": ""} for _ in range(plan.n)]
        self.hold = max((len(s) - 1 for s in plan.stops), default=0)

    def advance(self, index: int, token: int | None, final: bool = False) -> dict:
        """The delta after ``token`` (None: only flush, at the end)."""
        if token is not None:
            self.tokens[index].append(token)
        reply = self.plan.reply(self.tokens[index])
        delta = {}
        for field, text in (("reasoning_content", reply.reasoning), ("content", reply.content)):
            if field == "reasoning_content" and not self.plan.chat.thinking:
                continue
            cut = self.plan.first_stop(text) if field == "content" and self.plan.stops else None
            if cut is not None:
                text = text[:cut]
            elif not final:
                text = text.rstrip("\ufffd")
                if field == "content":
                    text = text[: max(len(self.sent[index][field]), len(text) - self.hold)]
            sent = self.sent[index][field]
            if text.startswith(sent) and len(text) > len(sent):
                delta[field] = text[len(sent):]
                self.sent[index][field] = text
        return delta


def tool_calls(calls: list[dict]) -> list[dict]:
    """Parsed calls as OpenAI ``tool_calls``: an id each, arguments as a JSON string."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"] if isinstance(call["arguments"], str)
                          else json.dumps(call["arguments"], ensure_ascii=False)}}
            for call in calls]
