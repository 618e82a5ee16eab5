"""The version matrix's action: taint the GPUs off their baseline so nothing new lands on them.

`apply_version_taints` makes the cluster's DRA DeviceTaintRules match the version matrix
(`inventory.versions`): one rule per DRA pool (a GPU driver publishes one pool per node, named
after it) holding GPUs on a driver/CUDA pair other than their model's baseline, with effect
NoSchedule and the (newest straying) driver version as value. The key says which kind:

- `tally.dev/unvalidated-driver`: an undocumented outlier (or one whose deviation expired).
  Nothing should tolerate it.
- `tally.dev/version-deviation`: every straying GPU of the pool is documented by an active
  `VersionDeviation`. Kept out of general scheduling; validation workloads run there by
  tolerating it, in their claim's request:
  `tolerations: [{key: tally.dev/version-deviation, operator: Exists, effect: NoSchedule}]`.

Tally's rules (label `app.kubernetes.io/managed-by: tally`) for pools back in line are
deleted; rules anyone else made are never touched. NoSchedule keeps new claims off those
devices and leaves running pods alone. Rules are written in the DeviceTaintRule API version
the cluster serves (v1, v1beta2 or v1alpha3), found by discovery on every run.

Writes are conditional on the resourceVersion read: a rule changed by someone else between
the list and the write is left for the next run, and counted in `conflicts`.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from inventory import kube
from inventory.models import Cluster
from inventory.versions import version_key, version_matrix

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

log = logging.getLogger(__name__)

TAINT_KEY = "tally.dev/unvalidated-driver"
DEVIATION_TAINT_KEY = "tally.dev/version-deviation"
TAINT_EFFECT = "NoSchedule"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "tally"
NODE_LABEL = "tally.dev/node"
RULE_PREFIX = "tally-unvalidated-"
DEVIATION_RULE_PREFIX = "tally-deviation-"
MAX_NAME = 253
MAX_LABEL_VALUE = 63


@dataclass(frozen=True)
class TaintTarget:
    """The GPUs of one DRA pool off their baseline, the driver version they run, and whether
    a deviation documents all of them. `node` is "" for a pool of devices without a node."""

    node: str
    driver: str
    pool: str
    driver_version: str
    documented: bool = False

    @property
    def taint_key(self) -> str:
        return DEVIATION_TAINT_KEY if self.documented else TAINT_KEY

    @property
    def rule_name(self) -> str:
        prefix = DEVIATION_RULE_PREFIX if self.documented else RULE_PREFIX
        # The hash keeps names unique when a node has pools of several drivers.
        digest = hashlib.sha256(f"{self.driver}/{self.pool}".encode()).hexdigest()[:8]
        base = (self.node or self.pool).lower()
        base = base[: MAX_NAME - len(prefix) - len(digest) - 1].rstrip(".-")
        return f"{prefix}{base}-{digest}"

    def rule(self, api_version: str) -> dict[str, Any]:
        labels = {MANAGED_BY_LABEL: MANAGED_BY}
        if self.node:
            labels[NODE_LABEL] = _label_value(self.node)
        return {
            "apiVersion": api_version,
            "kind": "DeviceTaintRule",
            "metadata": {"name": self.rule_name, "labels": labels},
            "spec": {
                "deviceSelector": {"driver": self.driver, "pool": self.pool},
                "taint": {
                    "key": self.taint_key,
                    "value": _label_value(self.driver_version),
                    "effect": TAINT_EFFECT,
                },
            },
        }


@dataclass
class TaintReport:
    """What one run did (or, with `dry_run`, would do), by rule name, and the API version."""

    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    dry_run: bool = False
    api_version: str = ""


def taint_targets(*, cluster: Cluster, at: datetime | None = None) -> list[TaintTarget]:
    """The pools of `cluster` with GPUs off their model's baseline (`at`: default now).

    A pool is documented when a deviation active at `at` covers every straying GPU in it; one
    undocumented GPU makes the whole pool an unvalidated one.
    """
    straying: dict[tuple[str, str, str], list[tuple[str, bool]]] = defaultdict(list)
    for model in version_matrix(cluster=cluster, at=at)["models"]:
        for outlier in model["outliers"]:
            straying[(outlier["node"], outlier["driver"], outlier["pool"])].append(
                (outlier["driver_version"], outlier["deviation"] is not None)
            )
    return [
        # A pool on two straying versions at once (mid-upgrade): the newest names it.
        TaintTarget(
            node=node,
            driver=driver,
            pool=pool,
            driver_version=max((version for version, _ in found), key=version_key),
            documented=all(documented for _, documented in found),
        )
        for (node, driver, pool), found in sorted(straying.items())
    ]


def apply_version_taints(
    *, cluster: Cluster, dry_run: bool = False, api_client: ApiClient | None = None
) -> TaintReport:
    """Create, update and delete Tally's DeviceTaintRules so they match the version matrix.

    Needs discovery (`/apis/resource.k8s.io`) and list/get/create/update/delete on
    resource.k8s.io devicetaintrules (and nothing else). With `dry_run` only discovery and
    the list are made; the report says what would change. Raises `kube.KubeError` when the
    cluster serves no DeviceTaintRule API.
    """
    own_client = api_client is None
    client = api_client if api_client is not None else kube.api_client()
    try:
        api_version = kube.device_taint_rule_api_version(api_client=client)
        return _apply(client, api_version, taint_targets(cluster=cluster), dry_run=dry_run)
    finally:
        if own_client:
            client.close()


def _apply(
    api_client: ApiClient, api_version: str, targets: list[TaintTarget], *, dry_run: bool
) -> TaintReport:
    report = TaintReport(dry_run=dry_run, api_version=api_version)
    existing = {
        rule["metadata"]["name"]: rule
        for rule in kube.list_device_taint_rules(
            api_client=api_client,
            api_version=api_version,
            label_selector=f"{MANAGED_BY_LABEL}={MANAGED_BY}",
        )
    }
    for target in targets:
        desired = target.rule(api_version)
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
            api_version=api_version,
            name=name,
            resource_version=str(stale["metadata"].get("resourceVersion") or ""),
        ):
            report.deleted.remove(name)
            report.conflicts.append(name)
    log.info(
        "device taints (%s)%s: %d created, %d updated, %d deleted, %d unchanged, %d conflicts",
        api_version,
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
    body = {
        **current,
        "apiVersion": desired["apiVersion"],
        "metadata": metadata,
        "spec": {**desired["spec"], "taint": taint},
    }
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
