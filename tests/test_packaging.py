"""The wheel: k3jax with its launchers inside the package (``k3jax.train``, ``k3jax.eval``) and the
example configs as package data, installed into a fresh venv and run from an empty directory."""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow   # builds a wheel, a venv and trains in subprocesses

SOURCE_IGNORED = shutil.ignore_patterns(".git", "build", "dist", "runs", "*.egg-info", "__pycache__", ".pytest_cache",
                                        ".benchmarks", ".venv", "tests", "bench")
# The micro model of tests/train/micro.yaml, as overrides of the packaged tiny config.
MICRO = ["model.vocab_size=512", "model.d_model=32", "model.dense_width=64", "model.kda.num_heads=1",
         "model.kda.head_dim=16", "model.kda.implementation=reference", "model.mla.num_heads=1",
         "model.mla.q_lora_rank=16", "model.mla.kv_lora_rank=16", "model.mla.nope_head_dim=8",
         "model.mla.rope_head_dim=8", "model.mla.value_head_dim=8", "model.moe.expert_width=16",
         "model.moe.latent_dim=16", "data.seq_len=32", "data.num_pairs=4", "data.num_keys=16", "data.num_values=16",
         "data.noise_vocab_size=0", "train.batch_size=4", "train.eval_batches=1", "optimizer.name=adamw",
         "logging.progress=false", "train.compilation_cache=null"]


def expected_wheel_modules() -> set[str]:
    """Every module of the source tree, at the path the wheel must give it."""
    places = {"k3jax": "k3jax", "train": "k3jax/train", "eval": "k3jax/eval"}
    return {f"{places[top]}/{path.relative_to(ROOT / top).as_posix()}"
            for top in places for path in (ROOT / top).rglob("*.py") if "__pycache__" not in path.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """A wheel built from a clean copy of the source tree (no stale build/ of an earlier build)."""
    scratch = tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, scratch / "src", ignore=SOURCE_IGNORED)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                             str(scratch / "src"), "-w", str(scratch / "dist")], capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stderr
    (path,) = (scratch / "dist").glob("k3jax-*.whl")
    return path


def test_wheel_holds_everything_under_k3jax(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"k3jax"}
    assert expected_wheel_modules() <= names, sorted(expected_wheel_modules() - names)
    assert {f"k3jax/configs/{path.name}" for path in (ROOT / "configs").glob("*.yaml")} <= names
    for script, target in [("k3jax-train", "k3jax.train.cli:entry"), ("k3jax-eval", "k3jax.eval.cli:main"),
                           ("k3jax-plan", "k3jax.train.plan:main")]:
        assert f"{script} = {target}" in entry_points
    assert "Requires-Dist: tensorboard>=2.14; extra == \"tensorboard\"" in metadata   # the viewer
    assert "Requires-Dist: tensorboardX>=2.6; extra == \"tensorboard\"" in metadata   # the writer


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> pathlib.Path:
    """A fresh venv (dependencies from the system site-packages) with the wheel installed, ``bin/``."""
    directory = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(directory)], check=True, timeout=300)
    result = subprocess.run([str(directory / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
                             "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return directory / "bin"


def run_outside(bin_dir: pathlib.Path, cwd: pathlib.Path, *command: str) -> subprocess.CompletedProcess:
    """``command`` with the venv's scripts first on PATH, from ``cwd``, without the repository on sys.path."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return subprocess.run(list(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)


def test_console_scripts_work_from_any_directory(venv, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    where = run_outside(venv, empty, "python", "-c", "import k3jax.train.cli as m; print(m.__file__)")
    assert where.stdout.strip().startswith(str(venv.parent)), where.stdout + where.stderr
    assert run_outside(venv, empty, "python", "-c", "import train").returncode != 0   # no generic top-level name

    trained = run_outside(venv, empty, "k3jax-train", "tiny", "run_dir=runs/tiny", "train.steps=2", *MICRO)
    assert trained.returncode == 0, trained.stderr
    assert json.loads(trained.stdout.splitlines()[0])["step"] == 2
    again = run_outside(venv, empty, "k3jax-train", "configs/tiny.yaml", "run_dir=runs/tiny", "train.steps=3", *MICRO)
    assert again.returncode == 0 and "resumed from checkpoint 2" in again.stderr, again.stderr

    unknown = run_outside(venv, empty, "k3jax-train", "tinny", "train.steps=2")
    assert unknown.returncode == 2
    assert unknown.stderr.strip().splitlines() == [
        "error: config 'tinny': no such file, and not a packaged config (packaged: k3, kimi-linear-48b, tiny)"]

    evaluated = run_outside(venv, empty, "k3jax-eval", "runs/tiny", "--tasks", "mqar", "--seeds", "2",
                            "--out", "eval-out")
    assert evaluated.returncode == 0, evaluated.stderr
    assert (empty / "eval-out" / "report.json").is_file() and (empty / "eval-out" / "report.md").is_file()
    assert sorted(path.name for path in empty.iterdir()) == ["eval-out", "runs"]   # nothing written elsewhere
