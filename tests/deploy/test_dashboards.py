"""The Grafana dashboards and Prometheus monitors in deploy/ (issue 39): every dashboard is a
Grafana dashboard that takes its data source from a variable, every query parses (with
promql-parser, and with promtool where it is installed) and names only metrics Tally exports,
and the two Kustomize components render to what Grafana's sidecar and the Prometheus Operator
read.

The exported names come from what `/metrics` serves (`core.metrics.render`, the database's
collectors included), parsed as Prometheus parses it, never from a list written here. Rendering
needs kubectl, as in test_manifests.py (skipped, saying so, without it); the promtool check is
skipped where promtool is missing, unless TALLY_PROMETHEUS_TESTS=required (.ci/run).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import kubernetes_validate
import promql_parser
import pytest
import yaml
from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR
from prometheus_client.parser import text_string_to_metric_families

from core import metrics
from tests.deploy.test_cloudnativepg import problems
from tests.deploy.test_manifests import (
    DEPLOY,
    KUBERNETES_VERSION,
    REPO,
    Obj,
    env_of,
    find,
    pod_specs,
)

DASHBOARDS = DEPLOY / "components" / "grafana-dashboards"
MONITORS = DEPLOY / "components" / "prometheus-monitors"
DASHBOARDS_DOCS = REPO / "docs" / "operations" / "dashboards.md"
PROMETHEUS_OPERATOR = Path(__file__).resolve().parents[1] / "fixtures" / "prometheus-operator"
SIDECAR_LABEL = ("grafana_dashboard", "1")
GRID_COLUMNS = 24
# `kubectl apply` (client side) copies the object into an annotation of at most 256 KiB.
MOST_CONFIG_MAP_BYTES = 262_144

# The series each metric type is exposed as (the exposition format's suffixes), for families
# that have no sample yet: a labelled metric no process has counted is a bare # TYPE line.
SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "summary": ("", "_count", "_sum"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}
# Grafana's own variables, as the values they take when an expression is parsed here.
BUILTIN_VARIABLES = {
    "__rate_interval": "1m",
    "__interval": "1m",
    "__range": "1h",
    "__interval_ms": "60000",
    "__range_s": "3600",
    "__range_ms": "3600000",
}
# $name, ${name}, ${name:format} and the old [[name]].
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
DATASOURCE_VARIABLE = "datasource"
LABEL_VALUES = re.compile(r"label_values\((?P<selector>.+),\s*(?P<label>\w+)\)")
QUERY_RESULT = re.compile(r"query_result\((?P<expr>.+)\)")


# -- the dashboards -------------------------------------------------------------------------


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


@cache
def load(path: Path) -> Obj:
    document = json.loads(path.read_text())
    assert isinstance(document, dict), path
    return document


@pytest.fixture(params=dashboard_files(), ids=lambda path: path.stem)
def dashboard(request: pytest.FixtureRequest) -> Obj:
    return copy.deepcopy(load(request.param))


def query_panels(dashboard: Obj) -> Iterator[Obj]:
    """Every panel with queries (rows hold none), those inside collapsed rows too."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def expressions(dashboard: Obj) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable, as written."""
    for panel in query_panels(dashboard):
        for target in panel["targets"]:
            yield f"{dashboard['uid']} / {panel['title']} / {target['refId']}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        where = f"{dashboard['uid']} / variable {variable['name']}"
        if found := LABEL_VALUES.fullmatch(text):
            yield where, found["selector"]
        elif found := QUERY_RESULT.fullmatch(text):
            yield where, found["expr"]
        else:
            pytest.fail(f"{where}: {text!r} is neither label_values(...) nor query_result(...)")


def variables(dashboard: Obj) -> dict[str, str]:
    """The value each variable stands for when an expression is checked: Grafana's built-in
    durations, and the dashboard's own variables' "All" value (a regex: they are used in =~)."""
    own = {v["name"]: v.get("allValue") or ".*" for v in dashboard["templating"]["list"]}
    return {**BUILTIN_VARIABLES, **own}


def substituted(expr: str, values: dict[str, str]) -> str:
    """`expr` with each template variable replaced; an undefined one fails the test."""

    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        assert name in values, f"{expr!r} uses ${name}, which the dashboard does not define"
        return values[name]

    return VARIABLE.sub(value, expr)


