"""A simulated GPU fleet, as `kubectl get nodes,deviceclasses,resourceslices,resourceclaims -A`
would print it from a cluster running the NVIDIA DRA driver (`resource.k8s.io/v1`).

Nodes come in layouts: whole H100 or H200 GPUs (NVLink cliques), A100s split by static MIG
(each GPU published only as its MIG devices) and H100s with partitionable devices (KEP-4815:
the whole GPU and every MIG placement, drawing on a per-GPU counter set that lives in a second
slice of the pool). About 5% of nodes run an outlier driver. ResourceClaims created by Pods
in a handful of namespaces hold about 60% of the GPUs: some nodes full, some partly used,
some idle, and a few claims still pending. Claims were created within `history` (14 days by
default) before `now`. A demo can ask for what it wants to show whatever the draws: nodes that
run an outlier driver (`outlier_nodes`) and static-MIG nodes with one GPU partly used, some of
its MIG devices claimed and the rest free (`partly_used_mig`).

Everything is derived from `seed` (each node from its own random stream), so a fleet is the
same on every run and `generate` can walk it several times, one kind after the other, without
holding it in memory. The GPUs' and MIG devices' UUIDs also depend on the cluster named
(`cluster`): two clusters simulated with one seed are two fleets, as real GPUs are, not the
same GPUs twice (which the sync would refuse in the second).
"""

from __future__ import annotations

import hashlib
import json
import random
import uuid
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import yaml

DRIVER = "gpu.nvidia.com"
API_VERSION = "resource.k8s.io/v1"
NAMESPACES = ("vision", "nlp", "speech", "recsys", "research")
# A fixed "now" keeps a seed's dump identical from run to run; load_demo passes the real one.
EPOCH = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
GPUS_PER_NODE = 8

BASELINE_DRIVER = ("580.82.7", "13.0.0")
OUTLIER_DRIVERS = (("570.172.8", "12.8.0"), ("580.65.6", "13.0.0"))
OUTLIER_SHARE = 0.05
# How long before `now` claims were created, at most (at least 10 minutes before it).
CLAIM_HISTORY = timedelta(days=14)
_NEWEST_CLAIM_AGE = timedelta(minutes=10)

_ALPHANUMS = "bcdfghjklmnpqrstvwxz2456789"  # the alphabet of Kubernetes' generated names


@dataclass(frozen=True)
class MigProfile:
    """One MIG profile of a GPU model, with what an instance of it gets."""

    name: str
    profile_id: int
    memory_slices: int  # of the GPU's 8 memory slices
    memory: str
    multiprocessors: int
    copy_engines: int
    decoders: int
    jpeg_engines: int
    ofa_engines: int
    placements: tuple[int, ...]  # the memory slices an instance may start at


@dataclass(frozen=True)
class GpuModel:
    """What the driver publishes for one GPU product."""

    product_name: str
    architecture: str
    compute_capability: str
    memory: str
    multiprocessors: int
    instance_type: str
    node_prefix: str
    addressing_mode: str | None = None
    mig_profiles: tuple[MigProfile, ...] = ()

    @property
    def label(self) -> str:
        """The product as GPU feature discovery writes it into `nvidia.com/gpu.product`."""
        return self.product_name.replace(" ", "-")


def _profile(
    name: str, profile_id: int, slices: int, memory: str, sms: int, *rest: int
) -> MigProfile:
    copy_engines, decoders, jpeg, ofa, *placements = rest
    return MigProfile(
        name, profile_id, slices, memory, sms, copy_engines, decoders, jpeg, ofa, tuple(placements)
    )


