"""The fleet inventory: each device's id, SKU or device class (or both), architecture, runtime
versions, ring, labels and key.

Read from YAML (``devices:`` a list of mappings) or CSV (one device a row); the suffix says which.
A file is checked whole before it is refused, so one run lists every problem (up to MAX_LISTED).
Large fleets belong in CSV: 100k devices load in well under a second, as YAML in tens of seconds.

``key`` is the device's public key (``ed25519:<base64>``, printed by ``skuforge agent identity``):
the controller counts a report only when it verifies under the key of the device it names
(pipeline/rollout/identity.py), so the inventory is where device identity is reviewed.

A device that names a ``device_class`` runs the engine the release selects for that class (its
``classes`` map, as the agent resolves it), whatever SKU it also names: counts and plans key it by
its class; a device that names only a SKU is keyed by its SKU.
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import yaml

from pipeline.core.errors import InputError
from pipeline.core.io import atomic_write_bytes
from pipeline.core.validation import did_you_mean
from pipeline.project.config import Target, device_class_problem
from pipeline.results.signing import parse_public_key

if TYPE_CHECKING:
    from pipeline.project.config import Registry

ARCHES: tuple[str, ...] = get_args(Target.model_fields["arch"].annotation)
ARCH_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64", "armv8": "aarch64"}
# ids become storage keys (per-device status, reports): no '/', no spaces, nothing to escape
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
COLUMNS = ("id", "sku", "device_class", "arch", "runtime", "ring", "labels", "key")
REQUIRED = ("id", "arch")
NAMED_BY = ("sku", "device_class")  # a device names one of them, or both
SUFFIXES = {".csv": "csv", ".yaml": "yaml", ".yml": "yaml"}
MAX_LISTED = 20

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class Versions(Mapping[str, str]):
    """Package -> version, read-only, hashable and picklable (a Device is frozen and shared)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, str] | Iterable[tuple[str, str]] = ()):
        self._items = dict(items)

    def __getitem__(self, package: str) -> str:
        return self._items[package]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return f"Versions({self._items!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Versions, (self._items,))


@dataclass(frozen=True, slots=True)
class Device:
    id: str
    sku: str | None  # None: the device names only its class
    arch: str
    runtime: Versions = Versions()
    ring: str | None = None
    labels: tuple[str, ...] = ()
    key: str | None = None  # public key, ed25519:<base64>: reports are counted only when signed by it
    device_class: str | None = None  # the release's selection for it decides the engine (before ``sku``)

    def __post_init__(self) -> None:
        if not isinstance(self.runtime, Versions):
            object.__setattr__(self, "runtime", Versions(self.runtime))
        if not isinstance(self.labels, tuple):
            object.__setattr__(self, "labels", tuple(self.labels))


class Inventory:
    """Devices in file order, looked up by id."""

    __slots__ = ("devices", "source", "_by_id")

    def __init__(self, devices: Iterable[Device], source: str | None = None):
        self.devices = list(devices)
        self.source = source
        self._by_id = {d.id: d for d in self.devices}
        if len(self._by_id) != len(self.devices):
            repeated = [i for i, n in Counter(d.id for d in self.devices).items() if n > 1]
            raise ValueError(f"device ids repeat: {repeated[:MAX_LISTED]}")

    def __len__(self) -> int:
        return len(self.devices)

    def __iter__(self) -> Iterator[Device]:
        return iter(self.devices)

    def __contains__(self, device_id: object) -> bool:
        return device_id in self._by_id

    def __getitem__(self, device_id: str) -> Device:
        return self._by_id[device_id]

    def get(self, device_id: str) -> Device | None:
        return self._by_id.get(device_id)

    def by_class(self) -> dict[str, int]:
        """Devices per device class, of those that name one, classes in name order."""
        return dict(sorted(Counter(d.device_class for d in self.devices if d.device_class is not None).items()))

    def by_sku(self) -> dict[str, int]:
        """Devices per SKU, of those that name no device class (by_class counts the others), SKUs in
        name order."""
        return dict(sorted(Counter(d.sku for d in self.devices if d.device_class is None and d.sku).items()))

    def check_against(self, registry: Registry) -> list[str]:
        """One problem per device SKU that params.yaml does not define (an engine cannot be built for
        it) and per device class that no SKU of it serves (``skus.<s>.device_class``)."""
        where = f"{self.source}: " if self.source else ""
        classes = registry.device_classes()
        unknown: dict[str, list[str]] = {}
        unserved: dict[str, list[str]] = {}
        for device in self.devices:
            if device.sku is not None and device.sku not in registry.skus:
                unknown.setdefault(device.sku, []).append(device.id)
            if device.device_class is not None and device.device_class not in classes:
                unserved.setdefault(device.device_class, []).append(device.id)
        return [
            f"{where}{len(ids)} device(s) have SKU {sku!r}, which params.yaml does not define"
            f"{did_you_mean(sku, registry.skus)} (e.g. {_first(ids)})"
            for sku, ids in sorted(unknown.items())
        ] + [
            f"{where}{len(ids)} device(s) have device class {name!r}, which no SKU of params.yaml serves"
            f"{did_you_mean(name, classes)} (skus.<s>.device_class; e.g. {_first(ids)})"
            for name, ids in sorted(unserved.items())
        ]


