"""``/v1/responses``: stateful turns over stored sessions, and their persistence.

Each stored response keeps one session of the store -- the conversation through its reply, in the
canonical rendering -- with the messages and tools it renders. A request with
``previous_response_id`` forks that session (KDA state copied, MLA pages shared) and feeds only
the new turn: no re-prefill, and the same tokens as sending the whole history, since the full
conversation is rendered and the stored session is used only when its tokens are a prefix of it
(otherwise -- other tools, say -- the whole history is prefilled, resuming from the prefix cache).
A reply whose sampled tokens differ from the rendering of the message read back (cut short by
``max_output_tokens``, or tokenized otherwise) is stored as rendered, so that later turns see
exactly what a client sending the history would send.

Continuing from an earlier response is a rollback that keeps the later ones; ``POST
/v1/responses/{id}/fork`` names a copy; ``DELETE`` frees one. A stored session is parked in the
host tier (disk past ``--host-bytes``) once stored, so the device pools hold only the sessions that
run (`SessionStore.park`); a continuation uploads a copy of it (one transfer; the stored session
stays parked). At most ``--max-stored-responses`` are kept, the
least recently used (stored, read or continued) evicted past it; ``store: false`` keeps none.
`ResponseStore.save` / `load` keep them across restarts in a state directory: ``state.json``
(written atomically, naming the sessions directory that `SessionStore.save` wrote) beside
``sessions-N/``, and ``responses/``, each response's token history written through before it is
answered (`eval.serve.journal`), so that one acknowledged survives a kill -9: at the next start it
is rebuilt by a prefill where the last clean save does not hold its session.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import pathlib
import re
import shutil
import time
import uuid
from typing import NamedTuple

from k3jax.data import DataError
from k3jax.data.chat_format import ReplyReader, reply_segments
from k3jax.disk import write_atomically
from k3jax.sessions import SessionStore, prefill_in_turns
from k3jax.sessions.tiers import remove_spill_files
from .completions import tool_calls
from .engine import PREFILL_TURN_TOKENS, Job, Sequence, open_in_turns
from .errors import ServeError
from .journal import JOURNAL_DIR, Journal, read_journal, remove_interrupted_writes
from .limits import shown
from .model import ServedModel
from .protocol import FunctionCallOutputItem, MessageItem, ReasoningItem, ResponseRequest
from . import constraints, params

RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
STATE_FILE = "state.json"


@dataclasses.dataclass
class StoredResponse:
    """A response kept for later turns: its session, the messages and tools its session renders."""

    id: str
    sid: int
    messages: list
    tools: list | None
    body: dict


class ResponseStore:
    """Stored responses by id, least recently used first (touched only on the engine thread): at
    most ``capacity`` (None: no cap), past it the least recently used one is evicted (its session
    closed); with a `Journal` each is written through before it is acknowledged."""

    def __init__(self, capacity: int | None = None, journal: Journal | None = None):
        self.items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self.capacity, self.journal = capacity, journal
        self.evicted = 0

    def get(self, response_id, param: str = "previous_response_id") -> StoredResponse:
        if not isinstance(response_id, str) or not RESPONSE_ID.fullmatch(response_id) or response_id not in self.items:
            raise ServeError(404, f"no stored response {shown(response_id)}", "not_found_error", param=param)
        self.items.move_to_end(response_id)
        return self.items[response_id]

    def add(self, store: SessionStore, item: StoredResponse) -> None:
        """Keep ``item`` (a 507 when its journal file cannot be written: it is then not kept), its
        session parked off the device until continued, then evict the least recently used
        responses past the capacity."""
        if self.journal is not None:
            try:
                self.journal.write(_entry(store, item))
            except OSError as error:
                raise ServeError(507, f"the response could not be stored in {self.journal.directory}: "
                                 f"{error.strerror or error}", "server_error") from None
        self.items[item.id] = item
        store.park(item.sid)
        while self.capacity is not None and len(self.items) > self.capacity:
            self.remove(store, next(iter(self.items)))
            self.evicted += 1

    def remove(self, store: SessionStore, response_id: str) -> None:
        """Forget a stored response: its session closed, its journal file removed."""
        store.close(self.items.pop(response_id).sid)
        if self.journal is not None:
            self.journal.remove(response_id)

    def delete(self, store: SessionStore, response_id: str) -> dict:
        self.get(response_id, "response_id")
        self.remove(store, response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def fork(self, store: SessionStore, response_id: str) -> dict:
        stored = self.get(response_id, "response_id")
        new_id = new_response_id()
        body = {**stored.body, "id": new_id, "created_at": int(time.time()), "forked_from": response_id}
        sid = store.fork(stored.sid)
        try:
            self.add(store, StoredResponse(new_id, sid, list(stored.messages), stored.tools, body))
        except ServeError:
            store.close(sid)
            raise
        return body

    # ---------------------------------------------------------------- persistence
    def save(self, store: SessionStore, directory: pathlib.Path) -> None:
        """Write every stored response and its session under ``directory`` (state.json last,
        atomically); OSError or ValueError when the disk refuses."""
        directory.mkdir(parents=True, exist_ok=True)
        previous = _read_state(directory)
        name = f"sessions-{time.time_ns()}"
        store.save(directory / name)
        write_atomically(directory / STATE_FILE, json.dumps({
            "sessions": name, "responses": [dataclasses.asdict(item) for item in self.items.values()]}), unique=True)
        if previous is not None and previous["sessions"] != name:
            shutil.rmtree(directory / previous["sessions"], ignore_errors=True)

    @classmethod
    def load(cls, model, directory: pathlib.Path, capacity: int | None = None, files: "StateFiles | None" = None,
             owner: bool = True, **budgets) -> tuple["ResponseStore", SessionStore, list[str]]:
        """(responses, store, notes) from ``directory``: the stored responses its journal lists,
        each with its session from the last clean save (`save`) where that holds its tokens, else
        rebuilt by one prefill of them; temporary files of interrupted writes and spill files of
        the disk tier (``budgets["disk_dir"]``) removed first. A damaged journal or session file
        skips (or rebuilds) that response alone; ``notes`` are lines saying what was skipped,
        rebuilt or removed. A directory of an older version (no journal) loads its saved state.

        ``files``: the directory's `read_state_files` (read here when None). ``owner`` False: a
        process of a mesh other than 0, which makes the same store calls from the same ``files``
        but writes and removes nothing in ``directory`` (process 0 does; its disk tier is its own)."""
        notes = [f"removed {name} (an interrupted write)" for name in remove_interrupted_writes(directory)] if owner else []
        if budgets.get("disk_dir") is not None:
            spilled = remove_spill_files(pathlib.Path(budgets["disk_dir"]))
            notes += [f"removed {len(spilled)} spill files of an earlier run"] if spilled else []
        files = read_state_files(directory) if files is None else files
        journal = Journal(directory) if owner else None
        damaged: list[int] = []
        if files.state is None:
            store, saved = SessionStore(model, **budgets), {}
        else:
            store = SessionStore.load(model, directory / files.state["sessions"], damaged=damaged, **budgets)
            saved = {item["id"]: StoredResponse(**item) for item in files.state["responses"]}
        entries = files.entries
        notes += [f"skipped {name}: an unreadable journal file" for name in files.unreadable]
        if not files.journaled:     # written by a version without a journal: what it saved, journaled from now on
            entries = {key: _entry(store, item) for key, item in saved.items() if item.sid in store.sessions()}
            for entry in entries.values() if journal is not None else ():
                journal.write(entry)
        notes += [f"skipped {key}: its session file is damaged" for key, item in saved.items()
                  if item.sid in damaged and key not in entries]
        responses = cls(capacity, journal)
        for entry in sorted(entries.values(), key=lambda entry: entry["body"].get("created_at", 0)):
            item, note = _restored(store, saved.get(entry["id"]), entry)
            notes += [note] if note else []
            if item is not None:
                responses.items[item.id] = item
        for key, item in saved.items():          # deleted or evicted since the save
            if key not in responses.items and item.sid in store.sessions():
                store.close(item.sid)
        while capacity is not None and len(responses.items) > capacity:
            responses.remove(store, next(iter(responses.items)))
        return responses, store, notes


class StateFiles(NamedTuple):
    """What a state directory held when read: ``state.json`` (None: none yet), whether it has a
    journal, the journal's entries by id and the names of its unreadable files."""

    state: dict | None
    journaled: bool
    entries: dict[str, dict]
    unreadable: list[str]

    def digest(self) -> str:
        """sha256 of the contents: equal where two processes read the same."""
        return hashlib.sha256(json.dumps(self._asdict(), sort_keys=True).encode()).hexdigest()


