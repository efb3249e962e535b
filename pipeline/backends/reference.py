"""The reference runtime: ONNX Runtime on the CPU provider, FP32, graph optimisations off.

Every engine is judged against its outputs (reference stage), graph passes and opset conversions are
checked with it, and calibration collects activation ranges with it. The ONNX Runtime *backend*
(onnxruntime.py) builds engines with the same session code."""

from __future__ import annotations

import functools
import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.backends.contract import Runner, median_per_run
from pipeline.core.errors import EnvironmentProblem, InputError, UnsupportedOp, first_line
from pipeline.core.io import atomic_write_bytes
from pipeline.results.reports import TensorSig

if TYPE_CHECKING:
    import numpy as np
    import onnxruntime as ort

CPU = "CPUExecutionProvider"

LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}


def ort_module() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise EnvironmentProblem(
            "onnxruntime is not installed", hint="pip install onnxruntime (or onnxruntime-gpu)"
        ) from exc
    return onnxruntime


def session_options(
    level: str,
    *,
    intra_op_num_threads: int = 0,
    inter_op_num_threads: int = 0,
    cpu_fallback: bool = True,
    profile_dir: Path | None = None,
) -> ort.SessionOptions:
    """Session options at graph optimisation ``level`` (disable/basic/extended/all); ``cpu_fallback``
    False: nodes no listed provider runs fail the session instead of running on the CPU."""
    ort = ort_module()
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, LEVELS[level])
    so.intra_op_num_threads = intra_op_num_threads
    so.inter_op_num_threads = inter_op_num_threads
    so.log_severity_level = 3
    if not cpu_fallback:
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if profile_dir is not None:
        so.enable_profiling = True
        so.profile_file_prefix = str(profile_dir / "ort_profile")
    return so


def create_session(
    model: Path | bytes,
    so: ort.SessionOptions,
    providers: list[str],
    provider_options: dict[str, dict[str, Any]] | None = None,
    engine: bool = False,
) -> ort.InferenceSession:
    """An ONNX Runtime session; ``engine``: ``model`` is a built engine (a refusal then means the
    engine is damaged or from another ONNX Runtime, and the hint says to rebuild it)."""
    ort = ort_module()
    provider_options = provider_options or {}
    try:
        return ort.InferenceSession(
            model if isinstance(model, bytes) else str(model),
            so,
            providers=providers,
            provider_options=[provider_options.get(p, {}) for p in providers],
        )
    except Exception as exc:  # ORT raises its own Fail/InvalidGraph/NotImplemented classes
        msg = first_line(exc)
        missing = re.search(r"Could not find an implementation for (\w+)\(\d+\) node with name '([^']*)'", msg)
        if missing or "NOT_IMPLEMENTED" in msg:
            raise UnsupportedOp(
                "onnxruntime",
                missing.group(1) if missing else None,
                missing.group(2) if missing else None,
                f"no kernel on {', '.join(providers)} ({msg})",
                hint="list a provider that implements it, or replace the op before export",
            ) from exc
        if engine:
            raise InputError(
                f"ONNX Runtime could not load the engine {'(in memory)' if isinstance(model, bytes) else model}: {msg}",
                hint="the engine is damaged or was built by another ONNX Runtime: rebuild it "
                "(skuforge build) with the onnxruntime this host runs",
            ) from exc
        raise InputError(
            f"ONNX Runtime could not load the model: {msg}",
            hint="the model is valid ONNX but this ONNX Runtime refuses it for the reason above: "
            "re-export it without what is named (for an opset: onnx.version_converter), "
            "or use another onnxruntime version",
        ) from exc


