"""Wave assignment: stable buckets, per-rollout canaries, cumulative waves, fallback and unserved SKUs;
devices keyed by device class where they name one."""

from __future__ import annotations

import hashlib

import pytest

from pipeline.core.errors import ConfigError
from pipeline.project.config import RolloutSpec, Wave
from pipeline.rollout.inventory import Device, Inventory
from pipeline.rollout.plan import RolloutPlan, bucket, first_wave, included, plan

SKUS = ("x86_ort_fp32", "x86_ort_int8", "arm_ort_fp32")
RINGS = (None, "lab", "beta", "prod")
PERCENT_WAVES = RolloutSpec().waves  # canary 1, early 10, half 50, all 100


def synthetic(n: int) -> Inventory:
    return Inventory(Device(f"dev-{i:06d}", SKUS[i % 3], "x86_64", ring=RINGS[i % 4]) for i in range(n))


@pytest.fixture(scope="module")
def fleet() -> Inventory:
    return synthetic(20_000)


def test_bucket_is_stable_and_in_range():
    assert bucket("r1", "dev-1") == bucket("r1", "dev-1")
    # pinned: a device agent or another host must compute the same value
    digest = hashlib.sha256(b"r1\0dev-1").digest()
    assert bucket("r1", "dev-1") == int.from_bytes(digest[:8], "big") / 2**64 * 100
    values = [bucket("r1", f"dev-{i}") for i in range(10_000)]
    assert all(0 <= v < 100 for v in values)
    assert 45 < sum(values) / len(values) < 55


def test_the_separator_keeps_ids_apart():
    assert bucket("r1", "0dev") != bucket("r10", "dev")


def test_another_rollout_picks_another_canary(fleet):
    canary = [Wave(name="canary", percent=1)]
    picked = [{d.id for d in fleet if first_wave(canary, rollout, d.id, d.ring) == 0} for rollout in ("r1", "r2")]
    assert all(150 < len(p) < 250 for p in picked)
    assert len(picked[0] & picked[1]) < 20  # independent draws share about 1% of 1%


def test_membership_is_cumulative_and_monotonic(fleet):
    waves = [Wave(name="lab", rings=["lab"]), *PERCENT_WAVES[:3], Wave(name="prod", rings=["prod"])]
    for device in list(fleet)[:2000]:
        inside = [included(waves, k, "r1", device.id, device.ring) for k in range(len(waves))]
        assert inside == sorted(inside)  # once in, in every later wave
        first = first_wave(waves, "r1", device.id, device.ring)
        assert inside.index(True) == first if first is not None else not any(inside)


def test_included_refuses_a_wave_out_of_range():
    with pytest.raises(IndexError):
        included(PERCENT_WAVES, 4, "r1", "dev-1", None)


def test_share_per_wave_is_near_its_target(fleet):
    result = plan(fleet, PERCENT_WAVES, "r1", SKUS)
    assert [w.name for w in result.waves] == ["canary", "early", "half", "all"]
    for wave in result.waves:
        assert abs(wave.devices / len(fleet) * 100 - wave.percent) < max(0.2 * wave.percent, 1.0), wave.name
        for sku, count in wave.by_sku.items():  # each SKU gets its share too
            assert abs(count / (len(fleet) / 3) * 100 - wave.percent) < max(0.3 * wave.percent, 1.5), (wave.name, sku)
    assert result.waves[-1].devices == len(fleet) == result.devices
    assert sum(w.new_devices for w in result.waves) == len(fleet)
    assert result.never_included.devices == result.fallback.devices == result.not_served.devices == 0


def test_plan_counts_agree_with_first_wave(fleet):
    result = plan(fleet, PERCENT_WAVES, "r7", SKUS)
    firsts = [first_wave(PERCENT_WAVES, "r7", d.id, d.ring) for d in fleet]
    for k, wave in enumerate(result.waves):
        assert wave.new_devices == firsts.count(k)
        assert wave.devices == sum(1 for f in firsts if f <= k)
        assert sum(wave.by_sku.values()) == wave.devices


def test_ring_waves_and_devices_no_wave_takes(fleet):
    waves = [Wave(name="lab", rings=["lab"], bake_minutes=30), Wave(name="beta", rings=["beta", "nightly"])]
    result = plan(fleet, waves, "r1", SKUS)
    lab, beta = result.waves
    assert (lab.rings, lab.percent, lab.bake_minutes) == (["lab"], None, 30)
    assert lab.devices == lab.new_devices == 5000
    assert (beta.devices, beta.new_devices) == (10_000, 5000)
    assert result.never_included.devices == 10_000
    assert result.never_included.by_ring == {"": 5000, "prod": 5000}
    assert result.never_included.examples[:2] == ["dev-000000", "dev-000003"]
    assert len(result.never_included.examples) == 20


def test_a_ring_wave_after_percent_waves_adds_only_the_rest(fleet):
    waves = [Wave(name="canary", percent=10), Wave(name="prod", rings=["prod"])]
    result = plan(fleet, waves, "r1", SKUS)
    canary, prod = result.waves
    prod_in_canary = sum(1 for d in fleet if d.ring == "prod" and bucket("r1", d.id) < 10)
    assert prod.new_devices == 5000 - prod_in_canary
    assert prod.devices == canary.devices + prod.new_devices
    assert result.never_included.devices == len(fleet) - prod.devices


