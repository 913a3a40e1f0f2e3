"""K3's chat format in ``python -m eval.generate`` and ``python -m eval.chat``: the ids fed to the model
are the renderer's for the same messages, generation stops at ``<|end_of_msg|>``, the reply is printed
without markup; ``--raw`` keeps plain text. The model and the session store are stand-ins that record
what they are fed and answer with fixed replies (so no compilation); a slow test runs both
programs on a real chat checkpoint against greedy `k3jax.inference.generation` on the renderer's prompts."""
import io
from types import SimpleNamespace

import numpy as np
import pytest

import eval.chat
import eval.flags
import eval.generate
import k3jax.inference.generation
from k3jax.config import load_config
from k3jax.data import load_tokenizer
from k3jax.data.chat_format import ChatEncoder, generation_prompt, render_conversation, reply_segments
from k3jax.inference import LoadedRun, load_run
from k3jax.inference.chat import ChatTurns, chat_turns_for
from k3jax.sessions import SessionStore
from tests.data.chat_tokenizer import write_chat_tokenizer
from tests.helpers import CONFIGS, MICRO
from tests.train.test_chat_learning import SMALL
from k3jax.training import Trainer

CONVERSATIONS = CONFIGS / "chat" / "conversations.jsonl"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"))


def chat_config(tokenizer_dir, *overrides):
    return load_config("configs/tiny.yaml", ["data.kind=chat", "data.path=unused.jsonl", f"data.tokenizer={tokenizer_dir}",
                                             "model.vocab_size=512", *overrides])


def rendered(tokenizer_dir, messages, prompt=True) -> list[int]:
    """The renderer's ids for ``messages`` (thinking, effort max), followed by the generation prompt."""
    segments = render_conversation(messages) + (generation_prompt() if prompt else [])
    return ChatEncoder(load_tokenizer(tokenizer_dir)).encode(segments)[0].tolist()