def read_state_files(directory: pathlib.Path) -> StateFiles:
    """``directory``'s `StateFiles`; ValueError when its ``state.json`` is not a server's."""
    journaled = (directory / JOURNAL_DIR).is_dir()
    entries, unreadable = read_journal(directory) if journaled else ({}, [])
    return StateFiles(_read_state(directory), journaled, entries, unreadable)


def _restored(store: SessionStore, saved: StoredResponse | None, entry: dict) -> tuple[StoredResponse | None, str | None]:
    """A journal ``entry``'s stored response: its ``saved`` session where that holds its tokens, else
    a session prefilled with them -> (the response or None when its tokens cannot be, a note or None)."""
    tokens, adapter = entry["tokens"], entry.get("adapter", "")
    if saved is not None and saved.sid in store.sessions() and store.tokens(saved.sid).tolist() == tokens \
            and store.adapter(saved.sid) == adapter:
        return saved, None
    try:
        sid = store.open(tokens, adapter=adapter)
    except ValueError as error:
        return None, f"skipped {entry['id']}: its tokens cannot be prefilled ({error})"
    item = StoredResponse(entry["id"], sid, entry["messages"], entry["tools"], entry["body"])
    return item, f"rebuilt {entry['id']} by a prefill of its {len(tokens)} tokens"


