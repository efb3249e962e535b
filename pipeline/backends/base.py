"""The backend contract. A backend builds an engine from a prepared model for a SKU, loads it,
runs it, and describes it. The base classes own the edges so every backend behaves the same
there: the build preamble (options, environment, pinned shapes, a staging folder, precision
conversion), the SKU's cache policy, typed engine metadata, engine integrity and input checks.
Subclasses fill in the ``*_impl`` hooks and declare what they can do in ``capabilities``.
"""

from __future__ import annotations

import abc
import importlib.metadata
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ValidationError

from pipeline.backends.caches import open_session
from pipeline.backends.contract import (
    ENGINE_META,
    BuildContext,
    BuildOutcome,
    Capabilities,
    EngineMeta,
    Runner,
    Staged,
    verify_engine,
)
from pipeline.backends.quantize import QdqOptions, quantize_qdq, to_fp16
from pipeline.core.errors import ConfigError, EnvironmentProblem, InputError
from pipeline.core.io import atomic_write_json, sha256_file
from pipeline.core.validation import validation_problems
from pipeline.model.graph import pin_axes
from pipeline.results.reports import FileRecord, engine_digest

if TYPE_CHECKING:
    import onnx

    from pipeline.project.config import SkuSpec


def onnx_version() -> str:
    """The onnx package's version for ``versions()``, read from its metadata: importing onnx costs
    time, and a device that only loads engines has no onnx (`pip install skuforge[agent]`)."""
    try:
        return importlib.metadata.version("onnx")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


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
    # an emulated runner (pipeline/backends/emulated): this backend's aarch64 CPU engines run on an
    # x86-64 host under QEMU user-mode emulation, for validation (never a benchmark)
    emulation: ClassVar[bool] = False

    @classmethod
    def options(cls, sku: SkuSpec) -> Any:
        try:
            return cls.Options.model_validate(sku.options)
        except ValidationError as exc:
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

    @classmethod
    def config_fingerprint(cls) -> dict[str, str]:
        """What beyond params.yaml decides this backend's engine bytes and is not a runtime version a
        SKU's toolchain pins (a converter environment's lock): part of the build's config hash.
        The default: nothing."""
        return {}

    def cross_compiles(self, sku: SkuSpec) -> bool:
        """True when this backend builds the SKU's engine on any host (the target is only needed
        to run it). The default: engines are built on the target."""
        return False

    def runs_remotely(self, sku: SkuSpec) -> bool:
        """True when this host runs the SKU's engine on a device it reaches (an RPC session), so the
        host's own hardware does not decide whether it can validate and bench it. The default: no."""
        return False

    @abc.abstractmethod
    def environment_problems(self, sku: SkuSpec, purpose: str = "run") -> list[str]:
        """What this host lacks to ``build`` or ``run`` the SKU's engines (SDK, providers, devices)."""

    @abc.abstractmethod
    def versions(self) -> dict[str, str]: ...

    def build(self, ctx: BuildContext) -> BuildOutcome:
        """Build the engine into ``ctx.engine_dir``: the shared preamble, then ``_build_impl``."""
        import onnx

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

    def load_emulated(self, engine_dir: Path, sku: SkuSpec) -> Runner:
        """The engine run by the SKU's runtime built for its CPU, under emulation on this host
        (``emulation``): checked whole as ``load`` does; the runtime versions are the worker's."""
        meta = self.read_meta(engine_dir)
        runner = self._load_emulated_impl(engine_dir, meta, sku)
        runner.engine_sha256 = engine_digest(meta.files)
        return runner

    def _load_emulated_impl(self, engine_dir: Path, meta: Any, sku: SkuSpec) -> Runner:
        raise EnvironmentProblem(
            f"the {self.name} backend has no emulated runner", hint="validate the engine on the device's runner"
        )

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
