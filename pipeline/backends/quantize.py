"""Model-level precision conversions shared by backends that take an ONNX graph: static INT8
QDQ with the calibrate stage's table, and FP16 with FP32 inputs and outputs.

They use ONNX Runtime's quantization tools (the reference runtime's), so the same QDQ graph can
be handed to any backend that consumes QDQ (ONNX Runtime, OpenVINO, TensorRT).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.backends.opset import OpsetConversion, convert_opset
from pipeline.core.errors import InputError, UnsupportedOp
from pipeline.model.graph import SUGGESTED_OPSET, _all_tensors, default_opset, tensors_to_raw

if TYPE_CHECKING:
    from pipeline.backends.contract import BuildContext

# QuantizeLinear/DequantizeLinear take a per-channel ``axis`` from opset 13
QDQ_MIN_OPSET = 13


@dataclass(frozen=True)
class QdqSettings:
    per_channel: bool = True
    reduce_range: bool = False
    activation_type: Literal["uint8", "int8"] = "uint8"
    weight_type: Literal["int8", "uint8"] = "int8"
    op_types_to_quantize: tuple[str, ...] | None = None
    nodes_to_exclude: tuple[str, ...] = ()
    # TensorRT's explicit quantization takes zero point 0 everywhere and quantizes biases itself
    symmetric_activations: bool = False
    quantize_bias: bool = True


class QdqOptions(BaseModel):
    """The INT8 options of every backend that consumes the QDQ graph (mixed into its Options)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    per_channel: bool = True
    reduce_range: bool | None = Field(
        None, description="7-bit weights; null: the backend decides from the target (see saturation_safe_range)"
    )
    activation_type: Literal["uint8", "int8"] = "uint8"
    weight_type: Literal["int8", "uint8"] = "int8"
    op_types_to_quantize: list[str] | None = Field(None, description="quantize only these op types (default: all)")
    nodes_to_exclude: list[str] = Field(
        default_factory=list, description="nodes kept in float (e.g. after a failed gate)"
    )

    def for_target(self, target: Any) -> Any:
        """These options with ``reduce_range`` decided for the SKU's target when left unset (the
        build report then records what was used)."""
        if self.reduce_range is not None:
            return self
        return self.model_copy(
            update={
                "reduce_range": saturation_safe_range(
                    target.arch, target.device, target.cpu_features, self.activation_type, self.weight_type
                )
            }
        )

    def qdq_settings(self) -> QdqSettings:
        return QdqSettings(
            per_channel=self.per_channel,
            reduce_range=bool(self.reduce_range),
            activation_type=self.activation_type,
            weight_type=self.weight_type,
            op_types_to_quantize=tuple(self.op_types_to_quantize) if self.op_types_to_quantize else None,
            nodes_to_exclude=tuple(self.nodes_to_exclude),
        )


VNNI = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def saturation_safe_range(
    arch: str, device: str, cpu_features: list[str] | frozenset[str], activation_type: str, weight_type: str
) -> bool:
    """Whether u8s8 weights need 7 bits on this target. x86 CPUs without VNNI multiply uint8 by int8
    with VPMADDUBSW, which sums pairs into int16 and saturates; ONNX Runtime's u8s8 kernels then
    compute wrong numbers, and so do OpenVINO's (measured: 7.8-11.7% of outputs off on an AVX2
    host). A SKU that declares no VNNI feature may run on such a CPU, so its engine must not
    depend on it."""
    return (
        arch == "x86_64"
        and device == "cpu"
        and activation_type == "uint8"
        and weight_type == "int8"
        and not (VNNI & set(cpu_features))
    )


