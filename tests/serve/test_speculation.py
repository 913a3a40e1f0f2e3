"""Speculative decoding in the server (``--draft RUN_DIR`` / ``--prompt-lookup N``): greedy
completions and chat replies, plain and streamed, equal the plain server's token for token; a
draft model that is the served model itself accepts every draft; ``/metrics`` counts the rounds; a
stop string inside a round leaves the session holding what plain decoding fed; concurrent requests
of different lengths (one with top log-probs, which takes plain steps) equal their solo results;
bad speculation flags are one line and exit status 2.

Every server here serves `chat_run` with the flags of the shared `serving` fixture (the plain
reference), and drafts at most ``K`` = 2 tokens a round, so the programs compiled stay few."""
import queue
import threading

import numpy as np
import pytest

from eval.serve.completions import CompletionPlan
from tests.serve.conftest import KEY
from tests.serve.test_api import USER, post, stream_events
from tests.serve.test_engine import wait_for

K = 2
PROMPT = "hello there"
REPEATING = [278, 468] * 4        # token ids the untrained model keeps repeating: prompt lookup's drafts hold


def speculative_server(chat_run, *flags):
    """(client, server) of a server over `chat_run` with ``flags``, as the `serving` fixture's."""
    from fastapi.testclient import TestClient

    from eval.serve.cli import build, parse_args

    app, _, _ = build(parse_args([str(chat_run), "--api-key", KEY, "--max-model-len", "256", "--max-batch", "8",
                                  "--speculate-k", str(K), *flags]))
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client, app.state.server


@pytest.fixture(scope="module")
def drafted(chat_run):
    """A server drafting with its own model (`chat_run` again): every greedy draft is accepted."""
    yield from speculative_server(chat_run, "--draft", str(chat_run))


@pytest.fixture(scope="module")
def looked_up(chat_run):
    yield from speculative_server(chat_run, "--prompt-lookup", "3")


def stats(server) -> dict:
    return server.engine.call(lambda store: server.engine.speculation()).result()


def same_completion(plain, speculative, body):
    """The completion of ``body`` (greedy) from both servers, plain and streamed: the same tokens,
    text and log-probs."""
    body = {**body, "temperature": 0, "logprobs": 0}
    expected, got = post(plain, "/v1/completions", body), post(speculative, "/v1/completions", body)
    (want,), (have,) = expected["choices"], got["choices"]
    assert have["logprobs"]["tokens"] == want["logprobs"]["tokens"] and have["text"] == want["text"]
    np.testing.assert_allclose(have["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"], atol=1e-4)
    assert (have["finish_reason"], got["usage"]) == (want["finish_reason"], expected["usage"])
    streamed = stream_events(speculative, "/v1/completions", body)
    assert "".join(chunk["choices"][0]["text"] for chunk in streamed) == want["text"]
    assert [piece for chunk in streamed if chunk["choices"][0]["logprobs"]
            for piece in chunk["choices"][0]["logprobs"]["tokens"]] == want["logprobs"]["tokens"]


def same_chat(plain, speculative, body):
    """The chat reply of ``body`` (greedy) from both servers, plain and streamed."""
    body = {**body, "temperature": 0, "logprobs": True}
    expected, got = post(plain, "/v1/chat/completions", body), post(speculative, "/v1/chat/completions", body)
    (want,), (have,) = expected["choices"], got["choices"]
    assert have["message"] == want["message"] and have["finish_reason"] == want["finish_reason"]
    assert [e["token"] for e in have["logprobs"]["content"]] == [e["token"] for e in want["logprobs"]["content"]]
    streamed = [chunk["choices"][0] for chunk in stream_events(speculative, "/v1/chat/completions", body)]
    for field in ("content", "reasoning_content"):
        assert "".join(choice["delta"].get(field) or "" for choice in streamed) == (want["message"][field] or "")
    assert [e["token"] for choice in streamed if choice["logprobs"] for e in choice["logprobs"]["content"]] == \
        [e["token"] for e in want["logprobs"]["content"]]


