"""Micro chat checkpoints (K3's chat format with and without thinking, the byte-level stand-in
tokenizer) saved at initialisation, and the server over it in this process (`fastapi.testclient.TestClient`)."""
from __future__ import annotations

import pathlib

import pytest

from k3jax.config import load_config
from k3jax.training import Trainer
from tests.helpers import CONFIGS, MICRO

CHAT = ["data.kind=chat", f"data.path={CONFIGS / 'chat' / 'conversations.jsonl'}",
        f"data.tokenizer={CONFIGS / 'chat' / 'tokenizer'}", "data.seq_len=128", "data.chat_thinking=true",
        "data.chat_thinking_effort=null", "train.steps=1", "checkpoint.async_save=false", "logging.progress=false",
        "model.vocab_size=512"]


def save_untrained(run_dir: pathlib.Path, overrides: list[str]) -> pathlib.Path:
    trainer = Trainer(load_config(MICRO, overrides + [f"run_dir={run_dir}"]))
    trainer.save(force=True)
    trainer.checkpoints.wait()
    trainer.close()
    return run_dir


@pytest.fixture(scope="session")
def chat_run(tmp_path_factory) -> pathlib.Path:
    return save_untrained(tmp_path_factory.mktemp("chat-run"), CHAT)


@pytest.fixture(scope="session")
def plain_chat_run(tmp_path_factory) -> pathlib.Path:
    """The same without thinking: the generation prompt opens the response, so every text token
    of a reply is content."""
    return save_untrained(tmp_path_factory.mktemp("plain-chat-run"), CHAT + ["data.chat_thinking=false"])


@pytest.fixture(scope="session")
def xla_cache(tmp_path_factory) -> pathlib.Path:
    """One compiled-program cache for the tests that start servers as processes, so that each
    compiles only what the ones before it did not."""
    return tmp_path_factory.mktemp("xla")


@pytest.fixture(scope="session")
def serving(chat_run):
    """(client, served model, engine) of a server over `chat_run` with an API key, in this process."""
    from fastapi.testclient import TestClient

    from eval.serve.cli import build, parse_args

    app, _, served = build(parse_args([str(chat_run), "--api-key", KEY, "--max-model-len", "256", "--max-batch", "8"]))
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client, served, app.state.server


KEY = "test-key"
