"""The GPU fleet as Kubernetes DRA publishes it, and who held which device when.

Rows are never deleted by the sync: what disappears gets `gone_at` (devices, slices, nodes,
classes) or `released_at` (claims, allocations). Billing reads these intervals.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from inventory.version_numbers import validate_version_text

# How a device's share of its unit is stored, wherever it is (devices, shapes, allocations,
# usage rows, statement lines): to the millionth, up to 999,999 units, so a multi-host slice
# of a whole TPU pod (thousands of chips) counts what it holds.
SHARE_DIGITS = 12
SHARE_PLACES = 6


class Cluster(models.Model):
    """One Kubernetes cluster whose DRA objects Tally syncs."""

    name = models.SlugField(max_length=63, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Bumped by every sync that changes devices, device classes or nodes: the webhook's
    # workers reload their view of the fleet only when it moves.
    fleet_version = models.PositiveBigIntegerField(default=0)
    # When the sync first stored anything of the cluster (the `at` of its first import or
    # watch batch): an allocation the cluster says began earlier is charged from here, so a
    # first import never bills hours before Tally knew the cluster (`inventory.services`).
    first_synced_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return self.name


class Node(models.Model):
    """A Kubernetes node that hosts devices, with the labels DRA drivers use for topology."""

    cluster = models.ForeignKey(Cluster, on_delete=models.PROTECT, related_name="nodes")
    name = models.CharField(max_length=253)
    labels = models.JSONField(default=dict, blank=True)
    # NVLink clique (`nvidia.com/gpu.clique`): GPUs in one clique share an NVLink fabric.
    clique = models.CharField(max_length=253, blank=True, db_index=True)
    first_seen = models.DateTimeField()
    gone_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["cluster", "name"], name="node_unique_name"),
        ]

    def __str__(self) -> str:
        return self.name


class DeviceClass(models.Model):
    """A DeviceClass: the name claims ask for and the CEL selectors that define it."""

    cluster = models.ForeignKey(Cluster, on_delete=models.PROTECT, related_name="device_classes")
    name = models.CharField(max_length=253)
    uid = models.CharField(max_length=64, blank=True)
    api_version = models.CharField(max_length=64)
    # The CEL expressions of `spec.selectors[].cel.expression`, in order.
    selectors = models.JSONField(default=list, blank=True)
    extended_resource_name = models.CharField(max_length=253, blank=True)
    spec = models.JSONField(default=dict, blank=True)
    resource_version = models.CharField(max_length=64, blank=True)
    first_seen = models.DateTimeField()
    gone_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "device classes"
        constraints = [
            models.UniqueConstraint(
                fields=["cluster", "name"],
                condition=Q(gone_at__isnull=True),
                name="deviceclass_unique_present",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class ResourceSlice(models.Model):
    """One ResourceSlice as last seen, kept whole (unknown fields too) for pool reconciliation."""

    cluster = models.ForeignKey(Cluster, on_delete=models.PROTECT, related_name="slices")
    name = models.CharField(max_length=253)
    uid = models.CharField(max_length=64, blank=True)
    api_version = models.CharField(max_length=64)
    driver = models.CharField(max_length=253)
    pool = models.CharField(max_length=253)
    generation = models.BigIntegerField()
    resource_slice_count = models.PositiveIntegerField()
    node_name = models.CharField(max_length=253, blank=True)
    spec = models.JSONField(default=dict)
    resource_version = models.CharField(max_length=64, blank=True)
    first_seen = models.DateTimeField()
    # When the slice's current generation and spec were first stored: a slice updated in place
    # keeps `first_seen`, and what `inventory.checks` finds in a generation has been true since
    # then. Null only for rows written before it was kept (migration 0008 fills them in).
    generation_seen_at = models.DateTimeField(null=True, blank=True)
    gone_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["cluster", "name"],
                condition=Q(gone_at__isnull=True),
                name="slice_unique_present",
            ),
        ]
        indexes = [models.Index(fields=["cluster", "driver", "pool"], name="slice_pool")]

    def __str__(self) -> str:
        return self.name


class Pool(models.Model):
    """A driver's pool, and which generation of it the inventory currently counts.

    Devices are taken from the newest generation only, and only once all of its
    `resourceSliceCount` slices have been seen; until then the last complete generation stays.
    """

    cluster = models.ForeignKey(Cluster, on_delete=models.PROTECT, related_name="pools")
    driver = models.CharField(max_length=253)
    name = models.CharField(max_length=253)
    counted_generation = models.BigIntegerField(null=True, blank=True)
    newest_generation = models.BigIntegerField(null=True, blank=True)
    slices_expected = models.PositiveIntegerField(default=0)
    slices_seen = models.PositiveIntegerField(default=0)
    updated_at = models.DateTimeField()
    # When `newest_generation` was first seen (set by the sync when it changes): how long an
    # incomplete pool has waited for its slices, a rollout's seconds or a broken driver's days.
    newest_generation_seen_at = models.DateTimeField(null=True, blank=True)
    # Devices of the counted generation not taken because their identity (UUID or meter id)
    # is live in another cluster: {device name: [identity, that cluster's name]}. One GPU is
    # billed by one cluster; the pool is recounted at each sync until they are taken.
    refused = models.JSONField(default=dict, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["cluster", "driver", "name"], name="pool_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.driver}/{self.name}"

    @property
    def complete(self) -> bool:
        return self.slices_seen >= self.slices_expected > 0


class DeviceKind(models.TextChoices):
    GPU = "gpu", "whole accelerator"
    MIG = "mig", "MIG device"
    PARTITION = "partition", "partition of an accelerator"
    OTHER = "other", "not an accelerator"


class Unit(models.TextChoices):
    """What a device's `gpu_share` counts: one physical accelerator of this unit is 1."""

    GPU = "gpu", "GPU"
    TPU = "tpu", "TPU chip"
    GAUDI = "gaudi", "Gaudi card"
    ACCELERATOR = "accelerator", "accelerator"


