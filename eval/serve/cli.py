"""``python -m eval.serve RUN_DIR`` (or ``k3jax-serve``): an OpenAI-compatible server over a checkpoint.

    python -m eval.serve runs/chat --port 8000                         # http://127.0.0.1:8000/v1
    python -m eval.serve runs/chat --api-key secret --state-dir state   # keys; stored responses survive restarts
    python -m eval.serve runs/chat --prompt-lookup 3                    # speculative decoding (or --draft RUN_DIR)

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream``), ``POST /v1/responses`` (``previous_response_id``; ``GET`` / ``DELETE /v1/responses/{id}``,
``POST /v1/responses/{id}/fork``), vLLM's ``GET /tokenizer_info``, ``POST /tokenize`` and ``POST
/detokenize``, ``GET /metrics`` (Prometheus) and ``GET /health``. Concurrent requests decode together
(`eval.serve.engine`). SIGTERM / SIGINT: no new requests; running ones get ``--drain-seconds`` to
finish, the rest an error (an open stream its error event and ``[DONE]``); with ``--state-dir`` the
stored responses are saved, and loaded at the next start (each is also written through as it is
answered, `eval.serve.journal`, so a kill -9 loses none); the process then ends by the signal
(status 143 after SIGTERM, as uvicorn does), or with status 1 and one line when the save failed.
Bad flags, an unusable run directory or a ``--max-model-len`` no session can hold: one line on
stderr, exit status 2.

A model too large for one host's devices is served by several processes over one mesh (``--mesh``
with ``--coordinator-address``, ``--num-processes``, ``--process-id``, the same command on every
host): each loads its shards; process 0 owns HTTP and the engine, and its store's and speculator's
calls are mirrored to the others (`k3jax.inference.mirror`), which make the same calls on their own
copies. SIGTERM on any process lets process 0 drain, then every process stops. ``--state-dir`` is
then one directory all processes read (a shared filesystem) and process 0 writes (`load_state_dir`).

LoRA fine-tunes of the served run (``--lora NAME=RUN_DIR``, repeatable; `k3jax.inference.adapters`)
are served beside it, a request's ``model`` choosing the base or an adapter by name, and requests
of different adapters decode in one batch. ``--max-loras N`` leaves room for adapters loaded later
and ``--runtime-lora-updates`` opens vLLM's routes for that, ``POST /v1/load_lora_adapter``
(``{"lora_name", "lora_path"}``) and ``POST /v1/unload_lora_adapter`` (``{"lora_name"}``).

Speculative decoding (`k3jax.sessions.speculate`): the flags of `eval.flags` (``--prompt-lookup N``
or ``--draft RUN_DIR``, ``--speculate-k``, ``--speculate-rollback``, ``--[no-]speculate-adaptive``),
from the one declaration of the settings (`k3jax.config.SpeculationConfig`); a draft must read the
same token ids as the served model (`k3jax.inference.draft_mismatch`). Greedy output is unchanged,
sampled output keeps its distribution.
"""
from __future__ import annotations

import argparse
import logging
import pathlib
import signal
import sys
import threading

from k3jax.checkpoint import quiet_checkpoint_io
from k3jax.host import process_flags
from k3jax.inference import InputError
from k3jax.inference.mirror import Channel, Leader

from ..flags import (OneLineParser, add_placement_flags, add_speculation_flags, byte_count, load_draft_beside,
                     load_model, speculation_settings)

DEFAULT_COMPILATION_CACHE = "~/.cache/k3jax/xla"    # `train.compilation_cache`'s default
DEFAULT_STORED_RESPONSES = 256
SHUTDOWN_GRACE_SECONDS = 5.0      # after the drain, for the answers of the requests it ended to go out


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value
    return parse