A100 = GpuModel(
    product_name="NVIDIA A100-SXM4-80GB",
    architecture="Ampere",
    compute_capability="8.0.0",
    memory="80Gi",
    multiprocessors=108,
    instance_type="p4de.24xlarge",
    node_prefix="a100",
    mig_profiles=(
        _profile("1g.10gb", 19, 1, "9856Mi", 14, 1, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6),
        _profile("2g.20gb", 14, 2, "19968Mi", 28, 2, 1, 0, 0, 0, 2, 4),
        _profile("3g.40gb", 9, 4, "40192Mi", 42, 3, 2, 0, 0, 0, 4),
        _profile("4g.40gb", 5, 4, "40192Mi", 56, 4, 2, 0, 0, 0),
        _profile("7g.80gb", 0, 8, "80896Mi", 98, 7, 5, 1, 1, 0),
    ),
)
H100 = GpuModel(
    product_name="NVIDIA H100 80GB HBM3",
    architecture="Hopper",
    compute_capability="9.0.0",
    memory="80Gi",
    multiprocessors=132,
    instance_type="p5.48xlarge",
    node_prefix="h100",
    addressing_mode="HMM",
    mig_profiles=(
        _profile("1g.10gb", 19, 1, "9856Mi", 16, 1, 1, 1, 0, 0, 1, 2, 3, 4, 5, 6),
        _profile("2g.20gb", 14, 2, "19968Mi", 32, 2, 2, 2, 0, 0, 2, 4),
        _profile("3g.40gb", 9, 4, "40192Mi", 60, 3, 3, 3, 0, 0, 4),
        _profile("4g.40gb", 5, 4, "40192Mi", 64, 4, 4, 4, 0, 0),
    ),
)
H200 = GpuModel(
    product_name="NVIDIA H200",
    architecture="Hopper",
    compute_capability="9.0.0",
    memory="141Gi",
    multiprocessors=132,
    instance_type="p5en.48xlarge",
    node_prefix="h200",
    addressing_mode="HMM",
)

# Static MIG layouts of one A100: (profile, placement start) pairs that fit together.
STATIC_MIG_LAYOUTS: tuple[tuple[tuple[str, int], ...], ...] = (
    tuple(("1g.10gb", start) for start in range(7)),
    (("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4)),
    (("3g.40gb", 0), ("3g.40gb", 4)),
    (("2g.20gb", 0), ("2g.20gb", 2), ("2g.20gb", 4), ("1g.10gb", 6)),
)


@dataclass(frozen=True)
class Layout:
    """How a node's GPUs are published: whole, as static MIG devices, or partitionable."""

    name: str
    model: GpuModel
    publishing: str  # "whole" | "mig" | "partitionable"
    cliques: bool = False  # nodes sit in NVLink cliques


LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("h100", H100, "whole", cliques=True),
        Layout("h200", H200, "whole", cliques=True),
        Layout("a100-mig", A100, "mig"),
        Layout("h100-partitionable", H100, "partitionable"),
    )
}
# The default mix of a fleet, by weight.
DEFAULT_MIX: Mapping[str, float] = {
    "h100": 0.5,
    "h200": 0.25,
    "a100-mig": 0.15,
    "h100-partitionable": 0.1,
}
# Whole GPUs only: exactly 8 devices and one slice per node (the benchmark's fleet).
WHOLE_GPU_MIX: Mapping[str, float] = {"h100": 0.7, "h200": 0.3}
CLIQUE_SIZE = 16  # nodes per NVLink domain

# Who creates claims: workload names per namespace.
WORKLOADS = {
    "vision": ("detr-train", "vit-finetune", "segformer-eval", "yolo-serve"),
    "nlp": ("llama-pretrain", "mistral-sft", "bert-embed", "rag-serve"),
    "speech": ("whisper-train", "tts-serve", "asr-eval"),
    "recsys": ("dlrm-train", "ranker-serve", "two-tower-embed"),
    "research": ("notebook", "sweep", "rl-agent", "diffusion-exp"),
}


@dataclass
class Device:
    """One published device and what it consumes of its node's GPUs."""

    name: str
    gpu_index: int
    entry: dict[str, Any]
    mig: MigProfile | None = None
    placement: int = 0


