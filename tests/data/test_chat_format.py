"""K3's chat format (`k3jax.data.chat_format`) against the reference rendering.

Expected strings marked VLLM are copied from vLLM's tests of its copy of K3's ``encoding_k3.py``:
https://github.com/vllm-project/vllm/blob/main/tests/tokenizers_/test_kimi_k3.py
(the renderer itself: https://github.com/vllm-project/vllm/blob/main/vllm/tokenizers/encoding_k3.py,
from https://huggingface.co/moonshotai/Kimi-K3/blob/main/encoding_k3.py).
"""
import re

import numpy as np
import pytest

from k3jax.data import ByteTokenizer, DataError, load_tokenizer
from k3jax.data.chat_format import (ChatEncoder, generation_prompt, render_conversation, rendered_text,
                                     reply_segments)

MULTI_TURN = [
    {"role": "user", "content": "first question"},
    {"role": "assistant", "reasoning_content": "first reasoning", "content": "first answer"},
    {"role": "user", "content": "follow-up question"},
]


def render(messages, tools=None, prompt=False, **options):
    segments = render_conversation(messages, tools, **options)
    return rendered_text(segments + (generation_prompt(options.get("thinking", True)) if prompt else []))


def test_non_thinking_prompt_equals_reference():
    # VLLM test_apply_chat_template_renders_non_thinking_prompt
    assert render([{"role": "user", "content": "hello"}], prompt=True, thinking=False) == (
        '<|open|>message role="user"<|sep|>hello'
        "<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="assistant"<|sep|>'
        "<|open|>response<|sep|>"
    )


def test_multi_turn_thinking_equals_reference():
    # VLLM test_apply_chat_template_renders_multi_turn_history_and_next_prompt (thinking, effort max)
    first_user = '<|open|>message role="user"<|sep|>first question<|close|>message<|sep|><|end_of_msg|>'
    first_assistant = ('<|open|>message role="assistant"<|sep|>'
                       "<|open|>think<|sep|>first reasoning<|close|>think<|sep|>"
                       "<|open|>response<|sep|>first answer<|close|>response<|sep|>"
                       "<|close|>message<|sep|><|end_of_msg|>")
    follow_up = '<|open|>message role="user"<|sep|>follow-up question<|close|>message<|sep|><|end_of_msg|>'
    next_assistant = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    effort = ('<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much '
              "to think in your thinking channel (not including the response channel), supported values include "
              "`low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort=max`."
              "<|close|>message<|sep|><|end_of_msg|>")   # the body from encoding_k3.py's build_chat_segments
    assert render(MULTI_TURN, prompt=True) == effort + first_user + first_assistant + follow_up + next_assistant
    assert "thinking-effort" not in render(MULTI_TURN, thinking_effort=None)


def test_tool_results_are_ordered_by_call_id():
    # VLLM test_apply_chat_template_reorders_tool_results_without_mutating_input
    conversation = [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "lookup:0", "type": "function", "function": {"name": "lookup", "arguments": "{}"}},
            {"id": "lookup:1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "lookup:1", "content": "second"},
        {"role": "tool", "tool_call_id": "lookup:0", "content": "first"},
    ]
    prompt = render(conversation)
    first = '<|open|>message role="tool" tool="lookup" index="1"<|sep|>first'
    second = '<|open|>message role="tool" tool="lookup" index="2"<|sep|>second'
    assert first in prompt and second in prompt and prompt.index(first) < prompt.index(second)
    assert [message["content"] for message in conversation[1:]] == ["second", "first"]