def _entry(store: SessionStore, item: StoredResponse) -> dict:
    """A stored response as its journal keeps it: the item, its session's tokens and adapter tag."""
    return {**dataclasses.asdict(item), "tokens": store.tokens(item.sid).tolist(), "adapter": store.adapter(item.sid)}


def _read_state(directory: pathlib.Path) -> dict | None:
    path = directory / STATE_FILE
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(state, dict) or not isinstance(state.get("sessions"), str) \
                or not re.fullmatch(r"sessions-\d+", state["sessions"]) or not isinstance(state.get("responses"), list):
            raise ValueError("unexpected layout")
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not a server state file ({error})") from None
    return state


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


# -------------------------------------------------------------------- input items -> chat messages
def input_messages(items: list) -> list[dict]:
    """Responses ``input`` items (checked: `eval.serve.protocol.ResponseRequest`) -> chat messages.
    An assistant's reasoning, message and function calls that follow each other are one assistant
    message, as its output listed them; a ``function_call_output`` is a tool message answering its
    call id."""
    messages = []
    for item in items:
        if isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else json.dumps(item.output, ensure_ascii=False)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif isinstance(item, MessageItem) and item.role != "assistant":
            messages.append({"role": {"developer": "system"}.get(item.role, item.role),
                             "content": "".join(part.text for part in item.content)})
        else:
            _add_to_assistant(messages, item)
    return messages