@dataclass
class NodePlan:
    """Everything about one simulated node, derived from its own random stream."""

    index: int
    name: str
    uid: str
    layout: Layout
    driver_version: str
    cuda_driver_version: str
    created: datetime
    clique: str
    cluster: str = ""
    devices: list[Device] = field(default_factory=list)
    counter_sets: list[dict[str, Any]] = field(default_factory=list)
    slice_names: list[str] = field(default_factory=list)
    slice_uids: list[str] = field(default_factory=list)
    claims: list[dict[str, Any]] = field(default_factory=list)


def generate(
    *,
    nodes: int = 24,
    seed: int = 0,
    now: datetime = EPOCH,
    mix: Mapping[str, float] = DEFAULT_MIX,
    owners: bool = False,
    history: timedelta = CLAIM_HISTORY,
    outlier_nodes: Collection[int] = (),
    partly_used_mig: Collection[int] = (),
    cluster: str = "",
) -> Iterator[dict[str, Any]]:
    """Yield the objects of a simulated fleet of `nodes` GPU nodes, one kind after the other.

    Order: DeviceClasses, Nodes, ResourceSlices, ResourceClaims (as `kubectl get` lists them).
    The same arguments always give the same objects. `mix` weighs the layouts of `LAYOUTS`.
    With `owners`, the claims' Pods follow, and what owns them (ReplicaSets of the serving
    workloads' Deployments, Jobs of the training ones), so that usage is charged per job.
    Claims were created within `history` before `now`. The nodes at the indexes in
    `outlier_nodes` run an outlier driver; those in `partly_used_mig`, when their GPUs are
    static MIG and one is free, have about half the MIG devices of their first free GPU
    claimed. Neither changes any other object of the fleet. `cluster` names the cluster the
    fleet is simulated for: its devices' UUIDs are the cluster's own (none, the default,
    gives those of a fleet simulated before clusters mattered).
    """
    unknown = set(mix) - set(LAYOUTS)
    if unknown:
        raise ValueError(f"unknown layouts {sorted(unknown)}; known: {sorted(LAYOUTS)}")
    if history < 2 * _NEWEST_CLAIM_AGE:
        raise ValueError(f"history {history} is too short: claims need at least 20 minutes")
    yield from device_classes(now)
    for kind in ("Node", "ResourceSlice", "ResourceClaim"):
        for index in range(nodes):
            plan = plan_node(
                index=index,
                seed=seed,
                now=now,
                mix=mix,
                history=history,
                outlier=index in outlier_nodes,
                partly_used_mig=index in partly_used_mig,
                cluster=cluster,
            )
            if kind == "Node":
                yield node_object(plan)
            elif kind == "ResourceSlice":
                yield from slice_objects(plan)
            else:
                yield from plan.claims
                if owners:
                    yield from owner_objects(plan.claims)


# Workloads run as Jobs (training, evaluation, sweeps); the others as Deployments.
_BATCH_WORDS = ("train", "sft", "finetune", "eval", "sweep", "exp")


