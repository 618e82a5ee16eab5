"""Read Kubernetes objects from a dump file, one at a time.

A dump is what `kubectl get ... -o yaml` or `-o json` prints (a `kind: List`), a multi-document
YAML file, a single JSON object, a JSON array of objects, or JSON lines (also concatenated
JSON, as `kubectl get -w -o json` prints it). The items of a List are read one by one, so a
100 MB dump is never held in memory whole; YAML and JSON of the same object give the same dict
(timestamps stay strings, as in the API's JSON).

Besides the DRA kinds, a dump may hold what says whose a claim is and which gang it is in:
Pods, ReplicaSets and Jobs (`inventory.owners.OwnerIndex`), and the objects that declare
gangs (`inventory.gangs.GANG_KINDS`: Workloads and PodGroups, JobSets, LeaderWorkerSets,
Volcano PodGroups, the training operators' jobs; `inventory.gangs.GangIndex`), e.g.
`kubectl get resourceclaims,pods,jobsets.jobset.x-k8s.io -A -o yaml`.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import ijson
import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import (
    DocumentEndEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
    StreamEndEvent,
)
from yaml.resolver import Resolver

try:
    from yaml.cyaml import CParser as _YamlEvents  # type: ignore[attr-defined]
except ImportError:  # PyYAML built without libyaml: the pure-Python loader gives the same events
    from yaml.loader import SafeLoader as _YamlEvents  # type: ignore[assignment]


JSON_START = (b"{", b"[")
_BOM = b"\xef\xbb\xbf"
# The prefix ijson gives the elements of a top-level array; every object to yield gets it.
_ITEM = "item"


class DumpError(Exception):
    """A dump that cannot be read or parsed; the message names the file and the position."""


def iter_objects(path: Path) -> Iterator[dict[str, Any]]:
    """Yield every Kubernetes object in the dump at `path`, in file order.

    The items of a List are yielded instead of the List; an item without `kind`/`apiVersion`
    takes them from a typed list (`ResourceSliceList` gives `ResourceSlice`) when the list
    names its kind before its items. Empty documents are skipped. Raises `DumpError` naming
    the file and line (or position) when the file cannot be read or parsed; objects before
    the fault have been yielded by then.
    """
    try:
        with open(path, "rb") as stream:
            head = stream.read(4096)
            stream.seek(len(_BOM) if head.startswith(_BOM) else 0)
            if head.lstrip(_BOM + b" \t\r\n")[:1] in JSON_START:
                yield from _json_objects(path, stream)
            else:
                yield from _yaml_objects(path, stream)
    except OSError as exc:
        raise DumpError(f"{path}: cannot read: {exc.strerror or exc}") from exc


def _list_item_defaults(header: dict[str, Any]) -> dict[str, str]:
    """What the items of a typed list (`kind: XList`) lack: kind `X` and the list's apiVersion."""
    kind = header.get("kind")
    if not isinstance(kind, str) or not kind.endswith("List") or kind == "List":
        return {}
    defaults = {"kind": kind.removesuffix("List")}
    if isinstance(header.get("apiVersion"), str):
        defaults["apiVersion"] = header["apiVersion"]
    return defaults


def _spread(value: Any, where: str) -> Iterator[dict[str, Any]]:
    """`value` as objects: itself, or the items of a List; nothing for an empty document."""
    if value is None:
        return
    if isinstance(value, list):
        for index, element in enumerate(value):
            yield from _spread(element, f"{where}, element {index + 1}")
        return
    if not isinstance(value, dict):
        raise DumpError(f"{where}: not an object: {value!r:.60}")
    if isinstance(value.get("items"), list):
        defaults = _list_item_defaults(value)
        for index, item in enumerate(value["items"]):
            if not isinstance(item, dict):
                raise DumpError(f"{where}: item {index + 1} of the List is not an object")
            yield {**defaults, **item}
        return
    yield value


# --- JSON ----------------------------------------------------------------------------------


