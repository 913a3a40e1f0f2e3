"""Command-line pieces the evaluation programs share (``eval``, ``eval.generate``, ``eval.chat``,
``eval.serve``): one-line argument errors, where the model runs, and speculative decoding's
flags, made from the one declaration of its settings (`k3jax.config.SpeculationConfig`, each
field's ``flag``):

    --mesh AXIS=N,...|auto  the device mesh the model is loaded onto (`k3jax.inference.layout`)
    --dtype float32|bfloat16  the weights' dtype (default: as stored)

    --prompt-lookup N      drafts copied from the sequence itself (n-grams of up to N tokens)
    --draft RUN_DIR        drafts from a smaller model: a k3jax run with the same tokenizer
    --speculate-k K        drafts per round, at most (default 4; adaptive)
    --speculate-rollback states|replay
    --[no-]speculate-adaptive

A flag of the settings given without a draft source, or a value the settings refuse, is one
`k3jax.inference.InputError` line naming the flag.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing

from k3jax.config import ConfigError, SpeculationConfig
from k3jax.host import add_process_flags, process_flags
from k3jax.inference import InputError, LoadedRun, draft_mesh, load_draft, load_run
from k3jax.inference.layout import INFERENCE_AXES
from k3jax.sharding import initialize_distributed

SOURCES = ("prompt_lookup", "draft")      # the fields that choose a draft source
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


class OneLineParser(argparse.ArgumentParser):
    """Argument errors become an `InputError` (one line, exit status 2) instead of usage + exit."""

    def error(self, message):
        raise InputError(f"{message} (see {self.prog} --help)")


def byte_count(text: str) -> int:
    """``123``, ``512M``, ``2GiB``, ``1.5g`` -> bytes (binary units)."""
    cleaned = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = cleaned[-1:] if cleaned[-1:] in _UNITS and cleaned[-1:] else ""
    try:
        value = float(cleaned[: len(cleaned) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a byte count such as 512M or 2G, got {text!r}") from None
    if not value >= 1 or value > 2**60:
        raise argparse.ArgumentTypeError(f"expected a byte count of at least 1, got {text!r}")
    return int(value)


def _argument(field: dataclasses.Field, hint) -> dict:
    """argparse keywords for one `SpeculationConfig` field of type ``hint`` (default None: unset)."""
    shown = "" if field.default is None else f" (default {field.default})"
    options = {"dest": f"speculation_{field.name}", "default": None, "help": field.metadata["help"] + shown}
    choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
    if hint is bool:
        return {**options, "action": argparse.BooleanOptionalAction}
    if choices:
        return {**options, "choices": choices}
    kind = next((t for t in (int, str) if t in (hint, *typing.get_args(hint))), str)
    return {**options, "type": kind, "metavar": field.metadata.get("metavar")}


def add_placement_flags(parser: argparse.ArgumentParser) -> None:
    """``--mesh`` and ``--dtype``: where the model runs and in what precision, and the flags of a
    mesh over several processes (`join_processes`)."""
    group = parser.add_argument_group("where the model runs")
    group.add_argument("--mesh", default=None, metavar="AXIS=N,...|auto",
                       help=f"shard the model over a mesh of every device: axes {', '.join(INFERENCE_AXES)} "
                            "(e.g. expert=4,tensor=2; data takes the devices left over), or auto (tensor over the "
                            "heads, then expert over the experts); default: this process's first device")
    group.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                       help="the weights' and computation's dtype, converted shard by shard after loading "
                            "(default: as stored; KDA states stay float32)")
    add_process_flags(group, "a mesh")


def join_processes(args: argparse.Namespace) -> bool:
    """Join the other processes of a multi-process mesh (before any device is touched) when
    ``--coordinator-address`` (or $JAX_COORDINATOR_ADDRESS) is given; True if joined. Every
    process then loads its own shards and runs the same steps; process 0 prints."""
    try:
        address, _ = process_flags(args)
    except ValueError as error:
        raise InputError(str(error)) from None
    if address is None:
        if args.num_processes is not None or args.process_id is not None:
            raise InputError("--num-processes and --process-id need --coordinator-address (or "
                             "$JAX_COORDINATOR_ADDRESS): run the same command on every process")
        return False
    if args.mesh is None:
        raise InputError("several processes run one model on a mesh: give --mesh (e.g. --mesh auto)")
    try:
        return initialize_distributed(address, args.num_processes, args.process_id, args.heartbeat_timeout)
    except Exception as error:  # noqa: BLE001 - JAX raises its own runtime errors
        raise InputError(f"cannot join the processes at {address}: {' '.join(str(error).split())[:300]}") from None


def load_model(args: argparse.Namespace) -> LoadedRun:
    """The run ``args.run`` at ``args.step``, placed and cast as ``--mesh`` and ``--dtype`` say,
    after joining the other processes (`join_processes`)."""
    join_processes(args)
    return load_run(args.run, args.step, mesh=args.mesh, dtype=args.dtype)


def is_reporter() -> bool:
    """Whether this process prints and writes what a program reports: process 0 of a
    multi-process mesh (the others run the same steps silently), or the only one."""
    import jax
    return jax.process_index() == 0


def add_speculation_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `SpeculationConfig` field, in a group of their own."""
    group = parser.add_argument_group("speculative decoding (greedy output unchanged, sampled output keeps its "
                                      "distribution)")
    hints = typing.get_type_hints(SpeculationConfig)
    for field in dataclasses.fields(SpeculationConfig):
        group.add_argument(field.metadata["flag"], **_argument(field, hints[field.name]))


