"""LiteRT (TFLite): the prepared ONNX model converted to a ``.tflite`` flatbuffer and run by
``ai-edge-litert``'s interpreter, with the XNNPACK delegate where the SKU asks for it.

Conversion runs in the converter's own environment (pipeline/backends/litert_converter: onnx2tf
and TensorFlow, pinned by its requirements.lock, whose sha256 is in the engine's versions and so in
its manifest). onnx2tf changes the layout to NHWC inside the model; ONNX inputs keep their layout
(a transpose inside the engine), and each output is compared with ONNX Runtime's on a probe sample
to record the transpose that gives it back in ONNX layout (``outputs[].perm``), which the runner
applies: an application on a device must do the same.

FP32; FP16 is FP16 weights (dequantized at load; XNNPACK computes in fp32 where the CPU has no fp16
arithmetic); INT8 is full-integer, calibrated on the model's calibration set, with int8 inputs and
outputs where ``int8_io`` asks (the runner then quantizes the float inputs and dequantizes the
outputs with the engine's own scales, as a device application would).

The build report's layers are the flatbuffer's ops: which the delegate took (device ``xnnpack``)
and which stayed on LiteRT's built-in kernels (device ``cpu``), the precision each runs in (from
its tensors' types), and the ONNX nodes each computes (``fused_from``, matched by value on the
probe sample by the converter). The delegate's partitions and the transposes the layout change
added are in the engine metadata and the build warnings.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.backends import litert_converter
from pipeline.backends.base import Backend
from pipeline.backends.contract import BuildContext, BuildOutcome, Capabilities, EngineMeta, Runner, Staged
from pipeline.backends.emulated import EmulatedInterpreter, Worker, check_versions, emulated_runner
from pipeline.backends.opset import convert_opset
from pipeline.core.env import process_environment
from pipeline.core.errors import EnvironmentProblem, InputError, UnsupportedOp, first_line
from pipeline.core.io import atomic_savez, atomic_write_bytes, read_json, sha256_arrays
from pipeline.core.processes import stop_group
from pipeline.host import probe
from pipeline.model.graph import coerced_axis_nodes, default_opset
from pipeline.results.reports import LayerInfo, TensorSig

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from pipeline.project.config import SkuSpec

log = logging.getLogger(__name__)

RUNTIME = "ai-edge-litert"
TFLITE = "model.tflite"
DELEGATED = "xnnpack"  # the device of an op the XNNPACK delegate runs
BUILTIN = "cpu"  # the device of an op left on LiteRT's built-in CPU kernels
# the newest opset and IR version the converter's ONNX Runtime (1.23, requirements.lock) loads
CONVERTER_OPSET, CONVERTER_IR = 23, 11
# the ONNX ops onnx2tf 1.29 rewrites as built-in math (its replace_to_pseudo_operators)
PSEUDO_OPS = (
    *("Abs", "Acos", "Asin", "Atan", "Erf", "GatherND", "Gelu"),
    *("HardSwish", "LeakyRelu", "MatMulInteger", "Neg", "Pow", "PRelu"),
)
# ops that move, reshape or convert data: their precision is not a compute precision ("n/a")
DATA_MOVEMENT = frozenset(
    {
        "RESHAPE",
        "TRANSPOSE",
        "QUANTIZE",
        "DEQUANTIZE",
        "CAST",
        "CONCATENATION",
        "GATHER",
        "GATHER_ND",
        "PACK",
        "UNPACK",
        "PAD",
        "PADV2",
        "SLICE",
        "STRIDED_SLICE",
        "SPLIT",
        "SPLIT_V",
        "SQUEEZE",
        "EXPAND_DIMS",
        "SHAPE",
        "TILE",
        "BROADCAST_TO",
        "DEPTH_TO_SPACE",
        "SPACE_TO_DEPTH",
    }
)
_PRECISIONS = {
    "int8": "int8",
    "uint8": "int8",
    "int16": "int16",
    "float16": "fp16",
    "float32": "fp32",
    "int32": "int32",
    "int64": "int64",
    "bool": "bool",
}


class LiteRtOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    delegate: Literal["xnnpack", "none"] = Field(
        "xnnpack", description="xnnpack: the XNNPACK delegate takes what it can; none: LiteRT's built-in kernels"
    )
    num_threads: int = Field(1, ge=1, le=256, description="interpreter and delegate threads")
    per_channel: bool = Field(True, description="INT8: per-channel weight scales (false: per tensor)")
    int8_io: bool = Field(False, description="INT8: int8 inputs and outputs (full-integer I/O, as NPUs need)")
    pseudo_ops: list[str] = Field(
        default_factory=lambda: ["Erf"],
        description="ONNX ops with no LiteRT built-in kernel that onnx2tf rewrites as built-in math "
        "(Erf: Abramowitz-Stegun 7.1.26, |error| <= 1.5e-7); without it they need TensorFlow's Flex ops",
    )
    xnnpack_rewrites: bool = Field(
        True,
        description="rewrite what would become ops XNNPACK has no kernel for, or runs slowly, as equal ops it "
        "runs well: HardSigmoid (RELU_0_TO_1) as Mul, Add, Clip(0, 1) before onnx2tf; RESIZE_NEAREST_NEIGHBOR by 2^k "
        "as CONCATENATION + DEPTH_TO_SPACE and TRANSPOSE_CONV with kernel = stride as a 1x1 CONV_2D + "
        "DEPTH_TO_SPACE in the flatbuffer; recorded in the build report's options.graph_rewrites",
    )
    convert_timeout_s: int = Field(1800, ge=10, description="the converter's time limit")


class IoTensor(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str  # the ONNX name
    index: int  # the interpreter's tensor index
    dtype: str  # the engine's dtype (int8 where int8_io)
    shape: list[int]  # the engine's shape (onnx2tf makes an ONNX scalar [1]: the runner reshapes)
    quantization: list[float] | None = None  # [scale, zero_point] of an int8 tensor the runner converts
    perm: list[int] | None = None  # output: the transpose back to ONNX layout (None: as it is)
    onnx_shape: list[int] | None = None  # output: the ONNX shape where the engine's differs (a scalar as [1])
    onnx_dtype: str | None = None  # output: the ONNX dtype where the engine's differs (int64 as int32)


class LiteRtMeta(EngineMeta):
    tflite: str
    delegate: Literal["xnnpack", "none"]
    num_threads: int
    inputs: list[IoTensor]
    outputs: list[IoTensor]
    onnx_inputs: list[TensorSig]
    partitions: int  # delegate partitions (DELEGATE nodes) when built
    layout: dict[str, int]  # TRANSPOSE ops in the engine and in the ONNX model


@functools.lru_cache(maxsize=1)
def _litert() -> Any:
    try:
        from ai_edge_litert import interpreter
    except ImportError as exc:
        raise EnvironmentProblem(f"{RUNTIME} is not installed", hint=LiteRtBackend.install_hint) from exc
    return interpreter


def runtime_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(RUNTIME)
    except PackageNotFoundError:
        return "not installed"


def interpreter(model: Path, delegate: str, num_threads: int) -> Any:
    """The flatbuffer loaded, tensors allocated: XNNPACK applied (LiteRT's default delegate) or not."""
    lite = _litert()
    resolver = (
        lite.OpResolverType.AUTO if delegate == "xnnpack" else lite.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
    )
    try:
        interp = lite.Interpreter(
            model_path=str(model),
            num_threads=num_threads,
            experimental_op_resolver_type=resolver,
        )
        interp.allocate_tensors()
    except (RuntimeError, ValueError) as exc:
        raise InputError(
            f"LiteRT {runtime_version()} could not load {model}: {first_line(exc)}",
            hint="the file is not a flatbuffer this LiteRT runs: rebuild the engine (skuforge build, or dvc repro)",
        ) from exc
    return interp


class LiteRtRunner(Runner):
    """One interpreter per calling thread (an interpreter is not thread-safe). ``worker``: the
    engine's interpreter is an aarch64 LiteRT under emulation (pipeline/backends/emulated)."""

    def __init__(self, model: Path, meta: LiteRtMeta, worker: Worker | None = None):
        super().__init__(meta.onnx_inputs, [o.name for o in meta.outputs])
        self._model, self._meta, self._worker = model, meta, worker
        self._local = threading.local()
        self._interpreter()  # load now: a damaged engine fails here, not at the first call

    def _interpreter(self) -> Any:
        interp = getattr(self._local, "interp", None)
        if interp is None:
            if self._worker is not None:
                interp = EmulatedInterpreter(self._worker, [t.index for t in self._meta.outputs])
            else:
                interp = interpreter(self._model, self._meta.delegate, self._meta.num_threads)
            self._local.interp = interp
        return interp

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import numpy as np

        interp = self._interpreter()
        for tensor in self._meta.inputs:
            arr = feeds[tensor.name]
            if tensor.quantization is not None:
                scale, zero = tensor.quantization
                arr = np.clip(np.round(arr / scale) + zero, -128, 127).astype(np.int8)
            if list(arr.shape) != tensor.shape:
                arr = arr.reshape(tensor.shape)
            interp.set_tensor(tensor.index, arr)
        try:
            interp.invoke()
        except RuntimeError as exc:
            raise InputError(f"LiteRT could not run {self._model}: {first_line(exc)}") from exc
        out = {}
        for tensor in self._meta.outputs:
            value = interp.get_tensor(tensor.index)
            if tensor.quantization is not None:
                scale, zero = tensor.quantization
                value = ((value.astype(np.float32) - zero) * scale).astype(np.float32)
            if tensor.perm is not None and len(tensor.perm) == value.ndim and tensor.perm != list(range(value.ndim)):
                value = np.transpose(value, tensor.perm)
            if tensor.onnx_shape is not None and list(value.shape) != tensor.onnx_shape:
                value = value.reshape(tensor.onnx_shape)
            out[tensor.name] = np.array(value, dtype=tensor.onnx_dtype or value.dtype)
        return out


class LiteRtBackend(Backend):
    name = "litert"
    Options = LiteRtOptions
    Meta = LiteRtMeta
    capabilities = Capabilities(
        precisions=("fp32", "fp16", "int8"),
        devices=("cpu",),
        runtime_package=RUNTIME,
        per_node_precision=True,  # INT8: the ops of the named nodes stay float
        calibration="samples",
    )
    install_hint = (
        "pip install 'skuforge[litert]' (the ai-edge-litert runtime); to build, also "
        "python -m pipeline.backends.litert_converter (the onnx2tf/TensorFlow converter environment)"
    )
    engine_format = "skuforge-litert/1"
    runtime_keys = ("ai-edge-litert",)
    emulation = True

    @classmethod
    def _check_sku_impl(cls, sku: SkuSpec, options: LiteRtOptions) -> list[str]:
        problems = []
        if sku.profiles:
            problems.append("profiles: a LiteRT engine is built at static shapes here; pin the axes in shapes instead")
        if options.int8_io and sku.precision != "int8":
            problems.append(f"options.int8_io: int8 inputs and outputs need precision int8, not {sku.precision}")
        known = {op.lower() for op in PSEUDO_OPS}
        unknown = [op for op in options.pseudo_ops if op.lower() not in known]
        if unknown:
            problems.append(
                f"options.pseudo_ops: {', '.join(unknown)} cannot be rewritten by onnx2tf; it rewrites "
                + ", ".join(PSEUDO_OPS)
            )
        return problems

    def cross_compiles(self, sku: SkuSpec) -> bool:
        return True  # a .tflite is portable: built on any host, validated where the target runs it

    def environment_problems(self, sku: SkuSpec, purpose: str = "run") -> list[str]:
        problems = []
        try:
            _litert()
        except EnvironmentProblem as exc:
            problems.append(f"{exc.message} ({self.install_hint})")
        if purpose == "build":
            problems += [
                f"{p} (make it: python -m pipeline.backends.litert_converter)" for p in litert_converter.problems()
            ]
        return problems

    def versions(self) -> dict[str, str]:
        pins = litert_converter.lock_versions()
        return {
            RUNTIME: runtime_version(),
            "onnx2tf": pins.get("onnx2tf", "unknown"),
            "tensorflow": pins.get("tensorflow", "unknown"),
            "converter_lock": litert_converter.lock_sha256()[:16],
        }

    @classmethod
    def config_fingerprint(cls) -> dict[str, str]:
        return {
            "litert_converter_lock": litert_converter.lock_sha256(),
            "litert_converter_script": litert_converter.script_sha256(),
        }

    def _adapt(self, model: onnx.ModelProto, ctx: BuildContext, staged: Staged) -> onnx.ModelProto:
        """Opset 13 where a pre-13 Softmax's axis coerces its input to 2-D (onnx2tf reads the axis as
        opset 13 does); at most the converter's newest opset and IR version."""
        coerced = coerced_axis_nodes(model)
        target, reason = default_opset(model), ""
        if coerced:
            target, reason = 13, f"onnx2tf reads the pre-13 axis of {', '.join(coerced[:3])} as opset 13's"
        elif target > CONVERTER_OPSET:
            target, reason = CONVERTER_OPSET, f"the converter's ONNX Runtime runs opsets up to {CONVERTER_OPSET}"
        model, conversion = convert_opset(model, target, ctx.probe_inputs, reason)
        model.ir_version = min(model.ir_version, CONVERTER_IR)
        if conversion is not None:
            staged.warnings.append(conversion.warning())
            staged.notes["opset_conversion"] = conversion.to_json()
        return model

    def _convert_precision(self, ctx: BuildContext, staged: Staged) -> None:
        """The converter quantizes (INT8) and halves the weights (FP16) itself: the ONNX stays FP32."""

    def _build_impl(self, ctx: BuildContext, staged: Staged) -> BuildOutcome:
        import numpy as np

        opts: LiteRtOptions = staged.options
        precision = ctx.sku_spec.precision
        graph = staged.model.graph
        initializers = {i.name for i in graph.initializer}
        onnx_inputs = [i.name for i in graph.input if i.name not in initializers]
        request: dict[str, Any] = {
            "onnx": str(staged.source),
            "work": str(staged.work / "convert"),
            "out": str(staged.work / TFLITE),
            "result": str(staged.work / "result.json"),
            "precision": precision,
            "inputs": onnx_inputs,
            "outputs": [o.name for o in graph.output],
            "probe": str(staged.work / "probe.npz"),
            "per_channel": opts.per_channel,
            "int8_io": opts.int8_io,
            "pseudo_ops": list(opts.pseudo_ops),
            "xnnpack_rewrites": opts.xnnpack_rewrites,
            "keep_nodes": list(ctx.keep_precise) if precision == "int8" else [],
        }
        atomic_savez(staged.work / "probe.npz", **{k: np.ascontiguousarray(v) for k, v in ctx.probe_inputs.items()})
        calibration = None
        if precision == "int8":
            if not ctx.calibration_batches:
                raise InputError(
                    f"INT8 build of {ctx.model} for {ctx.sku} needs the calibration set",
                    hint=f"run: skuforge data --model {ctx.model} (its set: models.{ctx.model}.datasets.calibration)",
                )
            # the batches stacked on a new first axis: each is one call's input (a scalar input stays one)
            arrays = {name: np.stack([batch[name] for batch in ctx.calibration_batches]) for name in onnx_inputs}
            atomic_savez(staged.work / "calibration.npz", **arrays)
            request["calibration"] = str(staged.work / "calibration.npz")
            calibration = {
                "format": "TFLite full-integer",
                "method": "TFLite converter calibration (min/max over the representative dataset)",
                "samples": len(ctx.calibration_batches),
                "batches_sha256": sha256_arrays(arrays),  # the preprocessed batches calibrated on
                "per_channel": opts.per_channel,
                "int8_io": opts.int8_io,
                "nodes_to_exclude": list(ctx.keep_precise),
            }
        (staged.work / "convert").mkdir()
        result = _run_converter(staged.work, request, opts.convert_timeout_s)
        if not result.get("ok"):
            raise _conversion_error(result.get("error") or {}, staged.model, ctx)
        tflite = ctx.engine_dir / TFLITE
        atomic_write_bytes(tflite, (staged.work / TFLITE).read_bytes())
        interp = interpreter(tflite, opts.delegate, opts.num_threads)
        layers, partitions, boundaries = engine_layers(interp, result.get("ops", []))
        inputs, outputs = _io(interp, result, onnx_inputs, {o.name: _onnx_sig(o) for o in graph.output})
        onnx_transposes = sum(1 for n in graph.node if n.op_type == "Transpose")
        transposes = sum(1 for layer in layers if layer.op_type == "TRANSPOSE")
        warnings = _warnings(ctx, opts, result, layers, partitions, transposes - onnx_transposes)
        if calibration is not None:
            calibration["nodes_kept_float"] = result.get("denylisted", [])
        meta = LiteRtMeta(
            tflite=TFLITE,
            delegate=opts.delegate,
            num_threads=opts.num_threads,
            inputs=inputs,
            outputs=outputs,
            onnx_inputs=[_onnx_sig(v) for v in graph.input if v.name not in initializers],
            partitions=partitions,
            layout={"engine_transposes": transposes, "onnx_transposes": onnx_transposes},
            host_cpu=probe.cpu_record(),
            # built-in ops only: any LiteRT with the flatbuffer schema runs it
            portable=not any(layer.op_type in ("CUSTOM", "DELEGATE") for layer in layers),
        )
        return BuildOutcome(
            files=[TFLITE],
            layers=layers,
            requested_devices=[DELEGATED if opts.delegate == "xnnpack" else BUILTIN],
            partition_boundaries=boundaries,
            options={
                **opts.model_dump(mode="json"),
                "converter": result.get("versions", {}),
                "opset_conversion": staged.notes.get("opset_conversion"),
                # [{rewrite, from, to, nodes}]: what the converter rewrote for XNNPACK, by ONNX node
                "graph_rewrites": result.get("rewrites", []),
            },
            calibration=calibration,
            warnings=warnings,
            meta=meta,
        )

    def _load_impl(self, engine_dir: Path, meta: LiteRtMeta, sku: SkuSpec) -> Runner:
        return LiteRtRunner(engine_dir / meta.tflite, meta)

    def _load_emulated_impl(self, engine_dir: Path, meta: LiteRtMeta, sku: SkuSpec) -> Runner:
        load = {
            "runtime": "litert",
            "model": str(engine_dir / meta.tflite),
            "delegate": meta.delegate,
            "num_threads": meta.num_threads,
        }
        worker = Worker(load, str(engine_dir))
        try:
            check_versions(worker, meta.versions, self.runtime_keys, engine_dir)
            return emulated_runner(LiteRtRunner(engine_dir / meta.tflite, meta, worker), worker)
        except BaseException:
            worker.close()
            raise


def _onnx_sig(value: Any) -> TensorSig:
    import onnx

    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in value.type.tensor_type.shape.dim]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name
    return TensorSig(name=value.name, dtype=dtype, shape=dims)


