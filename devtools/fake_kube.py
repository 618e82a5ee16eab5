"""A small Kubernetes API server for tests and benchmarks: enough LIST and WATCH for the real
client.

It serves nodes, device classes, resource slices and resource claims over plain HTTP on
127.0.0.1, the way the API server does where the sync cares: paged lists with continue tokens
(a token older than the compaction point answers 410), watches that stream newline-delimited
JSON events from a resourceVersion (BOOKMARK events on request; a resourceVersion older than
the compaction point gets an ERROR event with a 410 Status, or an HTTP 410), and list items
without `kind`/`apiVersion`, as the real server sends them. It also answers GET of one Pod,
ReplicaSet or Job by namespace and name (the owners of claims), 404 for one it does not hold,
and GET of one custom object (`add_custom`: JobSets, PodGroups, training jobs, the objects
that declare gangs) at /apis/<group>/<version>/namespaces/<ns>/<plural>/<name>, 404 for one
it does not hold or a version it does not serve it in.

The test drives it: `add`/`modify`/`delete` objects (each bumps the one global
resourceVersion and reaches the watchers), `compact` the history, `drop_streams` abruptly,
`send_bookmarks`, make it `unavailable` or some kinds `forbidden`, and read back `requests`
(`reads` for the GETs of one object). It stops itself when the `with` block ends, and after
`max_lifetime_seconds` in any case.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, urlsplit

# path → (kind, apiVersion)
COLLECTIONS: dict[str, tuple[str, str]] = {
    "/api/v1/nodes": ("Node", "v1"),
    "/apis/resource.k8s.io/v1/deviceclasses": ("DeviceClass", "resource.k8s.io/v1"),
    "/apis/resource.k8s.io/v1/resourceslices": ("ResourceSlice", "resource.k8s.io/v1"),
    "/apis/resource.k8s.io/v1/resourceclaims": ("ResourceClaim", "resource.k8s.io/v1"),
}
# The kinds served one object at a time, by namespace and name (no list, no watch).
OBJECT_PATHS: dict[str, re.Pattern[str]] = {
    "Pod": re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)"),
    "ReplicaSet": re.compile(r"/apis/apps/v1/namespaces/([^/]+)/replicasets/([^/]+)"),
    "Job": re.compile(r"/apis/batch/v1/namespaces/([^/]+)/jobs/([^/]+)"),
}
KINDS = {kind for kind, _ in COLLECTIONS.values()} | OBJECT_PATHS.keys()
# GET of one namespaced custom object: group, version, namespace, plural, name.
CUSTOM_OBJECT_PATH = re.compile(r"/apis/([^/]+)/([^/]+)/namespaces/([^/]+)/([^/]+)/([^/]+)")
FIRST_RESOURCE_VERSION = 1000
DEFAULT_WATCH_SECONDS = 1800.0

Key = tuple[str, str]  # (namespace, name); namespace is "" for cluster-scoped objects


@dataclass
class RecordedRequest:
    """A request as the server received it, and the HTTP status it answered (once it has)."""

    path: str
    query: dict[str, str]
    status: int | None = None

    @property
    def watch(self) -> bool:
        return _flag(self.query.get("watch"))

    @property
    def kind(self) -> str | None:
        collection = COLLECTIONS.get(self.path)
        return collection[0] if collection else None

    @property
    def custom_read(self) -> tuple[str, str, str, str, str] | None:
        """(group, version, plural, namespace, name) of a GET of one custom object."""
        if self.read is not None or self.watch:
            return None
        if found := CUSTOM_OBJECT_PATH.fullmatch(self.path):
            group, version, namespace, plural, name = found.groups()
            return group, version, plural, namespace, name
        return None

    @property
    def read(self) -> tuple[str, str, str] | None:
        """(kind, namespace, name) of a GET of one object; None for anything else."""
        for kind, pattern in OBJECT_PATHS.items():
            if found := pattern.fullmatch(self.path):
                return kind, found[1], found[2]
        return None


@dataclass(frozen=True)
class _Event:
    resource_version: int
    kind: str
    type: str
    obj: dict[str, Any]


@dataclass
class _WatchSignals:
    """Counters a stream compares against to notice the test's drop/bookmark calls."""

    drops: int = 0
    bookmarks: int = 0


