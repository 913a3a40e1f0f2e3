"""``python -m eval.generate``: prompts of different lengths in one batch, one continuation per line;
bad input one line, status 2."""
import argparse
import io

import pytest

from eval.generate import main
from eval.flags import add_speculation_flags, speculation_settings
from k3jax.config import SpeculationConfig


def test_prompts_of_different_lengths_get_one_line_each(untrained_run, capsys):
    status = main([str(untrained_run.path), "--prompt", "3 4 5", "--prompt", "6", "--max-new-tokens", "2",
                   "--temperature", "0.7", "--top-p", "0.9", "--seed", "1"])
    out = capsys.readouterr()
    assert status == 0, out.err
    lines = out.out.splitlines()
    assert len(lines) == 2 and all(len(line.split()) == 2 for line in lines)
    assert all(0 <= int(i) < untrained_run.config.model.vocab_size for line in lines for i in line.split())
    assert out.err == ""                                     # quiet restore


@pytest.mark.parametrize("args, message", [
    (["--prompt", "a b"], "space-separated integers"),
    (["--prompt", "3 999"], "token ids must be in [0, 64)"),
    (["--prompt-file", "/no/such/file"], "--prompt-file"),
    (["--prompt", "3", "--max-new-tokens", "0"], "max_new_tokens"),
    ([], "one of the arguments --prompt --prompt-file is required"),
])
def test_bad_input_is_one_line_and_status_2(args, message, untrained_run, capsys):
    status = main([str(untrained_run.path), *args])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_a_generation_beyond_the_devices_memory_is_one_line_before_it_runs(untrained_run, capsys, monkeypatch):
    """The memory bank alone fits (the shape check passes); the whole program does not (XLA's
    memory analysis of the compiled program, the one the first test ran): one line, status 2."""
    import k3jax.inference.generation as generation
    from k3jax.memory import memory_bytes

    bank = 2 * sum(memory_bytes(untrained_run.config.model, 8 + 2 - 1).values())
    monkeypatch.setattr(generation, "memory_limit", lambda: bank + 1)
    status = main([str(untrained_run.path), "--prompt", "3 4 5", "--prompt", "6", "--max-new-tokens", "2",
                   "--temperature", "0.7", "--top-p", "0.9", "--seed", "1"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert "max_new_tokens=2: the generation needs" in err and "more than the device holds" in err


def test_a_chat_whose_replies_cannot_fit_is_one_line_before_any_turn(untrained_run, capsys):
    from eval.chat import main as chat

    stdout = io.StringIO()
    assert chat([str(untrained_run.path), "--max-new-tokens", str(10**12)], io.StringIO("3 4\n"), stdout) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --max-new-tokens 1000000000000: a session of") and stdout.getvalue() == ""


@pytest.mark.slow     # compiles the verify and replay programs
@pytest.mark.parametrize("flags", [["--prompt-lookup", "2"], ["--draft", "RUN", "--speculate-k", "3"]])
def test_speculative_greedy_prints_what_greedy_prints(flags, untrained_run, capsys):
    prompts = ["--prompt", "3 4 5 3 4 5 3 4", "--prompt", "6", "--max-new-tokens", "6"]
    assert main([str(untrained_run.path), *prompts]) == 0
    plain = capsys.readouterr().out
    flags = [str(untrained_run.path) if flag == "RUN" else flag for flag in flags]    # the run as its own draft
    assert main([str(untrained_run.path), *prompts, *flags]) == 0
    assert capsys.readouterr().out == plain


def test_speculative_chat_answers_what_plain_chat_answers(untrained_run, capsys):
    from eval.chat import main as chat

    turns = "3 4 5 3 4 5\n6 7\n/rollback\n6 7\n"
    replies = []
    for flags in ([], ["--prompt-lookup", "2"]):
        stdout = io.StringIO()
        assert chat([str(untrained_run.path), "--max-new-tokens", "4", *flags], io.StringIO(turns), stdout) == 0
        replies.append(stdout.getvalue())
    assert replies[1] == replies[0] and len(replies[0].splitlines()) == 4


def test_speculation_flags_make_the_speculation_they_name():
    parser = argparse.ArgumentParser()
    add_speculation_flags(parser)
    args = parser.parse_args(["--prompt-lookup", "3", "--speculate-k", "2", "--speculate-rollback", "replay"])
    assert speculation_settings(args) == SpeculationConfig(prompt_lookup=3, k=2, rollback="replay")
    assert speculation_settings(parser.parse_args(["--prompt-lookup", "3"])) == SpeculationConfig(prompt_lookup=3)
    assert speculation_settings(parser.parse_args(["--draft", "d", "--no-speculate-adaptive"])) == \
        SpeculationConfig(draft="d", adaptive=False)
    assert speculation_settings(parser.parse_args([])) is None


@pytest.mark.parametrize("args, message", [
    (["--prompt-lookup", "2", "--draft", "x"], "--draft: drafts come from prompt_lookup or a draft model, not both"),
    (["--prompt-lookup", "0"], "--prompt-lookup: must be positive, got 0"),
    (["--prompt-lookup", "2", "--speculate-k", "0"], "--speculate-k: must be positive, got 0"),
    (["--speculate-k", "2"], "--speculate-k needs --prompt-lookup or --draft"),
    (["--speculate-rollback", "replay", "--speculate-k", "2"],
     "--speculate-k and --speculate-rollback need --prompt-lookup or --draft"),
    (["--prompt-lookup", "2", "--speculate-rollback", "undo"], "invalid choice: 'undo'"),
    (["--draft", "/no/such/run"], "/no/such/run"),
])
def test_bad_speculation_flags_are_one_line_and_status_2(args, message, untrained_run, capsys):
    status = main([str(untrained_run.path), "--prompt", "3", *args])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and message in err, err
