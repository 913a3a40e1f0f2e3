"""RL's inputs: prompt records (text and chat, rendered as the eval programs render them), rewards
(built-in and user functions) and the settings -- every bad one a one-line error before any compute."""
import json
import math
import signal
import sys
import time

import numpy as np
import pytest

from k3jax.config import ConfigError, SpeculationConfig, load_config, to_dict
from k3jax.data import DataError, PromptDataset, load_tokenizer
from k3jax.inference.chat import ChatTurns
from k3jax.training import rl
from k3jax.training.rewards import RewardError, check_records, load_reward, parse_number, score
from k3jax.training.signals import StopRequested, StopSignals
from tests.data.chat_tokenizer import write_chat_tokenizer
from tests.helpers import MICRO

TEXT = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(5)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_text_prompts_are_their_bytes_and_the_last_records_are_held_out(tmp_path):
    data = PromptDataset(write_jsonl(tmp_path / "p.jsonl", TEXT), 16, heldout_fraction=0.25)
    assert data.num_prompts("train") == 15 and data.num_prompts("heldout") == 5
    assert [p.record for _, p in data.heldout(10)] == TEXT[15:]
    index, prompt = data.prompts(0, 3)[1]
    assert index == 1 and prompt.tokens.tolist() == list(prompt.record["prompt"].encode()) and not data.chat
    assert data.stop_id == load_tokenizer(None).eos_id
    first_epoch = [p.record["prompt"] for step in range(5) for _, p in data.prompts(step, 3)]
    assert sorted(first_epoch) == sorted(r["prompt"] for r in TEXT[:15])          # a shuffled epoch
    assert first_epoch == [p.record["prompt"] for step in range(5) for _, p in data.prompts(step, 3)]
    resampled = [[p.record["prompt"] for step in range(5) for _, p in data.prompts(step, 3, resampling=r)]
                 for r in (1, 2)]                        # rl.resample_rounds' streams: epochs of their own
    assert all(sorted(stream) == sorted(first_epoch) for stream in resampled)
    assert len({tuple(first_epoch), *map(tuple, resampled)}) == 3
    assert data.prompts(4, 3, resampling=2) == data.prompts(4, 3, resampling=2)


def test_chat_prompts_render_like_the_chat_programs_with_the_end_of_message_stop(tmp_path):
    tokenizer = write_chat_tokenizer(tmp_path / "tok")
    records = [{"messages": [{"role": "user", "content": f"what is {a} + 1?"}], "answer": a + 1} for a in range(4)]
    data = PromptDataset(write_jsonl(tmp_path / "c.jsonl", records), 200, tokenizer_path=tokenizer,
                         heldout_fraction=0.25, thinking=False, thinking_effort=None)
    turns = ChatTurns(load_tokenizer(tokenizer), thinking=False, thinking_effort=None)
    for index, prompt in data.heldout(1) + data.prompts(0, 3):
        assert prompt.tokens.tolist() == turns.user_turn(prompt.record["messages"][0]["content"]).tolist()
        assert prompt.text == prompt.record["messages"][-1]["content"]
    assert data.chat and data.stop_id == turns.eos_id


def test_parquet_prompts_equal_their_jsonl(tmp_path):
    import pyarrow
    import pyarrow.parquet
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(TEXT), tmp_path / "p.parquet")
    jsonl = PromptDataset(write_jsonl(tmp_path / "p.jsonl", TEXT), 16)
    parquet = PromptDataset(tmp_path / "p.parquet", 16)
    assert [p.record for p in parquet.splits["train"]] == [p.record for p in jsonl.splits["train"]]
    assert parquet.content_hash() == jsonl.content_hash()


