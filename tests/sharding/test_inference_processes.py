"""A model run by two processes of 4 devices each (one jax.distributed system, ``--mesh
expert=4,tensor=2`` over its 8 devices) gives what one process on one device gives:
``eval.generate``'s tokens, ``eval``'s perplexity, ``eval.chat``'s transcript with /fork and
/rollback, and ``eval.serve``'s answers to the ``openai`` client (with speculative decoding, and LoRA
adapters: one given at start decoding beside the base, one loaded and unloaded at run time). Process 0
prints, writes and serves; process 1 runs the same steps silently. A server's stored responses outlive
a restart (``--state-dir``). A process killed outright stops the other with one line."""
import concurrent.futures
import json
import re
import signal
import time

import httpx
import numpy as np
import pytest

from k3jax.training import Trainer
from tests.serve.conftest import CHAT
from tests.serve.test_adapters import lora_run
from tests.sharding.programs.common import small_k3_config
from tests.sharding.test_multi_device import LOAD_TIMEOUTS, free_port, start

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.serial]

MESH = ("--mesh", "expert=4,tensor=2")
EXPERTS = "model.moe.num_experts=8"
SCRIPT = "3 QWERTY\nand again\n/fork\nsomething else\n/rollback\n/sessions\nlast one\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(an MQAR run trained 3 steps, an untrained chat run, two LoRA runs of random factors on the
    chat run), with 8 experts and 2 heads a mixer."""
    root = tmp_path_factory.mktemp("runs")
    Trainer(small_k3_config(f"run_dir={root / 'mqar'}", "train.steps=3", "train.eval_batches=0", EXPERTS)).run()
    Trainer(small_k3_config(f"run_dir={root / 'chat'}", *CHAT, "data.chat_thinking=false", EXPERTS)).save(force=True)
    tuned = lora_run(root, root / "chat", "tuned", 1, lora_rank=4, lora_alpha=8.0)
    late = lora_run(root, root / "chat", "late", 2, lora_rank=2, lora_alpha=4.0, lora_targets=["mixer/*_proj"])
    return root / "mqar", root / "chat", tuned, late


def one_process(args, stdin_path=None) -> str:
    job = start(python_stdout(args), devices=1, stdin=stdin_path)
    out, err = job.communicate(timeout=900)
    assert job.returncode == 0, err[-3000:]
    return out


def two_processes(args, stdin_path=None) -> tuple[str, str]:
    """stdout of process 0 and 1 of the same command run as 2 processes x 4 devices. Under load one
    process can reach a collective later than a fixed deadline allows (`LOAD_TIMEOUTS`); a run that
    fails with one of those is repeated once, and a second such failure fails the test."""
    for attempt in (1, 2):
        address = f"127.0.0.1:{free_port()}"
        jobs = [start(python_stdout([*args, *MESH, "--coordinator-address", address, "--num-processes", "2",
                                     "--process-id", str(i)]), devices=4, stdin=stdin_path) for i in range(2)]
        outputs = [job.communicate(timeout=900) for job in jobs]
        missed = [err for job, (_, err) in zip(jobs, outputs)
                  if job.returncode != 0 and any(sign in err for sign in LOAD_TIMEOUTS)]
        if not missed or attempt == 2:
            break
    for job, (_, err) in zip(jobs, outputs):
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


SERVING = re.compile(r"serving \S+ on (http://\S+/v1)")


def served_url(job, timeout=900) -> str:
    """The URL ``python -m eval.serve`` prints once it listens."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = SERVING.search(job.stderr_so_far())
        if match:
            return match.group(1)
        if job.poll() is not None:
            raise AssertionError(f"the server exited {job.returncode}:\n{job.stderr_so_far()[-3000:]}")
        time.sleep(0.5)
    raise AssertionError("the server did not start:\n" + job.stderr_so_far()[-3000:])


