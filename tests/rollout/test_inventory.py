"""The fleet inventory: CSV and YAML round trips, and every validation error naming its row."""

from __future__ import annotations

import os
import pickle

import models
import pytest

from pipeline.core.errors import InputError
from pipeline.project.config import parse_registry
from pipeline.results.signing import SigningKey
from pipeline.rollout.inventory import Device, Inventory, Versions, load_inventory, write_inventory

HEADER = "id,sku,arch,runtime,ring,labels\n"
GOOD = "cam-1,x86_ort_fp32,x86_64,onnxruntime=1.32.0,lab,a\n"
KEY_A, KEY_B = (SigningKey.generate("test").public_key for _ in range(2))


def fleet() -> list[Device]:
    return [
        Device(
            "cam-001",
            "x86_ort_fp32",
            "x86_64",
            {"onnxruntime": "1.32.0", "openvino": "2026.1.0"},
            "lab",
            ("eu-west", "indoor"),
            KEY_A,
        ),
        Device("cam-002", "arm_ort_fp32", "aarch64", {"onnxruntime": "1.20"}, None, ()),
        Device("gw:7.b_c-9", "x86_ort_fp32", "x86_64", {}, "beta", ("edge",), KEY_B),
        Device("0012", "arm_ort_fp32", "aarch64", {"onnxruntime": "1.31.1"}, "prod", ()),  # YAML would read 10
    ]


