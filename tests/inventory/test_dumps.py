"""The dump reader: every format kubectl and people produce, errors with positions, streaming."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import yaml

from inventory import simulate
from inventory.dumps import DumpError, iter_objects
from tests.fixtures import CLAIMS, DRA

EXAMPLE_LIST = DRA / "example-driver-slices.yaml"
COUNTER_SLICES = DRA / "partitionable-slices.yaml"
DEVICE_CLASS = DRA / "deviceclass-example.yaml"
CLAIM = CLAIMS / "allocated.yaml"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def names(objects: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(obj["kind"], obj["metadata"]["name"]) for obj in objects]


# --- formats -------------------------------------------------------------------------------


def test_kubectl_yaml_list_gives_its_items() -> None:
    objects = list(iter_objects(EXAMPLE_LIST))

    assert names(objects) == [("ResourceSlice", "kind-worker-gpu.example.com-k7x2q")]
    assert objects[0]["apiVersion"] == "resource.k8s.io/v1"
    assert len(objects[0]["spec"]["devices"]) == 8
    # Quoted timestamps stay strings, as in the API's JSON.
    assert objects[0]["metadata"]["creationTimestamp"] == "2026-03-02T09:41:27Z"


def test_kubectl_json_list_gives_the_same_items_as_the_yaml(tmp_path: Path) -> None:
    listed = yaml.safe_load(EXAMPLE_LIST.read_text())
    path = write(tmp_path, "list.json", json.dumps(listed, indent=4))

    assert list(iter_objects(path)) == list(iter_objects(EXAMPLE_LIST))


def test_multi_document_yaml_gives_each_document() -> None:
    objects = list(iter_objects(COUNTER_SLICES))

    assert names(objects) == [
        ("ResourceSlice", "node-p1-counters"),
        ("ResourceSlice", "node-p1-devices"),
    ]
    assert objects[0]["spec"]["sharedCounters"][0]["counters"]["memory"] == {"value": "80Gi"}


def test_single_yaml_object_without_trailing_newline(tmp_path: Path) -> None:
    text = DEVICE_CLASS.read_text().rstrip("\n")
    assert names(list(iter_objects(write(tmp_path, "class.yaml", text)))) == [
        ("DeviceClass", "gpu.example.com")
    ]


def test_single_json_object(tmp_path: Path) -> None:
    claim = yaml.safe_load(CLAIM.read_text())
    path = write(tmp_path, "claim.json", json.dumps(claim))

    assert list(iter_objects(path)) == [claim]


def test_yaml_documents_mixing_lists_and_objects(tmp_path: Path) -> None:
    text = (
        DEVICE_CLASS.read_text()
        + "\n---\n"
        + EXAMPLE_LIST.read_text()
        + "---\n"
        + COUNTER_SLICES.read_text()
    )
    path = write(tmp_path, "mixed.yaml", text)

    assert [name for _, name in names(list(iter_objects(path)))] == [
        "gpu.example.com",
        "kind-worker-gpu.example.com-k7x2q",
        "node-p1-counters",
        "node-p1-devices",
    ]


def test_json_lines_and_concatenated_json(tmp_path: Path) -> None:
    objects = [{"kind": "Node", "metadata": {"name": f"node-{n}"}} for n in range(3)]
    lines = write(tmp_path, "lines.jsonl", "".join(json.dumps(obj) + "\n" for obj in objects))
    # `kubectl get -w -o json` prints indented objects one after the other.
    pretty = write(tmp_path, "watch.json", "".join(json.dumps(obj, indent=4) for obj in objects))

    assert list(iter_objects(lines)) == objects
    assert list(iter_objects(pretty)) == objects


def test_concatenated_json_lists_and_objects(tmp_path: Path) -> None:
    first = {"apiVersion": "v1", "items": [{"kind": "A"}, {"kind": "B"}], "kind": "List"}
    second = {"apiVersion": "v1", "items": [{"kind": "C"}], "kind": "List"}
    path = write(
        tmp_path,
        "cat.json",
        json.dumps(first) + "\n" + json.dumps({"kind": "D"}) + "\n" + json.dumps(second),
    )

    assert [obj["kind"] for obj in iter_objects(path)] == ["A", "B", "D", "C"]


def test_json_array_of_objects(tmp_path: Path) -> None:
    path = write(tmp_path, "array.json", json.dumps([{"kind": "A"}, {"kind": "B"}]))

    assert [obj["kind"] for obj in iter_objects(path)] == ["A", "B"]


def test_typed_list_items_take_kind_and_api_version_from_the_list(tmp_path: Path) -> None:
    # What the API itself answers (`kubectl get --raw`): items carry neither field.
    raw = {
        "kind": "ResourceSliceList",
        "apiVersion": "resource.k8s.io/v1",
        "metadata": {"resourceVersion": "42"},
        "items": [{"metadata": {"name": "a"}}, {"kind": "Other", "metadata": {"name": "b"}}],
    }
    as_json = write(tmp_path, "raw.json", json.dumps(raw))
    as_yaml = write(tmp_path, "raw.yaml", yaml.safe_dump(raw, sort_keys=False))

    for path in (as_json, as_yaml):
        objects = list(iter_objects(path))
        assert [(obj["kind"], obj["apiVersion"]) for obj in objects] == [
            ("ResourceSlice", "resource.k8s.io/v1"),
            ("Other", "resource.k8s.io/v1"),
        ]


def test_item_fields_win_over_a_plain_lists_fields() -> None:
    # A kubectl List is `apiVersion: v1`; its items keep their own apiVersion.
    (item,) = iter_objects(EXAMPLE_LIST)

    assert item["apiVersion"] == "resource.k8s.io/v1"


@pytest.mark.parametrize(
    "text",
    ["", "\n\n", "---\n", "---\n---\n...\n", "# only a comment\n", "null\n", "~\n"],
)
def test_empty_documents_give_nothing(tmp_path: Path, text: str) -> None:
    assert list(iter_objects(write(tmp_path, "empty.yaml", text))) == []


def test_empty_documents_between_objects_are_skipped(tmp_path: Path) -> None:
    path = write(tmp_path, "gaps.yaml", "---\nkind: A\n---\n---\n\n---\nkind: B\n---\n")

    assert [obj["kind"] for obj in iter_objects(path)] == ["A", "B"]


def test_empty_list(tmp_path: Path) -> None:
    path = write(tmp_path, "empty.json", '{"apiVersion": "v1", "items": [], "kind": "List"}')

    assert list(iter_objects(path)) == []


def test_yaml_and_json_give_the_same_objects(tmp_path: Path) -> None:
    objects = list(simulate.generate(nodes=3, seed=5))
    as_json, as_yaml = tmp_path / "fleet.json", tmp_path / "fleet.yaml"
    with open(as_json, "w") as stream:
        simulate.write_dump(objects, stream, fmt="json")
    with open(as_yaml, "w") as stream:
        simulate.write_dump(objects, stream, fmt="yaml")

    assert list(iter_objects(as_json)) == objects
    assert list(iter_objects(as_yaml)) == objects


def test_unquoted_yaml_timestamps_stay_strings(tmp_path: Path) -> None:
    path = write(
        tmp_path, "ts.yaml", "kind: A\nmetadata:\n  creationTimestamp: 2025-01-02T03:04:05Z\n"
    )

    (obj,) = iter_objects(path)
    assert obj["metadata"]["creationTimestamp"] == "2025-01-02T03:04:05Z"


def test_json_numbers_are_plain_ints_and_floats(tmp_path: Path) -> None:
    path = write(tmp_path, "n.json", '{"kind": "A", "count": 4, "ratio": 0.5}')

    (obj,) = iter_objects(path)
    assert (type(obj["count"]), type(obj["ratio"])) == (int, float)
    json.dumps(obj)  # no Decimal: what JSONField stores


def test_byte_order_mark_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"kind": "A"}).encode())

    assert list(iter_objects(path)) == [{"kind": "A"}]


# --- errors --------------------------------------------------------------------------------


def test_missing_file_names_it(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"

    with pytest.raises(DumpError, match=r"nope\.yaml: cannot read"):
        list(iter_objects(path))


def test_broken_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "broken.yaml", "kind: A\n---\nkind: B\nspec:\n  x: [1, 2\n  y: 3\n")

    with pytest.raises(DumpError, match=r"broken\.yaml: line \d+, column \d+: invalid YAML") as exc:
        list(iter_objects(path))
    assert "line 6" in str(exc.value)


def test_broken_yaml_inside_a_list_yields_the_items_before_it(tmp_path: Path) -> None:
    text = "apiVersion: v1\nitems:\n- kind: A\n- kind: B\n  bad: : :\n    x\nkind: List\n"
    objects = iter_objects(write(tmp_path, "list.yaml", text))

    assert next(objects) == {"kind": "A"}
    with pytest.raises(DumpError, match=r"list\.yaml: line 5"):
        next(objects)


def test_broken_json_names_file_line_and_column(tmp_path: Path) -> None:
    text = '{"apiVersion": "v1", "items": [\n  {"kind": "A"},\n  {"kind": "B",}\n]}'
    path = write(tmp_path, "broken.json", text)

    with pytest.raises(DumpError, match=r"broken\.json: line 3, column 16: invalid JSON"):
        list(iter_objects(path))


def test_truncated_json_points_at_the_end(tmp_path: Path) -> None:
    path = write(tmp_path, "cut.json", '{"apiVersion": "v1", "items": [\n  {"kind": "A"},\n  {"ki')

    with pytest.raises(DumpError, match=r"cut\.json: line 3, column \d+: invalid JSON"):
        list(iter_objects(path))


def test_broken_json_lines_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "lines.jsonl", '{"kind": "A"}\n{"kind": "B"}\n{"kind" "C"}\n')

    with pytest.raises(DumpError, match=r"lines\.jsonl: line 3, column 9"):
        list(iter_objects(path))


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("scalar.yaml", "just a string\n"),
        ("list.yaml", "- kind: A\n- [1, 2]\n"),
        ("scalar.json", '[{"kind": "A"}, 3]'),
        ("item.yaml", "kind: List\nitems:\n- kind: A\n- 7\n"),
        ("item.json", '{"kind": "List", "items": [{"kind": "A"}, "x"]}'),
    ],
)
def test_something_that_is_not_an_object_is_an_error(tmp_path: Path, name: str, text: str) -> None:
    with pytest.raises(DumpError, match=rf"{name.replace('.', '[.]')}: .*not an object"):
        list(iter_objects(write(tmp_path, name, text)))


def test_invalid_utf8_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("kind: A\nname: caf\xe9\n".encode("latin-1"))

    with pytest.raises(DumpError, match=r"latin1\.yaml"):
        list(iter_objects(path))


# --- streaming -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_a_list_is_read_item_by_item(tmp_path: Path, fmt: str) -> None:
    # The first item comes out although the List is broken further on: nothing waits for
    # the whole List to be parsed.
    path = tmp_path / f"fleet.{fmt}"
    with open(path, "w") as stream:
        simulate.write_dump(simulate.generate(nodes=2, seed=1), stream, fmt=fmt)
    text = path.read_text()
    path.write_text(text[: len(text) * 2 // 3] + '\n"broken: [}\n')

    objects = iter_objects(path)
    assert next(objects)["kind"] == "DeviceClass"
    with pytest.raises(DumpError):
        list(objects)


def peak_memory_reading(path: Path) -> int:
    tracemalloc.start()
    try:
        for _ in iter_objects(path):
            pass
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_large_list_is_read_in_bounded_memory(tmp_path: Path) -> None:
    dumps = {}
    for nodes in (200, 800):
        dumps[nodes] = tmp_path / f"fleet-{nodes}.json"
        with open(dumps[nodes], "w") as stream:
            simulate.write_dump(
                simulate.generate(nodes=nodes, seed=2, mix=simulate.WHOLE_GPU_MIX), stream
            )
    small, large = peak_memory_reading(dumps[200]), peak_memory_reading(dumps[800])
    size = dumps[800].stat().st_size

    assert size > 6_000_000
    # Four times the dump, about the same memory: a fixed cost, nothing per item kept.
    assert large < small * 1.5 + 100_000, (small, large)
    assert large < size / 5, f"peak {large} bytes reading a {size}-byte dump"
