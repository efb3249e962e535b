"""The SKU side of params.yaml and the project-wide settings: targets, placement and precision gates,
bisection, caches, known upstream gaps, the SKU entry, names, selection, tracking, signing, release
and rollout."""

from __future__ import annotations

import re
from itertools import pairwise
from typing import Any, Literal, get_args

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from pipeline.backends import known_backends
from pipeline.core.kinds import TargetDevice
from pipeline.core.validation import did_you_mean
from pipeline.core.versions import specifier_problem
from pipeline.project.config.base import (
    Precision,
    Strict,
)
from pipeline.project.config.model import (
    BenchOverride,
    MetricGateOverride,
    ToleranceOverride,
)
from pipeline.project.config.preprocessing import (
    PreprocessingGate,
)
from pipeline.results.reports import ReproducibilityLevel
from pipeline.results.signing import parse_public_key


class Target(Strict):
    arch: Literal["x86_64", "aarch64"]
    device: TargetDevice = "cpu"
    os: Literal["linux", "windows", "macos"] = "linux"
    cpu_features: list[str] = Field(default_factory=list, description="e.g. avx2; checked on the host")


class Placement(Strict):
    allowed: list[str] | None = Field(None, description="devices/providers nodes may run on")
    max_fallback_nodes: int = Field(0, ge=0)


class PrecisionGate(Strict):
    """Layers that run in another precision than the SKU asked for (e.g. FP16 asked, FP32 run)."""

    policy: Literal["warn", "fail"] = Field("warn", description="what a mismatch does to the validate stage")
    max_mismatched_layers: int = Field(0, ge=0, description="mismatches tolerated before the policy applies")


class BisectSpec(Strict):
    """Bisection to the first divergent layer when validate fails, and its remedy."""

    on_failure: bool = Field(
        True, description="bisect when validate fails a correctness gate (result in validate.json)"
    )
    max_builds: int = Field(12, ge=1, le=200, description="engine builds one bisection may take")
    marks_per_build: int = Field(3, ge=1, le=64, description="intermediate tensors marked as outputs per build")
    fix_during_build: bool = Field(
        False,
        description="build: when the engine fails the gate, bisect and keep the "
        "suspects in higher precision until it passes",
    )
    max_fix_rounds: int = Field(4, ge=1, le=20, description="rebuild-and-revalidate rounds of the remedy")


class ReproducibilitySpec(Strict):
    """Build the engine a second time and compare it with the first (the build report's verdict)."""

    check: bool = Field(False, description="check on every build (skuforge build --check-reproducible checks once)")
    require: ReproducibilityLevel = Field(
        "none", description="the least verdict a build must reach, else it exits 1 (anything but none implies check)"
    )


class CacheSpec(Strict):
    """The SKU's checked-in compiler cache (TVM tuning database, TensorRT timing cache)."""

    require: bool = Field(
        False,
        description="fail the build on any cache miss (a stale, corrupt or missing cache, "
        "a tuning task not in the database): release builds replay the "
        "checked-in decisions; SKUFORGE_REQUIRE_CACHE=1 sets it for every SKU",
    )


GAP_REF_RULE = "owner/repo#N (a GitHub issue or pull request) or an https://github.com/ address"
GAP_REF_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,38}/[A-Za-z0-9._-]{1,100}#[1-9][0-9]{0,9}")
GAP_URL_PATTERN = re.compile(
    r"https://github\.com/[A-Za-z0-9][A-Za-z0-9-]{0,38}/[A-Za-z0-9._-]{1,100}(/[A-Za-z0-9._~/-]*)?(#[A-Za-z0-9_-]*)?"
)
MAX_GAP_SAYS = 199


