"""A small Kubernetes API server for tests: Leases and DeviceTaintRules, over plain HTTP.

DeviceTaintRules are served in the resource.k8s.io versions given (`device_taint_rule_versions`,
v1alpha3 by default), and discovery says so: `/apis/resource.k8s.io` lists the group's
versions (`served_resource_versions`, which may include versions without DeviceTaintRules),
`/apis/resource.k8s.io/<version>` the resources of each.

Enough of the real server's behaviour for the real client: GET (one object, or a list with a
`labelSelector` of `key=value` terms), POST (409 AlreadyExists when the name is taken), PUT
(409 Conflict unless the body's `metadata.resourceVersion` is the stored one) and DELETE
(409 when `preconditions.resourceVersion` is stale, 404 when missing). Every write bumps one
global resourceVersion. `requests` records (method, path) for assertions.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from kubernetes import client as k8s

# path pattern → (kind, apiVersion); group "ns" is the namespace, "name" the object's name.
LEASE_ROUTE = (
    re.compile(
        r"^/apis/coordination\.k8s\.io/v1/namespaces/(?P<ns>[^/]+)/leases(?:/(?P<name>[^/]+))?$"
    ),
    ("Lease", "coordination.k8s.io/v1"),
)
RESOURCE_GROUP = "resource.k8s.io"
DISCOVERY = re.compile(r"^/apis/resource\.k8s\.io/?(?:(?P<version>[^/]+)/?)?$")


def _taint_rule_route(version: str) -> tuple[re.Pattern[str], tuple[str, str]]:
    return (
        re.compile(rf"^/apis/resource\.k8s\.io/{version}/devicetaintrules(?:/(?P<name>[^/]+))?$"),
        ("DeviceTaintRule", f"{RESOURCE_GROUP}/{version}"),
    )


class FakeApi:
    """The fake server; use as a context manager. `objects[(kind, namespace, name)]`."""

    def __init__(
        self,
        *,
        device_taint_rule_versions: tuple[str, ...] = ("v1alpha3",),
        served_resource_versions: tuple[str, ...] | None = None,
    ) -> None:
        self.device_taint_rule_versions = device_taint_rule_versions
        # The group's versions: by default those with DeviceTaintRules plus v1 (ResourceSlices).
        self.served_resource_versions = served_resource_versions or tuple(
            dict.fromkeys(("v1", *device_taint_rule_versions))
        )
        self.routes = [LEASE_ROUTE] + [_taint_rule_route(v) for v in device_taint_rule_versions]
        self.lock = threading.Lock()
        self.resource_version = 100
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.fake = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def api_client(self) -> k8s.ApiClient:
        configuration = k8s.Configuration()
        configuration.host = self.url
        return k8s.ApiClient(configuration)

    def __enter__(self) -> FakeApi:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()

    def put_object(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store `obj` as if someone else had written it."""
        with self.lock:
            return self._store(kind, obj.get("metadata", {}).get("namespace", ""), obj)

    def get(self, kind: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        with self.lock:
            return copy.deepcopy(self.objects.get((kind, namespace, name)))

    def names(self, kind: str) -> list[str]:
        with self.lock:
            return sorted(name for k, _, name in self.objects if k == kind)

    def _store(self, kind: str, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
        self.resource_version += 1
        stored = copy.deepcopy(obj)
        stored["metadata"]["resourceVersion"] = str(self.resource_version)
        if namespace:
            stored["metadata"]["namespace"] = namespace
        self.objects[(kind, namespace, stored["metadata"]["name"])] = stored
        return copy.deepcopy(stored)

    def handle(
        self, method: str, path: str, query: dict[str, str], body: dict[str, Any] | None
    ) -> tuple[int, dict[str, Any]]:
        discovery = DISCOVERY.match(path)
        if method == "GET" and discovery:
            with self.lock:
                self.requests.append((method, path))
            return self._discovery(discovery.group("version"))
        routed = [(m, route) for pattern, route in self.routes if (m := pattern.match(path))]
        if not routed:
            return 404, _status(404, "NotFound", f"{path} is not served")
        match, (kind, api_version) = routed[0]
        groups = match.groupdict()
        namespace, name = groups.get("ns") or "", groups.get("name")
        with self.lock:
            self.requests.append((method, path))
            key = (kind, namespace, name or "")
            stored = self.objects.get(key)
            if method == "GET" and name is None:
                return 200, self._list(kind, api_version, namespace, query)
            if method == "GET":
                return (200, copy.deepcopy(stored)) if stored else _not_found(kind, name)
            if method == "POST" and body is not None:
                key = (kind, namespace, body["metadata"]["name"])
                if key in self.objects:
                    return 409, _status(409, "AlreadyExists", f"{kind} {key[2]} already exists")
                return 201, self._store(kind, namespace, body)
            if method == "PUT" and body is not None:
                if stored is None:
                    return _not_found(kind, name)
                sent = (body.get("metadata") or {}).get("resourceVersion")
                if sent != stored["metadata"]["resourceVersion"]:
                    return 409, _status(409, "Conflict", f"the object {name} has been modified")
                return 200, self._store(kind, namespace, body)
            if method == "DELETE":
                if stored is None:
                    return _not_found(kind, name)
                wanted = ((body or {}).get("preconditions") or {}).get("resourceVersion")
                if wanted and wanted != stored["metadata"]["resourceVersion"]:
                    return 409, _status(409, "Conflict", "precondition failed")
                del self.objects[key]
                return 200, _status(200, "", "deleted") | {"status": "Success"}
        return 405, _status(405, "MethodNotAllowed", method)

    def _discovery(self, version: str | None) -> tuple[int, dict[str, Any]]:
        """The group's APIGroup document, or one version's APIResourceList."""
        if version is None:
            versions = [
                {"groupVersion": f"{RESOURCE_GROUP}/{v}", "version": v}
                for v in self.served_resource_versions
            ]
            return 200, {
                "kind": "APIGroup",
                "apiVersion": "v1",
                "name": RESOURCE_GROUP,
                "versions": versions,
                "preferredVersion": versions[0],
            }
        if version not in self.served_resource_versions:
            return 404, _status(404, "NotFound", f"{RESOURCE_GROUP}/{version} is not served")
        resources = [
            {"name": "resourceslices", "namespaced": False, "kind": "ResourceSlice"},
            {"name": "deviceclasses", "namespaced": False, "kind": "DeviceClass"},
        ]
        if version in self.device_taint_rule_versions:
            resources.append(
                {"name": "devicetaintrules", "namespaced": False, "kind": "DeviceTaintRule"}
            )
        return 200, {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{RESOURCE_GROUP}/{version}",
            "resources": resources,
        }

    def _list(
        self, kind: str, api_version: str, namespace: str, query: dict[str, str]
    ) -> dict[str, Any]:
        terms = [t.split("=", 1) for t in (query.get("labelSelector") or "").split(",") if t]
        items = [
            copy.deepcopy(obj)
            for (k, ns, _), obj in sorted(self.objects.items())
            if k == kind
            and (not namespace or ns == namespace)
            and all((obj["metadata"].get("labels") or {}).get(k2) == v for k2, v in terms)
        ]
        return {
            "apiVersion": api_version,
            "kind": f"{kind}List",
            "metadata": {"resourceVersion": str(self.resource_version)},
            "items": items,
        }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _serve(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        fake: FakeApi = self.server.fake  # type: ignore[attr-defined]
        status, answer = fake.handle(self.command, url.path, dict(parse_qsl(url.query)), body)
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = _serve


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


def _not_found(kind: str, name: str | None) -> tuple[int, dict[str, Any]]:
    return 404, _status(404, "NotFound", f"{kind} {name} not found")