def test_tool_calls_and_declaration():
    # Written from the rules of encoding_k3.py (_render_assistant_segments, _render_tool_declare):
    # typed <argument> children, raw strings, JSON otherwise, attribute escaping, sorted compact JSON.
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    conversation = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "On it.", "tool_calls": [
            {"id": "c1", "function": {"name": 'weather&"alerts', "arguments": '{"city": " New York ", "days": 2}'}},
            {"id": "c2", "function": {"name": "f", "arguments": "{oops"}}]},
        {"role": "tool", "name": "get_weather", "content": "sunny"},
    ]
    assert render(conversation, tools, thinking=False) == (
        '<|open|>message role="system" type="tool-declare"<|sep|># Tools\n'
        "Here are the available tools, described in JSONSchema.\n\n```json\n"
        '[{"function":{"name":"get_weather","parameters":{"type":"object"}},"type":"function"}]\n```'
        "<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="user"<|sep|>weather?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>On it.<|close|>response<|sep|>'
        "<|open|>tools<|sep|>"
        '<|open|>call tool="weather&amp;&quot;alerts" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|> New York <|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|>'
        "<|close|>call<|sep|>"
        '<|open|>call tool="f" index="2"<|sep|><|open|>json type="object"<|sep|>{oops<|close|>json<|sep|>'
        "<|close|>call<|sep|>"
        "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>sunny<|close|>message<|sep|><|end_of_msg|>'
    )


def marker_text(ids, tokenizer):
    """Token ids back to text, special tokens as their names (an independent decoder for the check)."""
    names = {i: name for name, i in tokenizer.special_tokens.items()}
    return "".join(names[i] if i in names else bytes([i]).decode("latin-1") for i in ids)


ASSISTANT_OUTPUT = re.compile(r'<\|open\|>message role="assistant"<\|sep\|><\|open\|>(?:think|response)<\|sep\|>'
                              r"(.*?<\|end_of_msg\|>)", re.S)


@pytest.mark.parametrize("thinking", [True, False])
def test_loss_mask_covers_exactly_the_assistant_output(chat_tokenizer, thinking):
    tokenizer = load_tokenizer(chat_tokenizer)
    conversation = MULTI_TURN + [{"role": "assistant", "content": "second <|sep|> answer", "tool_calls": [
        {"function": {"name": "f", "arguments": {"x": [1, 2]}}}]}, {"role": "tool", "content": "ok"}]
    segments = render_conversation(conversation, thinking=thinking)
    ids, loss = ChatEncoder(tokenizer).encode(segments)
    text = rendered_text(segments)
    assert marker_text(ids, tokenizer) == text     # every segment tokenized, markers as single special tokens
    # the flagged tokens, as maximal runs, are the assistant's output spans of the rendered text
    runs = np.split(np.arange(ids.size), np.flatnonzero(np.diff(loss.astype(int))) + 1)
    flagged = [marker_text(ids[run], tokenizer) for run in runs if loss[run[0]]]
    assert flagged == ASSISTANT_OUTPUT.findall(text) and len(flagged) == 2
    # text that spells a marker stays text: <|sep|> inside the content is 7 byte tokens, not id 261
    assert text.count("<|sep|>") - 1 == int(np.sum(ids == tokenizer.special_tokens["<|sep|>"]))
    _, every = ChatEncoder(tokenizer).encode(segments, loss="all")
    assert every.all()


@pytest.mark.parametrize("messages, message", [
    ([{"role": "bot", "content": "x"}], "c:1: message 0 has unknown role 'bot'"),
    ([], "c:1: 'messages' must be a non-empty list"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "only text content parts"),
    ([{"role": "tool", "content": "x"}], "a tool result needs a 'name'"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], "tool call 1 needs a function name"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}], "must be a JSON object"),
])
def test_bad_messages_are_one_line_errors(messages, message):
    with pytest.raises(DataError, match=re.escape(message)):
        render_conversation(messages, where="c:1")


def test_tokenizer_without_markers_is_one_line_error():
    with pytest.raises(DataError, match=r"no special token <\|open\|>; K3's chat format needs"):
        ChatEncoder(ByteTokenizer())


REPLY_WITH_CALLS = {
    "role": "assistant", "reasoning_content": "look it up", "content": 'a "quoted" <|sep|> answer',
    "tool_calls": [
        {"type": "function", "function": {"name": "search", "arguments": '{"query": "x & \\"y\\"", "limit": 3, '
                                                                         '"exact": false, "tags": ["a"], "near": null}'}},
        {"type": "function", "function": {"name": 'we"ird&name', "arguments": {"nested": {"k": [1, 2.5]}}}},
        {"type": "function", "function": {"name": "raw", "arguments": "not json {"}},
    ],
}


