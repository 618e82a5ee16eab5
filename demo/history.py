"""The demo's history: five weeks of two simulated clusters laid down in time order through the
services production runs, so the week report, "did it help", the heatmap, the closed month,
stranded gangs and pending demand have something real to show the moment the demo is loaded
(issue 35, item 3).

The timeline (`timeline`), from `start` (`days` before the load) to `now`:

- `start`: the policy as it was (`earlier_policy`: vision's H100 quota 32 GPUs) is applied as
  of then; each cluster's first sync is noted then and its fleet imported, so every device is
  first seen at the start of the history.
- at each change: the clusters are synced again (`import_snapshot` of the fleet as it was
  then: the claims created by then, `Fleet.at`). The second cluster joins two weeks before
  the load (its first sync then).
- `driver_change` (18 days before today, in the third week): the driver of one node
  (`DRIVER_NODE`) is upgraded from an outlier version to the fleet's baseline, as its driver
  republishes its slices (a new pool generation) and the sync reads them.
- `quota_change` (7 days before today, where the default windows of "did it help" meet): the
  policy of docs/demo-policy.yaml is applied (vision's H100 quota cut to 24 GPUs).
- `now`: the last sync, with a multi-node gang in the second cluster one of whose four pods
  holds its GPUs while the other three wait (`stranded_gang`): a stranded gang, and pending
  demand.

The usage (`demo.usage`) follows the changes: jobs on the driver-change node ran slowly before
it, and vision's jobs used their GPUs better after its quota was cut.

Everything is derived from the seed and `now`, so a load at one moment is the same every time.
"""

from __future__ import annotations

import copy
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from typing import Any

import yaml

from inventory import simulate
from inventory.gangs import KUEUE_POD_GROUP_LABEL, KUEUE_TOTAL_COUNT_ANNOTATION
from inventory.simulate import API_VERSION, CREATED_BY, DRIVER

DAYS = 35
# The second cluster: its own fleet (another seed, its own GPU UUIDs), synced beside the first
# since it joined, two weeks before the load.
SECOND_CLUSTER = "lab"
SECOND_CLUSTER_NODES = 4
SECOND_CLUSTER_DAYS = 14
# The node (by index) whose driver is upgraded part-way, and the version it ran before.
DRIVER_NODE = 3
OLD_DRIVER = simulate.OUTLIER_DRIVERS[1]
DRIVER_CHANGE_DAYS = 18
QUOTA_CHANGE_DAYS = 7
# The quota the policy cuts part-way: vision's rule `h100`, from 32 GPUs to the file's.
CHANGED_TEAM = "vision"
CHANGED_RULE = "h100"
EARLIER_GPUS = 32
# The stranded gang: a Kueue pod group of four pods of nlp, each asking for four GPUs; one
# holds them since `GANG_AGE` before the load, the other three wait.
GANG_NAMESPACE = "nlp"
GANG_NAME = "llama-pretrain-multi"
GANG_PODS = 4
GANG_GPUS = 4
GANG_AGE = timedelta(days=2, hours=3)


@dataclass(frozen=True)
class Timeline:
    """The moments of the demo's history (see the module's docstring)."""

    start: datetime
    driver_change: datetime
    quota_change: datetime
    now: datetime

    def syncs(self, since: datetime) -> list[datetime]:
        """When a cluster that joined at `since` is synced: then, at each change after it, and
        now (each sync brings the claims created since the one before)."""
        changes = (self.driver_change, self.quota_change)
        return sorted({since, *(moment for moment in changes if moment > since), self.now})


def timeline(*, now: datetime, days: int) -> Timeline:
    """The history of `days` days up to `now`; the changes at midnight UTC, 18 and 7 days
    before today's."""
    if days <= DRIVER_CHANGE_DAYS + 1:
        raise ValueError(f"{days} days: the history needs more than {DRIVER_CHANGE_DAYS + 1}")
    today = datetime.combine(now.astimezone(UTC).date(), time(), UTC)
    return Timeline(
        start=now - timedelta(days=days),
        driver_change=today - timedelta(days=DRIVER_CHANGE_DAYS),
        quota_change=today - timedelta(days=QUOTA_CHANGE_DAYS),
        now=now,
    )


