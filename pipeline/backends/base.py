"""The backend contract. A backend builds an engine from a prepared model for a SKU, loads it,
runs it, and describes it. The base classes own the edges so every backend behaves the same
there: the build preamble (options, environment, pinned shapes, a staging folder, precision
conversion), the SKU's cache policy, typed engine metadata, engine integrity and input checks.
Subclasses fill in the ``*_impl`` hooks and declare what they can do in ``capabilities``.
"""

from __future__ import annotations

import abc
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.core.errors import ConfigError, EnvironmentProblem, InputError
from pipeline.core.io import atomic_write_json, read_json, sha256_file
from pipeline.results.reports import FileRecord, LayerInfo, TensorSig, engine_digest

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from pipeline.backends.caches import CacheSession
    from pipeline.project.config import ModelSpec, Profile, SkuSpec

ENGINE_META = "engine.json"

Precision = Literal["fp32", "fp16", "int8"]
TargetDevice = Literal["cpu", "gpu", "npu"]
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

    def to_json(self) -> dict[str, Any]:
        return {
            "precisions": list(self.precisions),
            "devices": list(self.devices),
            "per_node_precision": self.per_node_precision,
            "intermediate_outputs": self.intermediate_outputs,
            "cache": self.cache,
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
            static = tuple(sig.shape) if all(isinstance(d, int) for d in sig.shape) else None
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
        if len(arr.shape) != len(want) or any(w is not None and w != g for w, g in zip(want, arr.shape)):
            raise InputError(f"engine input {sig.name!r} must have shape {sig.shape}, got {list(arr.shape)}")

    @abc.abstractmethod
    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def profile_layers(self, feeds: dict[str, np.ndarray], iterations: int = 20) -> dict[str, float] | None:
        """Milliseconds per engine layer, the median of ``iterations`` runs on ``feeds`` after a warm-up,
        keyed by the names of build.json ``layers`` (pipeline.perf.roofline joins them to ONNX nodes);
        None where the backend cannot time its layers. The default cannot."""
        return None

    def close(self) -> None:
        """Release the engine; the default has nothing to release."""

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Backend(abc.ABC):
    name: ClassVar[str]
    Options: ClassVar[type[BaseModel]]
    Meta: ClassVar[type[EngineMeta]] = EngineMeta
    capabilities: ClassVar[Capabilities]
    install_hint: ClassVar[str]
    engine_format: ClassVar[str]
    cache_files: ClassVar[tuple[str, ...]] = ()  # what caches/<sku>/<model>/ holds, for a backend with a cache
    # versions() keys that must be equal at load time: an engine from another runtime or
    # compiler version is refused, not loaded
    runtime_keys: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def options(cls, sku: SkuSpec) -> Any:
        try:
            return cls.Options.model_validate(sku.options)
        except ValidationError as exc:
            from pipeline.project.config import validation_problems

            raise ConfigError(
                "; ".join(validation_problems(exc, cls.Options, ("options",))),
                hint=f"valid {cls.name} options: {', '.join(cls.Options.model_fields)}",
            ) from None

    @classmethod
    def check_sku(cls, sku: SkuSpec) -> list[str]:
        """Config-time problems with a SKU for this backend (no SDK import): what the declared
        capabilities rule out, then the backend's own checks."""
        try:
            opts = cls.options(sku)
        except ConfigError as exc:
            return [exc.message]
        caps, problems = cls.capabilities, []
        if sku.precision not in caps.precisions:
            problems.append(
                f"precision: {sku.precision} is not supported by the {cls.name} backend; "
                f"supported: {', '.join(caps.precisions)}"
            )
        if sku.target.device not in caps.devices:
            problems.append(
                f"target.device: {sku.target.device} is not a device the {cls.name} backend builds for; "
                f"it builds for: {', '.join(caps.devices)}"
            )
        if sku.cache.require and caps.cache is None:
            problems.append(f"cache.require: the {cls.name} backend keeps no cache; remove it")
        return problems + cls._check_sku_impl(sku, opts)

    @classmethod
    def _check_sku_impl(cls, sku: SkuSpec, options: Any) -> list[str]:
        return []

    def cross_compiles(self, sku: SkuSpec) -> bool:
        """True when this backend builds the SKU's engine on any host (the target is only needed
        to run it). The default: engines are built on the target."""
        return False

    @abc.abstractmethod
    def environment_problems(self, sku: SkuSpec, purpose: str = "run") -> list[str]:
        """What this host lacks to ``build`` or ``run`` the SKU's engines (SDK, providers, devices)."""

    @abc.abstractmethod
    def versions(self) -> dict[str, str]: ...

    def build(self, ctx: BuildContext) -> BuildOutcome:
        """Build the engine into ``ctx.engine_dir``: the shared preamble, then ``_build_impl``."""
        import onnx

        from pipeline.model.graph import pin_axes

        options = self.options(ctx.sku_spec)
        problems = self.environment_problems(ctx.sku_spec, "build")
        if problems:
            raise EnvironmentProblem("; ".join(problems), hint=self.install_hint)
        model = pin_axes(onnx.load(str(ctx.prepared)), ctx.pins, ctx.prepared)
        with tempfile.TemporaryDirectory(prefix=f"skuforge-{self.name}-") as tmp:
            staged = Staged(work=Path(tmp), model=model, source=Path(tmp) / "input.onnx", options=options)
            staged.model = self._adapt(staged.model, ctx, staged)
            onnx.save(staged.model, str(staged.source))
            self._convert_precision(ctx, staged)
            if self.capabilities.cache is not None and self.uses_cache(staged.options):
                from pipeline.backends.caches import open_session

                staged.cache = open_session(self, ctx)
            outcome = self._build_impl(ctx, staged)
            if staged.cache is not None:
                outcome.meta.cache = staged.cache.close()
                outcome.warnings += staged.cache.warnings
                outcome.cache = staged.cache
        outcome.warnings[:0] = staged.warnings
        return outcome

    def _adapt(self, model: onnx.ModelProto, ctx: BuildContext, staged: Staged) -> onnx.ModelProto:
        """The pinned model as this backend's importer needs it (an opset conversion, say)."""
        return model

    def _convert_precision(self, ctx: BuildContext, staged: Staged) -> None:
        """INT8: the calibrated QDQ graph (for backends whose options take QDQ settings); FP16:
        FP16 weights and compute with the nodes to keep precise left in FP32. A backend that
        converts otherwise (a compiler precision hint) overrides this."""
        from pipeline.backends.quantize import QdqOptions, quantize_qdq, to_fp16

        precision = ctx.sku_spec.precision
        if precision == "int8" and isinstance(staged.options, QdqOptions):
            staged.options = staged.options.for_target(ctx.sku_spec.target)
            staged.calibration = quantize_qdq(
                staged.source,
                staged.work / "quantized.onnx",
                ctx,
                staged.options.qdq_settings(),
                **self._qdq_arguments(),
            )
            staged.replace(staged.work / "quantized.onnx")
        elif precision == "fp16":
            staged.replace(to_fp16(staged.source, staged.work / "fp16.onnx", ctx.keep_precise))

    def _qdq_arguments(self) -> dict[str, Any]:
        return {}

    @abc.abstractmethod
    def _build_impl(self, ctx: BuildContext, staged: Staged) -> BuildOutcome:
        """Compile ``staged.source`` into ``ctx.engine_dir``; read and update ``staged.cache``."""

    def uses_cache(self, options: Any) -> bool:
        """Whether a build with these options reads and writes the cache (a backend with a cache)."""
        return True

    def cache_key(self, sku: SkuSpec) -> dict[str, str]:
        """What a cache of this backend is valid for (compiler version, target): a cache made
        under another key is stale. Only backends that declare a cache implement it."""
        raise NotImplementedError(f"the {self.name} backend keeps no cache")

    def check_cache(self, folder: Path) -> str | None:
        """Why the cache files in ``folder`` cannot be read (None: they can, as far as this host can
        tell without the SDK running them)."""
        return None

    def load(self, engine_dir: Path, sku: SkuSpec) -> Runner:
        """Load an engine after checking it is whole and was built by this backend and version."""
        meta = self.read_meta(engine_dir)
        have = self.versions()
        for key in self.runtime_keys if not meta.portable else ():
            built = meta.versions.get(key)
            if built != have.get(key):
                raise InputError(
                    f"{engine_dir} was built with {key} {built}, this host has {have.get(key)}",
                    hint="rebuild the engine here, or install the version it was built with",
                )
        return self._loaded(engine_dir, meta, sku)

    def _loaded(self, engine_dir: Path, meta: EngineMeta, sku: SkuSpec) -> Runner:
        runner = self._load_impl(engine_dir, meta, sku)
        runner.engine_sha256 = engine_digest(meta.files)
        return runner

    def read_meta(self, engine_dir: Path) -> Any:
        """engine.json, checked (whole, this backend's format, files intact) and typed."""
        raw = verify_engine(engine_dir, self.engine_format)
        try:
            return self.Meta.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InputError(
                f"{engine_dir / ENGINE_META} does not describe a {self.name} engine this skuforge loads: "
                f"{where}: {first['msg']}",
                hint="rebuild the engine (skuforge build, or dvc repro)",
            ) from None

    @abc.abstractmethod
    def _load_impl(self, engine_dir: Path, meta: Any, sku: SkuSpec) -> Runner: ...

    def write_meta(self, engine_dir: Path, files: list[str], meta: EngineMeta, **common: Any) -> list[FileRecord]:
        """Write engine.json: the backend's typed metadata with the base fields (``common``: the
        model, SKU and nodes kept precise)."""
        records = [
            FileRecord(path=f, sha256=sha256_file(engine_dir / f), bytes=(engine_dir / f).stat().st_size) for f in files
        ]
        full = meta.model_copy(
            update={
                "format": self.engine_format,
                "backend": self.name,
                "versions": self.versions(),
                "files": [r.to_json() for r in records],
                **common,
            }
        )
        atomic_write_json(engine_dir / ENGINE_META, self.Meta.model_validate(full.model_dump()).model_dump(mode="json"))
        return records


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
