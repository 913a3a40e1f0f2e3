"""One program across the processes of a jax.distributed mesh: process 0 leads, the others follow.

A model whose mesh spans several processes runs a compiled program only when every process
launches it, with the same host arguments, in the same order. Process 0 (the leader) owns what
arrives from outside — HTTP requests, the terminal — and decides what runs; the others follow:

    Channel          messages from the leader to every follower, in order, through jax.distributed's
                     key-value store: message n under ``k3jax/mirror/<n>``. Not a device collective,
                     so a follower can wait for the next one as long as the leader idles (CPU
                     collectives give up after 30 s); the leader deletes what every follower has
                     read and waits while the slowest is `WINDOW` messages behind.
    Mirrored         the leader's view of an object whose calls launch programs (a session store, a
                     speculator): each method call is sent (target, method, pickled arguments)
                     before it is made, so the followers make it at the same time.
    follow           a follower's loop: make each call the leader made, on its own copy of the
                     object (built the same way, from the same checkpoint and flags), until `stop`.
    on_the_leader    a value computed by the leader alone (a call with effects: a reward, a tool)
                     and taken by every follower.

Every call is mirrored, reads too, so each copy's host state — slot and page tables, the prefix
cache, snapshots, sampling positions — goes through the same changes in the same order and every
program meets its peers with the same arguments. A call that raises on the leader raises the same
error on each follower, which logs it and goes on. Results that are handles the leader keeps (a
`k3jax.sessions.Snapshot`: the store releases a snapshot once its handle is garbage-collected)
are kept by each follower until the leader's handle is collected, so snapshots live as long on
every process. Nothing else a call returns crosses: each process computes its own.
"""
from __future__ import annotations

import logging
import pickle
import threading
import time
import weakref
from typing import Any, Iterable, Iterator, Mapping

from k3jax.sharding.lost_peers import PeerLost

log = logging.getLogger("k3jax.mirror")

NAMESPACE = "k3jax/mirror/"
WINDOW = 4096            # messages the slowest follower may be behind before the leader waits
ACK_EVERY = 64           # a follower says how far it has read every this many messages
POLL_MS = 1000           # a follower's wait for the next message, between checks of the channel
# How long a follower that finds process 0 gone waits for JAX's coordination service to end it (the
# service sees the same loss, usually within milliseconds, and `k3jax.sharding.lost_peers` turns its
# fatal log into one line) before it raises `PeerLost` itself: one way for a run to stop, not two.
SERVICE_STOP_GRACE_S = 10.0


class Channel:
    """Ordered messages (bytes) from process 0 to the ``count - 1`` others of a jax.distributed
    run, through its key-value store ``client``; ``process`` is this process's index."""

    def __init__(self, client, process: int, count: int, namespace: str = NAMESPACE):
        self.client, self.process, self.count, self.namespace = client, process, count, namespace
        self._next = 0            # the leader: the next message's number; a follower: the next to read
        self._deleted = 0         # the leader: messages below this are deleted
        self._lock = threading.Lock()

    @classmethod
    def joined(cls, namespace: str = NAMESPACE) -> Channel | None:
        """The channel of the jax.distributed run this process joined; None in one process."""
        import jax
        from jax._src import distributed      # the coordination service's client (no public handle)

        client = distributed.global_state.client
        if client is None or jax.process_count() == 1:
            return None
        return cls(client, jax.process_index(), jax.process_count(), namespace)

    @property
    def leads(self) -> bool:
        return self.process == 0

    def send(self, payload: bytes) -> None:
        """The leader: message ``payload`` to every follower."""
        with self._lock:
            self.client.key_value_set_bytes(self._key(self._next), payload)
            self._next += 1
            if self._next % ACK_EVERY == 0:
                self._delete_read()

    def receive(self) -> bytes:
        """A follower: the next message, waiting as long as it takes. A lost coordinator (process
        0 gone) ends the wait: JAX's coordination service stops this process, or after
        `SERVICE_STOP_GRACE_S` without that, `PeerLost`."""
        key = self._key(self._next)
        while True:
            try:
                payload = self.client.blocking_key_value_get_bytes(key, POLL_MS)
                break
            except Exception as error:          # noqa: BLE001 - JAX raises its runtime error type
                if "DEADLINE_EXCEEDED" not in str(error):
                    time.sleep(SERVICE_STOP_GRACE_S)
                    raise PeerLost(f"process 0 is gone: {str(error).splitlines()[0][:200]}") from None
        self._next += 1
        if self._next % ACK_EVERY == 0:
            self.client.key_value_set(self._read_key(self.process), str(self._next), allow_overwrite=True)
        return payload

    def said_by_every_process(self, name: str, text: str, timeout_s: float = 3600.0) -> list[str]:
        """Every process's ``text`` for ``name`` (once per run), in process order, on every
        process: each writes its own and waits for the others'. Unlike a device collective it lets
        the processes arrive when they do -- one that failed early, one still reading -- so that all
        can decide together what to do next."""
        self.client.key_value_set(f"{self.namespace}said/{name}/{self.process}", text)
        return [self.client.blocking_key_value_get(f"{self.namespace}said/{name}/{process}", int(timeout_s * 1000))
                for process in range(self.count)]

    def _key(self, number: int) -> str:
        return f"{self.namespace}{number}"

    def _read_key(self, process: int) -> str:
        return f"{self.namespace}read/{process}"

    def _read_by_all(self) -> int:
        """How many messages every follower has said it read."""
        said = dict(self.client.key_value_dir_get(f"{self.namespace}read/"))
        return min(int(said.get(self._read_key(p), 0)) for p in range(1, self.count))

    def _delete_read(self) -> None:
        """Delete the messages every follower has read; wait while the slowest is more than
        `WINDOW` behind (it is busy with programs the leader has already run)."""
        while True:
            read = self._read_by_all()
            for number in range(self._deleted, read):
                self.client.key_value_delete(self._key(number))
            self._deleted = max(self._deleted, read)
            if self._next - read <= WINDOW:
                return
            time.sleep(0.01)