def earlier_policy(text: str) -> str:
    """The policy `text` as it was before the quota change: vision's H100 rule at 32 GPUs."""
    data = yaml.safe_load(text)
    team = next(team for team in data["teams"] if team["slug"] == CHANGED_TEAM)
    rule = next(rule for rule in team["quotas"] if rule["name"] == CHANGED_RULE)
    rule["gpus"] = EARLIER_GPUS
    return yaml.safe_dump(data, sort_keys=False)


def _created(obj: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(obj["metadata"]["creationTimestamp"])


def _node_name(obj: dict[str, Any]) -> str:
    if obj["kind"] == "Node":
        return str(obj["metadata"]["name"])
    return str(obj.get("spec", {}).get("pool", {}).get("name", ""))


def _on_driver(obj: dict[str, Any], version: tuple[str, str], generation: int) -> dict[str, Any]:
    """`obj` (the node or one of its slices) as its driver published it at `version`."""
    changed = copy.deepcopy(obj)
    driver, cuda = version
    if changed["kind"] == "Node":
        changed["metadata"]["labels"]["nvidia.com/cuda.driver-version.full"] = driver
        return changed
    changed["spec"]["pool"]["generation"] = generation
    for device in changed["spec"].get("devices", []):
        attributes = device.get("attributes", {})
        if "driverVersion" in attributes:
            attributes["driverVersion"] = {"version": driver}
            attributes["cudaDriverVersion"] = {"version": cuda}
    return changed


@dataclass(frozen=True)
class Fleet:
    """One cluster's simulated objects as they are at `now`, by kind; `driver_node` the node
    (by name) whose driver was upgraded part-way, "" for none."""

    cluster: str
    since: datetime  # its first sync
    fleet: list[dict[str, Any]]  # device classes, nodes, slices
    claims: list[dict[str, Any]]
    extra: list[dict[str, Any]]  # claims' Pods and what owns them, besides the simulated ones
    driver_node: str = ""

    def at(self, moment: datetime, changes: Timeline) -> list[dict[str, Any]]:
        """The cluster's objects as it showed them at `moment`: the claims created by then
        (with their Pods and owners), the driver-change node on its old driver before the
        change."""
        objects = []
        for obj in self.fleet:
            if self.driver_node and _node_name(obj) == self.driver_node:
                before = moment < changes.driver_change
                obj = _on_driver(
                    obj, OLD_DRIVER if before else simulate.BASELINE_DRIVER, 1 if before else 2
                )
            objects.append(obj)
        claims = [claim for claim in self.claims if _created(claim) <= moment]
        objects += claims
        objects += simulate.owner_objects([c for c in claims if c["metadata"].get("labels")])
        uids = {claim["metadata"]["uid"] for claim in claims}
        extra: dict[tuple[str, str], dict[str, Any]] = {}
        for obj in self.extra:
            if obj["_for"] in uids:
                shown = {key: value for key, value in obj.items() if key != "_for"}
                extra.setdefault((shown["kind"], shown["metadata"]["uid"]), shown)
        return [*objects, *extra.values()]


def simulated_fleet(
    *, cluster: str, nodes: int, seed: int, now: datetime, days: int, driver_node: int | None
) -> Fleet:
    """One cluster's fleet as `simulate.generate` makes it (the outlier node and partly used
    MIG GPUs of the demo in the first), with claims created over the `days` before `now`."""
    first = cluster == ""
    objects = simulate.generate(
        nodes=nodes,
        seed=seed,
        now=now,
        history=timedelta(days=days),
        outlier_nodes=(1,) if first else (),
        partly_used_mig=range(nodes) if first else (),
        cluster=cluster,
    )
    fleet: list[dict[str, Any]] = []
    claims: list[dict[str, Any]] = []
    for obj in objects:
        (claims if obj["kind"] == "ResourceClaim" else fleet).append(obj)
    driver_name = ""
    if driver_node is not None:
        driver_name = next(
            _node_name(obj)
            for obj in fleet
            if obj["kind"] == "Node" and obj["metadata"]["name"].endswith(f"-{driver_node:05d}")
        )
    return Fleet(
        cluster=cluster,
        since=now - timedelta(days=days),
        fleet=fleet,
        claims=claims,
        extra=[],
        driver_node=driver_name,
    )


def _uid(*names: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "demo/" + "/".join(names)))


