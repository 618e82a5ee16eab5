"""`POST /ingest/samples`: the node agents' utilisation samples.

A thin edge: authenticate the bearer token, parse the body, call `metering.ingest`, answer
JSON. Bad input gets a 4xx with `{"error": ...}`, never a 500; a bad sample is reported in
`rejected` and the rest of the batch is stored.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import OperationalError
from django.http import HttpRequest, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from core import metrics
from core.inputs import BadInput, parse_json
from metering import ingest
from metering.ingest.schema import envelope_problems
from metering.models import AgentToken

log = logging.getLogger(__name__)

# A batch is an object of samples, each an object whose `processes` is a list of objects:
# five levels, and room for what a process's fields hold.
MAX_DEPTH = 16


def _error(status: int, message: str, **headers: str) -> JsonResponse:
    return JsonResponse({"error": message}, status=status, headers=headers)


def _max_samples() -> int:
    return int(getattr(settings, "TALLY_INGEST_MAX_SAMPLES", 5000))


def _max_body_bytes() -> int:
    return int(getattr(settings, "TALLY_INGEST_MAX_BODY_BYTES", 16 * 2**20))


def _bearer_token(request: HttpRequest) -> str:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _read_body(request: HttpRequest) -> bytes | None:
    """The body, or None when it is larger than the limit.

    Read here rather than through `request.body`, whose limit (`DATA_UPLOAD_MAX_MEMORY_SIZE`)
    suits forms, not a batch of samples with their process lists.
    """
    limit = _max_body_bytes()
    try:
        declared = int(request.headers.get("Content-Length") or 0)
    except ValueError:
        declared = 0
    if declared > limit:
        return None
    body = request.read(limit + 1)
    return body if len(body) <= limit else None


@csrf_exempt
def ingest_samples(request: HttpRequest) -> JsonResponse:
    """Store a batch `{"node": ..., "samples": [...]}` sent with the node's agent token.

    A sample names its device by `uuid`, or by `driver` and `device` (the device's name in
    its ResourceSlice; optionally `pool`, and `node` when not the batch's) or `driver` and
    `pci_bus_id` (and `partition`), which the inventory resolves to the device's meter id;
    `unknown_named` (only when there are some) says what each unknown named device's
    identity in `unknown_devices` stands for.

    Answers `{"accepted", "duplicates", "rejected": [{"index", "reason"}], "unknown_devices"}`;
    `rejected` lists the invalid samples and those the token may not send (a device on another
    node, an unknown device past the token's limits), none of them stored.
    """
    if request.method != "POST":
        return _error(405, "use POST", Allow="POST")
    try:
        return _ingest(request)
    except OperationalError as exc:
        log.error("ingest: database unavailable: %s", exc)
        return _error(
            503, "the database is unavailable; send the batch again", **{"Retry-After": "5"}
        )


@dataclass(frozen=True)
class Batch:
    """A batch as the ingest takes it: the agent's token, the node, the samples unchecked."""

    agent: AgentToken
    node: str
    samples: list[Any]


def read_batch(request: HttpRequest) -> Batch | JsonResponse:
    """The authenticated and parsed batch of `request`, or the 4xx answer that says what is
    wrong with it. Everything the endpoint does before it validates and stores the samples
    (`bench.ingest_urls` serves a floor made of it alone)."""
    token = _bearer_token(request)
    if not token:
        return _error(
            401, "missing Authorization: Bearer <agent token>", **{"WWW-Authenticate": "Bearer"}
        )
    agent = ingest.authenticate(token)
    if agent is None:
        return _error(401, "unknown or revoked agent token", **{"WWW-Authenticate": "Bearer"})
    body = _read_body(request)
    if body is None:
        return _error(413, f"body larger than {_max_body_bytes()} bytes; send smaller batches")
    try:
        payload: Any = parse_json(body, max_depth=MAX_DEPTH)
    except BadInput as exc:
        return _error(400, f"body is not JSON this service accepts: {exc}")
    # The batch's own fields, by its schema (`metering.ingest.schema`); its samples are
    # validated one by one later, a bad one rejected, the rest stored.
    problems = envelope_problems(payload)
    if "" in problems:
        return _error(400, 'body must be a JSON object {"node": ..., "samples": [...]}')
    node = payload.get("node")
    if problems.get("node") == "type":
        return _error(400, "node is missing or not a non-empty string")
    if "node" in problems:
        return _error(
            400, f"node {node[:64]!r} is not a Kubernetes node name (a DNS subdomain, <= 253)"
        )
    # A token issued for the whole cluster (node "*": a DCGM-reading agent that reports for
    # every node) may send for any node; a node's own token only for its node.
    if agent.node != "*" and node != agent.node:
        return _error(403, f"this token belongs to node {agent.node!r}, not {node[:253]!r}")
    samples = payload.get("samples")
    if "samples" in problems:
        return _error(400, "samples is missing or not a list")
    if len(samples) > _max_samples():
        return _error(
            413, f"{len(samples)} samples in one batch; send at most {_max_samples()} at a time"
        )
    return Batch(agent=agent, node=node, samples=samples)


def _ingest(request: HttpRequest) -> JsonResponse:
    batch = read_batch(request)
    if isinstance(batch, JsonResponse):
        return batch
    agent, node, samples = batch.agent, batch.node, batch.samples
    received_at = timezone.now()
    valid, rejected = ingest.validate_samples(samples, now=received_at)
    report = ingest.ingest(node=node, samples=valid, received_at=received_at, agent=agent)
    if report.refused:
        rejected = _with_refused(rejected, report.refused, len(samples))
    metrics.INGEST_SAMPLES.inc(report.accepted)
    for label, count in Counter(rejection["label"] for rejection in rejected).items():
        metrics.INGEST_REJECTED.labels(reason=label).inc(count)
    return JsonResponse(
        {
            "accepted": report.accepted,
            "duplicates": report.duplicates,
            "rejected": [
                {"index": rejection["index"], "reason": rejection["reason"]}
                for rejection in rejected
            ],
            "unknown_devices": report.unknown_devices,
            # Only when a sample named an unknown device by driver and device: what each
            # identity in `unknown_devices` stands for.
            **({"unknown_named": report.unknown_named} if report.unknown_named else {}),
        }
    )


def _with_refused(
    rejected: list[ingest.Rejection], refused: list[ingest.Refusal], sent: int
) -> list[ingest.Rejection]:
    """`rejected` (invalid samples) and the samples `ingest` refused, by their positions among
    the valid ones, as indexes of the batch sent, in order."""
    invalid = {rejection["index"] for rejection in rejected}
    valid_indexes = [index for index in range(sent) if index not in invalid]
    refusals: list[ingest.Rejection] = [
        {
            "index": valid_indexes[refusal.position],
            "reason": f"samples[{valid_indexes[refusal.position]}].{refusal.field}: "
            f"{refusal.reason}",
            "label": refusal.label,
        }
        for refusal in refused
    ]
    return sorted([*rejected, *refusals], key=lambda rejection: rejection["index"])