def load_inventory(path: str | os.PathLike) -> Inventory:
    """The devices in ``path`` (.csv, .yaml or .yml); InputError listing every problem found."""
    path = Path(path)
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise InputError(
            f"{path}: an inventory is a .csv, .yaml or .yml file, not {path.suffix or 'suffix-less'}",
            hint=f"rename it, or write it as CSV with the header {','.join(COLUMNS)}",
        )
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: spreadsheets write a byte-order mark
    except FileNotFoundError:
        raise InputError(f"inventory {path} does not exist", hint="check the path") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})", hint="save it as UTF-8") from exc
    devices, problems = (_read_csv if kind == "csv" else _read_yaml)(text)
    if problems:
        listed = "\n  ".join(problems[:MAX_LISTED])
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise InputError(
            f"{path}: {len(problems)} problem(s) in the inventory:\n  {listed}{more}",
            hint="fix these rows (one device a row, ids unique) and run again",
        )
    return Inventory(devices, source=str(path))


def write_inventory(path: str | os.PathLike, devices: Iterable[Device]) -> Path:
    """Write ``devices`` atomically as CSV or YAML (by suffix), in a form load_inventory reads back."""
    path = Path(path)
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"{path}: write an inventory as .csv, .yaml or .yml")
    if kind == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(COLUMNS)
        writer.writerows(
            (
                d.id,
                d.sku or "",
                d.device_class or "",
                d.arch,
                _runtime_text(d),
                d.ring or "",
                _labels_text(d),
                d.key or "",
            )
            for d in devices
        )
        data = buf.getvalue()
    else:
        rows = [
            {
                "id": d.id,
                "sku": d.sku,
                "device_class": d.device_class,
                "arch": d.arch,
                "runtime": dict(d.runtime),
                "ring": d.ring,
                "labels": list(d.labels),
                "key": d.key,
            }
            for d in devices
        ]
        data = yaml.dump({"devices": rows}, Dumper=_Dumper, sort_keys=False, allow_unicode=True)
    return atomic_write_bytes(path, data.encode())


# --- reading -------------------------------------------------------------------------------------


def _read_csv(text: str) -> tuple[list[Device], list[str]]:
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None:
        return [], [f"the file is empty: write the header {','.join(COLUMNS)}"]
    header = [h.strip().lower() for h in header]
    problems = _columns(header, "line 1: column")
    if problems:
        return [], problems
    width, devices, parse = len(header), [], _Parser()
    # an optional column left out reads as the empty field appended after the last
    fields = itemgetter(*(header.index(name) if name in header else width for name in COLUMNS))
    pad = [""] if width < len(COLUMNS) else []
    for row in reader:
        if not row:
            continue
        where = f"line {reader.line_num}"
        if len(row) != width:
            problems.append(f"{where}: {len(row)} field(s), the header has {width} (quote a value holding a comma)")
            continue
        device = parse(where, *map(str.strip, fields(row + pad)), problems=problems)
        if device is not None:
            devices.append(device)
    return devices, problems


