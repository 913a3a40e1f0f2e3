"""`SessionStore.step` (one token for each session, each with its own sampling), `SessionStore.feed`
(teacher forcing with the same program) and `SessionStore.cache_prefix`: what a server's continuous
batching and an RL rollout's replay are built on."""
import jax
import numpy as np
import pytest

from k3jax.sampling import sample_logits
from k3jax.sessions import Sampling, SessionStore
from tests.sessions.conftest import contiguous_logits, random_tokens

TOL = dict(rtol=1e-5, atol=1e-5)


def expected_token(logits, sampling: Sampling, stream: int, position: int) -> int:
    """The token `Sampling`'s documented key draws from ``logits`` at ``position``."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(sampling.seed % 2**32), stream), position)
    return int(sample_logits(np.asarray(logits)[None], key, sampling.temperature, sampling.top_k or 0,
                             1.0 if sampling.top_p is None else sampling.top_p)[0])


def test_each_session_samples_with_its_own_rule_and_feeds_the_token(model):
    store = SessionStore(model)
    sids = [store.open(random_tokens(seed, length)) for seed, length in enumerate((5, 18, 9))]
    rules = {sids[0]: Sampling(), sids[1]: Sampling(0.9, 8, 0.8, seed=7, stream=3), sids[2]: Sampling(1.5, seed=2)}
    for _ in range(3):
        before = {sid: (store.logits(sid), len(store.tokens(sid))) for sid in sids}
        tokens = store.step(rules)
        assert list(tokens) == sids
        for sid, rule in rules.items():
            logits, position = before[sid]
            stream = sid if rule.stream is None else rule.stream
            assert tokens[sid] == expected_token(logits, rule, stream, position), sid
            assert store.tokens(sid)[-1] == tokens[sid]
            np.testing.assert_allclose(store.logits(sid), contiguous_logits(model, store.tokens(sid))[-1], **TOL)


def test_a_session_steps_the_same_alone_or_in_a_batch(model):
    rule = Sampling(1.0, seed=11, stream=0)
    alone_store, batch_store = SessionStore(model), SessionStore(model)
    alone = alone_store.open(random_tokens(3, 7))
    together = [batch_store.open(random_tokens(seed, 4 + seed)) for seed in (5, 3, 6)]   # the same prompt second
    for _ in range(4):
        alone_store.step({alone: rule})
        batch_store.step({sid: rule if i == 1 else Sampling(0.5, seed=i) for i, sid in enumerate(together)})
    np.testing.assert_array_equal(alone_store.tokens(alone), batch_store.tokens(together[1]))


def test_sessions_the_budget_cannot_hold_wait_for_a_later_step(model):
    probe = SessionStore(model)
    probe.open(random_tokens(0, 4))
    store = SessionStore(model, device_bytes=probe.slot_bytes + 2 * probe.page_bytes)   # one session's room
    first, second = store.open(random_tokens(1, 4)), store.open(random_tokens(2, 4))
    stepped = store.step({second: Sampling(), first: Sampling()})
    assert list(stepped) == [second]                        # the earlier one in the dict
    assert len(store.tokens(first)) == 4 and len(store.tokens(second)) == 5


def test_step_checks_its_input(model):
    store = SessionStore(model)
    sid = store.open(random_tokens(0, 4))
    assert store.step({}) == {}
    with pytest.raises(ValueError, match="unknown or closed session"):
        store.step({sid + 1: Sampling()})
    with pytest.raises(ValueError, match="must be a k3jax.sessions.Sampling"):
        store.step({sid: 0.5})
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0.0)
    with pytest.raises(ValueError, match="stream"):
        Sampling(stream=-1)
    assert len(store.tokens(sid)) == 4


def test_feeding_the_sampled_tokens_gives_the_sampled_sessions_logits_bit_for_bit(model):
    rules = [Sampling(1.0, seed=4), Sampling(0.7, 5, seed=9), Sampling()]
    sampled, fed = SessionStore(model), SessionStore(model)
    prompts = [random_tokens(seed, length) for seed, length in enumerate((6, 11, 3))]
    sampled_ids, fed_ids = [sampled.open(p) for p in prompts], [fed.open(p) for p in prompts]
    for _ in range(4):
        tokens = sampled.step(dict(zip(sampled_ids, rules)))
        assert fed.feed({f: tokens[s] for s, f in zip(sampled_ids, fed_ids)}) == {f: tokens[s] for s, f in zip(sampled_ids, fed_ids)}
        for s, f in zip(sampled_ids, fed_ids):
            np.testing.assert_array_equal(fed.tokens(f), sampled.tokens(s))
            np.testing.assert_array_equal(fed.logits(f), sampled.logits(s))
    greedy = sampled.step({sampled_ids[2]: Sampling()})[sampled_ids[2]]
    other = (greedy + 1) % model.config.vocab_size                        # not the argmax: fed all the same
    fed.feed({fed_ids[2]: other})
    assert fed.tokens(fed_ids[2])[-1] == other
    np.testing.assert_allclose(fed.logits(fed_ids[2]), contiguous_logits(model, fed.tokens(fed_ids[2]))[-1], **TOL)
    assert fed.feed({}) == {}
    with pytest.raises(ValueError, match="token ids must lie"):
        fed.feed({fed_ids[0]: model.config.vocab_size})


def test_cache_prefix_lets_a_prompt_that_extends_the_session_resume_there(model):
    store = SessionStore(model)
    sid = store.open(random_tokens(0, 5))
    store.step({sid: Sampling()})
    store.cache_prefix(sid)
    history = store.tokens(sid)
    prefilled = store.stats()["prefill_tokens"]
    longer = store.open(np.concatenate([history, random_tokens(1, 2)]))
    assert store.stats()["prefill_tokens"] == prefilled + 2        # only the two new tokens
    np.testing.assert_allclose(store.logits(longer), contiguous_logits(model, store.tokens(longer))[-1], **TOL)
