"""The backend contract: what every backend declares (``Capabilities``), what a build receives and
returns (``BuildContext``, ``BuildOutcome``), the engine's typed metadata (``EngineMeta``) and the
loaded engine (``Runner``, which checks every input before a backend sees it). The base class that
owns the build preamble is base.py; the table of backends is __init__.py."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.core.errors import InputError
from pipeline.core.io import read_json, sha256_file
from pipeline.core.kinds import Precision, TargetDevice
from pipeline.results.reports import LayerInfo, TensorSig

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from pipeline.backends.caches import CacheSession
    from pipeline.project.config import ModelSpec, Profile, SkuSpec

ENGINE_META = "engine.json"

CacheKind = Literal["tuning-database", "timing-cache"]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared once: the registry checks SKUs against it, ``skuforge
    backends`` and docs/backends.md list it, the rollout agent reads ``runtime_package``."""

    precisions: tuple[Precision, ...]
    devices: tuple[TargetDevice, ...]  # target.device values it builds for
    runtime_package: str  # the distribution a device needs to run the engines (the agent's inventory)
    per_node_precision: bool = False  # keeps named nodes in higher precision (remedy, higher_precision)
    intermediate_outputs: bool = True  # builds with intermediate tensors marked as outputs (bisection)
    cache: CacheKind | None = None  # what it keeps under caches/<sku>/<model>/
    # INT8 from the calibrate stage's range table (QDQ), or from the calibration samples themselves
    calibration: Literal["table", "samples"] = "table"

    def to_json(self) -> dict[str, Any]:
        return {
            "precisions": list(self.precisions),
            "devices": list(self.devices),
            "per_node_precision": self.per_node_precision,
            "intermediate_outputs": self.intermediate_outputs,
            "cache": self.cache,
            "calibration": self.calibration,
            "runtime_package": self.runtime_package,
        }


class EngineMeta(BaseModel):
    """engine.json: what loads and identifies an engine. The base fields are written by
    ``Backend.write_meta``; each backend subclasses it with what its loader needs."""

    model_config = ConfigDict(extra="forbid")

    format: str = ""
    backend: str = ""
    versions: dict[str, str] = Field(default_factory=dict)
    files: list[dict[str, Any]] = Field(default_factory=list)
    model: str | None = None
    sku: str | None = None
    keep_precise: list[str] = Field(default_factory=list)
    # standard ops only: any runtime of the backend runs it, so loading does not insist on the version
    portable: bool = False
    host_cpu: dict[str, Any] | None = None  # the CPU the engine was built on (a record for people)
    cache: dict[str, Any] | None = None  # the cache the build used (pipeline.backends.caches.CacheSession.record)


@dataclass(frozen=True)
class BuildContext:
    model: str
    sku: str
    spec: ModelSpec
    sku_spec: SkuSpec
    prepared: Path
    pins: dict[str, int]  # axes to fix in the engine
    profiles: dict[str, Profile]  # axes the engine keeps dynamic within {min, opt, max}
    engine_dir: Path
    calibration_table: Path | None
    probe_inputs: dict[str, np.ndarray]
    cache_dir: Path
    progress: Callable[[str, float], None] | None = None
    # ONNX node names (of the prepared model) kept in higher precision than the SKU's: excluded from
    # INT8 quantization, kept FP32 in an FP16 engine (a bisection remedy, or params.yaml's override)
    keep_precise: tuple[str, ...] = ()
    # the cache policy (pipeline.backends.caches): None: the SKU's cache.require or SKUFORGE_REQUIRE_CACHE decides
    cache_required: bool | None = None
    cache_refresh: bool = False  # ignore the cache and rebuild it (skuforge cache refresh)
    tuning_trials: int | None = None  # a tuning backend's trial budget instead of the SKU's
    search: bool = True  # False: what the cache lacks gets the compiler's default, nothing is searched (scratch builds)
    # INT8: the calibration set's batches as the engine takes them (preprocessed, axes pinned), for a
    # backend that calibrates itself (LiteRT) instead of reading the calibrate stage's table
    calibration_batches: list[dict[str, np.ndarray]] | None = None


@dataclass
class BuildOutcome:
    """What a backend reports about the engine it wrote into ``ctx.engine_dir``."""

    files: list[str]
    layers: list[LayerInfo]
    requested_devices: list[str]
    partition_boundaries: int
    options: dict[str, Any]
    calibration: dict[str, Any] | None = None
    hardware_specific: bool = False
    warnings: list[str] = field(default_factory=list)
    meta: EngineMeta = field(default_factory=EngineMeta)
    # the cache session, decided but not written: the caller commits it once the engine is in place
    cache: CacheSession | None = None


@dataclass
class Staged:
    """The model a backend compiles, in a staging folder the base class removes after the build:
    axes pinned, adapted by the backend's ``_adapt``, converted to the SKU's precision. ``source``
    is the ONNX file to compile; ``model`` is its graph (weights included unless reloaded)."""

    work: Path
    model: onnx.ModelProto
    source: Path
    options: Any  # the backend's typed options (INT8 may decide reduce_range for the target)
    calibration: dict[str, Any] | None = None
    cache: CacheSession | None = None
    warnings: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)  # what _adapt found, for _build_impl

    def replace(self, path: Path) -> None:
        """``path`` (in the staging folder) is now the model to compile."""
        import onnx

        self.source = path
        self.model = onnx.load(str(path))


