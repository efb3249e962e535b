"""The TVM runner: a built library on the Relax VM."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.backends.contract import (
    Runner,
    median_per_run,
)
from pipeline.backends.tvm.common import TvmMeta, elf_extent_problem, runtime_threads, tvm_module, tvm_version
from pipeline.core.errors import InputError

if TYPE_CHECKING:
    import numpy as np


log = logging.getLogger(__name__)


class TvmRunner(Runner):
    """A loaded library on the Relax VM; calls are serialised (one VM, not thread-safe)."""

    def __init__(self, library: Path, meta: TvmMeta):
        super().__init__(list(meta.inputs), [o.name for o in meta.outputs])
        runtime_threads(meta.num_threads)
        tvm = tvm_module()
        from tvm import relax

        self._tvm, self._dev = tvm, tvm.cpu(0)
        self._library, self._entry = library, meta.entry
        self._lock = threading.Lock()
        self._buffers: list[Any] | None = None
        self._views: list[Any] = []  # numpy arrays on the buffers' memory (None: copied by TVM)
        problem = elf_extent_problem(library)
        if problem is not None:
            raise InputError(
                f"{library} cannot be loaded: {problem}",
                hint="the library is damaged (truncated or not a library): rebuild the engine",
            )
        try:
            self._vm = relax.VirtualMachine(tvm.runtime.load_module(str(library)), self._dev)
            self._main = self._vm[meta.entry]
        except Exception as exc:  # TVMError, OSError from dlopen: a damaged or foreign library
            detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise InputError(
                f"{library} cannot be loaded by TVM {tvm_version()}: {detail}",
                hint="the library is damaged or from another TVM build or CPU: rebuild the engine",
            ) from exc

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import numpy as np

        with self._lock:
            if self._buffers is None:  # static shapes: one device buffer per input, filled per call
                self._buffers = [
                    self._tvm.runtime.empty(feeds[s.name].shape, feeds[s.name].dtype, self._dev) for s in self.inputs
                ]
                self._views = [_host_view(b) for b in self._buffers]
            for buffer, view, sig in zip(self._buffers, self._views, self.inputs, strict=True):
                arr = feeds[sig.name]
                if view is not None and view.shape == arr.shape:  # ~1 us; Tensor.copyfrom costs ~12
                    np.copyto(view, arr)
                else:  # copyfrom refuses another shape
                    buffer.copyfrom(np.asarray(arr, order="C"))  # asarray keeps 0-d arrays 0-d
            out = self._main(*self._buffers)
            outs = [out] if hasattr(out, "shape") else list(out)
            # copied out under the lock: the VM may reuse an output's storage on the next call
            # (np.from_dlpack + copy: 1-2 us here, Tensor.numpy(): about 15)
            return {name: _to_numpy(o) for name, o in zip(self.output_names, outs, strict=True)}

    def profile_layers(self, feeds: dict[str, np.ndarray], iterations: int = 20) -> dict[str, float] | None:
        """Median ms per primitive function (build.json layer names) on a second VM over the same
        library, timed by the VM's instrument hook around each call (the VM's builtins, such as
        allocations, are left out); the first run is left out. The hook's own cost, a few
        microseconds per call, is inside the times."""

        import numpy as np
        from tvm import relax

        vm = relax.VirtualMachine(self._tvm.runtime.load_module(str(self._library)), self._dev)
        started: dict[str, float] = {}
        runs: dict[str, list[float]] = {}
        counting = False

        def instrument(func: Any, symbol: str, before: bool, ret: Any, *args: Any) -> int:
            if before:
                started[symbol] = time.perf_counter()
            elif counting and not symbol.startswith("vm.builtin."):
                runs.setdefault(symbol, []).append((time.perf_counter() - started.pop(symbol)) * 1e3)
            return 0  # VMInstrumentReturnKind.NO_OP

        vm.set_instrument(instrument)
        args = [self._tvm.runtime.tensor(np.asarray(feeds[s.name], order="C"), self._dev) for s in self.inputs]
        for i in range(iterations + 1):
            counting = i > 0
            vm[self._entry](*args)
        return {name: median_per_run(times, iterations) for name, times in runs.items()}

    def close(self) -> None:
        self._vm = self._main = self._buffers = None
        self._views = []


def _host_view(tensor: Any) -> np.ndarray | None:
    """A writable numpy array on a CPU tensor's memory; None where numpy cannot import its dtype."""
    import numpy as np

    try:
        view = np.from_dlpack(tensor)
    except (TypeError, ValueError, RuntimeError, BufferError):
        return None
    return view if view.flags.writeable else None


def _to_numpy(tensor: Any) -> np.ndarray:
    import numpy as np

    try:
        return np.from_dlpack(tensor).copy()
    except (TypeError, ValueError, RuntimeError, BufferError):  # a dtype numpy's DLPack import lacks
        return tensor.numpy()
