"""Rollouts on forked sessions against the full forward over each whole sequence: the recorded
log-probs are the model's (<= 1e-5), greedy groups are `k3jax.inference.generation`, one prefill per prompt,
samples depend on (seed, slot, sample) only; tool episodes continue their session exactly through
tool results and rollbacks. A `replay` of a rollout's tokens gives its recorded log-probs bit for bit
(and another policy's its own). Speculative rollouts (prompt lookup, or the model drafting for
itself) record the same log-probs, and greedy ones are the plain ones token for token."""
import json

import jax
import numpy as np
import pytest
from flax import nnx

from k3jax.config import load_config
from k3jax.data import PromptDataset
from k3jax.data.chat_format import generation_prompt, render_conversation
from k3jax.inference.generation import generate
from k3jax.sampling import log_softmax
from k3jax.model import K3Model
from k3jax.sessions import SessionStore
from k3jax.training.environments import ToolCallError, Turn
from k3jax.config import SpeculationConfig
from k3jax.training.rollout import Rollout, SamplingSettings, replay
from tests.data.chat_tokenizer import write_chat_tokenizer
from tests.helpers import MICRO
from tests.train.test_rl_inputs import MemoryChannel

@pytest.fixture(scope="module")
def model():
    return K3Model(load_config(MICRO).model, rngs=nnx.Rngs(0))


_logits = nnx.jit(lambda m, tokens: m(tokens).logits)   # one jitted function: models of one graph share its programs


def forward_of(model):
    """The model's logits over ``tokens``, padded to a power of two (a few compiled programs serve all)."""
    call = _logits
    padded = lambda tokens: np.pad(np.asarray(tokens, np.int32), (0, (1 << (len(tokens) - 1).bit_length()) - len(tokens)))  # noqa: E731
    return lambda tokens: np.asarray(call(model, padded(tokens)[None])[0])


@pytest.fixture(scope="module")
def forward(model):
    return forward_of(model)


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a} plus {b} is", "answer": str(a + b)}) + "\n"
                            for a in range(3) for b in range(3)))
    return PromptDataset(path, 24, heldout_fraction=0)


def full_forward_logprobs(forward, completion) -> np.ndarray:
    """log_softmax of the full forward over prompt + completion, at each sampled token, float64."""
    sequence = np.concatenate([completion.prompt.tokens, completion.tokens])
    logprobs = log_softmax(forward(sequence)[: len(sequence) - 1])
    start = completion.prompt.tokens.size - 1
    return np.array([logprobs[start + i, token] for i, (token, sampled) in
                     enumerate(zip(completion.tokens, completion.sampled)) if sampled])


def recorded(completion) -> np.ndarray:
    return np.array([lp for lp in completion.logprobs if lp is not None])


SAMPLING = SamplingSettings(temperature=1.0, top_k=None, top_p=1.0, max_new_tokens=8)
LARGEST = 3 * 4   # sessions of this file's largest rollout (3 prompts, 4 samples each)


def rollout_of(model, data, settings=SAMPLING, **options) -> Rollout:
    """A rollout whose pools start at the largest rollout's capacity: every program is compiled for
    the pools' shape, so the fast tests' rollouts then share their prefill and decode programs
    instead of each compiling its own at its own pool size."""
    rollout = Rollout(model, data, settings, **options)
    rollout.store.reserve(*rollout._capacity(LARGEST))
    return rollout


@pytest.fixture(scope="module")
def sampled(model, text_data):
    """``(rollout, prompts, groups)``: 4 completions of each of prompts 0-2 (seed 7), rewarded by length."""
    rollout = rollout_of(model, text_data, reward=lambda p, c, r: float(len(c)))
    prompts = text_data.prompts(0, 3)
    return rollout, prompts, rollout.sample(prompts, 4, seed=7)


def test_group_log_probs_are_the_full_forwards_and_one_prefill_per_prompt(forward, text_data, sampled):
    rollout, prompts, groups = sampled
    assert rollout.store.stats()["prefill_tokens"] == sum(p.tokens.size for _, p in prompts)
    assert rollout.store.sessions() == []
    worst = 0.0
    for (index, prompt), group in zip(prompts, groups):
        assert [(c.prompt_index, c.sample) for c in group] == [(index, g) for g in range(4)]
        assert len({tuple(c.tokens) for c in group}) > 1                 # the forks sample apart
        for c in group:
            assert c.finish_reason == ("stop" if c.tokens[-1] == text_data.stop_id else "length")
            assert len(c.tokens) <= 8 and all(c.sampled) and c.reward == len(c.text)
            worst = max(worst, float(np.abs(recorded(c) - full_forward_logprobs(forward, c)).max()))
    assert worst <= 1e-5