def owner_objects(claims: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The Pods of `claims` and their controllers, derived from the claims alone (uids from
    names), so the random streams, and with them every other object, stay as they are."""
    for claim in claims:
        metadata = claim["metadata"]
        namespace, workload = metadata["namespace"], metadata["labels"]["app.kubernetes.io/name"]
        pod = metadata["ownerReferences"][0]
        # `<workload>-<ReplicaSet hash or Job suffix>-<suffix>`
        middle = pod["name"][len(workload) + 1 :].split("-")[0]
        controller_name = f"{workload}-{middle}"
        batch = any(word in workload for word in _BATCH_WORDS)
        controller = {
            "apiVersion": "batch/v1" if batch else "apps/v1",
            "kind": "Job" if batch else "ReplicaSet",
            "name": controller_name,
            "uid": _name_uid(namespace, controller_name),
            "controller": True,
        }
        # Who made the workload, as the workload webhook records it on the workload, its pod
        # template and so its Pods (`quota.workloads`): one of the namespace's people, by name.
        created_by = {CREATED_BY: _person(namespace, workload)}
        yield {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod["name"],
                "namespace": namespace,
                "uid": pod["uid"],
                "annotations": dict(created_by),
                "ownerReferences": [controller],
            },
        }
        owned: dict[str, Any] = {
            "name": controller_name,
            "namespace": namespace,
            "uid": controller["uid"],
            "annotations": dict(created_by),
        }
        if not batch:
            owned["ownerReferences"] = [
                {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "name": workload,
                    "uid": _name_uid(namespace, workload),
                    "controller": True,
                }
            ]
        yield {
            "apiVersion": controller["apiVersion"],
            "kind": controller["kind"],
            "metadata": owned,
        }


CREATED_BY = "tally.dev/created-by"
# The people of the simulated teams, three to a namespace.
PEOPLE = ("ana", "ben", "chen", "dana", "eli", "fay", "gus", "hana", "ivo")


def _person(namespace: str, workload: str) -> str:
    """One of three people of `namespace`, by the workload's name: the same on every run."""
    first = hashlib.sha1(namespace.encode()).digest()[0] % len(PEOPLE)
    which = hashlib.sha1(f"{namespace}/{workload}".encode()).digest()[0] % 3
    return PEOPLE[(first + which) % len(PEOPLE)]


def _name_uid(namespace: str, name: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"simulate/{namespace}/{name}"))


def device_classes(now: datetime) -> list[dict[str, Any]]:
    """The three DeviceClasses the NVIDIA driver's Helm chart installs."""
    created = _timestamp(now - timedelta(days=90))
    classes = []
    for index, (name, device_type, extended) in enumerate(
        (
            ("gpu.nvidia.com", "gpu", "nvidia.com/gpu"),
            ("mig.nvidia.com", "mig", None),
            ("vfio.gpu.nvidia.com", "vfio", None),
        )
    ):
        expression = (
            f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == '{device_type}'"
        )
        spec: dict[str, Any] = {"selectors": [{"cel": {"expression": expression}}]}
        if extended:
            spec["extendedResourceName"] = extended
        classes.append(
            {
                "apiVersion": API_VERSION,
                "kind": "DeviceClass",
                "metadata": {
                    "creationTimestamp": created,
                    "generation": 1,
                    "labels": {"app.kubernetes.io/managed-by": "Helm"},
                    "name": name,
                    "resourceVersion": str(1000 + index),
                    "uid": str(
                        uuid.UUID(int=random.Random(f"class/{name}").getrandbits(128), version=4)
                    ),
                },
                "spec": spec,
            }
        )
    return classes


def plan_node(
    *,
    index: int,
    seed: int,
    now: datetime,
    mix: Mapping[str, float],
    history: timedelta = CLAIM_HISTORY,
    outlier: bool = False,
    partly_used_mig: bool = False,
    cluster: str = "",
) -> NodePlan:
    """The node at `index` of the fleet: its layout, devices and the claims placed on it.

    `outlier` and `partly_used_mig` (see `generate`) change only what they name: every draw
    is made as without them, so the node is otherwise the same.
    """
    rng = random.Random(f"{seed}/node/{index}")
    names, weights = zip(*sorted(mix.items()), strict=True)
    layout = LAYOUTS[rng.choices(names, weights)[0]]
    driver_version, cuda_version = (
        rng.choice(OUTLIER_DRIVERS) if rng.random() < OUTLIER_SHARE else BASELINE_DRIVER
    )
    if outlier and (driver_version, cuda_version) == BASELINE_DRIVER:
        driver_version, cuda_version = OUTLIER_DRIVERS[0]
    name = f"gpu-{layout.model.node_prefix}-{index:05d}"
    clique = ""
    if layout.cliques:
        # Consecutive nodes share an NVLink domain (a clique of the fleet's one fabric).
        clique = f"{_uuid(random.Random(f'{seed}/fabric'))}.{index // CLIQUE_SIZE}"
    plan = NodePlan(
        index=index,
        name=name,
        uid=_uuid(rng),
        layout=layout,
        driver_version=driver_version,
        cuda_driver_version=cuda_version,
        created=now - timedelta(days=rng.randint(20, 60), seconds=rng.randint(0, 86399)),
        clique=clique,
        cluster=cluster,
    )
    _add_devices(plan, rng)
    pools = 2 if plan.counter_sets else 1
    plan.slice_names = [f"{name}-{DRIVER}-{_suffix(rng)}" for _ in range(pools)]
    plan.slice_uids = [_uuid(rng) for _ in range(pools)]
    _place_claims(plan, rng, seed=seed, now=now, history=history)
    if partly_used_mig:
        _claim_part_of_a_mig_gpu(plan, rng, seed=seed, now=now, history=history)
    return plan