def speculation_settings(args: argparse.Namespace) -> SpeculationConfig | None:
    """The settings the flags ask for (None: no draft source given), validated by the dataclass."""
    fields = {field.name: field for field in dataclasses.fields(SpeculationConfig)}
    given = {name: getattr(args, f"speculation_{name}") for name in fields
             if getattr(args, f"speculation_{name}") is not None}
    if not any(name in given for name in SOURCES):
        if given:
            flags = " and ".join(fields[name].metadata["flag"] for name in given)
            raise InputError(f"{flags} need{'s' if len(given) == 1 else ''} --prompt-lookup or --draft")
        return None
    try:
        return SpeculationConfig(**given)
    except ConfigError as error:
        flag = fields[error.key].metadata["flag"] if error.key in fields else "speculation"
        raise InputError(f"{flag}: {error.message}") from None


def speculation_from(args: argparse.Namespace, config) -> tuple[SpeculationConfig | None, object]:
    """``(settings, draft model)`` the flags ask for on a run trained with ``config``: the draft run
    loaded and checked against it (`k3jax.inference.load_draft`), in ``--dtype``, beside a ``--mesh``
    on a mesh of its own (`k3jax.inference.draft_mesh`); ``(None, None)``: no speculation."""
    settings = speculation_settings(args)
    if settings is None or settings.draft is None:
        return settings, None
    return settings, load_draft_beside(settings.draft, config, args)


def load_draft_beside(path: str, config, args: argparse.Namespace):
    """The draft run ``path``'s model, checked against a run trained with ``config``, placed beside
    the model ``--mesh`` places (`k3jax.inference.draft_mesh`) in ``--dtype``."""
    return load_draft(path, config, mesh=draft_mesh(args.mesh is not None), dtype=args.dtype)


def shared_lines(stream):
    """The lines of ``stream`` as process 0 reads them, on every process of a multi-process mesh
    (sent one by one as read, `k3jax.inference.mirror`: each process then runs the same steps for
    the same line, however long process 0 waits for it); ``stream`` itself in one process."""
    from k3jax.inference.mirror import Channel, Leader, follow_lines

    channel = Channel.joined(namespace="k3jax/lines/")
    if channel is None:
        yield from stream
    elif channel.leads:
        yield from Leader(channel).lines(stream)
    else:
        yield from follow_lines(channel)

