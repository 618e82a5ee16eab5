"""factory_boy factories for the inventory, with values as NVIDIA's DRA driver publishes them.

The defaults describe an H100 node running driver 580.82.7 / CUDA 13.0.0:

    gpu = DeviceFactory.create()                   # a whole GPU on a new node
    MigDeviceFactory.create_batch(7, parent=gpu)   # seven 1g.10gb MIG devices of that GPU
    PartitionDeviceFactory.create(parent=gpu)      # a partition of it (same physical GPU)
    AllocationFactory.create(device=gpu)           # held now by a new claim

Devices of one GPU share `physical_gpu_key`; a whole GPU's key is its own uuid.
The factories are generic over their model, so `NodeFactory.create()` is typed as a `Node`.
"""

# Subclasses replace a declaration by another kind of declaration (a value by a
# SelfAttribute), which factory_boy intends and mypy reads as a type change.
# mypy: disable-error-code="assignment"

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import factory
from django.utils import timezone

from inventory.claim_sync import allocation_metering
from inventory.models import Allocation, Cluster, Device, DeviceKind, Node, ResourceClaim
from teams.models import Team, TeamNamespace

GPU_DRIVER = "gpu.nvidia.com"
GIB = 2**30


def _gpu_uuid() -> str:
    return f"GPU-{uuid.uuid4()}"


def _published_attributes(device: Any) -> dict[str, dict[str, str]]:
    """The device's promoted columns as the driver publishes them (unqualified names)."""
    attributes = {
        "type": ("string", device.device_type),
        "uuid": ("string", device.uuid),
        "parentUUID": ("string", device.parent_uuid),
        "productName": ("string", device.product_name),
        "architecture": ("string", device.architecture),
        "profile": ("string", device.profile),
        "driverVersion": ("version", device.driver_version),
        "cudaDriverVersion": ("version", device.cuda_driver_version),
        "cudaComputeCapability": ("version", device.cuda_compute_capability),
    }
    return {name: {value_type: value} for name, (value_type, value) in attributes.items() if value}


class ClusterFactory(factory.django.DjangoModelFactory[Cluster]):
    class Meta:
        model = Cluster
        django_get_or_create = ("name",)

    name = factory.Sequence(lambda n: f"cluster-{n}")


class NodeFactory(factory.django.DjangoModelFactory[Node]):
    class Meta:
        model = Node

    cluster = factory.SubFactory(ClusterFactory)
    name = factory.Sequence(lambda n: f"gpu-node-{n:03d}")
    clique = ""
    labels = factory.LazyAttribute(
        lambda node: {
            "kubernetes.io/hostname": node.name,
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            **({"nvidia.com/gpu.clique": node.clique} if node.clique else {}),
        }
    )
    first_seen = factory.LazyFunction(timezone.now)


class DeviceFactory(factory.django.DjangoModelFactory[Device]):
    """A whole GPU: kind `gpu`, its own uuid as physical key, a share of 1."""

    class Meta:
        model = Device

    node = factory.SubFactory(NodeFactory)
    cluster = factory.SelfAttribute("node.cluster")
    driver = GPU_DRIVER
    # The NVIDIA driver publishes one pool per node, named after the node.
    pool = factory.LazyAttribute(lambda device: device.node.name if device.node else "shared")
    name = factory.Sequence(lambda n: f"gpu-{n}")
    slice_name = factory.LazyAttribute(lambda device: f"{device.pool}-{device.driver}-x7k2p")
    pool_generation = 1
    kind = DeviceKind.GPU
    uuid = factory.LazyFunction(_gpu_uuid)
    parent_uuid = ""
    physical_gpu_key = factory.SelfAttribute("uuid")
    # NVIDIA publishes a UUID per device (a MIG device's own): samples name it by that.
    meter_id = factory.LazyAttribute(
        lambda device: device.uuid if device.kind != DeviceKind.OTHER else ""
    )
    gpu_share = Decimal(1)
    product_name = "NVIDIA H100 80GB HBM3"
    architecture = "Hopper"
    driver_version = "580.82.7"
    cuda_driver_version = "13.0.0"
    cuda_compute_capability = "9.0.0"
    memory_bytes = 80 * GIB
    device_type = factory.SelfAttribute("kind")
    profile = ""
    attributes = factory.LazyAttribute(_published_attributes)
    capacity = factory.LazyAttribute(
        lambda device: {"memory": {"value": f"{device.memory_bytes // GIB}Gi"}}
    )
    first_seen = factory.LazyFunction(timezone.now)
    gone_at = None


class _GpuPartDeviceFactory(DeviceFactory):
    """A device carved out of `parent` (a whole GPU device): same node, model, versions, key."""

    class Params:
        parent = factory.SubFactory(DeviceFactory)

    node = factory.SelfAttribute("parent.node")
    cluster = factory.SelfAttribute("parent.cluster")
    pool = factory.SelfAttribute("parent.pool")
    slice_name = factory.SelfAttribute("parent.slice_name")
    pool_generation = factory.SelfAttribute("parent.pool_generation")
    parent_uuid = factory.SelfAttribute("parent.uuid")
    physical_gpu_key = factory.SelfAttribute("parent.physical_gpu_key")
    product_name = factory.SelfAttribute("parent.product_name")
    architecture = factory.SelfAttribute("parent.architecture")
    driver_version = factory.SelfAttribute("parent.driver_version")
    cuda_driver_version = factory.SelfAttribute("parent.cuda_driver_version")
    cuda_compute_capability = factory.SelfAttribute("parent.cuda_compute_capability")


