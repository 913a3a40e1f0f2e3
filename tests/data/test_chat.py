"""`k3jax.data.ChatDataset`: JSONL conversations packed whole into rows, loss on the assistant's output."""
import json
import re

import numpy as np
import pytest

from k3jax.config import load_config
from k3jax.data import ChatDataset, DataError, make_dataset
from k3jax.data.chat_format import ChatEncoder, render_conversation
from k3jax.data.tokenizers import load_tokenizer


def conversation(i: int, words: int = 1) -> dict:
    return {"messages": [{"role": "user", "content": f"q{i}"},
                         {"role": "assistant", "content": " ".join([f"a{i}"] * words)}]}


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def dataset(tmp_path, tokenizer, records, **options):
    options = {"thinking": False, "thinking_effort": None, "heldout_fraction": 0.25, **options}
    return ChatDataset(write_jsonl(tmp_path / "chat.jsonl", records), 300, tokenizer_path=tokenizer, **options)


def encoded(record, tokenizer_dir):
    return ChatEncoder(load_tokenizer(tokenizer_dir)).encode(
        render_conversation(record["messages"], thinking=False, thinking_effort=None))


def test_rows_hold_whole_conversations_with_assistant_loss(tmp_path, chat_tokenizer):
    records = [conversation(i, words=1 + i % 3) for i in range(8)]
    data = dataset(tmp_path, chat_tokenizer, records)
    assert data.describe()["heldout_conversations"] == 2
    assert data.num_rows("train") < 6     # several conversations share a row
    expected = [encoded(record, chat_tokenizer) for record in records]
    for split, wanted in (("train", expected[:6]), ("heldout", expected[6:])):
        rows = data.num_rows(split)
        batch = data.batch(0, rows, split)
        seen = []
        for r in range(rows):
            full = np.concatenate([batch["tokens"][r], batch["targets"][r, -1:]])
            segments = np.concatenate([batch["segment_ids"][r], batch["segment_ids"][r, -1:]])
            for s in range(1, segments.max() + 1):
                span = np.flatnonzero(segments == s)
                seen.append(full[span])
                # the loss mask at position t is the assistant flag of target t+1 within the conversation
                ids, flags = next((ids, flags) for ids, flags in wanted if np.array_equal(ids, full[span]))
                np.testing.assert_array_equal(batch["loss_mask"][r][span[:-1]], flags[1:].astype(np.float32))
            assert batch["loss_mask"][r][segments[:-1] == 0].sum() == 0
        assert sorted(map(bytes, seen)) == sorted(bytes(ids) for ids, _ in wanted)   # each conversation once, whole


def test_batches_are_the_same_for_any_process_count(tmp_path, chat_tokenizer):
    data = dataset(tmp_path, chat_tokenizer, [conversation(i, 1 + i % 4) for i in range(40)], heldout_fraction=0.1)
    whole = data.batch(3, 4)
    halves = [data.batch(3, 4, process_index=p, process_count=2) for p in range(2)]
    for key in whole:
        np.testing.assert_array_equal(whole[key], np.concatenate([half[key] for half in halves]))


def test_overflow_truncate_or_drop_is_counted(tmp_path, chat_tokenizer):
    records = [conversation(0), conversation(1, words=100), conversation(2)]
    cut = dataset(tmp_path, chat_tokenizer, records, overflow="truncate").describe()
    dropped = dataset(tmp_path, chat_tokenizer, records, overflow="drop").describe()
    assert (cut["truncated_conversations"], cut["dropped_conversations"], cut["num_conversations"]) == (1, 0, 3)
    assert (dropped["truncated_conversations"], dropped["dropped_conversations"], dropped["num_conversations"]) == (0, 1, 2)


def test_data_whose_every_reply_is_cut_off_is_refused_instead_of_training_on_nothing(tmp_path, chat_tokenizer):
    long_question = {"messages": [{"role": "user", "content": " ".join(["q"] * 400)},
                                  {"role": "assistant", "content": "a"}]}
    with pytest.raises(DataError, match=r"no training conversation has a token the loss counts .*data.chat_loss=all"):
        dataset(tmp_path, chat_tokenizer, [long_question] * 4)
    assert dataset(tmp_path, chat_tokenizer, [long_question] * 4, loss="all").num_rows() > 0


