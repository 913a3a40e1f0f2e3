"""Tokenizers: UTF-8 bytes by default, or a tiktoken-format BPE file such as K3's ``tiktoken.model``.

Both have one small interface: ``encode(str) -> list[int]``, ``decode(list[int]) -> str``,
``token_bytes(int) -> bytes`` (a text token's bytes, b"" for a special one), ``vocab_size``,
``bos_id``, ``eos_id`` and ``describe()``. ``encode`` treats all text as text (a special token's
name in the input is not turned into the special token); ``decode`` skips special tokens and
replaces byte sequences that are not UTF-8 with U+FFFD; `TextDecoder` decodes ids one at a time.

    bytes:  0–255 the UTF-8 bytes, 256 BOS, 257 EOS                      vocab_size 258
    BPE:    ranks 0…n-1 from the file, then 256 special tokens as in K3:
            n [BOS], n+1 [EOS], n+2… <|reserved_token_i|>                vocab_size n + 256

A BPE file has one ``base64(token_bytes) rank`` line per token, ranks 0…n-1, every single byte among
the tokens (K3's has n = 163,584, so vocab_size 163,840). Text is split before merging with K3's
pattern (`K3_SPLIT_PATTERN`, from Kimi's ``tokenization_kimi.py``).

A Hugging Face ``tokenizer_config.json`` beside the BPE file (as a released checkpoint ships it)
names the special tokens instead: ``added_tokens_decoder`` {id: {"content": name}} for ids n…n+255
(ids it leaves out keep the reserved names), ``bos_token`` / ``eos_token`` (a name or {"content": name})
choose BOS and EOS.
"""
from __future__ import annotations

import base64
import binascii
import codecs
import hashlib
import json
import os
from pathlib import Path
from typing import Protocol, Sequence

import tiktoken

from k3jax.data.errors import DataError
from k3jax.data.sources import read_file_bytes

K3_SPLIT_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_SPECIAL_TOKENS = 256
BPE_FILE_NAME = "tiktoken.model"  # looked for when the tokenizer path is a directory
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"  # special tokens, read when beside the BPE file


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes: ...

    def describe(self) -> dict: ...


def _checked_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """``ids`` as Python ints, each in ``[0, vocab_size)``."""
    ids = [int(i) for i in ids]
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise DataError(f"token id {outside[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


class ByteTokenizer:
    """UTF-8 bytes as tokens 0–255, then BOS 256 and EOS 257."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of ``text`` (a lone surrogate, which UTF-8 cannot hold, becomes ``?``)."""
        return list(text.encode("utf-8", errors="replace"))

    def decode(self, ids: Sequence[int]) -> str:
        text_bytes = bytes(i for i in _checked_ids(ids, self.vocab_size) if i < 256)
        return text_bytes.decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if 0 <= token < 256 else b""

    def describe(self) -> dict:
        return {"kind": "bytes", "vocab_size": self.vocab_size}


def _bpe_entry(line: bytes) -> tuple[bytes, int] | None:
    """``(token bytes, rank)`` from one ``base64 rank`` line, or None when the line is not one."""
    fields = line.split()
    if len(fields) != 2 or not fields[1].isdigit():
        return None
    try:
        return base64.b64decode(fields[0], validate=True), int(fields[1])
    except binascii.Error:
        return None


def parse_bpe_ranks(data: bytes, path: str | os.PathLike) -> dict[bytes, int]:
    """Token bytes → rank from the ``base64 rank`` lines of a tiktoken BPE file, validated."""
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        entry = _bpe_entry(line)
        if entry is None:
            raise DataError(f"{path}:{line_number}: not a tiktoken BPE line ('base64token rank')")
        token, rank = entry
        if token in ranks:
            raise DataError(f"{path}:{line_number}: token {token!r} appears twice")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"{path}: BPE ranks must be 0…{len(ranks) - 1}, each once (is this a tiktoken BPE file?)")
    missing = [byte for byte in range(256) if bytes([byte]) not in ranks]
    if missing:
        raise DataError(f"{path}: BPE vocabulary lacks {len(missing)} single-byte tokens "
                        f"(first: byte 0x{missing[0]:02x})")
    return ranks