def _add_devices(plan: NodePlan, rng: random.Random) -> None:
    model = plan.layout.model
    profiles = {profile.name: profile for profile in model.mig_profiles}
    # A DGX-like board: two GPUs per PCIe root complex.
    for gpu in range(GPUS_PER_NODE):
        bus = 0x18 + gpu * 0x11
        gpu_uuid = f"GPU-{_device_uuid(rng, plan.cluster)}"
        common = {
            "architecture": {"string": model.architecture},
            "brand": {"string": "Nvidia"},
            "cudaComputeCapability": {"version": model.compute_capability},
            "cudaDriverVersion": {"version": plan.cuda_driver_version},
            "driverVersion": {"version": plan.driver_version},
            "productName": {"string": model.product_name},
            "resource.kubernetes.io/pciBusID": {"string": f"0000:{bus:02x}:00.0"},
            "resource.kubernetes.io/pcieRoot": {
                "string": f"pci0000:{0x10 + (gpu // 2) * 0x20:02x}"
            },
        }
        if model.addressing_mode:
            common["addressingMode"] = {"string": model.addressing_mode}
        publishing = plan.layout.publishing
        if publishing in ("whole", "partitionable"):
            capacity: dict[str, Any] = {"memory": {"value": model.memory}}
            entry: dict[str, Any] = {
                "attributes": _sorted(
                    {**common, "type": {"string": "gpu"}, "uuid": {"string": gpu_uuid}}
                ),
                "capacity": capacity,
                "name": f"gpu-{gpu}",
            }
            if publishing == "partitionable":
                capacity["multiprocessors"] = {"value": str(model.multiprocessors)}
                counter_set = f"gpu-{gpu}-counter-set"
                plan.counter_sets.append({"name": counter_set, "counters": _gpu_counters(model)})
                entry["consumesCounters"] = [
                    {"counterSet": counter_set, "counters": _gpu_counters(model)}
                ]
            plan.devices.append(Device(entry["name"], gpu, entry))
        if publishing == "mig":
            placements = [(profiles[name], start) for name, start in rng.choice(STATIC_MIG_LAYOUTS)]
        elif publishing == "partitionable":
            placements = [(p, start) for p in model.mig_profiles for start in p.placements]
        else:
            placements = []
        for profile, start in placements:
            attributes = {
                **common,
                "parentUUID": {"string": gpu_uuid},
                "profile": {"string": profile.name},
                "type": {"string": "mig"},
            }
            if publishing == "mig":  # a partition that is not created yet has no UUID
                attributes["uuid"] = {"string": f"MIG-{_device_uuid(rng, plan.cluster)}"}
            name = f"gpu-{gpu}-mig-{profile.name.replace('.', '')}-{profile.profile_id}-{start}"
            entry = {
                "attributes": _sorted(attributes),
                "capacity": _mig_capacity(profile),
                "name": name,
            }
            if publishing == "partitionable":
                entry["consumesCounters"] = [
                    {
                        "counterSet": f"gpu-{gpu}-counter-set",
                        "counters": _mig_counters(profile, start),
                    }
                ]
            plan.devices.append(Device(name, gpu, entry, mig=profile, placement=start))


