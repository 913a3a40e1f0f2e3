"""A model run by two processes of 4 devices each (one jax.distributed system, ``--mesh
expert=4,tensor=2`` over its 8 devices) gives what one process on one device gives:
``eval.generate``'s tokens, ``eval``'s perplexity and ``eval.chat``'s transcript with /fork and
/rollback. Process 0 prints and writes; process 1 runs the same steps silently."""
import json

import pytest

from k3jax.training import Trainer
from tests.serve.conftest import CHAT
from tests.sharding.programs.common import small_k3_config
from tests.sharding.test_multi_device import LOAD_TIMEOUTS, free_port, start

pytestmark = [pytest.mark.slow, pytest.mark.serial]

MESH = ("--mesh", "expert=4,tensor=2")
EXPERTS = "model.moe.num_experts=8"
SCRIPT = "3 QWERTY\nand again\n/fork\nsomething else\n/rollback\n/sessions\nlast one\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(an MQAR run trained 3 steps, an untrained chat run), both with 8 experts and 2 heads a mixer."""
    root = tmp_path_factory.mktemp("runs")
    Trainer(small_k3_config(f"run_dir={root / 'mqar'}", "train.steps=3", "train.eval_batches=0", EXPERTS)).run()
    Trainer(small_k3_config(f"run_dir={root / 'chat'}", *CHAT, "data.chat_thinking=false", EXPERTS)).save(force=True)
    return root / "mqar", root / "chat"


def one_process(args, stdin_path=None) -> str:
    job = start(python_stdout(args), devices=1, stdin=stdin_path)
    out, err = job.communicate(timeout=900)
    assert job.returncode == 0, err[-3000:]
    return out


def two_processes(args, stdin_path=None) -> tuple[str, str]:
    """stdout of process 0 and 1 of the same command run as 2 processes x 4 devices."""
    address = f"127.0.0.1:{free_port()}"
    jobs = [start(python_stdout([*args, *MESH, "--coordinator-address", address, "--num-processes", "2",
                                 "--process-id", str(i)]), devices=4, stdin=stdin_path) for i in range(2)]
    outputs = [job.communicate(timeout=900) for job in jobs]
    for job, (_, err) in zip(jobs, outputs):
        if job.returncode != 0 and any(sign in err for sign in LOAD_TIMEOUTS):
            pytest.skip(f"a coordination deadline passed on this loaded machine: {err[-500:]}")
        assert job.returncode == 0, err[-3000:]
    return tuple(out for out, _ in outputs)


def python_stdout(args: list[str]) -> list[str]:
    """``-m MODULE ...`` run so that stdout holds only what Python prints: Gloo (XLA:CPU's collectives
    library) prints its connection lines on file descriptor 1 from several threads, interleaved."""
    assert args[0] == "-m"
    return ["-m", "tests.sharding.programs.python_stdout", *args[1:]]


def test_generate(runs):
    args = ["-m", "eval.generate", str(runs[0]), "--prompt", "5 9 12 5 9", "--prompt", "7 3", "--max-new-tokens", "8"]
    first, second = two_processes(args)
    assert first == (one_process(args)) and first.count("\n") == 2
    assert second == ""


def test_eval(runs, tmp_path):
    args = ["-m", "eval", str(runs[0]), "--tasks", "perplexity", "--seeds", "1", "--no-progress"]
    one_process([*args, "--out", str(tmp_path / "one")])
    two_processes([*args, "--out", str(tmp_path / "two")])
    reports = [json.loads((tmp_path / name / "report.json").read_text())["tasks"]["perplexity"]
               for name in ("one", "two")]
    values = [[value for row in report["results"] for key, value in sorted(row.items()) if isinstance(value, dict)]
              for report in reports]
    assert len(values[0]) > 0
    for one, two in zip(values[0], values[1]):
        assert abs(two["mean"] - one["mean"]) <= 1e-5 * abs(one["mean"]), (one, two)


def test_chat_with_fork_and_rollback(runs, tmp_path):
    script = tmp_path / "script.txt"
    script.write_text(SCRIPT)
    args = ["-m", "eval.chat", str(runs[1]), "--max-new-tokens", "6"]
    first, second = two_processes(args, script)
    assert first == (one_process(args, script)) and "forked" in first and "rolled back" in first
    assert second == ""