@pytest.mark.parametrize("records, words", [
    ([{"answer": "1"}], "'prompt' (text) or 'messages' (chat)"),
    ([{"prompt": "1+1=", "messages": [], "answer": "2"}], "'prompt' (text) or 'messages' (chat)"),
    ([{"prompt": "", "answer": "2"}], "'prompt' must be non-empty text"),
    ([{"prompt": "x" * 17, "answer": "2"}], "the prompt is 17 tokens, more than data.seq_len = 16"),
])
def test_bad_prompt_records_are_one_line_errors_naming_the_record(tmp_path, records, words):
    with pytest.raises(DataError, match="p.jsonl:1: ") as error:
        PromptDataset(write_jsonl(tmp_path / "p.jsonl", records), 16)
    assert words in str(error.value) and "\n" not in str(error.value)


def prompt(record, where="p.jsonl: line 3"):
    return type("Prompt", (), {"record": record, "where": where, "text": record.get("prompt", "")})()


@pytest.mark.parametrize("name, completion, answer, reward", [
    ("exact_match", " 12\n", "12", 1.0), ("exact_match", "12 apples", "12", 0.0), ("exact_match", "b", ["a", "b"], 1.0),
    ("contains", "it is 12 apples", "12", 1.0), ("contains", "it is 13", "12", 0.0),
    ("numeric", "so the total is 1,234.50", "1234.5", 1.0), ("numeric", "x = 3 then 12", 12, 1.0),
    ("numeric", "12.0000001", "12", 0.0), ("numeric", "no number", "12", 0.0), ("numeric", "-7", "-7", 1.0),
])
def test_built_in_rewards(name, completion, answer, reward):
    assert score(load_reward(name), prompt({"prompt": "q", "answer": answer}), completion) == reward


def test_parse_number_reads_the_last_number():
    assert parse_number("a 1 b 2,000 c") == 2000 and parse_number("1e3") == 1000.0 and parse_number("none") is None
    assert isinstance(parse_number("42"), int) and math.isclose(parse_number(".5"), 0.5)


def test_user_rewards_are_called_with_prompt_completion_and_record(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompt, completion, record):\n    return len(completion) * record['scale']\n"
        "def broken(prompt, completion, record):\n    raise KeyError('scale')\n"
        "def not_finite(prompt, completion, record):\n    return float('nan')\n"
        "VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    assert score(load_reward("my_rewards:length"), prompt({"scale": 0.5}), "abcd") == 2.0
    with pytest.raises(RewardError, match=r"^p.jsonl: line 3: the reward raised KeyError: 'scale'$"):
        score(load_reward("my_rewards:broken"), prompt({}), "x")
    with pytest.raises(RewardError, match=r"^p.jsonl: line 3: the reward is nan, not a finite number$"):
        score(load_reward("my_rewards:not_finite"), prompt({}), "x")
    for name, words in [("my_rewards:missing", "has no 'missing'"), ("my_rewards:VALUE", "is not callable"),
                        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
                        ("exactmatch", "neither built in nor of the form module:function")]:
        with pytest.raises(DataError, match=words):
            load_reward(name)


def test_a_built_in_reward_needs_every_answer():
    check_records("my:function", [prompt({"prompt": "x"})])
    with pytest.raises(DataError, match="p.jsonl: line 3: no 'answer' field"):
        check_records("numeric", [prompt({"prompt": "x", "answer": 1}), prompt({"prompt": "y"})])


GRPO = ["train.objective=grpo", "data.kind=prompts", "data.path=p.jsonl", "init_from=runs/sft"]


def test_a_reward_past_rl_reward_timeout_is_one_line_naming_the_record():
    def hangs(prompt_text, completion, record):
        try:
            time.sleep(60)
        except Exception:                      # a reward that swallows everything cannot swallow the timeout
            return 1.0
    started = time.monotonic()
    with pytest.raises(RewardError, match=r"^p.jsonl: line 3: the reward took longer than rl.reward_timeout=0.2 seconds$"):
        score(hangs, prompt({}), "x", timeout=0.2)
    assert time.monotonic() - started < 5
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)           # the timer and handlers restored
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
    assert score(lambda *args: 0.5, prompt({}), "x", timeout=5) == 0.5