@pytest.mark.slow   # the draft-model server's programs: ~60 s of compiles on 2 cores
def test_a_draft_model_of_the_served_model_accepts_every_draft_and_changes_nothing(serving, drafted):
    plain, (client, server) = serving[0], drafted
    same_completion(plain, client, {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True})
    same_chat(plain, client, {"messages": USER, "max_tokens": 12})
    counted = stats(server)
    assert counted["drafted"] > 0 and counted["accepted"] == counted["drafted"]
    assert counted["acceptance_rate"] == 1.0 and counted["emitted"] > counted["rounds"]


def test_prompt_lookup_on_a_repeating_prompt_changes_nothing(serving, looked_up):
    plain, (client, server) = serving[0], looked_up
    same_completion(plain, client, {"prompt": REPEATING, "max_tokens": 12, "ignore_eos": True})
    same_chat(plain, client, {"messages": USER, "max_tokens": 12})
    counted = stats(server)
    assert counted["accepted"] > 0 and counted["emitted"] > counted["rounds"]


@pytest.mark.slow   # the draft-model server's programs: ~60 s of compiles on 2 cores
def test_metrics_show_the_speculation_counters(serving, drafted):
    client, server = drafted
    post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    metrics = dict(line.split(" ") for line in client.get("/metrics").text.splitlines() if not line.startswith("#"))
    counted = stats(server)
    for name, key in (("rounds_total", "rounds"), ("drafted_tokens_total", "drafted"),
                      ("accepted_tokens_total", "accepted"), ("acceptance_rate", "acceptance_rate"),
                      ("mean_accepted_length", "mean_accepted_length")):
        assert float(metrics[f"k3jax_speculation_{name}"]) == counted[key] and counted[key] > 0, name
    assert float(metrics["k3jax_speculation_draft_seconds_total"]) > 0
    assert float(metrics["k3jax_speculation_verify_seconds_total"]) > 0
    assert "k3jax_speculation" not in serving[0].get("/metrics").text          # plain servers leave them out


def completion_on_engine(server, body) -> tuple[dict, list[list[int]]]:
    """(response body, each choice's session tokens when its job finished) of a completions
    request run on ``server``'s engine."""
    plan = CompletionPlan(server.served, body)
    events: queue.Queue = queue.Queue()
    job = plan.job(events.put, None)
    finish, held = job.finish, []

    def recording_finish(store, sequences):
        held.extend(store.tokens(sequence.sid).tolist() for sequence in sequences)
        return finish(store, sequences)
    job.finish = recording_finish
    server.engine.submit(job)
    event = wait_for(events, "result")
    assert event[0] == "result", event
    return event[1], held


@pytest.mark.slow   # the draft-model server's programs: ~60 s of compiles on 2 cores
def test_a_stop_string_inside_a_round_leaves_the_session_as_plain_decoding_does(serving, drafted):
    """With every draft accepted, rounds emit tokens 0-2, 3-5, ...: a stop string ending on a
    token that is not a round's last cuts the round, and the session must not keep the rest."""
    plain, speculative = serving[2], drafted[1]
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    _, (held,) = completion_on_engine(plain, body)
    prompt = plain.served.encode(PROMPT)
    generated = held[len(prompt):]
    def text(count: int) -> str:      # what the server has read after ``count`` tokens (an incomplete
        decoder = plain.served.text_decoder()   # character shows only once its bytes end it)
        return "".join(decoder.feed(token) for token in generated[:count])
    cut = next(index for index in range(len(generated)) if index % (K + 1) != K and text(index + 1) != text(index)
               and text(index + 1)[len(text(index)):] not in text(index))
    stop = text(cut + 1)[len(text(cut)):]
    expected, expected_held = completion_on_engine(plain, {**body, "stop": [stop]})
    got, got_held = completion_on_engine(speculative, {**body, "stop": [stop]})
    assert expected["choices"][0]["finish_reason"] == "stop" and expected["choices"][0]["text"] == text(cut)
    assert got["choices"] == expected["choices"] and got["usage"] == expected["usage"]
    assert got_held == expected_held == [prompt + generated[: cut + 1]]