def quantize_qdq(
    source: Path, out: Path, ctx: BuildContext, settings: QdqSettings, newest_opset: int | None = None
) -> dict[str, Any]:
    """Write ``out``: ``source`` with QuantizeLinear/DequantizeLinear pairs from the calibration table.

    A model older than opset 13 is converted to opset 17 first (checked on the probe batch):
    per-channel QDQ needs the ``axis`` of QuantizeLinear/DequantizeLinear-13, and OpenVINO and
    TensorRT read per-channel scales only from those. ``newest_opset``: the newest opset whose
    QuantizeLinear/DequantizeLinear the backend runs; a newer model is converted down to it. The
    conversion is in the returned record."""
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.calibrate import load_tensors_data, save_tensors_data

    if ctx.calibration_table is None or not ctx.calibration_table.is_file():
        raise InputError(
            f"INT8 build of {ctx.model} for {ctx.sku} needs the calibration table",
            hint=f"run: skuforge calibrate --model {ctx.model}",
        )
    with tempfile.TemporaryDirectory(prefix="skuforge-qdq-") as tmp:
        conversion = None
        model = onnx.load(str(source))
        have = default_opset(model)
        target = SUGGESTED_OPSET if have < QDQ_MIN_OPSET else have
        target = min(target, newest_opset) if newest_opset else target
        if target != have:
            reason = (
                f"INT8 QDQ needs opset {QDQ_MIN_OPSET} or newer"
                if have < QDQ_MIN_OPSET
                else f"the backend runs QuantizeLinear/DequantizeLinear up to opset {newest_opset}"
            )
            model, conversion = convert_opset(model, target, ctx.probe_inputs, reason)
            source = Path(tmp) / "converted.onnx"
            onnx.save(model, str(source))
        # nodes kept precise (params.yaml higher_precision, a bisection remedy) stay in float
        excluded = tuple(dict.fromkeys([*settings.nodes_to_exclude, *ctx.keep_precise]))
        check_nodes(model, excluded, f"nodes to keep out of INT8 quantization for {ctx.model}/{ctx.sku}")
        table = Path(tmp) / "calibration.json"  # a copy: quantize_static may rewrite its cache
        shutil.copyfile(ctx.calibration_table, table)
        try:
            ranges = load_tensors_data(table)
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(
                f"calibration table {ctx.calibration_table} is unreadable: {exc}",
                hint=f"rerun: skuforge calibrate --model {ctx.model}",
            ) from exc
        method = ranges.calibration_method
        derived = derive_missing_ranges(model, ranges)
        if derived:
            save_tensors_data(ranges, table)
        types = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}
        try:
            quantize_static(
                str(source),
                str(out),
                None,
                quant_format=QuantFormat.QDQ,
                per_channel=settings.per_channel,
                reduce_range=settings.reduce_range,
                activation_type=types[settings.activation_type],
                weight_type=types[settings.weight_type],
                calibrate_method=method,
                calibration_cache_path=str(table),
                op_types_to_quantize=list(settings.op_types_to_quantize) if settings.op_types_to_quantize else None,
                nodes_to_exclude=list(excluded) or None,
                extra_options={
                    "ActivationSymmetric": settings.symmetric_activations,
                    "QuantizeBias": settings.quantize_bias,
                },
            )
        except (ValueError, KeyError) as exc:
            raise InputError(
                f"INT8 quantization failed: {exc}",
                hint="the calibration table does not match the prepared model: "
                f"rerun skuforge calibrate --model {ctx.model}",
            ) from exc
        except RuntimeError as exc:  # the quantizer's own assertions on a graph ONNX Runtime runs
            raise UnsupportedOp(
                "ONNX Runtime's INT8 quantizer",
                None,
                None,
                f"{exc} (the FP32 model is valid and runs)",
                hint="keep the node it names in float (the SKU's options.nodes_to_exclude or the model's "
                "higher_precision), use an FP16/FP32 SKU for this model, or report it with the model",
            ) from exc
    quantized = onnx.load(str(out))
    if tensors_to_raw(quantized):
        onnx.save(quantized, str(out))
    record = asdict(settings)
    record["op_types_to_quantize"] = list(settings.op_types_to_quantize) if settings.op_types_to_quantize else None
    record["nodes_to_exclude"] = list(excluded)
    if derived:
        record["derived_ranges"] = derived
    if conversion is not None:
        record["opset_conversion"] = conversion.to_json()
    return {"format": "QDQ", **record}


