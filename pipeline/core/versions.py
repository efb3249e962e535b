"""One reading of every version string a vendor reports, and the one check of it against a specifier.

The SKU pins its toolchain with PEP 440 specifiers (``>=2026.0,<2027``); the versions checked
against them come from package metadata, from the SDKs themselves (recorded in the manifest) and
from devices. Most are PEP 440 already (ONNX Runtime's ``1.32.0``, TensorRT's ``10.3.0.26`` and
``8.6.1.post1``, TVM's ``0.18.dev0``, IREE's ``3.13.0rc20251120``, torch's ``2.13.0+cpu``, nvcc's
``V12.4.131``); the vendor forms that are not are read here, their build identifiers kept as the
local label, which specifiers without one ignore:

- OpenVINO's ``get_version()``: ``2026.4.1-22982-e213a147257-releases/2026/4`` -> ``2026.4.1+22982.e213a147257``
- nvcc's build line: ``cuda_12.4.r12.4/compiler.34097967_0`` -> ``12.4+34097967.0``

Anything else fails closed: a version that cannot be read satisfies no specifier, and the reason
names the string. Pre-releases are versions like any other here (an installed IREE candidate
satisfies ``==3.13.*``): the question is what is installed, not what a resolver would pick.
"""

from __future__ import annotations

import re

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from pipeline.core.errors import ConfigError, InputError

__all__ = ["UnreadableVersion", "normalize", "same_version", "satisfies", "specifier", "specifier_problem", "unmet"]

# OpenVINO: <release>-<build number>-<commit>[-<branch>]
_OPENVINO = re.compile(r"(?P<release>\d+(?:\.\d+)+)-(?P<build>\d+)-(?P<commit>[0-9a-fA-F]{7,40})(?:-\S+)?")
# nvcc --version: Build cuda_<release>.r<release>/compiler.<build>_<n>
_NVCC = re.compile(r"cuda_(?P<release>\d+(?:\.\d+)+)\.r\d+(?:\.\d+)*/compiler\.(?P<build>\d+)_(?P<n>\d+)")

FORMS = (
    "PEP 440 ('1.32.0', '10.3.0.26', '3.13.0rc20251120', '2.13.0+cpu'), OpenVINO's "
    "'2026.4.1-22982-e213a147257-releases/2026/4' or nvcc's 'cuda_12.4.r12.4/compiler.34097967_0'"
)


class UnreadableVersion(InputError):
    """A version string none of the known forms reads."""

    def __init__(self, version: str):
        super().__init__(
            f"{version!r} is not a version skuforge can read",
            hint=f"versions are read in these forms: {FORMS}; record or report one of them",
        )
        self.version = version


def normalize(version: str) -> Version:
    """``version`` as a PEP 440 version; UnreadableVersion (exit 2) naming it when no form reads it."""
    text = str(version).strip()
    try:
        return Version(text)
    except InvalidVersion:
        pass
    vendor = _OPENVINO.fullmatch(text)
    if vendor:
        return Version(f"{vendor['release']}+{vendor['build']}.{vendor['commit'].lower()}")
    vendor = _NVCC.fullmatch(text)
    if vendor:
        return Version(f"{vendor['release']}+{vendor['build']}.{vendor['n']}")
    raise UnreadableVersion(text)


def specifier_problem(spec: str) -> str | None:
    """Why ``spec`` is not a PEP 440 specifier set, or None."""
    try:
        SpecifierSet(spec)
    except InvalidSpecifier:
        return f"{spec!r} is not a PEP 440 version specifier (e.g. '==1.20.1', '>=1.20,<2' or '==3.13.*')"
    return None


def specifier(spec: str) -> SpecifierSet:
    """``spec`` parsed; ConfigError (exit 2) when it is not a specifier set."""
    problem = specifier_problem(spec)
    if problem:
        raise ConfigError(problem, hint="write the pin as PEP 440 specifiers, comma-separated")
    return SpecifierSet(spec)


def unmet(version: str | None, spec: str) -> str | None:
    """Why ``version`` does not satisfy ``spec`` (None: it does). Fail closed: an absent or
    unreadable version, or an unreadable specifier, is a reason."""
    if version is None:
        return f"no version recorded (needs {spec})"
    problem = specifier_problem(spec)
    if problem:
        return problem
    try:
        have = normalize(version)
    except UnreadableVersion as exc:
        return f"{exc.message}, so it cannot be checked against {spec} (known forms: {FORMS})"
    if SpecifierSet(spec).contains(have, prereleases=True):
        return None
    read_as = "" if str(have) == str(version).strip() else f" (read as {have})"
    return f"{version}{read_as} does not satisfy {spec}"


def satisfies(version: str | None, spec: str) -> bool:
    """``version`` meets the PEP 440 specifier ``spec``; False for anything unreadable or absent."""
    return unmet(version, spec) is None


def same_version(a: str | None, b: str | None) -> bool:
    """The same public version (build labels aside): OpenVINO's ``2026.4.1-22982-…`` is the
    ``2026.4.1`` its package reports. False when either is absent or unreadable."""
    if a is None or b is None:
        return False
    try:
        return Version(normalize(a).public) == Version(normalize(b).public)
    except UnreadableVersion:
        return False