def _add_to_assistant(messages: list[dict], item) -> None:
    """An assistant's message, reasoning or function call, added to the assistant message that ends
    ``messages`` (a new one when the last message is not the assistant's)."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    message = messages[-1]
    if isinstance(item, MessageItem):
        message["content"] += "".join(part.text for part in item.content)
    elif isinstance(item, ReasoningItem):
        message["reasoning_content"] = message.get("reasoning_content", "") + "".join(p.text for p in item.content)
    else:
        message.setdefault("tool_calls", []).append(
            {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})


def chat_tools(tools: list[dict] | None) -> list | None:
    """Checked responses tools (``{"type": "function", "name", "description", "parameters"}``) -> the
    chat completions form the chat format declares."""
    if not tools:
        return None
    return [{"type": "function", "function": {key: value for key, value in tool.items() if key != "type"}}
            for tool in tools]


class ResponsePlan:
    """A ``POST /v1/responses`` request (checked on the HTTP side; the stored state is read on the
    engine thread, where `prepare` resolves ``previous_response_id``). Streamed (``stream: true``),
    its events (`ResponseEvents`) build the very response that is stored and that a plain request
    answers: the same output items, ids and order."""

    named_events, done_marker = True, False      # server-sent events "event: TYPE", no "[DONE]" (`Server.chunks`)

    def __init__(self, served: ServedModel, body: dict | ResponseRequest, responses: ResponseStore):
        request = ResponseRequest.parse(body)
        self.model, self.adapter = params.model_choice(request, served)
        self.served, self.responses, self.chat = served, responses, served.require_chat()
        effort = request.reasoning.effort if request.reasoning is not None else None
        self.thinking, self.effort = params.chat_reasoning(effort, None, self.chat, "reasoning.effort")
        self.new_messages = input_messages(request.input)
        if request.instructions is not None:
            self.new_messages.insert(0, {"role": "system", "content": request.instructions})
        self.tools = None if request.tool_choice == "none" else chat_tools(request.tools)
        self.declared_tools = chat_tools(request.tools)
        choice = request.tool_choice or "auto"
        self.tool_choice = choice if isinstance(choice, str) else choice.model_dump()     # echoed as sent
        self.parallel_tool_calls = request.parallel_tool_calls
        self.text_format = ({"type": "text"} if request.text is None or request.text.format is None
                            else request.text.format.model_dump(by_alias=True, exclude_none=True))
        self.grammar = constraints.response_grammar(request, self.tools, self.thinking,
                                                    lambda: served.grammar_vocabulary("text.format"))
        self.previous_id, self.keep, self.metadata = request.previous_response_id, request.store, request.metadata
        self.temperature, self.top_p, self.seed = params.sampling(request)
        self.max_tokens, self.stream = request.max_output_tokens, request.stream
        self.id, self.created = new_response_id(), int(time.time())
        self.item_ids = {"think": f"rs_{uuid.uuid4().hex}", "response": f"msg_{uuid.uuid4().hex}"}
        self.prompt: list[int] = []
        self.messages: list[dict] = []
        self.cached_tokens = 0

    def job(self, notify, deadline) -> Job:
        return Job(self.prepare, self.finish, notify, deadline=deadline, adapter=self.adapter)

    def prepare(self, store: SessionStore):
        previous = self.responses.get(self.previous_id) if self.previous_id is not None else None
        self.messages = (previous.messages if previous is not None else []) + self.new_messages
        try:
            self.prompt = self.served.chat_prompt(self.messages, self.tools, self.thinking, self.effort).tolist()
        except DataError as error:
            raise ServeError(400, str(error), param="input") from None
        room = self.served.max_model_len - len(self.prompt)
        max_tokens = max(room, 0) if self.max_tokens is None else self.max_tokens
        self.served.check_length(len(self.prompt), max_tokens)
        if previous is not None and store.adapter(previous.sid) != self.adapter:
            raise ServeError(400, f"previous_response_id {self.previous_id} was answered by another model than "
                             f"{self.model!r}; continue it with the model that answered it", param="model")
        stored = store.tokens(previous.sid).tolist() if previous is not None else None
        if stored is not None and len(stored) < len(self.prompt) and self.prompt[: len(stored)] == stored:
            sid = store.fork(previous.sid)
            self.cached_tokens = len(stored)
            yield from prefill_in_turns(store, self.prompt[len(stored):], PREFILL_TURN_TOKENS, sid=sid)
        else:
            sid, self.cached_tokens = yield from open_in_turns(store, self.prompt, self.adapter)
        eos = frozenset() if self.served.eos_id is None else frozenset([self.served.eos_id])
        constraint = None
        if self.grammar is not None:
            from k3jax.grammar import Constraint
            constraint = Constraint(self.served.grammar_vocabulary("text.format"), self.grammar)
        return [Sequence(sid, params.choice_sampling(self.temperature, self.top_p, self.seed, 0, constraint=constraint),
                         max_tokens, eos)]

    def reader(self) -> ReplyReader:
        return ReplyReader(self.chat.encoder, self.thinking)

    def finish(self, store: SessionStore, sequences) -> dict:
        (sequence,) = sequences
        reader = self.reader()
        for token in sequence.tokens:
            reader.feed(token)
        reader.close()
        reply = reader.reply
        calls = tool_calls(reply.tool_calls)
        message = {"role": "assistant", "content": reply.content}
        if self.thinking:
            message["reasoning_content"] = reply.reasoning
        if calls:
            message["tool_calls"] = calls
        body = self.body(reply, reader.order, calls, sequence)
        if not self.keep:
            store.close(sequence.sid)
            return body
        canonical = self.prompt + self.chat.encoder.encode(reply_segments(message, self.thinking))[0].tolist()
        sid = sequence.sid
        if store.tokens(sid).tolist() != canonical:
            store.close(sid)
            sid = store.open(canonical, adapter=self.adapter)
        self.responses.add(store, StoredResponse(self.id, sid, self.messages + [message], self.tools, body))
        return body

    def output_item(self, channel: str, text: str | None, status: str = "completed") -> dict:
        """The reasoning (``channel`` think) or message (response) output item, ``text`` its one part
        (None: no part yet, as a stream announces it)."""
        if channel == "think":
            parts = [] if text is None else [{"type": "reasoning_text", "text": text}]
            return {"type": "reasoning", "id": self.item_ids[channel], "summary": [], "content": parts}
        parts = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
        return {"type": "message", "id": self.item_ids[channel], "status": status, "role": "assistant",
                "content": parts}

    def body(self, reply, order: list[str], calls: list[dict], sequence: Sequence) -> dict:
        """The response: its reasoning (with thinking, when there is any) and message (when it has
        text or calls nothing) in the order their text began (``order``: `ReplyReader.order`, as a
        stream opens them), then its function calls."""
        texts = {"think": reply.reasoning if self.thinking else "", "response": reply.content}
        shown = [channel for channel in order if texts[channel]]
        if not calls and "response" not in shown:
            shown.append("response")
        output = [self.output_item(channel, texts[channel]) for channel in shown]
        for call in calls:
            output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                           "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                           "status": "completed"})
        complete = sequence.finish_reason == "stop"
        usage = {"input_tokens": len(self.prompt), "output_tokens": len(sequence.tokens),
                 "total_tokens": len(self.prompt) + len(sequence.tokens),
                 # cached: resumed from a stored session or the prefix cache; written: prefilled into the kept session
                 "input_tokens_details": {"cached_tokens": self.cached_tokens,
                                          "cache_write_tokens": len(self.prompt) - self.cached_tokens if self.keep else 0},
                 "output_tokens_details": {"reasoning_tokens": reply.reasoning_tokens}}
        return self.envelope("completed" if complete else "incomplete", output, usage)

    def envelope(self, status: str, output: list, usage: dict | None) -> dict:
        """The response object around ``output`` (a stream's first events: in progress, no output)."""
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": status, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "previous_response_id": self.previous_id, "output": output, "store": self.keep,
            "temperature": self.temperature, "top_p": 1.0 if self.top_p is None else self.top_p,
            "tools": [{"type": "function", **tool["function"]} for tool in self.declared_tools or []],
            "parallel_tool_calls": self.parallel_tool_calls, "tool_choice": self.tool_choice,
            "text": {"format": self.text_format}, "error": None, "instructions": None,
            "reasoning": {"effort": self.effort if self.thinking else "none", "summary": None},
            "metadata": self.metadata or {}, "usage": usage,
        }

    # ---------------------------------------------------------------- streaming
    def stream_state(self) -> "ResponseEvents":
        return ResponseEvents(self)

    def opening_chunks(self, state: "ResponseEvents") -> list[dict]:
        return state.opening()

    def stream_chunks(self, state: "ResponseEvents", event: tuple) -> list[dict]:
        return state.on(event)


