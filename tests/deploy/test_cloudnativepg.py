"""The CloudNativePG overlay: its custom resources against the operator's CRD schemas, and the
wiring between them and Tally (the operator's secret, the replica, backups, network policy).

The overlay is rendered as tests/deploy/test_manifests.py renders the others (`kubectl
kustomize`; skipped without kubectl). The Cluster, ScheduledBackup and ObjectStore are
validated with jsonschema against the CRDs' openAPIV3Schema vendored in
tests/fixtures/cloudnativepg (see its README), strictly: a field the schema does not know is an
error, as `kubectl apply`'s field validation reports it. Built-in objects are validated as in
test_manifests.py.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from config.settings import _replica_database
from tests.deploy.test_manifests import (
    CRD_REQUIRED,
    DEPLOY_DOCS,
    KUBERNETES_VERSION,
    Obj,
    containers,
    env_of,
    pod_specs,
    referenced,
    render,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "cloudnativepg"
OVERLAY = "cloudnativepg"
PLUGIN = "barman-cloud.cloudnative-pg.io"
TALLY_DATABASE_USERS = ["web", "worker", "beat", "syncer", "migrate"]


def strict(schema: Any) -> Any:
    """The schema with unknown fields refused (the API server's strict field validation) and
    the pruned subtrees (x-tally-pruned) refusing any value."""
    if not isinstance(schema, dict):
        return schema
    if schema.get("x-tally-pruned"):
        return {"not": {}, "x-tally-pruned": True}
    tightened = {key: strict(value) for key, value in schema.items() if key != "properties"}
    tightened.update(
        (key, [strict(item) for item in value])
        for key, value in schema.items()
        if isinstance(value, list) and key in ("anyOf", "allOf", "oneOf")
    )
    if "properties" in schema:
        tightened["properties"] = {name: strict(sub) for name, sub in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            tightened.setdefault("additionalProperties", False)
    return tightened


@cache
def validators(fixtures: Path = FIXTURES) -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) → a validator, for every CRD version vendored in `fixtures`."""
    found: dict[tuple[str, str], jsonschema.protocols.Validator] = {}
    for path in sorted(fixtures.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            schema = strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
            jsonschema.Draft7Validator.check_schema(schema)
            key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
            found[key] = jsonschema.Draft7Validator(schema)
    return found


def problems(obj: Obj, fixtures: Path = FIXTURES) -> list[str]:
    """What the operator's schema (vendored in `fixtures`) refuses in `obj`, one line each
    (none: valid)."""
    validator = validators(fixtures)[(obj["apiVersion"], obj["kind"])]
    lines = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(part) for part in error.absolute_path) or "(the object)"
        if isinstance(error.schema, dict) and error.schema.get("x-tally-pruned"):
            lines.append(f"{where}: its schema is not vendored in {fixtures.name}: vendor it")
        else:
            lines.append(f"{where}: {error.message}")
    return lines


@pytest.fixture
def objects() -> tuple[Obj, ...]:
    return render(OVERLAY)


def one(objects: tuple[Obj, ...], kind: str) -> Obj:
    (found,) = (o for o in objects if o["kind"] == kind)
    return found


# -- schemas ------------------------------------------------------------------------------


def test_the_operators_resources_are_valid_for_its_crds(objects: tuple[Obj, ...]) -> None:
    custom = [o for o in objects if (o["apiVersion"], o["kind"]) in validators()]
    assert sorted(o["kind"] for o in custom) == ["Cluster", "ObjectStore", "ScheduledBackup"]
    for obj in custom:
        assert problems(obj) == [], f"{obj['kind']} {obj['metadata']['name']}"


def test_every_other_object_is_valid_for_kubernetes_1_34(objects: tuple[Obj, ...]) -> None:
    for obj in objects:
        key = (obj["apiVersion"], obj["kind"])
        if key in validators() or key in CRD_REQUIRED:
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {exc.message} at {exc.path}")


def mistake(obj: Obj, path: list[str | int], change: Any) -> Obj:
    """A copy of `obj` with `change(parent, last key)` applied at `path`."""
    wrong = copy.deepcopy(obj)
    parent: Any = wrong
    for part in path[:-1]:
        parent = parent[part]
    change(parent, path[-1])
    return wrong


def rename(to: str) -> Any:
    def change(parent: dict[str, Any], key: str) -> None:
        parent[to] = parent.pop(key)

    return change


def set_to(value: Any) -> Any:
    def change(parent: dict[str, Any], key: str) -> None:
        parent[key] = value

    return change


@pytest.mark.parametrize(
    ("kind", "path", "change", "says"),
    [
        ("Cluster", ["spec", "instances"], rename("instaces"), "'instaces' was unexpected"),
        ("Cluster", ["spec", "storage", "size"], rename("sise"), "'sise' was unexpected"),
        (
            "Cluster",
            ["spec", "plugins", 0, "isWALArchiver"],
            rename("isWalArchiver"),
            "spec.plugins.0: Additional properties are not allowed ('isWalArchiver'",
        ),
        ("Cluster", ["spec", "instances"], set_to(0), "0 is less than the minimum of 1"),
        (
            "Cluster",
            ["spec", "primaryUpdateMethod"],
            set_to("rolling"),
            "'rolling' is not one of ['switchover', 'restart']",
        ),
        (
            "Cluster",
            ["spec", "resources", "limits", "memory"],
            set_to("8 GB"),
            "spec.resources.limits.memory: '8 GB' does not match",
        ),
        (
            "Cluster",
            ["spec", "monitoring"],
            set_to({"enablePodMonitor": True}),
            "spec.monitoring: its schema is not vendored",
        ),
        (
            "ScheduledBackup",
            ["spec", "pluginConfiguration"],
            rename("pluginConfig"),
            "'pluginConfig' was unexpected",
        ),
        ("ScheduledBackup", ["spec", "method"], set_to("plugins"), "'plugins' is not one of"),
        ("ScheduledBackup", ["spec", "cluster"], rename("clusterRef"), "'cluster' is a required"),
        (
            "ObjectStore",
            ["spec", "configuration", "s3Credentials", "accessKeyId", "key"],
            rename("keys"),
            "'key' is a required property",
        ),
        (
            "ObjectStore",
            ["spec", "retentionPolicy"],
            set_to("30 days"),
            "'30 days' does not match",
        ),
    ],
)
def test_a_mistake_in_a_custom_resource_is_named(
    objects: tuple[Obj, ...], kind: str, path: list[str | int], change: Any, says: str
) -> None:
    found = problems(mistake(one(objects, kind), path, change))
    assert any(says in line for line in found), found


# -- Tally and the database ---------------------------------------------------------------


def test_tally_reads_its_database_url_from_the_operators_secret(objects: tuple[Obj, ...]) -> None:
    cluster = one(objects, "Cluster")
    app_secret = f"{cluster['metadata']['name']}-app"
    users = set()
    for obj, spec in pod_specs(objects):
        volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
        for container in spec["containers"]:
            url_file = env_of(container).get("DATABASE_URL_FILE")
            if url_file is None:
                continue
            users.add(obj["metadata"]["labels"]["app.kubernetes.io/component"])
            path = Path(url_file["value"])
            (mount,) = (m for m in container["volumeMounts"] if path.is_relative_to(m["mountPath"]))
            relative = str(path.relative_to(mount["mountPath"]))
            sources = [
                source["secret"]
                for source in volumes[mount["name"]]["projected"]["sources"]
                if any(item["path"] == relative for item in source["secret"].get("items", []))
            ]
            assert sources == [{"name": app_secret, "items": [{"key": "uri", "path": relative}]}], (
                obj["metadata"]["name"]
            )
    assert users == set(TALLY_DATABASE_USERS)
    assert "tally-database" not in referenced(objects, "Secret")
    # The database the operator makes is the one the secret's uri names.
    assert cluster["spec"]["bootstrap"]["initdb"] == {
        "database": "tally",
        "owner": "tally",
        "dataChecksums": True,
    }


def test_the_web_pods_read_from_the_replica_else_the_primary(objects: tuple[Obj, ...]) -> None:
    cluster = one(objects, "Cluster")
    name, namespace = cluster["metadata"]["name"], cluster["metadata"]["namespace"]
    readers = [
        (obj["metadata"]["name"], env_of(container)["DATABASE_REPLICA_URL"]["value"])
        for obj, container in containers(objects)
        if "DATABASE_REPLICA_URL" in env_of(container)
    ]
    assert [reader for reader, _ in readers] == ["tally-web"]
    ((_, url),) = readers
    parts = urlsplit(url)
    # No credentials of its own: Tally takes the user, password and database from DATABASE_URL.
    assert parts.username is None and parts.password is None and parts.path in ("", "/")
    hosts = parts.netloc.rsplit(":", 1)[0].split(",")
    assert hosts == [f"{name}-ro.{namespace}.svc", f"{name}-rw.{namespace}.svc"]
    assert parse_qs(parts.query) == {"target_session_attrs": ["prefer-standby"]}
    # Tally's settings take it as they would in the pod.
    replica = _replica_database(url)
    assert replica["HOST"] == ",".join(hosts)
    assert replica["TEST"] == {"MIRROR": "default"}


def test_a_replica_on_another_node_and_continuous_backups(objects: tuple[Obj, ...]) -> None:
    cluster = one(objects, "Cluster")
    spec = cluster["spec"]
    assert spec["instances"] == 2
    assert spec["affinity"] == {
        "enablePodAntiAffinity": True,
        "podAntiAffinityType": "required",
        "topologyKey": "kubernetes.io/hostname",
    }
    assert spec["resources"]["requests"] and spec["resources"]["limits"]["memory"]
    assert spec["storage"]["size"] and spec["walStorage"]["size"]
    # The replica may hold back the primary's vacuum rather than cancel the portal's reads.
    assert spec["postgresql"]["parameters"]["hot_standby_feedback"] == "on"
    # WAL goes to the ObjectStore through the plugin (not the deprecated barmanObjectStore).
    assert "backup" not in spec
    (plugin,) = spec["plugins"]
    store = one(objects, "ObjectStore")
    assert plugin == {
        "name": PLUGIN,
        "isWALArchiver": True,
        "parameters": {"barmanObjectName": store["metadata"]["name"]},
    }
    assert store["metadata"]["namespace"] == cluster["metadata"]["namespace"]
    assert store["spec"]["configuration"]["destinationPath"].startswith("s3://")
    assert store["spec"]["instanceSidecarConfiguration"]["resources"]["limits"]["memory"]
    scheduled = one(objects, "ScheduledBackup")
    assert scheduled["spec"]["cluster"] == {"name": cluster["metadata"]["name"]}
    assert scheduled["spec"]["method"] == "plugin"
    assert scheduled["spec"]["pluginConfiguration"] == {"name": PLUGIN}
    # The operator's cron has a seconds field: five fields would mean another time.
    assert len(scheduled["spec"]["schedule"].split()) == 6


def matches(selector: Obj, labels: dict[str, str]) -> bool:
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        present = expression["key"] in labels
        value = labels.get(expression["key"])
        if expression["operator"] == "In" and value not in expression["values"]:
            return False
        if expression["operator"] == "NotIn" and value in expression["values"]:
            return False
        if expression["operator"] == "Exists" and not present:
            return False
        if expression["operator"] == "DoesNotExist" and present:
            return False
    return True


def test_the_database_pods_admit_tally_the_instances_and_the_operator(
    objects: tuple[Obj, ...],
) -> None:
    cluster = one(objects, "Cluster")
    # The operator labels its pods cnpg.io/cluster, and adds the inherited labels.
    database_pod = {
        "cnpg.io/cluster": cluster["metadata"]["name"],
        **cluster["spec"]["inheritedMetadata"]["labels"],
    }
    policies = [
        o
        for o in objects
        if o["kind"] == "NetworkPolicy" and matches(o["spec"]["podSelector"], database_pod)
    ]
    assert {p["metadata"]["name"] for p in policies} == {
        "tally-default-deny-ingress",
        "tally-database",
        # The base's metrics policy selects every pod named tally (port 9090, unused here).
        "tally-metrics",
    }
    rules = [rule for policy in policies for rule in policy["spec"].get("ingress", [])]

    def admitted(port: int, pod: dict[str, str] | None = None, namespace: str = "") -> bool:
        for rule in rules:
            if port not in {p["port"] for p in rule.get("ports", [])}:
                continue
            for peer in rule.get("from", [{}]):
                if "podSelector" in peer and pod is not None and matches(peer["podSelector"], pod):
                    return True
                by_namespace = peer.get("namespaceSelector")
                in_namespace = {"kubernetes.io/metadata.name": namespace}
                if namespace and by_namespace is not None and matches(by_namespace, in_namespace):
                    return True
        return False

    for obj, _ in pod_specs(objects):
        labels = obj["spec"]["template"]["metadata"]["labels"]
        expected = labels["app.kubernetes.io/component"] in TALLY_DATABASE_USERS
        assert admitted(5432, labels) == expected, obj["metadata"]["name"]
    assert admitted(5432, database_pod)  # streaming replication, the replica's first copy
    assert admitted(8000, namespace="cnpg-system")  # the operator asks each instance's status
    assert not admitted(5432, namespace="cnpg-system")


def test_the_secrets_to_create_are_documented(objects: tuple[Obj, ...]) -> None:
    readme = DEPLOY_DOCS.read_text()
    store = one(objects, "ObjectStore")
    credentials = store["spec"]["configuration"]["s3Credentials"]
    for name in {credentials["accessKeyId"]["name"], credentials["secretAccessKey"]["name"]}:
        assert f"`{name}`" in readme
    assert "`tally-db-app`" in readme
    assert "deploy/overlays/cloudnativepg" in readme