@dataclass
class _Batch:
    """What a watch stream sends next."""

    events: list[_Event] = field(default_factory=list)
    hang_up: bool = False
    half_event: bool = False
    expired: bool = False
    ended: bool = False


@dataclass
class _Stream:
    """One open watch: where it stands and what it sends next."""

    kind: str
    cursor: int
    bookmarks: bool
    deadline: float
    signals: _WatchSignals
    compacted: int = 0
    batch: _Batch = field(default_factory=_Batch)

    def __post_init__(self) -> None:
        self.signals = copy.copy(self.signals)

    def gone(self) -> dict[str, Any]:
        message = f"too old resource version: {self.cursor} ({self.compacted})"
        return _status(410, "Expired", message)


@dataclass
class _Continue:
    resource_version: int
    remaining: list[dict[str, Any]] = field(default_factory=list)


class FakeKube:
    """The fake API server. Use as a context manager; `url` is where it listens."""

    def __init__(self, *, max_lifetime_seconds: float = 60.0) -> None:
        self._cond = threading.Condition()
        self._resource_version = FIRST_RESOURCE_VERSION
        self._objects: dict[str, dict[Key, dict[str, Any]]] = {kind: {} for kind in KINDS}
        # (group, version, plural) → objects served one at a time (`add_custom`).
        self._custom: dict[tuple[str, str, str], dict[Key, dict[str, Any]]] = {}
        self._history: list[_Event] = []
        self._compacted = 0
        self._continues: dict[str, _Continue] = {}
        self._signals = _WatchSignals()
        self._drop_partial = False
        self._stopped = False
        self._connections: set[socket.socket] = set()
        self.requests: list[RecordedRequest] = []
        # Answer a too-old watch with HTTP 410 instead of an ERROR event in a 200 stream.
        self.gone_as_http = False
        # Answer every request with 503, as an API server does while it starts or is overloaded.
        self.unavailable = False
        # Kinds whose objects are answered 403, as for a service account without `get` on them.
        self.forbidden: set[str] = set()
        # Called with each request before it is served (to change the state between pages).
        self.on_request: Callable[[RecordedRequest], None] | None = None
        self._server = _Server(self)
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="fake-kube", daemon=True
        )
        self._lifetime = threading.Timer(max_lifetime_seconds, self.stop)
        self._lifetime.daemon = True

    # Life cycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeKube:
        self._thread.start()
        self._lifetime.start()
        return self

    def stop(self) -> None:
        """Stop serving, end every stream and close every connection. Safe to call twice."""
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
            self._cond.notify_all()
            connections = list(self._connections)
        self._lifetime.cancel()
        self._server.shutdown()
        for sock in connections:
            _shutdown(sock)
        self._server.server_close()

    def __enter__(self) -> FakeKube:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def write_kubeconfig(self, path: Path, *, context: str = "fake") -> Path:
        """Write a kubeconfig (plain HTTP, no credentials) whose `context` points here."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": context, "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": context,
        }
        path.write_text(json.dumps(config, indent=2))
        return path

    # What the test does -------------------------------------------------------------------

    @property
    def resource_version(self) -> str:
        with self._cond:
            return str(self._resource_version)

    def add(self, obj: dict[str, Any]) -> str:
        """Create `obj` (it names its `kind`); returns the new resourceVersion."""
        return self._change("ADDED", obj, must_exist=False)

    def add_custom(self, obj: dict[str, Any], plural: str) -> None:
        """Serve the custom object `obj` (a JobSet, a PodGroup...) by GET, in its apiVersion
        only, as `plural`. Not listed or watched: nothing here follows these kinds."""
        group, _, version = obj["apiVersion"].partition("/")
        metadata = obj["metadata"]
        key = (metadata.get("namespace") or "default", metadata["name"])
        stored = copy.deepcopy(obj)
        stored["metadata"].setdefault("uid", f"uid-{plural}-{key[0]}-{key[1]}")
        with self._cond:
            self._custom.setdefault((group, version, plural), {})[key] = stored

    def custom_reads(self, plural: str) -> list[RecordedRequest]:
        """The GETs of single custom objects of `plural`, in the order received."""
        with self._cond:
            return [
                r for r in self.requests if r.custom_read is not None and r.custom_read[2] == plural
            ]

    def modify(self, obj: dict[str, Any]) -> str:
        """Replace the stored object of the same kind, namespace and name."""
        return self._change("MODIFIED", obj, must_exist=True)

    def delete(self, kind: str, name: str, namespace: str = "") -> str:
        """Delete an object; watchers get its last state with the deletion's resourceVersion."""
        with self._cond:
            obj = self._objects[kind].pop((namespace, name))
            return self._record("DELETED", kind, obj)

    def compact(self) -> None:
        """Forget the history up to now: older resourceVersions and continue tokens give 410."""
        with self._cond:
            self._compacted = self._resource_version
            self._history = [e for e in self._history if e.resource_version > self._compacted]
            self._continues = {
                token: entry
                for token, entry in self._continues.items()
                if entry.resource_version >= self._compacted
            }
            self._cond.notify_all()

    def drop_streams(self, *, partial: bool = True) -> None:
        """Cut every open watch without ending it properly (mid-event when `partial`)."""
        with self._cond:
            self._drop_partial = partial
            self._signals.drops += 1
            self._cond.notify_all()

    def send_bookmarks(self) -> None:
        """Send a BOOKMARK at the current resourceVersion to watches that allow them."""
        with self._cond:
            self._signals.bookmarks += 1
            self._cond.notify_all()

    def wait_for_request(
        self, predicate: Callable[[RecordedRequest], bool], *, timeout: float = 5.0
    ) -> RecordedRequest:
        """The first request (already received or yet to come) that matches `predicate`."""
        with self._cond:
            found: list[RecordedRequest] = []

            def match() -> bool:
                found[:] = [request for request in self.requests if predicate(request)][:1]
                return bool(found)

            if not self._cond.wait_for(match, timeout):
                seen = [(r.path, r.query, r.status) for r in self.requests]
                raise AssertionError(f"no matching request within {timeout}s; received {seen}")
            return found[0]

    def watches(self, kind: str) -> list[RecordedRequest]:
        with self._cond:
            return [r for r in self.requests if r.watch and r.kind == kind]

    def lists(self, kind: str) -> list[RecordedRequest]:
        with self._cond:
            return [r for r in self.requests if not r.watch and r.kind == kind]

    def reads(self, kind: str) -> list[RecordedRequest]:
        """The GETs of single objects of `kind`, in the order received."""
        with self._cond:
            return [r for r in self.requests if r.read is not None and r.read[0] == kind]

    # State, under the lock ----------------------------------------------------------------

    def _change(self, event_type: str, obj: dict[str, Any], *, must_exist: bool) -> str:
        kind = obj["kind"]
        metadata = obj["metadata"]
        key = (metadata.get("namespace", ""), metadata["name"])
        with self._cond:
            objects = self._objects[kind]
            if must_exist != (key in objects):
                state = "missing" if must_exist else "already there"
                raise KeyError(f"{kind} {key} is {state}")
            stored = copy.deepcopy(obj)
            stored["metadata"].setdefault("uid", f"uid-{kind.lower()}-{key[0]}-{key[1]}")
            stored["metadata"].setdefault("creationTimestamp", "2025-01-01T00:00:00Z")
            objects[key] = stored
            return self._record(event_type, kind, stored)

    def _record(self, event_type: str, kind: str, obj: dict[str, Any]) -> str:
        self._resource_version += 1
        obj["metadata"]["resourceVersion"] = str(self._resource_version)
        self._history.append(_Event(self._resource_version, kind, event_type, copy.deepcopy(obj)))
        self._cond.notify_all()
        return str(self._resource_version)

    def _pending(self, kind: str, after: int) -> list[_Event]:
        # The history is in resourceVersion order: start after `after` without a scan, so a
        # long history (the sync benchmark's) costs a watcher only what it has not seen.
        start = bisect.bisect_right(self._history, after, key=lambda e: e.resource_version)
        return [e for e in self._history[start:] if e.kind == kind]

    def _open_stream(
        self, kind: str, *, requested: str, bookmarks: bool, seconds: float
    ) -> _Stream:
        with self._cond:
            # "" or "0": start now, with the current objects as synthetic ADDED events.
            start_now = requested in ("", "0")
            cursor = self._resource_version if start_now else int(requested)
            stream = _Stream(kind, cursor, bookmarks, time.monotonic() + seconds, self._signals)
            stream.batch.expired = cursor < self._compacted
            stream.compacted = self._compacted
            if start_now:
                stream.batch.events = [
                    _Event(cursor, kind, "ADDED", copy.deepcopy(obj))
                    for obj in self._objects[kind].values()
                ]
            return stream

    def _next_batch(self, stream: _Stream) -> None:
        """Wait for what the stream has to send next: events, a bookmark, a hang-up or its end."""
        with self._cond:

            def woken() -> bool:
                return bool(
                    self._stopped
                    or self._signals != stream.signals
                    or stream.cursor < self._compacted
                    or self._pending(stream.kind, stream.cursor)
                )

            self._cond.wait_for(woken, max(0.0, stream.deadline - time.monotonic()))
            dropped = self._signals.drops != stream.signals.drops
            batch = _Batch(
                events=self._pending(stream.kind, stream.cursor),
                hang_up=self._stopped or dropped,
                half_event=dropped and self._drop_partial,
                expired=stream.cursor < self._compacted,
            )
            if stream.bookmarks and self._signals.bookmarks != stream.signals.bookmarks:
                batch.events.append(
                    _Event(
                        self._resource_version,
                        stream.kind,
                        "BOOKMARK",
                        _bookmark(stream.kind, self._resource_version),
                    )
                )
            batch.ended = not batch.events and time.monotonic() >= stream.deadline
            stream.batch = batch
            stream.signals = copy.copy(self._signals)
            stream.compacted = self._compacted
            # Every event of the kind up to now is in this batch.
            stream.cursor = self._resource_version

    # Serving ------------------------------------------------------------------------------

    def _received(self, request: RecordedRequest) -> None:
        with self._cond:
            self.requests.append(request)
            self._cond.notify_all()
        if self.on_request is not None:
            self.on_request(request)

    def _answered(self, request: RecordedRequest, status: int) -> None:
        with self._cond:
            request.status = status
            self._cond.notify_all()

    def _list(self, kind: str, query: dict[str, str]) -> tuple[int, dict[str, Any]]:
        limit = int(query.get("limit") or 0)
        token = query.get("continue")
        with self._cond:
            if token:
                entry = self._continues.get(token)
                if entry is None:
                    return 410, _status(
                        410, "Expired", "The provided continue parameter is too old"
                    )
                resource_version, remaining = entry.resource_version, entry.remaining
            else:
                resource_version = self._resource_version
                remaining = [copy.deepcopy(obj) for _, obj in sorted(self._objects[kind].items())]
            page, rest = (remaining[:limit], remaining[limit:]) if limit else (remaining, [])
            metadata: dict[str, Any] = {"resourceVersion": str(resource_version)}
            if rest:
                next_token = f"{kind}-{resource_version}-{len(self.requests)}"
                self._continues[next_token] = _Continue(resource_version, rest)
                metadata["continue"] = next_token
                metadata["remainingItemCount"] = len(rest)
        for item in page:
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return 200, {
            "kind": f"{kind}List",
            "apiVersion": _api_version(kind),
            "metadata": metadata,
            "items": page,
        }

    def _read(self, kind: str, namespace: str, name: str) -> tuple[int, dict[str, Any]]:
        if kind in self.forbidden:
            message = f"cannot get resource {kind.lower()}s in the namespace {namespace!r}"
            return 403, _status(403, "Forbidden", message)
        with self._cond:
            obj = self._objects[kind].get((namespace, name))
            if obj is None:
                return 404, _status(404, "NotFound", f"{kind.lower()}s {name!r} not found")
            return 200, copy.deepcopy(obj)

    def _read_custom(
        self, group: str, version: str, plural: str, namespace: str, name: str
    ) -> tuple[int, dict[str, Any]]:
        if f"{plural}.{group}" in self.forbidden:
            message = f"cannot get resource {plural!r} in API group {group!r}"
            return 403, _status(403, "Forbidden", message)
        with self._cond:
            obj = self._custom.get((group, version, plural), {}).get((namespace, name))
            if obj is None:
                return 404, _status(404, "NotFound", f"{plural}.{group} {name!r} not found")
            return 200, copy.deepcopy(obj)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, fake: FakeKube) -> None:
        self.fake = fake
        super().__init__(("127.0.0.1", 0), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-stream is routine here, not worth a traceback.
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Answers leave at once, as from the API server (Go sets TCP_NODELAY on its connections):
    # with Nagle's algorithm, a GET's body waited for the client's delayed ACK of its headers,
    # ~40 ms a read.
    disable_nagle_algorithm = True
    server: _Server

    def setup(self) -> None:
        super().setup()
        with self.server.fake._cond:
            self.server.fake._connections.add(self.connection)

    def finish(self) -> None:
        with self.server.fake._cond:
            self.server.fake._connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        fake = self.server.fake
        url = urlsplit(self.path)
        request = RecordedRequest(url.path, dict(parse_qsl(url.query)))
        fake._received(request)
        collection = COLLECTIONS.get(url.path)
        if fake.unavailable:
            self._send_json(request, 503, _status(503, "ServiceUnavailable", "try again later"))
        elif request.read is not None:
            self._send_json(request, *fake._read(*request.read))
        elif request.custom_read is not None:
            self._send_json(request, *fake._read_custom(*request.custom_read))
        elif collection is None:
            self._send_json(request, 404, _status(404, "NotFound", f"{url.path} is not served"))
        elif request.watch:
            self._watch(request, collection[0])
        else:
            self._send_json(request, *fake._list(collection[0], request.query))

    def _send_json(self, request: RecordedRequest, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        # Recorded before the client can read the answer: a test that asserts on the status
        # right after its call returns must find it there.
        self.server.fake._answered(request, status)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _watch(self, request: RecordedRequest, kind: str) -> None:
        fake = self.server.fake
        query = request.query
        stream = fake._open_stream(
            kind,
            requested=query.get("resourceVersion", ""),
            bookmarks=_flag(query.get("allowWatchBookmarks")),
            seconds=float(query.get("timeoutSeconds") or DEFAULT_WATCH_SECONDS),
        )
        if stream.batch.expired and fake.gone_as_http:
            self._send_json(request, 410, stream.gone())
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        fake._answered(request, 200)
        while True:
            batch = stream.batch
            if batch.hang_up:
                self._abort(half_event=batch.half_event)
                return
            if batch.expired:
                # Too old from the start, or fell behind a compaction as a slow watcher does.
                self._write_event({"type": "ERROR", "object": stream.gone()})
                self._end_stream()
                return
            for event in batch.events:
                self._write_event({"type": event.type, "object": event.obj})
            if batch.ended:
                self._end_stream()
                return
            fake._next_batch(stream)

    def _write_event(self, event: dict[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _abort(self, *, half_event: bool = False) -> None:
        """Hang up without ending the chunked body, as a dying API server or proxy does."""
        if half_event:
            data = json.dumps({"type": "ADDED", "object": {"metadata": {"name": "cut"}}}).encode()
            self.wfile.write(b"%x\r\n%s" % (len(data) + 1, data[: len(data) // 2]))
            self.wfile.flush()
        self.close_connection = True
        _shutdown(self.connection)


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed by the other side
        sock.shutdown(socket.SHUT_RDWR)


def _flag(value: str | None) -> bool:
    # As Go's strconv.ParseBool reads it; the Python client sends "True".
    return (value or "").lower() in ("1", "t", "true")


def _api_version(kind: str) -> str:
    return next(version for k, version in COLLECTIONS.values() if k == kind)


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _bookmark(kind: str, resource_version: int) -> dict[str, Any]:
    return {
        "kind": kind,
        "apiVersion": _api_version(kind),
        "metadata": {"resourceVersion": str(resource_version)},
    }
