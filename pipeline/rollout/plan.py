"""Which wave each device of the fleet joins a rollout in: deterministic, no I/O.

A device's bucket is a stable hash of the rollout id and its id, so the same rollout always picks
the same devices, and another rollout picks another canary (no device is always first). Waves are
cumulative: a device in wave k is in every later wave.

A device is served as the agent serves it (pipeline.rollout.agent.engine_for): the engine the
release selects for its device class (the release's ``classes``), else its own SKU's, else the
fallback. Counts key a device by its class where it names one (``by_class``), else by its SKU
(``by_sku``), so a class-only fleet, a SKU-named one and a mix are each counted once.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence

from pydantic import Field

from pipeline.core.errors import ConfigError
from pipeline.project.config import Wave
from pipeline.results.reports import Result
from pipeline.rollout.inventory import Device, Inventory

MAX_EXAMPLES = 20
_BELOW_100 = math.nextafter(100.0, 0.0)


def bucket(rollout_id: str, device_id: str) -> float:
    """The device's place in [0, 100) for this rollout."""
    digest = hashlib.sha256(f"{rollout_id}\0{device_id}".encode()).digest()
    # float rounding takes the top 2**10 hash values to 100.0, which a 100% wave must still include
    return min(int.from_bytes(digest[:8], "big") / 2**64 * 100, _BELOW_100)


def first_wave(waves: Sequence[Wave], rollout_id: str, device_id: str, ring: str | None) -> int | None:
    """Index of the first wave that takes the device (by bucket < percent, or by ring), None if none does."""
    share = None
    for index, wave in enumerate(waves):
        if wave.percent is not None:
            if share is None:
                share = bucket(rollout_id, device_id)
            if share < wave.percent:
                return index
        elif ring is not None:
            assert wave.rings is not None  # a Wave has exactly one of percent and rings (its validator)
            if ring in wave.rings:
                return index
    return None


def included(waves: Sequence[Wave], wave_index: int, rollout_id: str, device_id: str, ring: str | None) -> bool:
    """Whether the device is in wave ``wave_index`` (it or an earlier wave took it)."""
    if not 0 <= wave_index < len(waves):
        raise IndexError(f"wave {wave_index} of a rollout with {len(waves)} wave(s)")
    return first_wave(waves[: wave_index + 1], rollout_id, device_id, ring) is not None


Key = tuple[str, str]  # ("class", name) or ("sku", name): a class and a SKU may share a name


def key(device: Device) -> Key:
    """What a device is counted under: its device class where it names one, else its SKU."""
    if device.device_class is not None:
        return ("class", device.device_class)
    return ("sku", device.sku or "")


def engine(device: Device, release: Collection[str], classes: Mapping[str, str]) -> str | None:
    """The SKU whose engine the release serves ``device`` (as the agent picks it): its class's
    selected SKU, else its own SKU where the release has it; None: the fallback, if any."""
    if device.device_class is not None and device.device_class in classes:
        return classes[device.device_class]
    if device.sku is not None and device.sku in release:
        return device.sku
    return None


class DeviceGroup(Result):
    """Devices the plan sets apart, counted, with the first few ids (inventory order) to look at."""

    devices: int = 0
    by_sku: dict[str, int] = Field(default_factory=dict, description="devices that name no device class, per SKU")
    by_class: dict[str, int] = Field(default_factory=dict, description="devices that name a device class, per class")
    by_ring: dict[str, int] = Field(default_factory=dict, description="'' for devices without a ring")
    examples: list[str] = Field(default_factory=list)


class WavePlan(Result):
    name: str
    percent: float | None = None
    rings: list[str] | None = None
    bake_minutes: float
    devices: int = Field(description="devices in this wave and the earlier ones (cumulative)")
    new_devices: int = Field(description="devices this wave adds")
    on_fallback: int = Field(
        description="of `devices`, those the release has no engine for (class or SKU): they get the fallback engine"
    )
    by_sku: dict[str, int] = Field(description="`devices` that name no device class, per SKU (cumulative)")
    by_class: dict[str, int] = Field(
        default_factory=dict, description="`devices` that name a device class, per class (cumulative)"
    )