class KnownGap(Strict):
    """A shortfall of the SKU's stack that is known upstream (``skus.<s>.known_gaps``): shown next to
    the SKU in the matrix, the selection and the report so a slow engine is explained, never judged.
    Both fields are untrusted text: checked here, escaped where rendered."""

    ref: str = Field(description=f"where upstream tracks it: {GAP_REF_RULE}")
    says: str = Field(description=f"what the gap is, one printable line of at most {MAX_GAP_SAYS} characters")

    @field_validator("ref")
    @classmethod
    def _ref(cls, ref: str) -> str:
        if len(ref) > 300 or not (GAP_REF_PATTERN.fullmatch(ref) or GAP_URL_PATTERN.fullmatch(ref)):
            raise ValueError(f"{ref[:80]!r} is not {GAP_REF_RULE}, e.g. 'iree-org/iree#22674'")
        return ref

    @field_validator("says")
    @classmethod
    def _says(cls, says: str) -> str:
        if not says.strip():
            raise ValueError("is empty: say what the gap is in one line")
        if not says.isprintable():
            bad = sorted({repr(c) for c in says if not c.isprintable()})
            raise ValueError(f"holds control characters ({', '.join(bad)}): one printable line, no line breaks")
        if len(says) > MAX_GAP_SAYS:
            raise ValueError(f"is {len(says)} characters long: at most {MAX_GAP_SAYS}; link the details in 'ref'")
        return says

    @property
    def url(self) -> str:
        """The web address of ``ref`` (``owner/repo#N`` -> its issue page, which GitHub redirects
        to the pull request when N is one)."""
        if self.ref.startswith("https://"):
            return self.ref
        repo, _, number = self.ref.partition("#")
        return f"https://github.com/{repo}/issues/{number}"

    @property
    def line(self) -> str:
        return f"{self.ref}: {self.says}"


class Profile(Strict):
    min: int = Field(ge=1)
    opt: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> Profile:
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"need min <= opt <= max, got {self.min}, {self.opt}, {self.max}")
        return self


class SkuSpec(Strict):
    backend: str
    precision: Precision
    target: Target
    runner_labels: list[str] = Field(min_length=1)
    toolchain: dict[str, str] = Field(
        default_factory=dict, description="package -> PEP 440 specifier the host must satisfy"
    )
    shapes: dict[str, int] = Field(default_factory=dict, description="pins for dynamic axes")
    profiles: dict[str, Profile] = Field(default_factory=dict, description="dynamic axis ranges")
    options: dict[str, Any] = Field(default_factory=dict, description="backend options")
    placement: Placement = Placement()
    precision_gate: PrecisionGate = PrecisionGate()
    tolerance: ToleranceOverride = ToleranceOverride()
    metric: MetricGateOverride = MetricGateOverride()
    bench: BenchOverride = BenchOverride()
    preprocessing: PreprocessingGate = PreprocessingGate()
    max_seconds: float | None = Field(
        3600.0,
        gt=0,
        description="wall-clock budget of each of validate and bench for this SKU: past it the stage "
        "fails its gate as timed out (exit 1), even inside one engine call; null: no budget",
    )
    bisect: BisectSpec = BisectSpec()
    reproducibility: ReproducibilitySpec = ReproducibilitySpec()
    cache: CacheSpec = CacheSpec()
    device_class: str | None = Field(
        None,
        description="the devices this SKU's engine serves (x86-avx2, rpi5, jetson-orin, ...): the SKUs of one class "
        "are candidates for the same devices, and `skuforge select` picks one per model (docs/registry.md); "
        "unset: no class, not a candidate (the portable fallback)",
    )
    known_gaps: list[KnownGap] = Field(
        default_factory=list,
        max_length=8,
        description="shortfalls of the stack known upstream ([{ref: owner/repo#N, says: one line}]): shown in the "
        "matrix, the selection and the report; they change no verdict and rebuild nothing (docs/registry.md)",
    )
    ci: bool = Field(
        True,
        description="false: the rendered build workflow has no job for this SKU (its runners are not in "
        "CI yet, or it is built by hand); `skuforge repro` still builds it where the host can (docs/ci.md)",
    )
    description: str = ""

    @model_validator(mode="after")
    def _shapes(self) -> SkuSpec:
        both = set(self.shapes) & set(self.profiles)
        if both:
            raise ValueError(f"axes {sorted(both)} are in both 'shapes' and 'profiles': pick one")
        return self

    @field_validator("device_class")
    @classmethod
    def _device_class(cls, name: str | None) -> str | None:
        problem = None if name is None else device_class_problem(name)
        if problem:
            raise ValueError(problem)
        return name

    @field_validator("toolchain")
    @classmethod
    def _toolchain(cls, toolchain: dict[str, str]) -> dict[str, str]:
        for package, spec in toolchain.items():
            if not PACKAGE_PATTERN.match(package):
                raise ValueError(
                    f"{package!r} is not a package name (PEP 508: letters, digits, '.', '_', '-'; "
                    "a letter or digit at both ends)"
                )
            problem = specifier_problem(spec)
            if problem:
                raise ValueError(f"{package}: {problem}")
        return toolchain


