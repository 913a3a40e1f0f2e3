"""Rewards of completions (``rl.reward``, or ``rl.rewards``: several with weights): built-in ones
that compare with the record's ``answer``, or any Python callable named ``module:function``.

    exact_match   1.0 when the completion, stripped, equals str(answer) stripped (a list answer: any of them)
    contains      1.0 when str(answer) occurs in the completion (a list: any of them)
    numeric       1.0 when the completion's last number equals the answer as numbers (a list: any):
                  "1,234.50" = 1234.5; integers compare exactly, others to a relative 1e-9
    math          1.0 when math-verify finds the completion's answer equal to the record's (LaTeX or
                  plain expressions; a list: any); the optional extra ``pip install 'k3jax[math]'``

``rl.reward``'s function is called per completion as ``function(prompt, completion, record) -> float``
(``prompt``: the prompt text, or a chat record's last message; ``completion``: the completion's
text, or a chat reply's response text; ``record``: the whole record). ``rl.rewards`` is a list of
``{name, weight}``: a built-in name is called per completion as above, a ``module:function`` once
per step on the whole batch, ``function(prompts, completions, records) -> list of floats`` (TRL's
``reward_funcs`` style); a completion's reward is then r = sum_k weight_k r_k (`score_completions`).
A reward that raises or returns anything but a finite number is a `RewardError` naming the record
(a batch function: its batch's first record), and so is one that runs past ``rl.reward_timeout``
seconds (`user_call`; a batch function has that long for its whole batch).

With several processes (`score_on_the_leader`) only process 0 calls the rewards; the others
receive its values, so each completion is scored once and every process updates on the same
rewards.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import re
from typing import Any, Callable, Sequence

from k3jax.data.errors import DataError
from k3jax.inference.mirror import on_the_leader
from k3jax.training.signals import CallTimedOut, bounded_call

RewardFunction = Callable[[str, str, dict], float]
NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


class RewardError(DataError):
    """A reward that could not be computed; one line naming the record."""


def _answers(record: dict) -> list[str]:
    answer = record["answer"]
    return [str(a).strip() for a in (answer if isinstance(answer, list) else [answer])]


def exact_match(prompt: str, completion: str, record: dict) -> float:
    return float(completion.strip() in _answers(record))


def contains(prompt: str, completion: str, record: dict) -> float:
    return float(any(answer in completion for answer in _answers(record)))


def parse_number(text: str) -> float | int | None:
    """The last number written in ``text`` (thousands commas allowed), None when there is none."""
    found = NUMBER.findall(text)
    if not found:
        return None
    number = found[-1].replace(",", "")
    try:
        return int(number) if re.fullmatch(r"[-+]?\d+", number) else float(number)
    except ValueError:
        return None


def numbers_equal(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)


def numeric(prompt: str, completion: str, record: dict) -> float:
    value = parse_number(completion)
    if value is None:
        return 0.0
    expected = [parse_number(answer) for answer in _answers(record)]
    return float(any(e is not None and numbers_equal(value, e) for e in expected))


def math_answer(prompt: str, completion: str, record: dict) -> float:
    """math-verify's verdict on the completion against each answer (gold first, as its API wants)."""
    from math_verify import parse, verify

    found = parse(completion, parsing_timeout=None)
    return float(any(verify(parse(answer, parsing_timeout=None), found, timeout_seconds=None)
                     for answer in _answers(record)))


BUILT_IN: dict[str, RewardFunction] = {"exact_match": exact_match, "contains": contains, "numeric": numeric,
                                       "math": math_answer}
NEEDS = {"math": ("math_verify", "math-verify", "math")}   # a built-in's module, its PyPI name, k3jax's extra


@dataclasses.dataclass(frozen=True)
class RewardTerm:
    """One reward of a run: its name, weight, function and whether it is called on a whole batch."""

    name: str
    weight: float
    function: Callable
    batched: bool = False


def built_in(name: str, setting: str) -> RewardFunction:
    """The built-in reward ``name``, after checking that its optional dependency imports."""
    if name in NEEDS:
        module, package, extra = NEEDS[name]
        try:
            importlib.import_module(module)
        except ImportError:
            raise DataError(f"{setting}: the {name} reward needs {package}: pip install 'k3jax[{extra}]'") from None
    return BUILT_IN[name]


def load_rewards(reward: str | None, rewards: Sequence = ()) -> list[RewardTerm]:
    """The run's reward terms: ``rl.rewards`` (``{name, weight}`` each), or else ``rl.reward`` (default
    ``exact_match``) with weight 1."""
    if not rewards:
        return [RewardTerm(reward or "exact_match", 1.0, load_reward(reward or "exact_match"))]
    terms = []
    for index, term in enumerate(rewards):
        setting = f"rl.rewards[{index}].name"
        if term.name in BUILT_IN:
            terms.append(RewardTerm(term.name, term.weight, built_in(term.name, setting)))
        else:
            terms.append(RewardTerm(term.name, term.weight, load_callable(term.name, setting), batched=True))
    return terms