class DriverProfile(models.Model):
    """How to read one DRA driver's devices, configured by operators (policy file or admin).

    Built-in profiles (NVIDIA, AMD, Intel GPU, Intel Gaudi, Google TPU) live in
    `inventory.profiles`; a row here describes another driver or overrides a built-in one.
    `spec` is validated by `inventory.profiles` (which devices are accelerators, the unit,
    identity, model and memory attributes, how a partition's share is computed).
    """

    driver = models.CharField(max_length=253, unique=True)
    spec = models.JSONField(default=dict)
    # "policy": written by `apply_policy` (and pruned by it); "admin": written by hand.
    source = models.CharField(max_length=16, default="admin")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return self.driver


class VersionBaseline(models.Model):
    """The driver/CUDA pair validated for one model or architecture in one cluster.

    An empty `product_name` and `architecture` is the cluster-wide baseline; the most specific
    row that matches a device applies (product, then architecture, then cluster-wide). A row
    naming a DRA `driver` judges only that driver's devices (`inventory.versions`).
    """

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="baselines")
    driver = models.CharField(
        max_length=253,
        blank=True,
        help_text="The DRA driver whose devices it judges (gpu.nvidia.com).",
    )
    product_name = models.CharField(max_length=253, blank=True)
    architecture = models.CharField(max_length=64, blank=True)
    driver_version = models.CharField(max_length=64, blank=True, validators=[validate_version_text])
    cuda_driver_version = models.CharField(
        max_length=64, blank=True, validators=[validate_version_text]
    )
    source = models.CharField(max_length=16, default="admin")
    note = models.TextField(blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["cluster", "driver", "product_name", "architecture"],
                name="versionbaseline_unique_driver_scope",
            ),
        ]

    def __str__(self) -> str:
        scope = self.product_name or self.architecture or "all models"
        return f"{self.cluster} {self.driver + ' ' if self.driver else ''}{scope}"