def _gpu_counters(model: GpuModel) -> dict[str, Any]:
    counters: dict[str, Any] = {
        "memory": {"value": model.memory},
        "multiprocessors": {"value": str(model.multiprocessors)},
    }
    for memory_slice in range(8):
        counters[f"memory-slice-{memory_slice}"] = {"value": "1"}
    return counters


def _mig_counters(profile: MigProfile, start: int) -> dict[str, Any]:
    counters: dict[str, Any] = {
        "memory": {"value": profile.memory},
        "multiprocessors": {"value": str(profile.multiprocessors)},
    }
    for memory_slice in range(start, start + profile.memory_slices):
        counters[f"memory-slice-{memory_slice}"] = {"value": "1"}
    return counters


def _mig_capacity(profile: MigProfile) -> dict[str, Any]:
    return {
        "copyEngines": {"value": str(profile.copy_engines)},
        "decoders": {"value": str(profile.decoders)},
        "encoders": {"value": "0"},
        "jpegEngines": {"value": str(profile.jpeg_engines)},
        "memory": {"value": profile.memory},
        "multiprocessors": {"value": str(profile.multiprocessors)},
        "ofaEngines": {"value": str(profile.ofa_engines)},
    }


def _place_claims(
    plan: NodePlan, rng: random.Random, *, seed: int, now: datetime, history: timedelta
) -> None:
    """Claims on this node: all GPUs taken (40%), some (40%) or none (20%); a few pending."""
    state = rng.random()
    wanted = (
        GPUS_PER_NODE if state < 0.4 else rng.randint(1, GPUS_PER_NODE - 1) if state < 0.8 else 0
    )
    gpus = rng.sample(range(GPUS_PER_NODE), wanted)
    groups: list[list[Device]] = []
    publishing = plan.layout.publishing
    by_gpu: dict[int, list[Device]] = {}
    for device in plan.devices:
        by_gpu.setdefault(device.gpu_index, []).append(device)
    if publishing == "whole":
        # Whole-GPU claims of 8, 4, 2 or 1 GPUs until the node's share is taken.
        remaining = sorted(gpus)
        while remaining:
            size = rng.choice([n for n in (8, 4, 2, 1) if n <= len(remaining)])
            groups.append([by_gpu[gpu][0] for gpu in remaining[:size]])
            remaining = remaining[size:]
    elif publishing == "mig":
        groups.extend([device] for gpu in gpus for device in by_gpu[gpu])
    else:
        # Each taken GPU is claimed whole, or some MIG partitions of a layout that fits.
        for gpu in gpus:
            whole, *partitions = by_gpu[gpu]
            if rng.random() < 0.5:
                groups.append([whole])
                continue
            placed = {(d.mig.name, d.placement): d for d in partitions if d.mig}
            groups.extend(
                [placed[placement]]
                for placement in rng.choice(STATIC_MIG_LAYOUTS)
                if rng.random() < 0.75
            )
    for group in groups:
        plan.claims.append(
            _claim(plan, group, rng, seed=seed, now=now, history=history, allocated=True)
        )
    for _ in range(rng.choices((0, 1), (0.9, 0.1))[0]):
        plan.claims.append(
            _claim(
                plan, [plan.devices[0]], rng, seed=seed, now=now, history=history, allocated=False
            )
        )


