"""Reading user text: which files a path names, and the documents inside them.

A path is a file, a directory or a glob (``data/*.parquet``, ``corpus/**/*.jsonl``). A directory is
searched recursively, in sorted order, for ``.txt``/``.md`` files (one document each),
``.jsonl``/``.json`` files (one document per record) and ``.parquet`` files (one document per row);
hidden files and folders are skipped. A glob's matches are read in sorted order, its directories
searched like a directory and its files kept when they have one of those extensions. A file named
directly is read by its extension: ``.jsonl`` and ``.json`` as JSON, ``.parquet`` as Parquet, anything
else as text. A JSON file holds one record per line (JSON Lines) or, when it starts with ``[``, an
array of records; each record is an object whose ``field`` holds the text. In a Parquet file
``field`` names a string column (read with pyarrow: ``pip install 'k3jax[parquet]'``).

Files must be UTF-8 (a leading byte-order mark is dropped). Every user mistake raises `DataError`
naming the file, and the line or byte offset where there is one.
"""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Iterator

from k3jax.data.errors import DataError

TEXT_SUFFIXES = (".txt", ".md")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
DATA_SUFFIXES = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES
GLOB_CHARACTERS = "*?["
JSON_TYPE_NAMES = {dict: "an object", list: "an array", str: "a string", int: "a number",
                   float: "a number", bool: "a boolean", type(None): "null"}


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def _directory_files(directory: Path) -> list[Path]:
    """Data files under ``directory`` (recursive, hidden entries skipped), sorted by path."""
    found = []
    for folder, subfolders, names in os.walk(directory):
        subfolders[:] = [name for name in subfolders if not _is_hidden(name)]
        found += [Path(folder, name) for name in names
                  if not _is_hidden(name) and Path(name).suffix.lower() in DATA_SUFFIXES]
    return sorted(found)


def _glob_files(pattern: str) -> list[Path]:
    """Data files among a glob's sorted matches (``**`` spans folders), directories searched."""
    found = []
    for match in map(Path, sorted(glob.glob(pattern, recursive=True))):
        if match.is_dir():
            found += _directory_files(match)
        elif match.suffix.lower() in DATA_SUFFIXES:
            found.append(match)
    if not found:
        raise DataError(f"{pattern}: no {', '.join(DATA_SUFFIXES)} files match this glob")
    return list(dict.fromkeys(found))


def find_data_files(path: str | os.PathLike) -> list[Path]:
    """The data files ``path`` names: itself if a file, the matching files beneath it if a directory,
    the data files it matches if a glob."""
    if not Path(path).exists() and any(character in str(path) for character in GLOB_CHARACTERS):
        return _glob_files(str(path))
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if not path.is_dir():
        return [path]
    files = _directory_files(path)
    if not files:
        raise DataError(f"{path}: no {', '.join(DATA_SUFFIXES)} files in this directory")
    return files


def read_file_bytes(path: str | os.PathLike) -> bytes:
    """The file's bytes; a missing or unreadable file is a `DataError`."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as error:
        raise DataError(f"{path}: cannot read ({error.strerror or error})") from None


def decode_utf8(data: bytes, path: str | os.PathLike) -> str:
    """``data`` decoded as UTF-8, without a leading byte-order mark; naming the first bad byte otherwise."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        bad_byte = data[error.start]
        raise DataError(f"{path}: not UTF-8 text (byte 0x{bad_byte:02x} at byte offset {error.start})") from None
    return text.removeprefix("\ufeff")


def _parse_json(text: str, path: Path, first_line: int = 1):
    """``json.loads(text)``; ``text`` starts at line ``first_line`` of ``path`` (for the error message)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        line = first_line + error.lineno - 1
        raise DataError(f"{path}:{line}: malformed JSON ({error.msg} at column {error.colno})") from None
    except RecursionError:
        raise DataError(f"{path}:{first_line}: JSON nested too deeply") from None


def json_records(text: str, path: Path) -> Iterator[tuple[str, object]]:
    """``(location, record)`` for each record of a JSON array or JSON Lines file; blank lines skipped."""
    if text.lstrip().startswith("["):
        for index, record in enumerate(_parse_json(text, path)):
            yield f"{path}: record {index}", record
        return
    for line_number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            yield f"{path}:{line_number}", _parse_json(line, path, line_number)


def _record_text(record, where: str, field: str) -> str:
    """The string in ``record[field]``."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with a {field!r} field, got {JSON_TYPE_NAMES[type(record)]}")
    if field not in record:
        raise DataError(f"{where}: no {field!r} field (its fields: {', '.join(map(repr, list(record)[:8])) or 'none'})")
    value = record[field]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} is {JSON_TYPE_NAMES[type(value)]}, not a string")
    return value


def parquet_column(path: Path, column: str, accepts, holds: str, optional: bool = False) -> list | None:
    """One column of a Parquet file as Python values, row by row; ``accepts(arrow type)`` says whether
    the column's type is one the caller reads (``holds`` names those types for the error). A missing
    column is an error, or None when ``optional``."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install 'k3jax[parquet]'") from None
    try:
        table = pyarrow.parquet.ParquetFile(path)
        schema = table.schema_arrow
        if column not in schema.names:
            if optional:
                return None
            raise DataError(f"{path}: no {column!r} column (its columns: {', '.join(map(repr, schema.names[:8])) or 'none'})")
        kind = schema.field(column).type
        if not accepts(kind):
            raise DataError(f"{path}: column {column!r} holds {kind}, not {holds}")
        return table.read(columns=[column]).column(column).to_pylist()
    except (OSError, pyarrow.ArrowException) as error:
        raise DataError(f"{path}: not a readable Parquet file ({str(error).splitlines()[0]})") from None


def is_arrow_string(kind) -> bool:
    import pyarrow
    return pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind)


def _parquet_texts(path: Path, column: str) -> list[str]:
    """The strings of one column of a Parquet file, row by row (a null is an error naming its row)."""
    texts = parquet_column(path, column, is_arrow_string, "strings")
    if None in texts:
        raise DataError(f"{path}: row {texts.index(None)}: column {column!r} is null")
    return texts


def read_documents(path: Path, field: str = "text") -> list[str]:
    """The documents in one data file: the whole text, each JSON record's ``field``, or each Parquet
    row's ``field`` column."""
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return _parquet_texts(path, field)
    text = decode_utf8(read_file_bytes(path), path)
    if path.suffix.lower() in JSON_SUFFIXES:
        return [_record_text(record, where, field) for where, record in json_records(text, path)]
    return [text]
