"""The CEL selector evaluator against the selectors and devices of the DRA drivers' fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from inventory.dumps import iter_objects
from quota.cel import CELError, DeviceShape, compile_selector
from tests.fixtures import DRA

WHOLE_GPU = "nvidia-gpu-1"  # an A100-PCIE-40GB
MIG_1G = "nvidia-gpu-0-mig-1g5gb-19-2"

Device = tuple[str, dict[str, Any], dict[str, Any]]


def selector_expressions(node: Any) -> Iterator[str]:
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
                yield from selector_expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from selector_expressions(item)


def _fixture_expressions() -> set[str]:
    found: set[str] = set()
    for path in sorted(DRA.rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            found.update(selector_expressions(document))
    return found


def normalized(expression: str) -> str:
    return " ".join(expression.split())


@pytest.fixture
def devices() -> dict[str, Device]:
    """Every device of the driver fixtures by driver and name: `nvidia-gpu-1`, `example-gpu-0`."""
    found: dict[str, Device] = {}
    files = {"nvidia": "nvidia-slices.yaml", "example": "example-driver-slices.yaml"}
    for prefix, file in files.items():
        for resource_slice in iter_objects(DRA / file):
            for entry in resource_slice["spec"]["devices"]:
                found[f"{prefix}-{entry['name']}"] = (
                    resource_slice["spec"]["driver"],
                    entry["attributes"],
                    entry["capacity"],
                )
    return found


MIGS = {
    "nvidia-gpu-0-mig-1g5gb-19-2",
    "nvidia-gpu-0-mig-1g5gb-19-3",
    "nvidia-gpu-0-mig-2g10gb-14-0",
    "nvidia-gpu-0-mig-3g20gb-9-4",
}
EXAMPLE_GPUS = {f"example-gpu-{i}" for i in range(8)}
H100_VFIO = {"nvidia-gpu-vfio-0", "nvidia-gpu-vfio-1"}
# Expected result per fixture selector (whitespace-normalized); devices not listed: no match.
EXPECTED_MATCHES: dict[str, set[str]] = {
    # The DeviceClasses: the NVIDIA ones by `type`, the example driver's by driver.
    "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'": {
        WHOLE_GPU
    },
    "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'": MIGS,
    "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'vfio'": (
        H100_VFIO
    ),
    "device.driver == 'gpu.example.com'": EXAMPLE_GPUS,
    "device.attributes['gpu.nvidia.com'].profile == '1g.5gb'": {
        "nvidia-gpu-0-mig-1g5gb-19-2",
        "nvidia-gpu-0-mig-1g5gb-19-3",
    },
    "device.attributes['gpu.nvidia.com'].profile == '2g.10gb'": {"nvidia-gpu-0-mig-2g10gb-14-0"},
    # 28 SMs and 9856Mi, 42 SMs and 19968Mi; a whole GPU publishes no `multiprocessors`.
    (
        "device.capacity['gpu.nvidia.com'].multiprocessors.compareTo(quantity(\"28\")) >= 0 && "
        "device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity(\"9Gi\"))"
    ): {"nvidia-gpu-0-mig-2g10gb-14-0", "nvidia-gpu-0-mig-3g20gb-9-4"},
    # MIG devices carry their parent's productName: only the class keeps them apart.
    "device.attributes['gpu.nvidia.com'].productName.lowerAscii().contains('a100')": {
        WHOLE_GPU,
        *MIGS,
    },
    "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA A100-PCIE-40GB'": {
        WHOLE_GPU,
        *MIGS,
    },
    "device.attributes['gpu.nvidia.com'].productName.startsWith('NVIDIA H100')": H100_VFIO,
    "device.attributes['gpu.example.com'].model == 'LATEST-GPU-MODEL'": EXAMPLE_GPUS,
    "device.capacity['gpu.example.com'].memory.compareTo(quantity('40Gi')) >= 0": EXAMPLE_GPUS,
    "device.attributes['gpu.example.com'].model == 'NEXT-GPU-MODEL'": set(),
    "device.capacity['gpu.example.com'].memory.compareTo(quantity('2Ti')) >= 0": set(),
    # The other vendors' classes (fixtures/dra/vendors) match none of the devices above; they
    # are checked against their own drivers' devices in test_vendor_claims.py.
    "device.driver == 'gpu.amd.com'": set(),
    "device.driver == 'gpu.intel.com'": set(),
    "device.driver == 'gaudi.intel.com'": set(),
    "device.driver == 'tpu.google.com'": set(),
    "device.driver == 'gpu.partitions.example.com'": set(),
}


def test_every_fixture_selector_has_an_expectation() -> None:
    assert {normalized(e) for e in _fixture_expressions()} == set(EXPECTED_MATCHES)


def test_fixture_selectors_match_the_expected_devices(devices: dict[str, Device]) -> None:
    for expression in _fixture_expressions():
        assert matching(expression, devices) == EXPECTED_MATCHES[normalized(expression)], expression


def matching(expression: str, devices: dict[str, Device]) -> set[str]:
    """The names of the devices `expression` selects."""
    selector = compile_selector(expression)
    matched = set()
    for name, (driver, attributes, capacity) in devices.items():
        view = DeviceShape.from_device(driver=driver, attributes=attributes, capacity=capacity)
        if selector.matches(view):
            matched.add(name)
    return matched


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
        "device.attributes['resource.kubernetes.io']['pcieRoot'] == 'pci0000:ae'",
        "device.attributes['gpu.nvidia.com'].driverVersion.isGreaterThan(semver('550.54.15'))",
        "device.attributes['gpu.nvidia.com'].driverVersion.isLessThan(semver('1000.0.0'))",
        "device.attributes['gpu.nvidia.com'].driverVersion == semver('580.95.5')",
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
    assert _is_true(expression, devices[WHOLE_GPU])


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
    assert _is_true(expression, devices[WHOLE_GPU])


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("device.attributes['gpu.nvidia.com'].index == 0", "index"),
        ("device.attributes['other.example.com'].model == 'x'", "model"),
        ("device.capacity['gpu.nvidia.com'].multiprocessors.isGreaterThan(quantity('1'))", ""),
        ("quantity('1.5').asInteger() == 1", "not an integer"),
        ("quantity('forty') == quantity('40')", "invalid quantity"),
        ("device.attributes['gpu.nvidia.com'].productName", "must evaluate to bool"),
    ],
)
def test_evaluation_errors_are_no_match_and_never_raise(
    expression: str, error: str, devices: dict[str, Device]
) -> None:
    selector = compile_selector(expression)
    driver, attributes, capacity = devices[WHOLE_GPU]
    view = DeviceShape.from_device(driver=driver, attributes=attributes, capacity=capacity)
    assert selector.matches(view) is False
    matched, reason = selector.evaluate(view)
    assert not matched and reason is not None
    assert error in reason


def test_errors_are_ignored_where_cel_logic_allows(devices: dict[str, Device]) -> None:
    # CEL's && and || are commutative over errors, as in cel-go.
    missing = "device.attributes['gpu.nvidia.com'].index == 0"
    assert _is_true(f"{missing} || device.driver == 'gpu.nvidia.com'", devices[WHOLE_GPU])
    assert not _is_true(f"{missing} && device.driver == 'nope'", devices[WHOLE_GPU])


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
        ("device.attributes['x'].y.lowerAsci()", "undeclared reference to 'lowerAsci'"),
        ("gpu.driver == 'x'", "undeclared reference 'gpu' in CEL selector"),
        ("device.gpu == 'x'", "undefined field 'gpu'"),
        ("1", "must evaluate to bool or the unknown type, not int"),
        ("device.driver", "must evaluate to bool or the unknown type, not string"),
        ("device.capacity['gpu.nvidia.com'].memory == 42949672960", "no matching overload"),
        ("device.driver.all(c, c == 'x')", "cannot be range of a comprehension"),
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