class SessionRunner(Runner):
    def __init__(self, session: ort.InferenceSession, reopen: Callable[[Path], ort.InferenceSession] | None = None):
        """``reopen(folder)``: the same engine in a new session that profiles into ``folder``."""
        inputs = [TensorSig(name=i.name, dtype=_np_dtype(i.type), shape=list(i.shape)) for i in session.get_inputs()]
        super().__init__(inputs, [o.name for o in session.get_outputs()])
        self.session = session
        self._reopen = reopen

    def profile_layers(self, feeds: dict[str, np.ndarray], iterations: int = 20) -> dict[str, float] | None:
        """Median ms per node of the engine graph (build.json layer names) over ``iterations`` runs,
        from ONNX Runtime's profiler in a second session; the first run is left out (allocation,
        first touch)."""
        if self._reopen is None:
            return None
        with tempfile.TemporaryDirectory(prefix="skuforge-prof-") as tmp:
            session = self._reopen(Path(tmp))
            named = {i.name: feeds[i.name] for i in self.inputs}
            for _ in range(iterations + 1):
                session.run(self.output_names, named)
            trace = json.loads(Path(session.end_profiling()).read_text())
        durations: dict[str, list[float]] = {}
        for name, event in node_events(trace):
            durations.setdefault(name, []).append(event["dur"] / 1e3)
        return {name: median_per_run(d, iterations + 1, skip=1) for name, d in durations.items()}

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # infer() checked every input is there: feeds of the same size hold nothing else (ONNX
        # Runtime refuses unknown names), so they go as they are. run() returns new arrays.
        if len(feeds) != len(self.inputs) or type(feeds) is not dict:
            feeds = {i.name: feeds[i.name] for i in self.inputs}
        return dict(zip(self.output_names, self.session.run(self.output_names, feeds), strict=True))


def _np_dtype(ort_type: str) -> str:
    import numpy as np

    inner = ort_type.removeprefix("tensor(").removesuffix(")")
    return np.dtype({"float": "float32", "double": "float64", "float16": "float16"}.get(inner, inner)).name


def reference_runner(model: Path | bytes) -> SessionRunner:
    """The reference: ONNX Runtime, CPU provider, FP32, graph optimisations off."""

    def open_session(profile_dir: Path | None = None) -> ort.InferenceSession:
        return create_session(model, session_options("disable", profile_dir=profile_dir), [CPU])

    return SessionRunner(open_session(), reopen=open_session)


def runtime_version() -> str:
    return ort_module().__version__


def calibrate(model: Path, batches: list[dict[str, np.ndarray]], method: str, table: Path) -> int:
    """Collect activation ranges over the calibration batches; write ONNX Runtime's table JSON."""
    ort_module()
    from onnxruntime.quantization.calibrate import (
        CalibrationDataReader,
        CalibrationMethod,
        create_calibrator,
        save_tensors_data,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter(batches)

        def get_next(self) -> dict | None:
            return next(self._it, None)

    methods = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }
    with tempfile.TemporaryDirectory(prefix="skuforge-calib-") as tmp:
        calibrator = create_calibrator(
            model, None, augmented_model_path=str(Path(tmp) / "augmented.onnx"), calibrate_method=methods[method]
        )
        calibrator.collect_data(Reader())
        ranges = calibrator.compute_data()
        staged = Path(tmp) / "table.json"
        save_tensors_data(ranges, staged)
        atomic_write_bytes(table, staged.read_bytes())
    return len(ranges.data)


@functools.lru_cache(maxsize=1)
def newest_qdq_opset() -> int | None:
    """The newest ai.onnx opset whose QuantizeLinear this onnxruntime runs (it can lag the onnx
    package: 1.32 has no QuantizeLinear-28); None when none from 13 on."""
    import onnx
    from onnx import TensorProto, helper

    ort = ort_module()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s"], ["y"])],
        "q",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [2])],
        [helper.make_tensor("s", TensorProto.FLOAT, [], [0.1])],
    )
    for opset in range(onnx.defs.onnx_opset_version(), 12, -1):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        try:
            ort.InferenceSession(model.SerializeToString(), so, providers=[CPU])
            return opset
        except Exception:  # NOT_IMPLEMENTED (no kernel) or an IR/opset this build refuses
            continue
    return None


def node_events(trace: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(node name, event) of each kernel run in an ONNX Runtime profile, in run order."""
    return [
        (ev["name"].removesuffix("_kernel_time"), ev)
        for ev in trace
        if ev.get("cat") == "Node" and ev.get("name", "").endswith("_kernel_time")
    ]
