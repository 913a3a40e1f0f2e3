"""Write ``configs/chat/calculator.jsonl``: conversations in which the assistant adds two numbers by
calling a tool, for a tiny model that really makes tool calls (`bench/serve_tools.py` drives it
through ``python -m eval.serve`` with the ``openai`` client).

Each record declares one function tool, ``add(a: integer, b: integer)`` (`TOOLS`, kept short: it is
rendered into every prompt), and holds four messages:

    user       "add 12 and 7" / "what is 12 + 7?" / ... (`PHRASINGS`; a and b in the order asked)
    assistant  content "", one tool call ``add`` with arguments '{"a": 12, "b": 7}' (a JSON string,
               OpenAI's form) and an id
    tool       "19" (tool_call_id = the call's id)
    assistant  "19"

Numbers are drawn from [0, `--max-value`]; every record has its own (a, b) pair, so the held-out
split (the file's last ``data.heldout_fraction`` of records, 5% by default: 100 of 2000; the
questions `bench/serve_tools.py` asks) holds pairs the training split never shows. Seeded: the
same arguments write the same file.

    python configs/chat/make_calculator.py [--records 2000] [--max-value 99] [--seed 0] [--out PATH]
                                           [--prompts configs/rl/calculator_prompts.jsonl]

``--prompts`` also writes the same records as RL prompts (`k3jax.data.PromptDataset`): the tools,
the user's question and ``answer`` (the sum), for ``rl.environment=calculator``
(`configs/rl/calculator.yaml`). Held out at the same fraction, its held-out prompts are the
conversations' held-out ones.

Rendered with the stand-in byte-level tokenizer (configs/chat/tokenizer), a conversation is 603-624
tokens (~300 of them the tool declaration), so ``data.seq_len=640`` holds each whole. Thinking off
(its channel would be empty). On the shared 2-core CPU this reached held-out loss 0.0002 and 20/20
held-out tool calls and answers right in 500 steps (~5 minutes):

    python -m train configs/tiny.yaml run_dir=runs/calc data.kind=chat data.path=configs/chat/calculator.jsonl \
        data.tokenizer=configs/chat/tokenizer data.seq_len=640 data.chat_thinking=false \
        data.chat_thinking_effort=null train.batch_size=8 train.steps=500
    python -m bench.serve_tools runs/calc
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random

OUT = pathlib.Path(__file__).with_name("calculator.jsonl")
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]   # no description or
# "required": the declaration (~300 tokens of its ~620) is rendered into every conversation
PHRASINGS = ("add {a} and {b}", "what is {a} + {b}?", "{a} plus {b}", "sum of {a} and {b}",
             "what's {a} plus {b}?", "please add {a} and {b}", "{a}+{b}=?", "compute {a} + {b}")


def conversation(a: int, b: int, phrasing: str, call_id: str) -> dict:
    """One record: the question, the ``add`` call, its result and the answer."""
    total = str(a + b)
    call = {"id": call_id, "type": "function",
            "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
    return {"tools": TOOLS, "messages": [
        {"role": "user", "content": phrasing.format(a=a, b=b)},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": total},
        {"role": "assistant", "content": total}]}


def rl_prompt(record: dict) -> dict:
    """The RL prompt of a conversation: its tools and question, the sum as the answer."""
    return {"tools": record["tools"], "messages": record["messages"][:1], "answer": int(record["messages"][-1]["content"])}


def records(count: int, max_value: int, seed: int) -> list[dict]:
    """``count`` conversations with distinct (a, b) pairs from [0, max_value], phrasings drawn at random."""
    pairs = (max_value + 1) ** 2
    if count > pairs:
        raise SystemExit(f"--records {count} exceeds the {pairs} distinct pairs of numbers in [0, {max_value}]")
    rng = random.Random(seed)
    chosen = rng.sample(range(pairs), count)
    return [conversation(*divmod(pair, max_value + 1), rng.choice(PHRASINGS), f"call_{number}")
            for number, pair in enumerate(chosen)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--max-value", type=int, default=99)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--prompts", help="also write the records as RL prompts to this JSONL file")
    args = parser.parse_args()
    written = records(args.records, args.max_value, args.seed)
    with open(args.out, "w") as file:
        file.writelines(json.dumps(record, separators=(",", ":")) + "\n" for record in written)
    print(f"wrote {len(written)} conversations to {args.out}")
    if args.prompts:
        with open(args.prompts, "w") as file:
            file.writelines(json.dumps(rl_prompt(record), separators=(",", ":")) + "\n" for record in written)
        print(f"wrote {len(written)} prompts to {args.prompts}")


if __name__ == "__main__":
    main()
