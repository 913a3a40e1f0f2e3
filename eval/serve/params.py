"""A checked request (`eval.serve.protocol`) as the engine takes it: the model's name, sampling
and logits options, each choice's random stream, thinking and its effort, stop ids and stop strings
(found and held back in time linear in the streamed text)."""
from __future__ import annotations

import secrets

from k3jax.sessions import Sampling
from .errors import ServeError
from .limits import shown
from .protocol import ChatTemplateKwargs, Choices, Request, Sampled


def model_choice(request: Request, served) -> tuple[str, str]:
    """``(name, adapter tag)`` of the model the request names (`ServedModel.resolve`: the base,
    which no name also picks, or a loaded LoRA adapter); a 404 for any other name."""
    choice = served.resolve(request.model)
    if choice is None:
        raise ServeError(404, f"the model {shown(request.model)} does not exist; this server serves "
                         f"{', '.join(map(repr, served.model_names()))}", "not_found_error", param="model")
    return choice


def sampling(request: Sampled) -> tuple[float, float | None, int]:
    """(temperature, top_p or None, seed): top_p 1 is no filter; no seed draws one."""
    seed = secrets.randbits(32) if request.seed is None else request.seed
    return request.temperature, (None if request.top_p >= 1.0 else request.top_p), seed


def chat_reasoning(effort: str | None, template: ChatTemplateKwargs | None, chat,
                   effort_param: str = "reasoning_effort") -> tuple[bool, str | None]:
    """(thinking, thinking effort) a request asks for: ``effort`` (chat's ``reasoning_effort``, a
    response's ``reasoning.effort``: "none" is no thinking) and ``chat_template_kwargs`` ``thinking``
    / ``thinking_effort``, each left out taking the run's (``chat``: `k3jax.inference.chat.ChatTurns`).
    A 400 naming the field when they disagree or ask for an effort without thinking."""
    thinking = template.thinking if template is not None else None
    template_effort = template.thinking_effort if template is not None else None
    if effort is not None and template_effort is not None and effort != template_effort:
        raise ServeError(400, f"{effort_param} {effort!r} and chat_template_kwargs.thinking_effort "
                         f"{template_effort!r} disagree; send one", param=effort_param)
    effort = effort if effort is not None else template_effort
    if effort == "none":
        if thinking:
            raise ServeError(400, f"{effort_param} 'none' turns thinking off, but chat_template_kwargs.thinking is true",
                             param=effort_param)
        return False, None
    thinking = chat.thinking if thinking is None else thinking
    if effort is not None and not thinking:
        raise ServeError(400, f"{effort_param} {effort!r} needs thinking, which is off for this request "
                         "(chat_template_kwargs.thinking or the run's data.chat_thinking)", param=effort_param)
    return thinking, effort if effort is not None else chat.thinking_effort if thinking else None


def logits_options(request: Choices, vocab_size: int) -> dict:
    """The `Sampling` keyword arguments of a request's logits options (top_k -1 or 0 is off); a 400
    naming ``logit_bias`` or ``stop_token_ids`` for a token id outside the model's vocabulary."""
    bias = tuple((int(key), value) for key, value in request.logit_bias.items())
    for param, ids in (("logit_bias", [token for token, _ in bias]), ("stop_token_ids", request.stop_token_ids)):
        outside = [token for token in ids if not 0 <= token < vocab_size]
        if outside:
            raise ServeError(400, f"{param}: token id {outside[0]} is outside [0, {vocab_size})", param=param)
    return {"top_k": request.top_k if request.top_k > 0 else None, "min_p": request.min_p, "logit_bias": bias,
            "presence_penalty": request.presence_penalty, "frequency_penalty": request.frequency_penalty,
            "repetition_penalty": request.repetition_penalty}


def choice_sampling(temperature: float, top_p: float | None, seed: int, choice: int, options: dict | None = None,
                    generated_from: int = 0, constraint=None) -> Sampling:
    """Choice ``choice``'s sampling: its own stream of the request's seed, so a request's output
    depends on its seed and parameters, never on the requests it is batched with; ``options``
    (`logits_options`) with the penalties counting the tokens from history position
    ``generated_from``, and the choice's own grammar state ``constraint``."""
    return Sampling(temperature, top_p=top_p, seed=seed % 2**32, stream=choice, generated_from=generated_from,
                    constraint=constraint, **(options or {}))


class StopFinder:
    """Where the earliest of ``stops`` starts in a text given piece by piece, each character looked
    at O(1) times: a piece is searched together with the last ``max(len(stop)) - 1`` characters
    before it (a stop that straddles pieces), never the text again (one found earlier would have
    ended it). ``StopFinder(stops).feed(text)`` reads a whole text."""

    def __init__(self, stops: list[str]):
        self.stops, self.keep = stops, max((len(stop) for stop in stops), default=1) - 1
        self.tail, self.length = "", 0          # the text's last `keep` characters, its length

    def feed(self, piece: str) -> int | None:
        """``piece`` added -> where the earliest stop starts in the whole text, or None."""
        window = self.tail + piece
        found = [index for index in (window.find(stop) for stop in self.stops) if index >= 0]
        start = self.length - len(self.tail)
        self.length += len(piece)
        self.tail = window[max(0, len(window) - self.keep):] if self.keep else ""
        return start + min(found) if found else None


class HeldText:
    """A streamed text under stop strings: each piece sends what is certain -- up to a stop string
    (then nothing more), else all but the last ``max(len(stop)) - 1`` characters, which a stop
    string could still claim (sent at the end). The pieces sent join to the text cut at its first
    stop, as a reply that is not streamed shows it."""

    def __init__(self, stops: list[str]):
        self.finder = StopFinder(stops) if stops else None
        self.held, self.sent, self.stopped = "", 0, False

    def push(self, piece: str, final: bool = False) -> str:
        """``piece`` added (``final``: the text ends) -> the text to send now."""
        if self.stopped:
            return ""
        text = self.held + piece
        cut = self.finder.feed(piece) if self.finder is not None else None
        if cut is not None:
            self.stopped, send = True, text[: cut - self.sent]
        elif final or self.finder is None:
            send = text
        else:
            send = text[: max(0, len(text) - self.finder.keep)]
        self.held = "" if self.stopped else text[len(send):]
        self.sent += len(send)
        return send