class TiktokenTokenizer:
    """K3's byte-level BPE from a tiktoken-format file (see the module docstring for the id layout)."""

    def __init__(self, path: str | os.PathLike):
        data = read_file_bytes(path)
        ranks = parse_bpe_ranks(data, path)
        self.path = str(path)
        self.file_sha256 = hashlib.sha256(data).hexdigest()
        self.num_text_tokens = len(ranks)
        first = self.num_text_tokens
        self.vocab_size = first + NUM_SPECIAL_TOKENS
        special_names = ["[BOS]", "[EOS]", *(f"<|reserved_token_{i}|>" for i in range(first + 2, self.vocab_size))]
        bos_name, eos_name = "[BOS]", "[EOS]"
        config_path = Path(path).with_name(TOKENIZER_CONFIG_NAME)
        if config_path.is_file():
            special_names, bos_name, eos_name = special_tokens_from_config(config_path, first, special_names)
        self.special_tokens = {name: first + offset for offset, name in enumerate(special_names)}
        self.bos_id, self.eos_id = self.special_tokens[bos_name], self.special_tokens[eos_name]
        self._encoding = tiktoken.Encoding(
            name=Path(path).name, pat_str=K3_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=self.special_tokens)

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode([i for i in _checked_ids(ids, self.vocab_size) if i < self.num_text_tokens])

    def token_bytes(self, token: int) -> bytes:
        return self._encoding.decode_single_token_bytes(token) if 0 <= token < self.num_text_tokens else b""

    def describe(self) -> dict:
        return {"kind": "tiktoken", "path": self.path, "sha256": self.file_sha256, "vocab_size": self.vocab_size}


class TextDecoder:
    """Token ids -> text one id at a time, in time linear in the text: a token's bytes
    (``token_bytes(id)``) go through an incremental UTF-8 decoder, which carries the bytes of an
    incomplete character to the next token and replaces invalid bytes with U+FFFD exactly as a
    whole decode does: for every ids, ``"".join(map(feed, ids)) + flush()`` ==
    ``b"".join(map(token_bytes, ids)).decode("utf-8", "replace")``."""

    def __init__(self, token_bytes):
        self.token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token: int) -> str:
        """The text ``token`` completes (empty while a character is still incomplete)."""
        return self._utf8.decode(self.token_bytes(token))

    def flush(self) -> str:
        """The end of the text: bytes still carried become U+FFFD; the decoder starts afresh."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


def _token_name(value, key: str, path) -> str:
    name = value.get("content") if isinstance(value, dict) else value
    if not isinstance(name, str):
        raise DataError(f"{path}: {key} must be a token name or {{'content': name}}, got {value!r}")
    return name


def special_tokens_from_config(path: str | os.PathLike, first: int, defaults: list[str]) -> tuple[list[str], str, str]:
    """``(names of ids first…first+255, BOS name, EOS name)`` from a HF ``tokenizer_config.json``."""
    try:
        config = json.loads(read_file_bytes(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{path}: not valid JSON ({error})") from None
    names = list(defaults)
    for token_id, entry in (config.get("added_tokens_decoder") or {}).items():
        index = int(token_id) - first
        if not 0 <= index < len(names):
            raise DataError(f"{path}: special token id {token_id} is outside [{first}, {first + len(names)})")
        names[index] = _token_name(entry, f"added_tokens_decoder[{token_id}]", path)
    if len(set(names)) != len(names):
        raise DataError(f"{path}: special token names repeat")
    bos, eos = (_token_name(config.get(key, default), key, path) for key, default in
                (("bos_token", defaults[0]), ("eos_token", defaults[1])))
    for key, name in (("bos_token", bos), ("eos_token", eos)):
        if name not in names:
            raise DataError(f"{path}: {key} {name!r} is not one of the special tokens")
    return names, bos, eos


def load_tokenizer(path: str | os.PathLike | None = None) -> ByteTokenizer | TiktokenTokenizer:
    """The byte tokenizer when ``path`` is None, else the BPE file at ``path`` (or ``path/tiktoken.model``)."""
    if path is None:
        return ByteTokenizer()
    if Path(path).is_dir():
        path = Path(path, BPE_FILE_NAME)
    return TiktokenTokenizer(path)


def same_tokenizer(a: str | os.PathLike | None, b: str | os.PathLike | None) -> bool:
    """Whether two ``data.tokenizer`` settings give the same token ids (a draft model must read its
    target's): both bytes (None), or BPE files of the same content (sha256) and the same special
    tokens (names and ids), wherever they are. DataError when one does not load."""
    if a is None or b is None:
        return a is None and b is None

    def meaning(tokenizer) -> dict:
        return {**tokenizer.describe(), "path": None, "special_tokens": tokenizer.special_tokens}
    return meaning(load_tokenizer(a)) == meaning(load_tokenizer(b))
