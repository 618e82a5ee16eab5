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

Every rule carries its reason (annotation `tally.dev/reason`): the pair against its baseline,
or the deviation that documents it. GPUs whose versions are unknown are never tainted.

A taint takes healthy GPUs out of scheduling when the baseline is wrong, so the plan
(`taint_plan`) has a limit: the rules of a model whose targets would cover more than
`TALLY_VERSION_TAINT_MAX_PERCENT` of its nodes in the cluster are held (not written, and its
pools' existing rules left as they are) unless forced. A deviation removed or expired turns
its pool's rule into an unvalidated one (or none, when the pool is back on its baseline).

Writes are conditional on the resourceVersion read: a rule changed by someone else between
the list and the write is left for the next run, and counted in `conflicts`. `taint_state`
reads the rules back for the fleet page: applied, or planned and not applied.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.conf import settings

from inventory import kube
from inventory.models import Cluster
from inventory.version_numbers import version_key
from inventory.versions import SET, ModelVersions, Outlier, VersionMatrix, version_matrix

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

log = logging.getLogger(__name__)

TAINT_KEY = "tally.dev/unvalidated-driver"
DEVIATION_TAINT_KEY = "tally.dev/version-deviation"
TAINT_EFFECT = "NoSchedule"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "tally"
NODE_LABEL = "tally.dev/node"
# Why the pool is tainted, in words: its pairs against the baseline, or its deviations.
REASON_ANNOTATION = "tally.dev/reason"
MAX_REASON = 4096
RULE_PREFIX = "tally-unvalidated-"
DEVIATION_RULE_PREFIX = "tally-deviation-"
MAX_NAME = 253
MAX_LABEL_VALUE = 63


@dataclass(frozen=True)
class TaintTarget:
    """The GPUs of one DRA pool off their baseline, the driver version they run, whether a
    deviation documents all of them, and why they are tainted (`reason`, written on the rule).
    `node` is "" for a pool of devices without a node; `models` the (driver, product name) of
    the GPUs it covers, for the limit."""

    node: str
    driver: str
    pool: str
    driver_version: str
    documented: bool = False
    reason: str = ""
    models: tuple[tuple[str, str], ...] = ()

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
            "metadata": {
                "name": self.rule_name,
                "labels": labels,
                "annotations": {REASON_ANNOTATION: self.reason},
            },
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
class TaintPlan:
    """The rules the version matrix asks for, and those the limit holds back.

    `held`: targets of models over the limit, not written (their pools' existing rules are
    left as they are); `limits`: one line per such model, saying why."""

    targets: list[TaintTarget] = field(default_factory=list)
    held: list[TaintTarget] = field(default_factory=list)
    limits: list[str] = field(default_factory=list)


@dataclass
class TaintReport:
    """What one run did (or, with `dry_run`, would do), by rule name, and the API version.
    `plan`: one line per rule, with its reason, as shown before acting."""

    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    limits: list[str] = field(default_factory=list)
    plan: list[str] = field(default_factory=list)
    dry_run: bool = False
    api_version: str = ""


def taint_targets(*, cluster: Cluster, at: datetime | None = None) -> list[TaintTarget]:
    """The pools of `cluster` with GPUs off their model's baseline (`at`: default now).

    A pool is documented when a deviation active at `at` covers every straying GPU in it; one
    undocumented GPU makes the whole pool an unvalidated one. GPUs whose versions are unknown
    are no outliers, so never a target.
    """
    return _targets(version_matrix(cluster=cluster, at=at))


def _targets(matrix: VersionMatrix) -> list[TaintTarget]:
    straying: dict[tuple[str, str, str], list[tuple[Outlier, ModelVersions]]] = defaultdict(list)
    for model in matrix["models"]:
        for outlier in model["outliers"]:
            straying[(outlier["node"], outlier["driver"], outlier["pool"])].append((outlier, model))
    targets = []
    for (node, driver, pool), found in sorted(straying.items()):
        documented = all(outlier["deviation"] is not None for outlier, _ in found)
        targets.append(
            TaintTarget(
                node=node,
                driver=driver,
                pool=pool,
                # A pool on two straying versions at once (mid-upgrade): the newest names it.
                driver_version=max(
                    (outlier["driver_version"] for outlier, _ in found), key=version_key
                ),
                documented=documented,
                reason=_reason(found, documented=documented),
                models=tuple(
                    sorted({(model["driver"], model["product_name"]) for _, model in found})
                ),
            )
        )
    return targets


def _reason(found: list[tuple[Outlier, ModelVersions]], *, documented: bool) -> str:
    """Why a pool is tainted, in words: its deviations, or its pairs against their baselines."""
    reasons = []
    for outlier, model in found:
        deviation = outlier["deviation"]
        if documented and deviation is not None:
            text = (
                f"documented deviation {deviation['id']} (owner {deviation['owner']}, until "
                f"{deviation['expires_at']:%Y-%m-%d}): {deviation['reason']}"
            )
        elif deviation is None:
            baseline = model["baseline"]
            source = f"set for the {baseline['scope']}" if baseline["source"] == SET else "computed"
            text = (
                f"{outlier['gpus']} {model['product_name'] or 'GPU'} on driver "
                f"{outlier['driver_version']}, CUDA {outlier['cuda_driver_version'] or 'none'}; "
                f"baseline ({source}): driver {baseline['driver_version'] or 'any'}, CUDA "
                f"{baseline['cuda_driver_version'] or 'any'}; no active deviation"
            )
        else:
            continue  # documented, in a pool that another undocumented GPU taints
        if text not in reasons:
            reasons.append(text)
    return "; ".join(reasons)[:MAX_REASON]


def taint_plan(*, cluster: Cluster, force: bool = False, at: datetime | None = None) -> TaintPlan:
    """The taint targets of `cluster`, less those of models whose targets would take more
    than `TALLY_VERSION_TAINT_MAX_PERCENT` of the model's nodes (with versions known), unless
    `force`: a baseline that strays most of a model is far more often a mistake than a fleet
    out of line, and a taint takes healthy GPUs out of scheduling."""
    matrix = version_matrix(cluster=cluster, at=at)
    targets = _targets(matrix)
    percent = settings.TALLY_VERSION_TAINT_MAX_PERCENT
    over: set[tuple[str, str]] = set()
    limits: list[str] = []
    for model in matrix["models"]:
        key = (model["driver"], model["product_name"])
        tainted = {t.node or f"pool {t.pool}" for t in targets if key in t.models}
        nodes = max(len(model["nodes"]), 1)
        if len(tainted) * 100 > percent * nodes:
            over.add(key)
            limits.append(
                f"{model['product_name'] or 'unknown model'} ({model['driver']}): "
                f"{len(tainted)} of {len(model['nodes'])} nodes would be tainted, more than "
                f"TALLY_VERSION_TAINT_MAX_PERCENT={percent}%"
                + (
                    " (forced)"
                    if force
                    else "; not tainted: check the baseline, or run with --force"
                )
            )
    if force:
        return TaintPlan(targets=targets, limits=limits)
    held = [t for t in targets if over.intersection(t.models)]
    return TaintPlan(targets=[t for t in targets if t not in held], held=held, limits=limits)


def apply_version_taints(
    *,
    cluster: Cluster,
    dry_run: bool = False,
    force: bool = False,
    api_client: ApiClient | None = None,
) -> TaintReport:
    """Create, update and delete Tally's DeviceTaintRules so they match the version matrix,
    within the limit (`taint_plan`; `force` lifts it).

    Needs discovery (`/apis/resource.k8s.io`) and list/get/create/update/delete on
    resource.k8s.io devicetaintrules (and nothing else). With `dry_run` only discovery and
    the list are made; the report says what would change. Raises `kube.KubeError` when the
    cluster serves no DeviceTaintRule API.
    """
    own_client = api_client is None
    client = api_client if api_client is not None else kube.api_client()
    try:
        api_version = kube.device_taint_rule_api_version(api_client=client)
        plan = taint_plan(cluster=cluster, force=force)
        return _apply(client, api_version, plan, dry_run=dry_run)
    finally:
        if own_client:
            client.close()


def _existing(
    api_client: ApiClient, api_version: str, timeout: tuple[float, float] | None = None
) -> dict[str, dict[str, Any]]:
    return {
        rule["metadata"]["name"]: rule
        for rule in kube.list_device_taint_rules(
            api_client=api_client,
            api_version=api_version,
            label_selector=f"{MANAGED_BY_LABEL}={MANAGED_BY}",
            timeout=timeout,
        )
    }


def _apply(
    api_client: ApiClient, api_version: str, plan: TaintPlan, *, dry_run: bool
) -> TaintReport:
    report = TaintReport(dry_run=dry_run, api_version=api_version, limits=plan.limits)
    existing = _existing(api_client, api_version)
    # A held pool keeps whatever rule it has: the limit never adds taints, nor removes them.
    held_pools = {(t.driver, t.pool) for t in plan.held}
    for name, rule in sorted(existing.items()):
        if _selected_pool(rule) in held_pools:
            report.held.append(name)
            del existing[name]
    for target in plan.held:
        report.plan.append(f"held: {target.rule_name} ({target.reason})")
    for target in plan.targets:
        desired = target.rule(api_version)
        name = desired["metadata"]["name"]
        current = existing.pop(name, None)
        if current is None:
            report.created.append(name)
            report.plan.append(f"create: {name} ({target.reason})")
            if not dry_run:
                kube.create_device_taint_rule(api_client=api_client, body=desired)
        elif _same(current, desired):
            report.unchanged.append(name)
            report.plan.append(f"keep: {name} ({target.reason})")
        else:
            report.updated.append(name)
            report.plan.append(f"update: {name} ({target.reason})")
            if not dry_run and not _replace(api_client, current, desired):
                report.updated.remove(name)
                report.conflicts.append(name)
    for name, stale in sorted(existing.items()):
        report.deleted.append(name)
        report.plan.append(f"delete: {name} (its GPUs are back on their baseline, or gone)")
        if not dry_run and not kube.delete_device_taint_rule(
            api_client=api_client,
            api_version=api_version,
            name=name,
            resource_version=str(stale["metadata"].get("resourceVersion") or ""),
        ):
            report.deleted.remove(name)
            report.conflicts.append(name)
    log.info(
        "device taints (%s)%s: %d created, %d updated, %d deleted, %d unchanged, %d held, "
        "%d conflicts",
        api_version,
        " (dry run)" if dry_run else "",
        len(report.created),
        len(report.updated),
        len(report.deleted),
        len(report.unchanged),
        len(report.held),
        len(report.conflicts),
    )
    return report


APPLIED = "applied"
PLANNED = "planned, not applied"
HELD = "held by the limit"
UNREAD = "unknown: the cluster could not be read"


@dataclass
class TaintState:
    """Which planned rules the cluster holds (read back from it), for the fleet page.

    `rows`: each target (held ones included) with its state, APPLIED, PLANNED or HELD, or
    UNREAD when the cluster could not be read; `error` then says why ("" when it was read).
    `stale`: Tally's rules in the cluster no target asks for any more (the next
    apply_version_taints deletes them)."""

    rows: list[tuple[TaintTarget, str]] = field(default_factory=list)
    error: str = ""
    stale: list[str] = field(default_factory=list)

    def of_pool(self, driver: str, pool: str) -> str | None:
        """The state of the target of one pool; None when no rule is planned for it."""
        for target, state in self.rows:
            if (target.driver, target.pool) == (driver, pool):
                return state
        return None


def taint_state(*, cluster: Cluster, api_client: ApiClient) -> TaintState:
    """Read back Tally's DeviceTaintRules in the cluster and say, per planned target, whether
    the rule it asks for is there as planned. Never raises for the cluster's answers: an
    unreachable or forbidding API is reported in `error`. Each request waits at most
    `kube.PAGE_TIMEOUT_SECONDS`: a page waits for it."""
    plan = taint_plan(cluster=cluster)
    held = [(target, HELD) for target in plan.held]
    timeout = kube.PAGE_TIMEOUT_SECONDS
    try:
        api_version = kube.device_taint_rule_api_version(api_client=api_client, timeout=timeout)
        existing = _existing(api_client, api_version, timeout)
    except kube.READ_ERRORS as exc:
        return unread_state(plan=plan, error=kube.describe_error(exc))
    rows = []
    for target in plan.targets:
        current = existing.pop(target.rule_name, None)
        applied = current is not None and _same(current, target.rule(api_version))
        rows.append((target, APPLIED if applied else PLANNED))
    return TaintState(rows=rows + held, stale=sorted(existing))


def unread_state(*, plan: TaintPlan, error: str) -> TaintState:
    """The state when the cluster could not be read: what is planned is unknown there; what
    the limit holds is held whatever the cluster holds."""
    return TaintState(
        rows=[(target, UNREAD) for target in plan.targets]
        + [(target, HELD) for target in plan.held],
        error=error,
    )


def _selected_pool(rule: dict[str, Any]) -> tuple[str, str]:
    selector = (rule.get("spec") or {}).get("deviceSelector") or {}
    return (str(selector.get("driver") or ""), str(selector.get("pool") or ""))


def _replace(api_client: ApiClient, current: dict[str, Any], desired: dict[str, Any]) -> bool:
    metadata = {
        **current["metadata"],
        "labels": {**(current["metadata"].get("labels") or {}), **desired["metadata"]["labels"]},
        "annotations": {
            **(current["metadata"].get("annotations") or {}),
            **desired["metadata"]["annotations"],
        },
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
    annotations = current["metadata"].get("annotations") or {}
    return (
        {k: v for k, v in (spec.get("deviceSelector") or {}).items() if v}
        == wanted["deviceSelector"]
        and {k: taint.get(k) for k in ("key", "value", "effect")} == wanted["taint"]
        and all(labels.get(k) == v for k, v in desired["metadata"]["labels"].items())
        and all(annotations.get(k) == v for k, v in desired["metadata"]["annotations"].items())
    )


def _label_value(value: str) -> str:
    # Label values: at most 63 characters, alphanumeric at both ends.
    return value[:MAX_LABEL_VALUE].strip("-_.")
