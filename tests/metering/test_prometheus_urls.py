"""The engines' base URLs (`TALLY_PROMETHEUS_URL`, `TALLY_PROMETHEUS_URLS`) are checked at
start: a URL that names no host, or that the API's path cannot be added to, fails with a
message naming the variable (and the cluster), not at the first query."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from metering import prometheus

BAD_URLS = [
    ("http:///api", "it names no host"),
    ("http://:9090", "it names no host"),
    ("https://", "it names no host"),
    ("prometheus:9090", "it must start with http:// or https://"),
    ("http://prometheus:90x0", "Port could not be cast to integer value"),
    ("http://prometheus:9090/?tenant=a", "no query or fragment"),
]


@pytest.mark.parametrize(("url", "why"), BAD_URLS)
def test_a_single_url_without_a_host_is_refused_naming_the_variable(url: str, why: str) -> None:
    with override_settings(TALLY_METERING_SOURCE="prometheus", TALLY_PROMETHEUS_URL=url):
        with pytest.raises(ImproperlyConfigured) as error:
            prometheus.config()
        assert [check.id for check in prometheus.check_settings()] == ["billing.E101"]
    message = str(error.value)
    assert message.startswith(f"TALLY_PROMETHEUS_URL={url!r} is not a base URL")
    assert why in message


@pytest.mark.parametrize(("url", "why"), BAD_URLS)
def test_a_clusters_url_without_a_host_is_refused_naming_the_cluster(url: str, why: str) -> None:
    with (
        override_settings(
            TALLY_METERING_SOURCE="samples,gpu-east=prometheus",
            TALLY_PROMETHEUS_URLS=f"gpu-east={url}",
        ),
        pytest.raises(ImproperlyConfigured) as error,
    ):
        prometheus.config()
    message = str(error.value)
    assert message.startswith(f"TALLY_PROMETHEUS_URLS: gpu-east={url!r} is not a base URL")
    assert why in message


def test_a_bad_single_url_is_refused_even_where_no_cluster_uses_it() -> None:
    with (
        override_settings(TALLY_METERING_SOURCE="samples", TALLY_PROMETHEUS_URL="http:///"),
        pytest.raises(ImproperlyConfigured, match="TALLY_PROMETHEUS_URL='http:///'"),
    ):
        prometheus.config()
    with override_settings(TALLY_METERING_SOURCE="samples", TALLY_PROMETHEUS_URL=""):
        assert prometheus.config().url == ""


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://prometheus:9090/", "http://prometheus:9090"),
        ("https://[::1]:9090", "https://[::1]:9090"),
        ("http://mimir/prometheus", "http://mimir/prometheus"),
        ("  http://user:secret@thanos-query  ", "http://user:secret@thanos-query"),
    ],
)
def test_a_base_url_with_a_host_is_taken(url: str, base: str) -> None:
    with override_settings(TALLY_METERING_SOURCE="prometheus", TALLY_PROMETHEUS_URL=url):
        assert prometheus.config().url_for("any") == base