@pytest.mark.parametrize("lines, message", [
    (['{"messages": [{"role": "user", "content": "x"}]}', "{oops"], r"chat.jsonl:2: malformed JSON"),
    (['{"text": "x"}'], r"chat.jsonl:1: expected a JSON object with a 'messages' field"),
    (['{"messages": [{"role": "robot", "content": "x"}]}'], r"chat.jsonl:1: message 0 has unknown role 'robot'"),
])
def test_bad_records_are_one_line_errors(tmp_path, chat_tokenizer, lines, message):
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=message) as error:
        ChatDataset(tmp_path / "chat.jsonl", 64, tokenizer_path=chat_tokenizer)
    assert "\n" not in str(error.value)


def test_config_builds_the_chat_dataset(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [conversation(i) for i in range(6)])
    config = load_config("configs/tiny.yaml", ["data.kind=chat", f"data.path={path}", f"data.tokenizer={chat_tokenizer}",
                                               "data.seq_len=512", "data.chat_overflow=drop"])
    data = make_dataset(config.data)
    assert isinstance(data, ChatDataset) and data.describe()["thinking_effort"] == "max"
    assert data.describe()["dropped_conversations"] == 0
    assert re.fullmatch(r"[0-9a-f]{64}", data.content_hash())
    assert data.content_hash() != make_dataset(config.data.__class__(**{**vars(config.data), "chat_loss": "all"})).content_hash()


TOOL_CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?", "name": "ann"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "rain"},
                  {"role": "assistant", "content": "Rain in Oslo."}],
     "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]},
    *[conversation(i, 1 + i % 3) for i in range(7)],
]


def write_parquet(path, columns: dict) -> str:
    import pyarrow
    import pyarrow.parquet
    pyarrow.parquet.write_table(pyarrow.table(columns), path)
    return str(path)


def test_parquet_rows_equal_the_same_conversations_from_jsonl(tmp_path, chat_tokenizer):
    """A list-of-structs column (nulls where a message lacks a field) and a JSON-string column, read from a
    directory and from a glob, give the rows and hash the JSONL file gives."""
    options = {"thinking": False, "thinking_effort": None, "heldout_fraction": 0.25, "tokenizer_path": chat_tokenizer}
    jsonl = ChatDataset(write_jsonl(tmp_path / "chat.jsonl", TOOL_CONVERSATIONS), 300, **options)
    (tmp_path / "structs").mkdir()
    (tmp_path / "strings").mkdir()
    tools = [record.get("tools") for record in TOOL_CONVERSATIONS]
    write_parquet(tmp_path / "structs" / "chat.parquet",
                  {"messages": [record["messages"] for record in TOOL_CONVERSATIONS], "tools": tools})
    write_parquet(tmp_path / "strings" / "chat.parquet",
                  {"messages": [json.dumps(record["messages"]) for record in TOOL_CONVERSATIONS],
                   "tools": [json.dumps(spec) if spec else None for spec in tools]})
    for path in (tmp_path / "structs", str(tmp_path / "strings" / "*.parquet")):
        parquet = ChatDataset(path, 300, **options)
        assert parquet.content_hash() == jsonl.content_hash()
        for split in ("train", "heldout"):
            for key, value in jsonl.batch(0, 2, split).items():
                np.testing.assert_array_equal(parquet.batch(0, 2, split)[key], value, err_msg=f"{path} {split} {key}")


@pytest.mark.parametrize("columns, message", [
    ({"text": ["x"]}, r"chat.parquet: no 'messages' column \(its columns: 'text'\)"),
    ({"messages": [1]}, r"chat.parquet: column 'messages' holds int64, not a list of structs or JSON strings"),
    ({"messages": ['[{"role": "user", "content": "x"}]', '[{"role": "user"']},
     r"chat.parquet: row 1: column 'messages' is malformed JSON"),
    ({"messages": ['[{"role": "user", "content": "x"}]', None]}, r"chat.parquet: row 1: column 'messages' is null"),
    ({"messages": [[{"role": "user", "content": "x"}], [{"role": "robot", "content": "x"}]]},
     r"chat.parquet: row 1: message 0 has unknown role 'robot'"),
])
def test_bad_parquet_conversations_are_one_line_errors(tmp_path, chat_tokenizer, columns, message):
    path = write_parquet(tmp_path / "chat.parquet", columns)
    with pytest.raises(DataError, match=message) as error:
        ChatDataset(path, 64, tokenizer_path=chat_tokenizer)
    assert "\n" not in str(error.value)
