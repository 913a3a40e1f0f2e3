"""Every command in README.md's ```bash blocks, run as written, in order, from a scratch copy of the
repository (a fresh clone's files) with ``HOME`` in the scratch directory, so ``~/hf/...`` are the
tiny release-format checkpoints this test writes there and ``~/.cache`` starts empty.

A command that cannot run as written in CI is in `SUBSTITUTIONS` with what runs instead and why;
the test fails when a README command is neither runnable nor listed, or a listed one left the README.
Each command must exit 0 and leave the files `EXPECTED` names. ``pytest -q -m slow tests/test_readme.py -s``
prints each command's exit status and seconds.
"""
import json
import os
import pathlib
import re
import shutil
import subprocess
import time

import pyarrow
import pyarrow.parquet
import pytest

from tests.convert.hf_configs import tiny_k3
from tests.convert.hf_fixtures import hf_tensors, write_checkpoint, write_tokenizer
from tests.convert.test_bad_input import small_config
from tests.helpers import ROOT

pytestmark = pytest.mark.readme   # its own set (pytest -m readme): the README's main job alone trains for ~3 minutes

COPY_IGNORED = shutil.ignore_patterns(".git", "build", "dist", "runs", "*.egg-info", "__pycache__", ".pytest_cache",
                                      ".benchmarks", ".venv", "tests")

# README command (comment removed) -> (what runs instead, or None for nothing, and why).
SUBSTITUTIONS = {
    'pip install -e ".[parquet]" && python -m train configs/tiny.yaml': (
        "python -m train configs/tiny.yaml",
        "the install is .ci/run's first step; from a test it would repoint the environment at the scratch copy"),
    'pip install -e ".[test]" && pytest -q': (
        None, ".ci/run installs the test extra and runs `pytest -q` itself (running it here would recurse)"),
    "python -m train CONFIG [dotted.key=value ...]": (
        "python -m train --help", "a synopsis with placeholders; its usage text is checked instead"),
    "python -m train configs/tiny.yaml run_dir=runs/a train.steps=3000 optimizer.name=adamw": (
        "python -m train configs/tiny.yaml run_dir=runs/a train.steps=30 optimizer.name=adamw",
        "3000 AdamW steps take ~6 minutes on 2 cores; 30 run the same code (and runs/a feeds the next command)"),
    "XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m train configs/tiny.yaml run_dir=runs/sharded "
    "mesh.data=2 mesh.expert=4 mesh.moe_dispatch=capacity": (
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m train configs/tiny.yaml run_dir=runs/sharded "
        "mesh.data=2 mesh.expert=4 mesh.moe_dispatch=capacity train.steps=8 checkpoint.every=4",
        "1600 steps on 8 fake devices take far longer than CI allows; 8 steps run the same sharded step and saves"),
    "python -m train configs/tiny.yaml --coordinator-address host0:1234 --num-processes 2 --process-id 0": (
        None, "needs a second host; its localhost equivalent (two processes, --coordinator-address "
              "127.0.0.1:PORT --num-processes 2 --process-id 0/1) runs in tests/sharding/test_multi_device.py"),
    "python -m k3jax.convert import ~/hf/Kimi-K3 runs/k3-import --coordinator-address host0:1234 --num-processes 2 "
    "--process-id 0": (
        None, "needs a second host; its localhost equivalent (two processes of one jax.distributed run) runs in "
              "tests/convert/test_import_processes.py"),
    'pip install -e ".[tpu]"': (
        None, "CI does not install libtpu (README: it slows every process's start where JAX_PLATFORMS is unset), "
              "and from a test it would repoint the environment at the scratch copy"),
    "python -m train.plan configs/tiny.yaml --tpu v5e:2x2 mesh.fsdp=4 optimizer.name=adamw": (
        None, "needs libtpu (the tpu extra); tests/test_tpu.py compiles this step where it is installed"),
    "python -m train.plan configs/kimi-linear-48b.yaml --tpu v6e:4x4 mesh.fsdp=4 mesh.expert=4 mesh.moe_dispatch=capacity "
    "train.batch_size=16 data.seq_len=4096 model.remat=full finetune.lora_rank=16 model.moe.expert_format=mxfp4 "
    "optimizer.name=adamw": (
        None, "needs libtpu, and the TPU compiler takes 40 minutes over it on 2 cores"),
    "python -m eval.plan configs/kimi-linear-48b.yaml --tpu v6e:2x2 --mesh tensor=4 --dtype bfloat16 --batch 8 "
    "--context 8192": (None, "needs libtpu (the tpu extra)"),
    "python -m bench.tpu_compile": (None, "needs libtpu, and compiles 80 programs (an hour on 2 shared cores)"),
    "python -m eval.serve runs/chat --port 8000 --api-key secret --state-dir serve-state": (
        None, "a server runs until it is stopped; tests/serve/test_server_process.py starts it as a process and "
              "drives it with the openai client"),
    "python -m eval.serve runs/base --lora math=runs/math-lora --lora chat=runs/chat-lora --max-loras 4 "
    "--runtime-lora-updates --api-key secret": (
        None, "a server runs until it is stopped, over LoRA runs of a base; tests/serve/test_adapters.py serves the "
              "same flags in process and tests/sharding/test_inference_processes.py as processes"),
    'curl -H "Authorization: Bearer secret" -H "Content-Type: application/json" -d \'{"lora_name": "code", '
    '"lora_path": "runs/code-lora"}\' http://127.0.0.1:8000/v1/load_lora_adapter': (
        None, "talks to the server above; tests/serve/test_adapters.py posts the same body"),
}

