"""A deadline for the statements on one connection, kept by the client.

A server that stops answering (a host gone, packets dropped, a proxy whose backend hangs)
leaves the caller waiting on its socket: the server's statement_timeout never starts, and
TCP notices only when its keepalives or tcp_user_timeout give up, if nothing on the way
acknowledges for the server. Within `deadline(connection, at=...)` one thread of the process
watches the time: past `at`, it shuts the connection's socket down, so that the statement
waiting on it fails at once with psycopg's `OperationalError`, and the connection, broken, is
never used again. Its unsent data is dropped when the socket closes (SO_LINGER 0: a reset, not
a late delivery), though what the network already holds may still reach the server: a
statement that must not take effect late checks the time itself (the webhook's reservation).

Entering and leaving costs a lock and a duplicated file descriptor; the watching thread
sleeps until the earliest deadline and wakes only to shut a socket down or to tidy up.
"""

from __future__ import annotations

import heapq
import itertools
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# Linger on, for 0 s: closing the socket resets the connection and drops what is unsent.
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)


@dataclass(slots=True)
class Watch:
    """One deadline: the connection's socket (a duplicate of its descriptor, ours to close)
    and whether it was shut down."""

    descriptor: int
    done: bool = False
    expired: bool = False


_lock = threading.Lock()
_changed = threading.Condition(_lock)
# (at, order, watch), earliest first; a watch that is done leaves when it comes first.
_watches: list[tuple[float, int, Watch]] = []
_order = itertools.count()
_watcher: threading.Thread | None = None


@contextmanager
def deadline(connection: Any, *, at: float) -> Iterator[Watch]:
    """Within it, the socket of `connection` (a psycopg connection) is shut down at
    `time.monotonic()` `at` (the watch's `expired` says so afterwards)."""
    global _watcher
    watch = Watch(descriptor=os.dup(connection.fileno()))
    with _lock:
        if _watcher is None or not _watcher.is_alive():
            _watcher = threading.Thread(target=_watch, name="tally-db-deadline", daemon=True)
            _watcher.start()
        first = not _watches or at < _watches[0][0]
        heapq.heappush(_watches, (at, next(_order), watch))
        if first:
            _changed.notify()
    try:
        yield watch
    finally:
        # Under the lock: the watcher never shuts a descriptor down once it is closed here.
        with _lock:
            watch.done = True
            os.close(watch.descriptor)


def _watch() -> None:
    while True:
        with _lock:
            while _watches and _watches[0][2].done:
                heapq.heappop(_watches)
            if not _watches:
                _changed.wait()
                continue
            left = _watches[0][0] - time.monotonic()
            if left > 0:
                _changed.wait(left)
                continue
            _, _, expired = heapq.heappop(_watches)
            expired.expired = True
            _shut_down(expired.descriptor)


def _shut_down(descriptor: int) -> None:
    try:
        with socket.socket(fileno=os.dup(descriptor)) as sock:
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed by the server meanwhile: the statement fails anyway
