"""The backend contract. A backend builds an engine from a prepared model for a SKU, loads it,
runs it, and describes it. The base classes own the edges (engine integrity, input checks) so
every backend behaves the same there; subclasses fill in the ``*_impl`` hooks.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from pydantic import BaseModel, ValidationError

from ..errors import ConfigError, InputError
from ..io import atomic_write_json, read_json, sha256_file
from ..results import FileRecord, LayerInfo, TensorSig, engine_digest

if TYPE_CHECKING:
    import numpy as np

    from ..config import ModelSpec, Profile, SkuSpec

ENGINE_META = "engine.json"


@dataclass(frozen=True)
class BuildContext:
    model: str
    sku: str
    spec: "ModelSpec"
    sku_spec: "SkuSpec"
    prepared: Path
    pins: dict[str, int]  # axes to fix in the engine
    profiles: dict[str, "Profile"]  # axes the engine keeps dynamic within {min, opt, max}
    engine_dir: Path
    calibration_table: Path | None
    probe_inputs: dict[str, "np.ndarray"]
    cache_dir: Path
    progress: Callable[[str, float], None] | None = None
    # ONNX node names (of the prepared model) kept in higher precision than the SKU's: excluded from
    # INT8 quantization, kept FP32 in an FP16 engine (a bisection remedy, or params.yaml's override)
    keep_precise: tuple[str, ...] = ()


@dataclass
class BuildOutcome:
    """What a backend reports about the engine it wrote into ``ctx.engine_dir``."""

    files: list[str]
    layers: list[LayerInfo]
    requested_devices: list[str]
    partition_boundaries: int
    options: dict[str, Any]
    calibration: dict[str, Any] | None = None
    timing_cache: Path | None = None
    hardware_specific: bool = False
    warnings: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


class Runner(abc.ABC):
    """A loaded engine. ``infer`` checks its inputs, then calls ``_infer_impl``."""

    engine_sha256: str | None = None  # set by Backend.load from the verified engine files

    def __init__(self, inputs: list[TensorSig], outputs: list[str]):
        self.inputs = inputs
        self.output_names = outputs

    def infer(self, feeds: dict[str, "np.ndarray"]) -> dict[str, "np.ndarray"]:
        import numpy as np

        for sig in self.inputs:
            if sig.name not in feeds:
                raise InputError(f"engine input {sig.name!r} was not given (given: {sorted(feeds)})")
            arr = feeds[sig.name]
            if np.dtype(arr.dtype).name != sig.dtype:
                raise InputError(f"engine input {sig.name!r} must be {sig.dtype}, got {arr.dtype}")
            want = [d if isinstance(d, int) else None for d in sig.shape]
            if len(arr.shape) != len(want) or any(w is not None and w != g for w, g in zip(want, arr.shape)):
                raise InputError(f"engine input {sig.name!r} must have shape {sig.shape}, got {list(arr.shape)}")
        return self._infer_impl(feeds)

    @abc.abstractmethod
    def _infer_impl(self, feeds: dict[str, "np.ndarray"]) -> dict[str, "np.ndarray"]: ...

    def close(self) -> None:
        """Release the engine; the default has nothing to release."""

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Backend(abc.ABC):
    name: ClassVar[str]
    Options: ClassVar[type[BaseModel]]
    install_hint: ClassVar[str]
    engine_format: ClassVar[str]
    # versions() keys that must be equal at load time: an engine from another runtime or
    # compiler version is refused, not loaded
    runtime_keys: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def options(cls, sku: "SkuSpec") -> Any:
        try:
            return cls.Options.model_validate(sku.options)
        except ValidationError as exc:
            from ..config import validation_problems

            raise ConfigError("; ".join(validation_problems(exc, cls.Options, ("options",))),
                              hint=f"valid {cls.name} options: {', '.join(cls.Options.model_fields)}") from None

    @classmethod
    def check_sku(cls, sku: "SkuSpec") -> list[str]:
        """Config-time problems with a SKU for this backend (no SDK import)."""
        try:
            opts = cls.options(sku)
        except ConfigError as exc:
            return [exc.message]
        return cls._check_sku_impl(sku, opts)

    @classmethod
    def _check_sku_impl(cls, sku: "SkuSpec", options: Any) -> list[str]:
        return []

    def cross_compiles(self, sku: "SkuSpec") -> bool:
        """True when this backend builds the SKU's engine on any host (the target is only needed
        to run it). The default: engines are built on the target."""
        return False

    @abc.abstractmethod
    def environment_problems(self, sku: "SkuSpec", purpose: str = "run") -> list[str]:
        """What this host lacks to ``build`` or ``run`` the SKU's engines (SDK, providers, devices)."""

    @abc.abstractmethod
    def versions(self) -> dict[str, str]: ...

    @abc.abstractmethod
    def build(self, ctx: BuildContext) -> BuildOutcome: ...

    def load(self, engine_dir: Path, sku: "SkuSpec") -> Runner:
        """Load an engine after checking it is whole and was built by this backend and version."""
        meta = verify_engine(engine_dir, self.engine_format)
        have = self.versions()
        for key in self.runtime_keys if not meta.get("portable") else ():
            built = meta.get("versions", {}).get(key)
            if built != have.get(key):
                raise InputError(f"{engine_dir} was built with {key} {built}, this host has {have.get(key)}",
                                 hint="rebuild the engine here, or install the version it was built with")
        runner = self._load_impl(engine_dir, meta, sku)
        runner.engine_sha256 = engine_digest(meta.get("files", []))
        return runner

    @abc.abstractmethod
    def _load_impl(self, engine_dir: Path, meta: dict[str, Any], sku: "SkuSpec") -> Runner: ...

    def write_meta(self, engine_dir: Path, files: list[str], meta: dict[str, Any]) -> list[FileRecord]:
        records = [FileRecord(path=f, sha256=sha256_file(engine_dir / f), bytes=(engine_dir / f).stat().st_size) for f in files]
        atomic_write_json(engine_dir / ENGINE_META, {
            "format": self.engine_format,
            "backend": self.name,
            "versions": self.versions(),
            "files": [r.to_json() for r in records],
            **meta,
        })
        return records


def verify_engine(engine_dir: Path, engine_format: str) -> dict[str, Any]:
    """Refuse an engine whose files are missing, truncated, altered or of another format."""
    meta_path = engine_dir / ENGINE_META
    if not meta_path.is_file():
        raise InputError(f"{engine_dir} is not an engine (no {ENGINE_META})", hint="run the build stage for this model and SKU")
    try:
        meta = read_json(meta_path)
    except ValueError as exc:
        raise InputError(f"{meta_path} is corrupt: {exc}", hint="rebuild the engine") from exc
    if meta.get("format") != engine_format:
        raise InputError(f"{engine_dir} holds a {meta.get('format')!r} engine, expected {engine_format!r}",
                         hint="the SKU's backend changed since the build: rebuild the engine")
    for rec in meta.get("files", []):
        path = engine_dir / rec["path"]
        if not path.is_file() or path.stat().st_size != rec["bytes"] or sha256_file(path) != rec["sha256"]:
            raise InputError(f"engine file {path} is missing, truncated or altered (size or sha256 differs from {ENGINE_META})",
                             hint="rebuild it: skuforge build (or dvc repro)")
    return meta