class Example(Strict):
    """An example model trained from code by the export stage."""

    dir: str
    seed: int = 0
    epochs: int | None = None
    opset: int = 17


ALIAS_PATTERN = re.compile(r"^[A-Za-z0-9_-]+$")
NAME_FORBIDDEN = ("/", ":", "'", '"', "`")  # MLflow refuses '/' and ':'; quotes would break its filter strings
# Model, SKU and example names become shell words (dvc.yaml), paths, workflow values and MLflow
# names: one strict rule keeps them inert everywhere and keeps '<model>-<sku>' unambiguous.
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,63}")
NAME_RULE = "a lowercase letter, then lowercase letters, digits or '_', at most 64 characters"
# A device class is a key of the selection record and a CLI argument, never a path or a shell word
# on its own; '-' is allowed as in runner labels (x86-avx2).
DEVICE_CLASS_PATTERN = re.compile(r"[a-z][a-z0-9_-]{0,62}[a-z0-9]|[a-z]")
DEVICE_CLASS_RULE = (
    "a lowercase letter, then lowercase letters, digits, '-' or '_', ending in a letter or digit, at most 64 characters"
)
PREFIX_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
PACKAGE_PATTERN = re.compile(r"^([A-Z0-9]|[A-Z0-9][A-Z0-9._-]*[A-Z0-9])$", re.IGNORECASE)
RESERVED_MODEL_NAMES = (
    "config",
    "ci",
    "report",
)  # build/config, build/ci and build/report: resolved config, CI locks, the HTML report


def suggest_name(name: str) -> str:
    """A valid spelling of ``name``: lower-cased, each run of other characters replaced by one '_'."""
    fixed = re.sub(r"[^a-z0-9_]+", "_", str(name).lower()).strip("_")
    fixed = fixed if "a" <= fixed[:1] <= "z" else f"n_{fixed}".rstrip("_")
    return fixed[:64].rstrip("_")


def name_problem(name: Any) -> str | None:
    """Why ``name`` cannot name a model, SKU or example, with a valid spelling; None when it can."""
    if not isinstance(name, str):
        return f"is not a string ({type(name).__name__}); quote it or use e.g. {suggest_name(name)!r}"
    if NAME_PATTERN.fullmatch(name):
        return None
    bad = sorted({c for c in name if not ("a" <= c <= "z" or "0" <= c <= "9" or c == "_")})
    what = [f"is {len(name)} characters long"] if len(name) > 64 else []
    what += ["is empty"] if not name else [] if "a" <= name[0] <= "z" else ["does not start with a lowercase letter"]
    what += [f"contains {' '.join(repr(c) for c in bad)}"] if bad else []
    return f"{', '.join(what)}: names are {NAME_RULE}; use e.g. {suggest_name(name)!r}"


def device_class_problem(name: Any) -> str | None:
    """Why ``name`` cannot name a device class, with a valid spelling; None when it can."""
    if isinstance(name, str) and DEVICE_CLASS_PATTERN.fullmatch(name):
        return None
    fixed = re.sub(r"[^a-z0-9_-]+", "-", str(name).lower()).strip("-_")[:64].rstrip("-_")
    fixed = fixed if "a" <= fixed[:1] <= "z" else f"c-{fixed}".rstrip("-")
    return f"{name!r} is not a device class name: {DEVICE_CLASS_RULE}; use e.g. {fixed!r}"


