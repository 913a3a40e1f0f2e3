"""Multi-process import through jax.distributed and its partial directory: two processes on
localhost (one coordinator, as the trainer is launched), each writing every other tensor, produce
the checkpoint one process does (every array and the sealed meta bit for bit); arrays are chunked
by their shards on the mesh the overrides name; the run restores onto that mesh on 8 (fake CPU)
devices, verified, with the same values. A process that fails stops the other at once and nothing
is left; a partial directory a killed import left is removed by the next import, one a live
import holds is not touched."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from k3jax.checkpoint import CHECKSUMS, latest_meta
from k3jax.convert.errors import ConvertError
from k3jax.convert.importer import import_checkpoint
from k3jax.convert.orbax_stream import StateReader
from k3jax.convert.processes import ImportGroup
from tests.convert.hf_configs import tiny_kimi_linear
from tests.convert.hf_fixtures import hf_tensors, write_checkpoint
from tests.convert.test_import_export import k3_config
from tests.sharding.test_multi_device import COORDINATION_TIMEOUTS, Job, free_port

MESH = ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"]


def convert(*args) -> Job:
    """``python -m k3jax.convert import ARGS``, its output in files (`Job`)."""
    return Job([sys.executable, "-m", "k3jax.convert", "import", *map(str, args)], {**os.environ, **COORDINATION_TIMEOUTS})


def processes(hf_dirs, run, *overrides) -> list[Job]:
    """One import as two processes of a jax.distributed run, process i reading ``hf_dirs[i]``."""
    address = f"127.0.0.1:{free_port()}"
    return [convert(hf_dirs[i], run, *overrides, "--coordinator-address", address, "--num-processes", 2,
                    "--process-id", i) for i in (1, 0)][::-1]


def finished(process: Job) -> str:
    _, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-3000:]
    return stderr


def leftovers(run):
    return sorted(path.name for path in run.parent.glob(f".{run.name}.partial*"))


def arrays(run):
    _, meta = latest_meta(run)
    reader = StateReader(run / "checkpoints" / "0")
    names = [tuple(part.strip("'") for part in name[2:-2].split("']['")) for name in meta[CHECKSUMS]]
    return {name: reader.read(*name) for name in names}, reader


@pytest.mark.slow
@pytest.mark.serial
def test_two_processes_import_what_one_does_and_the_run_restores_on_its_mesh(tmp_path):
    hf_dir = write_checkpoint(tmp_path / "hf", k3_config(), hf_tensors(k3_config(), seed=0, mxfp4=True))
    run = tmp_path / "run"
    finished(convert(hf_dir, run, *MESH))
    one = run.rename(tmp_path / "one_process")               # the same output path for both imports
    for process in processes([hf_dir, hf_dir], run, *MESH):
        finished(process)
    assert (run / "checkpoints" / "0" / "state" / "ocdbt.process_1").is_dir()
    assert leftovers(run) == []
    assert (run / "checkpoints/0/meta/metadata").read_bytes() == (one / "checkpoints/0/meta/metadata").read_bytes()
    expected, _ = arrays(one)
    got, reader = arrays(run)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=str(name))

    # chunks are the shards on the fsdp=2 x expert=2 x tensor=2 mesh: the embedding [vocab, d] is
    # split 2 ways over vocab (tensor) and 4 over d (fsdp x expert)
    vocab, width = expected["params", "embedding"].shape
    assert reader.array("params", "embedding").chunk_layout.read_chunk.shape == (vocab // 2, width // 4)

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    out = tmp_path / "restored.npz"
    result = subprocess.run([sys.executable, "-m", "tests.convert.programs.restore_on_mesh", str(run), str(out)],
                            capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["devices"] == 8 and report["split_arrays"] > 0
    with np.load(out) as restored:
        for name in restored.files:
            np.testing.assert_array_equal(restored[name], expected["params", name.replace("|", "/")])


@pytest.mark.slow
@pytest.mark.serial
def test_a_failing_process_stops_both_at_once_and_leaves_nothing(tmp_path):
    """Process 1 reads a copy of the checkpoint that is not the same (one more tensor): it stops
    once process 0 has claimed the partial directory, and process 0 stops seconds later, both with
    one line and status 1; the partial directory and its lock are gone."""
    hf = tiny_kimi_linear()
    tensors = hf_tensors(hf, seed=0)
    hf_dir = write_checkpoint(tmp_path / "hf", hf, tensors)
    other = write_checkpoint(tmp_path / "hf_other", hf, {**tensors, "vision_tower.patch_embed.proj.weight":
                                                         np.ones((4, 3), np.float32)})
    run = tmp_path / "run"
    primary, second = processes([hf_dir, other], run)
    _, second_err = second.communicate(timeout=600)
    second_done = time.monotonic()
    _, primary_err = primary.communicate(timeout=600)
    assert time.monotonic() - second_done < 20, primary_err[-2000:]
    assert (primary.returncode, second.returncode) == (1, 1), (primary_err[-2000:], second_err[-2000:])
    reason = "process 1: not the same tensor manifest (HF_DIR) as process 0"
    assert second_err.splitlines()[-1].startswith(f"k3jax-convert: error: {reason}; "), second_err[-2000:]
    assert primary_err.splitlines()[-1].startswith(f"k3jax-convert: error: import process 1 failed: {reason}; "), \
        primary_err[-2000:]
    assert "Traceback" not in primary_err + second_err
    assert not run.exists() and leftovers(run) == []


HOLD_PARTIAL = """
import pathlib, sys, time
from k3jax.convert.processes import PartialDirectory
partial = PartialDirectory(pathlib.Path(sys.argv[1]))
(partial.claim(print) / "half-written").write_text("x")
print("claimed", flush=True)
time.sleep(600)
"""


@pytest.mark.slow   # an import, and a process that holds a partial directory until it is killed
def test_a_killed_imports_partial_directory_is_removed_and_a_live_ones_kept(tmp_path):
    """While the process that claimed OUT_DIR's partial directory lives, an import of the same
    OUT_DIR stops with one line naming it and touches nothing; once it is killed (SIGKILL: no
    cleanup), the next import removes the directory, says so, and succeeds, leaving nothing."""
    hf = tiny_kimi_linear()
    hf_dir = write_checkpoint(tmp_path / "hf", hf, hf_tensors(hf, seed=0))
    run, partial = tmp_path / "run", tmp_path / ".run.partial-import"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_PARTIAL, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        with pytest.raises(ConvertError, match=rf"^another import \(pid {holder.pid} on host .*\) is writing {partial}"):
            import_checkpoint(hf_dir, run, log=print)
        assert (partial / "half-written").is_file() and not run.exists()
    finally:
        holder.kill()
        holder.wait()
    lines = []
    import_checkpoint(hf_dir, run, log=lines.append)
    assert any(line.startswith(f"removed {partial}, left by an import that is no longer running (pid {holder.pid}")
               for line in lines), lines
    assert (run / "config.yaml").is_file() and leftovers(run) == []


class FakeStore:
    """The two calls of jax.distributed's key-value client the group uses, over a dict."""

    def __init__(self):
        self.values = {}

    def key_value_set(self, key, value):
        if key in self.values:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        return [(key, value) for key, value in self.values.items() if key.startswith(prefix)]


