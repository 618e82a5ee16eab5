"""The version matrix's action: taint the GPUs of outlier nodes so nothing new lands on them.

`apply_version_taints` makes the cluster's DRA DeviceTaintRules match the version matrix: one
rule per outlier node and DRA pool (a GPU driver publishes one pool per node, named after
it) whose GPUs run a driver/CUDA pair other than the cluster's baseline, with effect
NoSchedule, key `tally.dev/unvalidated-driver` and the driver version as value; Tally's rules
(label `app.kubernetes.io/managed-by: tally`) for nodes back in line are deleted. Rules
anyone else made are never touched. NoSchedule keeps new claims off those devices and leaves
running pods alone.

Writes are conditional on the resourceVersion read: a rule changed by someone else between
the list and the write is left for the next run, and counted in `conflicts`.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inventory import kube
from inventory.models import Cluster, Device, DeviceKind
from inventory.selectors import version_matrix

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

log = logging.getLogger(__name__)

TAINT_KEY = "tally.dev/unvalidated-driver"
TAINT_EFFECT = "NoSchedule"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "tally"
NODE_LABEL = "tally.dev/node"
RULE_PREFIX = "tally-unvalidated-"
MAX_NAME = 253
MAX_LABEL_VALUE = 63


@dataclass(frozen=True)
class TaintTarget:
    """The GPUs of one DRA pool on one outlier node, and the driver version they run."""

    node: str
    driver: str
    pool: str
    driver_version: str

    @property
    def rule_name(self) -> str:
        # The hash keeps names unique when a node has pools of several drivers.
        digest = hashlib.sha256(f"{self.driver}/{self.pool}".encode()).hexdigest()[:8]
        node = self.node[: MAX_NAME - len(RULE_PREFIX) - len(digest) - 1].rstrip(".-")
        return f"{RULE_PREFIX}{node}-{digest}"

    def rule(self) -> dict[str, Any]:
        return {
            "apiVersion": kube.DEVICE_TAINT_RULE_API_VERSION,
            "kind": "DeviceTaintRule",
            "metadata": {
                "name": self.rule_name,
                "labels": {MANAGED_BY_LABEL: MANAGED_BY, NODE_LABEL: _label_value(self.node)},
            },
            "spec": {
                "deviceSelector": {"driver": self.driver, "pool": self.pool},
                "taint": {
                    "key": TAINT_KEY,
                    "value": _label_value(self.driver_version),
                    "effect": TAINT_EFFECT,
                },
            },
        }


@dataclass
class TaintReport:
    """What one run did (or, with `dry_run`, would do), by rule name."""

    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    dry_run: bool = False


def taint_targets(*, cluster: Cluster) -> list[TaintTarget]:
    """The pools of `cluster`'s outlier nodes whose GPUs run a pair other than the baseline."""
    matrix = version_matrix(cluster=cluster)
    straying = {
        (node, row["driver_version"], row["cuda_driver_version"])
        for row in matrix["rows"]
        if not row["baseline"]
        for node in row["nodes"]
    }
    if not straying:
        return []
    devices = (
        Device.objects.filter(
            cluster=cluster,
            gone_at__isnull=True,
            node__name__in={node for node, _, _ in straying},
        )
        .exclude(kind=DeviceKind.OTHER)
        .exclude(physical_gpu_key="")
        .values_list("node__name", "driver", "pool", "driver_version", "cuda_driver_version")
        .distinct()
        .order_by()
    )
    versions: dict[tuple[str, str, str], set[str]] = defaultdict(set)
    for node, driver, pool, driver_version, cuda_version in devices:
        if (node, driver_version, cuda_version) in straying:
            versions[(node, driver, pool)].add(driver_version)
    return [
        # A pool on two straying versions at once (mid-upgrade): the newest names it.
        TaintTarget(node, driver, pool, max(found, key=_version_key))
        for (node, driver, pool), found in sorted(versions.items())
    ]


def apply_version_taints(
    *, cluster: Cluster, dry_run: bool = False, api_client: ApiClient | None = None
) -> TaintReport:
    """Create, update and delete Tally's DeviceTaintRules so they match the version matrix.

    Needs list/get/create/update/delete on resource.k8s.io devicetaintrules (and nothing
    else). With `dry_run` only the list is made; the report says what would change.
    """
    own_client = api_client is None
    client = api_client if api_client is not None else kube.api_client()
    try:
        return _apply(client, taint_targets(cluster=cluster), dry_run=dry_run)
    finally:
        if own_client:
            client.close()


def _apply(api_client: ApiClient, targets: list[TaintTarget], *, dry_run: bool) -> TaintReport:
    report = TaintReport(dry_run=dry_run)
    existing = {
        rule["metadata"]["name"]: rule
        for rule in kube.list_device_taint_rules(
            api_client=api_client, label_selector=f"{MANAGED_BY_LABEL}={MANAGED_BY}"
        )
    }
    for target in targets:
        desired = target.rule()
        name = desired["metadata"]["name"]
        current = existing.pop(name, None)
        if current is None:
            report.created.append(name)
            if not dry_run:
                kube.create_device_taint_rule(api_client=api_client, body=desired)
        elif _same(current, desired):
            report.unchanged.append(name)
        else:
            report.updated.append(name)
            if not dry_run and not _replace(api_client, current, desired):
                report.updated.remove(name)
                report.conflicts.append(name)
    for name, stale in sorted(existing.items()):
        report.deleted.append(name)
        if not dry_run and not kube.delete_device_taint_rule(
            api_client=api_client,
            name=name,
            resource_version=str(stale["metadata"].get("resourceVersion") or ""),
        ):
            report.deleted.remove(name)
            report.conflicts.append(name)
    log.info(
        "device taints%s: %d created, %d updated, %d deleted, %d unchanged, %d conflicts",
        " (dry run)" if dry_run else "",
        len(report.created),
        len(report.updated),
        len(report.deleted),
        len(report.unchanged),
        len(report.conflicts),
    )
    return report


def _replace(api_client: ApiClient, current: dict[str, Any], desired: dict[str, Any]) -> bool:
    metadata = {
        **current["metadata"],
        "labels": {**(current["metadata"].get("labels") or {}), **desired["metadata"]["labels"]},
    }
    taint = {**desired["spec"]["taint"]}
    current_taint = (current.get("spec") or {}).get("taint") or {}
    if current_taint.get("timeAdded") and current_taint.get("key") == taint["key"]:
        taint["timeAdded"] = current_taint["timeAdded"]  # tainted since then, still
    body = {**current, "metadata": metadata, "spec": {**desired["spec"], "taint": taint}}
    return kube.replace_device_taint_rule(api_client=api_client, body=body) is not None


def _same(current: dict[str, Any], desired: dict[str, Any]) -> bool:
    spec = current.get("spec") or {}
    taint = spec.get("taint") or {}
    wanted = desired["spec"]
    labels = current["metadata"].get("labels") or {}
    return (
        {k: v for k, v in (spec.get("deviceSelector") or {}).items() if v}
        == wanted["deviceSelector"]
        and {k: taint.get(k) for k in ("key", "value", "effect")} == wanted["taint"]
        and all(labels.get(k) == v for k, v in desired["metadata"]["labels"].items())
    )


def _label_value(value: str) -> str:
    # Label values: at most 63 characters, alphanumeric at both ends.
    return value[:MAX_LABEL_VALUE].strip("-_.")


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) if part.isdigit() else -1 for part in version.split("."))