class Runner(abc.ABC):
    """A loaded engine. ``infer`` checks its inputs, then calls ``_infer_impl``."""

    engine_sha256: str | None = None  # set by Backend.load from the verified engine files
    # set when the engine runs under QEMU user-mode emulation (Backend.load_emulated): the emulator,
    # the emulated CPU and the aarch64 environment, for the validation report
    emulation: dict[str, Any] | None = None

    def __init__(self, inputs: list[TensorSig], outputs: list[str]):
        self.inputs = inputs
        self.output_names = outputs

    @property
    def inputs(self) -> list[TensorSig]:
        return self._inputs

    @inputs.setter
    def inputs(self, sigs: list[TensorSig]) -> None:
        import numpy as np

        self._inputs = sigs
        # per input, the dtype and static shape a feed matches in two comparisons; anything else
        # takes the full check (its messages). Checking from the signature on every call cost
        # ~7 us, the bench stage's whole overhead budget.
        self._expected: list[tuple[TensorSig, Any, tuple[int, ...] | None]] = []
        for sig in sigs:
            try:
                dtype = np.dtype(sig.dtype)
            except TypeError:  # a type numpy does not know: always the full check
                dtype = None
            if dtype is not None and dtype.name != sig.dtype:  # an alias ("float"): the full check decides
                dtype = None
            fixed = [d for d in sig.shape if isinstance(d, int)]
            static = tuple(fixed) if len(fixed) == len(sig.shape) else None
            self._expected.append((sig, dtype, static))

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for sig, dtype, shape in self._expected:
            arr = feeds.get(sig.name)
            if arr is None or arr.dtype != dtype or arr.shape != shape:
                self._check_input(sig, feeds)
        return self._infer_impl(feeds)

    @staticmethod
    def _check_input(sig: TensorSig, feeds: dict[str, np.ndarray]) -> None:
        import numpy as np

        if sig.name not in feeds:
            raise InputError(f"engine input {sig.name!r} was not given (given: {sorted(feeds)})")
        arr = feeds[sig.name]
        if np.dtype(arr.dtype).name != sig.dtype:
            raise InputError(f"engine input {sig.name!r} must be {sig.dtype}, got {arr.dtype}")
        want = [d if isinstance(d, int) else None for d in sig.shape]
        if len(arr.shape) != len(want) or any(w is not None and w != g for w, g in zip(want, arr.shape, strict=True)):
            raise InputError(f"engine input {sig.name!r} must have shape {sig.shape}, got {list(arr.shape)}")

    @abc.abstractmethod
    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def profile_layers(self, feeds: dict[str, np.ndarray], iterations: int = 20) -> dict[str, float] | None:
        """Milliseconds per engine layer, the median of ``iterations`` runs on ``feeds`` after a warm-up,
        keyed by the names of build.json ``layers`` (pipeline.perf.roofline joins them to ONNX nodes);
        None where the backend cannot time its layers. The default cannot."""
        return None

    def close(self) -> None:  # noqa: B027  (an optional hook, not abstract: most runners hold nothing to release)
        """Release the engine; the default has nothing to release."""

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def median_per_run(times: list[float], runs: int, skip: int = 0) -> float:
    """The median over runs of a layer's time per run, from its times in run order (a layer that
    runs k times per run, inside a loop, has k per run: they are summed); the first ``skip`` runs
    are left out."""
    import statistics

    k = max(1, len(times) // runs)
    return statistics.median(sum(times[r * k : (r + 1) * k]) for r in range(skip, max(skip + 1, len(times) // k)))


def verify_engine(engine_dir: Path, engine_format: str) -> dict[str, Any]:
    """Refuse an engine whose files are missing, truncated, altered or of another format."""
    meta_path = engine_dir / ENGINE_META
    if not meta_path.is_file():
        raise InputError(
            f"{engine_dir} is not an engine (no {ENGINE_META})", hint="run the build stage for this model and SKU"
        )
    try:
        meta = read_json(meta_path)
    except ValueError as exc:
        raise InputError(f"{meta_path} is corrupt: {exc}", hint="rebuild the engine") from exc
    if meta.get("format") != engine_format:
        raise InputError(
            f"{engine_dir} holds a {meta.get('format')!r} engine, expected {engine_format!r}",
            hint="the SKU's backend changed since the build: rebuild the engine",
        )
    for rec in meta.get("files", []):
        path = engine_dir / rec["path"]
        if not path.is_file() or path.stat().st_size != rec["bytes"] or sha256_file(path) != rec["sha256"]:
            raise InputError(
                f"engine file {path} is missing, truncated or altered (size or sha256 differs from {ENGINE_META})",
                hint="rebuild it: skuforge build (or dvc repro)",
            )
    return meta
