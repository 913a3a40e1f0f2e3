"""Speculative rounds over a SessionStore (fp32, CPU) against independent computations: greedy
output equals plain greedy decoding token for token; after every round each session's KDA state,
conv tails, MLA rows and logits equal one prefill of its tokens over a contiguous bank, for a batch
of sessions of different lengths and acceptances; reported log-probs equal a float64 log-softmax
of that prefill's logits; sampled rounds are reproducible and keep the same invariants."""
import numpy as np
import pytest
from flax import nnx

from k3jax.inference.generation import generate
from k3jax.model import K3Model
from k3jax.sampling import log_softmax
from k3jax.sessions import DraftModel, PromptLookup, Sampling, SessionStore, Speculator
from k3jax.config import SpeculationConfig
from tests.sessions.conftest import contiguous_bank, contiguous_logits, random_tokens, tiny_config, tiny_model

TOL = dict(rtol=1e-5, atol=1e-5)
NEW = 12
PROMPTS = [random_tokens(10, 5), random_tokens(11, 19), random_tokens(12, 33)]    # lengths around page edges


class ScriptedDrafts:
    """Drafts the known greedy continuation of each session, with the tokens at ``wrong``
    positions of the continuation changed: controlled, different acceptances per session."""

    def __init__(self, prompts: dict, continuations: dict, wrong: dict):
        self.prompts, self.continuations, self.wrong = prompts, continuations, wrong

    def propose(self, histories, lengths):
        drafts = {}
        for sid, history in histories.items():
            start = len(history) - len(self.prompts[sid])
            drafts[sid] = [(int(self.continuations[sid][i]) + (i in self.wrong[sid])) % 64
                           for i in range(start, min(start + lengths[sid], len(self.continuations[sid])))]
        return drafts

    def keep(self, sid, history):
        pass

    def leave(self, sid):
        pass