def test_a_signal_inside_a_reward_call_stops_it_and_is_recorded():
    def waits_for_a_signal(prompt_text, completion, record):
        signal.raise_signal(signal.SIGTERM)      # as if sent while the reward hangs
        time.sleep(60)
    with StopSignals() as signals:
        started = time.monotonic()
        with pytest.raises(StopRequested, match="SIGTERM"):
            score(waits_for_a_signal, prompt({}), "x", timeout=None)
        assert signals.received == "SIGTERM" and time.monotonic() - started < 5


@pytest.mark.parametrize("overrides, key, words", [
    (GRPO + ["rl.group_size=1"], "rl.group_size", "at least 2"),
    (GRPO + ["rl.reward_timeout=0"], "rl.reward_timeout", "must be positive"),
    (GRPO[:3], "init_from", "set init_from=RUN_DIR"),
    (GRPO[1:], "train.objective", "data.kind=prompts goes with train.objective=grpo"),
    (GRPO[:1], "data.kind", "set data.kind=prompts"),
    (GRPO + ["train.grad_accum=3", "train.batch_size=3"], "train.grad_accum", "rl.prompts_per_step x rl.group_size = 64"),
    (GRPO + ["finetune.lora_rank=4", "finetune.lora_dropout=0.1"], "finetune.lora_dropout", "must be 0"),
    (GRPO + ["rl.top_p=0"], "rl.top_p", "(0, 1]"),
    (GRPO + ["rl.advantage=ppo"], "rl.advantage", "not one of"),
    (GRPO + ["rl.kl_coef=-1"], "rl.kl_coef", "non-negative"),
    (GRPO + ["rl.speculation.prompt_lookup=2", "rl.speculation.draft=runs/small"], "rl.speculation.draft", "not both"),
    (GRPO + ["rl.speculation.prompt_lookup=0"], "rl.speculation.prompt_lookup", "must be positive"),
    (GRPO + ["rl.speculation.prompt_lookup=2", "rl.speculation.k=0"], "rl.speculation.k", "must be positive"),
    (GRPO + ["rl.speculate_k=0"], "rl.speculation.k", "must be positive"),      # an earlier release's key
])
def test_bad_rl_settings_are_one_line_errors(overrides, key, words):
    with pytest.raises(ConfigError) as error:
        load_config(MICRO, overrides)
    assert error.value.key == key and words in str(error.value) and "\n" not in str(error.value)


def draft_saved_with(monkeypatch, config, vocab_size, tokenizer=None):
    """rl.speculation.draft's newest checkpoint, as `check_draft` reads it: ``config`` saved with
    this vocabulary size and tokenizer."""
    saved = to_dict(config)
    saved["model"]["vocab_size"], saved["data"]["tokenizer"] = vocab_size, tokenizer
    monkeypatch.setattr(rl, "latest_meta", lambda source: (3, {"config": saved}))


@pytest.mark.parametrize("vocab_offset, tokenizer, words", [
    (None, None, "no checkpoint in"),                  # nothing saved there
    (2, None, "share the target's vocabulary"),
    (0, "tok.model", "trained with tokenizer tok.model, the target with bytes"),
])
def test_a_bad_draft_is_a_one_line_error(tmp_path, monkeypatch, vocab_offset, tokenizer, words):
    config = load_config(MICRO, GRPO + [f"rl.speculation.draft={tmp_path / 'nowhere'}"])
    if vocab_offset is not None:
        draft_saved_with(monkeypatch, config, config.model.vocab_size + vocab_offset, tokenizer)
    with pytest.raises(ConfigError) as error:
        rl.check_draft(config)
    assert error.value.key == "rl.speculation.draft" and words in str(error.value) and "\n" not in str(error.value)