def test_skus_outside_the_release_get_the_fallback(fleet):
    result = plan(fleet, PERCENT_WAVES, "r1", ["x86_ort_fp32", "x86_ort_int8"], fallback_sku="x86_ort_fp32")
    arm = len(fleet) // 3 + (len(fleet) % 3 > 2)
    assert result.fallback.devices == arm and result.fallback.by_sku == {"arm_ort_fp32": arm}
    assert result.not_served.devices == 0
    last = result.waves[-1]
    assert last.devices == len(fleet) and last.on_fallback == arm and last.by_sku["arm_ort_fp32"] == arm
    assert all(w.on_fallback == w.by_sku.get("arm_ort_fp32", 0) for w in result.waves)


def test_skus_outside_the_release_without_a_fallback_are_not_served(fleet):
    result = plan(fleet, PERCENT_WAVES, "r1", ["x86_ort_fp32", "x86_ort_int8"])
    arm = result.not_served.devices
    assert arm == sum(1 for d in fleet if d.sku == "arm_ort_fp32")
    assert result.not_served.examples[0] == "dev-000002"
    assert result.fallback.devices == 0
    assert result.waves[-1].devices == len(fleet) - arm and "arm_ort_fp32" not in result.waves[-1].by_sku


def test_the_fallback_must_be_in_the_release(fleet):
    with pytest.raises(ConfigError, match="fallback SKU 'portable'"):
        plan(fleet, PERCENT_WAVES, "r1", SKUS, fallback_sku="portable")


def test_plan_is_deterministic_and_has_a_json_form(fleet):
    first, second = (plan(fleet, PERCENT_WAVES, "r1", SKUS).to_json() for _ in range(2))
    assert first.pop("seconds") >= 0 and second.pop("seconds") >= 0
    assert first == second
    assert RolloutPlan.model_validate(first | {"seconds": 0.0}).waves[0].name == "canary"


def test_a_hundred_thousand_devices():
    fleet = synthetic(100_000)
    waves = [Wave(name="lab", rings=["lab"]), *PERCENT_WAVES]
    result = plan(fleet, waves, "big", SKUS[:2], fallback_sku=SKUS[0])
    assert result.devices == result.waves[-1].devices == 100_000
    assert result.waves[0].devices == 25_000
    assert [w.devices for w in result.waves] == sorted(w.devices for w in result.waves)
    assert abs(result.waves[2].devices - (25_000 + 7_500)) < 500  # early: lab and 10% of the rest
    assert result.fallback.devices == 33_333 and result.waves[-1].on_fallback == 33_333


# --- device classes ---------------------------------------------------------------------------------

CLASSES = {"x86-avx2": "x86_ort_int8"}  # the release's class map
ALL = [Wave(name="all", percent=100)]


def classed(n: int, sku: str | None, device_class: str | None, start: int = 0) -> list[Device]:
    return [Device(f"dev-{i:06d}", sku, "x86_64", device_class=device_class) for i in range(start, start + n)]


def test_a_class_only_fleet_is_counted_by_class_and_served_the_selected_engine():
    fleet = Inventory(classed(300, None, "x86-avx2") + classed(100, None, "rpi5", start=300))
    result = plan(fleet, PERCENT_WAVES, "r1", SKUS, fallback_sku="x86_ort_fp32", classes=CLASSES)
    last = result.waves[-1]
    assert (last.devices, last.by_class, last.by_sku) == (400, {"rpi5": 100, "x86-avx2": 300}, {})
    # rpi5 selects nothing and its devices name no SKU: the fallback, counted under their class
    assert last.on_fallback == 100 and result.fallback.by_class == {"rpi5": 100} and result.fallback.by_sku == {}
    assert result.classes == CLASSES
    for wave in result.waves:
        assert sum(wave.by_class.values()) + sum(wave.by_sku.values()) == wave.devices
        assert wave.on_fallback == wave.by_class.get("rpi5", 0)
    # without the class map (a release whose SKUs name no class) none of them has an engine
    bare = plan(fleet, PERCENT_WAVES, "r1", SKUS, classes=None)
    assert bare.not_served.devices == 400 and bare.not_served.by_class == {"rpi5": 100, "x86-avx2": 300}
    assert bare.waves[-1].devices == 0


def test_a_mixed_fleet_counts_each_device_once():
    fleet = Inventory(
        classed(40, None, "x86-avx2")  # class only: the selected engine
        + classed(30, "arm_ort_fp32", None, start=40)  # SKU only: its SKU's engine
        + classed(20, "arm_ort_fp32", "x86-avx2", start=70)  # both: the class decides
        + classed(10, "arm_ort_fp32", "rpi5", start=90)  # a class with no selection: its own SKU
        + classed(5, "jetson_trt", None, start=100)  # a SKU the release lacks: the fallback
    )
    result = plan(fleet, ALL, "r1", SKUS, fallback_sku="x86_ort_fp32", classes=CLASSES)
    (wave,) = result.waves
    assert wave.devices == 105 and wave.by_class == {"rpi5": 10, "x86-avx2": 60}
    assert wave.by_sku == {"arm_ort_fp32": 30, "jetson_trt": 5}
    assert wave.on_fallback == 5 and result.fallback.by_sku == {"jetson_trt": 5} and result.fallback.by_class == {}
    assert fleet.by_class() == {"rpi5": 10, "x86-avx2": 60} and fleet.by_sku() == {"arm_ort_fp32": 30, "jetson_trt": 5}
    # a class mapped to a SKU the release does not hold serves no one: rpi5 devices fall back to their SKU
    elsewhere = plan(fleet, ALL, "r1", ["x86_ort_fp32", "arm_ort_fp32"], "x86_ort_fp32", classes=CLASSES)
    assert elsewhere.classes == {} and elsewhere.waves[0].on_fallback == 40 + 5