def _claim_part_of_a_mig_gpu(
    plan: NodePlan, rng: random.Random, *, seed: int, now: datetime, history: timedelta
) -> None:
    """On a static-MIG node, claim about half the MIG devices of the first GPU no claim holds
    (at least one, never all): a GPU partly used, the rest of its slices free."""
    if plan.layout.publishing != "mig":
        return
    held = {
        (result["pool"], result["device"])
        for claim in plan.claims
        for result in claim.get("status", {})
        .get("allocation", {})
        .get("devices", {})
        .get("results", [])
    }
    for gpu in range(GPUS_PER_NODE):
        devices = [device for device in plan.devices if device.gpu_index == gpu]
        if len(devices) < 2 or any((plan.name, device.name) in held for device in devices):
            continue
        for device in devices[: len(devices) // 2]:
            plan.claims.append(
                _claim(plan, [device], rng, seed=seed, now=now, history=history, allocated=True)
            )
        return


def _claim(
    plan: NodePlan,
    devices: list[Device],
    rng: random.Random,
    *,
    seed: int,
    now: datetime,
    history: timedelta,
    allocated: bool,
) -> dict[str, Any]:
    """A claim generated from a Pod's resourceClaimTemplate, allocated `devices` or pending."""
    namespace = rng.choice(NAMESPACES)
    workload = rng.choice(WORKLOADS[namespace])
    # A Deployment's Pod: `<workload>-<ReplicaSet hash>-<suffix>`.
    pod_name = f"{workload}-{''.join(rng.choices(_ALPHANUMS, k=10))}-{_suffix(rng)}"
    pod_uid = _uuid(rng)
    profile = devices[0].mig
    if profile:
        selector = f"device.attributes['{DRIVER}'].profile == '{profile.name}'"
        request: dict[str, Any] = {
            "name": "mig",
            "exactly": {
                "allocationMode": "ExactCount",
                "count": 1,
                "deviceClassName": "mig.nvidia.com",
                "selectors": [{"cel": {"expression": selector}}],
            },
        }
    else:
        request = {
            "name": "gpu",
            "exactly": {
                "allocationMode": "ExactCount",
                "count": len(devices),
                "deviceClassName": "gpu.nvidia.com",
            },
        }
    # The draw is the same whatever `history`, scaled into it, so nothing else changes.
    newest, oldest = int(_NEWEST_CLAIM_AGE.total_seconds()), int(CLAIM_HISTORY.total_seconds())
    drawn = rng.randint(newest, oldest)
    span = int(history.total_seconds()) - newest
    created = now - timedelta(seconds=newest + (drawn - newest) * span // (oldest - newest))
    claim: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {
            "annotations": {"resource.kubernetes.io/pod-claim-name": request["name"]},
            "creationTimestamp": _timestamp(created),
            "finalizers": ["resource.kubernetes.io/delete-protection"],
            "generateName": f"{pod_name}-{request['name']}-",
            "labels": {"app.kubernetes.io/name": workload},
            "name": f"{pod_name}-{request['name']}-{_suffix(rng)}",
            "namespace": namespace,
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
            "resourceVersion": str(rng.randint(10**6, 10**8)),
            "uid": _uuid(rng),
        },
        "spec": {"devices": {"requests": [request]}},
    }
    if allocated:
        claim["status"] = {
            "allocation": {
                "allocationTimestamp": _timestamp(created + timedelta(seconds=rng.randint(1, 90))),
                "devices": {
                    "results": [
                        {
                            "device": device.name,
                            "driver": DRIVER,
                            "pool": plan.name,
                            "request": request["name"],
                        }
                        for device in devices
                    ]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [plan.name]}
                            ]
                        }
                    ]
                },
            },
            "reservedFor": [{"name": pod_name, "resource": "pods", "uid": pod_uid}],
        }
    return claim


def node_object(plan: NodePlan) -> dict[str, Any]:
    """The Node, with the labels GPU feature discovery and the cloud provider set."""
    model = plan.layout.model
    labels = {
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/hostname": plan.name,
        "kubernetes.io/os": "linux",
        "node.kubernetes.io/instance-type": model.instance_type,
        "nvidia.com/cuda.driver-version.full": plan.driver_version,
        "nvidia.com/gpu.count": str(GPUS_PER_NODE),
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": model.label,
        "topology.kubernetes.io/zone": f"us-east-1{'abc'[plan.index % 3]}",
    }
    if plan.clique:
        labels["nvidia.com/gpu.clique"] = plan.clique
    if plan.layout.publishing == "mig":
        labels["nvidia.com/mig.config"] = "custom"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "creationTimestamp": _timestamp(plan.created),
            "labels": dict(sorted(labels.items())),
            "name": plan.name,
            "resourceVersion": str(5_000_000 + plan.index),
            "uid": plan.uid,
        },
        "spec": {"providerID": f"aws:///us-east-1{'abc'[plan.index % 3]}/i-{plan.index:017x}"},
        "status": {
            "capacity": {"cpu": "192", "memory": "2097152Mi", "pods": "110"},
            "nodeInfo": {
                "architecture": "amd64",
                "containerRuntimeVersion": "containerd://2.1.4",
                "kernelVersion": "6.8.0-1031-aws",
                "kubeletVersion": "v1.35.1",
                "operatingSystem": "linux",
                "osImage": "Ubuntu 24.04.3 LTS",
            },
        },
    }


