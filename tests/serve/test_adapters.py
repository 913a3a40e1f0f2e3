"""Several LoRA adapters served over one base (`k3jax.inference.adapters`, ``eval.serve --lora``),
against the merged weights of each fine-tune, W + (alpha / r) A B, as ``convert export`` writes
them: greedy tokens equal and log-probs within 1e-5 of the merged model's full forward, with
requests of two adapters and of the base decoded in one batch; loading and unloading at run time;
every adapter that cannot be served here refused in one line.

The base is the micro chat run; the LoRA runs on it hold random factors (`write_lora_run`): "wide"
(rank 4, alpha 8, the default targets, MLA's kv_b_proj among them) and "attn" (rank 2, alpha 4,
the mixers' projections only); the refusals make their own.
"""
from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from flax import nnx

from eval.serve.cli import build, parse_args
from k3jax.config import config_from_dict, load_config, to_dict
from k3jax.convert.peft import write_lora_run
from k3jax.inference import InputError, load_run
from k3jax.inference.adapters import ServedAdapters
from k3jax.inference.generation import generate
from k3jax.layers.lora import ADAPTER_SUFFIX, Adapter, AdapterBank, merged_weight, set_adapter_rows
from k3jax.sessions import Sampling, SessionStore
from k3jax.training.finetune import abstract_lora_model
from tests.serve.conftest import CHAT, save_untrained
from tests.serve.test_api import full_forward_logprobs, post

PROMPT = list(range(3, 40))


def lora_run(root, base, name: str, seed: int, **finetune):
    """A LoRA run on ``base`` whose checkpoint holds random factors (B nonzero)."""
    config = load_config(base / "config.yaml")
    run = config_from_dict({**to_dict(config), "init_from": str(base), "run_dir": str(root / name),
                            "finetune": finetune})
    lora = abstract_lora_model(run.model, run.finetune, run.train.seed)
    rng = np.random.default_rng(seed)
    write_lora_run(root / name, run, lora, {key: rng.normal(0, 0.3, value.shape).astype(np.float32)
                                            for key, value in lora.adapters.items()})
    return root / name


def merged(path) -> nnx.Module:
    """The LoRA run's model with every adapter merged into its weight, W + s A B (fp32)."""
    model = load_run(str(path)).model
    for _, module in list(nnx.iter_modules(model)):
        for attribute, adapter in list(vars(module).items()):
            if isinstance(adapter, Adapter):
                weight = getattr(module, attribute[: -len(ADAPTER_SUFFIX)])
                merge = lambda w, a, b: merged_weight(w, a, b, adapter.scale)  # noqa: E731
                if adapter.a.get_metadata()["logical_axes"][0] == "layers":
                    merge = jax.vmap(merge)
                weight.set_value(merge(weight[...], adapter.a[...], adapter.b[...]).astype(weight.dtype))
                delattr(module, attribute)
    return model


@pytest.fixture(scope="module")
def runs(plain_chat_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"base": plain_chat_run,
            "wide": lora_run(root, plain_chat_run, "wide", 1, lora_rank=4, lora_alpha=8.0),
            "attn": lora_run(root, plain_chat_run, "attn", 2, lora_rank=2, lora_alpha=4.0, lora_targets=["mixer/*_proj"])}


@pytest.fixture(scope="module")
def references(runs):
    """{model name: merged model}; the base under its run's name."""
    return {"wide": merged(runs["wide"]), "attn": merged(runs["attn"]), runs["base"].name: load_run(str(runs["base"])).model}


