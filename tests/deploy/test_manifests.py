"""The Kustomize overlays: render, validate against Kubernetes 1.34, and check cross-references.

Rendering uses `kubectl kustomize` (kubectl's built-in Kustomize); the tests are skipped,
saying so, where no kubectl is installed. Objects of built-in kinds are validated strictly
with kubernetes-validate's 1.34 schemas; cert-manager's (CRDs, no schema there) get their
required fields checked by hand.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from django.conf import settings
from django.db import connection
from django.urls import Resolver404, resolve

from db.embedded import postgres_url
from inventory import kube_owners
from inventory.gangs import GANG_KINDS, GANG_READS
from inventory.kube_owners import OWNER_READS
from inventory.kube_sync import RESOURCES

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
# How to deploy, with the secrets to create (deploy/README.md points to it).
DEPLOY_DOCS = REPO / "docs" / "operations" / "deploying.md"
OVERLAYS = ["default", "production"]
# The components an operator adds to an overlay of theirs that change the processes: rendered
# onto production as such an overlay would ("production+<component>"), every check here holds
# with them too.
COMPONENTS = ["agent-gaudi"]
RENDERINGS = [*OVERLAYS, *(f"production+{component}" for component in COMPONENTS)]
KUBERNETES_VERSION = "1.34"
SYSTEM_NAMESPACES = ["kube-system", "kube-public", "kube-node-lease"]
CRD_REQUIRED = {
    ("cert-manager.io/v1", "Issuer"): [["spec"]],
    ("cert-manager.io/v1", "Certificate"): [["spec", "secretName"], ["spec", "issuerRef", "name"]],
}
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection", "*"}

Obj = dict[str, Any]


@cache
def render(overlay: str) -> tuple[Obj, ...]:
    """An overlay, or `<overlay>+<component>`: the overlay with a component added."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot render the Kustomize overlays")
    name, _, component = overlay.partition("+")
    with tempfile.TemporaryDirectory() as scratch:
        target = DEPLOY / "overlays" / name
        if component:
            # Kustomize takes relative paths only.
            kustomization = {
                "resources": [os.path.relpath(target, scratch)],
                "components": [os.path.relpath(DEPLOY / "components" / component, scratch)],
            }
            (Path(scratch) / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
            target = Path(scratch)
        result = subprocess.run(
            [kubectl, "kustomize", str(target)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def find(objects: tuple[Obj, ...], kind: str, name: str) -> Obj:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def pod_specs(objects: tuple[Obj, ...]) -> Iterator[tuple[Obj, Obj]]:
    for obj in objects:
        if obj["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
            yield obj, obj["spec"]["template"]["spec"]


def containers(objects: tuple[Obj, ...]) -> Iterator[tuple[Obj, Obj]]:
    for obj, spec in pod_specs(objects):
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            yield obj, container


def env_of(container: Obj) -> dict[str, Obj]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def config_map_data(objects: tuple[Obj, ...]) -> dict[str, str]:
    maps = [
        o for o in objects if o["kind"] == "ConfigMap" and "tally-config" in o["metadata"]["name"]
    ]
    assert len(maps) == 1
    return dict(maps[0]["data"])


def resolved_env(objects: tuple[Obj, ...], container: Obj, pod_ip: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom, then env with $(VAR)."""
    environment = dict(config_map_data(objects))
    for name, entry in env_of(container).items():
        if "value" in entry:
            environment[name] = re.sub(
                r"\$\((\w+)\)", lambda m: environment.get(m.group(1), m.group(0)), entry["value"]
            )
        elif entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            environment[name] = pod_ip
    return environment


def web_container(objects: tuple[Obj, ...]) -> Obj:
    deployment = find(objects, "Deployment", "tally-web")
    return next(
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "web"
    )


def listeners(container: Obj) -> dict[int, list[str]]:
    routes: dict[int, list[str]] = {}
    for entry in env_of(container)["TALLY_LISTENERS"]["value"].split(","):
        port, prefix = entry.split("=", 1)
        routes.setdefault(int(port), []).append(prefix)
    return routes


def service_target(objects: tuple[Obj, ...], service: Obj, port: int) -> int:
    """The container port a Service port leads to in the web pods."""
    entry = next(p for p in service["spec"]["ports"] if p["port"] == port)
    target = entry.get("targetPort", port)
    if isinstance(target, int):
        return target
    ports = {p["name"]: p["containerPort"] for p in web_container(objects)["ports"]}
    return int(ports[target])


def service_dns_names(service: Obj) -> set[str]:
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    return {
        name,
        f"{name}.{namespace}",
        f"{name}.{namespace}.svc",
        f"{name}.{namespace}.svc.cluster.local",
    }


def network_policy_ports(objects: tuple[Obj, ...]) -> dict[int, list[Obj]]:
    """Port → the `from` peers allowed to it, over every NetworkPolicy that selects web pods."""
    allowed: dict[int, list[Obj]] = {}
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        labels = policy["spec"]["podSelector"].get("matchLabels", {})
        if labels.get("app.kubernetes.io/component", "web") != "web":
            continue
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                allowed.setdefault(int(port["port"]), []).extend(rule.get("from") or [{}])
    return allowed


@pytest.fixture(params=RENDERINGS)
def objects(request: pytest.FixtureRequest) -> tuple[Obj, ...]:
    return render(request.param)


# -- schemas ------------------------------------------------------------------------------


def test_every_object_is_valid_for_kubernetes_1_34(objects: tuple[Obj, ...]) -> None:
    for obj in objects:
        key = (obj["apiVersion"], obj["kind"])
        if key in CRD_REQUIRED:
            for path in CRD_REQUIRED[key]:
                value: Any = obj
                for part in path:
                    assert isinstance(value, dict) and part in value, (
                        f"{obj['kind']} {obj['metadata']['name']} lacks {'.'.join(path)}"
                    )
                    value = value[part]
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {exc.message} at {exc.path}")


def test_every_namespaced_object_is_in_the_namespace(objects: tuple[Obj, ...]) -> None:
    cluster_scoped = {
        "Namespace",
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingWebhookConfiguration",
        "MutatingWebhookConfiguration",
    }
    namespace = find(objects, "Namespace", "tally")["metadata"]["name"]
    for obj in objects:
        if obj["kind"] not in cluster_scoped:
            assert obj["metadata"].get("namespace") == namespace, obj["metadata"]["name"]


# -- webhooks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "view"),
    [
        ("ValidatingWebhookConfiguration", "admission-validate"),
        ("MutatingWebhookConfiguration", "admission-mutate"),
    ],
)
def test_webhooks_reach_their_views_through_the_service(
    objects: tuple[Obj, ...], kind: str, view: str
) -> None:
    configuration = next(o for o in objects if o["kind"] == kind)
    certificate_ref = configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    namespace, certificate_name = certificate_ref.split("/")
    certificate = find(objects, "Certificate", certificate_name)
    assert certificate["metadata"]["namespace"] == namespace
    (webhook,) = configuration["webhooks"]

    assert webhook["failurePolicy"] == "Fail"
    assert webhook["timeoutSeconds"] == 3
    assert webhook["sideEffects"] == "NoneOnDryRun"
    assert webhook["admissionReviewVersions"] == ["v1"]
    assert webhook["rules"] == [
        {
            "apiGroups": ["resource.k8s.io"],
            "apiVersions": ["*"],
            "operations": ["CREATE"],
            "resources": ["resourceclaims"],
            "scope": "Namespaced",
        }
    ]
    # The system namespaces and Tally's own are skipped, by CEL on request.namespace.
    (condition,) = webhook["matchConditions"]
    assert "request.namespace" in condition["expression"]
    for skipped in [*SYSTEM_NAMESPACES, namespace]:
        assert f"'{skipped}'" in condition["expression"]

    reference = webhook["clientConfig"]["service"]
    service = find(objects, "Service", reference["name"])
    assert service["metadata"]["namespace"] == reference["namespace"] == namespace
    assert resolve(reference["path"]).url_name == view
    # The Service port leads to a container port that serves the path, and that only the
    # API server may reach.
    target = service_target(objects, service, reference.get("port", 443))
    assert any(reference["path"].startswith(p) for p in listeners(web_container(objects))[target])
    peers = network_policy_ports(objects)[target]
    assert peers and all("ipBlock" in peer for peer in peers)
    # The certificate covers the name the API server calls.
    assert service_dns_names(service) <= set(certificate["spec"]["dnsNames"])


def test_the_web_pods_serve_tls_from_the_certificate(objects: tuple[Obj, ...]) -> None:
    deployment = find(objects, "Deployment", "tally-web")
    certificate = find(objects, "Certificate", "tally-web")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    container = web_container(objects)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    cert_file = env_of(container)["TLS_CERT_FILE"]["value"]
    volume = volumes[mounts[str(Path(cert_file).parent)]]
    assert volume["secret"]["secretName"] == certificate["spec"]["secretName"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def agents(objects: tuple[Obj, ...]) -> list[Obj]:
    """The node agents' DaemonSets: the base's, and one per component that adds one."""
    return [o for o in objects if o["kind"] == "DaemonSet" and "agent" in o["metadata"]["name"]]


def test_the_agent_reaches_the_ingest_port(objects: tuple[Obj, ...]) -> None:
    agent = find(objects, "DaemonSet", "tally-agent")
    spec = agent["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {t["key"] for t in spec["tolerations"]} == {"nvidia.com/gpu"}
    target = 0
    for each in agents(objects):
        (container,) = each["spec"]["template"]["spec"]["containers"]
        environment = env_of(container)
        url = urlsplit(environment["TALLY_URL"]["value"])
        assert url.scheme == "https"
        service = find(objects, "Service", url.hostname.split(".")[0] if url.hostname else "")
        assert url.hostname in service_dns_names(service)
        assert url.hostname in find(objects, "Certificate", "tally-web")["spec"]["dnsNames"]
        target = service_target(objects, service, url.port or 443)
        assert listeners(web_container(objects))[target] == ["/ingest/"]
        # The token comes from a Secret through TALLY_AGENT_TOKEN_FILE; only ca.crt is mounted.
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in each["spec"]["template"]["spec"]["volumes"]}
        token_file = Path(environment["TALLY_AGENT_TOKEN_FILE"]["value"])
        assert volumes[mounts[str(token_file.parent)]]["secret"]["secretName"] == (
            "tally-agent-token"
        )
        ca_volume = volumes[mounts[str(Path(environment["TALLY_AGENT_CA_FILE"]["value"]).parent)]]
        assert ca_volume["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    assert resolve("/ingest/samples"), "POST /ingest/samples is not routed in config/urls.py"
    # Only agent pods may reach the ingest port: each agent's, nothing else.
    peers = network_policy_ports(objects)[target]
    assert peers == [{"podSelector": {"matchLabels": spec_labels(a)}} for a in agents(objects)]


def spec_labels(obj: Obj) -> dict[str, str]:
    return dict(obj["spec"]["selector"]["matchLabels"])


def test_every_listener_port_is_a_container_port_and_policed(objects: tuple[Obj, ...]) -> None:
    container = web_container(objects)
    container_ports = {p["containerPort"] for p in container["ports"]}
    policed = network_policy_ports(objects)
    metrics_policy = find(objects, "NetworkPolicy", "tally-metrics")
    metrics_ports = {p["port"] for rule in metrics_policy["spec"]["ingress"] for p in rule["ports"]}
    for port, prefixes in listeners(container).items():
        assert port in container_ports
        assert port in policed or port in metrics_ports, f"no NetworkPolicy admits port {port}"
        for prefix in prefixes:
            path = prefix if not prefix.endswith("/") else prefix + "resourceclaims"
            try:
                resolve(path if prefix != "/ingest/" else "/ingest/samples")
            except Resolver404:
                pytest.fail(f"listener prefix {prefix} routes nowhere")
    assert metrics_ports == {9090}


# -- secrets, config maps, images ---------------------------------------------------------


def referenced(objects: tuple[Obj, ...], kind: str) -> set[str]:
    names: set[str] = set()
    key = "secret" if kind == "Secret" else "configMap"
    for _, spec in pod_specs(objects):
        for volume in spec.get("volumes", []):
            if key in volume:
                names.add(volume[key].get("secretName") or volume[key].get("name"))
            for source in volume.get("projected", {}).get("sources", []):
                if key in source:
                    names.add(source[key]["name"])
    for _, container in containers(objects):
        for source in container.get("envFrom", []):
            ref = source.get(f"{key}Ref")
            if ref:
                names.add(ref["name"])
        for entry in container.get("env", []):
            ref = entry.get("valueFrom", {}).get(f"{key}KeyRef")
            if ref:
                names.add(ref["name"])
    return names


def test_every_secret_is_defined_or_documented(objects: tuple[Obj, ...]) -> None:
    readme = DEPLOY_DOCS.read_text()
    defined = {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"}
    defined |= {o["spec"]["secretName"] for o in objects if o["kind"] == "Certificate"}
    for name in sorted(referenced(objects, "Secret") - defined):
        assert f"`{name}`" in readme, f"Secret {name} is neither defined nor in {DEPLOY_DOCS.name}"


def test_every_config_map_is_defined(objects: tuple[Obj, ...]) -> None:
    defined = {o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"}
    assert referenced(objects, "ConfigMap") <= defined


def test_every_file_variable_points_into_a_mount(objects: tuple[Obj, ...]) -> None:
    for obj, container in containers(objects):
        mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
        for name, entry in env_of(container).items():
            if name.endswith("_FILE"):
                assert any(entry["value"].startswith(m + "/") for m in mounts), (
                    f"{obj['metadata']['name']}: {name}={entry['value']} is in no volume"
                )


def test_one_image_for_everything(objects: tuple[Obj, ...]) -> None:
    images = {container["image"] for _, container in containers(objects)}
    assert len(images) == 1
    (image,) = images
    assert re.fullmatch(r"[\w.\-/]+:[\w.\-]+", image), image


# -- security -----------------------------------------------------------------------------


# Privileged, still as a non-root user with no capabilities: the Gaudi agent, whose HLML opens
# each card's control device node, which only a privileged container may open when it holds no
# card (deploy/components/agent-gaudi/agent-gaudi.yaml). Kubernetes refuses privileged with
# allowPrivilegeEscalation false.
PRIVILEGED = {"tally-agent-gaudi"}


def test_pods_run_as_non_root_with_limits(objects: tuple[Obj, ...]) -> None:
    for obj, spec in pod_specs(objects):
        assert spec["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
        for container in spec["containers"]:
            context = container["securityContext"]
            if obj["metadata"]["name"] in PRIVILEGED:
                assert context["privileged"] is True and "allowPrivilegeEscalation" not in context
            else:
                assert context.get("privileged", False) is False
                assert context["allowPrivilegeEscalation"] is False
            assert context["readOnlyRootFilesystem"] is True
            assert context["capabilities"]["drop"] == ["ALL"]
            assert container["resources"]["requests"] and container["resources"]["limits"]


def test_rbac_writes_nothing_cluster_wide_but_device_taint_rules(
    objects: tuple[Obj, ...],
) -> None:
    for role in (o for o in objects if o["kind"] == "ClusterRole"):
        for rule in role["rules"]:
            if WRITE_VERBS & set(rule["verbs"]):
                assert rule["apiGroups"] == ["resource.k8s.io"]
                assert rule["resources"] == ["devicetaintrules"]
            assert "*" not in rule["resources"] and "secrets" not in rule["resources"]
    reads = find(objects, "ClusterRole", "tally-inventory")["rules"]
    granted = role_grants(reads)
    watched = {"get", "list", "watch"}
    assert granted == {
        ("resource.k8s.io", "resourceslices"): watched,
        ("resource.k8s.io", "deviceclasses"): watched,
        ("resource.k8s.io", "resourceclaims"): watched,
        ("", "namespaces"): watched,
        ("", "pods"): watched,
        ("", "nodes"): watched,
        ("apps", "replicasets"): {"get"},
        ("batch", "jobs"): {"get"},
    }
    # The syncer's Lease, named after the cluster (see inventory.leader and sync_inventory).
    cluster = config_map_data(objects)["TALLY_CLUSTER_NAME"]
    lease_rules = find(objects, "Role", "tally-leader-election")["rules"]
    assert any(f"tally-sync-{cluster}" in rule.get("resourceNames", []) for rule in lease_rules)
    syncer = find(objects, "Deployment", "tally-syncer")["spec"]["template"]["spec"]
    assert "--leader-elect" in syncer["containers"][0]["args"]
    # Only the syncer and the web pods (the webhook reads gangs) have a token.
    for obj, spec in pod_specs(objects):
        talks_to_the_api = obj["metadata"]["name"] in ("tally-syncer", "tally-web")
        assert spec["automountServiceAccountToken"] is talks_to_the_api, obj["metadata"]["name"]
    for account in (o for o in objects if o["kind"] == "ServiceAccount"):
        expected = account["metadata"]["name"] in ("tally-syncer", "tally-web")
        assert account["automountServiceAccountToken"] is expected, account["metadata"]["name"]


def role_grants(rules: list[Obj]) -> dict[tuple[str, str], set[str]]:
    """(API group, resource) → the verbs `rules` grant on it (rules without resourceNames)."""
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        if rule.get("resourceNames"):
            continue
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def cluster_grants(
    objects: tuple[Obj, ...], service_account: str
) -> dict[tuple[str, str], set[str]]:
    """What the ClusterRoleBindings give `service_account` (of namespace tally) cluster-wide."""
    granted: dict[tuple[str, str], set[str]] = {}
    for binding in (o for o in objects if o["kind"] == "ClusterRoleBinding"):
        if not any(
            subject["kind"] == "ServiceAccount"
            and subject["name"] == service_account
            and subject["namespace"] == "tally"
            for subject in binding["subjects"]
        ):
            continue
        assert binding["roleRef"]["kind"] == "ClusterRole"
        role = find(objects, "ClusterRole", binding["roleRef"]["name"])
        for key, verbs in role_grants(role["rules"]).items():
            granted.setdefault(key, set()).update(verbs)
    return granted


def test_every_kind_the_code_reads_is_granted_to_the_process_that_reads_it(
    objects: tuple[Obj, ...],
) -> None:
    """Derived from the code, so that a kind added there without its RBAC fails here: the
    sync lists and watches `RESOURCES`, gets the owners of claims' Pods (`OWNER_READS`) and
    the objects that declare gangs (`GANG_KINDS`); the webhook gets a claim's Pod, the
    objects that declare its gang and its roles' ResourceClaimTemplates (`GANG_READS`).
    Nothing more than `get` on what is only ever read one object at a time."""
    syncer = cluster_grants(objects, "tally-syncer")
    web = cluster_grants(objects, "tally-web")

    def plural(kind: str) -> str:
        return kind.lower() + ("es" if kind.endswith("s") else "s")

    for resource in RESOURCES.values():
        group = resource.api_version.rpartition("/")[0]
        assert {"get", "list", "watch"} <= syncer.get((group, plural(resource.kind)), set()), (
            resource.kind
        )
    for (group, kind), (rbac_name, _, _) in OWNER_READS.items():
        assert rbac_name == f"{plural(kind)}.{group}".rstrip(".")
        assert "get" in syncer.get((group, plural(kind)), set()), rbac_name
    for (group, kind), name in GANG_KINDS.items():
        assert "get" in syncer.get((group, name), set()), f"{name}.{group} ({kind})"
    assert "get" in web.get(("", "pods"), set())
    for (group, kind), name in GANG_READS.items():
        assert "get" in web.get((group, name), set()), f"{name}.{group} ({kind})"
    # The workload webhook reads the owner of what a controller makes: any configured kind.
    owner_kinds = {
        (kind.rpartition("/")[0], plural(kind.rpartition("/")[2]))
        for kind in settings.TALLY_WORKLOAD_KINDS
    }
    for key in owner_kinds:
        assert "get" in web.get(key, set()), key
    # The webhooks read, one object at a time, and the fleet pages list Tally's
    # DeviceTaintRules (their taint state, read back): nothing else.
    assert web == {
        **{
            key: {"get"}
            for key in [("", "pods"), *((g, n) for (g, _), n in GANG_READS.items()), *owner_kinds]
        },
        ("resource.k8s.io", "devicetaintrules"): {"list"},
    }
    gang_role = role_grants(find(objects, "ClusterRole", "tally-gangs")["rules"])
    assert set().union(*gang_role.values()) == {"get"}


def test_the_reader_names_the_rbac_resource_the_manifests_grant() -> None:
    """The 403 the reader logs names what to grant: the same names as the ClusterRole's."""
    assert kube_owners._resource_name("jobset.x-k8s.io", "JobSet") == "jobsets.jobset.x-k8s.io"
    assert (
        kube_owners._resource_name("resource.k8s.io", "ResourceClaimTemplate")
        == "resourceclaimtemplates.resource.k8s.io"
    )
    assert kube_owners._resource_name("", "Pod") == "pods"


def test_production_runs_several_web_pods_with_a_budget() -> None:
    objects = render("production")
    assert find(objects, "Deployment", "tally-web")["spec"]["replicas"] >= 2
    assert find(objects, "Deployment", "tally-syncer")["spec"]["replicas"] >= 2
    budget = find(objects, "PodDisruptionBudget", "tally-web")
    assert budget["spec"]["selector"]["matchLabels"] == spec_labels(
        find(objects, "Deployment", "tally-web")
    )
    assert find(objects, "Deployment", "tally-beat")["spec"]["replicas"] == 1


# -- Django's deployment checks under the production environment ---------------------------


def test_check_deploy_is_clean_with_the_production_environment() -> None:
    objects = render("production")
    environment = resolved_env(objects, web_container(objects), pod_ip="10.1.2.3")
    # The mounted files and directories exist only in the pod.
    for name in (
        "SECRET_KEY_FILE",
        "DATABASE_URL_FILE",
        "REDIS_URL_FILE",
        "TALLY_METRICS_TOKEN_FILE",
        "PROMETHEUS_MULTIPROC_DIR",
    ):
        environment.pop(name, None)
    # /metrics has its token (from the mounted secret): no tally.W002.
    assert "TALLY_METRICS_TOKEN_FILE" in env_of(web_container(objects))
    environment.update(
        {
            "TALLY_METRICS_TOKEN": secrets.token_urlsafe(32),
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
            "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "config.settings"),
            "DEBUG": "false",
            "SECRET_KEY": secrets.token_urlsafe(50),
            # The test run's server: `check` connects to no database.
            "DATABASE_URL": postgres_url(connection.settings_dict),
            "CELERY_BROKER_URL": "memory://",
        }
    )
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
