"""Metering: the agents' tokens, utilisation samples, MIG spells, and the hourly usage rows
the rollup derives from them (what every usage report and statement counts).

GPU time is kept as integer GPU-milliseconds (a MIG device's milliseconds times its share of
its GPU) so that sums are exact. The tables keep their names from when these models were
billing's (`billing_sample`, ...): moving them here moved no data (issue 37).
"""

from __future__ import annotations

from django.contrib.postgres.fields import ArrayField
from django.contrib.postgres.indexes import BrinIndex
from django.db import models

from inventory.models import SHARE_DIGITS, SHARE_PLACES, Allocation, Cluster, Unit
from metering.hours import idle_of
from teams.models import Team


class AgentToken(models.Model):
    """A node agent's bearer token; only its SHA-256 is stored."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="agent_tokens")
    node = models.CharField(max_length=253)
    token_sha256 = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "billing_agenttoken"

    def __str__(self) -> str:
        return f"{self.cluster}/{self.node}"


class Sample(models.Model):
    """One utilisation reading of one device (GPU or MIG device, by UUID) at one instant.

    `ts_ms` is milliseconds since the epoch (UTC), so the rollup works in integers.
    A device and instant are stored once, however often they are sent. Samples arrive roughly
    in time order, so the index on `ts_ms` alone is a BRIN one, which costs an insert next to
    nothing; the rollup reads hours of samples through it.

    `gap_ms` is the time to the device's next sample (null: none yet), kept by `ingest` as
    samples arrive, in any order: a sample's utilisation holds for `min(gap_ms, hold)`, so
    the rollup sums spans without ordering the samples again.

    The table is partitioned by range of `ts_ms`, one partition per UTC day (migration 0007),
    so a day ages out as one dropped table (`metering.retention`); queries that bound `ts_ms`
    read only their days' partitions. The database's primary key is (id, ts_ms), as a
    partitioned table's must hold its partition key; Django keeps `id` alone as the primary
    key (ids come from one sequence, so they are unique), because its admin refuses models
    with a composite one.
    """

    # Compared byte by byte (COLLATE "C"): a UUID is never shown in a language's order, and the
    # locale's collation would cost every comparison of every btree insert and sort.
    device_uuid = models.CharField(max_length=128, db_collation="C")
    ts_ms = models.BigIntegerField()
    gpu_util = models.FloatField(null=True, blank=True)  # percent, 0-100; null: not measured
    mem_used_bytes = models.BigIntegerField(null=True, blank=True)
    processes = models.JSONField(null=True, blank=True)
    node = models.CharField(max_length=253, blank=True)
    received_at = models.DateTimeField()
    gap_ms = models.BigIntegerField(null=True, blank=True)
    # A mean's covered time (the agent's `covered_seconds`, in ms): its utilisation holds for
    # `min(gap_ms, covered_ms)`, not the whole gap to the next sample. Null: a single reading.
    covered_ms = models.BigIntegerField(null=True, blank=True)
    # Set on a sample DCGM named by its GPU instance (`<parent UUID>::gi<N>`): N. It is stored
    # under the device its GPU instance was at its instant (the spells, `MigInstance`), and
    # moved when they change (`metering.ingest`); null: a sample sent under its device's own id.
    placed_gpu_instance = models.IntegerField(null=True, blank=True)

    class Meta:
        db_table = "billing_sample"
        constraints = [
            models.UniqueConstraint(
                fields=["device_uuid", "ts_ms"], include=["gpu_util"], name="sample_unique"
            ),
        ]
        # BRIN: a summary per range of heap pages, a few kilobytes for millions of rows, so an
        # insert almost never touches it; autovacuum summarises each range once it fills.
        indexes = [BrinIndex(fields=["ts_ms"], name="sample_ts", autosummarize=True)]

    def __str__(self) -> str:
        return f"{self.device_uuid}@{self.ts_ms}"


class SampleBlock(models.Model):
    """One device's samples of one closed UTC day, compacted: arrays in time order, one row
    where `Sample` holds one a sample (`metering.compaction`).

    The device's first and last sample of the day (`lo_ms`, `hi_ms`) stay in `Sample`: a
    block holds only the samples strictly between them. So every lookup of a device's
    neighbouring, first or latest sample that `Sample` answers stays right without reading
    blocks, unless it falls inside a block's `(lo_ms, hi_ms)`: a write there thaws the block
    back into `Sample` first (`compaction.thaw_samples`). Readers of a time window read both
    through `metering_readings(lo, hi)` / `metering_samples(lo, hi)` (migration 0004). Samples
    placed by a GPU instance's spells (`Sample.placed_gpu_instance`) are never compacted: their
    device-day stays in `Sample`, so the spells' moves find them there.

    Instants are kept as milliseconds from `day_ms` (int4); the arrays are TOASTed and
    compressed (pglz) as one value each, so a repeated node, process list or gap costs next
    to nothing. `processes` keeps each sample's JSON as text (null: none), exactly.
    """

    device_uuid = models.CharField(max_length=128, db_collation="C")
    day_ms = models.BigIntegerField()  # the UTC day's start, ms since the epoch
    lo_ms = models.BigIntegerField()
    hi_ms = models.BigIntegerField()
    ts_off = ArrayField(models.IntegerField())
    gpu_util = ArrayField(models.FloatField(null=True))
    gap_ms = ArrayField(models.BigIntegerField(null=True))
    covered_ms = ArrayField(models.BigIntegerField(null=True))
    mem_used_bytes = ArrayField(models.BigIntegerField(null=True))
    processes = ArrayField(models.TextField(null=True))
    node = ArrayField(models.TextField())
    received_at = ArrayField(models.DateTimeField())

    class Meta:
        db_table = "metering_sampleblock"
        constraints = [
            models.UniqueConstraint(fields=["device_uuid", "day_ms"], name="sampleblock_unique")
        ]
        # A window's blocks, all devices (the rollup's reads).
        indexes = [models.Index(fields=["day_ms"], name="sampleblock_day")]

    def __str__(self) -> str:
        return f"{self.device_uuid}@{self.day_ms} ({len(self.ts_off)} samples)"


class HourSum(models.Model):
    """Per device and hour `h` (hours since the epoch): what the rollup's per-hour sums
    (`metering.rollup._PER_HOUR_SQL`) make of the spans of the samples whose own hour is `h`,
    kept as samples are written (`metering.hoursums`), so the rollup of a closed hour reads one
    row a device rather than scanning its samples.

    `covered` is the milliseconds the spans cover within hour `h`, `weighted` those milliseconds
    times utilisation (`UTIL_SCALE`ths of a percent, each reading rounded as the rollup rounds
    it); `spill` and `spill_weighted` the same for the part past the hour's end, in `h + 1`.
    Integer sums: exact, the same whatever order samples arrive in. Made under the hold
    `HourSumState` records. Statement triggers on `billing_sample` (migration 0005) add each
    statement's new rows and take away its old ones, in the writer's transaction; samples
    compacted into blocks count as before (a move changes no sum).
    """

    # The key the triggers' upserts meet rows by; no id (no sequence for each upsert to draw).
    pk = models.CompositePrimaryKey("device_uuid", "h")
    device_uuid = models.CharField(max_length=128, db_collation="C")
    h = models.BigIntegerField()
    covered = models.BigIntegerField()
    weighted = models.BigIntegerField()
    spill = models.BigIntegerField()
    spill_weighted = models.BigIntegerField()

    class Meta:
        db_table = "metering_hoursum"
        # A window's rows, every device (the rollup's read).
        indexes = [models.Index(fields=["h"], name="hoursum_h")]

    def __str__(self) -> str:
        return f"{self.device_uuid}@{self.h}"


class HourSumState(models.Model):
    """One row (id 1): the hold (TALLY_SAMPLE_HOLD_SECONDS, in ms) `HourSum` is made with. The
    triggers read it; the rollup reads the sums only while it equals the setting's hold, and
    `rebuild_sample_sums` makes the sums again under a new one."""

    hold_ms = models.BigIntegerField()

    class Meta:
        db_table = "metering_hoursumstate"

    def __str__(self) -> str:
        return f"hold {self.hold_ms} ms"


class UnknownDeviceSample(models.Model):
    """A sample for a UUID the inventory does not know yet, kept aside, not dropped.

    Moved into `Sample` once the device is known (the sync can lag the agents). Bounded: an
    agent token sets aside samples of at most TALLY_INGEST_MAX_UNKNOWN_DEVICES devices, at
    most TALLY_INGEST_MAX_UNKNOWN_SAMPLES of them, and what no device claims within
    TALLY_INGEST_UNKNOWN_RETENTION_DAYS is deleted. `agent_token` is null for samples an
    operator loaded (`ingest_samples`). `node` is the node that sent the sample (a node's
    token's own node): a token's samples are adopted only for a device where that token may
    send (`metering.ingest.adopt_unknown_samples`).
    """

    device_uuid = models.CharField(max_length=128, db_index=True)
    ts_ms = models.BigIntegerField()
    gpu_util = models.FloatField(null=True, blank=True)
    mem_used_bytes = models.BigIntegerField(null=True, blank=True)
    processes = models.JSONField(null=True, blank=True)
    node = models.CharField(max_length=253, blank=True)
    received_at = models.DateTimeField(db_index=True)
    # As on `Sample`: a mean's covered time, kept so it holds as long once adopted.
    covered_ms = models.BigIntegerField(null=True, blank=True)
    # A dynamic MIG device's sample (`metering.mig_samples`): its GPU and placement as the agent
    # sent them (`parent_uuid`, `start`, `size`, `profile`, `profile_id`), so it is adopted by
    # the partition at that placement once the sync has it.
    mig_placement = models.JSONField(null=True, blank=True)
    # A MIG device's GPU instance as the agent sent it (`parent_uuid`, `gpu_instance_id`), so
    # the device it is adopted under records it (`metering.mig_instances`), as `ingest` would.
    gpu_instance = models.JSONField(null=True, blank=True)
    # The cluster the sample is of: a token's, its token's; a DCGM sample named by its GPU
    # instance (`<parent UUID>::gi<N>`) set aside without a token (an operator's, or one set
    # aside again when the spells it was placed by changed), the cluster whose spells may place
    # it; null: any (an operator's whose cluster is not known). Part of the uniqueness, so that
    # one cluster's token cannot stand in for another cluster's own sample.
    cluster = models.ForeignKey(
        Cluster, on_delete=models.CASCADE, null=True, blank=True, related_name="+", db_index=False
    )
    agent_token = models.ForeignKey(
        AgentToken,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="unknown_device_samples",
    )

    class Meta:
        db_table = "billing_unknowndevicesample"
        constraints = [
            # Per sending node and cluster: a token's samples under the identity of a device on
            # another node (never adopted), or of a GPU instance on another cluster's node of
            # the same name, must not crowd out that device's own (`metering.ingest`). An
            # operator's of no known cluster (null) are one scope.
            models.UniqueConstraint(
                fields=["device_uuid", "ts_ms", "node", "cluster"],
                nulls_distinct=False,
                name="unknownsample_unique_per_cluster",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.device_uuid}@{self.ts_ms} (unknown device)"


class MigInstance(models.Model):
    """A spell of a GPU instance id of a GPU: which MIG device (`meter_id`) it was from the
    first to the last sample time a run of that device's samples gave it, with no sample of
    another device under that id between (`metering.mig_instances`).

    DCGM names a MIG device by its parent's UUID and its GPU instance id (`GPU_I_ID`), never
    by the MIG UUID, and NVIDIA's DRA driver publishes no GPU instance ids: these rows are how
    the Prometheus source tells apart two MIG devices of one profile on one GPU
    (`metering.prometheus`), and how the ingest stores an agent's DCGM samples named
    `<parent UUID>::gi<N>` (`metering.ingest`). An id reused A, B, A gives three spells, so a
    reading between is never claimed by both. A GPU instance is keyed by cluster, node (the
    inventory's, where its GPU is), parent and id; its spells are the runs of all its samples
    in time order, whatever order their batches came in, from agents, backfills and adopted
    samples alike.
    """

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="+")
    node = models.CharField(max_length=253)
    parent_uuid = models.CharField(max_length=128)
    gpu_instance_id = models.IntegerField()
    meter_id = models.CharField(max_length=128)
    first_ms = models.BigIntegerField()
    last_ms = models.BigIntegerField()

    class Meta:
        db_table = "billing_miginstance"
        constraints = [
            # Spells of one device under one GPU instance never overlap: one starts once. The
            # order serves `metering.mig_instances`, which reads a GPU instance's spells by time.
            models.UniqueConstraint(
                fields=[
                    "cluster",
                    "node",
                    "parent_uuid",
                    "gpu_instance_id",
                    "first_ms",
                    "meter_id",
                ],
                name="miginstance_unique_spell",
            ),
        ]
        indexes = [
            # A GPU instance's spells ending from a time on: the ones a batch falls in or
            # next to, however many its id was reused for before (`metering.mig_instances`).
            models.Index(fields=["cluster", "node", "parent_uuid", "gpu_instance_id", "last_ms"]),
            # A GPU's spells about a window (`metering.prometheus`).
            models.Index(fields=["parent_uuid", "last_ms"]),
        ]

    def __str__(self) -> str:
        return f"{self.parent_uuid}::gi{self.gpu_instance_id} = {self.meter_id}"


class DcgmInstance(models.Model):
    """A GPU instance DCGM sent samples of under `<parent UUID>::gi<N>` (an agent that could not
    tell its MIG device), on a node: the first and last instants sent. Those samples are stored
    under the device the GPU instance was at each instant, by its spells (`MigInstance`), and
    placed again where the spells change (`metering.ingest`); this row tells the spells' writer
    that there are such samples to look for, and when, so that where DCGM sent none (the
    usual case) a batch that extends a spell looks for none."""

    node = models.CharField(max_length=253)
    parent_uuid = models.CharField(max_length=128)
    gpu_instance_id = models.IntegerField()
    first_ms = models.BigIntegerField()
    last_ms = models.BigIntegerField()

    class Meta:
        db_table = "billing_dcgminstance"
        constraints = [
            models.UniqueConstraint(
                fields=["parent_uuid", "gpu_instance_id", "node"], name="dcgminstance_unique"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.parent_uuid}::gi{self.gpu_instance_id} on {self.node}"


class DirtyHour(models.Model):
    """An hour whose usage must be rolled up again: late samples or allocations touched it.

    `version` is new at every mark (`metering.dirty.mark_dirty`, from a sequence): a rollup takes
    away only the marks it read, at the version it read, so a mark made while it ran, whatever
    its `marked_at` says, outlives it."""

    hour = models.DateTimeField(unique=True)
    marked_at = models.DateTimeField()
    version = models.BigIntegerField(default=0)

    class Meta:
        db_table = "billing_dirtyhour"

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H:00}"


class RollupProgress(models.Model):
    """The newest hour beat's rollup has taken as the hour just ended (`rollup_pending`), in
    its one row. Each hour up to it was rolled up then or is marked (`DirtyHour`): a run that
    finds hours between it and the hour just ended (no worker ran while they ended) marks them,
    so an outage of the workers leaves no hour out of the open period's statements until the
    period closes. Budgets count the allocations themselves from the hour after it
    (`billing.selectors.team_gpu_hours`)."""

    rolled_through = models.DateTimeField()

    class Meta:
        db_table = "billing_rollupprogress"

    def __str__(self) -> str:
        return f"rolled up through {self.rolled_through:%Y-%m-%d %H:00}"


class UsageHour(models.Model):
    """One allocation's usage within one hour: the fact every usage report groups.

    allocated = utilised + idle + unmeasured, all in milliseconds of the device's `unit` (the
    columns say `gpu`: a TPU's row counts TPU chip-milliseconds, a Gaudi's card-milliseconds).
    `device_uuid` holds the device's meter id (`Device.meter_id`), which samples name it by.

    Derived rows, rewritten by the hour by the rollup (a week of a 1,000-GPU fleet is 168,000
    of them), so they are cheap to write: the references are kept by Django (PROTECT), not
    by foreign-key constraints, each of which would cost a trigger and a lookup per row; and
    the only indexes are the ones reads use: (hour, allocation) and (team, hour).
    """

    hour = models.DateTimeField()
    allocation = models.ForeignKey(
        Allocation,
        on_delete=models.PROTECT,
        related_name="usage",
        db_constraint=False,
        db_index=False,
    )
    cluster = models.ForeignKey(
        Cluster, on_delete=models.PROTECT, related_name="usage", db_constraint=False, db_index=False
    )
    device_uuid = models.CharField(max_length=128)
    product_name = models.CharField(max_length=253, blank=True)
    profile = models.CharField(max_length=64, blank=True)
    gpu_share = models.DecimalField(max_digits=SHARE_DIGITS, decimal_places=SHARE_PLACES)
    # What the figures count, copied from the device: hours of different units never add up.
    unit = models.CharField(max_length=16, choices=Unit.choices, default=Unit.GPU)
    namespace = models.CharField(max_length=253)
    claim_name = models.CharField(max_length=253)
    team = models.ForeignKey(
        Team,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        db_constraint=False,
        db_index=False,
    )
    # "Kind/name" of the claim's owner, and who made the claim: whole, as the allocation keeps
    # them (text, no limit): the API server bounds neither a username (a service account's is
    # up to 339 characters; other authenticators' any length) nor an owner reference's name.
    job = models.TextField(blank=True)
    username = models.TextField(blank=True)
    allocated_gpu_ms = models.BigIntegerField()
    utilised_gpu_ms = models.BigIntegerField()
    unmeasured_gpu_ms = models.BigIntegerField()

    class Meta:
        db_table = "billing_usagehour"
        constraints = [
            models.UniqueConstraint(fields=["hour", "allocation"], name="usagehour_unique"),
        ]
        indexes = [models.Index(fields=["team", "hour"], name="usagehour_team")]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H:00} {self.namespace}/{self.claim_name}"

    @property
    def idle_gpu_ms(self) -> int:
        return idle_of(self.allocated_gpu_ms, self.utilised_gpu_ms, self.unmeasured_gpu_ms)
