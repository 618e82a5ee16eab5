"""The webhook's caller authentication as deployed (issue 17, item 4): the API server's files
(deploy/apiserver/), the client CA in the web pods, gunicorn's wiring, and the NetworkPolicy
component that narrows port 8443 to the control plane.

Rendering needs kubectl, as in test_manifests.py (skipped, saying so, without it).
"""

from __future__ import annotations

import os
import runpy
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from gunicorn.workers.gthread import ThreadWorker

from tests.deploy.test_manifests import (
    DEPLOY,
    DEPLOY_DOCS,
    KUBERNETES_VERSION,
    OVERLAYS,
    Obj,
    config_map_data,
    env_of,
    find,
    network_policy_ports,
    render,
    web_container,
)

APISERVER = DEPLOY / "apiserver"
PLUGINS = {"ValidatingAdmissionWebhook", "MutatingAdmissionWebhook"}
CONTROL_PLANE = DEPLOY / "components" / "webhook-from-control-plane"


@pytest.fixture(params=OVERLAYS)
def objects(request: pytest.FixtureRequest) -> tuple[Obj, ...]:
    return render(request.param)


def _load(path: Path) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text())
    assert isinstance(document, dict), path
    return document


# -- the API server's files ---------------------------------------------------------------


def test_the_admission_configuration_gives_both_webhook_plugins_the_kubeconfig() -> None:
    """apiserver.config.k8s.io/v1 AdmissionConfiguration, checked field by field (no schema
    for it ships with kubernetes-validate)."""
    configuration = _load(APISERVER / "admission-configuration.yaml")
    assert set(configuration) == {"apiVersion", "kind", "plugins"}
    assert configuration["apiVersion"] == "apiserver.config.k8s.io/v1"
    assert configuration["kind"] == "AdmissionConfiguration"
    plugins = configuration["plugins"]
    assert {plugin["name"] for plugin in plugins} == PLUGINS and len(plugins) == len(PLUGINS)
    kubeconfigs = set()
    for plugin in plugins:
        assert set(plugin) == {"name", "configuration"}, plugin
        webhook = plugin["configuration"]
        assert set(webhook) == {"apiVersion", "kind", "kubeConfigFile"}, webhook
        assert webhook["apiVersion"] == "apiserver.config.k8s.io/v1"
        assert webhook["kind"] == "WebhookAdmissionConfiguration"
        assert webhook["kubeConfigFile"].startswith("/")
        kubeconfigs.add(webhook["kubeConfigFile"])
    (kubeconfig,) = kubeconfigs
    # The example kubeconfig is the file it names.
    assert Path(kubeconfig).name == "webhook-kubeconfig.yaml"
    assert (APISERVER / Path(kubeconfig).name).is_file()


def test_the_kubeconfig_presents_the_client_certificate_to_the_webhook_service(
    objects: tuple[Obj, ...],
) -> None:
    kubeconfig = _load(APISERVER / "webhook-kubeconfig.yaml")
    assert kubeconfig["apiVersion"] == "v1" and kubeconfig["kind"] == "Config"
    (user,) = kubeconfig["users"]
    # The API server picks the user by the name it calls: <service>.<namespace>.svc (port 443).
    for kind in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):
        configuration = next(o for o in objects if o["kind"] == kind)
        for webhook in configuration["webhooks"]:
            service = webhook["clientConfig"]["service"]
            assert service.get("port", 443) == 443
            assert user["name"] == f"{service['name']}.{service['namespace']}.svc"
    credentials = user["user"]
    assert set(credentials) == {"client-certificate", "client-key"}
    assert all(path.startswith("/etc/kubernetes/") for path in credentials.values())


# -- the web pods and the certificates ----------------------------------------------------