# README command prefix -> files (relative to the scratch copy; ~ is the scratch HOME) it must leave.
EXPECTED = {
    "python -m train configs/tiny.yaml\0": ["runs/default/summary.json", "runs/default/checkpoints/1200",
                                            "runs/default/checkpoints/1600"],
    "python -m train configs/tiny.yaml run_dir=runs/a": ["runs/a/summary.json"],
    "python -m train configs/tiny.yaml run_dir=runs/ft": ["runs/ft/summary.json"],
    "python -m train configs/tiny.yaml run_dir=runs/chat": ["runs/chat/summary.json"],
    "python -m eval runs/chat": ["runs/chat/eval/report.json"],
    "python -c \"import pyarrow.json": ["chat.parquet"],
    "python -m train configs/tiny.yaml run_dir=runs/chat-parquet": ["runs/chat-parquet/summary.json"],
    "printf '3 QWERTY\\n1 ZXCVB\\n' | python -m eval.chat runs/chat": ["runs/chat/sessions"],
    "python -m train configs/tiny.yaml run_dir=runs/text": ["runs/text/summary.json"],
    "python -m train configs/tiny.yaml run_dir=runs/jsonl": ["runs/jsonl/summary.json"],
    "python -m train configs/tiny.yaml run_dir=runs/parquet": ["runs/parquet/summary.json"],
    "python -m k3jax.data.prepare": ["runs/notes-tokens/index.json"],
    "python -m train configs/tiny.yaml run_dir=runs/tokens": ["runs/tokens/summary.json"],
    "XLA_FLAGS": ["runs/sharded/summary.json"],
    "python -m eval runs/default\0": ["runs/default/eval/report.json", "runs/default/eval/report.md"],
    "python -m eval runs/default --step 1200": ["/tmp/eval/report.json"],
    "python -m eval runs/default --tasks perplexity": ["runs/default/eval/report.json"],
    "python -m k3jax.convert import ~/hf/Kimi-Linear": ["runs/kimi-linear/config.yaml", "runs/kimi-linear/checkpoints/0"],
    "python -m eval runs/kimi-linear": ["runs/kimi-linear/eval/report.json"],
    "python -m train runs/kimi-linear/config.yaml": ["runs/kimi-ft/summary.json"],
    "python -m k3jax.convert export runs/kimi-ft": ["~/hf/my-kimi-linear/model.safetensors.index.json"],
    "python -m k3jax.convert import ~/hf/Kimi-K3 runs/k3-import": ["runs/k3-import/checkpoints/0"],
    "python -m k3jax.convert import ~/hf/Kimi-K3 runs/k3-base": ["runs/k3-base/checkpoints/0"],
    "python -m train runs/k3-base/config.yaml": ["runs/k3-qlora/summary.json", "runs/k3-qlora/checkpoints/4"],
    "python -m k3jax.convert export runs/k3-qlora": ["~/hf/my-k3-qlora/model.safetensors.index.json"],
    "python -m k3jax.convert export runs/k3-import": ["~/hf/my-k3/model.safetensors.index.json"],
    "python -m k3jax.convert export runs/lora ~/hf/my-lora-adapter --adapter": [
        "~/hf/my-lora-adapter/adapter_config.json", "~/hf/my-lora-adapter/adapter_model.safetensors"],
    "python -m k3jax.convert import-adapter": ["runs/lora-peft/config.yaml", "runs/lora-peft/checkpoints/0"],
    "python -m k3jax.convert config": ["kl.yaml"],
}