def _run_converter(work: Path, request: dict[str, Any], timeout_s: int) -> dict[str, Any]:
    """convert.py in the converter's environment; its result file (or EnvironmentProblem)."""
    path = work / "request.json"
    path.write_text(json.dumps(request))
    env = dict(process_environment())
    bin_dir = str(litert_converter.python().parent)
    # onnx2tf runs onnxsim from PATH; TensorFlow's C++ logs and GPU probing are noise here
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONPATH", None)
    logfile = work / "convert.log"
    try:
        code = litert_converter.Server.convert(path, work, env, logfile, timeout_s)
    except subprocess.TimeoutExpired:
        raise _timed_out(timeout_s) from None
    if code is None:  # no conversion server here: convert.py on its own
        code = _run_once(path, work, env, logfile, timeout_s)
    result_path = Path(request["result"])
    if code < 0:  # a signal we did not send: the converter crashed on this model
        text = logfile.read_text(errors="replace")
        steps = re.findall(r"^skuforge-convert: (.*)$", text, re.M)
        log.warning("LiteRT converter log (last lines):\n%s", text[-4000:])
        raise UnsupportedOp(
            "litert",
            None,
            None,
            f"the converter (TensorFlow {litert_converter.lock_versions().get('tensorflow')}) crashed with "
            f"{_signal_name(-code)} at step '{steps[-1] if steps else 'start'}' on this model",
            hint="keep this model off this LiteRT SKU (a crash at the INT8 steps may spare FP32), "
            "or report the model to TensorFlow with the log above",
        )
    if code != 0 or not result_path.is_file():
        tail = logfile.read_text(errors="replace").strip().splitlines()[-5:]
        raise EnvironmentProblem(
            f"the LiteRT converter failed (exit status {code}): {' | '.join(tail) or 'no output'}",
            hint="remake its environment: python -m pipeline.backends.litert_converter --force",
        )
    result = read_json(result_path)
    if not isinstance(result, dict):
        raise EnvironmentProblem("the LiteRT converter wrote a result that is not a JSON object")
    if not result.get("ok"):  # the staging folder goes with the build: its log is printed now
        log.warning("LiteRT converter log (last lines):\n%s", logfile.read_text(errors="replace")[-4000:])
    return result


