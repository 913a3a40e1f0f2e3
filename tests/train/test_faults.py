"""Fault injection, table-driven: every fault gets its one-line message, its exit status, the time
the process took to exit, and a proof that nothing was lost (the resumed run repeats the clean
run's losses bit for bit, the previous checkpoints still restore, the metrics are complete).

With K3JAX_FAULT_TABLE=path each case appends ``{case, status, seconds, message}`` to that JSON
lines file (the figures of the report)."""
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from k3jax.checkpoint import RunCheckpoints
from k3jax.config import load_config
from tests.helpers import MICRO, ROOT
from tests.train.test_cli import command, losses, wait_for_step
from k3jax.training import lay_out_run

pytestmark = pytest.mark.slow
LONG = ("train.steps=100000", "optimizer.schedule_steps=40", "checkpoint.every=100000")


def record(case: str, status: int, seconds: float, message: str) -> None:
    table = os.environ.get("K3JAX_FAULT_TABLE")
    if table:
        with open(table, "a", encoding="utf-8") as file:
            file.write(json.dumps({"case": case, "status": status, "seconds": round(seconds, 1),
                                   "message": message}) + "\n")


def timed_run(run_dir, cache, *overrides, env=None, timeout=600):
    started = time.perf_counter()
    result = subprocess.run(command(run_dir, cache, *overrides), cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout, env=env)
    return result, time.perf_counter() - started


PROGRESS = re.compile(r"step \d+/\d+ ")
# XLA's alarm when a compilation takes minutes (a loaded machine): a framed block of log lines
SLOW_COMPILE_ALARM = re.compile(r"[EW]\d{4} .*slow_operation_alarm\.cc|\*+$|\[Compiling module .*Very slow compile\?")


