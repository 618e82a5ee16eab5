"""Devices a sample names by driver and device name (or PCI address) rather than by UUID:
the key such a sample is carried under through validation, and its resolution against the
inventory, once per batch (`resolve_named`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple

from django.db.models import Q

from inventory import profiles
from inventory.models import Device
from metering.ingest.rows import Refusal, SampleRow
from metering.models import AgentToken

# A sample that names its device by driver and device name (and node, optionally pool) is
# carried through validation under a key no UUID can be (UUIDs are printable), then resolved
# by `ingest` against the inventory, once per batch.
NAMED = "\x00"
# A Kubernetes node name: a DNS subdomain (RFC 1123), at most 253 characters.
NODE_NAME = re.compile(
    r"(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)
MAX_NAME_LENGTH = 253
# A device named by its PCI address (the standard `resource.kubernetes.io/pciBusID`
# attribute) rather than its name: the key's device part is PCI_KEY-separated.
PCI_KEY = "\x01"
PCI_BUS_ID = re.compile(r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")
PCI_ATTRIBUTE = "resource.kubernetes.io/pciBusID"
# Where a device's PCI address is read from, in order: the standard attribute, else AMD's own
# `pciAddr` (auto-partition and vfio devices that publish only it), as the inventory's AMD
# profile reads a GPU's address (`inventory.profiles`, physical_unit_attributes).
PCI_ATTRIBUTES = (PCI_ATTRIBUTE, "pciAddr", "gpu.amd.com/pciAddr")


# A device named by its PCI address, with hyphens (`0000-0f-00-0`, optionally followed by
# `-<PCI device id>`): how Intel's Gaudi DRA driver names its cards, which publish no PCI
# attribute. PostgreSQL's regex for the query; the same in Python for the value.
PCI_NAME_SQL = r"^[0-9a-fA-F]{4}-[0-9a-fA-F]{2}-[0-9a-fA-F]{2}-[0-7](-|$)"
PCI_NAME = re.compile(r"([0-9a-fA-F]{4})-([0-9a-fA-F]{2})-([0-9a-fA-F]{2})-([0-7])(?:-.*)?")


def pci_address(attributes: dict[str, Any], name: str = "") -> str | None:
    """The PCI address a stored device's attributes publish, else (given its `name`) the one
    its name spells (Gaudi cards), lower-case; None without one."""
    for attribute in PCI_ATTRIBUTES:
        value = attributes.get(attribute)
        address = value.get("string") if isinstance(value, dict) else None
        if isinstance(address, str) and address:
            return address.lower()
    match = PCI_NAME.fullmatch(name)
    if match:
        domain, bus, slot, function = match.groups()
        return f"{domain}:{bus}:{slot}.{function}".lower()
    return None


class NamedDevice(NamedTuple):
    """A device named as its driver publishes it: `node` "" means the batch's node, `pool`
    "" any pool of the driver on that node."""

    node: str
    driver: str
    pool: str
    device: str  # the device's name, or PCI_KEY, its PCI address, PCI_KEY, its partition

    @property
    def pci(self) -> tuple[str, int | None] | None:
        """(PCI address, partition index or None) of a device named by its PCI address."""
        if not self.device.startswith(PCI_KEY):
            return None
        bus_id, _, partition = self.device[1:].partition(PCI_KEY)
        return bus_id, int(partition) if partition else None

    @property
    def label(self) -> str:
        where = f"node {self.node!r}" if self.node else "this node"
        return f"{self.sent} on {where}"

    @property
    def sent(self) -> str:
        """The device as the sample named it (driver, device or PCI address, pool), for
        messages: never the identity the inventory forms from them, which means nothing to
        the sender."""
        pool = f" (pool {self.pool!r})" if self.pool else ""
        pci = self.pci
        if pci is None:
            return f"{self.driver} device {self.device!r}{pool}"
        part = f" partition {pci[1]}" if pci[1] is not None else ""
        return f"{self.driver} device at PCI {pci[0]}{part}{pool}"


def named_device(key: str) -> NamedDevice | None:
    """The device a validated sample's key names by driver and device; None for a UUID."""
    if not key.startswith(NAMED):
        return None
    return NamedDevice(*key[1:].split(NAMED))


