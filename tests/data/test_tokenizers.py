"""Byte and tiktoken-format BPE tokenizers: round trips, id layout, bad BPE files."""
import base64

import pytest

from k3jax.data import ByteTokenizer, DataError, TiktokenTokenizer, load_tokenizer
from tests.data.corpus import TINY_MERGES

TEXTS = ["", "plain ASCII", "naïve café, Zürich", "中文 and 日本語", "emoji 🎉🚀", "tabs\tand\r\nnewlines\n\n",
         "the thing in the thing"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_byte_layout_and_special_tokens_are_skipped_in_decode():
    tokenizer = ByteTokenizer()
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (258, 256, 257)
    assert tokenizer.decode([tokenizer.bos_id, *b"ok", tokenizer.eos_id]) == "ok"
    with pytest.raises(DataError, match="outside the vocabulary"):
        tokenizer.decode([258])


@pytest.mark.parametrize("text", TEXTS)
def test_bpe_round_trip(bpe_file, text):
    tokenizer = TiktokenTokenizer(bpe_file)
    ids = tokenizer.encode(text)
    assert all(0 <= i < 256 + len(TINY_MERGES) for i in ids)
    assert tokenizer.decode(ids) == text


def test_bpe_merges_and_layout(bpe_file):
    tokenizer = load_tokenizer(bpe_file)
    rank = {token: 256 + i for i, token in enumerate(TINY_MERGES)}
    # Pre-tokens "the" and " thing". In " thing" the lowest-ranked pair "th" (256) merges before " t"
    # (259), which leaves " " + "th" (not a token); then "in", then "in" + "g".
    assert tokenizer.encode("the thing") == [rank[b"the"], ord(" "), rank[b"th"], rank[b"ing"]]
    assert tokenizer.encode("é") == [rank[b"\xc3\xa9"]]
    num_text = 256 + len(TINY_MERGES)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (num_text, num_text + 1, num_text + 256)
    assert tokenizer.encode("[EOS]") != [tokenizer.eos_id]  # special names in text stay text
    assert tokenizer.decode([tokenizer.bos_id, *tokenizer.encode("hi"), tokenizer.eos_id]) == "hi"


def test_bpe_directory_finds_tiktoken_model(bpe_file, tmp_path):
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "tiktoken.model").write_bytes(bpe_file.read_bytes())
    assert load_tokenizer(tmp_path / "checkpoint").encode("the") == [256 + TINY_MERGES.index(b"the")]


def _bpe_lines(tokens_and_ranks):
    return "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in tokens_and_ranks)


BYTES = [(bytes([b]), b) for b in range(256)]
BAD_BPE_FILES = {
    "not base64": _bpe_lines(BYTES) + "@@@ 256\n",
    "no rank": _bpe_lines(BYTES) + "dGg=\n",
    "repeated token": _bpe_lines(BYTES + [(b"a", 256)]),
    "rank gap": _bpe_lines(BYTES + [(b"th", 300)]),
    "missing byte": _bpe_lines(BYTES[1:]),
    "binary": "\x00\x01\x02 garbage",
}


@pytest.mark.parametrize("case", sorted(BAD_BPE_FILES))
def test_bad_bpe_file_names_the_file(tmp_path, case):
    path = tmp_path / "bad.tiktoken"
    path.write_text(BAD_BPE_FILES[case])
    with pytest.raises(DataError, match="bad.tiktoken") as error:
        TiktokenTokenizer(path)
    assert "\n" not in str(error.value)


def test_missing_bpe_file(tmp_path):
    with pytest.raises(DataError, match="absent.model: no such file"):
        load_tokenizer(tmp_path / "absent.model")


def test_special_tokens_from_tokenizer_config(bpe_file):
    import json
    num_text = 256 + len(TINY_MERGES)
    bpe_file.with_name("tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(num_text): {"content": "[BOS]"}, str(num_text + 1): {"content": "[EOS]"},
                                 str(num_text + 2): {"content": "<|im_end|>"}, str(num_text + 5): {"content": "<|x|>"}},
        "bos_token": "[BOS]", "eos_token": {"content": "<|im_end|>"}}))
    tokenizer = TiktokenTokenizer(bpe_file)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (num_text, num_text + 2, num_text + 256)
    assert tokenizer.special_tokens["<|x|>"] == num_text + 5
    assert tokenizer.special_tokens[f"<|reserved_token_{num_text + 3}|>"] == num_text + 3   # left out: reserved
    assert tokenizer.decode([tokenizer.eos_id, *tokenizer.encode("hi")]) == "hi"


@pytest.mark.parametrize("config, words", [
    ({"added_tokens_decoder": {"5": {"content": "x"}}}, "outside"),
    ({"eos_token": "<|nope|>"}, "eos_token"),
    ({"added_tokens_decoder": {"300": {"content": "[EOS]"}}}, "repeat"),
])
def test_bad_tokenizer_config_names_the_file(bpe_file, config, words):
    import json
    config_path = bpe_file.with_name("tokenizer_config.json")
    config_path.write_text(json.dumps(config).replace('"300"', f'"{256 + len(TINY_MERGES)}"'))
    with pytest.raises(DataError, match=words) as caught:
        TiktokenTokenizer(bpe_file)
    assert "tokenizer_config.json" in str(caught.value)


def test_same_tokenizer_compares_contents_not_paths(tmp_path):
    from k3jax.data.tokenizers import same_tokenizer
    from tests.data.chat_tokenizer import write_chat_tokenizer

    first, second = write_chat_tokenizer(tmp_path / "a"), write_chat_tokenizer(tmp_path / "b")
    other = write_chat_tokenizer(tmp_path / "c")
    model = other / "tiktoken.model"
    lines = model.read_text().splitlines()
    lines[0], lines[1] = f"{lines[0].split()[0]} 1", f"{lines[1].split()[0]} 0"     # bytes 0 and 1 swap ids
    model.write_text("\n".join(lines) + "\n")
    assert same_tokenizer(None, None) and same_tokenizer(first, second) and same_tokenizer(first, first / "tiktoken.model")
    assert not same_tokenizer(first, other) and not same_tokenizer(None, first) and not same_tokenizer(first, None)
    with pytest.raises(DataError):
        same_tokenizer(first, tmp_path / "missing")
