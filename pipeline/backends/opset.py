"""Opset conversion checked with the reference runtime: ``onnx.version_converter`` to a target opset,
accepted only when the converted graph gives the same outputs on the probe inputs. Backends whose
importer or quantizer needs a newer opset call it; the conversion is recorded for the report."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from pipeline.backends.reference import reference_runner
from pipeline.core.errors import InputError, first_line
from pipeline.model.graph import default_opset, tensors_to_raw

if TYPE_CHECKING:
    import onnx

OPSET_CONVERSION_RTOL = 1e-5


@dataclass(frozen=True)
class OpsetConversion:
    """An opset conversion done for a backend, checked on the probe inputs; lands in the manifest."""

    from_opset: int
    to_opset: int
    reason: str
    max_abs_error: float
    relative_error: float

    def to_json(self) -> dict:
        return asdict(self)

    def warning(self) -> str:
        return (
            f"opset converted from {self.from_opset} to {self.to_opset} ({self.reason}) with onnx.version_converter; "
            f"outputs on the probe batch unchanged (max abs error {self.max_abs_error:.3g})"
        )


def recorded_conversion(*records: dict | None) -> OpsetConversion | None:
    """The opset conversion a build did, from the records a backend keeps it in (the QDQ
    calibration record, the build options), or None."""
    for record in records:
        found = (record or {}).get("opset_conversion")
        if found:
            return OpsetConversion(**found)
    return None


def probe_difference(model: onnx.ModelProto, changed: onnx.ModelProto, probe_inputs: dict) -> tuple[float, float]:
    """The largest absolute and relative (to the largest output magnitude, at least 1) difference
    between the outputs ONNX Runtime computes for two models on ``probe_inputs``; inf where an
    output's shape, or an integer output's values, differ. InputError when either does not run."""
    import numpy as np

    with reference_runner(model.SerializeToString()) as old, reference_runner(changed.SerializeToString()) as new:
        want, got = old.infer(probe_inputs), new.infer(probe_inputs)
    worst_abs, worst_rel = 0.0, 0.0
    for name, a in want.items():
        b = got[name]
        if a.shape != b.shape or (not np.issubdtype(a.dtype, np.floating) and not np.array_equal(a, b)):
            worst_abs = worst_rel = float("inf")
            continue
        if np.issubdtype(a.dtype, np.floating):
            diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0))
            worst_abs = max(worst_abs, diff)
            worst_rel = max(worst_rel, diff / max(1.0, float(np.max(np.abs(a), initial=0.0))))
    return worst_abs, worst_rel


def without_shapeless_values(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` without the ``graph.value_info`` entries that carry no shape (an element
    type alone: shape inference writes one for a tensor whose rank it cannot tell, and exporters do).
    They add nothing inference does not find again, and the converter's output must type-check."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    kept = [vi for vi in copy.graph.value_info if has_shape(vi)]
    del copy.graph.value_info[:]
    copy.graph.value_info.extend(kept)
    return copy


def has_shape(value: onnx.ValueInfoProto) -> bool:
    """A tensor value with a shape (of known rank); other types count as shaped."""
    return not value.type.HasField("tensor_type") or value.type.tensor_type.HasField("shape")


def checkable(converted: onnx.ModelProto, original: onnx.ModelProto) -> onnx.ModelProto:
    """``converted`` as the ONNX checker takes it: the checker wants a shape on every graph output,
    but an output of unknown rank (a tensor bisection marks as an output, a Reshape to a computed
    shape) has none before the conversion either; the probe run checks those outputs instead."""
    import onnx

    unshaped = {o.name for o in original.graph.output if not has_shape(o)}
    if not unshaped:
        return converted
    copy = onnx.ModelProto()
    copy.CopyFrom(converted)
    kept = [o for o in copy.graph.output if has_shape(o) or o.name not in unshaped]
    del copy.graph.output[:]
    copy.graph.output.extend(kept)
    return copy


def convert_opset(
    model: onnx.ModelProto, target: int, probe_inputs: dict, reason: str
) -> tuple[onnx.ModelProto, OpsetConversion | None]:
    """``model`` at ai.onnx opset ``target``: converted with ONNX's version converter (up or down,
    tensors stored as raw_data) when at another opset, else returned as is (record None). The
    conversion is refused (InputError) when the converter fails or ONNX Runtime's outputs on
    ``probe_inputs`` differ between the two models by more than OPSET_CONVERSION_RTOL. Value infos
    without a shape are left out before converting, and shapes inferred again after."""
    import onnx
    from onnx import version_converter

    have = default_opset(model)
    if have == target:
        return model, None
    redo = f"re-export the model from its framework at opset {target}"
    try:
        converted = version_converter.convert_version(without_shapeless_values(model), target)
        converted = onnx.shape_inference.infer_shapes(converted)
        onnx.checker.check_model(checkable(converted, model))
    except Exception as exc:  # the converter raises plain RuntimeError/ValidationError from C++
        detail = first_line(exc)
        raise InputError(
            f"converting the model from opset {have} to {target} ({reason}) failed: {detail}", hint=redo
        ) from exc
    tensors_to_raw(converted)
    try:
        worst_abs, worst_rel = probe_difference(model, converted, probe_inputs)
    except InputError as exc:
        raise InputError(
            f"the model converted from opset {have} to {target} ({reason}) does not run: {exc.message}", hint=redo
        ) from exc
    if not worst_rel <= OPSET_CONVERSION_RTOL:
        raise InputError(
            f"converting the model from opset {have} to {target} ({reason}) changed its outputs on the "
            f"probe batch (max abs error {worst_abs:.3g}, relative {worst_rel:.3g} > {OPSET_CONVERSION_RTOL})",
            hint=redo,
        )
    return converted, OpsetConversion(
        from_opset=have, to_opset=target, reason=reason, max_abs_error=worst_abs, relative_error=worst_rel
    )