def resolve_samples(
    samples: Sequence[SampleRow], keys: set[str], node: str, agent: AgentToken | None
) -> tuple[list[SampleRow], dict[int, Refusal], dict[str, str], dict[int, str]]:
    """`samples` with each device named by driver and device replaced by its meter id, the
    ones refused (by position), the unknown ones' identities -> why (see `resolve_named`),
    and how each sample replaced named its device (`NamedDevice.sent`, by position), so that
    a later refusal names it so."""
    resolved, refusals, unknown = resolve_named(keys, node=node, agent=agent)
    rows: list[SampleRow] = []
    refused: dict[int, Refusal] = {}
    sent: dict[int, str] = {}
    ids = {key: meter for key, (meter, _) in unknown.items()} | resolved
    names = {key: name.sent for key in ids if (name := named_device(key)) is not None}
    for position, row in enumerate(samples):
        key = row[0]
        if key[:1] != NAMED:
            rows.append(row)
        elif key in refusals:
            label, reason = refusals[key]
            refused[position] = Refusal(position, label, reason, "device")
            rows.append(row)  # never stored: its position is refused
        else:
            rows.append(SampleRow(ids[key], *row[1:]))
            sent[position] = names[key]
    return rows, refused, dict(why for _, why in unknown.values()), sent


def formed_meter_id(cluster: str, driver: str, pool: str, device: str) -> str:
    """The identity the inventory forms for a device published without a UUID
    (`inventory.profiles.meter_id`, from the cluster's name): samples of such a device not
    known yet are kept aside under it, and adopted when the sync learns the device."""
    return profiles.meter_id(cluster, driver, pool, device)


class _Match(NamedTuple):
    """A present device a named sample may mean."""

    pool: str
    meter_id: str
    name: str
    kind: str


