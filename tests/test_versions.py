"""Every vendor's version string read one way (pipeline.core.versions), and the verdicts of the checks
that use it: the promotion gate, the runner's toolchain check, the rollout agent, TensorRT's
version-compatible engines."""

from __future__ import annotations

import pytest

from pipeline.core.errors import ConfigError, InputError
from pipeline.core.versions import (
    UnreadableVersion,
    normalize,
    same_version,
    satisfies,
    specifier,
    unmet,
)

OPENVINO = "2026.4.1-22982-e213a147257-releases/2026/4"
NVCC = "cuda_12.4.r12.4/compiler.34097967_0"

# what each vendor reports -> the version it is read as
READ_AS = [
    (OPENVINO, "2026.4.1+22982.e213a147257"),  # OpenVINO's get_version(): build and commit kept as the local label
    ("2024.5.0-16993-9c432a3641a", "2024.5.0+16993.9c432a3641a"),  # a build from a branch-less tree
    ("2026.4.1", "2026.4.1"),  # the openvino package's metadata
    ("10.3.0.26", "10.3.0.26"),  # TensorRT's __version__ (a tar install names the build)
    ("8.6.1.post1", "8.6.1.post1"),  # the TensorRT 8 wheel
    ("12.4", "12.4"),  # CUDA runtime (cudaRuntimeGetVersion)
    ("V12.4.131", "12.4.131"),  # nvcc's release line
    (NVCC, "12.4+34097967.0"),  # nvcc's build line
    ("0.27.0.post1", "0.27.0.post1"),  # TVM release
    ("0.18.dev0", "0.18.dev0"),  # TVM nightly
    ("1.32.0", "1.32.0"),  # ONNX Runtime
    ("3.13.0rc20251120", "3.13.0rc20251120"),  # IREE candidate
    ("3.13.0.dev", "3.13.0.dev0"),  # IREE from source
    ("2.13.0+cpu", "2.13.0+cpu"),  # a local version (torch's CPU build)
    (" 1.32.0\n", "1.32.0"),  # read from a command's output
]


@pytest.mark.parametrize("text, expected", READ_AS, ids=[t for t, _ in READ_AS])
def test_vendor_versions_are_read_as_pep_440(text, expected):
    assert str(normalize(text)) == expected


# version, specifier, verdict
VERDICTS = [
    (OPENVINO, ">=2026.0,<2027", True),  # the promotion gate used to refuse every OpenVINO engine here
    (OPENVINO, "==2026.4.1", True),  # a specifier without a local label ignores the build
    (OPENVINO, "==2026.4.*", True),
    (OPENVINO, ">=2027", False),
    (OPENVINO, ">2026.4.1", False),  # the same release, not a later one
    ("10.3.0.26", ">=10.0,<11", True),
    ("10.3.0.26", "==10.3.*", True),
    ("10.3.0.26", "==10.3.0", False),  # PEP 440: the fourth number is part of the version
    ("8.6.1.post1", ">=8.6,<9", True),
    ("8.6.1.post1", ">=10.0,<11", False),
    ("12.4", ">=12.0,<13", True),
    ("V12.4.131", "==12.4.*", True),
    (NVCC, "==12.4.*", True),
    (NVCC, ">=12.6", False),
    ("0.27.0.post1", "==0.27.0.post1", True),
    ("0.27.0.post1", "==0.27.0", False),  # a post release is not the release
    ("0.18.dev0", ">=0.18.dev0,<0.19", True),
    ("0.18.dev0", ">=0.18", False),  # a dev build comes before its release
    ("1.32.0", "==1.32.0", True),
    ("1.32.0", "<1.0", False),
    ("3.13.0rc20251120", "==3.13.*", True),  # installed pre-releases are versions like any other
    ("3.13.0rc20251120", ">=3.13", False),
    ("3.13.0.dev", "==3.13.*", True),
    ("2.13.0+cpu", "==2.13.0", True),
    ("2.13.0+cpu", "==2.13.0+cu124", False),
    ("garbage", ">=0", False),  # unreadable: fails closed
    ("unknown", "==12.4.*", False),  # what a backend records when the host does not say
    (None, ">=0", False),  # not recorded: fails closed
    ("1.32.0", "one point twenty", False),  # an unreadable specifier: fails closed
]


@pytest.mark.parametrize("version, spec, verdict", VERDICTS, ids=[f"{v} {s}" for v, s, _ in VERDICTS])
def test_specifier_verdicts(version, spec, verdict):
    assert satisfies(version, spec) is verdict
    assert (unmet(version, spec) is None) is verdict


def test_an_unreadable_version_fails_closed_naming_the_string():
    with pytest.raises(UnreadableVersion) as info:
        normalize("2026.4.1 (custom build)")
    assert isinstance(info.value, InputError) and info.value.exit_code == 2
    assert "'2026.4.1 (custom build)' is not a version skuforge can read" in info.value.message
    assert "OpenVINO" in info.value.hint
    why = unmet("custom_master_deadbeef", ">=2026.0,<2027")
    assert why is not None and "'custom_master_deadbeef'" in why and ">=2026.0,<2027" in why


def test_unmet_says_why():
    assert unmet(OPENVINO, ">=2027") == f"{OPENVINO} (read as 2026.4.1+22982.e213a147257) does not satisfy >=2027"
    assert unmet("1.32.0", "<1.0") == "1.32.0 does not satisfy <1.0"
    assert unmet(None, ">=1") == "no version recorded (needs >=1)"
    assert "'one point twenty' is not a PEP 440 version specifier" in unmet("1.32.0", "one point twenty")


def test_a_bad_specifier_is_a_config_error():
    assert str(specifier(">=2026.0,<2027")) in (">=2026.0,<2027", "<2027,>=2026.0")
    with pytest.raises(ConfigError, match="'1.20' is not a PEP 440 version specifier"):
        specifier("1.20")


@pytest.mark.parametrize(
    "a, b, same",
    [
        (OPENVINO, "2026.4.1", True),
        ("10.3", "10.3.0", True),
        ("2.13.0+cpu", "2.13.0", True),
        ("2026.4.1", "2026.3.0", False),
        ("3.13.0rc20251120", "3.13.0", False),
        ("garbage", "garbage", False),
        (None, None, False),
        ("1.32.0", None, False),
    ],
)
def test_same_version(a, b, same):
    assert same_version(a, b) is same


def test_every_check_reads_versions_the_same_way():
    """The runner's toolchain check, the rollout agent and TensorRT read an OpenVINO- or nvcc-style
    string as the gate does (one implementation: no check keeps its own parse)."""
    from pipeline.backends.tensorrt import version_compatible_runtime
    from pipeline.rollout.agent import Device, compatibility

    dev = Device(id="d", sku="ov", arch="x86_64", runtime={"openvino": OPENVINO}, cpu_features=frozenset())
    assert compatibility({"specifiers": {"openvino": ">=2026.0,<2027"}, "exact": {"openvino": "2026.4.1"}}, dev) == []
    garbled = Device(id="d", sku="ov", arch="x86_64", runtime={"openvino": "garbage"}, cpu_features=frozenset())
    assert compatibility({"specifiers": {"openvino": ">=2026.0,<2027"}}, garbled) == [
        "needs openvino >=2026.0,<2027, the device has garbage"
    ]
    assert version_compatible_runtime("10.3.0", "10.7.0.23") and not version_compatible_runtime("garbage", "10.3.0")
