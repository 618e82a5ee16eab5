"""deploy/components/agent-gaudi: the node agent on Gaudi nodes, reading HLML from the host.

Schema validation and the checks every process passes (non-root, one image, the ingest
NetworkPolicy) run on "production+agent-gaudi" in tests/deploy/test_manifests.py; here, what the
component adds and that the agent would read its configuration as meant.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from agent import runner
from agent.exporters import GAUDI, HLML_LIBRARY, HLML_LIBRARY_DIR
from tests.deploy.test_manifests import Obj, env_of, find, render, spec_labels

WITH_GAUDI = "production+agent-gaudi"
NFD_GAUDI_LABEL = "intel.feature.node.kubernetes.io/gaudi"


def keyed(objects: tuple[Obj, ...]) -> dict[tuple[str, str], Obj]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def gaudi_agent() -> tuple[Obj, Obj, Obj]:
    daemon_set = find(render(WITH_GAUDI), "DaemonSet", "tally-agent-gaudi")
    spec = daemon_set["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return daemon_set, spec, container


def test_the_component_adds_one_daemon_set_and_lets_it_reach_ingest_only() -> None:
    plain, extended = keyed(render("production")), keyed(render(WITH_GAUDI))
    assert set(extended) - set(plain) == {("DaemonSet", "tally-agent-gaudi")}
    changed = {key for key in plain if plain[key] != extended[key]}
    assert changed == {("NetworkPolicy", "tally-web-ingest")}
    # The base agent is untouched: NVIDIA nodes are metered as before.
    assert plain["DaemonSet", "tally-agent"] == extended["DaemonSet", "tally-agent"]
    (before,), (after,) = (
        o[("NetworkPolicy", "tally-web-ingest")]["spec"]["ingress"] for o in (plain, extended)
    )
    gaudi = extended["DaemonSet", "tally-agent-gaudi"]
    assert after["from"] == [
        *before["from"],
        {"podSelector": {"matchLabels": spec_labels(gaudi)}},
    ]
    assert after["ports"] == before["ports"]


def test_the_gaudi_agent_runs_on_gaudi_nodes_and_neither_agent_claims_the_others_pods() -> None:
    objects = render(WITH_GAUDI)
    base = find(objects, "DaemonSet", "tally-agent")
    gaudi, spec, _ = gaudi_agent()
    # The label Intel's NodeFeatureRule sets on nodes with a Gaudi PCI device; not the base
    # agent's, so a Gaudi node runs one agent (and a node with both kinds, one of each).
    assert spec["nodeSelector"] == {NFD_GAUDI_LABEL: "true"}
    assert NFD_GAUDI_LABEL not in base["spec"]["template"]["spec"]["nodeSelector"]
    assert {t["key"] for t in spec["tolerations"]} == {"habana.ai/gaudi"}
    for one, other in ((base, gaudi), (gaudi, base)):
        pod_labels = other["spec"]["template"]["metadata"]["labels"]
        assert not spec_labels(one).items() <= pod_labels.items()


def test_the_gaudi_agent_reads_the_exporter_and_hlml_it_is_given() -> None:
    """Its environment as the kubelet would give it, read by the agent's own configuration:
    the Gaudi profile, the exporter on the node's address, and HLML from the host's
    directory, mounted read-only where the agent is told to look."""
    _, spec, container = gaudi_agent()
    environment: dict[str, str] = {"TALLY_HOST_IP": "10.0.3.7"}
    for name, entry in env_of(container).items():
        if "value" in entry:
            environment[name] = entry["value"].replace("$(TALLY_HOST_IP)", "10.0.3.7")
    assert env_of(container)["TALLY_HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "status.hostIP"
    )
    # The token and CA are files of mounted Secrets (tests/deploy/test_manifests.py).
    del environment["TALLY_AGENT_TOKEN_FILE"], environment["TALLY_AGENT_CA_FILE"]
    config = runner.Config.from_env(environment | {"TALLY_AGENT_TOKEN": "t"})
    assert (config.source, config.exporter_profile) == ("exporter", GAUDI.name)
    assert config.exporter_url == "http://10.0.3.7:41611/metrics"
    assert config.hlml_library_dir == HLML_LIBRARY_DIR
    assert environment["LD_LIBRARY_PATH"] == config.hlml_library_dir

    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    mount = mounts[config.hlml_library_dir]
    assert mount["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    # Where Habana's packages install it; Directory: a node without it shows an event.
    assert volume["hostPath"] == {"path": HLML_LIBRARY_DIR, "type": "Directory"}


def test_the_library_directory_is_where_pyhlml_looks_by_default() -> None:
    """The component mounts the host's library where pyhlml (and Habana's own images) look, so
    the agent's default and pyhlml's agree."""
    from pyhlml.hlml_lib import LibHLML

    default = inspect.signature(LibHLML).parameters["path"].default
    assert Path(default) == Path(HLML_LIBRARY_DIR) / HLML_LIBRARY
