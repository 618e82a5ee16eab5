"""The CEL selector evaluator against the selectors and devices that upstream DRA publishes."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from quota.cel import (
    CELError,
    CompiledSelector,
    DeviceShape,
    compile_selector,
    match_devices,
    referenced_names,
    shape_key,
)

NVIDIA_DEVICES = (
    "dra-driver-nvidia-gpu/site/content/docs/reference/resourceslice-attributes.devices.yaml"
)
EXAMPLE_SLICES = "dra-example-driver/README.resourceslice-list.yaml"
API_FIXTURES = "kubernetes-api/testdata"

Device = tuple[str, dict[str, Any], dict[str, Any]]


def _selector_expressions(node: Any) -> Iterator[str]:
    """Every `selectors[]` expression, including the website's mis-indented sibling of `cel:`."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "selectors" and isinstance(value, list):
                for selector in value:
                    cel = selector.get("cel") or {}
                    expression = cel.get("expression") or selector.get("expression")
                    if expression:
                        yield expression
            else:
                yield from _selector_expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from _selector_expressions(item)


def _upstream_expressions(upstream: Path, *, fixtures: bool) -> set[str]:
    found: set[str] = set()
    for path in sorted(upstream.rglob("*.yaml")):
        if path.relative_to(upstream).as_posix().startswith(API_FIXTURES) != fixtures:
            continue
        for document in yaml.safe_load_all(path.read_text()):
            found.update(_selector_expressions(document))
    return found


def _normalized(expression: str) -> str:
    return " ".join(expression.split())


@pytest.fixture
def devices(upstream: Path) -> dict[str, Device]:
    """Realistic devices by name: the NVIDIA reference entries, derived variants, example GPUs."""
    gpu, mig, vfio = yaml.safe_load((upstream / NVIDIA_DEVICES).read_text())
    nvidia = "gpu.nvidia.com"
    found: dict[str, Device] = {
        "nvidia-gpu": (nvidia, gpu["attributes"], gpu["capacity"]),
        "nvidia-mig-1g.5gb": (nvidia, mig["attributes"], mig["capacity"]),
        "nvidia-vfio": (nvidia, vfio["attributes"], vfio["capacity"]),
    }
    # The same A100 as published by driver releases up to v25.3, which still had `index`.
    for index in (0, 1):
        attributes = {**gpu["attributes"], "index": {"int": index}}
        found[f"nvidia-gpu-index-{index}"] = (nvidia, attributes, gpu["capacity"])
    # A bigger MIG slice of the same GPU: 3g.20gb has 42 SMs and 19968Mi usable memory.
    big = copy.deepcopy(mig)
    big["attributes"]["profile"] = {"string": "3g.20gb"}
    big["capacity"].update({"memory": {"value": "19968Mi"}, "multiprocessors": {"value": "42"}})
    found["nvidia-mig-3g.20gb"] = (nvidia, big["attributes"], big["capacity"])

    (example_slice,) = yaml.safe_load((upstream / EXAMPLE_SLICES).read_text())["items"]
    for entry in example_slice["spec"]["devices"]:
        found[f"example-{entry['name']}"] = (
            example_slice["spec"]["driver"],
            entry["attributes"],
            entry["capacity"],
        )
    # The website's example device class assumes a driver.example.com GPU with 64Gi.
    website = {"type": {"string": "gpu"}}
    found["website-64Gi"] = ("driver.example.com", website, {"memory": {"value": "64Gi"}})
    found["website-65536Mi"] = ("driver.example.com", website, {"memory": {"value": "65536Mi"}})
    found["website-80Gi"] = ("driver.example.com", website, {"memory": {"value": "80Gi"}})
    return found