def metric_names(expr: str) -> list[str]:
    """The metric each selector of `expr` names (parsed with promql-parser). A selector that
    names none exactly (no name, or `__name__=~...`) is reported as such: it cannot be
    checked."""
    names: list[str] = []

    def visit(node: object) -> None:
        if not isinstance(node, promql_parser.VectorSelector):
            return
        if node.name:
            names.append(node.name)
            return
        exact = [
            matcher.value
            for matcher in node.matchers.matchers
            if matcher.name == "__name__" and matcher.op == promql_parser.MatchOp.Equal
        ]
        names.append(exact[0] if len(exact) == 1 else f"(no exact metric name in {node})")

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


@cache
def exported_series() -> frozenset[str]:
    """The series names `/metrics` serves, from what it renders (the database's collectors
    included), less prometheus_client's process and interpreter metrics: the deployed pods
    gather theirs through PROMETHEUS_MULTIPROC_DIR, which exports none of those."""
    own = {
        family.name
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR)
        for family in collector.collect()
    }
    names: set[str] = set()
    for family in text_string_to_metric_families(metrics.render().decode()):
        if family.name in own:
            continue
        names.update(family.name + suffix for suffix in SAMPLE_SUFFIXES[family.type])
        names.update(sample.name for sample in family.samples)
    return frozenset(names)


def unknown_metrics(dashboard: Obj) -> list[str]:
    """'where: name' for every metric a query names that Tally does not export."""
    values = variables(dashboard)
    return [
        f"{where}: {name}"
        for where, expr in expressions(dashboard)
        for name in metric_names(substituted(expr, values))
        if name not in exported_series()
    ]


