"""Constrained decoding (`k3jax.grammar`, `eval.serve.constraints`) on an untrained tiny K3 chat model
(`configs/tiny.yaml` with the chat tokenizer of `configs/chat/tokenizer`, random weights: nothing
but the constraint makes its output valid). Two parts, in one run:

    cost     tokens/s of `SessionStore.step` at batch 1 and 32, side by side: plain sampling (the
             plain decode program); penalties (presence 0.5, repetition 1.2: the adjusted decode
             program, its per-row arrays built on the host, no grammar); and every row held to a
             JSON schema (the token mask of each row computed on the host by llguidance, applied in
             the adjusted program, the grammar advanced with each token); trials rotate, medians
    server   ``python -m eval.serve RUN_DIR --port 0`` as a subprocess and the official ``openai``
             client: ``--replies`` chat replies with ``response_format`` json_schema over five
             schemas (nested objects, arrays, enums, bounded numbers, required fields), at
             temperature 1 with a seed each, sent by 16 threads; each reply parsed and validated
             with ``jsonschema`` (valid / finish_reason stop); then ``client.chat.completions.parse``
             with a pydantic model, whose ``message.parsed`` must be an instance of it; then
             ``--replies`` / 4 replies of each forced kind (`forced_outputs`: tool_choice required, a
             named function, parallel_tool_calls false, a regex, a choice list), each checked

    python -m bench.constrained [--run DIR] [--replies 200] [--steps 24] [--trials 3]
                                [--json bench/constrained.json]

``--run``: an untrained chat run directory to serve (default: one is saved into a temporary
directory first). Nothing is asserted: the table and the JSON report what happened.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench.common import table, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAT_OVERRIDES = ["data.kind=chat", f"data.path={ROOT / 'configs' / 'chat' / 'conversations.jsonl'}",
                  f"data.tokenizer={ROOT / 'configs' / 'chat' / 'tokenizer'}", "data.seq_len=128",
                  "data.chat_thinking=false", "train.steps=1", "checkpoint.async_save=false", "logging.progress=false",
                  "model.vocab_size=512"]
READY = re.compile(r"serving (\S+) on (http://\S+/v1)")
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "tags": {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                       "minItems": 1, "maxItems": 4}},
             "required": ["tags"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                   "y": {"type": "boolean"}},
                  "required": ["x", "y"], "additionalProperties": False},
        "color": {"enum": ["red", "green", "blue"]}}, "required": ["point", "color"], "additionalProperties": False},
    "bounded": {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1},
                                                 "rank": {"type": "integer", "minimum": 1, "maximum": 10}},
                "required": ["score", "rank"], "additionalProperties": False},
    "items": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "label": {"type": "string", "maxLength": 4}},
        "required": ["id"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
}
# a schema that stays open for the whole cost measurement (strings of any length)
COST_SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
               "required": ["notes"]}


def save_untrained(directory: pathlib.Path) -> pathlib.Path:
    from k3jax.config import load_config
    from k3jax.training import Trainer

    trainer = Trainer(load_config(ROOT / "configs" / "tiny.yaml", CHAT_OVERRIDES + [f"run_dir={directory}"]))
    trainer.save(force=True)
    trainer.checkpoints.wait()
    trainer.close()
    return directory


# ---------------------------------------------------------------------- cost
def cost(run_dir: pathlib.Path, batches: list[int], steps: int, trials: int) -> list[dict]:
    """Median tokens/s of ``steps`` store steps at each batch, plain and JSON-schema constrained."""
    from k3jax.grammar import Constraint, grammar_tokenizer, json_schema_grammar
    from k3jax.inference import load_run
    from k3jax.inference.chat import chat_turns_for
    from k3jax.data import load_tokenizer
    from k3jax.sessions import Sampling, SessionStore

    run = load_run(str(run_dir))
    chat = chat_turns_for(run.config)
    vocabulary = grammar_tokenizer(load_tokenizer(run.config.data.tokenizer), run.config.model.vocab_size, chat.eos_id)
    grammar = json_schema_grammar(COST_SCHEMA)
    store = SessionStore(run.model, prefix_cache=False)
    rows = []
    for batch in batches:
        sids = [store.open([5 + i % 7, 9, 11]) for i in range(batch)]
        handles = [store.snapshot(sid) for sid in sids]

        variants = {"plain": lambda: Sampling(),
                    "penalties": lambda: Sampling(presence_penalty=0.5, repetition_penalty=1.2),
                    "json_schema": lambda: Sampling(constraint=Constraint(vocabulary, grammar))}

        def trial(variant: str) -> float:
            for sid, handle in zip(sids, handles):
                store.rollback(sid, handle)
            rules = {sid: variants[variant]() for sid in sids}
            started = time.perf_counter()
            for _ in range(steps):
                store.step(rules)
            return time.perf_counter() - started

        times = {variant: [] for variant in variants}
        names = list(variants)
        for number in range(trials + 1):
            for variant in names[number % 3:] + names[: number % 3]:
                seconds = trial(variant)
                if number > 0:                       # the first round compiles
                    times[variant].append(seconds)
        speed = {variant: batch * steps / statistics.median(times[variant]) for variant in names}
        rows.append({"batch": batch, "steps": steps, **{f"{v}_tokens_per_s": speed[v] for v in names},
                     "penalties_ratio": speed["penalties"] / speed["plain"],
                     "json_schema_ratio": speed["json_schema"] / speed["plain"]})
        for sid in sids:
            store.close(sid)
    return rows


# ---------------------------------------------------------------------- server
class Server:
    """``python -m eval.serve RUN_DIR --port 0`` and its address from the ``serving NAME on URL`` line."""

    def __init__(self, run_dir: pathlib.Path, startup_seconds: float = 600.0):
        self.process = subprocess.Popen([sys.executable, "-m", "eval.serve", str(run_dir), "--port", "0",
                                         "--max-model-len", "1024", "--max-batch", "16"],
                                        cwd=ROOT, stderr=subprocess.PIPE, text=True)
        found = threading.Event()
        self.url = self.name = None

        def drain():
            for line in self.process.stderr:
                match = READY.search(line)
                if match and not found.is_set():
                    self.name, self.url = match.groups()
                    found.set()
        threading.Thread(target=drain, daemon=True).start()
        if not found.wait(startup_seconds):
            self.process.kill()
            raise RuntimeError("the server did not start")

    def stop(self) -> int | None:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return None


def served_replies(run_dir: pathlib.Path, replies: int) -> dict:
    import jsonschema
    import openai
    import pydantic

    server = Server(run_dir)
    client = openai.OpenAI(base_url=server.url, api_key="none", timeout=600)
    names = list(SCHEMAS)

    def ask(number: int) -> dict:
        name = names[number % len(names)]
        started = time.perf_counter()
        try:
            reply = client.chat.completions.create(
                model=server.name, messages=[{"role": "user", "content": f"Fill in the {name} form."}],
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                                         "strict": True}},
                temperature=1.0, seed=number, max_tokens=300)
        except openai.APIError as error:
            return {"schema": name, "error": str(error)}
        choice = reply.choices[0]
        try:
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
            valid = True
        except (json.JSONDecodeError, jsonschema.ValidationError):
            valid = False
        return {"schema": name, "valid": valid, "finish_reason": choice.finish_reason,
                "tokens": reply.usage.completion_tokens, "seconds": time.perf_counter() - started,
                **({} if valid else {"content": choice.message.content})}

    try:
        ask(0)                                                  # compiles the programs
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(ask, range(replies)))
        elapsed = time.perf_counter() - started

        class Point(pydantic.BaseModel):
            x: int = pydantic.Field(ge=-9, le=9)
            label: str = pydantic.Field(max_length=6)
            ok: bool

        parsed = client.chat.completions.parse(model=server.name, messages=[{"role": "user", "content": "A point."}],
                                               response_format=Point, temperature=0, max_tokens=200)
        parse_result = {"parsed": repr(parsed.choices[0].message.parsed),
                        "is_instance": isinstance(parsed.choices[0].message.parsed, Point),
                        "finish_reason": parsed.choices[0].finish_reason}
        forced = forced_outputs(client, server.name, max(replies // 4, 1))
    finally:
        status = server.stop()
    per_schema = {name: {"replies": sum(r["schema"] == name for r in results),
                         "valid": sum(r["schema"] == name and r.get("valid", False) for r in results)}
                  for name in names}
    return {"replies": len(results), "valid": sum(r.get("valid", False) for r in results),
            "errors": sum("error" in r for r in results),
            "stopped": sum(r.get("finish_reason") == "stop" for r in results), "seconds": elapsed,
            "completion_tokens": sum(r.get("tokens", 0) for r in results), "per_schema": per_schema,
            "parse": parse_result, "forced": forced, "server_exit_status": status,
            "failures": [r for r in results if not r.get("valid", False)][:10]}


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
              "type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima", "Pune"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
              "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
              "required": ["a", "b"], "additionalProperties": False}}}]
STRICT_TOOLS = [{"type": "function", "function": {**tool["function"], "strict": True}} for tool in TOOLS]
REGEX, CHOICES = r"[A-Z]{3}-[0-9]{2}", ["yes", "no", "maybe"]


def forced_outputs(client, model: str, count: int) -> dict:
    """``count`` sampled replies of each forced kind -> per kind, how many kept to what was asked:
    ``tool_choice: required`` (at least one call, each valid for its function's schema), a named
    function (exactly one call, of it, valid), ``parallel_tool_calls: false`` under auto (at most
    one call; arguments are held to the schema only for ``strict`` functions, so also with both
    tools strict: at most one call, valid), a ``structured_outputs`` regex and choice list (the
    content matches)."""
    import jsonschema

    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}

    def valid_calls(message, names) -> list[bool]:
        calls = message.tool_calls or []
        result = []
        for call in calls:
            try:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
                result.append(call.function.name in names)
            except (json.JSONDecodeError, jsonschema.ValidationError, KeyError):
                result.append(False)
        return result

    kinds = {
        "tool_choice required": ({"tools": TOOLS, "tool_choice": "required"},
                                 lambda m: len(valid_calls(m, schemas)) >= 1 and all(valid_calls(m, schemas))),
        "tool_choice add": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}},
                            lambda m: valid_calls(m, {"add"}) == [True]),
        "parallel_tool_calls false": ({"tools": TOOLS, "parallel_tool_calls": False},
                                      lambda m: len(m.tool_calls or []) <= 1),
        "parallel_tool_calls false, strict": ({"tools": STRICT_TOOLS, "parallel_tool_calls": False},
                                              lambda m: len(m.tool_calls or []) <= 1 and all(valid_calls(m, schemas))),
        "regex": ({"extra_body": {"structured_outputs": {"regex": REGEX}}},
                  lambda m: re.fullmatch(REGEX, m.content or "") is not None),
        "choice": ({"extra_body": {"structured_outputs": {"choice": CHOICES}}}, lambda m: m.content in CHOICES),
    }
    result = {}
    for kind, (options, kept) in kinds.items():
        def ask(number: int) -> bool:
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "What is the weather in Oslo, or 2 + 3?"}],
                temperature=1.0, seed=number, max_tokens=300, **options)
            return kept(reply.choices[0].message)
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(ask, range(count)))
        result[kind] = {"replies": count, "kept": sum(outcomes)}
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default=None, help="a chat run to serve (default: save an untrained one)")
    parser.add_argument("--replies", type=int, default=200)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--json", default="bench/constrained.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as temporary:
        run_dir = pathlib.Path(args.run) if args.run else save_untrained(pathlib.Path(temporary) / "untrained-chat")
        rows = cost(run_dir, [int(b) for b in args.batches.split(",")], args.steps, args.trials)
        print(table(["batch", "steps", "plain tok/s", "penalties tok/s", "json_schema tok/s", "penalties / plain",
                     "json_schema / plain"],
                    [[r["batch"], r["steps"], f"{r['plain_tokens_per_s']:.1f}", f"{r['penalties_tokens_per_s']:.1f}",
                      f"{r['json_schema_tokens_per_s']:.1f}", f"{r['penalties_ratio']:.2f}",
                      f"{r['json_schema_ratio']:.2f}"] for r in rows]))
        served = served_replies(run_dir, args.replies) if args.replies else None
    if served is not None:
        print(table(["schema", "replies", "valid"], [[name, v["replies"], v["valid"]]
                                                   for name, v in served["per_schema"].items()]))
        print(f"{served['valid']}/{served['replies']} valid, {served['stopped']} finished 'stop', {served['errors']} "
              f"errors, {served['seconds']:.1f} s; parse(): {served['parse']}")
        print(table(["forced output", "replies", "kept to it"],
                    [[kind, v["replies"], v["kept"]] for kind, v in served["forced"].items()]))
    write_json(args.json, {"command": " ".join(["python -m bench.constrained", *(argv or sys.argv[1:])]),
                           "cost": rows, "server": served})


if __name__ == "__main__":
    main()