def test_one_decode_batch_of_two_adapters_and_the_base_equals_each_merged_model(runs, references, tmp_path):
    run = load_run(str(runs["base"]))
    served = ServedAdapters.attach(run, {"wide": str(runs["wide"]), "attn": str(runs["attn"])})
    banks = [m for _, m in nnx.iter_modules(run.model) if isinstance(m, AdapterBank)]
    assert banks and any(path[-1] == "kv_b_proj" + ADAPTER_SUFFIX for path, m in nnx.iter_modules(run.model)
                         if isinstance(m, AdapterBank))
    store = SessionStore(run.model)
    store.serve_adapters(served.tags())
    names = ["wide", runs["base"].name, "attn"]
    sids = [store.open(PROMPT, adapter=served.tag(n) if n in served.adapters else "") for n in names]
    tokens = {sid: [] for sid in sids}
    logits = {sid: [store.logits(sid).copy()] for sid in sids}
    for _ in range(5):                                   # one batched step of all three each time
        for sid, token in store.step({sid: Sampling() for sid in sids}).items():
            tokens[sid].append(token)
            logits[sid].append(store.logits(sid).copy())
    for name, sid in zip(names, sids):
        expected = np.asarray(generate(references[name], PROMPT, max_new_tokens=5).tokens).tolist()
        assert tokens[sid] == expected, name
        full = np.asarray(references[name](np.asarray(PROMPT + expected, np.int32)[None]).logits[0])
        np.testing.assert_allclose(np.stack(logits[sid]), full[len(PROMPT) - 1:], rtol=0, atol=2e-5)

    # Saved and loaded, each session keeps its adapter; fed only once its adapter is served again.
    store.save(tmp_path / "saved")
    loaded = SessionStore.load(run.model, tmp_path / "saved")
    assert [loaded.adapter(sid) for sid in sids] == [served.tag("wide"), "", served.tag("attn")]
    with pytest.raises(ValueError, match="adapter 'wide' is not loaded"):
        loaded.append(sids[0], [7])
    loaded.serve_adapters(served.tags())
    for sid in sids:
        np.testing.assert_array_equal(loaded.append(sid, [7]), store.append(sid, [7]))

    # The training-shaped forward (no memory: MLA expanded) takes the rows too.
    rows = np.asarray([served.adapters["attn"].slot, 0], np.int32)
    set_adapter_rows(run.model, np.broadcast_to(rows[:, None], (2, len(PROMPT))))
    both = np.asarray(run.model(np.asarray([PROMPT, PROMPT], np.int32)).logits)
    np.testing.assert_allclose(both[0], np.asarray(references["attn"](np.asarray([PROMPT], np.int32)).logits[0]),
                               atol=2e-5, rtol=0)
    np.testing.assert_allclose(both[1], np.asarray(references[runs["base"].name](
        np.asarray([PROMPT], np.int32)).logits[0]), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_adapters_that_cannot_be_served_here_are_refused_in_one_line(runs, tmp_path):
    run = load_run(str(runs["base"]))
    experts = lora_run(tmp_path, runs["base"], "experts", 3, lora_rank=2, lora_routed_experts=True)
    with pytest.raises(InputError, match="routed experts"):
        ServedAdapters.attach(run, {"x": str(experts)})
    reseeded = save_untrained(tmp_path / "reseeded", CHAT + ["data.chat_thinking=false", "train.seed=5"])
    other = lora_run(tmp_path, reseeded, "other", 4, lora_rank=2)      # a LoRA run of another base
    with pytest.raises(InputError, match="whose weights are not the served base's"):
        ServedAdapters.attach(run, {"x": str(other)})
    with pytest.raises(InputError, match="is not a LoRA run"):
        ServedAdapters.attach(run, {"x": str(runs["base"])})
    with pytest.raises(InputError, match="is a LoRA run: serve its base"):
        ServedAdapters.attach(load_run(str(runs["wide"])), {"x": str(runs["attn"])})
    with pytest.raises(InputError, match="no such directory"):
        ServedAdapters.attach(run, {"x": str(tmp_path / "missing")})
    assert not any(isinstance(m, AdapterBank) for _, m in nnx.iter_modules(run.model))   # refusals left it as it was
    served = ServedAdapters.attach(run, {"attn": str(runs["attn"])})
    with pytest.raises(InputError, match="its rank 4 is above the banks' 2"):
        served.load("wide", str(runs["wide"]))
    with pytest.raises(InputError, match="no free adapter slot"):
        served.load("again", str(runs["attn"]))
    with pytest.raises(InputError, match="already loaded"):
        served.load("attn", str(runs["attn"]))
    narrow = ServedAdapters.attach(load_run(str(runs["base"])), {"attn": str(runs["attn"])}, capacity=2, rank=4)
    with pytest.raises(InputError, match="which no adapter given at start adapts"):
        narrow.load("wide", str(runs["wide"]))          # banks over the mixers only; wide adapts the FFNs too
    biased = lora_run(tmp_path, runs["base"], "biased", 5, lora_rank=2, update_router_bias=True)
    with pytest.raises(InputError, match="update_router_bias"):
        narrow.load("biased", str(biased))
    empty = ServedAdapters.attach(load_run(str(runs["base"])), {}, capacity=1, rank=4)   # room, no adapter yet
    assert empty.load("wide", str(runs["wide"])).slot == 1 and not empty.tags().keys() - {empty.tag("wide")}


@pytest.fixture(scope="module")
def lora_server(runs):
    from fastapi.testclient import TestClient

    args = parse_args([str(runs["base"]), "--lora", f"wide={runs['wide']}", "--lora", f"attn={runs['attn']}",
                       "--max-loras", "3", "--runtime-lora-updates", "--max-model-len", "256", "--max-batch", "8"])
    app, _, served = build(args)
    with TestClient(app) as client:
        yield client, served, app.state.server


@pytest.mark.slow
def test_requests_of_two_adapters_and_the_base_batched_equal_the_merged_models(lora_server, references, runs):
    client, served, server = lora_server
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [served.name, "wide", "attn"]
    names = ["wide", "attn", served.name]
    answers, gate = {}, threading.Event()
    steps, tokens = server.engine.counters["decode_steps"], server.engine.counters["generation_tokens"]
    server.engine.call(lambda store: gate.wait(60))          # hold the engine: all three are admitted together

    def ask(name):
        answers[name] = post(client, "/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 5,
                                                         "temperature": 0, "logprobs": 1, "ignore_eos": True})
    threads = [threading.Thread(target=ask, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    while server.engine.queue_depth < 3:
        threading.Event().wait(0.01)
    gate.set()
    for thread in threads:
        thread.join(120)
    # 15 tokens in 5 steps: the three requests decoded in one batch at every step.
    assert (server.engine.counters["decode_steps"] - steps, server.engine.counters["generation_tokens"] - tokens) == (5, 15)
    for name in names:
        choice = answers[name]["choices"][0]
        assert answers[name]["model"] == name
        expected = np.asarray(generate(references[name], PROMPT, max_new_tokens=5).tokens).tolist()
        assert choice["text"] == served.decode(expected), name
        reference = full_forward_logprobs(references[name], PROMPT + expected)[len(PROMPT) - 1:]
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], reference, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_adapters_load_and_unload_at_run_time_and_bad_requests_are_4xx(lora_server, runs, references):
    client, served, _ = lora_server
    assert post(client, "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 1}, 404)["error"]["param"] == "model"
    post(client, "/v1/unload_lora_adapter", {"lora_name": "nope"}, 404)
    post(client, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(runs["base"])}, 400)   # not a LoRA run
    post(client, "/v1/load_lora_adapter", {"lora_name": "x"}, 400)
    post(client, "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": str(runs["wide"])}, 400)
    loaded = post(client, "/v1/load_lora_adapter", {"lora_name": "third", "lora_path": str(runs["attn"])})
    assert loaded["id"] == "third" and loaded["rank"] == 2
    body = post(client, "/v1/completions", {"model": "third", "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                            "logprobs": 1, "ignore_eos": True})
    expected = np.asarray(generate(references["attn"], PROMPT, max_new_tokens=3).tokens).tolist()
    np.testing.assert_allclose(body["choices"][0]["logprobs"]["token_logprobs"],
                               full_forward_logprobs(references["attn"], PROMPT + expected)[len(PROMPT) - 1:],
                               atol=1e-5, rtol=0)
    first = post(client, "/v1/responses", {"model": "wide", "input": "hi", "max_output_tokens": 2})
    post(client, "/v1/responses", {"model": "attn", "input": "again", "max_output_tokens": 2,
                                   "previous_response_id": first["id"]}, 400)
    assert post(client, "/v1/unload_lora_adapter", {"lora_name": "third"})["deleted"] is True
    post(client, "/v1/completions", {"model": "third", "prompt": "x", "max_tokens": 1}, 404)
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [served.name, "wide", "attn"]


def test_runtime_loading_is_off_unless_asked(serving):
    client = serving[0]
    assert post(client, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}, 403)["error"]["type"] \
        == "permission_error"


@pytest.mark.slow
def test_an_adapter_of_an_mxfp4_base_is_served_beside_its_packed_experts(tmp_path):
    """A QLoRA-style run (attention and shared-expert adapters over MXFP4 routed experts): the base's
    fingerprint is taken from the checksums of its packed codes (saved in ``buffers``), and the
    served adapter equals its merged weights."""
    mxfp4 = ["model.moe.expert_format=mxfp4", "model.moe.expert_matmul=ragged_dot", "model.moe.expert_width=32",
             "model.moe.latent_dim=32", "model.moe.expert_tile=3"]
    base = save_untrained(tmp_path / "base", CHAT + ["data.chat_thinking=false", *mxfp4])
    lora = lora_run(tmp_path, base, "qlora", 1, lora_rank=4, lora_alpha=8.0)
    run = load_run(str(base))
    served = ServedAdapters.attach(run, {"qlora": str(lora)})
    store = SessionStore(run.model)
    store.serve_adapters(served.tags())
    sid = store.open(PROMPT, adapter=served.tag("qlora"))
    expected = np.asarray(merged(lora)(np.asarray([PROMPT], np.int32)).logits[0, -1])
    np.testing.assert_allclose(store.logits(sid), expected, atol=2e-5, rtol=0)