def slice_objects(plan: NodePlan) -> list[dict[str, Any]]:
    """The node's ResourceSlice, and for partitionable GPUs the pool's counter slice too."""
    pool = {"generation": 1, "name": plan.name, "resourceSliceCount": len(plan.slice_names)}
    specs: list[dict[str, Any]] = [
        {
            "devices": [device.entry for device in plan.devices],
            "driver": DRIVER,
            "nodeName": plan.name,
            "pool": pool,
        }
    ]
    if plan.counter_sets:
        # Since resource.k8s.io/v1 in 1.35 counters must sit in a slice of their own, with no
        # devices and no node selection.
        specs.append({"driver": DRIVER, "pool": pool, "sharedCounters": plan.counter_sets})
    return [
        {
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {
                "creationTimestamp": _timestamp(plan.created + timedelta(minutes=3)),
                "generateName": f"{plan.name}-{DRIVER}-",
                "generation": 1,
                "name": name,
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "controller": True,
                        "kind": "Node",
                        "name": plan.name,
                        "uid": plan.uid,
                    }
                ],
                "resourceVersion": str(6_000_000 + plan.index * 2 + number),
                "uid": uid,
            },
            "spec": spec,
        }
        for number, (name, uid, spec) in enumerate(
            zip(plan.slice_names, plan.slice_uids, specs, strict=True)
        )
    ]


class TextSink(Protocol):
    """Where a dump goes: a text file, `sys.stdout` or a command's `self.stdout`."""

    def write(self, text: str, /) -> object: ...


def write_dump(objects: Iterable[dict[str, Any]], stream: TextSink, *, fmt: str = "json") -> int:
    """Write `objects` to `stream` as a `kind: List` in `fmt` (json or yaml), item by item.

    The JSON has one item per line (what `kubectl get -o json` prints, less the indentation);
    the YAML is laid out as `kubectl get -o yaml` prints it. Returns the number of objects.
    """
    count = 0
    if fmt == "json":
        stream.write('{"apiVersion": "v1", "items": [\n')
        for count, obj in enumerate(objects, start=1):
            if count > 1:
                stream.write(",\n")
            stream.write(json.dumps(obj, separators=(",", ":")))
        stream.write('\n], "kind": "List", "metadata": {"resourceVersion": ""}}\n')
    elif fmt == "yaml":
        dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
        stream.write("apiVersion: v1\nitems:\n")
        for obj in objects:
            stream.write(yaml.dump([obj], Dumper=dumper, sort_keys=False, width=1000))
            count += 1
        if not count:
            stream.write("  []\n")  # `items:` alone would be null
        stream.write('kind: List\nmetadata:\n  resourceVersion: ""\n')
    else:
        raise ValueError(f"unknown format {fmt!r}: use json or yaml")
    return count


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _device_uuid(rng: random.Random, cluster: str) -> str:
    """A device's UUID: drawn from the node's stream whatever the cluster (so every other
    draw stays as it was), then made the cluster's own where one is named."""
    drawn = _uuid(rng)
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"simulate/{cluster}/{drawn}")) if cluster else drawn


def _suffix(rng: random.Random) -> str:
    return "".join(rng.choices(_ALPHANUMS, k=5))


def _timestamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _sorted(attributes: dict[str, Any]) -> dict[str, Any]:
    """Attributes in the order the API server prints them (Go sorts map keys)."""
    return dict(sorted(attributes.items()))
