"""Atomic writes and full disks (`k3jax.disk`): a failed write leaves the old file and no temporary
file; a full disk is recognised through the errors that wrap it, and eval's outputs report one in
one line after printing their results."""
import errno
import os

import pytest

from k3jax.disk import disk_full, free_space, write_atomically


def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_write_is_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    write_atomically(path, "old")
    write_atomically(path, b"new bytes")
    assert path.read_bytes() == b"new bytes"
    write_atomically(path, lambda file: file.write(b"by a writer"), unique=True)
    assert path.read_text() == "by a writer"

    def half_then_full(file):
        file.write(b"half")
        full()
    with pytest.raises(OSError) as failed:
        write_atomically(path, half_then_full)
    assert disk_full(failed.value) and path.read_text() == "by a writer" and os.listdir(tmp_path) == ["report.json"]
    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError):
        write_atomically(path, "never")
    assert path.read_text() == "by a writer" and os.listdir(tmp_path) == ["report.json"]


def test_a_full_disk_is_recognised_through_the_errors_that_wrap_it(tmp_path):
    try:
        try:
            full()
        except OSError as error:
            raise RuntimeError("RESOURCE_EXHAUSTED: Error writing state") from error
    except RuntimeError as wrapped:
        assert disk_full(wrapped)
    assert disk_full(ValueError("... Failed writing: No space left on device"))
    assert not disk_full(OSError(errno.EACCES, "Permission denied"))
    assert free_space(tmp_path / "not" / "yet").endswith(("bytes", "KiB", "MiB", "GiB"))


def test_eval_outputs_on_a_full_disk_are_one_line_and_leave_nothing(tmp_path, monkeypatch):
    from eval import cli
    from k3jax.inference import InputError
    report = {"tasks": {}, "plots": {}}
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(InputError, match=r"^cannot write the report into .*: no space left on device \(.* free\); "
                                         r"the results are above$"):
        cli.write_outputs(report, [], 0, tmp_path)
    assert os.listdir(tmp_path) == []


def test_prepare_on_a_full_disk_is_one_line(tmp_path, monkeypatch, capsys):
    from k3jax.data import prepare as prepare_module
    assert disk_full(OSError("240001 requested and 23520 written"))        # NumPy's short write
    monkeypatch.setattr(prepare_module, "prepare", full)
    assert prepare_module.main([str(tmp_path / "corpus.txt"), str(tmp_path / "out")]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"prepare: error: cannot write {tmp_path / 'out'}: no space left on device (")


def test_a_metrics_line_on_a_full_disk_is_one_line(tmp_path):
    from k3jax.training import RunError
    from k3jax.training.metrics import MetricsLog
    log = MetricsLog(tmp_path / "metrics.jsonl", 0)
    log.write({"step": 1, "loss": 2.0})

    class FullFile:
        def __init__(self, file):
            self.file = file

        def write(self, text):
            full()

        def close(self):
            self.file.close()
            full()
    log._file = FullFile(log._file)
    with pytest.raises(RunError, match=r"^writing .*metrics.jsonl failed: no space left on device \(.* free\); "
                                       r"the checkpoints saved so far are kept: make room and run again to resume$"):
        log.write({"step": 2, "loss": 1.0})
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'
