"""Multi-turn tool environments for RL on chat prompts (``rl.environment``).

An environment is a class; the rollout makes one per completion and drives it:

    env = Environment()
    env.reset(record)                 # the prompt record (its messages are the conversation's start)
    turn = env.step(reply)            # reply: the assistant message the policy wrote, parsed
                                      #   {"content", "reasoning_content"?, "tool_calls": [{"name", "arguments"}]}
    turn.messages                     # tool results to feed back (each {"role": "tool", "name", "content"})
    turn.done, turn.reward            # the episode's end and its reward (a finite number)

``step`` raises `ToolCallError` for a call it cannot run (unknown tool, bad arguments): the rollout
then rolls the session back to before the reply and samples it again (``rl.tool_retries`` times;
after that the episode ends with reward 0). A reply whose tool call does not parse is resampled the
same way before the environment sees it. ``rl.environment`` names a built-in environment
(`BUILT_IN`) or ``module:Class``; a class may list the record fields it reads in ``required_fields``
(checked in every record before any compute). Any other exception from ``reset`` or ``step``, or a
reward that is not a finite number, ends the run with one line naming the record.
"""
from __future__ import annotations

import dataclasses
import json

from k3jax.training.rewards import load_callable, numbers_equal, parse_number


class ToolCallError(ValueError):
    """A tool call the environment cannot run; the rollout resamples the reply."""


@dataclasses.dataclass(frozen=True)
class Turn:
    """The environment's answer to one reply."""

    messages: tuple = ()
    done: bool = False
    reward: float | None = None


def call_arguments(call: dict) -> dict:
    """A parsed call's arguments as a dict (a raw ``json`` call's text is parsed); `ToolCallError` otherwise."""
    arguments = call.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ToolCallError(f"{call.get('name')}: arguments are not JSON") from None
    if not isinstance(arguments, dict):
        raise ToolCallError(f"{call.get('name')}: arguments must be an object")
    return arguments


class Calculator:
    """Adds two integers with the ``add`` tool (the tool of ``configs/chat/calculator.jsonl``); the
    episode ends with the first reply that calls no tool, rewarded 1.0 when its number equals the
    record's ``answer``."""

    TOOLS = {"add": lambda a, b: a + b}
    required_fields = ("answer",)         # checked in every record before the run starts

    def reset(self, record: dict) -> None:
        self.answer = record["answer"]

    def step(self, reply: dict) -> Turn:
        calls = reply.get("tool_calls") or []
        if not calls:
            value, expected = parse_number(reply.get("content", "")), parse_number(str(self.answer))
            right = value is not None and expected is not None and numbers_equal(value, expected)
            return Turn(done=True, reward=float(right))
        results = []
        for call in calls:
            name, arguments = call.get("name"), call_arguments(call)
            if name not in self.TOOLS:
                raise ToolCallError(f"unknown tool {name!r}")
            if set(arguments) != {"a", "b"} or not all(isinstance(arguments[k], int) and not isinstance(arguments[k], bool)
                                                       for k in ("a", "b")):
                raise ToolCallError(f"{name} takes integers a and b, got {arguments}")
            results.append({"role": "tool", "name": name, "content": str(self.TOOLS[name](**arguments))})
        return Turn(messages=tuple(results))


BUILT_IN = {"calculator": Calculator}


def load_environment(name: str):
    """``rl.environment``'s class."""
    return BUILT_IN.get(name) or load_callable(name, "rl.environment")