def _json_objects(path: Path, stream: IO[bytes]) -> Iterator[dict[str, Any]]:
    start = stream.tell()
    header = _list_header(stream)
    stream.seek(start)
    yielded = 0
    try:
        if header is not None:
            # The common dump, one List: ijson's C code builds the items, about twice as fast
            # as relabelling every event in Python. More JSON after it ends this fast path.
            defaults = _list_item_defaults(header)
            try:
                for item in ijson.items(stream, "items.item", use_float=True):
                    yielded += 1
                    if not isinstance(item, dict):
                        raise DumpError(f"{path}: item {yielded} of the List is not an object")
                    yield {**defaults, **item}
                return
            except ijson.JSONError as exc:
                if "trailing garbage" not in str(exc):
                    raise
            stream.seek(start)
        events = _mark_objects(ijson.parse(stream, multiple_values=True, use_float=True))
        values = ijson.items(events, _ITEM)
        objects = (
            obj
            for number, value in enumerate(values, start=1)
            for obj in _spread(value, f"{path}: object {number}")
        )
        yield from itertools.islice(objects, yielded, None)
    except ijson.JSONError as exc:
        position = _json_error_position(path)
        raise DumpError(f"{path}: {position}: invalid JSON: {_first_line(exc)}") from exc


def _list_header(stream: IO[bytes]) -> dict[str, Any] | None:
    """The members before `items` when the first JSON value is a List, else None."""
    header: dict[str, Any] = {}
    key = None
    try:
        for prefix, name, value in ijson.parse(stream, multiple_values=True, use_float=True):
            if prefix == "items" and name == "start_array":
                return header
            if prefix == "" and name == "map_key":
                key = value
            elif prefix == key and name in ("string", "number"):
                header[key] = value
            elif prefix == "" and name != "start_map":
                return None  # the first value ended, or is not an object
    except ijson.JSONError:
        return None  # the general path reports it, with its position
    return None


def _mark_objects(events: Iterable[tuple[str, str, Any]]) -> Iterator[tuple[str, str, Any]]:
    """Pass JSON parse events on, giving the start of each object to yield the prefix `item`.

    The objects to yield are the items of a top-level List (streamed: the List is never built),
    the elements of a top-level array, and every other top-level value. ijson's `items` only
    looks at the prefix of an object's first event, so only those are relabelled. A top-level
    object is held back until its key `items` shows it is a List, or until it ends.
    """
    held: list[tuple[str, str, Any]] = []  # a top-level object not yet known to be a List
    in_list = in_array = False
    item_defaults: list[tuple[str, str, Any]] = []
    for event in events:
        prefix, name, value = event
        if in_list:
            if prefix == "items.item":
                if name == "start_map":
                    yield (_ITEM, name, value)
                    yield from item_defaults
                else:
                    yield (_ITEM, name, value)
            elif prefix == "":
                in_list = name != "end_map"  # the List's keys after `items` are not needed
            elif prefix != "items":
                yield event
        elif in_array:
            in_array = not (prefix == "" and name == "end_array")
            yield event
        elif held:
            held.append(event)
            if prefix == "items" and name == "start_array":
                in_list = True
                header = _top_level_scalars(held)
                item_defaults = [
                    ev
                    for key, val in _list_item_defaults(header).items()
                    for ev in ((_ITEM, "map_key", key), (f"{_ITEM}.{key}", "string", val))
                ]
                held = []
            elif prefix == "" and name == "end_map":
                yield (_ITEM, "start_map", None)
                yield from held[1:]
                held = []
        elif name == "start_map":
            held = [event]
        elif name == "start_array":
            in_array = True
            yield event
        else:
            yield (_ITEM, name, value)


def _top_level_scalars(held: list[tuple[str, str, Any]]) -> dict[str, Any]:
    """The scalar members of a held top-level object (`kind`, `apiVersion`, ...)."""
    return {
        key[2]: value[2]
        for key, value in itertools.pairwise(held)
        if key[:2] == ("", "map_key") and value[1] in ("string", "number")
    }


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _json_error_position(path: Path) -> str:
    """`line L, column C` of the first JSON fault in `path`.

    ijson's fast C parser does not say where it failed, so the file is parsed again with its
    pure-Python backend, which does (slowly, but only on the error path). For a fault inside a
    string it only says where in the string, so then the 256-byte read it happened in is named.
    """
    from ijson.backends import python as slow_backend

    with open(path, "rb") as stream:
        reader = _CountingReader(stream)
        try:
            for _ in slow_backend.basic_parse(reader, multiple_values=True, buf_size=256):
                pass
        except ijson.JSONError as exc:
            found = re.search(r" at (\d+)$", str(exc))
            return _line_and_column(path, int(found[1]) if found else None)
        except ValueError:  # json.JSONDecodeError from a string lexeme
            return "near " + _line_and_column(path, reader.characters(path))
    return "position unknown"  # not a syntax fault: the caller's message says what it is