# Expected result per upstream selector (whitespace-normalized); devices not listed: no match.
EXPECTED_MATCHES: dict[str, set[str]] = {
    "device.attributes['gpu.example.com'].model == 'BLEEDING-EDGE-GPU'": set(),
    "device.capacity['gpu.example.com'].memory.compareTo(quantity('1Ti')) >= 0": set(),
    "device.attributes['gpu.example.com'].model == 'LATEST-GPU-MODEL'": {
        f"example-gpu-{i}" for i in range(8)
    },
    "device.capacity['gpu.example.com'].memory.compareTo(quantity('4Gi')) >= 0": {
        f"example-gpu-{i}" for i in range(8)
    },
    "device.attributes['gpu.nvidia.com'].profile == '1g.5gb'": {"nvidia-mig-1g.5gb"},
    "device.attributes['gpu.nvidia.com'].profile == '2g.10gb'": set(),
    "device.attributes['gpu.nvidia.com'].profile == '3g.20gb'": {"nvidia-mig-3g.20gb"},
    (
        "device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('^.*a100.*$') && "
        "(device.attributes['gpu.nvidia.com'].index == 0 || "
        "device.attributes['gpu.nvidia.com'].index == 2 || "
        "device.attributes['gpu.nvidia.com'].index == 4 || "
        "device.attributes['gpu.nvidia.com'].index == 6)"
    ): {"nvidia-gpu-index-0"},
    (
        "device.capacity['gpu.nvidia.com'].multiprocessors.isGreaterThan(quantity(\"10\")) && "
        "device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity(\"10Gi\"))"
    ): {"nvidia-mig-3g.20gb"},
    "device.driver == 'gpu.example.com'": {f"example-gpu-{i}" for i in range(8)},
    (
        'device.attributes["driver.example.com"].type == "gpu" && '
        'device.capacity["driver.example.com"].memory == quantity("64Gi")'
    ): {"website-64Gi", "website-65536Mi"},
}


def test_every_upstream_selector_has_an_expectation(upstream: Path) -> None:
    found = {_normalized(e) for e in _upstream_expressions(upstream, fixtures=False)}
    assert found == set(EXPECTED_MATCHES)


def test_upstream_selectors_match_the_expected_devices(
    upstream: Path, devices: dict[str, Device]
) -> None:
    for expression in _upstream_expressions(upstream, fixtures=False):
        selector = compile_selector(expression)
        matched = set()
        for name, (driver, attributes, capacity) in devices.items():
            view = DeviceShape.from_device(driver=driver, attributes=attributes, capacity=capacity)
            if selector.matches(view):
                matched.add(name)
        assert matched == EXPECTED_MATCHES[_normalized(expression)], expression


def test_api_fixture_placeholder_is_not_a_valid_selector(upstream: Path) -> None:
    (placeholder,) = _upstream_expressions(upstream, fixtures=True)
    with pytest.raises(CELError, match="undeclared reference 'expressionValue'"):
        compile_selector(placeholder)


def _evaluate(expression: str, device: Device) -> tuple[bool, str | None]:
    driver, attributes, capacity = device
    view = DeviceShape.from_device(driver=driver, attributes=attributes, capacity=capacity)
    return compile_selector(expression).evaluate(view)


def _is_true(expression: str, device: Device) -> bool:
    matched, error = _evaluate(expression, device)
    assert error is None, error
    return matched


@pytest.mark.parametrize(
    "expression",
    [
        "device.driver == 'gpu.nvidia.com'",
        "device.attributes['gpu.nvidia.com'].type == 'gpu'",
        "device.attributes['gpu.nvidia.com'].productName.startsWith('NVIDIA A100')",
        "device.attributes['gpu.nvidia.com'].productName.endsWith('40GB')",
        "device.attributes['gpu.nvidia.com'].productName.contains('A100')",
        "device.attributes['gpu.nvidia.com'].productName.upperAscii() == 'NVIDIA A100-PCIE-40GB'",
        "device.attributes['gpu.nvidia.com'].architecture.lowerAscii() == 'ampere'",
        "device.attributes['resource.kubernetes.io'].pciBusID.matches('^0000:[0-9a-f]{2}:00\\\\.0$')",
        "device.attributes['resource.kubernetes.io']['pcieRoot'] == 'pci0000:64'",
        "device.attributes['gpu.nvidia.com'].driverVersion.isGreaterThan(semver('550.54.15'))",
        "device.attributes['gpu.nvidia.com'].driverVersion.isLessThan(semver('1000.0.0'))",
        "device.attributes['gpu.nvidia.com'].driverVersion == semver('580.126.20')",
        "device.attributes['gpu.nvidia.com'].cudaComputeCapability.compareTo(semver('8.0.0')) == 0",
        "device.attributes['gpu.nvidia.com'].cudaDriverVersion.major() == 13",
        "device.capacity['gpu.nvidia.com'].memory == quantity('40960Mi')",
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) == 0",
        "device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('39Gi'))",
        "device.capacity['gpu.nvidia.com'].memory.asInteger() == 42949672960",
        "device.allowMultipleAllocations == false",
        "has(device.attributes['gpu.nvidia.com'].uuid)",
        "!has(device.attributes['gpu.nvidia.com'].index)",
        "!('productName' in device.attributes['other.example.com'])",
    ],
)
def test_functions_on_a_real_nvidia_gpu(expression: str, devices: dict[str, Device]) -> None:
    assert _is_true(expression, devices["nvidia-gpu"])


