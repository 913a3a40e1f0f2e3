"""The server under hostile load, a kill -9, and thousands of stored responses, in one run (the
hardening issue's measurements; `bench.serve` measures throughput and single bad requests).

    python -m bench.serve_faults --train-tiny runs/chat [--seconds 60] [--out bench/serve_faults.json]

Each part starts ``python -m eval.serve`` in a subprocess (`bench.serve.ServerProcess`) on the
README's tiny chat model (``--train-tiny DIR`` trains it unless DIR holds checkpoints):

    hostile   ``--clients`` clients send chat completions back to back for ``--seconds`` (as in
              `bench.serve`'s phase B, after its warm-up and two untimed rounds of a many-prompt
              request beside a burst of ``--clients``, which compile the programs of the pools
              that grow to hold them) while 20 hostile requests arrive spread
              over the phase, in turn: a tool schema nested 1,500 levels, a 24 MiB prompt, a
              completions request of 64 prompts of ~370 tokens (``--request-timeout 20``), and one
              asking for more sequences than ``--max-batch``. Per kind: statuses and seconds; for the
              good requests: completed, failed, lost.
    kill -9   two conversations of stored responses (``/v1/responses``, greedy, each turn continuing
              the last with ``previous_response_id``) on a server with ``--state-dir``, killed with
              SIGKILL after ``--acknowledged`` answers; a new server on the same directory. Every
              acknowledged response must be there (``GET``), and the next turn of each
              conversation must give the tokens a server that was never killed gives.
    stored    ``--stored`` responses (``store`` is true by default) with the default cap
              (``--max-stored-responses`` 256): the server's resident memory (VmRSS) and the median
              latency of each block of 250.

Nothing is asserted: every figure goes to the tables and to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import threading
import time

import httpx

from bench.common import table, write_json
from bench.serve import Requests, ServerProcess, burst, prepare_run, run_clients, summarize, warm_up

KEY = "bench-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
TURNS = ["1 ABC", "2 DEFG", "3 HI", "4 JKLMN", "5 OP", "6 QRS", "7 TUV", "8 WXYZ"]


# ---------------------------------------------------------------------------------------------- hostile
def hostile_bodies(name: str) -> list[tuple[str, str, bytes]]:
    """(kind, route, JSON body) of the four hostile kinds (the nested one written out as text: Python's
    encoder cannot nest 1,500 levels)."""
    schema = '{"type": "object", "properties": {"x": ' * 1500 + '{"type": "string"}' + "}}" * 1500
    nested = ('{"model": %s, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": '
              '[{"type": "function", "function": {"name": "f", "parameters": %s}}]}' % (json.dumps(name), schema))
    huge = {"model": name, "prompt": "A" * (24 * 2**20), "max_tokens": 1}
    prompts = {"model": name, "prompt": [f"{i}: " + " ".join(f"w{j}" for j in range(90)) for i in range(64)],
               "max_tokens": 1}
    rows = {"model": name, "prompt": "hello", "n": 65, "max_tokens": 1}
    return [("nested tool schema (1,500 levels)", "/v1/chat/completions", nested.encode()),
            ("24 MiB prompt", "/v1/completions", json.dumps(huge).encode()),
            ("64 prompts of ~370 tokens", "/v1/completions", json.dumps(prompts).encode()),
            ("65 sequences (> --max-batch 64)", "/v1/completions", json.dumps(rows).encode())]


def hostile(server: ServerProcess, args) -> dict:
    requests = Requests(server.name, 16, False)
    warm_up(server, HEADERS, requests, args.clients, 120, 4)
    kinds = hostile_bodies(server.name)
    for _ in range(2):      # untimed: compile what a many-prompt request beside the clients needs (pools grow)
        many = threading.Thread(target=lambda: httpx.post(server.url + kinds[2][1], content=kinds[2][2], timeout=300,
                                                          headers={**HEADERS, "Content-Type": "application/json"}))
        many.start()
        burst(server, HEADERS, requests, args.clients, 300)
        many.join(300)
    answers = []

    def send_hostile() -> None:
        with httpx.Client(base_url=server.url, headers=HEADERS, timeout=120) as client:
            for index in range(20):
                time.sleep(args.seconds / 22)
                kind, route, body = kinds[index % len(kinds)]
                start = time.perf_counter()
                try:
                    response = client.post(route, content=body, headers={"Content-Type": "application/json"})
                    status, error = response.status_code, (response.json().get("error") or {}).get("message", "")[:80] \
                        if response.headers.get("content-type", "").startswith("application/json") else response.text[:80]
                except httpx.HTTPError as failure:
                    status, error = None, f"{type(failure).__name__}: {failure}"[:80]
                answers.append({"kind": kind, "status": status, "seconds": time.perf_counter() - start,
                                "error": error})

    thread = threading.Thread(target=send_hostile, daemon=True)
    thread.start()
    records, start = run_clients(server, HEADERS, requests, args.clients, args.seconds, 120)
    thread.join(300)
    by_kind = {}
    for answer in answers:
        row = by_kind.setdefault(answer["kind"], {"kind": answer["kind"], "statuses": [], "max_seconds": 0.0,
                                                  "error": answer["error"]})
        row["statuses"].append(answer["status"])
        row["max_seconds"] = max(row["max_seconds"], answer["seconds"])
    return {"good": summarize(records, start, args.clients, args.seconds), "hostile": list(by_kind.values()),
            "hostile_sent": len(answers)}


# ---------------------------------------------------------------------------------------------- kill -9
def respond(client: httpx.Client, name: str, text: str, previous: str | None) -> dict:
    body = {"model": name, "input": text, "temperature": 0, "max_output_tokens": 8}
    if previous is not None:
        body["previous_response_id"] = previous
    response = client.post("/v1/responses", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"/v1/responses answered {response.status_code}: {response.text[:300]}")
    return response.json()


def output_text(response: dict) -> str:
    return "".join(part.get("text", "") for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def conversations(server: ServerProcess, turns: int, stop_after: int | None = None) -> list[list[dict]]:
    """Two conversations of ``turns`` stored responses, alternating; with ``stop_after``: SIGKILL the
    server once that many are acknowledged (the answers so far are returned)."""
    chains: list[list[dict]] = [[], []]
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=120) as client:
        for turn in range(turns):
            for chain in chains:
                previous = chain[-1]["id"] if chain else None
                chain.append(respond(client, server.name, TURNS[turn % len(TURNS)], previous))
                if stop_after is not None and sum(map(len, chains)) == stop_after:
                    os.killpg(server.process.pid, signal.SIGKILL)
                    server.process.wait(30)
                    return chains
    return chains


def kill9(run_dir: pathlib.Path, args) -> dict:
    root = pathlib.Path(tempfile.mkdtemp(prefix="k3jax-kill9-"))
    flags = ["--api-key", KEY, "--max-model-len", "4096"]      # a turn renders to ~100 byte tokens
    reference = ServerProcess(run_dir, flags + ["--state-dir", str(root / "reference")], args.startup_timeout)
    try:
        whole = conversations(reference, args.acknowledged // 2 + 1)
    finally:
        reference.stop()
    killed = ServerProcess(run_dir, flags + ["--state-dir", str(root / "killed")], args.startup_timeout)
    acknowledged = conversations(killed, args.acknowledged, stop_after=args.acknowledged)
    restarted = ServerProcess(run_dir, flags + ["--state-dir", str(root / "killed")], args.startup_timeout)
    try:
        with httpx.Client(base_url=restarted.url, headers=HEADERS, timeout=120) as client:
            found = [client.get(f"/v1/responses/{item['id']}").status_code == 200
                     for chain in acknowledged for item in chain]
            same = []
            for chain, reference_chain in zip(acknowledged, whole):
                following = respond(client, restarted.name, TURNS[len(chain) % len(TURNS)], chain[-1]["id"])
                same.append(output_text(following) == output_text(reference_chain[len(chain)]))
    finally:
        restarted.stop()
    return {"acknowledged": sum(map(len, acknowledged)), "found_after_restart": sum(found),
            "continuations_equal": sum(same), "conversations": len(same),
            "restart_log": [line for line in restarted.log_tail(40) if "rebuilt" in line or "skipped" in line][:8]}


# ---------------------------------------------------------------------------------------------- stored
def resident_bytes(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def stored(run_dir: pathlib.Path, args) -> list[dict]:
    server = ServerProcess(run_dir, ["--api-key", KEY, "--max-model-len", "512"], args.startup_timeout)
    rows = []
    try:
        with httpx.Client(base_url=server.url, headers=HEADERS, timeout=120) as client:
            latencies = []
            for index in range(args.stored):
                start = time.perf_counter()
                respond(client, server.name, TURNS[index % len(TURNS)] + f" {index}", None)
                latencies.append(time.perf_counter() - start)
                if (index + 1) % 250 == 0:
                    rows.append({"stored": index + 1, "rss_mb": resident_bytes(server.process.pid) / 2**20,
                                 "median_ms": 1000 * statistics.median(latencies)})
                    latencies = []
                    print(f"stored {index + 1}: {rows[-1]['rss_mb']:.0f} MB, {rows[-1]['median_ms']:.0f} ms",
                          file=sys.stderr, flush=True)
    finally:
        server.stop()
    return rows


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", help="the run directory to serve (or --train-tiny)")
    parser.add_argument("--train-tiny", default=None, metavar="DIR")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--acknowledged", type=int, default=10, help="answers before the kill -9")
    parser.add_argument("--stored", type=int, default=2000)
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--parts", default="hostile,kill9,stored", help="which parts to run (comma-separated)")
    parser.add_argument("--out", default="bench/serve_faults.json")
    args = parser.parse_args(argv)
    if (args.run is None) == (args.train_tiny is None):
        parser.error("give RUN or --train-tiny DIR")
    return args


def print_tables(result: dict) -> None:
    if "hostile" in result:
        good = result["hostile"]["good"]
        print(f"\n{args_line(result)}\ngood requests under hostile load: {good['completed']} completed, "
              f"{good['failed']} failed, {good['lost']} lost; p99 {good['latency_p99'] or 0:.2f} s")
        print(table(["hostile request", "statuses", "slowest answer (s)", "error"],
                    [[row["kind"], " ".join(map(str, row["statuses"])), f"{row['max_seconds']:.2f}", row["error"]]
                     for row in result["hostile"]["hostile"]]))
    if "kill9" in result:
        kill = result["kill9"]
        print(f"\nkill -9: {kill['found_after_restart']}/{kill['acknowledged']} acknowledged responses found after "
              f"the restart; {kill['continuations_equal']}/{kill['conversations']} continuations equal the "
              "uninterrupted server's")
    if "stored" in result:
        print("\n" + table(["stored responses", "server RSS (MB)", "median latency (ms)"],
                           [[row["stored"], f"{row['rss_mb']:.0f}", f"{row['median_ms']:.0f}"] for row in result["stored"]]))


def args_line(result: dict) -> str:
    return f"{result['clients']} clients for {result['seconds']:.0f} s on {result['run_dir']}"


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    run_dir, training = prepare_run(args)
    result = {"run_dir": str(run_dir), **training, "clients": args.clients, "seconds": args.seconds,
              "cpus": os.cpu_count(), "load_average_start": os.getloadavg()[0]}
    parts = set(args.parts.split(","))
    if "hostile" in parts:
        server = ServerProcess(run_dir, ["--api-key", KEY, "--max-batch", "64", "--max-queue", "256",
                                         "--max-model-len", "512", "--request-timeout", "20"], args.startup_timeout)
        try:
            result["hostile"] = hostile(server, args)
        finally:
            result["hostile_shutdown"] = server.stop()
        write_json(args.out, json.loads(json.dumps(result, default=str)))     # each part kept as it ends
    if "kill9" in parts:
        result["kill9"] = kill9(run_dir, args)
        write_json(args.out, json.loads(json.dumps(result, default=str)))
    if "stored" in parts:
        result["stored"] = stored(run_dir, args)
    print_tables(result)
    print(f"wrote {write_json(args.out, json.loads(json.dumps(result, default=str)))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