def host_list(text: str) -> frozenset[str]:
    """``--allowed-hosts``: comma-separated host names (no ports), compared without case."""
    hosts = frozenset(part.strip().lower() for part in text.split(",") if part.strip())
    if not hosts or any(":" in host and not host.startswith("[") for host in hosts):
        raise argparse.ArgumentTypeError(f"expected host names separated by commas, without ports, got {text!r}")
    return hosts


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m eval.serve", description="Serve a checkpoint over an OpenAI-compatible API.")
    parser.add_argument("run", metavar="RUN_OR_CHECKPOINT_DIR")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route")
    parser.add_argument("--allowed-hosts", type=host_list, default=None, metavar="HOST,...",
                        help="answer only requests whose Host header names one of these (e.g. localhost,127.0.0.1); "
                             "default: any")
    parser.add_argument("--allowed-origins", type=lambda text: [o.strip() for o in text.split(",") if o.strip()],
                        default=None, metavar="ORIGIN,...",
                        help="web origins allowed to call the API from a browser (CORS; '*' for any); default: none")
    parser.add_argument("--model-name", default=None, help="the model's name in the API (default: the run directory's)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest good one)")
    parser.add_argument("--device-bytes", type=byte_count, default=None, help="session state on the device (default: all that fits)")
    parser.add_argument("--host-bytes", type=byte_count, default=None, help="session state in host memory (default: unlimited)")
    parser.add_argument("--state-dir", default=None,
                        help="stored responses saved here on shutdown and loaded at start; also the disk tier")
    parser.add_argument("--max-batch", type=_positive(int), default=64,
                        help="sequences decoding together, and the most one request may bring (prompts x n; default 64)")
    parser.add_argument("--max-stored-responses", type=_positive(int), default=DEFAULT_STORED_RESPONSES,
                        help="/v1/responses kept for previous_response_id; past it the least recently used is "
                             f"evicted (default {DEFAULT_STORED_RESPONSES})")
    parser.add_argument("--max-queue", type=_positive(int), default=256, help="requests waiting; past it 429 (default 256)")
    parser.add_argument("--max-model-len", type=_positive(int), default=32768,
                        help="prompt + completion tokens per request (default 32768)")
    parser.add_argument("--request-timeout", type=_positive(float), default=600.0, help="seconds per request (default 600)")
    parser.add_argument("--compilation-cache", default=DEFAULT_COMPILATION_CACHE, metavar="DIR",
                        help="compiled programs kept here, so a restarted server skips compiling "
                             f"(default {DEFAULT_COMPILATION_CACHE}, as training's; 'none': off)")
    parser.add_argument("--drain-seconds", type=_positive(float), default=30.0,
                        help="on SIGTERM, seconds running requests get to finish (default 30)")
    add_placement_flags(parser)
    add_speculation_flags(parser)
    add_lora_flags(parser)
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    try:
        process_flags(args)
    except ValueError as error:
        parser.error(str(error))
    args.speculation = speculation_settings(args)
    return args