class VersionDeviation(models.Model):
    """A documented deviation from the baseline: a node or pool allowed to run another
    driver/CUDA pair, why, who answers for it, and until when (issue 20)."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="deviations")
    driver = models.CharField(
        max_length=253, blank=True, help_text="The DRA driver of the devices; empty: any."
    )
    node_name = models.CharField(max_length=253, blank=True)
    pool = models.CharField(max_length=253, blank=True)
    driver_version = models.CharField(max_length=64, blank=True, validators=[validate_version_text])
    cuda_driver_version = models.CharField(
        max_length=64, blank=True, validators=[validate_version_text]
    )
    reason = models.TextField()
    owner = models.CharField(max_length=253)
    expires_at = models.DateTimeField()
    source = models.CharField(max_length=16, default="admin")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.cluster} {self.node_name or self.pool} until {self.expires_at:%Y-%m-%d}"


class DeviceShape(models.Model):
    """What a group of devices look like to a CEL selector: attributes less identity, capacity.

    The quota webhook evaluates selectors once per shape instead of once per device, so its
    cost does not grow with the fleet. Rows are written once per distinct shape; a shape no
    device has any more (attributes changed by a driver upgrade, a shape key changed) is
    deleted by the sync's relist once it has been unused for a while (see
    `inventory.services.delete_unused_shapes`).
    """

    cluster = models.ForeignKey(Cluster, on_delete=models.PROTECT, related_name="shapes")
    key = models.CharField(max_length=40)
    driver = models.CharField(max_length=253)
    kind = models.CharField(max_length=16, choices=DeviceKind.choices)
    unit = models.CharField(max_length=16, choices=Unit.choices, default=Unit.GPU)
    gpu_share = models.DecimalField(max_digits=SHARE_DIGITS, decimal_places=SHARE_PLACES, default=0)
    attributes = models.JSONField(default=dict, blank=True)
    capacity = models.JSONField(default=dict, blank=True)
    allow_multiple_allocations = models.BooleanField(default=False)
    # When a relist first found no device of this shape (null: in use when last looked at).
    unused_since = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["cluster", "key"], name="deviceshape_unique_key"),
        ]

    def __str__(self) -> str:
        return f"{self.driver} {self.key[:10]}"


class Device(models.Model):
    """One device of a pool's counted generation, with its attributes kept as published.

    A physical GPU is counted by `physical_gpu_key`: a whole GPU, its MIG devices and its
    partitions all carry the same key. Non-GPU devices (kind `other`) have an empty key.
    """

    cluster = models.ForeignKey(Cluster, on_delete=models.PROTECT, related_name="devices")
    node = models.ForeignKey(
        Node, on_delete=models.PROTECT, null=True, blank=True, related_name="devices"
    )
    shape = models.ForeignKey(
        DeviceShape, on_delete=models.PROTECT, null=True, blank=True, related_name="devices"
    )
    driver = models.CharField(max_length=253)
    pool = models.CharField(max_length=253)
    name = models.CharField(max_length=253)
    slice_name = models.CharField(max_length=253)
    pool_generation = models.BigIntegerField()
    kind = models.CharField(max_length=16, choices=DeviceKind.choices, db_index=True)
    physical_gpu_key = models.CharField(max_length=512, blank=True, db_index=True)
    # What `gpu_share` counts (GPUs, TPU chips, Gaudi cards).
    unit = models.CharField(max_length=16, choices=Unit.choices, default=Unit.GPU)
    # Units: 1 for a whole accelerator, a MIG device's or partition's share of its parent.
    gpu_share = models.DecimalField(max_digits=SHARE_DIGITS, decimal_places=SHARE_PLACES, default=0)
    # What samples name the device by and billing meters it by: its published UUID (a MIG
    # device's own), else an identity formed from cluster, driver, pool and device name
    # (`inventory.profiles.meter_id`). Empty for devices that are not accelerators.
    meter_id = models.CharField(max_length=128, blank=True, db_index=True)
    # `{qualified name: {"int"|"bool"|"string"|"version": value}}` exactly as published.
    attributes = models.JSONField(default=dict, blank=True)
    # `{qualified name: {"value": "40Gi", ...}}` exactly as published.
    capacity = models.JSONField(default=dict, blank=True)
    # Everything else of the device entry (consumesCounters, taints, unknown fields).
    extra = models.JSONField(default=dict, blank=True)

    product_name = models.CharField(max_length=253, blank=True, db_index=True)
    uuid = models.CharField(max_length=128, blank=True, db_index=True)
    parent_uuid = models.CharField(max_length=128, blank=True, db_index=True)
    device_type = models.CharField(max_length=64, blank=True, db_index=True)
    profile = models.CharField(max_length=64, blank=True, db_index=True)
    memory_bytes = models.BigIntegerField(null=True, blank=True, db_index=True)
    architecture = models.CharField(max_length=64, blank=True, db_index=True)
    driver_version = models.CharField(max_length=64, blank=True, db_index=True)
    cuda_driver_version = models.CharField(max_length=64, blank=True, db_index=True)
    cuda_compute_capability = models.CharField(max_length=64, blank=True, db_index=True)

    first_seen = models.DateTimeField()
    gone_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["cluster", "driver", "pool", "name"],
                condition=Q(gone_at__isnull=True),
                name="device_unique_present",
            ),
        ]
        indexes = [models.Index(fields=["cluster", "driver", "pool"], name="device_pool")]

    def __str__(self) -> str:
        return f"{self.driver}/{self.pool}/{self.name}"


class Gang(models.Model):
    """Pods that must run together (issue 20), as the cluster declares them (`inventory.gangs`).

    `key` names the gang in its namespace ("JobSet/train", "LeaderWorkerSet/lws#0"); its member
    claims point here (`ResourceClaim.gang`). `ended_at` is set once no member claim is live,
    and cleared should a member appear again; the row is kept for history.
    """

    cluster = models.ForeignKey(Cluster, on_delete=models.PROTECT, related_name="gangs")
    namespace = models.CharField(max_length=253)
    key = models.CharField(max_length=320)
    # "workload" | "jobset" | "leaderworkerset" | "kueue" | "volcano" | "kubeflow"
    source = models.CharField(max_length=32)
    size = models.PositiveIntegerField()
    first_seen = models.DateTimeField()
    last_seen = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["cluster", "namespace", "key"], name="gang_unique_key"),
            models.CheckConstraint(condition=models.Q(size__gte=1), name="gang_size_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.namespace}/{self.key}"


class ResourceClaim(models.Model):
    """A ResourceClaim as last seen. `released_at` is set when it disappears.

    `job` ("Kind/name") is what usage is reported per: the claim's controller owner, followed
    through its Pod, ReplicaSet or Job to the workload behind it (see `inventory.owners`).
    """

    cluster = models.ForeignKey(Cluster, on_delete=models.PROTECT, related_name="claims")
    namespace = models.CharField(max_length=253, db_index=True)
    name = models.CharField(max_length=253)
    uid = models.CharField(max_length=64)
    api_version = models.CharField(max_length=64)
    labels = models.JSONField(default=dict, blank=True)
    annotations = models.JSONField(default=dict, blank=True)
    owner_references = models.JSONField(default=list, blank=True)
    # "" when the claim has no controller owner (billing then uses `admitted_job`).
    job = models.CharField(max_length=320, blank=True)
    # Who created the claim and the object it was made for ("Kind/name"), as the admission
    # webhook saw them: written by `quota` when the sync first sees the claim, read by billing.
    created_by = models.TextField(blank=True)
    admitted_job = models.TextField(blank=True)
    spec = models.JSONField(default=dict)
    status = models.JSONField(default=dict, blank=True)
    resource_version = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(null=True, blank=True)
    first_seen = models.DateTimeField()
    released_at = models.DateTimeField(null=True, blank=True, db_index=True)
    # The gang of the claim's Pod, set by the sync when it reads the Pod (null: none known).
    gang = models.ForeignKey(
        Gang, on_delete=models.SET_NULL, null=True, blank=True, related_name="claims"
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["cluster", "uid"], name="claim_unique_uid"),
        ]
        indexes = [models.Index(fields=["cluster", "namespace", "name"], name="claim_ns_name")]

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


class Allocation(models.Model):
    """One device held by one claim over `[start, end)`; `end` is null while it is held.

    `device` is linked when the device is known; the driver/pool/device names are kept either
    way so an allocation seen before its ResourceSlice is never lost.

    The job and the person charged for it are fixed when it starts, here, so that releasing
    the claim or rolling its hours up again never changes them: `job` is the claim's job as the
    sync resolved it (else as the webhook saw it), `username` who created the claim, as the
    webhook saw it (filled once, when quota records it). The team is not kept here: each hour
    is charged to the team that owned the claim's namespace in that hour (`teams.ownership`,
    dated), so a claim running before its namespace had an owner is not lost to billing.

    What it is metered and counted by is fixed the same way, from its device when it starts
    (or when the device is linked, for an allocation seen before it): a device that gains a
    UUID later (NVIDIA dynamic MIG, a driver upgrade) and so a new meter id, or a driver profile
    edited since, never changes the hours it has held. The rollup reads these, never the
    device's current columns.
    """

    cluster = models.ForeignKey(Cluster, on_delete=models.PROTECT, related_name="allocations")
    claim = models.ForeignKey(ResourceClaim, on_delete=models.PROTECT, related_name="allocations")
    device = models.ForeignKey(
        Device, on_delete=models.PROTECT, null=True, blank=True, related_name="allocations"
    )
    request = models.CharField(max_length=253)
    driver = models.CharField(max_length=253)
    pool = models.CharField(max_length=253)
    device_name = models.CharField(max_length=253)
    share_id = models.CharField(max_length=64, blank=True)
    consumed_capacity = models.JSONField(default=dict, blank=True)
    start = models.DateTimeField(db_index=True)
    end = models.DateTimeField(null=True, blank=True, db_index=True)
    job = models.TextField(blank=True)  # "Kind/name"
    username = models.TextField(blank=True)
    # The device's meter id, unit, model and MIG or partition profile when it started ("" until
    # the device is linked; no meter id: not an accelerator, not billed).
    meter_id = models.CharField(max_length=128, blank=True)
    unit = models.CharField(max_length=16, choices=Unit.choices, blank=True)
    product_name = models.CharField(max_length=253, blank=True)
    profile = models.CharField(max_length=64, blank=True)
    # The device's share of its unit, and the part of that this allocation holds: less for a
    # consumable share (KEP-5075), by the capacity it consumed; 0 for a device that is not an
    # accelerator. Usage rows count `gpu_share`; pricing reads `device_share`.
    device_share = models.DecimalField(
        max_digits=SHARE_DIGITS, decimal_places=SHARE_PLACES, default=0
    )
    gpu_share = models.DecimalField(max_digits=SHARE_DIGITS, decimal_places=SHARE_PLACES, default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["claim", "request", "driver", "pool", "device_name", "share_id"],
                condition=Q(end__isnull=True),
                name="allocation_unique_open",
            ),
        ]
        indexes = [models.Index(fields=["cluster", "driver", "pool", "device_name"])]

    def __str__(self) -> str:
        return f"{self.claim} → {self.driver}/{self.pool}/{self.device_name}"


class SyncState(models.Model):
    """Where the live sync of one kind stands, so a restart resumes its watch."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="sync_states")
    kind = models.CharField(max_length=64)
    resource_version = models.CharField(max_length=64, blank=True)
    last_event_at = models.DateTimeField(null=True, blank=True)
    last_relist_at = models.DateTimeField(null=True, blank=True)
    relists = models.PositiveIntegerField(default=0)
    events_applied = models.PositiveBigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["cluster", "kind"], name="syncstate_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.cluster}/{self.kind}"


class NodeShapeCount(models.Model):
    """How many present devices of one shape sit on one node (no node: devices published
    without one), kept by triggers on the device table (migration 0007) in the transaction
    that changed the devices, whatever wrote them (sync, COPY, admin, tests).

    The quota webhook reads the fleet from these rows instead of counting every device, and
    after a sync only the rows changed since it last read (`changed_xid`), so a reload costs
    what changed, not the fleet. A count that falls to zero is kept, so a reader sees it fall.
    """

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="+", db_index=False)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, null=True, related_name="+")
    shape = models.ForeignKey(
        DeviceShape, on_delete=models.CASCADE, related_name="+", db_index=False
    )
    devices = models.IntegerField()
    # The 64-bit id (`pg_current_xact_id()`) of the transaction that last changed `devices`.
    changed_xid = models.BigIntegerField()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["shape", "node"], nulls_distinct=False, name="nodeshapecount_unique"
            ),
        ]
        indexes = [models.Index(fields=["cluster", "changed_xid"], name="nodeshapecount_changed")]

    def __str__(self) -> str:
        return f"{self.cluster} node {self.node_id} shape {self.shape_id}: {self.devices}"
