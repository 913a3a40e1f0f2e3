"""Pre-tokenise a corpus once into packed token shards that ``data.kind=tokens`` reads from disk.

    python -m k3jax.data.prepare SRC [SRC ...] OUT [--tokenizer PATH] [--jsonl-field text]
                                 [--shard-tokens 16777216] [--seq-len N]

SRC is read as ``data.kind=text`` reads ``data.path`` (text, JSONL, Parquet files, directories,
globs; `k3jax.data.sources`); OUT gets the layout of `k3jax.data.tokens`. Documents are tokenized
in order and a shard is closed at the first document boundary at or past ``--shard-tokens`` tokens.

Resumable: each shard is written under a temporary name and renamed, its ``.json`` last, so a killed
prepare leaves only complete shards; run again with the same arguments and it continues after the
last one (a run with other settings into the same OUT is refused). Deterministic: the same sources
and settings give the same bytes in every file, however often it was interrupted. ``--seq-len N``
checks that the corpus fills at least one row of N positions and reports the rows.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from k3jax.disk import disk_full, free_space, write_atomically
from k3jax.data.errors import DataError, require_int
from k3jax.data.packing import concatenate_documents, document_tokens
from k3jax.data.sources import find_data_files, read_documents
from k3jax.data.tokenizers import load_tokenizer
from k3jax.data.tokens import (FORMAT, FORMAT_VERSION, INDEX_NAME, SETTINGS_NAME, array_sha256, read_json,
                               shard_name)

DEFAULT_SHARD_TOKENS = 2**24   # 64 MiB of int32 tokens


def file_sha256(path: Path) -> str:
    """SHA-256 of a source file's bytes (read in 1 MiB pieces): a continued prepare refuses sources
    edited since it began, even when their size is unchanged."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as file:
            for piece in iter(lambda: file.read(1 << 20), b""):
                digest.update(piece)
    except OSError as error:
        raise DataError(f"{path}: cannot read ({error.strerror or error})") from None
    return digest.hexdigest()


def write_json(path: Path, value) -> None:
    write_atomically(path, lambda file: file.write((json.dumps(value, indent=1, sort_keys=True) + "\n").encode()))


def completed_shards(out: Path) -> list[dict]:
    """The entries of the shards ``0, 1, …`` that a previous run finished (their ``.json`` exists)."""
    entries = []
    while (out / f"{shard_name(len(entries))}.json").is_file():
        entries.append(read_json(out / f"{shard_name(len(entries))}.json"))
    return entries


def write_shard(out: Path, number: int, pieces: list[np.ndarray], end_document: int) -> dict:
    """Shard ``number`` from documents' tokens ``pieces``; returns its entry (also its ``.json``)."""
    stream = concatenate_documents(pieces)
    name = shard_name(number)
    write_atomically(out / f"{name}.tokens.npy", lambda file: np.save(file, stream.tokens))
    write_atomically(out / f"{name}.docs.npy", lambda file: np.save(file, stream.doc_starts))
    entry = {"name": name, "num_tokens": int(stream.tokens.size), "num_documents": int(stream.doc_starts.size),
             "end_document": end_document, "tokens_sha256": array_sha256(stream.tokens),
             "docs_sha256": array_sha256(stream.doc_starts)}
    write_json(out / f"{name}.json", entry)
    return entry


def source_documents(files: list[Path], field: str, bar) -> Iterator[str]:
    """Every document of ``files`` in order (empty ones too: they are counted), advancing ``bar`` by bytes."""
    for file in files:
        yield from read_documents(file, field)
        bar.update(file.stat().st_size)


