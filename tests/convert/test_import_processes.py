"""Multi-process import and mesh chunk layouts: two processes, each writing every other tensor,
produce the checkpoint one process does (every array and the sealed meta bit for bit); arrays are
chunked by their shards on the mesh the overrides name; the run restores onto that mesh on 8
(fake CPU) devices, verified, with the same values."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from k3jax.checkpoint import CHECKSUMS, latest_meta
from k3jax.convert.orbax_stream import StateReader
from tests.convert.hf_fixtures import hf_tensors, write_checkpoint
from tests.convert.test_import_export import k3_config

MESH = ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"]


def convert(*args, **popen):
    return subprocess.Popen([sys.executable, "-m", "k3jax.convert", "import", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def finished(process):
    output, _ = process.communicate(timeout=900)
    assert process.returncode == 0, output


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
    processes = [convert(hf_dir, run, *MESH, "--num-processes", 2, "--process-id", i) for i in (1, 0)]
    for process in processes:
        finished(process)
    assert (run / "checkpoints" / "0" / "state" / "ocdbt.process_1").is_dir()
    assert not list(tmp_path.glob(".run.partial*"))
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