def write(tmp_path, text: str, name: str = "fleet.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def problem(path) -> str:
    with pytest.raises(InputError) as info:
        load_inventory(path)
    assert info.value.exit_code == 2
    assert str(path) in info.value.message
    return info.value.message


# --- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fleet.csv", "fleet.yaml", "fleet.yml"])
def test_round_trip(tmp_path, name):
    path = write_inventory(tmp_path / name, fleet())
    inventory = load_inventory(path)
    assert inventory.devices == fleet()
    assert len(inventory) == 4 and list(inventory) == fleet()
    assert inventory["cam-002"].runtime == {"onnxruntime": "1.20"}
    assert "gw:7.b_c-9" in inventory and inventory.get("nope") is None
    assert inventory.by_sku() == {"arm_ort_fp32": 2, "x86_ort_fp32": 2}
    assert inventory.source == str(path)
    assert (inventory["cam-001"].key, inventory["cam-002"].key) == (KEY_A, None)
    assert [p.name for p in tmp_path.iterdir()] == [name]  # the atomic write left no temporary file


def test_key_is_the_last_csv_column(tmp_path):
    path = write_inventory(tmp_path / "fleet.csv", fleet()[:2])
    header, first, second = path.read_text().splitlines()
    assert header == "id,sku,device_class,arch,runtime,ring,labels,key"
    assert first.endswith(f",eu-west;indoor,{KEY_A}") and second.endswith(",,")
    written = write(tmp_path, HEADER.replace("\n", ",key\n") + GOOD.replace("\n", f",{KEY_B}\n"), "keyed.csv")
    assert load_inventory(written)["cam-1"].key == KEY_B


def test_keys_are_checked_and_unique(tmp_path):
    header = HEADER.replace("\n", ",key\n")
    rows = [
        f"cam-1,s,x86_64,,,,{KEY_A}",
        f"cam-2,s,x86_64,,,,{KEY_A}",  # a second device with the first one's key
        "cam-3,s,x86_64,,,,ed25519:bm90IGEga2V5",
        "cam-4,s,x86_64,,,,ssh-ed25519 AAAAC3Nz",
        f"cam-5,s,x86_64,,,,{KEY_B}",
        "cam-6,s,x86_64,,,,",
    ]
    message = problem(write(tmp_path, header + "\n".join(rows) + "\n"))
    assert "3 problem(s)" in message
    shown = repr(KEY_A[:20] + "...")  # keys are shortened in messages
    assert f"line 3: key {shown} repeats line 2 (each device has its own" in message
    assert "line 4: key 'ed25519:bm90IGEga2V5' is not a device key: an ed25519 public key is 32 bytes" in message
    assert "line 5: key 'ssh-ed25519 AAAAC3Nz' is not a device key: a public key reads 'ed25519:" in message
    assert "line 6" not in message and "line 7" not in message


def test_csv_as_documented(tmp_path):
    path = write(tmp_path, HEADER + "cam-1,x86_ort_fp32,x86_64,onnxruntime=1.32.0;openvino=2026.1.0,,a;b\n")
    (device,) = load_inventory(path)
    assert device == Device(
        "cam-1", "x86_ort_fp32", "x86_64", {"onnxruntime": "1.32.0", "openvino": "2026.1.0"}, None, ("a", "b")
    )


def test_csv_optional_columns_may_be_left_out_and_columns_reordered(tmp_path):
    path = write(tmp_path, "Arch,id,sku\r\nx86_64,cam-1,x86_ort_fp32\r\n\r\naarch64,cam-2,arm_ort_fp32\r\n")
    assert load_inventory(path).devices == [
        Device("cam-1", "x86_ort_fp32", "x86_64"),
        Device("cam-2", "arm_ort_fp32", "aarch64"),
    ]


def test_csv_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "fleet.csv"
    path.write_bytes(b"\xef\xbb\xbf" + (HEADER + GOOD).encode())
    assert load_inventory(path)["cam-1"].ring == "lab"


def test_yaml_hand_written(tmp_path):
    path = write(
        tmp_path,
        "devices:\n"
        "  - {id: cam-1, sku: x86_ort_fp32, arch: x86_64, runtime: {onnxruntime: '1.32.0'}}\n"
        "  - id: cam-2\n    sku: arm_ort_fp32\n    arch: aarch64\n    ring: lab\n"
        "    labels: [a, b]\n",
        "fleet.yaml",
    )
    assert load_inventory(path).devices == [
        Device("cam-1", "x86_ort_fp32", "x86_64", {"onnxruntime": "1.32.0"}),
        Device("cam-2", "arm_ort_fp32", "aarch64", {}, "lab", ("a", "b")),
    ]


def test_device_is_frozen_hashable_and_picklable():
    device = fleet()[0]
    assert isinstance(device.runtime, Versions)
    assert {device: 1}[fleet()[0]] == 1
    assert pickle.loads(pickle.dumps(device)) == device
    with pytest.raises(AttributeError):
        device.sku = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        device.runtime["onnxruntime"] = "1.0"  # type: ignore[index]


def test_inventory_refuses_repeated_ids_from_code():
    with pytest.raises(ValueError, match="cam-001"):
        Inventory(fleet() + fleet()[:1])


def test_write_refuses_what_csv_would_split(tmp_path):
    with pytest.raises(ValueError, match="';'"):
        write_inventory(tmp_path / "fleet.csv", [Device("cam-1", "s", "x86_64", labels=("a;b",))])
    with pytest.raises(ValueError, match="'='"):
        write_inventory(tmp_path / "fleet.csv", [Device("cam-1", "s", "x86_64", {"ort": "=1"})])
    assert not os.listdir(tmp_path)


# --- CSV validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "row, expected",
    [
        ("cam-1,s,x86_64,,,\n", "line 3: id 'cam-1' repeats line 2"),
        ("../x,s,x86_64,,,\n", "line 3: id '../x' is not a valid device id"),
        ("a b,s,x86_64,,,\n", "line 3: id 'a b' is not a valid device id"),
        ("a/b,s,x86_64,,,\n", "line 3: id 'a/b' is not a valid device id"),
        ("a..b,s,x86_64,,,\n", "line 3: id 'a..b' is not a valid device id"),
        (f"{'a' * 129},s,x86_64,,,\n", "at most 128 characters"),
        (",s,x86_64,,,\n", "line 3: empty id"),
        ("cam-2,,x86_64,,,\n", "line 3: empty sku and device_class (name the device's SKU, its device class"),
        ("cam-2,s,arm64,,,\n", "line 3: arch 'arm64' is not one of x86_64, aarch64 (write 'aarch64')"),
        ("cam-2,s,sparc,,,\n", "line 3: arch 'sparc' is not one of x86_64, aarch64"),
        ("cam-2,s,x86_64,onnxruntime,,\n", "line 3: runtime entry 'onnxruntime' is not name=version"),
        ("cam-2,s,x86_64,onnxruntime=,,\n", "line 3: runtime entry 'onnxruntime=' is not name=version"),
        ("cam-2,s,x86_64,=1.0,,\n", "line 3: runtime entry '=1.0' is not name=version"),
        ("cam-2,s,x86_64,ort=1;ort=2,,\n", "line 3: runtime 'ort=1;ort=2' names a package twice"),
        ("cam-2,s,x86_64,,\n", "line 3: 5 field(s), the header has 6"),
    ],
)
def test_csv_row_problem_names_the_line(tmp_path, row, expected):
    assert expected in problem(write(tmp_path, HEADER + GOOD + row))