class RolloutPlan(Result):
    rollout_id: str
    release_skus: list[str]
    classes: dict[str, str] = Field(
        default_factory=dict, description="device class -> the SKU the release serves it with (its `classes`)"
    )
    fallback_sku: str | None
    devices: int = Field(description="devices in the inventory")
    waves: list[WavePlan]
    never_included: DeviceGroup = Field(description="served devices no wave takes (e.g. a ring no wave lists)")
    fallback: DeviceGroup = Field(
        description="devices the release has no engine for (their class selects none, their SKU is not in it), "
        "served the fallback engine"
    )
    not_served: DeviceGroup = Field(description="devices the release has no engine for, with no fallback SKU set")
    not_targeted: DeviceGroup = Field(
        default_factory=DeviceGroup, description="devices without any of the rollout's labels (none: all targeted)"
    )
    labels: list[str] = Field(default_factory=list, description="the rollout's target labels (empty: every device)")
    seconds: float = Field(description="time taken to plan")


def plan(
    inventory: Inventory | Iterable[Device],
    waves: Sequence[Wave],
    rollout_id: str,
    release_skus: Collection[str],
    fallback_sku: str | None = None,
    labels: Collection[str] = (),
    classes: Mapping[str, str] | None = None,
) -> RolloutPlan:
    """Assign every device its first wave and count each wave's devices. With ``labels``, only
    devices carrying one of them take part (the others are counted as not targeted). ``classes``:
    the release's device class -> SKU map; a device of a class in it runs that SKU's engine."""
    start = time.perf_counter()
    release = frozenset(release_skus)
    served_classes = {c: s for c, s in (classes or {}).items() if s in release}
    wanted = frozenset(labels)
    if fallback_sku is not None and fallback_sku not in release:
        raise ConfigError(
            f"rollout {rollout_id}: the release has no engine for the fallback SKU {fallback_sku!r} "
            f"(it has {', '.join(sorted(release)) or 'none'})",
            hint="add the fallback SKU to release.skus and promote the release again",
        )
    first: list[Counter[Key]] = [Counter() for _ in waves]  # key counts of the devices each wave adds
    first_fallback = [0] * len(waves)
    never, fallback, unserved, untargeted = _Group(), _Group(), _Group(), _Group()
    total = 0
    for device in inventory:
        total += 1
        if wanted and wanted.isdisjoint(device.labels):
            untargeted.add(device)
            continue
        served = engine(device, release, served_classes) is not None
        if not served:
            if fallback_sku is None:
                unserved.add(device)
                continue
            fallback.add(device)
        index = first_wave(waves, rollout_id, device.id, device.ring)
        if index is None:
            never.add(device)
            continue
        first[index][key(device)] += 1
        if not served:
            first_fallback[index] += 1

    wave_plans, on_fallback = [], 0
    cumulative: Counter[Key] = Counter()  # key counts of the devices the waves so far take
    for wave, added, added_fallback in zip(waves, first, first_fallback, strict=True):
        cumulative.update(added)
        on_fallback += added_fallback
        by_sku, by_class = _split(cumulative)
        wave_plans.append(
            WavePlan(
                name=wave.name,
                percent=wave.percent,
                rings=wave.rings,
                bake_minutes=wave.bake_minutes,
                devices=cumulative.total(),
                new_devices=added.total(),
                on_fallback=on_fallback,
                by_sku=by_sku,
                by_class=by_class,
            )
        )
    return RolloutPlan(
        rollout_id=rollout_id,
        release_skus=sorted(release),
        classes=dict(sorted(served_classes.items())),
        fallback_sku=fallback_sku,
        devices=total,
        waves=wave_plans,
        never_included=never.result(),
        fallback=fallback.result(),
        not_served=unserved.result(),
        not_targeted=untargeted.result(),
        labels=sorted(wanted),
        seconds=time.perf_counter() - start,
    )


def _split(counts: Counter[Key]) -> tuple[dict[str, int], dict[str, int]]:
    """``counts`` as (by SKU, by class), names in order."""
    by_sku: dict[str, int] = {}
    by_class: dict[str, int] = {}
    for (kind, name), n in sorted(counts.items()):
        (by_class if kind == "class" else by_sku)[name] = n
    return by_sku, by_class


class _Group:
    __slots__ = ("keys", "rings", "examples")

    def __init__(self) -> None:
        self.keys: Counter[Key] = Counter()
        self.rings: Counter[str] = Counter()
        self.examples: list[str] = []

    def add(self, device: Device) -> None:
        self.keys[key(device)] += 1
        self.rings[device.ring or ""] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(device.id)

    def result(self) -> DeviceGroup:
        by_sku, by_class = _split(self.keys)
        return DeviceGroup(
            devices=self.keys.total(),
            by_sku=by_sku,
            by_class=by_class,
            by_ring=dict(sorted(self.rings.items())),
            examples=self.examples,
        )