def error_lines(stderr: str) -> list[str]:
    """The lines of ``stderr`` but the progress log's ``step N/M ...`` lines and XLA's slow-compile alarm."""
    return [line for line in stderr.splitlines()
            if line.strip() and not PROGRESS.match(line) and not SLOW_COMPILE_ALARM.match(line)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One compilation cache for the module (K3JAX_TEST_XLA_CACHE: one kept across sessions)."""
    kept = os.environ.get("K3JAX_TEST_XLA_CACHE")
    return pathlib.Path(kept) if kept else tmp_path_factory.mktemp("xla-cache")


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, cache):
    """40 steps, checkpoints 20 and 40 (and 1): the reference every resumed run must repeat."""
    run_dir = tmp_path_factory.mktemp("clean")
    result, _ = timed_run(run_dir, cache)
    assert result.returncode == 0, result.stderr
    return run_dir


# -- corrupted checkpoints: the run falls back to checkpoint 20 and repeats steps 21-40 exactly ------

def flip_one_bit(run_dir: pathlib.Path, step: int, field: str) -> str:
    """Rewrite the stored arrays of ``step`` with one bit of one array of ``state.<field>`` flipped,
    keeping the metadata (and so the checksums) that were saved with it: silent corruption of that
    array's data on disk. Returns the array's name."""
    config = load_config(run_dir / "config.yaml")
    layout = lay_out_run(config)
    checkpoints = RunCheckpoints(run_dir / "checkpoints", read_only=True)
    state, meta = checkpoints.restore(step, layout.state)
    checkpoints.close()
    host = jax.device_get(state)
    part = getattr(host, field)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(part)
    index = next(i for i, (_, leaf) in enumerate(leaves) if np.asarray(leaf).dtype == np.float32 and np.any(leaf))
    path, leaf = leaves[index]
    flipped = np.array(leaf)
    flipped.reshape(-1).view(np.uint32)[0] ^= 1 << 7
    part = jax.tree_util.tree_unflatten(treedef, [flipped if i == index else v for i, (_, v) in enumerate(leaves)])
    scratch = run_dir.parent / f"{run_dir.name}-scratch"
    writer = RunCheckpoints(scratch, async_save=False)
    writer.save(step, host._replace(**{field: part}), meta, force=True)
    writer.wait()
    writer.close()
    shutil.rmtree(run_dir / "checkpoints" / str(step) / "state")
    shutil.move(scratch / str(step) / "state", run_dir / "checkpoints" / str(step) / "state")
    shutil.rmtree(scratch)
    return jax.tree_util.keystr(path)


def truncate_data_file(run_dir: pathlib.Path, step: int) -> str:
    files = [p for p in (run_dir / "checkpoints" / str(step) / "state").rglob("*") if p.is_file() and "d" in p.parts]
    largest = max(files, key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    return "checkpoint 40"


def delete_metadata(run_dir: pathlib.Path, step: int) -> str:
    (run_dir / "checkpoints" / str(step) / "state" / "_METADATA").unlink()
    return "checkpoint 40"


CORRUPTIONS = {
    "bit flip in params": (lambda run_dir: flip_one_bit(run_dir, 40, "params")),
    "bit flip in optimizer state": (lambda run_dir: flip_one_bit(run_dir, 40, "opt_state")),
    "truncated data file": (lambda run_dir: truncate_data_file(run_dir, 40)),
    "deleted metadata": (lambda run_dir: delete_metadata(run_dir, 40)),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupted_latest_checkpoint_falls_back_and_repeats_the_run_exactly(case, tmp_path, cache, clean_run):
    run_dir = shutil.copytree(clean_run, tmp_path / "run")
    named = CORRUPTIONS[case](run_dir)
    result, seconds = timed_run(run_dir, cache)
    assert result.returncode == 0, result.stderr
    lines = error_lines(result.stderr)
    assert lines[0].startswith("warning: ") and "checkpoint 40" in lines[0] and named in lines[0], result.stderr
    assert "falling back to checkpoint 20 (unusable: 40)" in result.stderr
    assert "moved checkpoints 40 (unusable)" in result.stderr
    assert "Traceback" not in result.stderr
    record(case, result.returncode, seconds, lines[0])
    assert (run_dir / "checkpoints-set-aside" / "40").is_dir()            # kept, not deleted
    assert losses(run_dir) == losses(clean_run)                           # steps 21-40 again, exactly
    checkpoints = RunCheckpoints(run_dir / "checkpoints", read_only=True)
    assert checkpoints.latest_step() == 40


def test_resume_step_picks_a_checkpoint_and_sets_the_newer_ones_aside(tmp_path, cache, clean_run):
    run_dir = shutil.copytree(clean_run, tmp_path / "run")
    result, seconds = timed_run(run_dir, cache, "train.resume_step=20")
    assert result.returncode == 0, result.stderr
    assert "moved checkpoints 40 (newer than train.resume_step)" in result.stderr
    assert "resumed from checkpoint 20" in result.stderr
    record("train.resume_step=20", result.returncode, seconds, error_lines(result.stderr)[0])
    assert losses(run_dir) == losses(clean_run)
    missing, _ = timed_run(run_dir, cache, "train.resume_step=7")
    assert missing.returncode == 2 and "no checkpoint for step 7" in missing.stderr
    assert len(error_lines(missing.stderr)) == 1


def test_a_resume_on_other_data_is_refused_with_the_difference_named_unless_allowed(tmp_path, cache, clean_run):
    run_dir = shutil.copytree(clean_run, tmp_path / "run")
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    result, seconds = timed_run(run_dir, cache, "data.seed=1")
    lines = error_lines(result.stderr)
    record("resume with other data settings", result.returncode, seconds, lines[0])
    assert result.returncode == 2 and len(lines) == 1
    assert "was trained on other data: data.seed: checkpoint 0, config 1" in lines[0]
    assert "train.allow_data_change=true" in lines[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    allowed, _ = timed_run(run_dir, cache, "data.seed=1", "train.allow_data_change=true")
    assert allowed.returncode == 0, allowed.stderr


def test_every_checkpoint_corrupted_is_one_line_and_nothing_changes(tmp_path, cache, clean_run):
    run_dir = shutil.copytree(clean_run, tmp_path / "run")
    for step_dir in (run_dir / "checkpoints").iterdir():
        (step_dir / "state" / "_METADATA").unlink()
    result, seconds = timed_run(run_dir, cache)
    lines = error_lines(result.stderr)
    record("every checkpoint corrupted", result.returncode, seconds, lines[0])
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: no usable checkpoint")
    assert "train.resume_step" in lines[0]
    assert not (run_dir / "checkpoints-set-aside").exists()


# -- two trainers, torn metrics, failed saves ----------------------------------------------------

def test_a_second_trainer_is_refused_and_the_first_loses_nothing(tmp_path, cache, clean_run):
    first = subprocess.Popen(command(tmp_path, cache, *LONG), cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    wait_for_step(first, tmp_path, 3)
    second, seconds = timed_run(tmp_path, cache, *LONG)
    lines = error_lines(second.stderr)
    record("two trainers", second.returncode, seconds, lines[0])
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert "in use by another trainer" in lines[0] and f"pid {first.pid}" in lines[0]
    wait_for_step(first, tmp_path, 6)
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=120)
    assert first.returncode == 0
    logged = losses(tmp_path)
    assert sorted(logged) == list(range(1, max(logged) + 1))          # every step of the first trainer
    assert all(logged[step] == losses(clean_run)[step] for step in range(1, 7))


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path, cache, clean_run):
    run_dir = shutil.copytree(clean_run, tmp_path / "run")
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as file:
        file.write('{"step": 41, "loss": 3.1')                           # what a crash mid-write leaves
    result, seconds = timed_run(run_dir, cache, "train.steps=42", "optimizer.schedule_steps=40")
    record("torn metrics line", result.returncode, seconds, error_lines(result.stderr)[0])
    assert result.returncode == 0, result.stderr
    logged = losses(run_dir)
    assert sorted(logged) == list(range(1, 43))
    assert {step: logged[step] for step in range(1, 41)} == losses(clean_run)


def _read_only_mount(path: pathlib.Path) -> str | None:
    """Make ``path`` read-only in place and return None, or return why that is impossible here.

    The tests run as root (as CI does), and permission bits do not stop root, so the only way to
    make a directory unwritable is a read-only bind mount: it needs root, mount(8) and the right to
    mount (a container without CAP_SYS_ADMIN lacks it). Where any of these is missing the caller
    skips with this reason; on this project's machines (root, mount allowed) both tests run."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "needs root and mount(8) to make a directory read-only"
    bind = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True, text=True)
    if bind.returncode:
        return f"mount --bind failed: {bind.stderr.strip()}"
    remount = subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], capture_output=True, text=True)
    if remount.returncode:
        subprocess.run(["umount", str(path)])
        return f"read-only remount failed: {remount.stderr.strip()}"
    return None