def _natural(name: str) -> list[Any]:
    """`gpu-2-130` before `gpu-10-138`: digits compared as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _pci_device(matches: list[_Match], partition: int | None) -> tuple[list[_Match], str]:
    """Of the devices carrying one PCI address, the one meant: the whole GPU without a
    partition, else the `partition`-th of its partitions in name order (AMD's driver names
    a GPU's partitions by their DRM card index, which follows the partition index); or why
    none can be chosen."""
    whole = [match for match in matches if match.kind != "partition"]
    parts = sorted(
        (match for match in matches if match.kind == "partition"), key=lambda m: _natural(m.name)
    )
    if partition is None:
        if len(whole) == 1 or len(matches) == 1:
            return (whole or matches)[:1], ""
        return [], f"{len(matches)} devices carry that PCI address; give the partition"
    if not parts and partition == 0 and len(whole) == 1:
        return whole, ""
    if partition < len(parts):
        return [parts[partition]], ""
    return [], f"that GPU has {len(parts)} partitions in the inventory, not a partition {partition}"


def resolve_named(
    keys: set[str], *, node: str, agent: AgentToken | None
) -> tuple[dict[str, str], dict[str, tuple[str, str]], dict[str, tuple[str, tuple[str, str]]]]:
    """Resolve devices named by driver and device name (`named_device` keys) through the
    inventory: a present device of that driver and name on that node (the sample's, else
    `node`), in the agent token's cluster (any, for an operator's backfill), in that pool
    if one is named.

    Returns three dicts by key: the meter ids found; the refused, as (label, reason): a node
    not the token's, a node of another cluster, a device that is not metered (not an
    accelerator), a name on several pools or clusters; and the unknown ones, as (the formed
    identity their samples are kept aside under, (that identity, why)). One query for the
    whole batch.
    """
    named = {key: named_device(key) for key in keys}
    wanted: dict[str, NamedDevice] = {}
    refused: dict[str, tuple[str, str]] = {}
    for key, name in named.items():
        assert name is not None
        where = name.node or node
        if agent is not None and agent.node != "*" and where != agent.node:
            refused[key] = (
                "device_elsewhere",
                f"{name.label}: node {where!r} is not this token's node {agent.node!r}",
            )
        else:
            wanted[key] = name._replace(node=where)
    found: dict[tuple[str, str, str], list[_Match]] = defaultdict(list)
    by_name = {key: name for key, name in wanted.items() if name.pci is None}
    by_pci = {key: name for key, name in wanted.items() if name.pci is not None}
    for named_here, by_address in ((by_name, False), (by_pci, True)):
        if not named_here:
            continue
        devices = Device.objects.filter(
            gone_at__isnull=True,
            node__name__in={name.node for name in named_here.values()},
            driver__in={name.driver for name in named_here.values()},
        )
        if by_address:
            devices = devices.filter(
                Q(attributes__has_any_keys=list(PCI_ATTRIBUTES)) | Q(name__regex=PCI_NAME_SQL)
            )
        else:
            devices = devices.filter(name__in={name.device for name in named_here.values()})
        if agent is not None:
            devices = devices.filter(cluster_id=agent.cluster_id)
        for (
            node_name,
            driver,
            device,
            pool,
            meter_id,
            uuid,
            kind,
            attributes,
        ) in devices.values_list(
            "node__name",
            "driver",
            "name",
            "pool",
            "meter_id",
            "uuid",
            "kind",
            "attributes" if by_address else "pk",
        ):
            if by_address:
                bus_id = pci_address(attributes, device)
                if bus_id is None:
                    continue
                found[node_name, driver, PCI_KEY + bus_id].append(
                    _Match(pool, meter_id or uuid, device, kind)
                )
            else:
                found[node_name, driver, device].append(
                    _Match(pool, meter_id or uuid, device, kind)
                )
    resolved: dict[str, str] = {}
    unknown: dict[str, tuple[str, tuple[str, str]]] = {}
    missing: dict[str, NamedDevice] = {}
    for key, name in wanted.items():
        label = name.label.replace("this node", f"node {name.node!r}")
        pci = name.pci
        where = name.device if pci is None else PCI_KEY + pci[0]
        matches = [
            match
            for match in found.get((name.node, name.driver, where), [])
            if not name.pool or match.pool == name.pool
        ]
        if pci is not None and matches:
            matches, why = _pci_device(matches, pci[1])
            if why:
                refused[key] = ("device", f"{label}: {why}")
                continue
        if len(matches) > 1:
            refused[key] = (
                "ambiguous_device",
                f"{label} names {len(matches)} devices (pools "
                f"{', '.join(sorted(repr(match.pool) for match in matches))}"
                f"{'' if agent else ', or clusters'}); give its pool"
                f"{'' if agent else ' (or its uuid)'}",
            )
        elif matches and not matches[0].meter_id:
            refused[key] = (
                "not_metered",
                f"{label} is not an accelerator Tally meters (no meter id in the inventory)",
            )
        elif matches:
            resolved[key] = matches[0].meter_id
        else:
            missing[key] = name
    if missing and agent is not None:
        # A node of another cluster is a wrong token, not a device the sync will bring.
        elsewhere = set(
            Device.objects.filter(
                gone_at__isnull=True, node__name__in={name.node for name in missing.values()}
            )
            .exclude(cluster_id=agent.cluster_id)
            .values_list("node__name", flat=True)
        ) - set(
            Device.objects.filter(
                cluster_id=agent.cluster_id,
                node__name__in={name.node for name in missing.values()},
            ).values_list("node__name", flat=True)
        )
        for key, name in list(missing.items()):
            if name.node in elsewhere:
                refused[key] = (
                    "device_elsewhere",
                    f"{name.label.replace('this node', 'node ' + repr(name.node))}: node "
                    f"{name.node!r} is in another cluster than this token's ({agent.cluster})",
                )
                del missing[key]
    for key, name in missing.items():
        label = name.label.replace("this node", f"node {name.node!r}")
        if name.pci is not None:
            # No device name to form its identity from: nothing to keep its samples under.
            refused[key] = (
                "device",
                f"{label} is not in the inventory (no device of that driver publishes "
                f"{' or '.join(PCI_ATTRIBUTES[:2])} {name.pci[0]} there); run sync_inventory "
                "first",
            )
            continue
        if agent is None:
            refused[key] = (
                "device",
                f"{label} is not in the inventory; run sync_inventory first, or send its uuid",
            )
            continue
        pool = name.pool or name.node
        meter = formed_meter_id(agent.cluster.name, name.driver, pool, name.device)
        unknown[key] = (
            meter,
            (
                meter,
                f"{label} is not in the inventory of cluster {agent.cluster.name!r}; its samples "
                f"are kept aside as {meter} (pool {pool!r}) until the sync learns it",
            ),
        )
    return resolved, refused, unknown
