"""What several stages read: stage reports, datasets and reference outputs."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pipeline.core.errors import InputError
from pipeline.core.io import read_json
from pipeline.core.paths import Layout
from pipeline.project.config import ModelSpec, Pair, Registry, SkuSpec
from pipeline.project.data import LABELS, check_finite, iter_batches
from pipeline.results.reports import Result

if TYPE_CHECKING:
    import numpy as np

    from pipeline.results.reports import BuildReport

R = TypeVar("R", bound=Result)


# The record a stage logs with its result (``extra=RESULT``): a command that prints the result
# itself drops that record, so the result shows once (pipeline/cli/commands.py).
RESULT_ATTR = "skuforge_result"
RESULT = {RESULT_ATTR: True}


class _Prefixed(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return f"{self.extra['prefix']} {msg}", kwargs


def log(model: str, sku: str | None = None) -> logging.LoggerAdapter:
    """A logger whose lines name the model and SKU."""
    return _Prefixed(logging.getLogger("pipeline.stages"), {"prefix": f"[{model}{'/' + sku if sku else ''}]"})


def layout(registry: Registry) -> Layout:
    return Layout(registry.root)


def read_report(path: Path, cls: type[R], producer: str) -> R:
    if not path.is_file():
        raise InputError(f"{path} does not exist", hint=f"run the {producer} stage first (or dvc repro)")
    try:
        return cls.model_validate(read_json(path))
    except ValueError as exc:
        raise InputError(f"{path} is not a valid {producer} report: {exc}", hint=f"rerun the {producer} stage") from exc


def load_arrays(path: Path, producer: str) -> dict[str, np.ndarray]:
    import numpy as np

    if not path.is_file():
        raise InputError(f"{path} does not exist", hint=f"run the {producer} stage first (or dvc repro)")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except Exception as exc:  # a damaged archive: zipfile, OSError or ValueError
        raise InputError(
            f"{path} is damaged ({type(exc).__name__}: {exc})", hint=f"rerun the {producer} stage"
        ) from exc


def check_engine(runner, build: BuildReport, engine_dir: Path, model: str, sku: str) -> str:
    """The loaded engine is the one the build report describes; returns its engine_sha256."""
    if runner.engine_sha256 != build.engine_sha256:
        raise InputError(
            f"{engine_dir} is not the engine build.json describes (engine sha256 "
            f"{(runner.engine_sha256 or '?')[:12]}, build report {build.engine_sha256[:12]})",
            hint=f"rebuild it: skuforge build --model {model} --sku {sku} (or dvc repro)",
        )
    return build.engine_sha256


def batch_indices(spec: ModelSpec, signature) -> tuple[dict[str, int | None], dict[str, int | None]]:
    axis = spec.batch_axis
    return (
        {t.name: t.batch_index(axis) for t in signature.inputs},
        {t.name: t.batch_index(axis) for t in signature.outputs},
    )


def run_plan(pair: Pair, signature) -> tuple[dict[str, int | None], dict[str, int | None], int]:
    """Batch axes of the inputs and outputs, and the batch to run at: the SKU's pin, else the
    model's (1 by default). A batch above 1 is split back into samples along each output's batch
    axis (found by the prepare stage), so every output needs one."""
    return _run_plan(pair.model, pair.spec, pair.pins, signature, pair.sku, pair.sku_spec)


def model_run_plan(
    registry: Registry, model: str, signature
) -> tuple[dict[str, int | None], dict[str, int | None], int]:
    """``run_plan`` at the model's own pins (the reference stage: no SKU)."""
    return _run_plan(model, registry.model(model), registry.pins(model), signature, None, None)


def _run_plan(
    model: str, spec: ModelSpec, pins: dict[str, int], signature, sku: str | None, sku_spec: SkuSpec | None
) -> tuple[dict[str, int | None], dict[str, int | None], int]:
    axis = spec.batch_axis
    in_idx, out_idx = batch_indices(spec, signature)
    batch = pins.get(axis or "", 1)
    unbatched = [o for o, i in out_idx.items() if i is None]
    if batch > 1 and unbatched and all(i is not None for i in in_idx.values()):
        where = f"models.{model}.pins.{axis}: 1"
        if sku_spec is not None and axis in sku_spec.profiles:
            where = f"skus.{sku}.shapes.{axis}: 1 in place of skus.{sku}.profiles.{axis}"
        elif sku_spec is not None and axis in sku_spec.shapes:
            where = f"skus.{sku}.shapes.{axis}: 1"
        raise InputError(
            f"{model}{'/' + sku if sku else ''} runs at {axis}={batch}, but outputs {unbatched} have no "
            f"batch axis (see the prepare report's signature), so batched samples cannot be split apart",
            hint=f"set {where} in params.yaml (one sample per call)",
        )
    return in_idx, out_idx, batch


CALIBRATION_TABLE = "table.json"


def calibration_table(registry: Registry, model: str) -> Path:
    """The calibrate stage's table for ``model`` (INT8 builds read it)."""
    return layout(registry).calibration_dir(model) / CALIBRATION_TABLE


def calibration_batches(
    registry: Registry, model: str, spec: ModelSpec, pins: dict[str, int], signature
) -> tuple[list[dict[str, np.ndarray]], int]:
    """The calibration set as the engine takes it: batches at the pinned batch size, the first
    ``calibration.samples`` samples where params.yaml caps them; and the number of samples. Refuses
    NaN/Inf (they would give infinite ranges)."""
    files = layout(registry)
    arrays = load_arrays(files.split(model, "calibration"), "data")
    arrays.pop(LABELS, None)
    # the data stage refuses NaN/Inf; this catches data written before it did
    check_finite(arrays, "calibration", str(files.split(model, "calibration")))
    samples = spec.calibration.samples
    if samples is not None:
        arrays = {k: v[:samples] for k, v in arrays.items()}
    in_idx, _ = batch_indices(spec, signature)
    batch = pins.get(spec.batch_axis or "", 1)
    return [feeds for _, feeds in iter_batches(arrays, in_idx, batch)], len(next(iter(arrays.values())))