class _CountingReader:
    """A binary file that counts the bytes read from it."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.count += len(data)
        return data

    def characters(self, path: Path) -> int:
        """The bytes read so far, as a character offset into the decoded text."""
        with open(path, "rb") as stream:
            return len(stream.read(self.count).decode("utf-8-sig", errors="replace"))


def _line_and_column(path: Path, offset: int | None) -> str:
    """`line L, column C` of character `offset` of `path`, or of its end when `offset` is None."""
    line, column, seen = 1, 1, 0
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as text:
        while chunk := text.read(1 << 20):
            if offset is not None and seen + len(chunk) > offset:
                chunk = chunk[: offset - seen]
            newlines = chunk.count("\n")
            line += newlines
            column = len(chunk) - chunk.rfind("\n") if newlines else column + len(chunk)
            seen += len(chunk)
            if offset is not None and seen >= offset:
                break
    return f"line {line}, column {column}"


# --- YAML ----------------------------------------------------------------------------------


class _PlainResolver(Resolver):
    """YAML 1.1 scalars as the API's JSON has them: timestamps stay strings."""

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in Resolver.yaml_implicit_resolvers.items()
    }


class _StreamLoader(_YamlEvents, Composer, SafeConstructor, _PlainResolver):
    """libyaml's event parser with PyYAML's composer, so one node can be built at a time.

    `yaml.CSafeLoader` composes a whole document at once; building the items of a List one by
    one needs `Composer.compose_node`, which works on any event source.
    """

    def __init__(self, stream: IO[bytes]) -> None:
        _YamlEvents.__init__(self, stream)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        _PlainResolver.__init__(self)

    def next_value(self) -> Any:
        """Compose and construct the next node (a key, a value, an item)."""
        value = self.construct_document(self.compose_node(None, None))  # type: ignore[arg-type]
        self.anchors = {}
        return value


def _yaml_objects(path: Path, stream: IO[bytes]) -> Iterator[dict[str, Any]]:
    loader = _StreamLoader(stream)
    document = 0
    try:
        loader.get_event()  # StreamStart
        while not loader.check_event(StreamEndEvent):
            loader.get_event()  # DocumentStart
            document += 1
            where = f"{path}: document {document} (line {_yaml_line(loader)})"
            if loader.check_event(MappingStartEvent):
                yield from _yaml_mapping(loader, where)
            elif loader.check_event(SequenceStartEvent):
                loader.get_event()
                while not loader.check_event(SequenceEndEvent):
                    yield from _spread(loader.next_value(), where)
                loader.get_event()
            elif loader.check_event(ScalarEvent):
                yield from _spread(loader.next_value(), where)
            if not loader.check_event(DocumentEndEvent):
                raise DumpError(f"{where}: unexpected content")
            loader.get_event()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        position = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "position unknown"
        raise DumpError(f"{path}: {position}: invalid YAML: {exc.problem or exc}") from exc
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise DumpError(f"{path}: document {document}: invalid YAML: {exc}") from exc
    finally:
        loader.dispose()


def _yaml_line(loader: _StreamLoader) -> int:
    event = loader.peek_event()
    return event.start_mark.line + 1 if event is not None and event.start_mark else 0


def _yaml_mapping(loader: _StreamLoader, where: str) -> Iterator[dict[str, Any]]:
    """One top-level mapping: its items when it is a List (built one by one), else itself."""
    loader.get_event()  # MappingStart
    header: dict[Any, Any] = {}
    is_list = False
    while not loader.check_event(MappingEndEvent):
        key = loader.next_value()
        if key == "items" and loader.check_event(SequenceStartEvent):
            is_list = True
            defaults = _list_item_defaults(header)
            loader.get_event()
            index = 0
            while not loader.check_event(SequenceEndEvent):
                index += 1
                item = loader.next_value()
                if not isinstance(item, dict):
                    raise DumpError(f"{where}: item {index} of the List is not an object")
                yield {**defaults, **item}
            loader.get_event()
        else:
            try:
                header[key] = loader.next_value()
            except TypeError as exc:  # an unhashable key, e.g. `? [a, b]`
                raise DumpError(f"{where}: unusable key {key!r:.60}") from exc
    loader.get_event()  # MappingEnd
    if not is_list:
        yield from _spread(header, where)