def lora_module(text: str) -> tuple[str, str]:
    """``--lora NAME=RUN_DIR`` -> (name, directory)."""
    name, equals, path = text.partition("=")
    if not equals or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=RUN_DIR, got {text!r}")
    return name.strip(), path.strip()


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters served beside the model (a request's model picks one)")
    group.add_argument("--lora", type=lora_module, action="append", default=[], metavar="NAME=RUN_DIR",
                       help="a LoRA fine-tune of this run, served as model NAME (repeatable)")
    group.add_argument("--max-loras", type=_positive(int), default=None,
                       help="adapters loaded at once (default: the number of --lora)")
    group.add_argument("--max-lora-rank", type=_positive(int), default=None,
                       help="the largest adapter rank (default: the largest of --lora's)")
    group.add_argument("--runtime-lora-updates", action="store_true",
                       help="open POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they read any run "
                            "directory this process can read: give an --api-key)")


def load_adapters(args: argparse.Namespace, run):
    """The LoRA adapters ``--lora`` names, in banks on ``run.model`` (None without ``--lora`` or
    ``--max-loras``); the banks cover the weights the adapters adapt, or, with none given, every
    weight an adapter can join except routed experts."""
    if not args.lora and args.max_loras is None:
        if args.runtime_lora_updates:
            raise InputError("--runtime-lora-updates: give --max-loras (and --max-lora-rank) to make room for adapters")
        return None
    from k3jax.inference.adapters import ServedAdapters
    names = [name for name, _ in args.lora]
    if len(set(names)) != len(names) or (args.model_name or run.run_dir.name) in names:
        raise InputError(f"--lora: every adapter needs a name of its own, other than the model's ({', '.join(names)})")
    return ServedAdapters.attach(run, dict(args.lora), capacity=args.max_loras, rank=args.max_lora_rank)


def load_draft_model(args: argparse.Namespace, config):
    """The model of the ``--draft`` run (None without one), which must read the same token ids as
    a model trained with ``config``."""
    if args.speculation is None or args.speculation.draft is None:
        return None
    try:
        return load_draft_beside(args.speculation.draft, config, args)
    except InputError as error:
        raise InputError(f"--draft: {error}") from None


def load_engine_parts(args: argparse.Namespace):
    """``(run, responses, store, speculator, adapters)`` for ``args``: the model loaded (on every
    process of a mesh) with its LoRA adapters (None without), stored state read, the speculator
    (None without one) over the store."""
    from .responses import ResponseStore
    from k3jax.sessions import SessionStore
    from k3jax.sessions.speculate import Speculator

    run = load_model(args)
    adapters = load_adapters(args, run)
    draft = load_draft_model(args, run.config)
    budgets = dict(device_bytes=args.device_bytes, host_bytes=args.host_bytes)
    if args.state_dir is not None:
        responses, store = load_state_dir(run.model, pathlib.Path(args.state_dir), args.max_stored_responses, budgets)
    else:
        responses, store = ResponseStore(args.max_stored_responses), SessionStore(run.model, **budgets)
    try:
        store.check_length(args.max_model_len)
    except ValueError as error:
        raise InputError(f"--max-model-len {args.max_model_len}: {error}") from None
    if adapters is not None:
        store.serve_adapters(adapters.tags())
    speculator = None if args.speculation is None else Speculator.of(store, args.speculation, draft)
    return run, responses, store, speculator, adapters


def load_state_dir(model, state_dir: pathlib.Path, capacity: int | None, budgets: dict):
    """(responses, store) kept in ``--state-dir`` (`ResponseStore.load`; what it skipped or rebuilt
    said on stderr). Across processes it is one directory that every process reads (on several
    hosts, a shared filesystem) and process 0 alone writes; each process keeps its disk tier in
    ``tier/process-N``. The processes first check that they read the same stored responses, and
    all refuse in one line where one did not, before any of them runs a program."""
    from .responses import ResponseStore, read_state_files
    from k3jax.inference.mirror import Channel

    channel = Channel.joined(namespace="k3jax/state-dir/")
    process = 0 if channel is None else channel.process
    try:
        files, failure = read_state_files(state_dir), None
    except (OSError, ValueError) as error:
        files, failure = None, str(error)
    if channel is not None:
        said = channel.said_by_every_process("read", f"error {failure}" if files is None else f"read {files.digest()}")
        failure = failure or disagreement(said)
    if failure is not None:
        raise InputError(f"--state-dir {state_dir}: {failure}")
    tier = state_dir / "tier" if channel is None else state_dir / "tier" / f"process-{process}"
    try:
        responses, store, notes = ResponseStore.load(model, state_dir, capacity, files=files, owner=process == 0,
                                                     disk_dir=tier, **budgets)
    except (OSError, ValueError) as error:
        raise InputError(f"--state-dir {state_dir}: {error}") from None
    for note in notes if process == 0 else ():
        print(f"--state-dir {state_dir}: {note}", file=sys.stderr, flush=True)
    return responses, store


def disagreement(said: list[str]) -> str | None:
    """Why processes that read a state directory cannot go on, from what each said (in process
    order: ``"read DIGEST"`` or ``"error MESSAGE"``); None where every one read the same."""
    failed = [process for process, text in enumerate(said) if text.startswith("error ")]
    differ = [process for process, text in enumerate(said) if text != said[0]]
    if failed:
        return f"{_processes(failed)} of {len(said)} could not read it"
    if differ:
        return (f"{_processes(differ)} of {len(said)} read other stored responses there than process 0: every "
                f"process must read one directory (on several hosts, a shared filesystem)")
    return None


def _processes(numbers: list[int]) -> str:
    return f"process{'es' if len(numbers) > 1 else ''} {', '.join(map(str, numbers))}"


def build(args: argparse.Namespace, parts=None, leader=None):
    """(app, uvicorn config, served model) for ``args``: the engine started over ``parts``
    (`load_engine_parts`'s, loaded here when None). With ``leader`` (process 0 of a mesh over
    several processes, `k3jax.inference.mirror.Leader`), the store's and the speculator's calls
    are mirrored to the other processes, which are stopped after the engine."""
    import uvicorn

    from .app import Server, create_app
    from .engine import Engine
    from .model import ServedModel
    from k3jax.inference.mirror import Mirrored
    from k3jax.sessions import Snapshot

    run, responses, store, speculator, adapters = parts or load_engine_parts(args)
    if leader is not None:
        store = Mirrored(store, "store", leader, handles=(Snapshot,))
        speculator = None if speculator is None else Mirrored(speculator, "speculator", leader)
        adapters = None if adapters is None else Mirrored(adapters, "adapters", leader)
    served = ServedModel(run, args.model_name or run.run_dir.name, args.max_model_len, adapters,
                         runtime_lora_updates=args.runtime_lora_updates)
    engine = Engine(store, max_batch=args.max_batch, max_queue=args.max_queue, speculator=speculator)
    server = Server(served, engine, responses, api_key=args.api_key, request_timeout=args.request_timeout,
                    allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins)
    state_dir = None if args.state_dir is None else pathlib.Path(args.state_dir)

    def save(store) -> None:
        try:
            responses.save(store, state_dir)
        except Exception as error:             # whatever it is, nothing was saved: said in one line
            server.save_failure = f"could not save the stored responses to {state_dir}: {error}"

    @run_once
    def on_shutdown() -> None:
        engine.shutdown(args.drain_seconds, on_stop=None if state_dir is None else save)
        if server.save_failure is not None:
            print(f"error: {server.save_failure}", file=sys.stderr, flush=True)
        elif state_dir is not None:
            print(f"saved {len(responses.items)} stored responses to {state_dir}", file=sys.stderr, flush=True)
        if leader is not None:
            stop_following(leader)

    app = create_app(server, on_shutdown)
    app.state.drain = on_shutdown
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.drain_seconds + SHUTDOWN_GRACE_SECONDS, access_log=False)
    return app, config, served


