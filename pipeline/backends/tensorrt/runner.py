"""The TensorRT runner: a deserialised engine plan, device buffers and a stream."""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.backends.contract import Runner
from pipeline.backends.tensorrt.common import NAME
from pipeline.backends.tensorrt.sdk import cuda_call, trt_logger
from pipeline.core.errors import EnvironmentProblem, InputError, UnsupportedOp
from pipeline.results.reports import Signature

if TYPE_CHECKING:
    import numpy as np


log = logging.getLogger(__name__)


def deserialize(trt: Any, blob: bytes, host_code: bool, dla_core: int | None, path: Path) -> tuple[Any, Any]:
    """(runtime, engine); the runtime must outlive its engine."""
    logger = trt_logger(trt)
    mark = logger.mark()
    runtime = trt.Runtime(logger)
    if host_code:
        runtime.engine_host_code_allowed = True  # a version-compatible plan carries the lean runtime
    if dla_core is not None:
        runtime.DLA_core = dla_core
    engine = runtime.deserialize_cuda_engine(blob)
    if engine is None:
        why = "; ".join(logger.errors_since(mark)[-3:]) or "no reason logged"
        raise InputError(
            f"TensorRT {trt.__version__} could not load {path}: {why}",
            hint="the plan is damaged, or was built by another TensorRT version or for another GPU: "
            "rebuild it on the SKU's runner",
        )
    return runtime, engine


def io_names(trt: Any, engine: Any) -> dict[str, bool]:
    """I/O tensor name -> is an input."""
    names = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        names[name] = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
    return names


def cast_feed(array: np.ndarray, dtype: np.dtype, name: str) -> np.ndarray:
    """An input as the engine's dtype, C-contiguous (0-d arrays stay 0-d); int64 values outside
    int32 are refused when the engine takes int32."""
    import numpy as np

    if array.dtype == dtype:
        return np.asarray(array, order="C")
    if np.issubdtype(array.dtype, np.integer) and np.issubdtype(dtype, np.integer) and array.size:
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise InputError(
                f"input {name!r} holds values outside {dtype} (the engine's type for it)",
                hint="the values cannot reach TensorRT unchanged: change the model's input type",
            )
    return np.asarray(array.astype(dtype), order="C")


@dataclass
class _Slot:
    """One thread's execution context, stream and device buffers."""

    context: Any
    stream: Any
    buffers: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # name -> (pointer, bytes)

    def device(self, cudart: Any, name: str, nbytes: int) -> int:
        ptr, size = self.buffers.get(name, (0, 0))
        if size < max(nbytes, 1):
            if ptr:
                cuda_call(cudart.cudaFree(ptr), "cudaFree")
            size = max(nbytes, 1)
            ptr = int(cuda_call(cudart.cudaMalloc(size), "cudaMalloc"))
            self.buffers[name] = (ptr, size)
        return ptr


class TensorRtRunner(Runner):
    """An engine with one execution context, stream and buffers per calling thread (a context
    runs one inference at a time; the bench stage calls from several threads)."""

    def __init__(self, trt: Any, cudart: Any, runtime: Any, engine: Any, sig: Signature):
        import numpy as np

        super().__init__(sig.inputs, [o.name for o in sig.outputs])
        names = io_names(trt, engine)
        want = {t.name: True for t in sig.inputs} | {t.name: False for t in sig.outputs}
        if names != want:
            raise InputError(
                f"the engine's I/O tensors {sorted(names)} differ from its recorded signature {sorted(want)}",
                hint="rebuild the engine",
            )
        try:
            self._dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in names}
        except TypeError as exc:  # bf16, fp8, int4 have no numpy type
            raise InputError(
                f"an engine I/O tensor has a type numpy cannot hold: {exc}",
                hint="keep the model's inputs and outputs in fp32, fp16 or integer types",
            ) from exc
        self._out_dtypes = {o.name: np.dtype(o.dtype) for o in sig.outputs}
        self._cudart, self._runtime, self._engine = cudart, runtime, engine
        self._local = threading.local()
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()

    def _slot(self) -> _Slot:
        slot = getattr(self._local, "slot", None)
        if slot is None:
            context = self._engine.create_execution_context()
            if context is None:
                raise EnvironmentProblem(
                    "TensorRT could not create an execution context", hint="free GPU memory and retry"
                )
            slot = _Slot(context, cuda_call(self._cudart.cudaStreamCreate(), "cudaStreamCreate"))
            with self._lock:
                self._slots.append(slot)
            self._local.slot = slot
        return slot

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import numpy as np

        cudart, slot = self._cudart, self._slot()
        to_device = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        held = []  # host arrays stay alive until the stream is synchronised
        for sig in self.inputs:
            arr = cast_feed(feeds[sig.name], self._dtypes[sig.name], sig.name)
            if not slot.context.set_input_shape(sig.name, arr.shape):
                raise InputError(
                    f"input {sig.name!r} shape {list(arr.shape)} is outside the engine's optimization profile",
                    hint="run at the SKU's batch, or widen the SKU's profiles and rebuild",
                )
            ptr = slot.device(cudart, sig.name, arr.nbytes)
            cuda_call(
                cudart.cudaMemcpyAsync(ptr, arr.ctypes.data, arr.nbytes, to_device, slot.stream), "cudaMemcpyAsync"
            )
            slot.context.set_tensor_address(sig.name, ptr)
            held.append(arr)
        outputs = {}
        for name in self.output_names:
            shape = tuple(slot.context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise UnsupportedOp(
                    NAME,
                    None,
                    name,
                    f"output {name!r} has a data-dependent shape {list(shape)}",
                    hint="skuforge's TensorRT runner needs output shapes known from the input shapes",
                )
            host = np.empty(shape, self._dtypes[name])
            ptr = slot.device(cudart, name, host.nbytes)
            slot.context.set_tensor_address(name, ptr)
            outputs[name] = (host, ptr)
        if not slot.context.execute_async_v3(int(slot.stream)):
            raise EnvironmentProblem("TensorRT failed to run the engine", hint="see the tensorrt errors logged above")
        to_host = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        for host, ptr in outputs.values():
            cuda_call(
                cudart.cudaMemcpyAsync(host.ctypes.data, ptr, host.nbytes, to_host, slot.stream), "cudaMemcpyAsync"
            )
        cuda_call(cudart.cudaStreamSynchronize(slot.stream), "cudaStreamSynchronize")
        del held
        return {name: host.astype(self._out_dtypes[name], copy=False) for name, (host, _) in outputs.items()}

    def close(self) -> None:
        with self._lock:
            slots, self._slots = self._slots, []
        for slot in slots:
            for ptr, _ in slot.buffers.values():
                cuda_call(self._cudart.cudaFree(ptr), "cudaFree")
            cuda_call(self._cudart.cudaStreamDestroy(slot.stream), "cudaStreamDestroy")
            slot.context = None  # contexts go before their engine
        self._local = threading.local()
        self._engine = self._runtime = None  # the engine before its runtime