def assert_session_is_one_prefill(model, store, sid):
    """The session's memory and logits equal one prefill of its tokens; its pages fit its tokens."""
    tokens = store.tokens(sid)
    capacity = 64 * -(-tokens.size // 64)
    bank, value = contiguous_bank(model, tokens, capacity), store._arrays(store._sessions[sid])
    np.testing.assert_allclose(value.state, np.asarray(bank.kda.state[:, 0]), **TOL)
    np.testing.assert_allclose(value.conv, np.asarray(bank.kda.conv[:, 0]), **TOL)
    np.testing.assert_allclose(value.rows, np.asarray(bank.mla.latent[:, 0, : tokens.size]), **TOL)
    np.testing.assert_allclose(store.logits(sid), contiguous_logits(model, tokens, capacity)[-1], **TOL)
    assert len(store._sessions[sid].pages) == store._device.pages_for(tokens.size)


def run_rounds(speculator, sids, sampling, new=NEW):
    """Rounds until every session has ``new`` tokens -> ({sid: tokens}, {sid: log-probs})."""
    tokens, logprobs = {sid: [] for sid in sids}, {sid: [] for sid in sids}
    while any(len(tokens[sid]) < new for sid in sids):
        live = [sid for sid in sids if len(tokens[sid]) < new]
        results = speculator.round({sid: sampling for sid in live}, limits={sid: new - len(tokens[sid]) for sid in live})
        for sid, result in results.items():
            assert 1 <= len(result.tokens) == len(result.logprobs) <= new
            tokens[sid] += result.tokens
            logprobs[sid] += result.logprobs
    return tokens, logprobs


def assert_logprobs_of_one_prefill(model, store, sid, emitted, logprobs):
    tokens = store.tokens(sid)
    start = tokens.size - len(emitted)
    expected = log_softmax(contiguous_logits(model, tokens))[np.arange(start - 1, tokens.size - 1), emitted]
    np.testing.assert_allclose(logprobs, expected, atol=1e-5)


@pytest.mark.slow    # compiles of verify / replay widths and of the reference prefills
@pytest.mark.parametrize("rollback", ["states", "replay"])
def test_greedy_rounds_with_rejections_equal_plain_greedy_and_leave_every_session_as_one_prefill(model, rollback):
    store = SessionStore(model)
    sids = [store.open(prompt) for prompt in PROMPTS]
    plain = dict(zip(sids, store.generate([store.fork(sid) for sid in sids], NEW)))
    wrong = {sids[0]: {2, 3, 7}, sids[1]: {1, 9}, sids[2]: set()}      # different acceptances
    drafter = ScriptedDrafts(dict(zip(sids, PROMPTS)), plain, wrong)
    speculator = Speculator(store, drafter, SpeculationConfig(k=3, adaptive=False, rollback=rollback))
    tokens, logprobs = run_rounds(speculator, sids, Sampling())
    for sid in sids:
        assert_session_is_one_prefill(model, store, sid)
        np.testing.assert_array_equal(tokens[sid], plain[sid])
        assert_logprobs_of_one_prefill(model, store, sid, tokens[sid], logprobs[sid])
    stats = speculator.stats
    assert 0 < stats.accepted < stats.drafted and stats.emitted == 3 * NEW


@pytest.mark.slow    # compiles of verify / replay widths and of the reference prefills
@pytest.mark.parametrize("rollback", ["states", "replay"])
def test_sampled_rounds_are_reproducible_and_exact_in_memory(model, rollback):
    sampling = Sampling(temperature=1.0, top_p=0.9, seed=7)

    def sample():
        store = SessionStore(model)
        sids = [store.open(prompt) for prompt in PROMPTS[:2]]
        speculator = Speculator(store, DraftModel(tiny_model(seed=3)), SpeculationConfig(k=3, rollback=rollback))
        tokens, logprobs = run_rounds(speculator, sids, sampling, new=8)
        for sid in sids:
            assert_session_is_one_prefill(model, store, sid)
            assert_logprobs_of_one_prefill(model, store, sid, tokens[sid], logprobs[sid])
        return tokens, speculator.stats

    first, stats = sample()
    again, _ = sample()
    assert first == again and stats.drafted > 0


@pytest.mark.slow    # compiles of verify / replay widths and of the reference prefills
def test_store_generate_and_generate_speculate_as_greedy_decoding_does(model):
    store = SessionStore(model)
    sids = [store.open(prompt) for prompt in PROMPTS[:2]]
    plain = store.generate([store.fork(sid) for sid in sids], NEW, eos_id=9)
    speculator = Speculator(store, DraftModel(model), SpeculationConfig(k=4))              # the target as its own draft
    spoken = store.generate(sids, NEW, eos_id=9, speculator=speculator)
    for expected, got in zip(plain, spoken):
        np.testing.assert_array_equal(got, expected)
    assert speculator.stats.accepted == speculator.stats.drafted > 0
    assert speculator.drafter.store.sessions() == []                    # draft sessions closed as they finished
    expected = generate(model, list(PROMPTS), max_new_tokens=NEW, eos_id=9)
    got = generate(model, list(PROMPTS), max_new_tokens=NEW, eos_id=9, speculation=SpeculationConfig(prompt_lookup=2))
    np.testing.assert_array_equal(got.lengths, expected.lengths)
    np.testing.assert_array_equal(got.tokens, expected.tokens)


@pytest.mark.slow    # compiles of verify / replay widths and of the reference prefills
def test_prompt_lookup_drafts_from_the_history_and_a_stop_id_ends_the_round(model):
    store = SessionStore(model)
    sid = store.open(np.tile(PROMPTS[2], 2))                            # most tokens recur: drafts
    continuation = store.generate([store.fork(sid)], NEW)[0]
    stop = int(continuation[5])
    speculator = Speculator(store, PromptLookup(max_ngram=3), SpeculationConfig(k=4))
    emitted = []
    while not emitted or emitted[-1] != stop and len(emitted) < NEW:
        emitted += speculator.round({sid: Sampling()}, limits={sid: NEW - len(emitted)}, stop_ids=[stop])[sid].tokens
    np.testing.assert_array_equal(emitted, continuation[: list(continuation).index(stop) + 1])
    assert_session_is_one_prefill(model, store, sid)
    assert speculator.stats.drafted > 0


def test_bad_speculation_requests_are_one_line_errors(model):
    store = SessionStore(model)
    sid = store.open(PROMPTS[0])
    with pytest.raises(ValueError, match="at least one token"):
        Speculator(store, PromptLookup()).round({sid: Sampling()}, limits={sid: 0})
    with pytest.raises(ValueError, match="vocabulary"):
        Speculator.of(store, SpeculationConfig(draft="small"), K3Model(tiny_config("model.vocab_size=32"), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="another session store"):
        store.generate([sid], 2, speculator=Speculator(SessionStore(model), PromptLookup()))



def test_a_round_the_budget_cannot_hold_leaves_every_session_as_it_was(model):
    probe = SessionStore(model, prefix_cache=False)
    probe.open(PROMPTS[0])
    page_bytes, slot_bytes = probe.page_bytes, probe.slot_bytes
    store = SessionStore(model, prefix_cache=False, device_bytes=2 * slot_bytes + 3 * page_bytes)
    sids = [store.open(random_tokens(20 + i, 16)) for i in range(2)]         # one full page each; one page free
    before = {sid: (store.tokens(sid).copy(), list(store._sessions[sid].pages)) for sid in sids}
    speculator = Speculator(store, PromptLookup(), SpeculationConfig(k=2))
    with pytest.raises(ValueError, match="cannot hold a speculative round of 2"):
        speculator.round({sid: Sampling() for sid in sids})
    for sid in sids:
        np.testing.assert_array_equal(store.tokens(sid), before[sid][0])
        assert store._sessions[sid].pages == before[sid][1]
    assert store.stats()["pages_in_use"] == 2
    assert len(speculator.round({sids[0]: Sampling()})[sids[0]].tokens) >= 1     # one session fits


class ResidueGrammar:
    """A grammar for the tests (the `k3jax.grammar.Constraint` protocol): token t may follow token
    s only when (s + t) % 3 != 0 (the first token: t % 3 != 0); it keeps what it took, so it can
    take tokens back."""

    def __init__(self, vocab: int):
        self.vocab, self.taken = vocab, []

    def allows(self, token: int) -> bool:
        return (token + (self.taken[-1] if self.taken else 0)) % 3 != 0

    def allowed(self, words: int):
        from k3jax.sampling import pack_bits
        flags = np.zeros(32 * words, bool)
        flags[: self.vocab] = [self.allows(t) for t in range(self.vocab)]
        return pack_bits(flags)

    def advance(self, tokens) -> int:
        for count, token in enumerate(tokens):
            if not self.allows(int(token)):
                return count
            self.taken.append(int(token))
        return len(tokens)

    def rollback(self, count: int) -> None:
        del self.taken[len(self.taken) - count:]


@pytest.mark.slow    # compiles of the adjusted decode step, verify widths and the reference prefill
def test_constrained_and_penalised_greedy_steps_and_rounds_follow_the_host_rule(model):
    """Plain steps with a grammar and penalties pick, at every position, the argmax of the host's
    float64 adjusted logits (`row_adjustment`, `adjusted_logits`) of a one-prefill reference, and
    every token keeps the grammar; speculative rounds whose drafts are the unconstrained greedy
    continuation (so the grammar forbids many) emit the same tokens."""
    from k3jax.sampling import adjusted_logits
    from k3jax.sessions.batching import row_adjustment

    def rule(grammar):
        return Sampling(constraint=grammar, repetition_penalty=1.5, presence_penalty=0.7, logit_bias=((3, 2.0),),
                        generated_from=len(PROMPTS[0]))

    store = SessionStore(model)
    sid = store.open(PROMPTS[0])
    free = store.generate([store.fork(sid)], NEW)[0]
    plain_sid, grammar = store.fork(sid), ResidueGrammar(model.config.vocab_size)
    for _ in range(NEW):
        store.step({plain_sid: rule(grammar)})
    plain = store.tokens(plain_sid)[len(PROMPTS[0]):]
    assert grammar.taken == list(plain) and not np.array_equal(plain, free)
    reference, check = contiguous_logits(model, store.tokens(plain_sid)), ResidueGrammar(model.config.vocab_size)
    for index, token in enumerate(plain):
        position = len(PROMPTS[0]) + index
        adjusted = adjusted_logits(reference[position - 1].astype(np.float64),
                                   row_adjustment(rule(check), store.tokens(plain_sid)[:position], reference.shape[-1]))
        assert token == int(np.argmax(adjusted))
        check.advance([token])

    drafter = ScriptedDrafts({sid: PROMPTS[0]}, {sid: free}, {sid: set()})
    speculator = Speculator(store, drafter, SpeculationConfig(k=3, adaptive=False))
    grammar, emitted = ResidueGrammar(model.config.vocab_size), []
    while len(emitted) < NEW:
        emitted += speculator.round({sid: rule(grammar)}, limits={sid: NEW - len(emitted)})[sid].tokens
    np.testing.assert_array_equal(emitted, plain)
    assert grammar.taken == emitted and speculator.stats.accepted < speculator.stats.drafted
