"""Rollouts: groups of completions sampled on forked memory banks, with the policy's log-probs.

Each prompt is prefilled once (`k3jax.sessions.SessionStore.open`) and its session forked G - 1
times (KDA state and conv tail copied, MLA pages shared); all P x G sessions then decode together,
one batched step per token (`SessionStore.step`), with the very parameters the update uses. For
each sampled token the rollout records its log-probability under the policy,

    logprob_t = log_softmax(logits_t)[token_t]      (float64 from the step's fp32 logits; no temperature
                                                     or top-p: the policy's own distribution)

which the update recomputes (`k3jax.training.grpo`), by `replay`ing this decode on the sampled
tokens or with the training forward (``rl.update_logprobs``). Token t of a
completion draws from the key fold_in(fold_in(key(seed), stream), position) (`Sampling`): ``seed``
a function of the run's seed and the policy step, ``stream`` of the prompt's slot in the step, the
sample and the attempt -- never of the batch -- so a resumed run samples the same tokens.

A completion stops at the stop token (EOS; ``<|end_of_msg|>`` for chat), at ``max_new_tokens``, or
where the update row (``seq_len + 1`` tokens with the prompt) is full.

With an environment (`k3jax.training.environments`) a completion is an episode of assistant turns:
after each reply the environment answers with tool results, which are rendered in K3's chat format
with the next generation prompt and appended to the same session (no new prefill). A reply whose
tool call does not parse, or that the environment refuses (`ToolCallError`), is undone -- the
session rolls back to its snapshot from before the reply -- and sampled again with another stream.
With several processes the environments live on process 0, which sends each turn's outcome (tool
messages, retry, end and reward) to the others: every tool runs once.

With speculation settings (`k3jax.config.SpeculationConfig`) the sessions decode in speculative rounds instead
(`k3jax.sessions.speculate`): each round drafts up to k tokens per session (prompt lookup or a draft model), verifies them in one
batched call and emits one or more tokens per session, each with the same log-prob as above. A
session after a round is exactly as that many plain steps would leave it (tool turns and rollbacks
work unchanged); greedy completions are token for token the plain ones, sampled ones follow the
same distribution but draw other samples (acceptance tests and residual draws: `k3jax.speculative`),
still functions of the seed, the stream and the sequence itself, not of the batch.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import numpy as np

from k3jax.data.chat_format import generation_prompt, render_conversation
from k3jax.inference.mirror import on_the_leader
from k3jax.sampling import log_softmax
from k3jax.sessions import Sampling, SessionStore
from k3jax.sessions.speculate import Speculator
from k3jax.config import SpeculationConfig
from k3jax.training.environments import ToolCallError
from k3jax.training.rewards import RewardTerm, checked_reward, score_on_the_leader, user_call


@dataclasses.dataclass
class Completion:
    """One sampled completion of a prompt. ``tokens``: every token after the prompt (with an
    environment, the tool results and generation prompts between the replies too); ``sampled``:
    which of them the policy sampled (the update's loss counts only those); ``logprobs``: the
    policy's log-prob of each sampled token (None for the others)."""

    prompt_index: int
    sample: int
    prompt: object                        # k3jax.data.Prompt
    tokens: list = dataclasses.field(default_factory=list)
    sampled: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: str = ""               # stop | length | turns (rl.max_turns) | tool_error
    text: str = ""
    reward: float = 0.0
    reward_terms: dict = dataclasses.field(default_factory=dict)   # with several rewards: each one's value
    advantage: float = 0.0
    tool_calls: int = 0
    retries: int = 0
    resampling: int = 0                   # the step's sampling round that drew it (rl.resample_rounds)

    def add(self, tokens, logprobs=None) -> None:
        """Append sampled tokens (with their log-probs) or, without, tokens the environment inserted."""
        self.tokens += list(map(int, tokens))
        self.sampled += [logprobs is not None] * len(tokens)
        self.logprobs += list(map(float, logprobs)) if logprobs is not None else [None] * len(tokens)

    @property
    def length(self) -> int:
        """Tokens the policy sampled."""
        return sum(self.sampled)


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    temperature: float
    top_k: int | None
    top_p: float
    max_new_tokens: int


@dataclasses.dataclass
class Decoded:
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    stopped: bool = False


def _steps(store: SessionStore, rules: dict) -> dict[int, tuple[list, list]]:
    """One batched decode step of every session of ``rules`` -> {sid: ([token], [its log-prob])}."""
    sids = list(rules)
    logprobs = dict(zip(sids, log_softmax(np.stack([store.logits(sid) for sid in sids]))))   # one call per step
    return {sid: ([token], [float(logprobs[sid][token])]) for sid, token in store.step(rules).items()}


def _rounds(speculator: Speculator, rules: dict, remaining: dict, stop_id: int) -> dict[int, tuple[list, list]]:
    """One speculative round of every session of ``rules`` -> {sid: (tokens, their log-probs)}: at
    least one token and at most ``remaining[sid]``, none after ``stop_id``."""
    results = speculator.round(rules, limits=remaining, stop_ids=[stop_id])
    return {sid: (result.tokens, result.logprobs) for sid, result in results.items()}


def decode(store: SessionStore, rules: dict, limits: dict, stop_id: int,
           speculator: Speculator | None = None) -> dict[int, Decoded]:
    """Sample each session of ``rules`` ({sid: `Sampling`}) until its ``stop_id`` or ``limits[sid]``
    tokens -> {sid: `Decoded`} (tokens, their policy log-probs). All running sessions advance together:
    one batched step per token, or with ``speculator`` (over ``store``) one speculative round per
    iteration; a session that finishes then leaves the speculator (no draft state carries over to a
    later turn or past a rollback)."""
    out = {sid: Decoded() for sid in rules}
    active = {sid: rule for sid, rule in rules.items() if limits[sid] > 0}
    while active:
        if speculator is None:
            advanced = _steps(store, active)
        else:
            advanced = _rounds(speculator, active, {sid: limits[sid] - len(out[sid].tokens) for sid in active}, stop_id)
        for sid, (tokens, logprobs) in advanced.items():
            decoded = out[sid]
            decoded.tokens += tokens
            decoded.logprobs += logprobs
            decoded.stopped = tokens[-1] == stop_id
            if decoded.stopped or len(decoded.tokens) >= limits[sid]:
                del active[sid]
                if speculator is not None:
                    speculator.leave(sid)
    return out


def open_group(store: SessionStore, prompt_tokens, size: int, fork: bool = True) -> list[int]:
    """``size`` sessions of one prompt -> their ids: the prompt prefilled once and its session
    forked ``size`` - 1 times (KDA state copied, MLA pages shared), or with ``fork`` False
    prefilled once per session."""
    first = store.open(prompt_tokens)
    return [first] + [store.fork(first) if fork else store.open(prompt_tokens) for _ in range(size - 1)]


def _run_end(flags: list, start: int) -> int:
    """The end of the run of equal ``flags`` that starts at ``start``."""
    end = start
    while end < len(flags) and flags[end] == flags[start]:
        end += 1
    return end


def replay(store: SessionStore, groups) -> list[list[np.ndarray]]:
    """The log-prob of every sampled token of ``groups``' completions (`Rollout.sample`'s) under
    ``store``'s model, computed as the rollout computed it -> for each group, one float64 array per
    completion. Each prompt is prefilled once and forked G - 1 times; then, reply by reply as the
    rollout decoded them, every session's next reply is fed back token by token, all sessions
    together in one batched decode step per position (`SessionStore.feed`: the program that sampled
    them), and the tokens the environment inserted after it are appended as they were. With the
    rollout's parameters (and its store's capacity, `SessionStore.reserve`) these are its programs
    on its inputs in its batches, so the result is its recorded log-probs bit for bit -- except
    where the rollout's batches held what the completions do not: a reply it discarded (a tool
    call retried) or speculative rounds (which scored tokens with the verify program); those agree
    to fp32 rounding."""
    sessions = {sid: completion for group in groups
                for sid, completion in zip(open_group(store, group[0].prompt.tokens, len(group)), group)}
    position = dict.fromkeys(sessions, 0)
    logprobs = {sid: [] for sid in sessions}
    try:
        while True:
            reply_ends = {}
            for sid, completion in sessions.items():
                if position[sid] < len(completion.tokens) and not completion.sampled[position[sid]]:
                    end = _run_end(completion.sampled, position[sid])       # tool results, then the next reply
                    store.append(sid, completion.tokens[position[sid] : end])
                    position[sid] = end
                if position[sid] < len(completion.tokens):
                    reply_ends[sid] = _run_end(completion.sampled, position[sid])
            if not reply_ends:
                break
            while forced := {sid: sessions[sid].tokens[position[sid]] for sid, end in reply_ends.items()
                             if position[sid] < end}:
                rows = dict(zip(forced, log_softmax(np.stack([store.logits(sid) for sid in forced]))))
                for sid, token in store.feed(forced).items():
                    logprobs[sid].append(rows[sid][token])
                    position[sid] += 1
    finally:
        for sid in sessions:
            store.close(sid)
    order = iter(sessions)
    return [[np.asarray(logprobs[next(order)], np.float64) for _ in group] for group in groups]


class Rollout:
    """Sampling for one policy: ``model`` (its adapters' dropout off), its prompts' ``dataset``
    (`k3jax.data.PromptDataset`), ``settings`` and the reward (a function of ``(prompt, completion,
    record)``, or `k3jax.training.rewards.RewardTerm` s, scored together once the batch is decoded)
    or environment class; ``speculation``
    (a `k3jax.config.SpeculationConfig` with a draft source; ``draft``: the model of its draft run)
    decodes in speculative rounds on the rollout's own store."""

    def __init__(self, model, dataset, settings: SamplingSettings, *, reward: Callable | list | None = None,
                 environment=None, tool_retries: int = 0, max_turns: int = 1, fingerprint: str | None = None,
                 speculation: SpeculationConfig | None = None, draft=None, reward_timeout: float | None = None,
                 reward_channel=None):
        """``reward_timeout``: seconds a reward or environment call may take (None: unbounded);
        ``reward_channel``: with several processes, the `k3jax.inference.mirror.Channel` over which
        process 0 sends the rewards it computed (`score_on_the_leader`) and what each environment
        turn led to (the environments live on process 0 alone)."""
        self.model, self.dataset, self.settings = model, dataset, settings
        self.rewards = reward if isinstance(reward, list) or reward is None else [RewardTerm("reward", 1.0, reward)]
        self.environment, self.reward_timeout, self.reward_channel = environment, reward_timeout, reward_channel
        self.tool_retries, self.max_turns = tool_retries, max_turns
        self.store = SessionStore(model, fingerprint=fingerprint, prefix_cache=False)
        speculating = speculation is not None and speculation.enabled
        self.speculator = Speculator.of(self.store, speculation, draft) if speculating else None
        self.attempts = max_turns * (tool_retries + 1)   # streams per completion
        self.seconds = 0.0

    # -- what to sample ------------------------------------------------------------------------

    def _rule(self, seed: int, slot: int, attempt: int, greedy: bool) -> Sampling:
        s = self.settings
        if greedy:
            return Sampling(0.0, stream=0)
        return Sampling(s.temperature, s.top_k, None if s.top_p >= 1 else s.top_p, seed=seed,
                        stream=slot * self.attempts + attempt)

    def _row_room(self, completion: Completion) -> int:
        """Tokens the update row (``seq_len + 1`` with the prompt) still holds after the completion."""
        return self.dataset.seq_len + 1 - completion.prompt.tokens.size - len(completion.tokens)

    def _room(self, completion: Completion) -> int:
        """Tokens the completion may still sample: its budget and the update row's room."""
        return max(0, min(self.settings.max_new_tokens - completion.length, self._row_room(completion)))

    def _text(self, tokens) -> str:
        """A completion's text: a chat reply's response channel; else its tokens decoded, without the
        stop token and ids beyond the tokenizer's vocabulary (a model's vocabulary may be padded)."""
        if self.dataset.chat:
            return self.dataset.encoder.parse_reply(tokens, self.dataset.thinking).content
        tokenizer = self.dataset.tokenizer
        return tokenizer.decode([t for t in tokens if t != self.dataset.stop_id and t < tokenizer.vocab_size])

    # -- the rollout ---------------------------------------------------------------------------

    def sample(self, prompts, group_size: int, seed: int, greedy: bool = False,
               fork: bool = True) -> list[list[Completion]]:
        """``group_size`` completions of each ``(index, Prompt)`` of ``prompts`` (greedy: temperature
        0), rewarded -> one list per prompt. Completion g of the prompt in slot i of ``prompts``
        samples with stream (i * G + g) * attempts + attempt. ``fork`` False prefills the prompt once
        per completion instead of forking one prefill (the baseline `bench.rl` compares)."""
        started = time.perf_counter()
        self.store.reserve(*self._capacity(len(prompts) * group_size))
        groups, sessions = [], {}
        for slot, (index, prompt) in enumerate(prompts):
            group = [Completion(index, sample, prompt) for sample in range(group_size)]
            for sample, (sid, completion) in enumerate(zip(open_group(self.store, prompt.tokens, group_size, fork), group)):
                sessions[sid] = (slot * group_size + sample, completion)
            groups.append(group)
        try:
            if self.environment is None:
                self._single_turn(sessions, seed, greedy)
            else:
                self._episodes(sessions, seed, greedy)
        finally:
            for sid in sessions:
                if self.speculator is not None:
                    self.speculator.leave(sid)          # after an error mid-decode, its draft session too
                self.store.close(sid)
        self.seconds += time.perf_counter() - started
        return groups

    def _capacity(self, sessions: int) -> tuple[int, int]:
        """The KDA slots and MLA pages ``sessions`` completions can hold at once, reserved before a
        rollout starts, so that all of it runs (and compiles its programs) at one pool shape rather
        than at each size the pools would pass through: a slot per session, per snapshot (with an
        environment) and per padding row of a decode batch; the pages of a full update row (and a
        verify's drafts past it) and one copied on write, per session."""
        slots = sessions * (3 if self.environment is not None else 2) - 1
        drafts = 0 if self.speculator is None else self.speculator.k
        pages = sessions * (math.ceil((self.dataset.seq_len + 1 + drafts) / self.store.page_size) + 1)
        return slots, pages

    def speculation_metrics(self) -> dict:
        """This rollout's speculation counters as ``speculation_*`` metrics (none without speculation):
        the acceptance rate of drafts, accepted drafts and emitted tokens per sequence-round, and the
        seconds spent drafting and verifying."""
        if self.speculator is None:
            return {}
        stats = self.speculator.stats
        return {"speculation_acceptance_rate": stats.acceptance_rate,
                "speculation_mean_accepted_length": stats.mean_accepted_length,
                "speculation_tokens_per_round": stats.emitted / stats.rounds if stats.rounds else 0.0,
                "speculation_draft_seconds": stats.draft_seconds, "speculation_verify_seconds": stats.verify_seconds}

    def _single_turn(self, sessions: dict, seed: int, greedy: bool) -> None:
        rules = {sid: self._rule(seed, slot, 0, greedy) for sid, (slot, _) in sessions.items()}
        limits = {sid: self._room(completion) for sid, (_, completion) in sessions.items()}
        for sid, decoded in decode(self.store, rules, limits, self.dataset.stop_id, self.speculator).items():
            completion = sessions[sid][1]
            completion.add(decoded.tokens, decoded.logprobs)
            completion.finish_reason = "stop" if decoded.stopped else "length"
            completion.text = self._text(decoded.tokens)
        score_on_the_leader(self.rewards, [completion for _, completion in sessions.values()], self.reward_timeout,
                            self.reward_channel)

    def _episodes(self, sessions: dict, seed: int, greedy: bool) -> None:
        """Assistant turns of every episode together, one batched decode per turn, until each is done.
        With several processes the environments live on process 0 alone, which sends what each turn
        led to (`k3jax.inference.mirror.on_the_leader`): each tool runs once."""
        envs: dict = {}                     # the leader's only
        on_the_leader(self.reward_channel, lambda: envs.update(self._started_environments(sessions)))
        attempts, turns, turn_retries = dict.fromkeys(sessions, 0), dict.fromkeys(sessions, 0), dict.fromkeys(sessions, 0)
        running = set(sessions)
        while running:
            snapshots = {sid: self.store.snapshot(sid) for sid in running}
            rules = {sid: self._rule(seed, sessions[sid][0], attempts[sid], greedy) for sid in running}
            limits = {sid: self._room(sessions[sid][1]) for sid in running}
            decoded = decode(self.store, rules, limits, self.dataset.stop_id, self.speculator)
            replies = on_the_leader(self.reward_channel, lambda: {
                sid: self._reply(envs[sid], sessions[sid][1], decoded[sid]) for sid in sorted(running)})
            for sid in sorted(running):
                completion = sessions[sid][1]
                attempts[sid] += 1
                outcome, ended = replies[sid]
                for field, value in ended.items():
                    setattr(completion, field, value)
                if outcome == "retry" and turn_retries[sid] < self.tool_retries:
                    turn_retries[sid] += 1
                    completion.retries += 1
                    self.store.rollback(sid, snapshots[sid])
                    continue
                completion.add(decoded[sid].tokens, decoded[sid].logprobs)
                turns[sid] += 1
                turn_retries[sid] = 0
                if outcome == "retry":
                    completion.finish_reason, completion.reward = "tool_error", 0.0
                elif isinstance(outcome, tuple):                   # tool results to feed back
                    tokens = self._tool_turn(outcome)
                    if turns[sid] >= self.max_turns:
                        completion.finish_reason, completion.reward = "turns", 0.0
                    elif len(tokens) >= self._row_room(completion) or self._room(completion) == 0:
                        completion.finish_reason, completion.reward = "length", 0.0
                    else:
                        self.store.append(sid, tokens)
                        completion.add(tokens)
                        continue
                running.discard(sid)

    def _started_environments(self, sessions: dict) -> dict:
        """``{sid: environment}``: one per episode, reset with its prompt's record."""
        envs = {}
        for sid, (_, completion) in sessions.items():
            env = self.environment()
            self._environment_call(completion, lambda: env.reset(completion.prompt.record))
            envs[sid] = env
        return envs

    def _reply(self, env, completion: Completion, decoded: Decoded) -> tuple:
        """``(what a reply leads to, the completion's fields it sets)``: "retry" (a call that does not
        parse or run), a tuple of tool messages, or None when the episode ended (its reward, finish
        reason and text set); every reply that reaches the environment adds its tool calls."""
        if not decoded.stopped:
            return None, {"finish_reason": "length", "reward": 0.0, "text": self._text(decoded.tokens)}
        reply = self.dataset.encoder.parse_reply(decoded.tokens, self.dataset.thinking)
        if reply.malformed:
            return "retry", {}
        message = {**reply.message(self.dataset.thinking), "tool_calls": reply.tool_calls}
        try:
            turn = self._environment_call(completion, lambda: env.step(message))
        except ToolCallError:
            return "retry", {}
        calls = {"tool_calls": completion.tool_calls + len(reply.tool_calls)}
        if turn.done:
            return None, {**calls, "finish_reason": "stop", "text": reply.content,
                          "reward": checked_reward(turn.reward, completion.prompt.where)}
        return tuple(turn.messages), calls

    def _environment_call(self, completion: Completion, call):
        """``call()`` of the episode's environment, bounded (`user_call`; a `ToolCallError` passes)."""
        return user_call(call, "the environment", completion.prompt.where, self.reward_timeout, (ToolCallError,))

    def _tool_turn(self, messages: tuple) -> np.ndarray:
        """Tool results rendered in K3's chat format, then the next generation prompt."""
        thinking = self.dataset.thinking
        segments = render_conversation(list(messages), thinking=thinking, thinking_effort=None, where="tool results")
        return self.dataset.encoder.encode(segments + generation_prompt(thinking))[0]