def test_group_waits_for_values_and_stops_on_another_processes_failure():
    store = FakeStore()
    primary, second = ImportGroup(store, 0, 3), ImportGroup(store, 1, 3)
    primary.publish("ready", "print")
    assert second.wait(["ready"]) == ["print"]
    second.check()                                       # nobody failed
    second.fail("process 1: disk full")
    second.fail("again")                                 # a second report is ignored
    with pytest.raises(ConvertError, match=r"^import process 1 failed: process 1: disk full$"):
        primary.wait(["done/0"])
    second.check()                                       # its own failure does not stop it twice
    assert primary.wait_stopped(seconds=0.3) == [2]      # process 2 never reported
    ImportGroup(store, 2, 3).fail("stopped")
    assert primary.wait_stopped(seconds=0) == []


@pytest.mark.parametrize("args, words", [(["--num-processes", "2"], "needs --coordinator-address HOST:PORT"),
                                          (["--num-processes", "2", "--process-id", "2"], "must be in [0, 2), got 2"),
                                          (["--num-processes", "0"], "at least 1, got 0")])
def test_multi_process_arguments_are_checked_before_anything_starts(args, words, tmp_path, capsys):
    from k3jax.convert.cli import main

    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "run"), *args]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k3jax-convert: error: --") and words in lines[0], lines