Objective = Literal["p50", "p99", "throughput"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)
DEFAULT_PREFERENCE = ("onnxruntime", "openvino", "litert", "iree", "tvm", "tensorrt")


class SelectionSpec(Strict):
    """How `skuforge select` picks one engine per (model, device class) among the passing candidates."""

    objective: Objective = Field(
        "p50",
        description="p50 or p99: engine-only latency from the bench's steady-state samples (lower wins); "
        "throughput: samples per second (higher wins)",
    )
    confidence: float = Field(
        0.95, gt=0, lt=1, description="level of the interval of the runner-up's figure over the winner's"
    )
    bootstrap: int = Field(2000, ge=100, description="bootstrap resamples of that interval")
    min_samples: int = Field(30, ge=5, description="fewer steady-state samples on either side: not separated")
    prefer: list[str] = Field(
        default_factory=lambda: list(DEFAULT_PREFERENCE),
        description="backends in order of preference: breaks a tie (candidates not separated from the fastest); "
        "a backend not listed comes after those listed",
    )

    @field_validator("prefer")
    @classmethod
    def _prefer(cls, prefer: list[str]) -> list[str]:
        repeated = sorted({b for b in prefer if prefer.count(b) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} listed more than once; list each backend once")
        unknown = [b for b in prefer if b not in known_backends()]
        if unknown:
            raise ValueError(
                f"unknown backend {unknown[0]!r}{did_you_mean(unknown[0], known_backends())}; "
                f"known backends: {', '.join(known_backends())}"
            )
        return prefer


class PerformanceGate(Strict):
    """Promotion gate on latency: the candidate's steady-state samples against the alias holder's."""

    max_regression: float = Field(0.05, ge=0, description="allowed growth of the median latency (0.05 = 5%)")
    alpha: float = Field(0.05, gt=0, lt=1, description="significance level of the one-sided Mann-Whitney U test")
    confidence: float = Field(0.95, gt=0, lt=1, description="level of the bootstrap interval of the median ratio")
    bootstrap: int = Field(2000, ge=100, description="bootstrap resamples")
    min_samples: int = Field(30, ge=5, description="fewer samples on either side: too noisy to decide")
    on_noisy: Literal["block", "allow"] = Field("block", description="what 'too noisy to decide' does to a promotion")


class TrackingSpec(Strict):
    """How MLflow calls are retried: exponential backoff on connection errors, 5xx and a locked database;
    a server that is down or does not answer fails each call within ``deadline_seconds``."""

    retries: int = Field(4, ge=0, description="retries after the first attempt")
    backoff_seconds: float = Field(0.5, ge=0, description="first wait; doubles each retry")
    max_backoff_seconds: float = Field(8.0, ge=0)
    timeout_seconds: float = Field(
        5.0, gt=0, description="to connect and to read each HTTP answer (MLFLOW_HTTP_REQUEST_TIMEOUT wins)"
    )
    deadline_seconds: float = Field(
        10.0,
        gt=0,
        description="no retry of an unreachable or silent server starts "
        "that could not end this long after the call began",
    )


class SigningSpec(Strict):
    """Who may publish what reaches each alias (pipeline/results/signing.py verifies).

    ``trust.<alias>`` lists key names, or ``"*"``: any signature that verifies, whoever signed
    (integrity only: the manifest was not altered after it was signed). An alias missing from
    ``trust`` refuses every version, unless ``trust`` is empty as a whole (an unconfigured project:
    every alias accepts ``"*"``).
    """

    keys: dict[str, str] = Field(
        default_factory=dict, description="name -> public key 'ed25519:<base64>' (`skuforge keys show` prints it)"
    )
    trust: dict[str, list[str]] = Field(default_factory=dict, description="alias -> key names, or '*' for any signer")

    @field_validator("keys")
    @classmethod
    def _keys(cls, keys: dict[str, str]) -> dict[str, str]:

        for name, text in keys.items():
            if not ALIAS_PATTERN.match(name):
                raise ValueError(f"keys: {name!r} is not a key name (letters, digits, _ and - only)")
            try:
                parse_public_key(text)
            except ValueError as exc:
                raise ValueError(f"keys.{name}: {exc}") from None
        return keys

    @model_validator(mode="after")
    def _names(self) -> SigningSpec:
        for alias, names in self.trust.items():
            if not names:
                raise ValueError(f"trust.{alias}: an empty list trusts no key; list key names or '*'")
            for name in names:
                if name != "*" and name not in self.keys:
                    raise ValueError(
                        f"trust.{alias}: unknown key {name!r}{did_you_mean(name, self.keys)}; "
                        f"known keys: {', '.join(sorted(self.keys)) or '(none: add release.signing.keys)'}"
                    )
        return self


class Release(Strict):
    """MLflow: experiment and registered-model names, the alias chain, promotion gates."""

    name_prefix: str = Field(
        "", description="prepended to the experiment '<model>' and registered model '<model>.<sku>'"
    )
    aliases: list[str] = Field(
        default_factory=lambda: ["candidate", "staging", "production"],
        min_length=1,
        description="the promotion chain, first to last",
    )
    reason_required: list[str] = Field(
        default_factory=lambda: ["production"], description="aliases whose moves need --reason"
    )
    skus: list[str] | None = Field(None, description="SKUs a release (promote --all) requires; default: every SKU")
    history: int = Field(50, ge=1, description="alias moves kept per alias (rollback reads them)")
    performance: PerformanceGate = PerformanceGate()
    tracking: TrackingSpec = TrackingSpec()
    signing: SigningSpec = SigningSpec()

    @field_validator("name_prefix")
    @classmethod
    def _prefix(cls, prefix: str) -> str:
        bad = [c for c in NAME_FORBIDDEN if c in prefix]
        if bad:
            raise ValueError(f"may not contain {' '.join(bad)} (MLflow names)")
        if prefix and not PREFIX_PATTERN.fullmatch(prefix):
            raise ValueError(
                f"{prefix!r}: a prefix is empty or a letter or digit, then letters, digits, "
                "'_', '.' or '-', at most 64 characters (e.g. 'team-')"
            )
        return prefix

    @model_validator(mode="after")
    def _chain(self) -> Release:
        for alias in self.aliases:
            if not ALIAS_PATTERN.match(alias):
                raise ValueError(f"aliases: {alias!r} is not a valid MLflow alias (letters, digits, _ and - only)")
            if alias.lower() == "latest" or re.fullmatch(r"[vV]\d+", alias):
                raise ValueError(f"aliases: {alias!r} is reserved by MLflow ('latest' and v<number>)")
        if len(set(self.aliases)) != len(self.aliases):
            raise ValueError(f"aliases repeat: {self.aliases}")
        unknown = [a for a in self.reason_required if a not in self.aliases]
        if unknown:
            raise ValueError(f"reason_required: {unknown} not in aliases {self.aliases}")
        unknown = [a for a in self.signing.trust if a not in self.aliases]
        if unknown:
            raise ValueError(f"signing.trust: {unknown} not in aliases {self.aliases}")
        return self


class Wave(Strict):
    """One step of a rollout: a share of the fleet (by a stable hash of the device id) or named rings."""

    name: str = Field(description="shown in status and logs, e.g. canary")
    percent: float | None = Field(None, gt=0, le=100, description="cumulative share of each SKU's devices")
    rings: list[str] | None = Field(
        None, min_length=1, description="devices whose ring is listed (cumulative with earlier waves)"
    )
    bake_minutes: float = Field(60, ge=0, description="how long the wave runs before the next may start")
    timeout_minutes: float | None = Field(
        None,
        gt=0,
        description="in-progress time-out: a device of the wave with no report this long after the wave "
        "started counts as timed out (default: rollout.timeout_minutes)",
    )

    @model_validator(mode="after")
    def _one(self) -> Wave:
        if (self.percent is None) == (self.rings is None):
            raise ValueError(f"wave {self.name!r}: give exactly one of percent or rings")
        if not ALIAS_PATTERN.match(self.name):
            raise ValueError(f"wave {self.name!r}: letters, digits, _ and - only")
        return self


class HealthGates(Strict):
    """When a wave is healthy enough to go on; any failed gate aborts the rollout and rolls it back."""

    min_reports: int = Field(20, ge=1, description="device reports a wave needs before it can pass (fewer: wait)")
    max_failure_rate: float = Field(
        0.02, ge=0, le=1, description="failed reports / reports: smoke-test, verification and other errors"
    )
    max_fallback_rate: float = Field(
        0.05,
        ge=0,
        le=1,
        description="reports of devices that could not run their SKU's "
        "engine (runtime, architecture) and took the portable one",
    )
    max_smoke_failures: int = Field(0, ge=0, description="devices whose smoke test failed on the new engine")
    max_latency_regression: float = Field(
        0.10, ge=0, description="median of (new / previous engine latency) - 1 over devices that ran both"
    )
    max_timeout_rate: float = Field(
        0.5,
        ge=0,
        le=1,
        description="after a wave's time-out: devices of the wave that never reported / devices of the wave",
    )


class Expiry(Strict):
    """Lifetimes of the signed TUF metadata; a device refuses metadata past its expiry (freeze attack)."""

    root_days: float = Field(365, gt=0)
    targets_days: float = Field(90, gt=0)
    snapshot_days: float = Field(90, gt=0)
    timestamp_days: float = Field(
        1, gt=0, description="`skuforge rollout advance` (scheduled) re-signs it at half life"
    )


class RolloutSpec(Strict):
    """Shipping engines to devices: the release store, waves, health gates (docs/rollout.md)."""

    store: str = Field(
        "build/release-store",
        description="a folder (relative to params.yaml) or s3://bucket/prefix; SKUFORGE_STORE overrides it",
    )
    fallback_sku: str | None = Field(None, description="the portable ONNX Runtime CPU FP32 SKU every release carries")
    waves: list[Wave] = Field(
        default_factory=lambda: [
            Wave(name="canary", percent=1, bake_minutes=60),
            Wave(name="early", percent=10, bake_minutes=240),
            Wave(name="half", percent=50, bake_minutes=720),
            Wave(name="all", percent=100, bake_minutes=0),
        ],
        min_length=1,
    )
    gates: HealthGates = HealthGates()
    expiry: Expiry = Expiry()
    inventory: str | None = Field(
        None,
        description="the fleet inventory (CSV or YAML, relative to params.yaml) with each device's public key: "
        "the controller counts only reports signed by a device of the current wave; --inventory overrides it",
    )
    timeout_minutes: float | None = Field(
        1440, gt=0, description="default in-progress time-out of a wave (null: wait for reports forever)"
    )
    max_per_minute: float | None = Field(
        None, gt=0, description="rate limit: devices a wave admits per minute (null: all of it at once)"
    )
    max_attempts: int = Field(
        3, ge=1, description="installs a device tries per rollout before it stops retrying (failed or reverted)"
    )
    health_window_minutes: float = Field(
        30,
        ge=0,
        description="after activation the device re-checks the new engine for this long and reverts to the "
        "previous slot by itself when it fails (0: off)",
    )

    @model_validator(mode="after")
    def _waves(self) -> RolloutSpec:
        names = [w.name for w in self.waves]
        if len(set(names)) != len(names):
            raise ValueError(f"waves: names repeat: {names}")
        shares = [w.percent for w in self.waves if w.percent is not None]
        if any(b < a for a, b in pairwise(shares)):
            raise ValueError(f"waves: percentages are cumulative and may not shrink: {shares}")
        return self