def test_a_draft_sharing_the_policys_vocabulary_restores_its_newest_step(monkeypatch):
    config = load_config(MICRO, GRPO + ["rl.speculation.draft=runs/small"])
    draft_saved_with(monkeypatch, config, config.model.vocab_size)
    assert rl.check_draft(config) == 3


def test_an_earlier_releases_speculation_keys_are_read_under_their_new_names():
    config = load_config(MICRO, GRPO + ["rl.prompt_lookup=3", "rl.speculate_k=2", "rl.speculate_rollback=replay"])
    assert config.rl.speculation == SpeculationConfig(prompt_lookup=3, k=2, rollback="replay")


def test_rows_of_an_update():
    config = load_config(MICRO, GRPO + ["rl.prompts_per_step=3", "rl.group_size=5"])
    assert config.rl.rows == 15 and np.isclose(config.rl.clip, 0.2)


def test_weighted_rewards_sum_per_completion_and_batch_functions(tmp_path, monkeypatch):
    from k3jax.config import RewardTermConfig
    from k3jax.training.rewards import load_rewards, score_completions
    from types import SimpleNamespace

    (tmp_path / "batch_rewards.py").write_text(
        "calls = []\n"
        "def short(prompts, completions, records):\n"
        "    calls.append(len(completions))\n"
        "    return [1.0 / (1 + len(c)) for c in completions]\n"
        "def wrong_length(prompts, completions, records):\n    return [0.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "batch_rewards", raising=False)
    terms = load_rewards(None, (RewardTermConfig("exact_match", 2.0), RewardTermConfig("batch_rewards:short", -0.5)))
    completions = [SimpleNamespace(prompt=prompt({"prompt": "1+1=", "answer": "2"}), text=text, reward=None,
                                   reward_terms={}) for text in ("2", "33", " 2 ")]
    score_completions(terms, completions)
    import batch_rewards
    assert batch_rewards.calls == [3]                               # once, on the whole batch
    for completion, exact in zip(completions, (1.0, 0.0, 1.0)):
        short = 1.0 / (1 + len(completion.text))
        assert completion.reward == 2.0 * exact - 0.5 * short
        assert completion.reward_terms == {"exact_match": exact, "batch_rewards:short": short}
    bad = load_rewards(None, (RewardTermConfig("batch_rewards:wrong_length"),))
    with pytest.raises(RewardError, match="p.jsonl: line 3: the reward batch_rewards:wrong_length returned list of 1, not a list of 3"):
        score_completions(bad, completions)
    default = load_rewards(None)
    assert [(t.name, t.weight, t.batched) for t in default] == [("exact_match", 1.0, False)]
    score_completions(default, completions[:1])
    assert completions[0].reward == 1.0


def test_math_reward_uses_math_verify():
    from k3jax.config import RewardTermConfig
    from k3jax.training.rewards import load_rewards, math_answer

    try:
        import math_verify  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match=r"^rl.rewards\[0\].name: the math reward needs math-verify: pip install 'k3jax\[math\]'$"):
            load_rewards(None, (RewardTermConfig("math"),))
        pytest.skip("math-verify is not installed (the optional extra k3jax[math])")

    assert math_answer("", "so the answer is $\\frac{1}{2}$", {"answer": "0.5"}) == 1.0
    assert math_answer("", "\\boxed{42}", {"answer": ["41", "42"]}) == 1.0
    assert math_answer("", "it is 41", {"answer": "42"}) == 0.0