def _free_whole_gpus(fleet: Fleet) -> dict[str, list[str]]:
    """Per node, the whole GPUs (by device name) no claim holds, in the slices' order."""
    held = {
        (result["pool"], result["device"])
        for claim in fleet.claims
        for result in claim.get("status", {})
        .get("allocation", {})
        .get("devices", {})
        .get("results", [])
    }
    free: dict[str, list[str]] = defaultdict(list)
    for obj in fleet.fleet:
        if obj["kind"] != "ResourceSlice":
            continue
        node = obj["spec"].get("nodeName", "")
        for device in obj["spec"].get("devices", []):
            kind = device.get("attributes", {}).get("type", {}).get("string")
            if kind == "gpu" and (node, device["name"]) not in held:
                free[node].append(device["name"])
    return free


def stranded_gang(fleet: Fleet, *, now: datetime) -> Fleet:
    """`fleet` with a Kueue pod group of `GANG_PODS` pods added, each with a claim of
    `GANG_GPUS` whole GPUs: the first holds them on the node with the most free whole GPUs,
    the others wait (no node has room for them all)."""
    free = _free_whole_gpus(fleet)
    node = max(sorted(free), key=lambda name: len(free[name]))
    if len(free[node]) < GANG_GPUS:
        raise ValueError(f"no node of cluster {fleet.cluster!r} has {GANG_GPUS} free GPUs")
    created = now - GANG_AGE
    job_uid = _uid(fleet.cluster, GANG_NAMESPACE, "Job", GANG_NAME)
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": GANG_NAME,
            "namespace": GANG_NAMESPACE,
            "uid": job_uid,
            "annotations": {CREATED_BY: "ana"},
        },
    }
    claims, extra = [], []
    for index in range(GANG_PODS):
        pod_name = f"{GANG_NAME}-{index}"
        pod_uid = _uid(fleet.cluster, GANG_NAMESPACE, "Pod", pod_name)
        claim_uid = _uid(fleet.cluster, GANG_NAMESPACE, "ResourceClaim", pod_name)
        request = {
            "name": "gpus",
            "exactly": {
                "allocationMode": "ExactCount",
                "count": GANG_GPUS,
                "deviceClassName": "gpu.nvidia.com",
            },
        }
        claim: dict[str, Any] = {
            "apiVersion": API_VERSION,
            "kind": "ResourceClaim",
            "metadata": {
                "annotations": {"resource.kubernetes.io/pod-claim-name": "gpus"},
                "creationTimestamp": created.strftime("%Y-%m-%dT%H:%M:%SZ"),
                "name": f"{pod_name}-gpus",
                "namespace": GANG_NAMESPACE,
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "blockOwnerDeletion": True,
                        "controller": True,
                        "kind": "Pod",
                        "name": pod_name,
                        "uid": pod_uid,
                    }
                ],
                "resourceVersion": str(9_000_000 + index),
                "uid": claim_uid,
            },
            "spec": {"devices": {"requests": [request]}},
        }
        if index == 0:
            claim["status"] = {
                "allocation": {
                    "allocationTimestamp": (created + timedelta(seconds=40)).strftime(
                        "%Y-%m-%dT%H:%M:%SZ"
                    ),
                    "devices": {
                        "results": [
                            {"device": name, "driver": DRIVER, "pool": node, "request": "gpus"}
                            for name in free[node][:GANG_GPUS]
                        ]
                    },
                },
                "reservedFor": [{"name": pod_name, "resource": "pods", "uid": pod_uid}],
            }
        claims.append(claim)
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name,
                "namespace": GANG_NAMESPACE,
                "uid": pod_uid,
                "labels": {KUEUE_POD_GROUP_LABEL: GANG_NAME},
                "annotations": {
                    KUEUE_TOTAL_COUNT_ANNOTATION: str(GANG_PODS),
                    CREATED_BY: "ana",
                },
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": GANG_NAME,
                        "uid": job_uid,
                        "controller": True,
                    }
                ],
            },
        }
        extra += [{**pod, "_for": claim_uid}, {**job, "_for": claim_uid}]
    return Fleet(
        cluster=fleet.cluster,
        since=fleet.since,
        fleet=fleet.fleet,
        claims=[*fleet.claims, *claims],
        extra=[*fleet.extra, *extra],
        driver_node=fleet.driver_node,
    )