def quantize_lstm_dynamic(
    source: Path, out: Path, keep: tuple[str, ...] | list[str], reduce_range: bool, per_channel: bool
) -> dict[str, Any] | None:
    """Write ``out``: ``source`` (a QDQ graph) with its LSTM layers given INT8 weights and
    activations quantized on each call: ONNX Runtime's ``com.microsoft.DynamicQuantizeLSTM``, a
    CPU kernel (MLAS u8 x s8 GEMMs). Static QDQ has no LSTM: without this an INT8 engine's LSTMs
    run in FP32 (on the ship recognizer, 43% of the INT8 engine's time; 2.4x faster dynamic).

    Left in float, each with its reason in the record: nodes in ``keep`` (kept precise by
    params.yaml or a remedy), an LSTM whose ``layout`` is 1 (batch first; the contrib op has no
    such attribute, and the quantizer would drop it) and one whose weights are not constants.
    ``reduce_range``: 7-bit weights, as for the static layers (see ``saturation_safe_range``).
    Returns None for a graph without LSTM, else {"op", "nodes", "kept_float", "reduce_range",
    "per_channel"}; ``out`` is written when "nodes" (those quantized) is not empty."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(source))
    constants = {t.name for t in model.graph.initializer}
    chosen: list[str] = []
    kept: dict[str, str] = {}
    renamed = False
    for index, node in enumerate(model.graph.node):
        if node.op_type != "LSTM" or node.domain not in ("", "ai.onnx"):
            continue
        if not node.name:  # the quantizer excludes by name
            node.name, renamed = f"LSTM#{index}", True
        layout = next((a.i for a in node.attribute if a.name == "layout"), 0)
        if node.name in keep:
            kept[node.name] = "kept precise"
        elif layout != 0:
            kept[node.name] = f"layout {layout} (batch first): DynamicQuantizeLSTM takes time-major inputs only"
        elif len(node.input) < 3 or node.input[1] not in constants or node.input[2] not in constants:
            kept[node.name] = "its weights W and R are not constants"
        else:
            chosen.append(node.name)
    record = {
        "op": "com.microsoft.DynamicQuantizeLSTM",
        "nodes": chosen,
        "kept_float": kept,
        "reduce_range": reduce_range,
        "per_channel": per_channel,
    }
    if not chosen:
        return record if kept else None
    if renamed:
        source = out.with_name(out.stem + "-named.onnx")
        onnx.save(model, str(source))
    quantize_dynamic(
        str(source),
        str(out),
        op_types_to_quantize=["LSTM"],
        nodes_to_exclude=list(kept) or None,
        per_channel=per_channel,
        reduce_range=reduce_range,
        weight_type=QuantType.QInt8,
    )
    quantized = onnx.load(str(out))
    made = [n.name for n in quantized.graph.node if n.op_type == "DynamicQuantizeLSTM"]
    if len(made) != len(chosen):  # the quantizer skips what it cannot take, silently
        raise UnsupportedOp(
            "ONNX Runtime's dynamic LSTM quantizer",
            "LSTM",
            None,
            f"it made {len(made)} DynamicQuantizeLSTM node(s) of the {len(chosen)} LSTM(s) chosen "
            f"({', '.join(chosen)})",
            hint="keep the LSTMs in float: the SKU's options.recurrent: float",
        )
    if tensors_to_raw(quantized):
        onnx.save(quantized, str(out))
    return record


# ops whose output holds exactly the values of their data input (input 0), rearranged
RANGE_PRESERVING = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Identity"})


def derive_missing_ranges(model: Any, ranges: Any) -> dict[str, str]:
    """Fill in ``ranges`` (a calibration TensorsData) for float tensors of ``model`` the table lacks
    but whose range is known without running the model: a Softmax output is [0, 1], and a tensor
    on either side of a range-preserving op (Reshape, Flatten, ...) has the other side's range.

    The calibration table holds the tensors of the prepared model; an opset conversion before
    quantizing can add tensors (``onnx.version_converter`` rewrites a Softmax-11 over a non-last
    axis as Flatten -> Softmax -> Reshape, the Softmax writing ``<name>_intermediate``), and ONNX
    Runtime's quantizer then fails on the Softmax output it must set to [0, 1] (RuntimeError:
    "Only an existing tensor can be modified"). Returns {tensor: how its range was derived}."""
    import numpy as np
    from onnxruntime.quantization.calibrate import TensorData

    derived: dict[str, str] = {}
    nodes = list(model.graph.node)
    changed = True
    while changed:
        changed = False
        for node in nodes:
            if node.op_type == "Softmax" and node.output and node.output[0] not in ranges.data:
                ranges.data[node.output[0]] = TensorData(lowest=np.float32(0.0), highest=np.float32(1.0))
                derived[node.output[0]] = f"Softmax {node.name or '(unnamed)'}: [0, 1]"
                changed = True
            elif node.op_type in RANGE_PRESERVING and node.input and node.output:
                source, target = node.input[0], node.output[0]
                for have, want in ((source, target), (target, source)):
                    if have in ranges.data and want not in ranges.data:
                        ranges.data[want] = ranges.data[have]
                        derived[want] = f"{node.op_type} {node.name or '(unnamed)'}: the range of {have!r}"
                        changed = True
    return derived


def conversion_warnings(calibration: dict[str, Any] | None) -> list[str]:
    """The build warnings for the opset conversion recorded by ``quantize_qdq`` (if any), the
    tensor ranges it derived instead of calibrating, and the LSTMs ``quantize_lstm_dynamic`` had
    to leave in float."""

    record = (calibration or {}).get("opset_conversion")
    warnings = [OpsetConversion(**record).warning()] if record else []
    derived = (calibration or {}).get("derived_ranges") or {}
    if derived:
        names = ", ".join(sorted(derived)[:3]) + (", ..." if len(derived) > 3 else "")
        warnings.append(
            f"INT8: {len(derived)} tensor range(s) not in the calibration table were derived from the graph "
            f"({names}; Softmax outputs [0, 1], reshapes their input's range): see the build report's calibration"
        )
    kept = ((calibration or {}).get("dynamic") or {}).get("kept_float") or {}
    warnings += [f"INT8: LSTM {name} stays in float: {why}" for name, why in kept.items() if why != "kept precise"]
    return warnings


def check_nodes(model: Any, names: tuple[str, ...] | list[str], what: str) -> None:
    """Refuse node names the model does not have (a typo would silently keep nothing precise)."""
    have = {n.name for n in model.graph.node}
    unknown = [n for n in names if n not in have]
    if unknown:
        raise InputError(
            f"{what}: the prepared model has no node named {', '.join(map(repr, unknown))}",
            hint="names are those of the prepared model (build/<model>/prepared/model.onnx), as "
            "skuforge bisect reports them; fix models.<model>.higher_precision or the SKU's nodes_to_exclude",
        )


def to_fp16(source: Path, out: Path, keep: tuple[str, ...] = ()) -> Path:
    """FP16 weights and compute, FP32 inputs and outputs, nodes topologically sorted (the
    converter can leave them unsorted, which importers such as IREE's refuse), tensors in raw_data.
    ``keep``: nodes left in FP32 (the converter casts around them)."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16
    from onnxruntime.transformers.onnx_model import OnnxModel

    model = onnx.load(str(source))
    check_nodes(model, keep, "nodes to keep in FP32")
    converted = OnnxModel(convert_float_to_float16(model, keep_io_types=True, node_block_list=list(keep) or None))
    if keep:
        _drop_round_trips(converted.model)
    converted.topological_sort()
    tensors_to_raw(converted.model)  # the converter writes FP16 into int32_data, which IREE's importer refuses
    _empty_tensors_to_raw(converted.model)
    onnx.save(converted.model, str(out))
    return out


def _empty_tensors_to_raw(model: Any) -> int:
    """Give every tensor with no elements and no data field an empty ``raw_data``; returns how many.
    Exporters write optional inputs such as Resize's ``roi`` as a float tensor of dims [0] with no
    data field, which is valid ONNX; the converter turns it into an FP16 tensor with no field, and
    IREE's importer reads FP16 only from raw_data ("Unhandled ONNX TensorProto data: dims: 0")."""
    from onnx import TensorProto

    filled = 0
    for tensor in _all_tensors(model.graph):
        if (
            0 in tensor.dims
            and not tensor.HasField("raw_data")
            and tensor.data_location != TensorProto.EXTERNAL
            and tensor.data_type != TensorProto.STRING
        ):
            tensor.raw_data = b""
            filled += 1
    return filled


def _drop_round_trips(model: Any) -> int:
    """Remove FP32 -> FP16 -> FP32 cast pairs. The converter casts each blocked node's output back to
    FP16 and again to FP32 for the next blocked node, so a value that only fits FP32 (the reason
    for keeping the nodes) still overflows between them; the second cast's readers take the FP32
    value directly. Returns how many pairs went."""
    import onnx

    by_output = {o: n for n in model.graph.node for o in n.output}
    outputs = {o.name for o in model.graph.output}

    def cast_to(node: Any) -> int | None:
        return next((a.i for a in node.attribute if a.name == "to"), None) if node.op_type == "Cast" else None

    dropped = []
    for node in model.graph.node:
        first = by_output.get(node.input[0]) if node.input else None
        if (
            cast_to(node) == onnx.TensorProto.FLOAT
            and first is not None
            and cast_to(first) == onnx.TensorProto.FLOAT16
            and node.output[0] not in outputs
        ):
            source = first.input[0]
            for reader in model.graph.node:
                for i, name in enumerate(reader.input):
                    if name == node.output[0]:
                        reader.input[i] = source
            dropped.append(node)
    for node in dropped:
        model.graph.node.remove(node)
    read = {i for n in model.graph.node for i in n.input} | outputs
    for node in [n for n in model.graph.node if cast_to(n) == onnx.TensorProto.FLOAT16 and n.output[0] not in read]:
        model.graph.node.remove(node)
    return len(dropped)