def failure_code(status: int) -> str:
    """A failed response's ``error.code`` (one of the Responses API's) for an HTTP status: 429
    ``rate_limit_exceeded``, 5xx ``server_error``, any other (the request's own) ``invalid_prompt``."""
    return "rate_limit_exceeded" if status == 429 else "server_error" if status >= 500 else "invalid_prompt"


class ResponseEvents:
    """A streamed response's events (OpenAI's Responses streaming), each with its
    ``sequence_number``: response.created and .in_progress; per output item .output_item.added,
    .content_part.added, text deltas (.reasoning_text.delta for reasoning, .output_text.delta for
    the message) as the reply is read (`ReplyReader`: each token once), then their .done events and
    .output_item.done; function calls (known once the reply has ended) as items with
    .function_call_arguments.delta / .done; last response.completed (or .incomplete) carrying the
    stored response, or response.failed."""

    DELTA = {"think": "response.reasoning_text", "response": "response.output_text"}
    LOGPROBS = {"think": {}, "response": {"logprobs": []}}      # output text events list log-probs (none here)

    def __init__(self, plan: ResponsePlan):
        self.plan, self.reader, self.number = plan, plan.reader(), 0
        self.open: dict[str, int] = {}          # channel -> its item's output index, in the order opened

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return event

    def opening(self) -> list[dict]:
        response = self.plan.envelope("in_progress", [], None)
        return [self.event("response.created", response=response), self.event("response.in_progress", response=response)]

    def on(self, event: tuple) -> list[dict]:
        if event[0] == "token":
            return self.text(*self.reader.feed(event[2]))
        if event[0] == "end":
            return self.text(*self.reader.close())
        if event[0] == "result":
            return self.closing(event[1])
        if event[0] == "error":
            error = {"code": failure_code(event[1].status), "message": event[1].message}
            return [self.event("response.failed", response={**self.plan.envelope("failed", [], None), "error": error})]
        return []

    def text(self, reasoning: str, content: str) -> list[dict]:
        events = []
        for channel, delta in (("think", reasoning if self.plan.thinking else ""), ("response", content)):
            if not delta:
                continue
            if channel not in self.open:
                events += self.added(channel)
            events.append(self.event(f"{self.DELTA[channel]}.delta", item_id=self.plan.item_ids[channel],
                                     output_index=self.open[channel], content_index=0, delta=delta,
                                     **self.LOGPROBS[channel]))
        return events

    def added(self, channel: str) -> list[dict]:
        index = self.open[channel] = len(self.open)
        item = self.plan.output_item(channel, None, "in_progress")
        part = {"type": "reasoning_text", "text": ""} if channel == "think" else \
            {"type": "output_text", "text": "", "annotations": []}
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                           part=part)]

    def closing(self, body: dict) -> list[dict]:
        """The .done events of every item of the finished ``body`` (announcing those not streamed:
        function calls, an empty message), then response.completed / .incomplete."""
        events = []
        for index, item in enumerate(body["output"]):
            channel = {"reasoning": "think", "message": "response"}.get(item["type"])
            if channel is not None:
                if channel not in self.open:
                    events += self.added(channel)
                part = item["content"][0]
                events.append(self.event(f"{self.DELTA[channel]}.done", item_id=item["id"], output_index=index,
                                         content_index=0, text=part["text"], **self.LOGPROBS[channel]))
                events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                         content_index=0, part=part))
            else:
                events.append(self.event("response.output_item.added", output_index=index,
                                         item={**item, "arguments": "", "status": "in_progress"}))
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=index, delta=item["arguments"]))
                events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                         output_index=index, arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return events + [self.event(kind, response=body)]