def _read_yaml(text: str) -> tuple[list[Device], list[str]]:
    try:
        doc = yaml.load(text, Loader=_Loader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as exc:
        return [], [f"not valid YAML: {exc}"]
    if not isinstance(doc, dict) or not isinstance(doc.get("devices"), list):
        return [], [f"expected a mapping with a `devices:` list of devices ({', '.join(COLUMNS)})"]
    devices, problems, parse = [], [], _Parser()
    for i, entry in enumerate(doc["devices"]):
        where = f"devices[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{where}: expected a mapping with keys {', '.join(COLUMNS)}, got {type(entry).__name__}")
            continue
        if isinstance(entry.get("id"), str):
            where += f" (id {entry['id']!r})"
        keys = [str(k) for k in entry]
        bad = _columns(keys, f"{where}: key")
        values = [
            _text(entry.get(k), f"{where}: {k}", bad) for k in ("id", "sku", "device_class", "arch", "ring", "key")
        ]
        runtime = _yaml_runtime(entry.get("runtime"), where, bad)
        labels = _yaml_labels(entry.get("labels"), where, bad)
        if bad:
            problems += bad
            continue
        device = parse(
            where, values[0], values[1], values[2], values[3], runtime, values[4], labels, values[5], problems=problems
        )
        if device is not None:
            devices.append(device)
    return devices, problems


class _Parser:
    """Checks one device's fields (as CSV text) and builds it; runtimes and labels repeat across a
    fleet, so each distinct text is parsed once and its value shared. Keys are each device's own:
    one seen twice is a problem (two devices could sign each other's reports)."""

    def __init__(self) -> None:
        self._runtime: dict[str, Versions | str] = {"": Versions()}
        self._labels: dict[str, tuple[str, ...]] = {"": ()}
        self._seen: dict[str, str] = {}  # id -> where it first appeared
        self._classes: dict[str, str | None] = {"": None}  # class text -> why it is no class name (None: it is)
        self._keys: dict[str, str] = {}  # public key -> where it first appeared

    def __call__(
        self,
        where: str,
        id: str,
        sku: str,
        device_class: str,
        arch: str,
        runtime: str,
        ring: str,
        labels: str,
        key: str,
        *,
        problems: list[str],
    ) -> Device | None:
        before = len(problems)
        if not id:
            problems.append(f"{where}: empty id")
        elif ID_PATTERN.fullmatch(id) is None or ".." in id:
            problems.append(
                f"{where}: id {id!r} is not a valid device id: a letter or digit, then letters, digits, "
                "'.', '_', ':' or '-' (no '/', spaces or '..'; at most 128 characters)"
            )
        elif id in self._seen:
            problems.append(f"{where}: id {id!r} repeats {self._seen[id]} (ids must be unique)")
        else:
            self._seen[id] = where
        if not sku and not device_class:
            problems.append(f"{where}: empty sku and device_class (name the device's SKU, its device class, or both)")
        if device_class not in self._classes:
            self._classes[device_class] = device_class_problem(device_class)
        if self._classes[device_class]:
            problems.append(f"{where}: device_class {self._classes[device_class]}")
        if arch not in ARCHES:
            alias = ARCH_ALIASES.get(arch.lower())
            hint = f" (write {alias!r})" if alias else ""
            problems.append(f"{where}: arch {arch!r} is not one of {', '.join(ARCHES)}{hint}")
        versions = self._runtime.get(runtime)
        if versions is None:
            versions = self._runtime[runtime] = _parse_runtime(runtime)
        if isinstance(versions, str):
            problems.append(f"{where}: {versions}")
        tags = self._labels.get(labels)
        if tags is None:
            tags = self._labels[labels] = tuple(t for t in (s.strip() for s in labels.split(";")) if t)
        if key:
            try:
                parse_public_key(key)
            except ValueError as exc:
                problems.append(f"{where}: key {_short(key)} is not a device key: {exc}")
            else:
                if key in self._keys:
                    problems.append(
                        f"{where}: key {_short(key)} repeats {self._keys[key]} (each device has its own: "
                        "run `skuforge agent identity --state DIR` on the device)"
                    )
                else:
                    self._keys[key] = where
        if len(problems) > before or isinstance(versions, str):  # a str runtime: its problem is listed
            return None
        return Device(id, sku or None, arch, versions, ring or None, tags, key or None, device_class or None)


