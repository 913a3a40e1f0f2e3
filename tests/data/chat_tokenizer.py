"""A tiny tokenizer laid out like K3's: the 256 bytes as BPE ranks 0–255, then K3's special tokens in
K3's order ([BOS], [EOS], <|end_of_msg|>, <|open|>, <|close|>, <|sep|> at ids n…n+5, as in the released
tokenizer_config.json at 163584…163589), named by a tokenizer_config.json beside the BPE file."""
import base64
import json
import pathlib

K3_SPECIALS = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"]


def write_chat_tokenizer(directory: pathlib.Path) -> pathlib.Path:
    """The directory holding ``tiktoken.model`` and ``tokenizer_config.json`` (vocab_size 512)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    decoder = {str(256 + i): {"content": name, "special": True} for i, name in enumerate(K3_SPECIALS)}
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]"}))
    return directory