def prepare(sources: list[str], out: str | os.PathLike, *, tokenizer_path: str | None = None,
            jsonl_field: str = "text", shard_tokens: int = DEFAULT_SHARD_TOKENS, seq_len: int | None = None,
            log=print) -> dict:
    """Write (or finish writing) the shards of ``sources`` into ``out``; returns the index."""
    shard_tokens = require_int("--shard-tokens", shard_tokens, 1)
    seq_len = None if seq_len is None else require_int("--seq-len", seq_len, 1)
    tokenizer = load_tokenizer(tokenizer_path)
    out = Path(out)
    files = [file for source in sources for file in find_data_files(source)
             if out.resolve() not in file.resolve().parents]   # OUT inside a source: its own .json files
    settings = {"format": FORMAT, "version": FORMAT_VERSION, "sources": [str(s) for s in sources],
                "files": [{"path": str(f), "bytes": f.stat().st_size, "sha256": file_sha256(f)} for f in files],
                "jsonl_field": jsonl_field, "tokenizer": tokenizer.describe(), "shard_tokens": shard_tokens}
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    if (out / SETTINGS_NAME).is_file():
        if read_json(out / SETTINGS_NAME) != settings:
            raise DataError(f"{out}: prepared (or being prepared) from other sources or settings; "
                            "use another directory, or delete it to start over")
    else:
        write_json(out / SETTINGS_NAME, settings)
    index = read_json(out / INDEX_NAME) if (out / INDEX_NAME).is_file() else None
    if index is None:
        index = _write_shards(files, out, settings, tokenizer, shard_tokens, log)
    rows = f"; {max(index['num_tokens'] - 1, 0) // seq_len} rows of seq_len {seq_len}" if seq_len else ""
    if seq_len and index["num_tokens"] <= seq_len:
        raise DataError(f"{out}: {index['num_tokens']} tokens, fewer than one row of seq_len + 1 = {seq_len + 1}")
    log(f"{out}: {index['num_tokens']} tokens, {index['num_documents']} documents in {len(index['shards'])} shards{rows}")
    return index


def _write_shards(files: list[Path], out: Path, settings: dict, tokenizer, shard_tokens: int, log) -> dict:
    """Tokenize the documents after the completed shards into new shards; then write the index."""
    shards = completed_shards(out)
    skip = shards[-1]["end_document"] if shards else 0
    if shards:
        log(f"{out}: continuing after {len(shards)} complete shards ({skip} source documents)")
    pieces, size = [], 0
    with tqdm(total=sum(f["bytes"] for f in settings["files"]), unit="B", unit_scale=True, desc="prepare",
              disable=None) as bar:
        for number, text in enumerate(source_documents(files, settings["jsonl_field"], bar)):
            if number < skip:
                continue
            piece = document_tokens(text, tokenizer)
            if piece is not None:
                pieces.append(piece)
                size += piece.size
            if size >= shard_tokens:
                shards.append(write_shard(out, len(shards), pieces, number + 1))
                bar.set_postfix(shards=len(shards))
                pieces, size = [], 0
    if pieces:
        shards.append(write_shard(out, len(shards), pieces, number + 1))
    total = sum(entry["num_tokens"] for entry in shards)
    if total == 0:
        raise DataError(f"{', '.join(settings['sources'])}: no tokens (every document is empty)")
    index = {"format": FORMAT, "version": FORMAT_VERSION, "tokenizer": settings["tokenizer"],
             "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "num_tokens": total,
             "num_documents": sum(entry["num_documents"] for entry in shards), "shards": shards}
    write_json(out / INDEX_NAME, index)
    return index


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m k3jax.data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", metavar="SRC ... OUT",
                        help="text / JSONL / Parquet files, directories or globs, then the output directory")
    parser.add_argument("--tokenizer", help="a tiktoken BPE file (K3's tiktoken.model) or its directory; default bytes")
    parser.add_argument("--jsonl-field", default="text", help="the JSON field / Parquet column holding the text")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help=f"close a shard at the first document end past this many tokens (default {DEFAULT_SHARD_TOKENS})")
    parser.add_argument("--seq-len", type=int, help="check the corpus fills a row of this length; report the rows")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if len(args.paths) < 2:
        parser.error("give at least one SRC and the OUT directory")
    *sources, out = args.paths
    try:
        prepare(sources, out, tokenizer_path=args.tokenizer, jsonl_field=args.jsonl_field,
                shard_tokens=args.shard_tokens, seq_len=args.seq_len, log=lambda line: print(line, file=sys.stderr))
    except DataError as error:
        print(f"prepare: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:       # writing OUT: a full disk, a read-only directory
        reason = f"no space left on device ({free_space(out)} free)" if disk_full(error) else error.strerror or error
        print(f"prepare: error: cannot write {out}: {reason}; the complete shards are kept: make room and run again "
              "to continue", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"prepare: interrupted; the complete shards in {out} are kept: run again to continue", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