# README command prefix -> what its standard output must say (the README promises it; for the memory
# plans, the totals of the tables the README prints, so that those stay current).
EXPECTED_STDOUT = {"python -m train configs/tiny.yaml\0": "held-out MQAR recall",
                   "python -m train --help\0": "usage: python -m train",
                   "python -m eval.plan configs/kimi-linear-48b.yaml": "56.988 GiB   weights + sessions",
                   "python -m eval.plan k3 ": "55.713 GiB   weights + sessions"}


def readme_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks: continuation lines joined, trailing comments removed."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = " ".join(re.sub(r"\s+#\s.*$", "", line).split())
            if command:
                commands.append(command)
    return commands


COMMANDS = readme_commands((ROOT / "README.md").read_text(encoding="utf-8"))


def expected_files(command: str) -> list[str]:
    return [path for prefix, paths in EXPECTED.items()
            if (command + "\0").startswith(prefix) for path in paths]


def test_every_substitution_names_a_readme_command():
    assert set(SUBSTITUTIONS) <= set(COMMANDS), sorted(set(SUBSTITUTIONS) - set(COMMANDS))


def write_inputs(root: pathlib.Path, home: pathlib.Path) -> None:
    """The files the README's commands name: notes/, notes.txt, notes.jsonl, parquet/*.parquet,
    held_out.txt, prompts.txt and the two Hugging Face checkpoints under ~/hf."""
    passage = ("The heat of the day broke at last; the thin thread of the river ran on. "
               "Notes on the model: KDA keeps a matrix of memory per head, MLA a latent cache. ")
    (root / "notes").mkdir()
    for index in range(12):
        (root / "notes" / f"note{index:02d}.txt").write_text(passage * (3 + index % 4), encoding="utf-8")
    (root / "notes.txt").write_text(passage * 40, encoding="utf-8")
    records = [{"text": passage * (1 + index % 3), "id": index} for index in range(30)]
    (root / "notes.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    (root / "parquet").mkdir()
    for part in range(2):
        pyarrow.parquet.write_table(pyarrow.table({"text": [r["text"] for r in records[part::2]]}),
                                    root / "parquet" / f"notes-{part}.parquet")
    (root / "held_out.txt").write_text(("Held-out text, never trained on: " + passage) * 20, encoding="utf-8")
    (root / "prompts.txt").write_text("The heat of\nNotes on the\n", encoding="utf-8")
    kimi_linear = write_checkpoint(home / "hf" / "Kimi-Linear-48B-A3B-Instruct", small_config(),
                                   hf_tensors(small_config(), seed=1))
    write_tokenizer(kimi_linear)
    write_checkpoint(home / "hf" / "Kimi-K3", tiny_k3(), hf_tensors(tiny_k3(), seed=2, mxfp4=True, padded_a_log=256))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    """``(scratch copy of the repository, environment)`` with the README's inputs in place."""
    scratch = tmp_path_factory.mktemp("readme")
    root, home = scratch / "k3jax", scratch / "home"
    shutil.copytree(ROOT, root, ignore=COPY_IGNORED)
    home.mkdir()
    write_inputs(root, home)
    shutil.rmtree("/tmp/eval", ignore_errors=True)   # the README's --out /tmp/eval: no earlier report counts
    env = {key: value for key, value in os.environ.items() if not key.startswith(("XLA_", "JAX_"))}
    env.update(HOME=str(home), PYTHONPATH=str(root))
    return root, env


def command_id(index: int, command: str) -> str:
    """``c07-python-m-train.plan-configs-k3.yaml`` (for ``-k c07``)."""
    return f"c{index:02d}-" + "-".join(re.findall(r"[\w.]+", command))[:50]


@pytest.mark.parametrize("command", COMMANDS, ids=[command_id(i, c) for i, c in enumerate(COMMANDS)])
def test_readme_command(workspace, command):
    root, env = workspace
    replacement, reason = SUBSTITUTIONS.get(command, (command, None))
    if replacement is None:
        pytest.skip(f"not run here: {reason}")
    started = time.perf_counter()
    result = subprocess.run(["bash", "-c", replacement], cwd=root, env=env, capture_output=True, text=True,
                            timeout=3600)   # the main job takes ~10 min on 2 idle cores, far longer under load
    seconds = time.perf_counter() - started
    print(f"\n[readme] exit {result.returncode} in {seconds:.0f} s: {replacement}")
    assert result.returncode == 0, f"{replacement}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    for prefix, words in EXPECTED_STDOUT.items():
        if (replacement + "\0").startswith(prefix):
            assert words in result.stdout, result.stdout[-2000:]
    for name in expected_files(replacement):
        path = pathlib.Path(env["HOME"], name[2:]) if name.startswith("~/") else root / name
        assert path.exists(), f"{replacement} did not write {name}"