def test_the_web_pods_trust_only_the_ca_that_issues_the_api_servers_certificate(
    objects: tuple[Obj, ...],
) -> None:
    container = web_container(objects)
    ca_file = Path(env_of(container)["TALLY_WEBHOOK_CLIENT_CA_FILE"]["value"])
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    mount = mounts[str(ca_file.parent)]
    assert mount.get("readOnly") is True
    pod = find(objects, "Deployment", "tally-web")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    secret = volumes[mount["name"]]["secret"]
    # Only the CA's certificate, not its key.
    assert secret["items"] == [{"key": "ca.crt", "path": ca_file.name}]
    # The client certificate is issued by the Issuer whose CA is that secret.
    client = find(objects, "Certificate", "tally-webhook-client")
    issuer = find(objects, client["spec"]["issuerRef"]["kind"], client["spec"]["issuerRef"]["name"])
    assert issuer["spec"]["ca"]["secretName"] == secret["secretName"]
    certificates = [o for o in objects if o["kind"] == "Certificate"]
    ca = next(o for o in certificates if o["spec"]["secretName"] == secret["secretName"])
    assert ca["spec"]["isCA"] is True
    # That CA is its own: not the serving certificate's, which every pod's agent trusts.
    assert secret["secretName"] != find(objects, "Certificate", "tally-ca")["spec"]["secretName"]
    assert "client auth" in client["spec"]["usages"]
    allowed = config_map_data(objects)["TALLY_WEBHOOK_CLIENT_NAMES"].split(",")
    assert client["spec"]["commonName"] in allowed


def test_the_deploy_readme_documents_the_callers_and_the_secrets() -> None:
    readme = DEPLOY_DOCS.read_text()
    assert "## The webhook's callers" in readme
    for name in (
        "`tally-webhook-client`",
        "`tally-webhook-client-ca`",
        "`TALLY_WEBHOOK_CLIENT_CA_FILE`",
        "`TALLY_WEBHOOK_CLIENT_NAMES`",
        "deploy/apiserver/admission-configuration.yaml",
        "deploy/apiserver/webhook-kubeconfig.yaml",
        "--admission-control-config-file",
        "components/webhook-from-control-plane",
    ):
        assert name in readme, name


# -- gunicorn -----------------------------------------------------------------------------


def _gunicorn_settings(monkeypatch: pytest.MonkeyPatch, **environment: str) -> dict[str, Any]:
    for name in ("TALLY_WEBHOOK_CLIENT_CA_FILE", "TLS_CERT_FILE", "TLS_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    return runpy.run_path(str(DEPLOY / "gunicorn.conf.py"))


def test_gunicorn_verifies_client_certificates_against_the_ca_of_the_pods(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    objects = render("production")
    environment = env_of(web_container(objects))
    conf = _gunicorn_settings(
        monkeypatch,
        **{
            name: environment[name]["value"]
            for name in ("TALLY_WEBHOOK_CLIENT_CA_FILE", "TLS_CERT_FILE", "TLS_KEY_FILE")
        },
    )
    assert conf["ca_certs"] == environment["TALLY_WEBHOOK_CLIENT_CA_FILE"]["value"]
    # Optional: probes, the portal's ingress and the agents present no certificate.
    assert conf["cert_reqs"] == ssl.CERT_OPTIONAL
    assert conf["certfile"] == environment["TLS_CERT_FILE"]["value"]
    assert issubclass(conf["worker_class"], ThreadWorker)
    assert conf["worker_class"].__name__ == "DrainingThreadWorker"
    # Without a CA no certificate is asked for (and Tally warns at start).
    conf = _gunicorn_settings(monkeypatch)
    assert conf["ca_certs"] is None and conf["cert_reqs"] == ssl.CERT_NONE


# -- the NetworkPolicy for the control plane ----------------------------------------------


def _render_with_control_plane(tmp_path: Path) -> tuple[Obj, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot render the Kustomize overlays")
    # Kustomize takes relative paths only.
    overlay = {
        "resources": [os.path.relpath(DEPLOY / "overlays" / "production", tmp_path)],
        "components": [os.path.relpath(CONTROL_PLANE, tmp_path)],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    command = [kubectl, "kustomize", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def test_the_control_plane_component_admits_8443_from_its_cidr_only(tmp_path: Path) -> None:
    patch = _load(CONTROL_PLANE / "networkpolicy.yaml")
    (cidr,) = [peer["ipBlock"]["cidr"] for peer in patch["spec"]["ingress"][0]["from"]]
    objects = _render_with_control_plane(tmp_path)
    policy = find(objects, "NetworkPolicy", "tally-web-webhook")
    kubernetes_validate.validate(policy, KUBERNETES_VERSION, strict=True)
    assert network_policy_ports(objects)[8443] == [{"ipBlock": {"cidr": cidr}}]
    # Without the component: anything outside the pod network, as documented.
    (peer,) = network_policy_ports(render("production"))[8443]
    assert peer["ipBlock"]["cidr"] == "0.0.0.0/0" and peer["ipBlock"]["except"]
    # The example value is the one the deploying page tells operators to replace.
    assert cidr in DEPLOY_DOCS.read_text()