def test_a_save_into_a_read_only_directory_fails_fast_and_keeps_the_previous_checkpoint(tmp_path, cache):
    process = subprocess.Popen(command(tmp_path, cache, "train.steps=400", "optimizer.schedule_steps=40",
                                       "checkpoint.every=10", "checkpoint.async_save=true"),
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(process, tmp_path, 12)                                 # checkpoint 10 is on disk
    reason = _read_only_mount(tmp_path / "checkpoints")
    if reason:
        process.kill()
        pytest.skip(reason)
    try:
        started = time.perf_counter()
        _, stderr = process.communicate(timeout=120)
        seconds = time.perf_counter() - started
    finally:
        subprocess.run(["umount", str(tmp_path / "checkpoints")])
    lines = error_lines(stderr)
    record("read-only checkpoint dir mid-run", process.returncode, seconds, lines[-1])
    assert process.returncode == 2 and len(lines) == 1, stderr
    assert lines[0].startswith("error: saving") and "PERMISSION_DENIED" in lines[0]   # (cut to one line)
    assert seconds < 30
    checkpoints = RunCheckpoints(tmp_path / "checkpoints", read_only=True)
    assert checkpoints.latest_step() is not None              # the last complete save, intact
    checkpoints.restore(checkpoints.latest_step(), lay_out_run(load_config(tmp_path / "config.yaml")).state)


def test_a_read_only_run_directory_is_refused_before_anything_starts(tmp_path, cache, clean_run):
    run_dir = shutil.copytree(clean_run, tmp_path / "run")
    reason = _read_only_mount(run_dir)
    if reason:
        pytest.skip(reason)
    try:
        result, seconds = timed_run(run_dir, cache)
    finally:
        subprocess.run(["umount", str(run_dir)])
    lines = error_lines(result.stderr)
    record("read-only run dir", result.returncode, seconds, lines[0])
    assert result.returncode == 2 and len(lines) == 1 and "cannot write run directory" in lines[0]


# -- signals before, during and after compilation ----------------------------------------------------

def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a SIGTERM handler installed (bit 15 of SigCgt in /proc)."""
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    caught = int(re.search(r"SigCgt:\s*([0-9a-f]+)", status).group(1), 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _started(process, run_dir: pathlib.Path) -> bool:
    return _catches_sigterm(process.pid)                             # the CLI's first line ran: still importing


def _compiling(process, run_dir: pathlib.Path) -> bool:
    return (run_dir / "config.yaml").exists()                           # written just before the first step


def _trained(process, run_dir: pathlib.Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and max(losses(run_dir), default=0) >= 3


MOMENTS = {"before compilation": _started, "during compilation": _compiling, "after compilation": _trained}
# During compilation the signal lands in the first step's compile, or (on a loaded machine) just
# before the first step starts: the step is finished and saved, or nothing is, never half of it.
EXPECTED = {"before compilation": ("received while starting: stopped before training, nothing written",),
            "during compilation": ("received: saved checkpoint 1 in", "received: stopped before the first step"),
            "after compilation": ("received: saved checkpoint",)}


# SIGTERM at every moment; SIGINT, which `StopSignals` handles with the same handler, once (after
# compilation): each case is a training subprocess, two of them compiling from a cold cache.
SIGNAL_CASES = [(signal.SIGTERM, moment) for moment in MOMENTS] + [(signal.SIGINT, "after compilation")]


@pytest.mark.parametrize("sig, moment", SIGNAL_CASES, ids=[f"{sig.name}-{moment}" for sig, moment in SIGNAL_CASES])
def test_a_signal_at_any_moment_exits_cleanly(moment, sig, tmp_path, cache, tmp_path_factory):
    # During compilation: a fresh compilation cache, so that the first step really compiles.
    run_cache = tmp_path_factory.mktemp("cold-cache") if moment == "during compilation" else cache
    run_dir = tmp_path / "run"
    process = subprocess.Popen(command(run_dir, run_cache, *LONG, "logging.peak_tflops=1"), cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while not MOMENTS[moment](process, run_dir) and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    started = time.perf_counter()
    process.send_signal(sig)
    stdout, stderr = process.communicate(timeout=300)
    seconds = time.perf_counter() - started
    message = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    record(f"{sig.name} {moment}", process.returncode, seconds, message)
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr and "Segmentation" not in stderr, stderr
    assert message.startswith(sig.name) and any(e in message for e in EXPECTED[moment]), (stdout, stderr)
    if moment == "before compilation":
        assert not run_dir.exists()                                   # a failed start leaves nothing
        return
    if "nothing to save" in message:
        assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").iterdir())
        return
    saved = RunCheckpoints(run_dir / "checkpoints", read_only=True).latest_step()
    assert saved == max(losses(run_dir))                              # every logged step is saved


# -- eval restores onto whatever devices are present ----------------------------------------------

def _devices_env(count: int) -> dict:
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={count}",
            "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}


LOAD = ("import jax, sys; from k3jax.inference import load_run; run = load_run(sys.argv[1]); "
        "print(jax.device_count(), run.step)")
WRITE_TWO_DEVICE_CHECKPOINT = ("import sys; from k3jax.config import load_config; from k3jax.training import Trainer; "
                               "t = Trainer(load_config(sys.argv[1], sys.argv[2:])); t.save(force=True); "
                               "t.checkpoints.wait(); t.close()")


@pytest.mark.parametrize("written_on, read_on", [(1, 2), (2, 1)])
def test_eval_restores_a_checkpoint_written_on_another_device_count(written_on, read_on, tmp_path, cache, clean_run):
    if written_on == 1:
        run_dir = clean_run
    else:
        run_dir = tmp_path / "two-devices"
        subprocess.run([sys.executable, "-c", WRITE_TWO_DEVICE_CHECKPOINT, MICRO, f"run_dir={run_dir}",
                        "mesh.data=2", f"train.compilation_cache={cache}"], cwd=ROOT, check=True,
                       env=_devices_env(2), timeout=600, capture_output=True)
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", LOAD, str(run_dir)], cwd=ROOT, capture_output=True, text=True,
                            env=_devices_env(read_on), timeout=600)
    record(f"eval on {read_on} device(s) of a {written_on}-device checkpoint", result.returncode,
           time.perf_counter() - started, result.stdout.strip())
    assert result.returncode == 0, result.stderr
    devices, step = map(int, result.stdout.split())
    assert devices == read_on and step == RunCheckpoints(run_dir / "checkpoints", read_only=True).latest_step()
    assert result.stderr.strip() == ""                                 # quiet: no absl / Orbax notices