def _run_once(path: Path, work: Path, env: dict[str, str], logfile: Path, timeout_s: int) -> int:
    """convert.py as a process of its own: its exit status."""
    with open(logfile, "w") as out:
        proc = subprocess.Popen(
            [str(litert_converter.python()), str(litert_converter.SCRIPT), str(path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=work,
            env=env,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            raise _timed_out(timeout_s) from None
        except BaseException:  # Ctrl-C, SIGTERM, the stage budget: the converter goes with us
            stop_group(proc)
            raise
    return code


def _timed_out(timeout_s: int) -> EnvironmentProblem:
    return EnvironmentProblem(
        f"the LiteRT converter did not finish in {timeout_s} s",
        hint="raise the SKU's options.convert_timeout_s, or report the model to onnx2tf",
    )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _conversion_error(error: dict[str, Any], model: Any, ctx: BuildContext) -> Exception:
    """The converter's failure as skuforge's error: an op it cannot convert is UnsupportedOp."""
    message = str(error.get("message") or "unknown failure")
    op, node = error.get("op"), error.get("node")
    stage = error.get("stage")
    by_name = {n.name: n for n in model.graph.node}
    if stage in ("onnx2tf", "tflite") and (op or node in by_name):
        if node in by_name:
            op = by_name[node].op_type
        else:  # a TensorFlow op the converter found no node for (Erf): a node of that type, if there is one
            same = [n for n in model.graph.node if n.op_type.lower() == str(op).lower()]
            if same:
                op, node = same[0].op_type, same[0].name or same[0].output[0]
        return UnsupportedOp(
            "litert",
            str(op),
            node,
            message,
            hint="keep this model off LiteRT SKUs, replace the op in the model, or (an op onnx2tf can rewrite "
            "as built-in math) add it to the SKU's options.pseudo_ops",
        )
    if stage == "io":
        return InputError(message, hint="report the model to skuforge: its inputs did not survive the conversion")
    return EnvironmentProblem(
        f"LiteRT conversion of {ctx.model} for {ctx.sku} failed: {message}",
        hint="the converter's log is printed above; report the model with it to onnx2tf or skuforge",
    )


def engine_layers(interp: Any, mapped: list[dict[str, Any]]) -> tuple[list[LayerInfo], int, int]:
    """The flatbuffer's ops as loaded: each op's device (the delegate's or the built-in kernels'),
    precision, and ONNX nodes; the number of delegate partitions; the edges between devices."""
    ops = interp._get_ops_details()
    tensors = {d["index"]: d for d in interp.get_tensor_details()}
    original = [op for op in ops if op["op_name"] != "DELEGATE"]
    delegates = [op for op in ops if op["op_name"] == "DELEGATE"]
    producer = {int(t): op["index"] for op in original for t in op["outputs"] if t >= 0}
    by_index = {op["index"]: op for op in original}
    covered: dict[int, int] = {}
    for d in delegates:
        stop = {int(t) for t in d["inputs"] if t >= 0}
        todo = [int(t) for t in d["outputs"] if t >= 0]
        while todo:
            p = producer.get(todo.pop())
            if p is None or p in covered:
                continue
            covered[p] = d["index"]
            todo += [int(t) for t in by_index[p]["inputs"] if t >= 0 and int(t) not in stop]
    fused = _onnx_nodes(original, tensors, mapped)
    layers, device_of = [], {}
    for op in original:
        device = DELEGATED if op["index"] in covered else BUILTIN
        device_of[op["index"]] = device
        types = {tensors[int(t)]["dtype"].__name__ for t in [*op["inputs"], *op["outputs"]] if t >= 0}
        layers.append(
            LayerInfo(
                name=f"{op['op_name']}@{op['index']}",
                op_type=op["op_name"],
                device=device,
                precision=_precision(op["op_name"], types),
                kernel=f"{device}:{op['op_name']}",
                fused_from=fused.get(op["index"], []),
            )
        )
    boundaries = sum(
        1
        for op in original
        for t in op["inputs"]
        if t >= 0 and int(t) in producer and device_of[producer[int(t)]] != device_of[op["index"]]
    )
    return layers, len(delegates), boundaries


def _onnx_nodes(ops: list[dict], tensors: dict[int, dict], mapped: list[dict[str, Any]]) -> dict[int, list[str]]:
    """Op index -> the ONNX nodes it computes, from the converter's map of the FP32 flatbuffer's ops.
    An FP16 or INT8 flatbuffer has the same ops plus (de)quantizations; an op is the FP32 op of the
    same type and output name (its first ';' part: the converter appends constants' names), else of
    the same type and rank among the ops of that type."""

    def key(name: str | None) -> str:
        return (name or "").split(";")[0]

    by_name = {(m["op"], key(m.get("tensor"))): m.get("nodes", []) for m in mapped}
    by_rank: dict[str, list[list[str]]] = {}
    for m in mapped:
        by_rank.setdefault(m["op"], []).append(m.get("nodes", []))
    found, seen = {}, dict.fromkeys(by_rank, 0)
    for op in ops:
        name = op["op_name"]
        outs = [int(t) for t in op["outputs"] if t >= 0]
        nodes = by_name.get((name, key(tensors[outs[0]]["name"] if outs else None)))
        rank = seen.get(name, 0)
        if nodes is None and rank < len(by_rank.get(name, [])):
            nodes = by_rank[name][rank]
        if name in seen:
            seen[name] += 1
        found[op["index"]] = list(nodes or [])
    return found


def _precision(op: str, types: set[str]) -> str | None:
    if op in DATA_MOVEMENT:
        return "n/a"
    for dtype in _PRECISIONS:
        if dtype in types:
            return _PRECISIONS[dtype]
    return None


def _io(
    interp: Any, result: dict[str, Any], onnx_inputs: list[str], onnx_outputs: dict[str, TensorSig]
) -> tuple[list[IoTensor], list[IoTensor]]:
    """The engine's inputs and outputs by ONNX name, through the flatbuffer's serving signature."""
    signature = interp._get_full_signature_list().get("serving_default")
    if not signature:
        raise InputError("the converted flatbuffer has no serving signature to name its inputs and outputs")
    details = {d["index"]: d for d in [*interp.get_input_details(), *interp.get_output_details()]}

    def tensor(name: str, index: int, perm: list[int] | None = None, onnx: Any = None) -> IoTensor:
        d = details[index]
        scale, zero = d["quantization"]
        quantized = d["dtype"].__name__ == "int8" and scale
        shape = [int(x) for x in d["shape"]]
        dtype = d["dtype"].__name__
        onnx_shape = onnx_dtype = None
        if onnx is not None:
            want = [x if isinstance(x, int) else None for x in onnx.shape]
            permuted = [shape[i] for i in perm] if perm else shape
            # a scalar as [1], say; a shape that differs otherwise is left for validate to refuse
            if None not in want and permuted != want and [d for d in permuted if d != 1] == [d for d in want if d != 1]:
                onnx_shape = want
            if onnx.dtype != dtype and not quantized:
                onnx_dtype = onnx.dtype
        return IoTensor(
            name=name,
            index=index,
            dtype=dtype,
            shape=shape,
            quantization=[float(scale), float(zero)] if quantized else None,
            perm=perm,
            onnx_shape=onnx_shape,
            onnx_dtype=onnx_dtype,
        )

    keys = result.get("inputs", {})
    inputs = [tensor(name, signature["inputs"][keys[name]]) for name in onnx_inputs]
    outputs = []
    for out in result.get("outputs", []):
        if out.get("key") not in signature["outputs"]:
            raise InputError(f"the converted flatbuffer has no output for ONNX output {out.get('name')!r}")
        outputs.append(
            tensor(out["name"], signature["outputs"][out["key"]], out.get("perm"), onnx_outputs.get(out["name"]))
        )
    return inputs, outputs


def _warnings(
    ctx: BuildContext,
    opts: LiteRtOptions,
    result: dict[str, Any],
    layers: list[LayerInfo],
    partitions: int,
    added_transposes: int,
) -> list[str]:
    warnings = []
    if opts.delegate == "xnnpack":
        kept = [layer for layer in layers if layer.device == BUILTIN and layer.precision != "n/a"]
        if kept or partitions > 1:
            ops = sorted({layer.op_type for layer in kept})
            warnings.append(
                f"XNNPACK took the model in {partitions} partition(s); {len(kept)} compute op(s) stay on LiteRT's "
                f"built-in kernels{': ' + ', '.join(ops) if ops else ''}"
            )
    if added_transposes > 0:
        warnings.append(f"the NCHW->NHWC layout change added {added_transposes} TRANSPOSE op(s) to the engine")
    unchecked = [o["name"] for o in result.get("outputs", []) if not o.get("checked")]
    if unchecked:
        warnings.append(
            f"output(s) {', '.join(unchecked)}: layout not confirmed against ONNX Runtime on the probe sample; "
            "validate compares them as the engine gives them"
        )
    missing = result.get("keep_not_found") or []
    if missing:
        warnings.append(
            "nodes to keep in float with no op of their own in the flatbuffer (folded or fused away): "
            + ", ".join(missing)
        )
    if ctx.sku_spec.precision == "int8" and ctx.spec.calibration.method != "minmax":
        warnings.append(
            f"INT8: the TFLite converter calibrates by min/max; calibration.method {ctx.spec.calibration.method} "
            "applies to the QDQ backends only"
        )
    if ctx.keep_precise and ctx.sku_spec.precision == "fp16":
        warnings.append("FP16 on LiteRT is FP16 weights only: nodes to keep precise are ignored (they compute in fp32)")
    if ctx.sku_spec.target.arch != probe.host_arch():
        warnings.append(
            f"the delegate placement was read on this {probe.host_arch()} host; the {ctx.sku_spec.target.arch} "
            "device's validate stage reads its own"
        )
    return warnings