def test_a_replay_gives_the_recorded_log_probs_bit_for_bit_and_another_policy_its_own(model, sampled):
    rollout, prompts, groups = sampled
    store = SessionStore(model, prefix_cache=False)
    stats = rollout.store.stats()
    store.reserve(stats["slot_capacity"], stats["page_capacity"])          # as the trainer does
    replayed = replay(store, groups)
    assert [[len(v) for v in values] for values in replayed] == [[c.length for c in group] for group in groups]
    for group, values in zip(groups, replayed):
        for c, v in zip(group, values):
            np.testing.assert_array_equal(v, recorded(c))                  # the same programs on the same inputs
    assert store.sessions() == [] and store.stats()["prefill_tokens"] == sum(p.tokens.size for _, p in prompts)
    graph, params = nnx.split(model)                                       # the update's next parameters
    other = nnx.merge(graph, jax.tree.map(lambda x: x * 1.05, params))
    other_forward = forward_of(other)
    other_store = SessionStore(other, prefix_cache=False)
    other_store.reserve(stats["slot_capacity"], stats["page_capacity"])   # the same programs, other parameters
    for group, values in zip(groups, replay(other_store, groups)):
        for c, v in zip(group, values):
            assert np.abs(v - full_forward_logprobs(other_forward, c)).max() <= 1e-5
            assert np.abs(v - recorded(c)).max() > 1e-4                   # recomputed, not copied


def test_forked_groups_equal_groups_prefilled_once_per_sample(model, text_data):
    prompts = text_data.prompts(2, 2)
    forked = rollout_of(model, text_data, reward=lambda *a: 0.0)
    groups = forked.sample(prompts, 3, seed=5)
    separate = rollout_of(model, text_data, reward=lambda *a: 0.0)
    expected = separate.sample(prompts, 3, seed=5, fork=False)
    assert [[(c.tokens, c.logprobs) for c in g] for g in groups] == [[(c.tokens, c.logprobs) for c in g] for g in expected]
    assert separate.store.stats()["prefill_tokens"] == 3 * forked.store.stats()["prefill_tokens"]


def test_samples_depend_on_seed_slot_and_sample_only(model, text_data):
    prompts = text_data.prompts(0, 3)
    together = rollout_of(model, text_data, reward=lambda *a: 0.0).sample(prompts, 3, seed=7)
    alone = rollout_of(model, text_data, reward=lambda *a: 0.0).sample(prompts[:1], 3, seed=7)
    other_seed = rollout_of(model, text_data, reward=lambda *a: 0.0).sample(prompts[:1], 3, seed=8)
    assert [c.tokens for c in alone[0]] == [c.tokens for c in together[0]]
    # another batch size is another compiled program: the log-probs may differ in the last bits
    np.testing.assert_allclose(np.concatenate([c.logprobs for c in alone[0]]),
                               np.concatenate([c.logprobs for c in together[0]]), rtol=0, atol=1e-6)
    assert [c.tokens for c in other_seed[0]] != [c.tokens for c in alone[0]]


def test_a_greedy_group_is_generate_for_every_sample(model, text_data):
    prompts = text_data.prompts(1, 2)
    groups = rollout_of(model, text_data, reward=lambda *a: 0.0).sample(prompts, 3, seed=0, greedy=True)
    for (_, prompt), group in zip(prompts, groups):
        expected = generate(model, prompt.tokens, max_new_tokens=8, eos_id=text_data.stop_id)
        for c in group:
            assert c.tokens == np.asarray(expected.tokens)[: int(expected.lengths)].tolist()


class StopAt:
    """The dataset with another stop token: a random model's greedy cycle (445) ends its replies."""

    def __init__(self, data, stop_id):
        self._data, self.stop_id = data, stop_id

    def __getattr__(self, name):
        return getattr(self._data, name)


class Scripted:
    """Refuses the first reply, answers the next with a tool result, ends on the one after."""

    calls = []

    def reset(self, record):
        self.turns, self.refused = 0, False

    def step(self, reply):
        Scripted.calls.append(reply)
        if not self.refused:
            self.refused = True
            raise ToolCallError("first reply refused")
        self.turns += 1
        if self.turns < 2:
            return Turn(messages=({"role": "tool", "name": "add", "content": str(40 + self.turns)},))
        return Turn(done=True, reward=1.5)


def never_built():
    raise AssertionError("a follower process built an environment")


