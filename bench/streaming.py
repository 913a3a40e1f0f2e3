"""Streaming CPU per token: what reading each sampled token of a chat reply into its stream deltas
costs (`k3jax.data.chat_format.ReplyReader`: incremental UTF-8 decoding and a stateful parser of
thinking / content / tool-call markup, which the server's streams use), driven by a token sequence
alone -- no model, no HTTP. Replies of 1K and 16K tokens should cost the
same per token (linear time); the old way, the whole reply re-decoded and re-parsed after each
token (`ChatEncoder.parse_reply` of the prefix), is timed beside it on the short replies for scale.

The reply: K3's chat format with a byte-level tokenizer that names its markers (the tests' one:
every multi-byte character split across tokens, every tag's text too), half reasoning and half
content of mixed ASCII, accented, CJK and emoji text, one tool call, cut to exactly N tokens.

    python -m bench.streaming [--lengths 1024 16384] [--old-lengths 1024 4096] [--out bench/streaming.json]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.common import table, write_json
from k3jax.data import load_tokenizer
from k3jax.data.chat_format import ChatEncoder, ReplyReader, reply_segments
from tests.data.chat_tokenizer import write_chat_tokenizer

TEXT = "The sum of 12 and 7 is 19; café, naïve — 中文字符 and emoji 😀🎉. "


def reply_ids(encoder: ChatEncoder, length: int) -> list[int]:
    """A reply of exactly ``length`` ids: reasoning and content of about ``length / 2`` bytes each."""
    text = TEXT * (length // (2 * len(TEXT.encode())) + 1)
    message = {"role": "assistant", "reasoning_content": text, "content": text,
               "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 12, "b": 7}'}}]}
    ids = encoder.encode(reply_segments(message, True))[0].tolist()
    return ids[:length] if len(ids) >= length else ids + encoder.tokenizer.encode(TEXT * length)[: length - len(ids)]


def streaming_seconds(encoder: ChatEncoder, ids: list[int]) -> float:
    """CPU seconds of one streamed reply: every token through a `ReplyReader`, then its end; the
    deltas checked against the whole reply's parse."""
    reader = ReplyReader(encoder, True)
    start = time.process_time()
    sent = [reader.feed(token) for token in ids] + [reader.close()]
    elapsed = time.process_time() - start
    whole = encoder.parse_reply(ids, True)
    assert "".join(r for r, _ in sent) == whole.reasoning and "".join(c for _, c in sent) == whole.content
    return elapsed


def reparse_seconds(encoder: ChatEncoder, ids: list[int]) -> float:
    """CPU seconds of the old way: the whole prefix parsed again after each token."""
    start = time.process_time()
    for end in range(1, len(ids) + 1):
        encoder.parse_reply(ids[:end], True)
    return time.process_time() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--old-lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/streaming.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        encoder = ChatEncoder(load_tokenizer(write_chat_tokenizer(Path(directory))))
    rows, results = [], []
    for method, lengths, measure in (("incremental", args.lengths, streaming_seconds),
                                     ("re-parse each token", args.old_lengths, reparse_seconds)):
        for length in lengths:
            ids = reply_ids(encoder, length)
            best = min(measure(encoder, ids) for _ in range(args.repeats))
            results.append({"method": method, "tokens": length, "seconds": best, "us_per_token": 1e6 * best / length})
            rows.append([method, length, f"{best:.4f}", f"{1e6 * best / length:.2f}"])
    print(table(["method", "reply tokens", "CPU s (best of repeats)", "µs / token"], rows))
    write_json(args.out, {"repeats": args.repeats, "results": results})


if __name__ == "__main__":
    main()