def score_completions(terms: Sequence[RewardTerm], completions: Sequence, timeout: float | None = None) -> None:
    """Set each completion's ``reward`` = sum_k weight_k r_k over ``terms`` and, with several terms,
    ``reward_terms`` = {name: r_k}; a per-completion term is called (`score`) on each, a batched
    one once on all of them (`user_call`, its values checked as `checked_reward`)."""
    if not completions:
        return
    values = []
    for term in terms:
        if not term.batched:
            values.append([score(term.function, c.prompt, c.text, timeout) for c in completions])
            continue
        where = completions[0].prompt.where
        got = user_call(lambda: term.function([c.prompt.text for c in completions], [c.text for c in completions],
                                              [c.prompt.record for c in completions]),
                        f"the reward {term.name}", where, timeout)
        if not isinstance(got, (list, tuple)) or len(got) != len(completions):
            got_what = f"{type(got).__name__} of {len(got)}" if isinstance(got, (list, tuple)) else type(got).__name__
            raise RewardError(f"{where}: the reward {term.name} returned {got_what}, "
                              f"not a list of {len(completions)} numbers (one per completion)")
        values.append([checked_reward(value, c.prompt.where) for value, c in zip(got, completions)])
    for index, completion in enumerate(completions):
        completion.reward = sum(term.weight * value[index] for term, value in zip(terms, values))
        if len(terms) > 1:
            completion.reward_terms = {term.name: value[index] for term, value in zip(terms, values)}


def score_on_the_leader(terms: Sequence[RewardTerm], completions: Sequence, timeout: float | None,
                        channel) -> None:
    """`score_completions` on process 0 of a jax.distributed run, its values taken by the other
    processes (`k3jax.inference.mirror.on_the_leader` over ``channel``; None in one process: scored
    here): a reward with effects runs once per completion, the update sees the same rewards on
    every process, and what stops the leader stops every process."""
    def score() -> list:
        score_completions(terms, completions, timeout)
        return [(c.reward, c.reward_terms) for c in completions]
    for completion, (reward, reward_terms) in zip(completions, on_the_leader(channel, score), strict=True):
        completion.reward, completion.reward_terms = reward, reward_terms


def load_callable(name: str, setting: str) -> Any:
    """The object ``module:attribute`` names; a one-line `DataError` naming ``setting`` otherwise."""
    module_name, sep, attribute = name.partition(":")
    if not sep or not module_name or not attribute:
        raise DataError(f"{setting}: {name!r} is neither built in nor of the form module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - an import can fail in any way; report it in one line
        raise DataError(f"{setting}: cannot import {module_name!r} ({type(error).__name__}: {error})") from None
    try:
        found = getattr(module, attribute)
    except AttributeError:
        raise DataError(f"{setting}: module {module_name!r} has no {attribute!r}") from None
    if not callable(found):
        raise DataError(f"{setting}: {name} is not callable")
    return found


def load_reward(name: str) -> RewardFunction:
    """``rl.reward``'s function."""
    return BUILT_IN.get(name) or load_callable(name, "rl.reward")


def check_records(name: str, prompts, setting: str = "rl.reward") -> None:
    """A built-in reward needs every record's ``answer``: a `DataError` naming the first without one."""
    if name not in BUILT_IN:
        return
    for prompt in prompts:
        if "answer" not in prompt.record:
            raise DataError(f"{prompt.where}: no 'answer' field ({setting}={name} compares the completion with it)")


def checked_reward(value: Any, where: str) -> float:
    """``value`` as a float; a `RewardError` naming the record unless it is a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(f"{where}: the reward is {value!r}, not a finite number")
    return float(value)


def score(reward: RewardFunction, prompt, completion: str, timeout: float | None = None) -> float:
    """``reward(prompt text, completion, record)``, checked and bounded (`user_call`)."""
    value = user_call(lambda: reward(prompt.text, completion, prompt.record), "the reward", prompt.where, timeout)
    return checked_reward(value, prompt.where)


def user_call(call: Callable[[], Any], what: str, where: str, timeout: float | None,
              passing: tuple[type[Exception], ...] = ()) -> Any:
    """``call()`` of a user's function (``what``: "the reward", "the environment") for the record
    ``where``, within ``timeout`` seconds (`k3jax.training.signals.bounded_call`; a SIGTERM / SIGINT
    during it raises `StopRequested`): an exception it raises (but those of ``passing``), or running
    past the timeout, is a `RewardError` naming the record."""
    try:
        with bounded_call(timeout):
            return call()
    except CallTimedOut:
        raise RewardError(f"{where}: {what} took longer than rl.reward_timeout={timeout:g} seconds") from None
    except passing:
        raise
    except Exception as error:  # noqa: BLE001 - a user's function may raise anything
        raise RewardError(f"{where}: {what} raised {type(error).__name__}: {error}") from None
