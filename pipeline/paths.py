"""Where each stage reads and writes. dvc.yaml names the same paths (a test keeps them equal)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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

    def latency_csv(self, model: str, sku: str) -> Path:
        return self.sku_dir(model, sku) / "latency.csv"

    def manifest(self, model: str, sku: str) -> Path:
        return self.root / "manifests" / model / f"{sku}.json"

    def cache_dir(self, model: str, sku: str) -> Path:
        """Checked-in timing caches / tuning logs of one (model, SKU): DVC output with persist."""
        return self.root / "caches" / sku / model