def test_rewards_settings_are_refused_by_name():
    with pytest.raises(ConfigError, match="^rl.rewards: set rl.reward or rl.rewards, not both"):
        load_config(MICRO, [*GRPO, "rl.reward=contains", "rl.rewards=[{name: numeric}]"])
    with pytest.raises(ConfigError, match="^rl.rewards: a tool environment gives the reward"):
        load_config(MICRO, [*GRPO, "rl.environment=calculator", "rl.rewards=[{name: numeric, weight: 2}]"])
    with pytest.raises(ConfigError, match=r"^rl.overlong_penalty: must be in \[0, rl.max_new_tokens = 32\)"):
        load_config(MICRO, [*GRPO, "rl.overlong_penalty=32"])
    with pytest.raises(ConfigError, match="^rl.clip_low: must be below 1"):
        load_config(MICRO, [*GRPO, "rl.clip_low=1.5"])
    with pytest.raises(ConfigError, match="^rl.resample_rounds: refills the groups dynamic sampling leaves out; "
                                          "set rl.dynamic_sampling=true"):
        load_config(MICRO, [*GRPO, "rl.resample_rounds=2"])
    with pytest.raises(ConfigError, match="^rl.resample_rounds: must be non-negative, got -1"):
        load_config(MICRO, [*GRPO, "rl.dynamic_sampling=true", "rl.resample_rounds=-1"])
    config = load_config(MICRO, [*GRPO, "rl.clip_high=0.28", "rl.rewards=[{name: numeric}, {name: m:f, weight: 0.1}]"])
    assert config.rl.clip_range == (0.2, 0.28) and [t.weight for t in config.rl.rewards] == [1.0, 0.1]


class MemoryChannel:
    """A `k3jax.inference.mirror.Channel` in memory: what the leader sends, in order."""

    def __init__(self, leads: bool, messages: list):
        self.leads, self.messages = leads, messages

    def send(self, payload: bytes) -> None:
        self.messages.append(payload)

    def receive(self) -> bytes:
        return self.messages.pop(0)


def test_across_processes_the_leader_scores_and_the_followers_take_its_values(monkeypatch):
    """Several processes: process 0 calls the rewards once per completion, the others take its
    values (a reward with effects runs once; a nondeterministic one cannot split the update), and
    what stops the leader stops each follower with the same error."""
    from k3jax.config import RewardTermConfig
    from k3jax.training.rewards import RewardTerm, load_rewards, score_on_the_leader
    from types import SimpleNamespace

    calls = []

    def counted(prompt_text, completion, record):
        calls.append(completion)
        return float(len(calls))                    # a different value on each call: not recomputable

    def batch():
        return [SimpleNamespace(prompt=prompt({"prompt": "1+1=", "answer": "2"}), text=text, reward=None,
                                reward_terms={}) for text in ("2", "33", " 2 ")]

    terms = [RewardTerm("counted", 0.5, counted), *load_rewards(None, (RewardTermConfig("exact_match", 2.0),))]
    messages = []
    leader, follower = batch(), batch()
    score_on_the_leader(terms, leader, None, MemoryChannel(True, messages))
    score_on_the_leader(terms, follower, None, MemoryChannel(False, messages))
    assert calls == ["2", "33", " 2 "] and messages == []            # called on the leader only; all read
    assert [(c.reward, c.reward_terms) for c in follower] == [(c.reward, c.reward_terms) for c in leader]
    assert [c.reward for c in leader] == [0.5 * 1 + 2.0, 0.5 * 2, 0.5 * 3 + 2.0]
    alone = batch()
    score_on_the_leader(terms, alone, None, None)                    # one process: scored here
    assert [c.reward for c in alone] == [0.5 * 4 + 2.0, 0.5 * 5, 0.5 * 6 + 2.0]

    def fails(prompt_text, completion, record):
        raise RuntimeError("quota exhausted")

    for function, error, words in ((fails, RewardError, "p.jsonl: line 3: .*quota exhausted"),
                                   (signalled, StopRequested, None)):
        with pytest.raises(error, match=words) as raised:
            score_on_the_leader([RewardTerm("r", 1.0, function)], batch(), None, MemoryChannel(True, messages))
        with pytest.raises(error, match=words) as followed:
            score_on_the_leader([RewardTerm("r", 1.0, function)], batch(), None, MemoryChannel(False, messages))
        assert str(followed.value) == str(raised.value) and messages == []


def signalled(prompt_text, completion, record):
    raise StopRequested()
