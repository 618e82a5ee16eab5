"""`manage.py review_claims PATH...`: what the webhooks answer to ResourceClaims in files.

Each ResourceClaim, and the claim each ResourceClaimTemplate makes, is sent as the API server
sends a CREATE: to the mutating webhook, its patch applied, then to the validating one. A dry
run by default, so nothing is reserved or recorded; `--reserve` admits for real.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonpatch
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from inventory.dumps import DumpError, iter_objects
from quota.admission import views as webhook

CLAIM_KINDS = ("ResourceClaim", "ResourceClaimTemplate")
OBJECT_FILES = (".yaml", ".yml", ".json")
VALIDATE_PATH = "/admission/resourceclaims"
MUTATE_PATH = "/admission/resourceclaims/mutate"
URL_TIMEOUT_SECONDS = 10

# Sends an AdmissionReview to a webhook (its path) and gives the answer's `response`.
Send = Callable[[str, dict[str, Any]], dict[str, Any]]


@dataclass
class Verdict:
    """What the webhooks said about one claim, as the API server would combine it."""

    allowed: bool
    message: str = ""
    warnings: list[str] = field(default_factory=list)


class Command(BaseCommand):
    help = (
        "Send the ResourceClaims and ResourceClaimTemplates in YAML/JSON files (or directories "
        "of them) through the quota webhooks as CREATEs, and print each decision with its "
        "reasons. A dry run unless --reserve: nothing is reserved or recorded."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "paths",
            nargs="+",
            type=Path,
            metavar="PATH",
            help="a file (multi-document YAML, JSON, a List) or a directory, read recursively "
            f"for {', '.join(OBJECT_FILES)} files",
        )
        parser.add_argument(
            "--namespace",
            help="create every claim in this namespace (default: each object's own, else default)",
        )
        parser.add_argument(
            "--user",
            default="review_claims",
            help="the creating user the webhook is told of (default: %(default)s)",
        )
        parser.add_argument(
            "--url",
            help="a running Tally's base URL (e.g. http://127.0.0.1:8000) to send the reviews "
            "to; default: in this process, through the same code as the webhook's views",
        )
        parser.add_argument(
            "--reserve",
            action="store_true",
            help="not a dry run: admitted claims reserve their quota, so later claims count "
            "them (the sync releases reservations for claims that never appear)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not options["url"]:
            _require_migrated()  # in this process the webhooks' answer would be "failed"
        send = _sender(options["url"])
        counts = {"allowed": 0, "denied": 0}
        unreadable = 0
        # Kinds of what was read but is no claim, to say what the files held instead.
        others: Counter[str] = Counter()
        for path in _files(options["paths"]):
            try:
                objects = list(iter_objects(path))
            except DumpError as exc:
                self.stderr.write(f"error: {exc}")
                unreadable += 1
                continue
            for obj in objects:
                if obj.get("kind") not in CLAIM_KINDS:
                    others[str(obj.get("kind") or "no kind")] += 1
                    continue
                claim = claim_to_create(obj, namespace=options["namespace"])
                verdict = review(
                    send, claim, username=options["user"], dry_run=not options["reserve"]
                )
                counts["allowed" if verdict.allowed else "denied"] += 1
                self.stdout.write(_line(path, obj, claim, verdict))
        mode = "admitted claims reserved" if options["reserve"] else "dry run, nothing reserved"
        self.stdout.write(
            f"{counts['allowed'] + counts['denied']} claims: {counts['allowed']} allowed, "
            f"{counts['denied']} denied ({mode})"
        )
        if unreadable:
            raise CommandError(f"{unreadable} file(s) could not be read")
        if not counts["allowed"] + counts["denied"]:
            # Nothing was reviewed: a wrong path or file is no pass.
            held = ", ".join(f"{n} {kind}" for kind, n in sorted(others.items())) or "nothing"
            named = ", ".join(str(path) for path in options["paths"])
            raise CommandError(
                f"no ResourceClaim or ResourceClaimTemplate in {named} (read: {held}); "
                "give the files that hold the claims to review"
            )


def _require_migrated() -> None:
    """A CommandError saying what to run when the database lacks migrations (an unreachable
    one raises OperationalError, which manage.py words in one line)."""
    executor = MigrationExecutor(connection)
    if executor.migration_plan(executor.loader.graph.leaf_nodes()):
        raise CommandError(
            "the database is not migrated (the webhooks would fail on every claim): "
            "run `python manage.py migrate` first"
        )


def _files(paths: list[Path]) -> Iterator[Path]:
    """The files named, and the object files under the directories named, in order."""
    for path in paths:
        if path.is_dir():
            yield from sorted(
                found
                for found in path.rglob("*")
                if found.suffix in OBJECT_FILES and found.is_file()
            )
        else:
            yield path  # one that cannot be read is reported by the reader


def claim_to_create(obj: dict[str, Any], *, namespace: str | None) -> dict[str, Any]:
    """The ResourceClaim a CREATE of `obj` sends: the claim itself, or the claim the
    resource-claim controller makes from a template (named after it), in `namespace`."""
    metadata = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    assert isinstance(metadata, dict)
    if obj.get("kind") == "ResourceClaimTemplate":
        template = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
        assert isinstance(template, dict)
        claim_metadata = template.get("metadata")
        claim: dict[str, Any] = {
            "apiVersion": obj.get("apiVersion"),
            "kind": "ResourceClaim",
            "metadata": {
                **(claim_metadata if isinstance(claim_metadata, dict) else {}),
                "name": metadata.get("name"),
            },
            "spec": template.get("spec"),
        }
    else:
        # The API server drops the status of an object it creates.
        claim = {key: value for key, value in obj.items() if key != "status"}
        claim["metadata"] = dict(metadata)
    claim["metadata"]["namespace"] = namespace or metadata.get("namespace") or "default"
    return claim


def admission_review(
    claim: dict[str, Any], *, uid: str, username: str, dry_run: bool
) -> dict[str, Any]:
    """The AdmissionReview the API server sends for a CREATE of `claim`."""
    version = str(claim.get("apiVersion") or "").rpartition("/")[2]
    kind = {"group": "resource.k8s.io", "version": version, "kind": "ResourceClaim"}
    resource = {"group": "resource.k8s.io", "version": version, "resource": "resourceclaims"}
    return {
        "apiVersion": webhook.API_VERSION,
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": kind,
            "resource": resource,
            "requestKind": kind,
            "requestResource": resource,
            "name": claim["metadata"].get("name") or "",
            "namespace": claim["metadata"]["namespace"],
            "operation": "CREATE",
            "userInfo": {"username": username},
            "object": claim,
            "oldObject": None,
            "dryRun": dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def review(send: Send, claim: dict[str, Any], *, username: str, dry_run: bool) -> Verdict:
    """The API server's CREATE: the mutating webhook, its patch applied, then the validating
    one (unless the mutation denied). Warnings of both, each once."""
    uid = str(uuid.uuid4())  # one request: both webhooks are asked about the same uid
    answer = send(MUTATE_PATH, admission_review(claim, uid=uid, username=username, dry_run=dry_run))
    warnings = list(answer.get("warnings") or [])
    if answer.get("allowed"):
        if answer.get("patch"):
            try:
                patch = base64.b64decode(answer["patch"], validate=True)
                claim = jsonpatch.apply_patch(claim, json.loads(patch))
            except (  # not base64, not JSON, or a JSON Patch that fails
                ValueError,
                TypeError,
                jsonpatch.JsonPatchException,
                jsonpatch.JsonPointerException,
            ) as exc:
                message = f"the mutating webhook's patch does not apply: {exc}"
                return Verdict(False, message, warnings)
        validation = admission_review(claim, uid=uid, username=username, dry_run=dry_run)
        answer = send(VALIDATE_PATH, validation)
        warnings += [w for w in answer.get("warnings") or [] if w not in warnings]
    status = answer.get("status") if isinstance(answer.get("status"), dict) else {}
    assert isinstance(status, dict)
    return Verdict(answer.get("allowed") is True, str(status.get("message") or ""), warnings)


def _sender(url: str | None) -> Send:
    """Send reviews in this process (through `quota.admission.views.respond`, as the views do), or
    over HTTP to a running service at `url`."""
    if not url:

        def in_process(path: str, body: dict[str, Any]) -> dict[str, Any]:
            request = webhook.parse_review(b"", body)
            answer: dict[str, Any] = webhook.respond(request, mutate=path == MUTATE_PATH)
            return dict(answer["response"])

        return in_process

    def over_http(path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            url.rstrip("/") + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=URL_TIMEOUT_SECONDS) as response:
                answer = json.load(response)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace").strip()
            raise CommandError(f"{request.full_url} answered {exc.code}: {detail}") from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise CommandError(f"cannot reach {request.full_url}: {exc}") from exc
        if not isinstance(answer, dict) or not isinstance(answer.get("response"), dict):
            raise CommandError(f"{request.full_url} did not answer an AdmissionReview")
        return dict(answer["response"])

    return over_http


def _line(path: Path, obj: dict[str, Any], claim: dict[str, Any], verdict: Verdict) -> str:
    """One claim's line: file, namespace/name, the decision, its reason and warnings."""
    kind = " (template)" if obj.get("kind") == "ResourceClaimTemplate" else ""
    metadata = claim["metadata"]
    parts = [
        f"{path}: {metadata['namespace']}/{metadata.get('name') or '?'}{kind}: "
        + ("ALLOWED" if verdict.allowed else "DENIED")
    ]
    if verdict.message:
        parts.append(verdict.message)
    parts += [f"warning: {warning}" for warning in verdict.warnings]
    return " | ".join(parts)