def on_the_leader(channel: Channel | None, compute):
    """``compute()`` on the leader alone, its (picklable) value sent to every follower, which returns
    it without computing: a call with effects (a sandbox, a judge model, a quota, a tool) runs once,
    and one that is not deterministic gives every process the same value. What ``compute`` raises on
    the leader (an error, a signal's stop) is sent too and raised on every follower, so all stop
    together. ``channel`` None (one process): ``compute()`` here."""
    if channel is None:
        return compute()
    if not channel.leads:
        outcome, value = pickle.loads(channel.receive())
        if outcome == "raised":
            raise value
        return value
    try:
        value = compute()
    except BaseException as error:
        channel.send(pickle.dumps(("raised", error)))
        raise
    channel.send(pickle.dumps(("value", value)))
    return value


class Leader:
    """The leader's side of a `Channel`: mirrored calls and the lifetimes of kept handles."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self._number = 0                   # calls sent so far
        self._keep_last = False            # the last call's result is a handle followers must keep
        self._forgotten: list[int] = []    # calls whose kept handles the leader has dropped
        self._forgotten_lock = threading.Lock()

    def call(self, target: str, method: str, args: tuple, kwargs: dict) -> int:
        """Send the call ``target.method(*args, **kwargs)`` -> its number."""
        with self._forgotten_lock:
            forgotten, self._forgotten = self._forgotten, []
        number, self._number = self._number, self._number + 1
        self._send(("call", number, self._keep_last, forgotten, target, method, args, kwargs))
        self._keep_last = False
        return number

    def keep(self, number: int, handle: Any) -> None:
        """Followers keep call ``number``'s result until ``handle`` (the leader's) is collected."""
        self._keep_last = True
        weakref.finalize(handle, self._forget, number)

    def stop(self) -> None:
        """The followers' `follow` returns."""
        self._send(("stop",))

    def lines(self, stream: Iterable[str]) -> Iterator[str]:
        """The lines of ``stream``, each sent to the followers (`follow_lines`) as it is read."""
        for line in stream:
            self._send(("line", line))
            yield line
        self._send(("stop",))

    def _forget(self, number: int) -> None:          # a finalizer: any thread, any moment
        with self._forgotten_lock:
            self._forgotten.append(number)

    def _send(self, message: tuple) -> None:
        self.channel.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


class Mirrored:
    """``target`` as the leader uses it: every method call goes to the followers first (they make
    it on their own copy, named ``name`` in `follow`'s ``targets``), then is made here. Results of
    a type in ``handles`` are kept by the followers as long as the leader holds them. Attributes
    that are not methods are read here only."""

    def __init__(self, target: Any, name: str, leader: Leader, handles: tuple[type, ...] = ()):
        self._target, self._name, self._leader, self._handles = target, name, leader, handles

    def __getattr__(self, attribute: str):
        value = getattr(self._target, attribute)
        if not callable(value):
            return value

        def mirrored(*args, **kwargs):
            number = self._leader.call(self._name, attribute, args, kwargs)
            result = value(*args, **kwargs)
            if isinstance(result, self._handles):
                self._leader.keep(number, result)
            return result
        return mirrored


def _messages(channel: Channel) -> Iterator[tuple]:
    while True:
        message = pickle.loads(channel.receive())
        if message[0] == "stop":
            return
        yield message


def follow(channel: Channel, targets: Mapping[str, Any]) -> int:
    """A follower: make every call the leader's `Mirrored` objects make, on ``targets`` (name ->
    this process's copy), until the leader stops -> the number of calls made."""
    kept: dict[int, Any] = {}
    last: tuple[int, Any] = (-1, None)
    calls = 0
    for message in _messages(channel):
        _, number, keep_last, forgotten, target, method, args, kwargs = message
        if keep_last:
            kept[last[0]] = last[1]
        for done in forgotten:
            kept.pop(done, None)
        try:
            last = (number, getattr(targets[target], method)(*args, **kwargs))
        except Exception as error:        # noqa: BLE001 - the leader met the same error and answers for it
            log.debug("mirrored %s.%s raised %s: %s", target, method, type(error).__name__, error)
            last = (number, None)
        calls += 1
    return calls


def follow_lines(channel: Channel) -> Iterator[str]:
    """A follower: the lines the leader's `Leader.lines` read, as it reads them."""
    for _, line in _messages(channel):
        yield line