@pytest.mark.parametrize(
    "expression",
    [
        "quantity('1Gi') == quantity('1024Mi')",
        "quantity('1Gi') != quantity('1G')",
        "quantity('1k').compareTo(quantity('999')) == 1",
        "quantity('999').compareTo(quantity('1k')) == -1",
        "quantity('1').isLessThan(quantity('1001m'))",
        "quantity('1Gi').add(quantity('1Gi')) == quantity('2Gi')",
        "quantity('1Gi').sub(1073741824) == quantity('0')",
        "quantity('100m').add(1) == quantity('1100m')",
        "quantity('1.5').asApproximateFloat() == 1.5",
        "quantity('-2Gi').sign() == -1 && quantity('0').sign() == 0",
        "quantity('4').isInteger() && !quantity('100m').isInteger()",
        "isQuantity('40Gi') && !isQuantity('40GiB')",
        "semver('1.2.3').isLessThan(semver('1.10.0'))",
        "semver('1.0.0-rc.1').isLessThan(semver('1.0.0'))",
        "semver('1.0.0+build.5') == semver('1.0.0')",
        "semver('v1.2', true) == semver('1.2.0')",
        "isSemver('1.2.3') && !isSemver('1.2') && !isSemver('01.2.3')",
        "semver('2.3.4').minor() == 3 && semver('2.3.4').patch() == 4",
    ],
)
def test_quantity_and_semver_functions(expression: str, devices: dict[str, Device]) -> None:
    assert _is_true(expression, devices["nvidia-gpu"])


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("device.attributes['gpu.nvidia.com'].index == 0", "index"),
        ("device.attributes['other.example.com'].model == 'x'", "model"),
        ("device.capacity['gpu.nvidia.com'].multiprocessors.isGreaterThan(quantity('1'))", ""),
        ("quantity('1.5').asInteger() == 1", "not an integer"),
        ("quantity('forty') == quantity('40')", "invalid quantity"),
        ("device.capacity['gpu.nvidia.com'].memory == 42949672960", "overload"),
        ("device.attributes['gpu.nvidia.com'].productName", "must evaluate to bool"),
    ],
)
def test_evaluation_errors_are_no_match_and_never_raise(
    expression: str, error: str, devices: dict[str, Device]
) -> None:
    selector = compile_selector(expression)
    driver, attributes, capacity = devices["nvidia-gpu"]
    view = DeviceShape.from_device(driver=driver, attributes=attributes, capacity=capacity)
    assert selector.matches(view) is False
    assert selector.last_error is not None
    assert error in selector.last_error


def test_errors_are_ignored_where_cel_logic_allows(devices: dict[str, Device]) -> None:
    # CEL's && and || are commutative over errors, as in cel-go.
    missing = "device.attributes['gpu.nvidia.com'].index == 0"
    assert _is_true(f"{missing} || device.driver == 'gpu.nvidia.com'", devices["nvidia-gpu"])
    assert not _is_true(f"{missing} && device.driver == 'nope'", devices["nvidia-gpu"])


def test_an_invalid_published_value_fails_every_selector() -> None:
    view = DeviceShape.from_device(
        driver="gpu.nvidia.com",
        attributes={"driverVersion": {"version": "not-a-version"}},
        capacity={},
    )
    selector = compile_selector("device.driver == 'gpu.nvidia.com'")
    assert selector.evaluate(view) == (False, view.error)
    assert "not-a-version" in str(view.error)