@pytest.mark.parametrize("thinking", [True, False])
def test_parse_reply_inverts_the_rendering_of_a_reply_with_tool_calls(chat_tokenizer, thinking):
    encoder = ChatEncoder(load_tokenizer(chat_tokenizer))
    ids, _ = encoder.encode(reply_segments(REPLY_WITH_CALLS, thinking))
    reply = encoder.parse_reply(ids, thinking)
    assert reply.finished and not reply.malformed
    assert reply.content == REPLY_WITH_CALLS["content"]
    assert reply.reasoning == (REPLY_WITH_CALLS["reasoning_content"] if thinking else "")
    assert reply.tool_calls == [
        {"name": "search", "arguments": {"query": 'x & "y"', "limit": 3, "exact": False, "tags": ["a"], "near": None}},
        {"name": 'we"ird&name', "arguments": {"nested": {"k": [1, 2.5]}}},
        {"name": "raw", "arguments": "not json {"},
    ]
    again, _ = encoder.encode(reply_segments(reply.message(thinking), thinking))
    np.testing.assert_array_equal(again, ids)              # re-rendered: the same ids


def reply_ids(encoder, text):
    """Ids of a reply written as text with the four markers spelled out (after a thinking prompt)."""
    ids = []
    for piece in re.split(r"(<\|open\|>|<\|close\|>|<\|sep\|>|<\|end_of_msg\|>)", text):
        ids += [encoder.marker_ids[piece]] if piece in encoder.marker_ids else encoder.tokenizer.encode(piece)
    return ids


@pytest.mark.parametrize("text, malformed", [
    ('<|open|>call tool="f"<|sep|><|open|>argument key="n" type="number"<|sep|>seven<|close|>argument<|sep|>'
     "<|close|>call<|sep|>", "tool call 1: argument 'n' is not number JSON"),
    ('<|open|>call tool="f"<|sep|><|open|>argument key="n" type="number"<|sep|>"7"<|close|>argument<|sep|>'
     "<|close|>call<|sep|>", "tool call 1: argument 'n' is string, its tag says number"),
    ("<|open|>call<|sep|><|close|>call<|sep|>", "tool call 1: a call without a tool name"),
    ('<|open|>call tool="f"<|sep|><|open|>argument key="a"<|sep|>cut', "a tool call was cut short"),
    # raw json arguments that are JSON but not an object: rendering them again would fail
    ('<|open|>call tool="f"<|sep|><|open|>json type="object"<|sep|>[1, 2]<|close|>json<|sep|><|close|>call<|sep|>',
     "tool call 1: its json arguments are array, not an object"),
])
def test_malformed_tool_calls_are_reported_and_left_out(chat_tokenizer, text, malformed):
    encoder = ChatEncoder(load_tokenizer(chat_tokenizer))
    prefix = "<|close|>think<|sep|><|open|>response<|sep|>hi<|close|>response<|sep|><|open|>tools<|sep|>"
    reply = encoder.parse_reply(reply_ids(encoder, prefix + text), thinking=True)
    assert reply.malformed == [malformed] and reply.tool_calls == [] and reply.content == "hi"
    assert "tool_calls" not in reply.message()


def test_text_outside_the_channels_and_after_the_end_is_left_out(chat_tokenizer):
    encoder = ChatEncoder(load_tokenizer(chat_tokenizer))
    ids = reply_ids(encoder, "why<|close|>think<|sep|>stray<|open|>response<|sep|>yes<|close|>response<|sep|>"
                             "<|close|>message<|sep|><|end_of_msg|>more<|open|>response<|sep|>no")
    reply = encoder.parse_reply(ids, thinking=True)
    assert (reply.reasoning, reply.content, reply.finished) == ("why", "yes", True)