def datasource_references(node: object) -> Iterator[object]:
    """Every `datasource` value anywhere in the dashboard."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield value
            yield from datasource_references(value)
    elif isinstance(node, list):
        for item in node:
            yield from datasource_references(item)


def is_the_datasource_variable(reference: object) -> bool:
    uid = reference.get("uid") if isinstance(reference, dict) else reference
    return uid in ("$" + DATASOURCE_VARIABLE, "${" + DATASOURCE_VARIABLE + "}")


def test_there_are_the_four_dashboards() -> None:
    uids = {load(path)["uid"] for path in dashboard_files()}
    assert uids == {"tally-fleet", "tally-teams", "tally-webhook", "tally-pipeline"}


def test_every_dashboard_has_grafanas_shape(dashboard: Obj) -> None:
    uid = dashboard["uid"]
    # Grafana's limit for a uid; the sidecar and imports find the dashboard again by it.
    assert isinstance(uid, str) and re.fullmatch(r"[-a-zA-Z0-9_]{1,40}", uid), uid
    assert isinstance(dashboard["title"], str) and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    assert "id" not in dashboard or dashboard["id"] is None, "an id is the Grafana instance's"
    rows = [panel for panel in dashboard["panels"] if panel["type"] == "row"]
    panel_ids = [panel["id"] for panel in dashboard["panels"]] + [
        panel["id"] for row in rows for panel in row.get("panels", [])
    ]
    assert len(panel_ids) == len(set(panel_ids)), "panel ids repeat"
    panels = list(query_panels(dashboard))
    assert panels
    for panel in panels:
        assert panel["type"] and panel["title"] and panel.get("description"), panel.get("title")
        targets = panel["targets"]
        assert targets, f"{panel['title']} has no query"
        ref_ids = [target["refId"] for target in targets]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in targets:
            assert isinstance(target["expr"], str) and target["expr"].strip(), panel["title"]


def test_every_datasource_is_the_datasource_variable(dashboard: Obj) -> None:
    """A hard-coded data source uid exists only in the Grafana it was exported from."""
    (variable,) = (v for v in dashboard["templating"]["list"] if v["name"] == DATASOURCE_VARIABLE)
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    references = list(datasource_references(dashboard))
    assert references
    hard_coded = [ref for ref in references if not is_the_datasource_variable(ref)]
    assert hard_coded == []
    for panel in query_panels(dashboard):
        assert is_the_datasource_variable(panel["datasource"]), panel["title"]
        for target in panel["targets"]:
            assert is_the_datasource_variable(target["datasource"]), panel["title"]


def test_panels_fit_the_grid_without_overlapping(dashboard: Obj) -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] >= 0 and grid["y"] >= 0
        assert grid["x"] + grid["w"] <= GRID_COLUMNS, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, f"{panel['title']} covers {taken[(x, y)]}"
                taken[(x, y)] = panel["title"]


@pytest.mark.django_db
def test_every_query_names_only_metrics_tally_exports(dashboard: Obj) -> None:
    values = variables(dashboard)
    for where, expr in expressions(dashboard):
        assert metric_names(substituted(expr, values)), f"{where} names no metric"
    assert unknown_metrics(dashboard) == []


@pytest.mark.django_db
def test_a_metric_tally_does_not_export_is_reported() -> None:
    """The check above can fail: a metric Tally never had, a counter without the _total its
    series has, and a selector by regex are each reported, and a real name is not."""
    dashboard = copy.deepcopy(load(DASHBOARDS / "webhook.json"))
    panel = next(query_panels(dashboard))
    panel["targets"] = [
        {"refId": "A", "expr": 'sum(rate(tally_gpu_hours_total{namespace=~"$namespace"}[5m]))'},
        {"refId": "B", "expr": "sum(rate(tally_webhook_decisions[$__rate_interval]))"},
        {"refId": "C", "expr": '{__name__=~"tally_.*"}'},
        {"refId": "D", "expr": "sum(rate(tally_webhook_decisions_total[$__rate_interval]))"},
    ]
    where = f"tally-webhook / {panel['title']}"
    assert unknown_metrics(dashboard) == [
        f"{where} / A: tally_gpu_hours_total",
        f"{where} / B: tally_webhook_decisions",
        f'{where} / C: (no exact metric name in {{__name__=~"tally_.*"}})',
    ]
    # The exported names come from /metrics itself: its families with their series' suffixes.
    assert {"tally_webhook_duration_seconds_bucket", "tally_idle_unit_hours"} <= exported_series()
    assert "process_cpu_seconds_total" not in exported_series()


def test_an_undefined_variable_is_reported(dashboard: Obj) -> None:
    with pytest.raises(AssertionError, match=r"uses \$cluster"):
        substituted('tally_sync_lag_seconds{cluster="$cluster"}', variables(dashboard))


def _promtool() -> str:
    found = shutil.which("promtool")
    if found:
        return found
    if os.environ.get("TALLY_PROMETHEUS_TESTS") == "required":
        pytest.fail("TALLY_PROMETHEUS_TESTS=required but promtool is not installed")
    pytest.skip("needs Debian's prometheus package for promtool (apt-get install prometheus)")


def test_every_expression_parses_with_promtool(tmp_path: Path) -> None:
    """Prometheus's own parser, through `promtool check rules` on a recording rule per
    expression: what Grafana sends to Prometheus, variables substituted."""
    promtool = _promtool()
    groups = []
    for path in dashboard_files():
        dashboard = load(path)
        values = variables(dashboard)
        prefix = "tally_dashboard:" + dashboard["uid"].replace("-", "_")
        rules = [
            {"record": f"{prefix}:{index}", "expr": substituted(expr, values)}
            for index, (_, expr) in enumerate(expressions(dashboard))
        ]
        groups.append({"name": dashboard["uid"], "rules": rules})
    rules_file = tmp_path / "dashboards.rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": groups}))
    checked = subprocess.run(
        [promtool, "check", "rules", str(rules_file)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    total = sum(len(group["rules"]) for group in groups)
    assert f"SUCCESS: {total} rules found" in checked.stdout


def test_promtool_refuses_a_broken_expression(tmp_path: Path) -> None:
    """The promtool check can fail: an unbalanced parenthesis is refused."""
    promtool = _promtool()
    rules_file = tmp_path / "broken.rules.yaml"
    unbalanced = "sum(rate(tally_ingest_samples_total[1m])"
    broken = {"record": "tally_dashboard:broken", "expr": unbalanced}
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "broken", "rules": [broken]}]}))
    command = [promtool, "check", "rules", str(rules_file)]
    checked = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert checked.returncode != 0


def test_the_docs_describe_every_dashboard_and_panel() -> None:
    text = DASHBOARDS_DOCS.read_text()
    for path in dashboard_files():
        dashboard = load(path)
        assert dashboard["title"] in text and path.name in text, path.name
        for panel in query_panels(dashboard):
            assert f"**{panel['title']}**" in text, f"{path.name}: {panel['title']}"


# -- the Kustomize components ---------------------------------------------------------------


def render_with(tmp_path: Path, overlay: str, *components: Path) -> tuple[Obj, ...]:
    """The overlay with the components added, as an operator's own overlay would add them."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot render the Kustomize overlays")
    # Kustomize takes relative paths only.
    kustomization = {
        "resources": [os.path.relpath(DEPLOY / "overlays" / overlay, tmp_path)],
        "components": [os.path.relpath(component, tmp_path) for component in components],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    command = [kubectl, "kustomize", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def added_by(tmp_path: Path, component: Path) -> list[Obj]:
    """What the component adds to the production overlay (and it changes nothing else)."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "with").mkdir()
    plain = render_with(tmp_path / "plain", "production")
    extended = render_with(tmp_path / "with", "production", component)
    assert [obj for obj in extended if obj in plain] == list(plain)
    return [obj for obj in extended if obj not in plain]


def test_the_dashboards_component_is_one_configmap_for_the_sidecar(tmp_path: Path) -> None:
    (config_map,) = added_by(tmp_path, DASHBOARDS)
    kubernetes_validate.validate(config_map, KUBERNETES_VERSION, strict=True)
    assert config_map["kind"] == "ConfigMap"
    assert config_map["metadata"]["namespace"] == "tally"
    label, value = SIDECAR_LABEL
    assert config_map["metadata"]["labels"][label] == value
    # The JSON files are the dashboards: the ConfigMap holds each of them unchanged.
    assert config_map["data"] == {path.name: path.read_text() for path in dashboard_files()}
    assert len(json.dumps(config_map).encode()) < MOST_CONFIG_MAP_BYTES


def test_the_monitors_scrape_every_process_that_serves_metrics(tmp_path: Path) -> None:
    monitors = added_by(tmp_path, MONITORS)
    assert sorted(obj["kind"] for obj in monitors) == ["PodMonitor", "ServiceMonitor"]
    for monitor in monitors:
        assert monitor["metadata"]["namespace"] == "tally"
        assert problems(monitor, PROMETHEUS_OPERATOR) == [], monitor["kind"]
    objects = render_with(tmp_path / "with", "production", MONITORS)
    (service_monitor,) = (obj for obj in monitors if obj["kind"] == "ServiceMonitor")
    (pod_monitor,) = (obj for obj in monitors if obj["kind"] == "PodMonitor")

    # The web pods, through their Service: HTTPS checked against Tally's CA, with the token.
    service = find(objects, "Service", "tally-web")
    assert selects(service_monitor["spec"]["selector"], service["metadata"]["labels"])
    (endpoint,) = service_monitor["spec"]["endpoints"]
    port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
    assert port["appProtocol"] == endpoint["scheme"] == "https"
    certificate = find(objects, "Certificate", "tally-web")
    tls = endpoint["tlsConfig"]
    assert tls["serverName"] in certificate["spec"]["dnsNames"]
    assert tls["ca"]["secret"] == {"name": certificate["spec"]["secretName"], "key": "ca.crt"}
    web = find(objects, "Deployment", "tally-web")["spec"]["template"]["spec"]
    token_file = env_of(web["containers"][0])["TALLY_METRICS_TOKEN_FILE"]["value"]
    assert endpoint["authorization"]["credentials"] == mounted_secret(web, token_file)

    # The other processes, pod by pod: each serves plain HTTP on the port the monitor scrapes.
    (pod_endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert pod_endpoint["scheme"] == "http"
    scraped = []
    for deployment, spec in pod_specs(objects):
        labels = spec_labels(deployment)
        if not selects(pod_monitor["spec"]["selector"], labels):
            continue
        scraped.append(deployment["metadata"]["name"])
        (container,) = spec["containers"]
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        assert served_metrics_port(container) == ports[pod_endpoint["port"]], scraped[-1]
        # Each wants the token the monitor sends, mounted from the same secret as the web's.
        token_file = env_of(container)["TALLY_METRICS_TOKEN_FILE"]["value"]
        assert pod_endpoint["authorization"]["credentials"] == mounted_secret(spec, token_file)
    assert sorted(scraped) == ["tally-syncer", "tally-worker"]


def spec_labels(obj: Obj) -> dict[str, str]:
    return dict(obj["spec"]["template"]["metadata"]["labels"])


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions with In) applied to labels."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def mounted_secret(spec: Obj, path: str) -> dict[str, str]:
    """{name, key} of the secret whose key the pod sees at `path` (projected volumes)."""
    for container in spec["containers"]:
        for mount in container.get("volumeMounts", []):
            volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
            for source in volume.get("projected", {}).get("sources", []):
                secret = source.get("secret")
                for item in (secret or {}).get("items", []):
                    if f"{mount['mountPath']}/{item['path']}" == path:
                        return {"name": secret["name"], "key": item["key"]}
    raise AssertionError(f"nothing is mounted at {path}")


def served_metrics_port(container: Obj) -> int | None:
    """The port the process serves its own metrics on: the syncer's --metrics-port, the
    Celery worker's TALLY_WORKER_METRICS_PORT (config/celery.py); None when it serves none."""
    args = container.get("args", [])
    if "--metrics-port" in args:
        return int(args[args.index("--metrics-port") + 1])
    variable = env_of(container).get("TALLY_WORKER_METRICS_PORT")
    return int(variable["value"]) if variable else None
