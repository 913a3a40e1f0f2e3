"""Fixtures for the data tests: a small corpus on disk and a tiny tiktoken-format BPE file."""
import base64

import pytest

from tests.data.corpus import CORPUS, TINY_MERGES, write_files


@pytest.fixture
def corpus_dir(tmp_path):
    write_files(tmp_path / "corpus", CORPUS)
    return tmp_path / "corpus"


@pytest.fixture
def bpe_file(tmp_path):
    """A tiktoken-format file: the 256 bytes at ranks 0–255, then `TINY_MERGES`."""
    tokens = [bytes([b]) for b in range(256)] + TINY_MERGES
    path = tmp_path / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path


@pytest.fixture
def chat_tokenizer(tmp_path):
    """A byte-level tokenizer directory that names K3's chat markers (see `tests.data.chat_tokenizer`)."""
    from tests.data.chat_tokenizer import write_chat_tokenizer
    return write_chat_tokenizer(tmp_path / "chat_tokenizer")