def test_a_quoted_field_over_two_lines_keeps_the_line_numbers(tmp_path):
    path = write(tmp_path, HEADER + 'cam-1,s,x86_64,,,"a\nb"\ncam-1,s,x86_64,,,\n')
    assert "line 4: id 'cam-1' repeats line 3" in problem(path)


@pytest.mark.parametrize(
    "header, expected",
    [
        ("id,sku,runtime,ring,labels\n", "line 1: column 'arch' is missing"),
        ("id,sku,arch,runtime,rings,labels\n", "line 1: column 'rings' is unknown (did you mean 'ring'?)"),
        ("id,sku,arch,arch\n", "line 1: column 'arch' appears twice"),
        ("id,arch,ring\n", "line 1: columns 'sku' and 'device_class' are both missing (a device names one of them"),
    ],
)
def test_csv_header_problem(tmp_path, header, expected):
    assert expected in problem(write(tmp_path, header + "cam-1,s,x86_64,x\n"))


def test_empty_csv(tmp_path):
    assert "empty" in problem(write(tmp_path, ""))


def test_every_problem_is_listed_at_once(tmp_path):
    path = write(tmp_path, HEADER + "a b,s,x86_64,,,\n" + GOOD + "cam-2,s,arm,,,\n" + GOOD)
    message = problem(path)
    assert "3 problem(s)" in message
    assert all(f"line {n}:" in message for n in (2, 4, 5))


def test_many_problems_are_cut_short(tmp_path):
    path = write(tmp_path, HEADER + "".join(f"cam-{i},s,mips,,,\n" for i in range(50)))
    message = problem(path)
    assert "50 problem(s)" in message and "... and 30 more" in message
    assert "line 21:" in message and "line 22:" not in message


# --- YAML validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry, expected",
    [
        ("{id: cam-1, sku: s, arch: x86_64}", "devices[1] (id 'cam-1'): id 'cam-1' repeats devices[0]"),
        ("{id: ../x, sku: s, arch: x86_64}", "devices[1] (id '../x'): id '../x' is not a valid device id"),
        ("{id: cam-2, sku: s}", "devices[1] (id 'cam-2'): key 'arch' is missing"),
        ("{id: cam-2, sku: s, arch: x86_64, rings: lab}", "key 'rings' is unknown (did you mean 'ring'?)"),
        ("{id: 0012, sku: s, arch: x86_64}", "devices[1]: id: YAML reads this value as a number (10); quote it"),
        (
            "{id: cam-2, sku: s, arch: x86_64, runtime: {ort: 1.20}}",
            "runtime.ort: YAML reads this value as a number (1.2)",
        ),
        ("{id: cam-2, sku: s, arch: x86_64, runtime: 'ort=1'}", "runtime must be a mapping"),
        ("{id: cam-2, sku: s, arch: x86_64, runtime: {ort: ''}}", "runtime entry 'ort=' is not name=version"),
        ("{id: cam-2, sku: s, arch: x86_64, ring: no}", "ring: YAML reads this value as a boolean (False)"),
        ("{id: cam-2, sku: s, arch: x86_64, labels: lab}", "labels must be a list of text"),
        ("{id: cam-2, sku: s, arch: ppc64le}", "arch 'ppc64le' is not one of x86_64, aarch64"),
        ("cam-2", "devices[1]: expected a mapping"),
        ("{id: cam-2, sku: s, arch: x86_64, key: 12}", "key: YAML reads this value as a number (12)"),
        ("{id: cam-2, sku: s, arch: x86_64, key: 'ed25519:'}", "key 'ed25519:' is not a device key"),
    ],
)
def test_yaml_entry_problem_names_the_index(tmp_path, entry, expected):
    path = write(tmp_path, f"devices:\n  - {{id: cam-1, sku: s, arch: x86_64}}\n  - {entry}\n", "fleet.yaml")
    assert expected in problem(path)