@pytest.mark.slow   # ~40 s: long chat sequences compile their own prefill, decode and reference programs
def test_tool_episodes_continue_their_session_through_tool_results_and_rollbacks(model, forward, tmp_path):
    tokenizer = write_chat_tokenizer(tmp_path / "tok")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"add {a} and 2"}]})
                                              + "\n" for a in range(2)))
    chat = PromptDataset(tmp_path / "c.jsonl", 360, tokenizer_path=tokenizer, heldout_fraction=0, thinking=False,
                         thinking_effort=None)
    data = StopAt(chat, 445)
    settings = SamplingSettings(temperature=1.0, top_k=1, top_p=1.0, max_new_tokens=60)
    messages = []           # as process 0 of several: it alone runs the environments, the others take its outcomes
    rollout = Rollout(model, data, settings, environment=Scripted, tool_retries=2, max_turns=4,
                      reward_channel=MemoryChannel(True, messages))
    groups = rollout.sample(chat.prompts(0, 2), 2, seed=3)
    tool_turn = lambda n: chat.encoder.encode(render_conversation(  # noqa: E731
        [{"role": "tool", "name": "add", "content": str(40 + n)}], thinking=False, thinking_effort=None)
        + generation_prompt(False))[0].tolist()
    finished = 0
    for c in (c for group in groups for c in group):
        assert np.abs(recorded(c) - full_forward_logprobs(forward, c)).max() <= 1e-5
        if c.finish_reason != "stop":
            continue
        finished += 1
        assert c.retries == 1 and c.reward == 1.5
        inserted = [t for t, sampled in zip(c.tokens, c.sampled) if not sampled]
        assert inserted == tool_turn(1)
        assert sum(1 for t, s in zip(c.tokens, c.sampled) if s and t == 445) == 2      # two replies kept
    assert finished >= 2 and rollout.store.sessions() == []
    assert len(Scripted.calls) >= 3 * finished
    follower = Rollout(model, data, settings, environment=never_built, tool_retries=2, max_turns=4,
                       reward_channel=MemoryChannel(False, messages))
    followed = follower.sample(chat.prompts(0, 2), 2, seed=3)      # the same store calls, no environment
    fields = lambda c: (c.tokens, c.sampled, c.logprobs, c.finish_reason, c.text, c.reward, c.tool_calls,  # noqa: E731
                        c.retries)
    assert [list(map(fields, g)) for g in followed] == [list(map(fields, g)) for g in groups] and messages == []
    for group, values in zip(groups, replay(SessionStore(model, prefix_cache=False), groups)):
        for c, v in zip(group, values):            # the retried replies are not replayed: other batches
            assert np.abs(v - recorded(c)).max() <= 1e-6


# 12 tokens: a random model's greedy completions start to repeat, so prompt lookup drafts and has some accepted
LONGER = SamplingSettings(temperature=1.0, top_k=2, top_p=1.0, max_new_tokens=12)


def speculative(model, data, drafter: str) -> Rollout:
    """A rollout drafting by prompt lookup over bigrams, or with the model itself; two drafts a round
    at most (each replayed length, batch and round width is a program of its own to compile)."""
    speculation = SpeculationConfig(prompt_lookup=2, k=2) if drafter == "lookup" else SpeculationConfig(draft="self", k=2)
    return Rollout(model, data, LONGER, reward=lambda *a: 0.0, speculation=speculation,
                   draft=None if drafter == "lookup" else model)


def worst_logprob_error(forward, groups) -> float:
    return max(float(np.abs(recorded(c) - full_forward_logprobs(forward, c)).max()) for g in groups for c in g)


@pytest.mark.slow   # ~45 s for both: the plain, verify and replay programs and the draft store's compile
@pytest.mark.parametrize("drafter", ["lookup", "self"])
def test_greedy_speculative_rollouts_are_the_plain_ones(model, forward, text_data, drafter):
    prompts = text_data.prompts(1, 2)
    plain = Rollout(model, text_data, LONGER, reward=lambda *a: 0.0).sample(prompts, 2, seed=0, greedy=True)
    rollout = speculative(model, text_data, drafter)
    groups = rollout.sample(prompts, 2, seed=0, greedy=True)
    assert [[c.tokens for c in g] for g in groups] == [[c.tokens for c in g] for g in plain]
    assert worst_logprob_error(forward, groups) <= 1e-5
    stats = rollout.speculator.stats
    assert stats.accepted > 0 and stats.emitted == sum(c.length for g in groups for c in g)
    if drafter == "self":
        assert stats.acceptance_rate == 1.0 and rollout.speculator.drafter.store.sessions() == []


@pytest.mark.slow
def test_sampled_speculative_rollouts_record_the_policys_log_probs(model, forward, text_data):
    prompts = text_data.prompts(1, 2)                         # the greedy test's shapes: its programs serve
    rollout = speculative(model, text_data, "self")           # greedy drafts of top-2 samples
    groups = rollout.sample(prompts, 2, seed=7)
    assert worst_logprob_error(forward, groups) <= 1e-5
    assert 0 < rollout.speculator.stats.acceptance_rate < 1   # rounds that accept, and rejections replayed
    again = speculative(model, text_data, "self").sample(prompts, 2, seed=7)
    assert [[c.tokens for c in g] for g in again] == [[c.tokens for c in g] for g in groups]
    for group, values in zip(groups, replay(SessionStore(model, prefix_cache=False), groups)):
        for c, v in zip(group, values):            # the verify program scored them; the replay decodes
            assert np.abs(v - recorded(c)).max() <= 1e-5