@pytest.mark.slow   # the draft-model server's programs: ~60 s of compiles on 2 cores
def test_concurrent_requests_of_different_lengths_one_with_top_logprobs(serving, drafted):
    plain, (client, server) = serving[0], drafted
    requests = [("/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True}),
                ("/v1/completions", {"prompt": REPEATING, "max_tokens": 10, "ignore_eos": True}),
                ("/v1/completions", {"prompt": PROMPT, "max_tokens": 7, "ignore_eos": True, "logprobs": 2}),
                ("/v1/chat/completions", {"messages": USER, "max_tokens": 9, "logprobs": True, "top_logprobs": 2})]
    requests = [(path, {**body, "temperature": 0}) for path, body in requests]
    solo = [post(plain, path, body)["choices"] for path, body in requests]
    results = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def send(index):
        barrier.wait()
        results[index] = post(client, *requests[index])["choices"]
    threads = [threading.Thread(target=send, args=(index,)) for index in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for (path, _), got, want in zip(requests, results, solo):
        field = "text" if path == "/v1/completions" else "message"
        assert [c[field] for c in got] == [c[field] for c in want]
    for got, want in zip(results[2][0]["logprobs"]["top_logprobs"], solo[2][0]["logprobs"]["top_logprobs"]):
        assert got == pytest.approx(want, abs=1e-5)
    assert server.engine.call(lambda store: store.sessions()).result() == []
    assert server.engine.speculator.drafter.store.sessions() == []             # every draft session left


def test_bad_speculation_flags_are_one_line_errors():
    from k3jax.config import SpeculationConfig
    from k3jax.inference import InputError
    from eval.serve.cli import parse_args

    for flags, words in ((["--prompt-lookup", "3", "--draft", "draft-run"], "--draft: drafts come from prompt_lookup or"),
                         (["--prompt-lookup", "0"], "--prompt-lookup: must be positive"),
                         (["--draft", "draft-run", "--speculate-k", "0"], "--speculate-k: must be positive"),
                         (["--speculate-k", "3"], "--speculate-k needs --prompt-lookup or --draft"),
                         (["--speculate-rollback", "replay"], "--speculate-rollback needs --prompt-lookup or --draft"),
                         (["--prompt-lookup", "2", "--speculate-rollback", "undo"], "invalid choice: 'undo'")):
        with pytest.raises(InputError, match=words) as error:
            parse_args(["run", *flags])
        assert "\n" not in str(error.value)
    assert parse_args(["run", "--prompt-lookup", "2"]).speculation == SpeculationConfig(prompt_lookup=2, k=4, rollback="states")
    assert parse_args(["run", "--draft", "d", "--speculate-rollback", "replay"]).speculation.rollback == "replay"
    assert parse_args(["run"]).speculation is None


def test_a_draft_must_load_and_read_the_same_token_ids(chat_run, tmp_path, monkeypatch, capsys):
    """A missing or checkpoint-less draft directory ends ``main`` with one line and status 2; a
    draft whose config gives another vocabulary size or tokenizer is refused (the run as loaded,
    its config changed: only the config is read)."""
    import dataclasses

    import k3jax.inference.load
    from k3jax.inference import InputError, load_run
    from eval.serve import cli

    for draft, words in ((tmp_path / "missing", "no such directory"), (tmp_path, "--draft")):
        assert cli.main([str(chat_run), "--draft", str(draft)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --draft") and words in lines[0], lines
    run = load_run(str(chat_run))
    for section, fields, words in (("model", {"vocab_size": 640}, "its vocabulary has 640 tokens, the target's 512"),
                                   ("data", {"kind": "mqar", "tokenizer": None}, "it was trained with tokenizer bytes")):
        config = dataclasses.replace(run.config, **{section: dataclasses.replace(getattr(run.config, section), **fields)})
        monkeypatch.setattr(k3jax.inference.load, "load_run", lambda path, step=None, mesh=None, dtype=None: run._replace(config=config))
        with pytest.raises(InputError, match=words):
            cli.load_draft_model(cli.parse_args([str(chat_run), "--draft", "other-run"]), run.config)