@pytest.mark.parametrize("text", ["[a, b]\n", "devices: {}\n", "devices: [\n", ""])
def test_yaml_without_a_devices_list(tmp_path, text):
    message = problem(write(tmp_path, text, "fleet.yml"))
    assert "devices" in message or "not valid YAML" in message


# --- files ---------------------------------------------------------------------------------------


def test_unknown_suffix(tmp_path):
    assert ".json" in problem(write(tmp_path, "{}", "fleet.json"))


def test_missing_file(tmp_path):
    assert "does not exist" in problem(tmp_path / "nope.csv")


def test_not_utf8(tmp_path):
    path = tmp_path / "fleet.csv"
    path.write_bytes(HEADER.encode() + b"cam-\xff,s,x86_64,,,\n")
    assert "not UTF-8" in problem(path)


def test_check_against_names_unknown_skus(tmp_path):
    registry = parse_registry(
        {
            "defaults": {},
            "examples": {},
            "models": {"conv": models.conv_bn_spec()},
            "skus": {"x86_ort_fp32": models.ort_sku("fp32")},
        }
    )
    path = write_inventory(tmp_path / "fleet.csv", fleet())
    (only,) = load_inventory(path).check_against(registry)
    assert "2 device(s) have SKU 'arm_ort_fp32'" in only and "cam-002, 0012" in only
    assert Inventory(fleet()[:1]).check_against(registry) == []


# --- device classes ----------------------------------------------------------------------------------


def classed_fleet() -> list[Device]:
    return [
        Device("cls-1", None, "x86_64", key=KEY_A, device_class="x86-avx2"),  # the class only
        Device("cls-2", None, "aarch64", {"onnxruntime": "1.32.0"}, "lab", device_class="rpi5"),
        Device("both-1", "x86_ort_fp32", "x86_64", device_class="x86-avx2"),  # SKU and class
        Device("sku-1", "x86_ort_fp32", "x86_64", key=KEY_B),  # the SKU only
    ]


@pytest.mark.parametrize("name", ["fleet.csv", "fleet.yaml"])
def test_devices_may_name_a_class_instead_of_a_sku(tmp_path, name):
    inventory = load_inventory(write_inventory(tmp_path / name, classed_fleet()))
    assert inventory.devices == classed_fleet()
    # keyed by class where a device names one, whatever SKU it also names
    assert inventory.by_class() == {"rpi5": 1, "x86-avx2": 2} and inventory.by_sku() == {"x86_ort_fp32": 1}


def test_a_class_only_csv_needs_no_sku_column(tmp_path):
    path = write(tmp_path, "id,device_class,arch\ncam-1,x86-avx2,x86_64\ncam-2,rpi5,aarch64\n")
    assert load_inventory(path).devices == [
        Device("cam-1", None, "x86_64", device_class="x86-avx2"),
        Device("cam-2", None, "aarch64", device_class="rpi5"),
    ]
    yaml_path = write(tmp_path, "devices:\n  - {id: cam-1, device_class: x86-avx2, arch: x86_64}\n", "fleet.yaml")
    assert load_inventory(yaml_path)["cam-1"] == Device("cam-1", None, "x86_64", device_class="x86-avx2")


@pytest.mark.parametrize(
    "row, expected",
    [
        ("cam-2,,X86 AVX2,x86_64\n", "line 3: device_class 'X86 AVX2' is not a device class name"),
        ("cam-2,,../etc,x86_64\n", "line 3: device_class '../etc' is not a device class name"),
        ("cam-2,,,x86_64\n", "line 3: empty sku and device_class"),
    ],
)
def test_a_bad_class_names_the_line(tmp_path, row, expected):
    message = problem(write(tmp_path, "id,sku,device_class,arch\ncam-1,s,x86-avx2,x86_64\n" + row))
    assert expected in message and "1 problem(s)" in message


def test_check_against_names_classes_no_sku_serves(tmp_path):
    registry = parse_registry(
        {
            "defaults": {},
            "examples": {},
            "models": {"conv": models.conv_bn_spec()},
            "skus": {"x86_ort_fp32": models.ort_sku("fp32", device_class="x86-avx2")},
        }
    )
    assert Inventory(classed_fleet()[2:]).check_against(registry) == []
    (only,) = Inventory(classed_fleet()).check_against(registry)
    assert "1 device(s) have device class 'rpi5', which no SKU of params.yaml serves" in only and "cls-2" in only
