"""The CEL selector evaluator against the selectors and devices of the DRA drivers' fixtures."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from inventory.dumps import iter_objects
from quota.cel import (
    MAX_ESTIMATED_COST,
    MAX_EVALUATION_STEPS,
    CELCostError,
    CELError,
    DeviceShape,
    Evaluation,
    compile_selector,
)
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


@pytest.mark.parametrize(
    "expression",
    [
        # CEL's strings extension, as the API server's environment has it.
        "'a,b,c'.split(',') == ['a', 'b', 'c'] && 'a,b,c'.split(',', 2) == ['a', 'b,c']",
        "'abc'.split('') == ['a', 'b', 'c'] && 'abc'.split(',', 0) == []",
        "['a', 'b'].join('-') == 'a-b' && ['a', 'b'].join() == 'ab'",
        "'aXbX'.replace('X', '-') == 'a-b-' && 'aXbX'.replace('X', '-', 1) == 'a-bX'",
        "'hello'.substring(1, 3) == 'el' && 'hello'.substring(3) == 'lo'",
        "'hello'.charAt(1) == 'e' && 'hello'.indexOf('l') == 2 && 'hello'.lastIndexOf('l') == 3",
        "'  x '.trim() == 'x' && 'abc'.reverse() == 'cba' && 'ABC'.lowerAscii() == 'abc'",
        # cel.bind, and Kubernetes' lists, regex and sets libraries.
        "cel.bind(g, device.attributes['gpu.nvidia.com'], g.type == 'gpu' && g.productName != '')",
        "[3, 1, 2].min() == 1 && [3, 1, 2].max() == 3 && [1, 2].sum() == 3",
        "[1, 2, 3].isSorted() && ![2, 1].isSorted() && [1, 2, 1].lastIndexOf(1) == 2",
        "'abc123'.find('[0-9]+') == '123' && 'a1b2'.findAll('[0-9]') == ['1', '2']",
        "sets.contains([1, 2, 3], [1, 2]) && sets.intersects([1], [1, 5])",
        "sets.equivalent([1, 2], [2, 1]) && !sets.contains([1], [2])",
        # Macros as cel-go has them: over a map's keys; all/exists stop at their answer.
        "device.attributes['gpu.nvidia.com'].exists(name, name == 'productName')",
        "[0, 1].exists(x, x == 0 || 1 / x > 0) && ![0, 1].all(x, x == 1 && 1 / x > 0)",
        "[1, 2, 3].map(x, x * 2) == [2, 4, 6] && [1, 2, 3].filter(x, x > 1) == [2, 3]",
        "[1, 2, 3].map(x, x > 1, x * 10) == [20, 30] && [1, 2].exists_one(x, x == 2)",
        "device.attributes['gpu.nvidia.com'].productName.includes('NVIDIA A100-PCIE-40GB')",
    ],
)
def test_the_api_servers_libraries(expression: str, devices: dict[str, Device]) -> None:
    assert _is_true(expression, devices[WHOLE_GPU])


def test_a_macro_over_a_string_is_an_error_not_its_characters(
    devices: dict[str, Device],
) -> None:
    # Upstream: "got 'types.String', expected iterable type"; celpy iterated the characters.
    matched, error = _evaluate(
        "device.attributes['gpu.nvidia.com'].type.exists(c, c == 'g')", devices[WHOLE_GPU]
    )
    assert not matched
    assert error is not None and "got 'types.String', expected iterable type" in error


@pytest.mark.parametrize(
    "expression",
    [
        # 60x60 and 200x200 nested macros: within the API server's limit, not within Tally's.
        "["
        + ",".join(map(str, range(60)))
        + "].all(x, ["
        + ",".join(map(str, range(60)))
        + "].all(y, x + y >= 0))",
        "["
        + ",".join(map(str, range(200)))
        + "].all(x, ["
        + ",".join(map(str, range(200)))
        + "].all(y, x + y >= 0))",
        # Upstream's "expensive" case: over both limits.
        "[1,2,3,4,5,6,7,8,9,10].all(a, [1,2,3,4,5,6,7,8,9,10].all(b, [1,2,3,4,5,6,7,8,9,10]"
        ".all(c, [1,2,3,4,5,6,7,8,9,10].all(d, int('1'.find('[0-9]*')) < 100))))",
    ],
)
def test_an_expensive_selector_is_refused_when_compiled(expression: str) -> None:
    started = time.perf_counter()
    with pytest.raises(CELCostError, match="is too expensive: its estimated cost is"):
        compile_selector(expression)
    assert time.perf_counter() - started < 1.0


def test_an_evaluation_that_beats_its_estimate_is_stopped() -> None:
    # The estimate reckons with the 64 values a list attribute may hold (the API server's
    # limit); a device published with thousands is read to the step limit and no further.
    view = DeviceShape.from_device(
        driver="dra.example.com", attributes={"ports": {"ints": list(range(20_000))}}, capacity={}
    )
    selector = compile_selector("device.attributes['dra.example.com'].ports.all(p, p >= 0)")
    assert selector.cost <= MAX_ESTIMATED_COST
    started = time.perf_counter()
    outcome = selector.run(view)
    assert time.perf_counter() - started < 1.0
    assert outcome.exceeded and not outcome.matched
    assert outcome.steps == MAX_EVALUATION_STEPS + 1
    assert outcome.error is not None and "evaluation stopped after 20,000 steps" in outcome.error
    # Within the limit it is evaluated whole.
    short = DeviceShape.from_device(
        driver="dra.example.com", attributes={"ports": {"ints": list(range(64))}}, capacity={}
    )
    assert selector.run(short) == Evaluation(True, None, selector.run(short).steps)


def test_regular_expressions_are_re2_in_linear_time() -> None:
    # A pattern that backtracks exponentially in Python's `re`: one call, which no step
    # count sees, would hold the worker for minutes on a 40-character string.
    view = DeviceShape.from_device(
        driver="dra.example.com", attributes={"name": {"string": "a" * 40 + "!"}}, capacity={}
    )
    started = time.perf_counter()
    for expression in (
        "device.attributes['dra.example.com'].name.find('(a+)+$') == ''",
        "device.attributes['dra.example.com'].name.findAll('(a|aa)+$').size() == 0",
        "!device.attributes['dra.example.com'].name.matches('^(a+)+$')",
    ):
        assert compile_selector(expression).evaluate(view) == (True, None), expression
    assert time.perf_counter() - started < 1.0
    matched, error = compile_selector(
        "device.attributes['dra.example.com'].name.find('(?=a)') == ''"
    ).evaluate(view)
    assert not matched and error is not None and "invalid regular expression" in error


def test_a_value_that_grows_at_each_step_is_stopped() -> None:
    # Each step multiplies the string by ten: a dozen steps, but a terabyte, were they all run.
    selector = compile_selector("'a'" + ".replace('a', 'aaaaaaaaaa')" * 12 + ".size() > 0")
    assert selector.cost <= MAX_ESTIMATED_COST
    started = time.perf_counter()
    outcome = selector.run(DeviceShape.from_device(driver="x", attributes={}, capacity={}))
    assert time.perf_counter() - started < 1.0
    assert outcome.exceeded and "evaluation stopped after" in (outcome.error or "")


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("(" * 3000 + "true" + ")" * 3000, "is nested too deeply"),
        (" && ".join(["device.driver == 'x'"] * 600), "over the API server's limit of 10,240"),
    ],
    ids=["deep", "long"],
)
def test_a_selector_too_long_or_too_deep_is_refused(expression: str, message: str) -> None:
    with pytest.raises(CELError, match=message):
        compile_selector(expression)
