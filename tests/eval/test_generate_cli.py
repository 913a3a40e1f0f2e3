"""``python -m eval.generate``: prompts of different lengths in one batch, one continuation per line;
bad input one line, status 2."""
import pytest

from eval.generate import main


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