def _parse_runtime(text: str) -> Versions | str:
    """``name=version;name=version`` as Versions, or what is wrong with it."""
    pairs = []
    for entry in text.split(";"):
        entry = entry.strip()
        if not entry:
            continue
        name, sep, version = (s.strip() for s in entry.partition("="))
        if not sep or not name or not version or "=" in version:
            return f"runtime entry {entry!r} is not name=version (e.g. onnxruntime=1.32.0; entries split by ';')"
        pairs.append((name, version))
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        return f"runtime {text!r} names a package twice"
    return Versions(pairs)


def _columns(names: list[str], what: str) -> list[str]:
    problems = [
        f"{what} {n!r} is unknown{did_you_mean(n, COLUMNS)}; known: {', '.join(COLUMNS)}"
        for n in names
        if n not in COLUMNS
    ]
    problems += [f"{what} {n!r} is missing (required: {', '.join(REQUIRED)})" for n in REQUIRED if n not in names]
    if not any(n in names for n in NAMED_BY):
        problems.append(f"{what}s 'sku' and 'device_class' are both missing (a device names one of them, or both)")
    repeated = sorted(n for n, count in Counter(names).items() if count > 1)
    problems += [f"{what} {n!r} appears twice" for n in repeated]
    return problems


def _text(value: Any, where: str, problems: list[str]) -> str:
    # YAML reads 0012 as 10, 1.20 as 1.2 and `no` as false: not the text the user wrote
    if value is None or isinstance(value, str):
        return (value or "").strip()
    kind = "a boolean" if isinstance(value, bool) else "a number" if isinstance(value, (int, float)) else "not text"
    problems.append(f"{where}: YAML reads this value as {kind} ({value!r}); quote it as written")
    return ""


def _yaml_runtime(value: Any, where: str, problems: list[str]) -> str:
    """A YAML runtime mapping in the CSV form, so both formats are checked by one parser."""
    if value is None:
        return ""
    if not isinstance(value, dict):
        problems.append(f"{where}: runtime must be a mapping of package to version (onnxruntime: '1.32.0')")
        return ""
    entries = []
    for name, version in value.items():
        version = _text(version, f"{where}: runtime.{name}", problems)
        if any(sep in f"{name}{version}" for sep in ";="):
            problems.append(f"{where}: runtime.{name}: names and versions may not hold ';' or '='")
        entries.append(f"{name}={version}")
    return ";".join(entries)


def _yaml_labels(value: Any, where: str, problems: list[str]) -> str:
    if value is None:
        return ""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        problems.append(f"{where}: labels must be a list of text, e.g. [lab, eu-west]")
        return ""
    if any(";" in v for v in value):
        problems.append(f"{where}: labels may not hold ';'")
    return ";".join(value)


# --- writing -------------------------------------------------------------------------------------


def _runtime_text(device: Device) -> str:
    if any(";" in s or "=" in s for pair in device.runtime.items() for s in pair):
        raise ValueError(f"device {device.id!r}: runtime {dict(device.runtime)} holds ';' or '=', which CSV splits on")
    return ";".join(f"{name}={version}" for name, version in device.runtime.items())


def _labels_text(device: Device) -> str:
    if any(";" in label for label in device.labels):
        raise ValueError(f"device {device.id!r}: labels {device.labels} hold ';', which CSV splits on")
    return ";".join(device.labels)


def _short(key: str) -> str:
    return repr(key if len(key) <= 24 else key[:20] + "...")


def _first(ids: Iterable[str], n: int = 3) -> str:
    ids = list(ids)
    return ", ".join(ids[:n]) + (", ..." if len(ids) > n else "")