def requests_and_answers(url: str, late_adapter: str) -> list:
    """The same requests to each server, as the ``openai`` client sends them: chat (plain, streamed,
    four at once, with tools, two sampled choices), completions with log-probs (plain steps beside
    speculative rounds), a stored response and its continuation, LoRA adapter "tuned" beside the
    base, ``late_adapter`` loaded, used and unloaded -> what each answered."""
    from concurrent.futures import ThreadPoolExecutor

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id

    def chat(text, **options):
        reply = client.chat.completions.create(messages=[{"role": "user", "content": text}],
                                               max_tokens=10, **{"model": model, "temperature": 0, **options})
        return [(choice.message.content, choice.message.tool_calls) for choice in reply.choices]

    answers = [chat("3 QWERTY")]
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "3 QWERTY"}],
                                            max_tokens=10, temperature=0, stream=True)
    answers.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
    with ThreadPoolExecutor(4) as pool:
        answers.append(list(pool.map(chat, ["a b c", "hello there", "3 QWERTY again", "x"])))
    answers.append(chat("sampled", n=2, temperature=1.0, seed=11))
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
    answers.append(chat("add 3 and 4", tools=tools))
    completion = client.completions.create(model=model, prompt="one two", max_tokens=6, temperature=0, logprobs=2)
    answers.append((completion.choices[0].text, completion.choices[0].logprobs.tokens,
                    completion.choices[0].logprobs.token_logprobs))
    first = client.responses.create(model=model, input="remember 42", max_output_tokens=6, temperature=0)
    second = client.responses.create(model=model, input="and now?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    answers.append((first.output_text, second.output_text, second.usage.input_tokens))
    with ThreadPoolExecutor(2) as pool:
        answers.append(list(pool.map(lambda name: chat("3 QWERTY", model=name), ["tuned", model])))
    loaded = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "late", "lora_path": late_adapter}, timeout=600)
    answers.append((loaded.status_code, chat("3 QWERTY", model="late")))
    unloaded = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "late"}, timeout=600)
    answers.append((unloaded.status_code, [m.id for m in client.models.list().data][1:]))
    return answers


def assert_same_answers(ours, theirs) -> None:
    """Equal, log-probs within 1e-5; the adapters answered, were loaded and unloaded."""
    completion = 5                                 # (text, tokens, log-probs) of the completion
    text, tokens, logprobs = ours[completion]
    text_theirs, tokens_theirs, logprobs_theirs = theirs[completion]
    assert ours[:completion] + ours[completion + 1:] == theirs[:completion] + theirs[completion + 1:]
    assert (text, tokens) == (text_theirs, tokens_theirs)
    np.testing.assert_allclose(logprobs, logprobs_theirs, atol=1e-5)
    adapters, (loaded, _), (unloaded, models) = ours[-3:]
    assert (loaded, unloaded, models) == (200, 200, ["tuned"]) and adapters[0] != adapters[1]


def test_serve_across_processes_answers_as_one_process(runs):
    args = ["-m", "eval.serve", str(runs[1]), "--port", "0", "--compilation-cache", "none", "--max-model-len", "1024",
            "--prompt-lookup", "2", "--lora", f"tuned={runs[2]}", "--max-loras", "2", "--runtime-lora-updates"]
    one = start(args, devices=1)
    address = f"127.0.0.1:{free_port()}"
    two = [start([*args, *MESH, "--coordinator-address", address, "--num-processes", "2", "--process-id", str(i)],
                 devices=4) for i in range(2)]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(requests_and_answers, [served_url(one), served_url(two[0])], [str(runs[3])] * 2))
        assert_same_answers(answers[1], answers[0])
        for job in (two[1], two[0], one):      # SIGTERM to a follower first: it waits for process 0
            job.send_signal(signal.SIGTERM)
        for job in (*two, one):
            job.communicate(timeout=300)
        codes = [job.returncode for job in (*two, one)]
        assert codes == [-signal.SIGTERM, 0, -signal.SIGTERM], [job.stderr_so_far()[-2000:] for job in (*two, one)]
        assert "stopping with process 0" in two[1].stderr_so_far()
    finally:
        for job in (one, *two):
            if job.poll() is None:
                job.kill()


def two_servers(args, *extra) -> list:
    """The two processes of ``args`` (``extra[i]``: flags for process i alone)."""
    address = f"127.0.0.1:{free_port()}"
    return [start([*args, *(extra[i] if extra else ()), *MESH, "--coordinator-address", address,
                   "--num-processes", "2", "--process-id", str(i)], devices=4) for i in range(2)]


def stopped(jobs) -> list[str]:
    """SIGTERM to each of a 2-process server (the follower first) -> their stderr; both ended by it."""
    for job in (jobs[1], jobs[0]):
        job.send_signal(signal.SIGTERM)
    for job in jobs:
        job.communicate(timeout=300)
    errors = [job.stderr_so_far() for job in jobs]
    assert [job.returncode for job in jobs] == [-signal.SIGTERM, 0], [error[-2000:] for error in errors]
    return errors


