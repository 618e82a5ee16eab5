"""Every port a Tally pod serves metrics on is reachable from the monitoring namespace alone.

The web pods' /metrics takes a bearer token (config/metrics_auth.py), and so do the worker's
and the syncer's own metrics ports (core.metrics.start_metrics_server, plain HTTP) when the
token is set; the NetworkPolicies keep other pods from them all the same. Kubernetes admits a
connection that ANY policy selecting the pod admits, so every policy selecting a metrics pod is
read: each rule that admits its metrics port must name only namespaces labelled
tally.dev/monitoring.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.test_dashboards import selects, served_metrics_port
from tests.deploy.test_manifests import OVERLAYS, pod_specs, render

Obj = dict[str, Any]
MONITORING = {"namespaceSelector": {"matchLabels": {"tally.dev/monitoring": "true"}}}


def metrics_ports(container: Obj) -> set[int]:
    """The ports the container serves metrics on: its port named metrics, and the one its
    process is told to serve them on."""
    ports = {p["containerPort"] for p in container.get("ports", []) if p.get("name") == "metrics"}
    served = served_metrics_port(container)
    return ports | ({served} if served is not None else set())


def peers_admitted(policies: list[Obj], labels: dict[str, str], port: int) -> list[Obj]:
    """The `from` peers the policies selecting a pod with `labels` admit to `port`; {} for a
    rule that admits everyone."""
    peers: list[Obj] = []
    for policy in policies:
        if not selects(policy["spec"]["podSelector"], labels):
            continue
        for rule in policy["spec"].get("ingress", []):
            rule_ports = [p.get("port") for p in rule.get("ports", [])]
            if rule_ports and port not in rule_ports:
                continue
            peers += rule.get("from") or [{}]
    return peers


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_metrics_ports_admit_the_monitoring_namespace_only(overlay: str) -> None:
    objects = render(overlay)
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert any(p["spec"]["podSelector"] == {} and not p["spec"].get("ingress") for p in policies)
    checked = set()
    for workload, spec in pod_specs(objects):
        labels = dict(workload["spec"]["template"]["metadata"]["labels"])
        for container in spec["containers"]:
            for port in metrics_ports(container):
                peers = peers_admitted(policies, labels, port)
                name = f"{workload['metadata']['name']}:{port}"
                assert peers, f"{name}: no NetworkPolicy admits the monitoring namespace"
                assert all(peer == MONITORING for peer in peers), f"{name}: {peers}"
                checked.add(workload["metadata"]["name"])
    assert {"tally-web", "tally-worker", "tally-syncer"} <= checked


def test_a_policy_open_to_every_pod_is_caught() -> None:
    open_policy = {"spec": {"podSelector": {}, "ingress": [{"ports": [{"port": 9090}]}]}}
    assert peers_admitted([open_policy], {"app.kubernetes.io/name": "tally"}, 9090) == [{}]
