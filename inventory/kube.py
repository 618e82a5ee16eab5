"""The client side of Tally's talk with the Kubernetes API: the client, its errors and pauses,
and the writes (Leases for leader election, DeviceTaintRules for taint plans).

Only the `inventory.kube*` modules talk to the API: this one; `inventory.kube_sync` (list +
watch of the DRA objects into the inventory); `inventory.kube_owners` (single reads of claims'
owners and the objects that declare gangs). Objects stay raw JSON (camelCase, unknown fields
kept), never the client's generated models.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import tenacity
import urllib3
from django.conf import settings
from django.db import (
    InterfaceError,
    OperationalError,
)
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_SECONDS = 10
LIST_READ_TIMEOUT_SECONDS = 60
# What a page waits for the API server at most (connect, read): a request worker is not held
# for a minute by an API server that does not answer.
PAGE_TIMEOUT_SECONDS = (3.0, 5.0)


class KubeError(Exception):
    """The sync cannot do what it was asked (bad kubeconfig, a kind that could not be listed)."""


class StreamError(Exception):
    """The API answered something the sync cannot use (an ERROR event, a line that is no JSON)."""


# Failures worth retrying after a pause: the network, the API server, the database.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    urllib3.exceptions.HTTPError,
    ApiException,
    OSError,
    StreamError,
    OperationalError,
    InterfaceError,
)

# What a read made for a page may fail with (the API unreachable, forbidding, no such API):
# the page says so instead of failing.
READ_ERRORS: tuple[type[BaseException], ...] = (
    KubeError,
    ApiException,
    OSError,
    urllib3.exceptions.HTTPError,
)


def describe_error(exc: BaseException) -> str:
    """One short line for a person: the API's status and reason, or the error's first line."""
    if isinstance(exc, ApiException):
        return f"the Kubernetes API answered {exc.status} {exc.reason}"
    text = str(exc)
    return text.splitlines()[0][:300] if text else type(exc).__name__


@dataclass(frozen=True)
class Backoff:
    """How long a loop pauses after failures in a row: about initial * 2^(n-1) after the n-th,
    at most `maximum_seconds`."""

    initial_seconds: float = 0.5
    maximum_seconds: float = 30.0

    def wait(self) -> tenacity.wait_combine:
        # Equal jitter, half fixed and half random: loops that failed together do not retry
        # together, and none retries at once.
        half = self.initial_seconds / 2
        ceiling = self.maximum_seconds / 2
        return tenacity.wait_exponential(multiplier=half, max=ceiling) + (
            tenacity.wait_random_exponential(multiplier=half, max=ceiling)
        )


def api_client(
    *, kubeconfig: str | None = None, context: str | None = None, retries: int | None = None
) -> k8s.ApiClient:
    """A client for the cluster: the pod's service account when running in one, else kubeconfig.

    An explicit `kubeconfig` or `context` wins over the in-cluster config; without them the
    kubeconfig is found the usual way (`$KUBECONFIG`, then `~/.kube/config`). `retries`: how
    often a failed request is tried again (None: urllib3's default, 3); the admission
    webhook's reads are not (0), as each try may wait its whole timeout.
    """
    try:
        configuration = k8s.Configuration()
        if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            k8s_config.load_incluster_config(client_configuration=configuration)
        else:
            # persist_config=False: refreshing a token must not rewrite the operator's kubeconfig.
            # $KUBECONFIG as it is now (the client reads it once, when it is imported).
            k8s_config.load_kube_config(
                config_file=kubeconfig or os.environ.get("KUBECONFIG") or None,
                context=context,
                client_configuration=configuration,
                persist_config=False,
            )
        if retries is not None:
            configuration.retries = retries
        return k8s.ApiClient(configuration)
    except (ConfigException, OSError) as exc:
        where = kubeconfig or "the default kubeconfig"
        raise KubeError(f"cannot load the Kubernetes configuration from {where}: {exc}") from exc


def status_message(exc: ApiException) -> str:
    try:
        status = json.loads(exc.body)
    except (TypeError, ValueError):
        return str(exc.reason)
    return str(status.get("message") or exc.reason)


# Leases (leader election, see inventory.leader) ------------------------------------------
#
# Raw JSON in and out, like the sync: a Lease's MicroTime fields stay the strings the API
# server wrote. A write that loses a race answers None instead of raising: 409 is the
# normal outcome of two candidates trying at once, not an error.

HTTP_NOT_FOUND = 404
HTTP_CONFLICT = 409
WRITE_TIMEOUT_SECONDS = (CONNECT_TIMEOUT_SECONDS, 10)


def decode_json(text: bytes | str) -> Any:
    """JSON text as Python values, as `json.loads` gives them. By orjson, several times as
    fast (the sync decodes every watch event, list page and owner it reads), but for what it
    refuses and the standard library takes (integers over 64 bits, NaN): `json.loads` decides
    those, and raises ValueError for text that is no JSON."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


def response_json(response: urllib3.BaseHTTPResponse) -> dict[str, Any]:
    try:
        data = decode_json(response.data)
    except ValueError as exc:
        raise StreamError(f"the answer is not JSON: {exc}") from exc
    finally:
        response.release_conn()
    if not isinstance(data, dict):
        raise StreamError("the answer is not a JSON object")
    return data


def _unless_status(
    status: int, call: Callable[[], urllib3.BaseHTTPResponse]
) -> dict[str, Any] | None:
    """`call`'s object, or None when the API answered `status`."""
    try:
        return response_json(call())
    except ApiException as exc:
        if exc.status == status:
            return None
        raise


def read_lease(*, api_client: k8s.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    """The Lease `namespace/name` as JSON, or None when there is none."""
    api = k8s.CoordinationV1Api(api_client)
    return _unless_status(
        HTTP_NOT_FOUND,
        lambda: api.read_namespaced_lease(
            name, namespace, _preload_content=False, _request_timeout=WRITE_TIMEOUT_SECONDS
        ),
    )


def create_lease(
    *, api_client: k8s.ApiClient, namespace: str, body: dict[str, Any]
) -> dict[str, Any] | None:
    """Create the Lease `body`; None when one of that name exists already (409)."""
    api = k8s.CoordinationV1Api(api_client)
    return _unless_status(
        HTTP_CONFLICT,
        lambda: api.create_namespaced_lease(
            namespace, body, _preload_content=False, _request_timeout=WRITE_TIMEOUT_SECONDS
        ),
    )


def replace_lease(
    *, api_client: k8s.ApiClient, namespace: str, body: dict[str, Any]
) -> dict[str, Any] | None:
    """Replace the Lease if it is still at `body`'s `metadata.resourceVersion`; None on 409."""
    api = k8s.CoordinationV1Api(api_client)
    return _unless_status(
        HTTP_CONFLICT,
        lambda: api.replace_namespaced_lease(
            body["metadata"]["name"],
            namespace,
            body,
            _preload_content=False,
            _request_timeout=WRITE_TIMEOUT_SECONDS,
        ),
    )


# DeviceTaintRules (the version matrix's action, see inventory.taints) ---------------------
#
# DeviceTaintRule is served as resource.k8s.io/v1alpha3 from Kubernetes 1.33 (feature gate
# DRADeviceTaints, from 1.35 DRADeviceTaintRules; the version enabled with --runtime-config),
# v1beta2 from 1.36 (that version enabled too) and v1 once device taints are GA; which one a
# cluster serves is found by discovery, not assumed. Every version selects by driver, pool and
# device, the only selector fields Tally writes. The calls go through the client's generic
# (custom-object) methods: they form the same paths for any version of a built-in kind.

DEVICE_TAINT_RULE_GROUP = "resource.k8s.io"
DEVICE_TAINT_RULE_PLURAL = "devicetaintrules"
# Most stable first: the first of these the cluster serves DeviceTaintRules in is used.
DEVICE_TAINT_RULE_VERSIONS = ("v1", "v1beta2", "v1alpha3")
_RESOURCE_VERSION_APIS: dict[str, Callable[[k8s.ApiClient], Any]] = {
    "v1": k8s.ResourceV1Api,
    "v1beta2": k8s.ResourceV1beta2Api,
    "v1alpha3": k8s.ResourceV1alpha3Api,
}


def device_taint_rule_api_version(
    *, api_client: k8s.ApiClient, timeout: tuple[float, float] | None = None
) -> str:
    """The `apiVersion` (`resource.k8s.io/<version>`) the cluster serves DeviceTaintRules in.

    Reads the group's discovery document, then each served candidate version's resource list,
    since a version can be served without DeviceTaintRules (feature gate off). Raises
    `KubeError` naming the versions tried when none serves them. `timeout`: (connect, read)
    seconds per request, default the sync's.
    """
    timeout = timeout or (CONNECT_TIMEOUT_SECONDS, LIST_READ_TIMEOUT_SECONDS)
    try:
        group = response_json(
            k8s.ResourceApi(api_client).get_api_group(
                _preload_content=False, _request_timeout=timeout
            )
        )
    except ApiException as exc:
        if exc.status != HTTP_NOT_FOUND:
            raise
        group = {}
    served = {entry.get("version") for entry in group.get("versions") or ()}
    for version in DEVICE_TAINT_RULE_VERSIONS:
        if version not in served:
            continue
        resources = response_json(
            _RESOURCE_VERSION_APIS[version](api_client).get_api_resources(
                _preload_content=False, _request_timeout=timeout
            )
        )
        if any(
            resource.get("name") == DEVICE_TAINT_RULE_PLURAL
            for resource in resources.get("resources") or ()
        ):
            return f"{DEVICE_TAINT_RULE_GROUP}/{version}"
    raise KubeError(
        "the cluster serves no DeviceTaintRule API (looked for resource.k8s.io "
        f"{', '.join(DEVICE_TAINT_RULE_VERSIONS)}; served: {', '.join(sorted(served)) or 'none'}): "
        "enable the DRADeviceTaintRules feature gate (DRADeviceTaints before Kubernetes 1.35) "
        "and its API version"
    )


def _taint_rule_path(api_version: str) -> tuple[str, str, str]:
    group, _, version = api_version.partition("/")
    return group, version, DEVICE_TAINT_RULE_PLURAL


def list_device_taint_rules(
    *,
    api_client: k8s.ApiClient,
    api_version: str,
    label_selector: str,
    timeout: tuple[float, float] | None = None,
) -> list[dict[str, Any]]:
    """Every DeviceTaintRule matching `label_selector`, as JSON (all pages); `timeout` as for
    `device_taint_rule_api_version`."""
    api = k8s.CustomObjectsApi(api_client)
    rules: list[dict[str, Any]] = []
    continue_token: str | None = None
    while True:
        page = response_json(
            api.list_cluster_custom_object(
                *_taint_rule_path(api_version),
                label_selector=label_selector,
                limit=settings.TALLY_SYNC_PAGE_SIZE,
                _continue=continue_token,
                _preload_content=False,
                _request_timeout=timeout or (CONNECT_TIMEOUT_SECONDS, LIST_READ_TIMEOUT_SECONDS),
            )
        )
        for rule in page.get("items") or ():
            rule.setdefault("kind", "DeviceTaintRule")
            rule.setdefault("apiVersion", api_version)
            rules.append(rule)
        continue_token = (page.get("metadata") or {}).get("continue")
        if not continue_token:
            return rules


def create_device_taint_rule(*, api_client: k8s.ApiClient, body: dict[str, Any]) -> dict[str, Any]:
    """Create the rule `body`, in the version its `apiVersion` names."""
    api = k8s.CustomObjectsApi(api_client)
    return response_json(
        api.create_cluster_custom_object(
            *_taint_rule_path(body["apiVersion"]),
            body,
            _preload_content=False,
            _request_timeout=WRITE_TIMEOUT_SECONDS,
        )
    )


def replace_device_taint_rule(
    *, api_client: k8s.ApiClient, body: dict[str, Any]
) -> dict[str, Any] | None:
    """Replace the rule if it is still at `body`'s resourceVersion; None on 409."""
    api = k8s.CustomObjectsApi(api_client)
    return _unless_status(
        HTTP_CONFLICT,
        lambda: api.replace_cluster_custom_object(
            *_taint_rule_path(body["apiVersion"]),
            body["metadata"]["name"],
            body,
            _preload_content=False,
            _request_timeout=WRITE_TIMEOUT_SECONDS,
        ),
    )


def delete_device_taint_rule(
    *, api_client: k8s.ApiClient, api_version: str, name: str, resource_version: str
) -> bool:
    """Delete the rule if it is still at `resource_version`; False when it changed or is gone."""
    api = k8s.CustomObjectsApi(api_client)
    try:
        api.delete_cluster_custom_object(
            *_taint_rule_path(api_version),
            name,
            body={"preconditions": {"resourceVersion": resource_version}},
            _preload_content=False,
            _request_timeout=WRITE_TIMEOUT_SECONDS,
        ).release_conn()
    except ApiException as exc:
        if exc.status in (HTTP_NOT_FOUND, HTTP_CONFLICT):
            return False
        raise
    return True
