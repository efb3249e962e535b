"""Where each stage reads and writes. dvc.yaml names the same paths (a test keeps them equal)."""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from pipeline.core.env import SKUFORGE_CACHE_DIR, XDG_CACHE_HOME
from pipeline.core.errors import InputError

PATH_RULE = "relative to the folder holding params.yaml, and inside it (no absolute path, no '..' above it)"


def path_problem(path: str) -> str | None:
    """Why a registry path cannot name a place inside the project, or None. Lexical only."""
    if not path:
        return "is empty"
    if "\0" in path:
        return "contains a NUL character"
    if PurePosixPath(path).is_absolute() or PureWindowsPath(path).anchor:
        return "is absolute"
    if posixpath.normpath(path.replace("\\", "/")).split("/")[0] == "..":
        return "leaves the project root ('..')"
    return None


def inside(root: str | os.PathLike, *parts: str | os.PathLike) -> Path:
    """``root`` joined with ``parts``; an InputError when that resolves (symlinks followed) outside root."""
    path = Path(root).joinpath(*parts)
    base, resolved = Path(root).resolve(), path.resolve()
    if resolved != base and base not in resolved.parents:
        raise InputError(
            f"{path} resolves to {resolved}, outside the project root {base}",
            hint=f"registry paths must be {PATH_RULE}; a symlink must not lead out of it either",
        )
    return path


SPLITS: tuple[str, ...] = ("golden", "calibration", "evaluation", "hard_tail")
REFERENCE_SPLITS: tuple[str, ...] = ("golden", "evaluation", "hard_tail")


@dataclass(frozen=True)
class Layout:
    root: Path

    def config_dir(self) -> Path:
        return self.root / "build" / "config"

    def config_file(self, model: str, sku: str | None = None, example: bool = False) -> Path:
        """The resolved settings one stage reads: what DVC tracks instead of params.yaml keys."""
        if example:
            return self.config_dir() / f"example-{model}.json"
        return self.config_dir() / (f"{model}-{sku}.json" if sku else f"model-{model}.json")

    def model_dir(self, model: str) -> Path:
        return self.root / "build" / model

    def data_dir(self, model: str) -> Path:
        return self.model_dir(model) / "data"

    def split(self, model: str, split: str, raw: bool = False) -> Path:
        return self.data_dir(model) / (f"{split}.raw.npz" if raw else f"{split}.npz")

    def reference_dir(self, model: str) -> Path:
        return self.model_dir(model) / "reference"

    def calibration_dir(self, model: str) -> Path:
        return self.model_dir(model) / "calibration"

    def prepare_dir(self, model: str) -> Path:
        return self.model_dir(model) / "prepared"

    def prepared_model(self, model: str) -> Path:
        return self.prepare_dir(model) / "model.onnx"

    def sku_dir(self, model: str, sku: str) -> Path:
        return self.model_dir(model) / sku

    def engine_dir(self, model: str, sku: str) -> Path:
        return self.sku_dir(model, sku) / "engine"

    def report(self, model: str, sku: str | None, stage: str) -> Path:
        """``<stage>.json`` next to that stage's output."""
        if sku is None:
            folder = {
                "prepare": self.prepare_dir(model),
                "data": self.data_dir(model),
                "reference": self.reference_dir(model),
                "calibrate": self.calibration_dir(model),
            }[stage]
            return folder / f"{stage}.json"
        return self.sku_dir(model, sku) / f"{stage}.json"

    def engine_outputs(self, model: str, sku: str, stage: str = "validate") -> Path:
        """The engine's outputs on the golden set, written by validate (the consistency matrix reads
        them); ``stage`` emulate: those of the engine under emulation (emulate_outputs.npz)."""
        return self.sku_dir(model, sku) / ("outputs.npz" if stage == "validate" else f"{stage}_outputs.npz")

    def consistency_report(self, model: str, suffix: str = ".json") -> Path:
        """The cross-SKU consistency matrix of a model (``.json`` and ``.md``): checked into git."""
        return self.root / "reports" / "consistency" / f"{model}{suffix}"

    def selection(self, model: str) -> Path:
        """The engine chosen per device class for ``model`` (``skuforge select``): outside every DVC
        output, in a folder git ignores (model names never start with '.')."""
        return self.root / "build" / ".selection" / f"{model}.json"

    def latency_csv(self, model: str, sku: str) -> Path:
        return self.sku_dir(model, sku) / "latency.csv"

    def roofline(self, model: str, sku: str) -> Path:
        """The engine against the host's peaks (pipeline.perf.roofline), written by the bench stage."""
        return self.sku_dir(model, sku) / "roofline.json"

    def timeline_csv(self, model: str, sku: str) -> Path:
        """Every timed call of the bench stage in order, warm-up included (the report's timeline)."""
        return self.sku_dir(model, sku) / "timeline.csv"

    def manifest(self, model: str, sku: str) -> Path:
        return self.root / "manifests" / model / f"{sku}.json"

    def cache_dir(self, model: str, sku: str) -> Path:
        """Checked-in timing caches / tuning logs of one (model, SKU): DVC output with persist."""
        return self.root / "caches" / sku / model


def cache_dir() -> Path:
    """This host's skuforge cache folder (SKUFORGE_CACHE_DIR, else $XDG_CACHE_HOME/skuforge): the
    peaks, the LiteRT converter's environment, the release stores' ledgers."""
    return SKUFORGE_CACHE_DIR.get() or (XDG_CACHE_HOME.get() or Path.home() / ".cache").expanduser() / "skuforge"