def test_serve_across_processes_keeps_stored_responses_across_restarts(runs, tmp_path):
    """--state-dir across processes: what the first server stored (process 0 writes, both read the
    values) the second continues from its saved sessions, as the first would have."""
    state = tmp_path / "state"
    args = ["-m", "eval.serve", str(runs[1]), "--port", "0", "--compilation-cache", "none", "--max-model-len", "256",
            "--state-dir", str(state)]

    def ask(jobs, **options):
        client = openai.OpenAI(base_url=served_url(jobs[0]), api_key="unused", max_retries=0, timeout=600)
        reply = client.responses.create(model=client.models.list().data[0].id, max_output_tokens=6, temperature=0,
                                        **options)
        return reply.id, reply.output_text, reply.usage.input_tokens

    jobs = two_servers(args)
    try:
        first = ask(jobs, input="remember 42")
        second = ask(jobs, input="and now?", previous_response_id=first[0])
        errors = stopped(jobs)
        assert "saved 2 stored responses" in errors[0] and "saved" not in errors[1]
        assert sorted(path.name for path in (state / "tier").iterdir()) == ["process-0", "process-1"]
        jobs = two_servers(args)
        again = ask(jobs, input="and now?", previous_response_id=first[0])
        assert again[1:] == second[1:] and again[0] != second[0]
        errors = stopped(jobs)
        assert "rebuilt" not in errors[0] and "saved 3 stored responses" in errors[0]
        jobs = two_servers(args, (), ("--state-dir", str(tmp_path / "elsewhere")))   # as if a host's own disk
        for job in jobs:
            job.communicate(timeout=300)
        lines = [job.stderr_so_far().strip().splitlines()[-1] for job in jobs]
        assert [job.returncode for job in jobs] == [2, 2], lines
        assert lines == [f"error: --state-dir {state}: process 1 of 2 read other stored responses there than "
                         f"process 0: every process must read one directory (on several hosts, a shared filesystem)",
                         f"error: --state-dir {tmp_path / 'elsewhere'}: process 1 of 2 read other stored responses "
                         f"there than process 0: every process must read one directory (on several hosts, a shared "
                         f"filesystem)"]
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()


LOST_PEER = re.compile(r"error: process (\d) of 2 stopped: (.*); every process of the run stops \(JAX's log: (\S+)\)")


@pytest.mark.parametrize("victim", [1, 0], ids=["a follower", "the coordinator"])
def test_a_killed_process_stops_the_other_with_one_line(runs, victim):
    """kill -9 of one process of a 2-process server: the other ends (by JAX's abort) within the
    heartbeat timeout, having written one line for JAX's fatal log."""
    args = ["-m", "eval.serve", str(runs[1]), "--port", "0", "--compilation-cache", "none", "--max-model-len", "256",
            *MESH, "--heartbeat-timeout", "5"]
    address = f"127.0.0.1:{free_port()}"
    jobs = [start([*args, "--coordinator-address", address, "--num-processes", "2", "--process-id", str(i)],
                  devices=4) for i in range(2)]
    survivor = jobs[1 - victim]
    try:
        served_url(jobs[0])
        before = len(survivor.stderr_so_far())
        jobs[victim].kill()
        killed = time.monotonic()
        survivor.communicate(timeout=120)
        assert survivor.returncode == -signal.SIGABRT and time.monotonic() - killed < 60
        deadline = time.monotonic() + 10    # the watcher writes the line as the process aborts
        while not LOST_PEER.search(survivor.stderr_so_far()[before:]) and time.monotonic() < deadline:
            time.sleep(0.1)
        after = survivor.stderr_so_far()[before:]
        lines = [line for line in after.splitlines() if line.strip()]
        match = LOST_PEER.fullmatch(lines[-1]) if lines else None
        assert match and len(lines) == 1, after[-3000:]
        expected = (f"process 1 sent no heartbeat for 5 s" if victim == 1 else
                    f"process 0, the coordinator at {address}, is gone")
        assert match.group(1) == str(1 - victim) and match.group(2).startswith(expected), lines
        assert "Terminating process because the JAX distributed service" in open(match.group(3)).read()
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