def test_list_attributes_become_lists() -> None:
    view = DeviceShape.from_device(
        driver="dra.example.com",
        attributes={"ext.example.com/ports": {"ints": [1, 2]}, "tags": {"strings": ["a", "b"]}},
        capacity={},
    )
    selector = compile_selector(
        "2 in device.attributes['ext.example.com'].ports && "
        "device.attributes['dra.example.com'].tags.exists(t, t == 'b')"
    )
    assert selector.evaluate(view) == (True, None)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("device.driver ==", "syntax error in CEL selector 'device.driver ==' at line 1, column"),
        ("device.attributes['x'.y == 1", "at line 1, column 28"),
        ("device.attributes['x'].y.lowerAsci()", "undeclared function 'lowerAsci'"),
        ("gpu.driver == 'x'", "undeclared reference 'gpu' in CEL selector"),
        ("cel.bind(a, device.driver, a == 'x')", "cel.bind is not supported"),
    ],
)
def test_compile_errors_name_the_expression_and_position(expression: str, message: str) -> None:
    with pytest.raises(CELError) as caught:
        compile_selector(expression)
    assert message in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_compiled_selectors_are_cached() -> None:
    expression = "device.driver == 'gpu.nvidia.com'"
    assert compile_selector(expression) is compile_selector(expression)


def test_macro_variables_are_declared() -> None:
    compile_selector("[1, 2].all(x, x > 0) && ['a'].exists(name, name == 'a')")


@pytest.mark.parametrize(
    ("expression", "names"),
    [
        (
            "device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('a100') && "
            'device.capacity["gpu.nvidia.com"]["memory"].isGreaterThan(quantity("10Gi"))',
            {"gpu.nvidia.com/productName", "gpu.nvidia.com/memory"},
        ),
        (
            "device.attributes['resource.kubernetes.io'].pciBusID != ''",
            {"resource.kubernetes.io/pciBusID"},
        ),
        ("device.driver == 'gpu.nvidia.com'", set()),
        ("device.attributes[device.driver].model == 'x'", None),
        ("'model' in device.attributes['gpu.example.com']", None),
        ("device.attributes['gpu.example.com'].exists(k, k == 'uuid')", None),
        ("device.attributes['gpu.example.com'].model == 'capacity'", None),
    ],
)
def test_referenced_names(expression: str, names: set[str] | None) -> None:
    expected = None if names is None else frozenset(names)
    assert referenced_names(expression) == expected


def test_shape_key_ignores_unreferenced_attributes(devices: dict[str, Device]) -> None:
    names = referenced_names("device.attributes['gpu.example.com'].model == 'LATEST-GPU-MODEL'")
    keys = {
        shape_key(*devices[f"example-gpu-{i}"], names=names)  # uuid and index differ
        for i in range(8)
    }
    assert len(keys) == 1
    assert len({shape_key(*devices[f"example-gpu-{i}"], names=None) for i in range(8)}) == 8


def test_ten_thousand_gpus_that_differ_by_uuid_are_evaluated_once(
    devices: dict[str, Device], monkeypatch: pytest.MonkeyPatch
) -> None:
    driver, attributes, capacity = devices["nvidia-gpu"]
    fleet = []
    for number in range(10_000):
        published = {
            **attributes,
            "uuid": {"string": f"GPU-{number:08x}-5a5f-aa66-7660-471eed407181"},
            "resource.kubernetes.io/pciBusID": {"string": f"0000:{number % 256:02x}:00.0"},
        }
        fleet.append((driver, published, capacity))
    fleet.append(devices["nvidia-mig-1g.5gb"])

    evaluations = 0
    real_matches = CompiledSelector.matches

    def counting(self: CompiledSelector, device: DeviceShape) -> bool:
        nonlocal evaluations
        evaluations += 1
        return real_matches(self, device)

    monkeypatch.setattr(CompiledSelector, "matches", counting)
    expressions = [
        "device.attributes['gpu.nvidia.com'].type == 'gpu'",
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
    ]
    matched = match_devices(expressions, fleet, key=lambda device: device)

    assert len(matched) == 10_000
    assert devices["nvidia-mig-1g.5gb"] not in matched
    # Two shapes (the whole GPU, the MIG slice); the MIG fails the first selector already.
    assert evaluations == 3


def test_match_devices_ands_the_selectors(devices: dict[str, Device]) -> None:
    expressions = [
        "device.attributes['gpu.example.com'].model == 'LATEST-GPU-MODEL'",
        "device.attributes['gpu.example.com'].index < 2",
    ]
    matched = match_devices(expressions, list(devices), key=lambda name: devices[name])
    assert matched == ["example-gpu-0", "example-gpu-1"]