def stop_following(leader) -> None:
    """Process 0 of a mesh: end the other processes' `follow` and leave the run together (uvicorn
    then ends this process by the signal it caught, before any exit handler could)."""
    import jax

    leader.stop()
    jax.distributed.shutdown()


def follow_process_zero(channel, parts) -> int:
    """A process of a mesh other than 0: make the store's and speculator's calls process 0's
    engine makes, until it stops. SIGTERM / SIGINT wait for that: process 0 drains its requests
    with this process's devices, then stops every process."""
    import jax

    from k3jax.inference.mirror import follow

    def wait_for_process_zero(signum, frame) -> None:
        print(f"process {channel.process}: stopping with process 0", file=sys.stderr, flush=True)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, wait_for_process_zero)
    _, _, store, speculator, adapters = parts
    follow(channel, {"store": store, "speculator": speculator, "adapters": adapters})
    jax.distributed.shutdown()
    return 0


def run_once(function):
    """``function()`` run by the first call only; a later call (another thread) waits for it to end."""
    lock, done = threading.Lock(), []

    def once() -> None:
        with lock:
            if not done:
                done.append(True)
                function()
    return once


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    quiet_checkpoint_io()
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        parts = load_engine_parts(args)
        channel = Channel.joined()
        if channel is not None and not channel.leads:
            return follow_process_zero(channel, parts)
        app, config, served = build(args, parts, None if channel is None else Leader(channel))
    except InputError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    logging.basicConfig(level=logging.WARNING)
    serving = app.state.server
    if args.compilation_cache.lower() != "none":
        from k3jax.host import enable_compilation_cache
        enable_compilation_cache(args.compilation_cache)
    server = uvicorn.Server(config)
    original = server.startup

    async def startup(sockets=None):
        await original(sockets)
        for listener in server.servers:
            for sock in listener.sockets:
                host, port = sock.getsockname()[:2]
                print(f"serving {served.name} on http://{host}:{port}/v1", file=sys.stderr, flush=True)
    server.startup = startup
    catch_exit = server.handle_exit

    def handle_exit(number, frame):          # SIGTERM / SIGINT: drain now, while uvicorn waits for the
        catch_exit(number, frame)            # connections, so open streams end with an error and [DONE]
        threading.Thread(target=app.state.drain, name="k3jax-serve-drain", daemon=True).start()
    server.handle_exit = handle_exit
    end_by_signal_unless(lambda: serving.save_failure is not None)
    server.run()
    return 0 if serving.save_failure is None else 1


def end_by_signal_unless(failed) -> None:
    """SIGTERM / SIGINT handlers for after uvicorn's shutdown, which raises the signal it caught
    again once it is done: the process then ends by that signal as a clean stop does, or, when
    ``failed()`` (the shutdown's save failed), with exit status 1."""
    def handler(number, frame):
        if failed():
            sys.exit(1)
        signal.signal(number, signal.SIG_DFL)
        signal.raise_signal(number)
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, handler)


if __name__ == "__main__":
    sys.exit(main())