class MigDeviceFactory(_GpuPartDeviceFactory):
    """A MIG device (default 1g.10gb, a seventh of an H100) of `parent`."""

    kind = DeviceKind.MIG
    profile = "1g.10gb"
    uuid = factory.LazyFunction(lambda: f"MIG-{uuid.uuid4()}")
    # Current driver naming: gpu-<minor>-mig-<profile without dots>-<profileId>-<placement>.
    name = factory.Sequence(lambda n: f"gpu-0-mig-1g10gb-19-{n}")
    gpu_share = Decimal("0.142857")
    memory_bytes = 10 * GIB


class PartitionDeviceFactory(_GpuPartDeviceFactory):
    """A partition of `parent` published beside it (partitionable devices, half by default)."""

    kind = DeviceKind.PARTITION
    # Partitions publish no `type` or `uuid`: the sync ties them to the GPU by counter set.
    device_type = ""
    uuid = ""
    name = factory.Sequence(lambda n: f"gpu-0-partition-{n}")
    gpu_share = Decimal("0.5")
    memory_bytes = 40 * GIB


class OtherDeviceFactory(DeviceFactory):
    """A device that is not a GPU (an IMEX channel of the ComputeDomain driver)."""

    driver = "compute-domain.nvidia.com"
    kind = DeviceKind.OTHER
    name = factory.Sequence(lambda n: f"channel-{n}")
    uuid = ""
    physical_gpu_key = ""
    gpu_share = Decimal(0)
    product_name = ""
    architecture = ""
    driver_version = ""
    cuda_driver_version = ""
    cuda_compute_capability = ""
    memory_bytes = None
    capacity = factory.LazyFunction(dict)


class ResourceClaimFactory(factory.django.DjangoModelFactory[ResourceClaim]):
    class Meta:
        model = ResourceClaim

    cluster = factory.SubFactory(ClusterFactory)
    namespace = "team-a"
    name = factory.Sequence(lambda n: f"train-{n}-gpu")
    uid = factory.LazyFunction(lambda: str(uuid.uuid4()))
    api_version = "resource.k8s.io/v1"
    spec = factory.LazyFunction(
        lambda: {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": GPU_DRIVER}}]}
        }
    )
    created_at = factory.LazyFunction(timezone.now)
    first_seen = factory.LazyFunction(timezone.now)


def own_namespace(*, team: Team, namespace: str) -> TeamNamespace:
    """`team` owns `namespace` since always (a test's set-up: the dated writer is
    `teams.ownership`); refused when another team owns it now, so two tests' ideas of who owns
    it never mix silently."""
    current = TeamNamespace.objects.filter(namespace=namespace).first()
    if current is None:
        return TeamNamespace.objects.create(team=team, namespace=namespace)
    if current.team_id != team.pk:
        raise ValueError(f"namespace {namespace!r} is owned by {current.team}, not {team}")
    return current


class AllocationFactory(factory.django.DjangoModelFactory[Allocation]):
    """`device` held by a new claim of the same cluster since now (open: `end` is null).
    `team=`: that team owns the claim's namespace since always, so its hours are charged to
    it (`own_namespace`)."""

    class Meta:
        model = Allocation
        skip_postgeneration_save = True

    device = factory.SubFactory(DeviceFactory)
    cluster = factory.SelfAttribute("device.cluster")
    claim = factory.SubFactory(ResourceClaimFactory, cluster=factory.SelfAttribute("..cluster"))
    request = "gpu"
    driver = factory.SelfAttribute("device.driver")
    pool = factory.SelfAttribute("device.pool")
    device_name = factory.SelfAttribute("device.name")
    consumed_capacity = factory.LazyFunction(dict)
    start = factory.LazyFunction(timezone.now)
    end = None
    # What it is metered and counted by, fixed from its device as the sync fixes it.
    meter_id = factory.LazyAttribute(lambda allocation: allocation.metering["meter_id"])
    unit = factory.LazyAttribute(lambda allocation: allocation.metering["unit"])
    product_name = factory.LazyAttribute(lambda allocation: allocation.metering["product_name"])
    profile = factory.LazyAttribute(lambda allocation: allocation.metering["profile"])
    device_share = factory.LazyAttribute(lambda allocation: allocation.metering["device_share"])
    gpu_share = factory.LazyAttribute(lambda allocation: allocation.metering["gpu_share"])

    @factory.post_generation
    def team(allocation: Allocation, create: bool, extracted: Team | None, **_: Any) -> None:
        if create and extracted is not None:
            own_namespace(team=extracted, namespace=allocation.claim.namespace)

    class Params:
        metering = factory.LazyAttribute(
            lambda allocation: allocation_metering(
                device=vars(allocation.device),
                capacity=allocation.device.capacity,
                consumed_capacity=allocation.consumed_capacity,
            )
        )


def owner_of(allocation: Allocation) -> Team | None:
    """The team that owns the allocation's namespace now (whom its new hours are charged to)."""
    current = TeamNamespace.objects.filter(namespace=allocation.claim.namespace).first()
    return current.team if current is not None else None