def reply_ids(tokenizer_dir, text: str) -> list[int]:
    """What a model writes after the generation prompt (thinking on): an empty think channel, ``text``."""
    markers = ChatEncoder(load_tokenizer(tokenizer_dir)).marker_ids
    o, c, s, end = (markers[name] for name in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"))
    byte_ids = lambda string: list(string.encode())
    return [c, *byte_ids("think"), s, o, *byte_ids("response"), s, *byte_ids(text), c, *byte_ids("response"), s,
            c, *byte_ids("message"), s, end]


def test_turns_built_one_by_one_are_the_rendering_of_the_whole_conversation(tokenizer_dir):
    turns = ChatTurns(load_tokenizer(tokenizer_dir), thinking=True, thinking_effort="max")
    first, cut_short = reply_ids(tokenizer_dir, "three"), reply_ids(tokenizer_dir, "two")[:18]
    assert turns.reply_message(first + [65, 66]) == {"role": "assistant", "content": "three", "reasoning_content": ""}
    assert turns.reply_text(cut_short) == "t"                     # cut inside the response: the text so far
    assert turns.rendered_reply(first).tolist() == first          # a well-formed reply is the renderer's
    call = {"id": "c1", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    with_tools = turns.encoder.encode(reply_segments({"role": "assistant", "content": "ok", "tool_calls": [call]}))[0]
    assert turns.reply_text(with_tools) == "ok"                   # the tools channel is not part of the text
    history = (turns.user_turn("3 QWERTY").tolist() + turns.rendered_reply(first).tolist()
               + turns.user_turn("2 ASDF", first=False).tolist() + turns.rendered_reply(cut_short).tolist()
               + turns.user_turn("1 ZX", first=False).tolist())
    messages = [{"role": "user", "content": "3 QWERTY"}, {"role": "assistant", "content": "three"},
                {"role": "user", "content": "2 ASDF"}, {"role": "assistant", "content": "t"},
                {"role": "user", "content": "1 ZX"}]
    assert history == rendered(tokenizer_dir, messages)


def test_runs_get_the_chat_format_when_trained_on_chat_or_their_tokenizer_names_k3_markers(tokenizer_dir, tmp_path):
    plain_bpe = tmp_path / "plain.tiktoken"            # the same BPE file without K3's tokenizer_config.json
    plain_bpe.write_bytes((tokenizer_dir / "tiktoken.model").read_bytes())
    assert chat_turns_for(chat_config(tokenizer_dir)) is not None
    assert chat_turns_for(load_config("configs/tiny.yaml", [f"data.tokenizer={tokenizer_dir}"])) is not None  # imported K3
    assert chat_turns_for(load_config("configs/tiny.yaml", [])) is None
    assert chat_turns_for(load_config("configs/tiny.yaml", ["data.kind=text", "data.path=x.txt",
                                                            f"data.tokenizer={plain_bpe}"])) is None


class RecordingGenerate:
    """Stands in for `k3jax.inference.generation.generate`: records the prompts and eos id, answers ``reply`` and, as
    the real one does, ends each sample at the first ``eos_id`` (``lengths``) and fills the rest with it."""

    def __init__(self, reply: list[int]):
        self.reply, self.calls = reply, []

    def __call__(self, model, prompts, *, max_new_tokens, eos_id, **sampling):
        self.calls.append(([list(map(int, p)) for p in prompts], eos_id))
        tokens = np.full((len(prompts), max_new_tokens), eos_id, np.int32)
        tokens[:, :min(len(self.reply), max_new_tokens)] = self.reply[:max_new_tokens]
        ends = [self.reply.index(eos_id) + 1 if eos_id in self.reply[:max_new_tokens] else max_new_tokens] * len(prompts)
        return SimpleNamespace(tokens=tokens, lengths=np.asarray(ends))


def loaded(config, tmp_path) -> LoadedRun:
    return LoadedRun(model=None, config=config, meta={}, step=0, checkpoints=tmp_path, run_dir=tmp_path)


def test_generate_renders_a_user_turn_stops_at_end_of_msg_and_prints_the_reply(tokenizer_dir, tmp_path, monkeypatch,
                                                                                capsys):
    config = chat_config(tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    fake = RecordingGenerate(reply_ids(tokenizer_dir, "three") + list(b"<after the end>"))
    monkeypatch.setattr(eval.flags, "load_run", lambda path, step, mesh, dtype: loaded(config, tmp_path))
    monkeypatch.setattr(k3jax.inference.generation, "generate", fake)
    assert eval.generate.main(["run", "--prompt", "3 QWERTY", "--prompt", "1 ZX", "--max-new-tokens", "64"]) == 0
    assert capsys.readouterr().out.splitlines() == ["three", "three"]
    prompts, eos_id = fake.calls[-1]
    assert prompts == [rendered(tokenizer_dir, [{"role": "user", "content": text}]) for text in ("3 QWERTY", "1 ZX")]
    assert eos_id == tokenizer.special_tokens["<|end_of_msg|>"]

    assert eval.generate.main(["run", "--prompt", "3 QWERTY", "--raw", "--max-new-tokens", "4"]) == 0
    assert fake.calls[-1] == ([list(b"3 QWERTY")], tokenizer.eos_id)       # plain text, the tokenizer's EOS
    assert capsys.readouterr().out == tokenizer.decode(fake.reply[:4]) + "\n"


class RecordingStore:
    """Stands in for `k3jax.sessions.SessionStore` in eval.chat: keeps each session's tokens and answers
    each generate with the next of ``replies`` (stopping after eos_id, as the real one)."""

    replies: list[list[int]] = []
    made: list["RecordingStore"] = []

    def __init__(self, model):
        self.histories, self.eos_ids = {}, []
        self.made.append(self)

    def check_length(self, length):
        pass

    def open(self, tokens):
        self.histories[len(self.histories)] = list(map(int, tokens))
        return len(self.histories) - 1

    def append(self, sid, tokens):
        self.histories[sid] += list(map(int, tokens))

    def snapshot(self, sid):
        return list(self.histories[sid])

    def rollback(self, sid, snapshot):
        self.histories[sid] = list(snapshot)

    def generate(self, sids, max_new_tokens, *, eos_id, **sampling):
        self.eos_ids.append(eos_id)
        reply = self.replies.pop(0)[:max_new_tokens]
        reply = reply[:reply.index(eos_id) + 1] if eos_id in reply else reply
        self.append(sids[0], reply)
        return [np.asarray(reply, np.int32)]


def test_chat_session_holds_the_rendered_conversation(tokenizer_dir, tmp_path, monkeypatch):
    end = load_tokenizer(tokenizer_dir).special_tokens["<|end_of_msg|>"]
    # a well-formed reply (and a token after its end, never reached), one cut short inside its response,
    # and one the renderer would not write (it ends the message inside the think channel)
    RecordingStore.replies = [reply_ids(tokenizer_dir, "three") + [65], reply_ids(tokenizer_dir, "two")[:19],
                              list(b"hm") + [end]]
    monkeypatch.setattr(eval.flags, "load_run", lambda path, step, mesh, dtype: loaded(chat_config(tokenizer_dir), tmp_path))
    monkeypatch.setattr(eval.chat, "SessionStore", RecordingStore)
    out = io.StringIO()
    assert eval.chat.main(["run", "--sessions-dir", str(tmp_path)], stdin=io.StringIO("3 QWERTY\n2 AS\n1 ZX\n"),
                          stdout=out) == 0
    store = RecordingStore.made[-1]
    assert out.getvalue().splitlines() == ["three", "tw", ""] and store.eos_ids == [end] * 3
    messages = [{"role": "user", "content": "3 QWERTY"}, {"role": "assistant", "content": "three"},
                {"role": "user", "content": "2 AS"}, {"role": "assistant", "content": "tw"},
                {"role": "user", "content": "1 ZX"}, {"role": "assistant", "content": "", "reasoning_content": "hm"}]
    assert store.histories == {0: rendered(tokenizer_dir, messages, prompt=False)}


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, tokenizer_dir):
    """A chat run's checkpoint at initialisation (saved without compiling a training step); no thinking."""
    run_dir = tmp_path_factory.mktemp("chat_run")
    config = load_config(MICRO, SMALL + [f"run_dir={run_dir}", "data.kind=chat", f"data.path={CONVERSATIONS}",
                                         f"data.tokenizer={tokenizer_dir}", "data.seq_len=128",
                                         "data.chat_thinking=false", "data.chat_thinking_effort=null"])
    trainer = Trainer(config)
    trainer.save(force=True)
    trainer.checkpoints.wait()
    return run_dir


@pytest.mark.slow   # compiles the micro model's generate and the session store's decode
def test_generate_and_chat_on_a_chat_checkpoint_feed_the_rendered_conversation(chat_run, tokenizer_dir, monkeypatch,
                                                                               capsys):
    stores = []

    class RecordedStore(SessionStore):
        def __init__(self, model):
            super().__init__(model)
            stores.append(self)

    monkeypatch.setattr(eval.chat, "SessionStore", RecordedStore)
    out = io.StringIO()
    assert eval.chat.main([str(chat_run), "--max-new-tokens", "3"], stdin=io.StringIO("3 QWERTY\n1 ZX\n"), stdout=out) == 0
    # The expected replies: greedy k3jax.generate on the renderer's rendering of the conversation so far.
    encoder, model = ChatEncoder(load_tokenizer(tokenizer_dir)), load_run(str(chat_run)).model
    messages = []
    for text in ("3 QWERTY", "1 ZX"):
        messages.append({"role": "user", "content": text})
        prompt = encoder.encode(render_conversation(messages, thinking=False, thinking_effort=None)
                                + generation_prompt(False))[0]
        sample = k3jax.inference.generation.generate(model, prompt, max_new_tokens=3, eos_id=encoder.end_of_message_id)
        messages.append(encoder.reply_message(np.asarray(sample.tokens)[: int(sample.lengths)], thinking=False))
    assert out.getvalue() == "".join(m["content"] + "\n" for m in messages[1::2])
    whole = encoder.encode(render_conversation(messages, thinking=False, thinking_effort=None))[0]
    assert stores[0].tokens(0).tolist() == whole.tolist()

    assert eval.generate.main([str(chat_run), "--prompt", "3 QWERTY", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out == messages[1]["content"] + "\n"
