"""The Kubernetes DRA CEL test table (`tests/fixtures/cel/conformance.yaml`), run through Tally's
evaluator: every case compiles, matches or fails as the API server's DRA CEL environment does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from quota.cel import MAX_ESTIMATED_COST, CELCostError, CELError, DeviceShape, compile_selector

CASES: list[dict[str, Any]] = yaml.safe_load(
    (Path(__file__).resolve().parents[1] / "fixtures" / "cel" / "conformance.yaml").read_text()
)["cases"]
# Upstream names the longest attribute name it may build (`DeviceMaxIDLength`).
MAX_ID_LENGTH = 63


def _generated(spec: Any) -> Any:
    """The values upstream builds in Go (see the fixture's header)."""
    if isinstance(spec, dict) and spec.get("generate") == "values":
        return [f"value-{i}" for i in range(spec["count"])]
    return spec


def _attributes(case: dict[str, Any]) -> dict[str, Any]:
    attributes = case.get("attributes") or {}
    if attributes.get("generate") == "long-names":
        names = (f"-{i}" for i in range(attributes["count"]))
        return {
            "dra.example.com/" + "x" * (MAX_ID_LENGTH - len(suffix)) + suffix: attributes["value"]
            for suffix in names
        }
    return {
        name: {kind: _generated(value) for kind, value in published.items()}
        for name, published in attributes.items()
    }


def _device(case: dict[str, Any]) -> DeviceShape:
    return DeviceShape.from_device(
        driver=case.get("driver", ""),
        attributes=_attributes(case),
        capacity=case.get("capacity") or {},
        allow_multiple_allocations=bool(case.get("allowMultipleAllocations", False)),
    )


def _expected(case: dict[str, Any]) -> dict[str, Any]:
    keys = ("match", "compile_error", "match_error")
    return case.get("tally") or {key: case[key] for key in keys if key in case}


def test_the_table_is_transcribed_whole() -> None:
    names = [case["name"] for case in CASES]
    assert len(names) == len(set(names)) == 71
    for case in CASES:
        assert len({"match", "compile_error", "match_error"} & case.keys()) == 1, case["name"]
        assert ("tally" in case) == ("why" in case), case["name"]


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_upstream_case(case: dict[str, Any]) -> None:
    expected = _expected(case)
    if "compile_error" in expected:
        with pytest.raises(CELError) as caught:
            compile_selector(case["expression"])
        assert expected["compile_error"].lower() in str(caught.value).lower()
        return
    selector = compile_selector(case["expression"])
    outcome = selector.run(_device(case))
    assert not outcome.exceeded, outcome.error
    if "match_error" in expected:
        assert not outcome.matched
        assert outcome.error is not None and expected["match_error"] in outcome.error
    else:
        assert outcome.error is None
        assert outcome.matched is expected["match"]


# Where Tally's estimate is not upstream's: the API server's estimator adds the list that
# `split()` allocates, which Tally's does not count.
KNOWN_COST_DIFFERENCES = {"split_attribute": 14}


@pytest.mark.parametrize(
    "case", [case for case in CASES if "cost" in case], ids=lambda case: case["name"]
)
def test_estimated_cost_is_upstreams(case: dict[str, Any]) -> None:
    """The estimate follows the API server's estimator, and an expression upstream estimates
    over the API server's limit is refused when compiled."""
    if case["cost"] > MAX_ESTIMATED_COST:
        with pytest.raises(CELCostError, match="too expensive"):
            compile_selector(case["expression"])
        return
    cost = compile_selector(case["expression"]).cost
    assert cost == KNOWN_COST_DIFFERENCES.get(case["name"], case["cost"])
