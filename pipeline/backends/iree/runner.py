"""The IREE runner: a VM flatbuffer on the local-task, Vulkan or CUDA driver, inputs bound to device
buffers without per-call conversions."""

from __future__ import annotations

import functools
import logging
import math
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.backends.contract import Runner
from pipeline.backends.iree.common import DRIVERS, HOST_ALIGNMENT, IreeMeta
from pipeline.core.errors import EnvironmentProblem, InputError, first_line

if TYPE_CHECKING:
    import numpy as np


logger = logging.getLogger(__name__)

logger = logging.getLogger(__name__)


class IreeRunner(Runner):
    """A loaded vmfb on one HAL device. Calls are serialised: an IREE VM context is not safe to
    invoke from several threads at once.

    On the local (CPU) drivers a call does what ``iree-benchmark-module`` does and no more: the
    argument list is built once and reused, each input a host buffer imported into the device once
    (the caller's own array, without a copy, where it is aligned as IREE's kernels assume; else a
    runner-owned aligned array the feed is copied into), the function handle looked up at load; the
    outputs are copied from their mapped buffers into new arrays (a caller keeps them; an output may
    be the input's own buffer, which the next call overwrites). Other drivers copy every input into
    a new device buffer per call and read outputs through a staging buffer where the host cannot map
    them (``_read``)."""

    def __init__(self, vmfb: Path, meta: IreeMeta):
        import iree.runtime as rt
        import numpy as np

        super().__init__(list(meta.inputs), [o.name for o in meta.outputs])
        self._rt, self._np = rt, np
        self._out_dtypes = [np.dtype(o.dtype) for o in meta.outputs]
        self._lock = threading.Lock()
        driver, entry = meta.driver, meta.entry
        try:
            self._config = rt.Config(driver)
            self._context = rt.SystemContext(config=self._config)
            module = rt.VmModule.copy_buffer(self._config.vm_instance, vmfb.read_bytes())
            self._context.add_vm_module(module)
        except (RuntimeError, ValueError) as exc:
            detail = first_line(exc)
            raise InputError(
                f"{vmfb} cannot be loaded on the IREE {driver} driver: {detail}",
                hint="the file is damaged, from another IREE version or for another device: rebuild the engine",
            ) from exc
        self._device, self._driver = self._config.device, driver
        self._allocator = self._device.allocator
        from iree.runtime.array_interop import map_dtype_to_element_type

        # the per-call lookups cost ~0.7 us (input dtype) and ~3 us (output element type): kept as met
        self._element_type = functools.lru_cache(maxsize=None)(map_dtype_to_element_type)
        self._raw_dtype = functools.lru_cache(maxsize=None)(rt.HalElementType.map_to_dtype)
        self._host_visible, self._mapping = int(rt.MemoryType.HOST_VISIBLE), int(rt.BufferUsage.MAPPING_SCOPED)
        self._function = module.lookup_function(entry)
        if self._function is None:
            raise InputError(
                f"{vmfb} has no function {entry!r} (it has {', '.join(module.function_names)})",
                hint="engine.json and the vmfb disagree: rebuild the engine",
            )
        self._vm_context = self._context.vm_context
        self._local_driver = driver in DRIVERS["local"]
        self._input_names = [sig.name for sig in self.inputs]
        # per input: (the caller's array imported as it is, or None where the feed is copied into
        # ``host``; host: the array the device reads; the imported buffer, kept while it is bound;
        # host's shape and dtype)
        self._bound: list[Any] = [None] * len(self.inputs)
        self._args: Any = None  # the VmVariantList of the bound inputs; None: build it again
        self._out_raw: list[Any] = [None] * len(self.output_names)  # per output, (returned dtype, cast to)

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``Runner.infer``, but for the bench loop's case on a local driver: feeds of the shapes
        and dtypes of the inputs bound at the last call (which passed every check then), each the
        same array as was imported or one to copy into the bound one, run without checking them
        again. Written for the fewest interpreter steps: right after the dispatches each costs
        several times what it does in a tight loop."""
        with self._lock:
            args = self._args
            if args is not None:
                try:
                    for name, slot in zip(self._input_names, self._bound):  # noqa: B905 (one per input)
                        arr = feeds[name]
                        if arr.shape != slot[3] or arr.dtype is not slot[4]:
                            break
                        if slot[0] is None:
                            self._np.copyto(slot[1], arr)
                        elif slot[0] is not arr:
                            break
                    else:
                        return self._invoke(args)
                except (KeyError, TypeError, AttributeError):  # not given, not bound, not an array: the checks say
                    pass
        return super().infer(feeds)

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            args = self._bind_inputs(feeds) if self._local_driver else None
            if args is None:  # not a local driver, or it cannot import host memory: copies, per call
                args = self._copy_inputs(feeds)
            return self._invoke(args)

    def _invoke(self, args: Any) -> dict[str, np.ndarray]:
        """Run the function on ``args`` (the lock held); its outputs, copied."""
        rt = self._rt
        results = rt.VmVariantList(len(self.output_names))
        try:
            self._vm_context.invoke(self._function, args, results)
        except (RuntimeError, ValueError) as exc:  # the runtime's status: a failed assertion, a lost device
            raise EnvironmentProblem(
                f"the IREE {self._driver} runtime failed to run the engine: {exc}",
                hint="the engine and this device or runtime disagree: rebuild it for this SKU, or check the device",
            ) from exc
        if not self._local_driver:
            return {
                name: self._read(results.get_as_object(i, rt.HalBufferView), dtype)
                for i, (name, dtype) in enumerate(zip(self.output_names, self._out_dtypes, strict=True))
            }
        # host memory: each output's mapping copied into a new array, in as few numpy calls as can
        # be (right after the dispatches each costs ~2 us, ~4x its cost in a tight loop: asarray
        # ~8 us, frombuffer + reshape + copy ~6, ndarray + copy ~3.5); its element type read once
        ndarray, view_type, out = self._np.ndarray, rt.HalBufferView, {}
        for i, name in enumerate(self.output_names):
            view = results.get_as_object(i, view_type)
            raw = self._out_raw[i]
            if raw is None:  # the dtype the module returns, and the engine's where they differ
                dtype = self._raw_dtype(view.element_type)
                raw = self._out_raw[i] = (dtype, None if dtype == self._out_dtypes[i] else self._out_dtypes[i])
            host = ndarray(view.shape, raw[0], view.map()).copy()
            out[name] = host if raw[1] is None else host.astype(raw[1])
        return out

    def _copy_inputs(self, feeds: dict[str, np.ndarray]) -> Any:
        """The arguments as new device buffers holding copies of the feeds (any driver)."""
        rt, np = self._rt, self._np
        args = rt.VmVariantList(len(self.inputs))
        for name in self._input_names:
            arr = np.asarray(feeds[name], order="C")  # keeps 0-d arrays 0-d
            args.push_ref(
                self._allocator.allocate_buffer_copy(
                    memory_type=rt.MemoryType.DEVICE_LOCAL,
                    allowed_usage=rt.BufferUsage.DEFAULT,
                    device=self._device,
                    buffer=arr,
                    element_type=self._element_type(arr.dtype),
                )
            )
        return args

    def _bind_inputs(self, feeds: dict[str, np.ndarray]) -> Any | None:
        """The arguments on a local driver: the host arrays bound at an earlier call, reused while
        the feeds are the same arrays (read again in place) or, for a copied input, of the same
        shape (the feed copied in); bound again otherwise. None where the runtime refuses to import
        a host array (the caller copies instead)."""
        bound, changed, asarray = self._bound, False, self._np.asarray
        for i, name in enumerate(self._input_names):
            arr, slot = asarray(feeds[name]), bound[i]  # the array itself where it is one (a scalar: a new one)
            if slot is not None and slot[3] == arr.shape and slot[4] == arr.dtype:
                if slot[0] is arr:
                    continue
                if slot[0] is None:
                    self._np.copyto(slot[1], arr)
                    continue
            try:
                bound[i], changed = self._import(arr), True
            except (RuntimeError, ValueError, TypeError, BufferError) as exc:
                logger.debug("IREE %s cannot import host arrays (%s): inputs copied per call", self._driver, exc)
                self._bound, self._args, self._local_driver = [None] * len(bound), None, False
                return None
        if changed or self._args is None:
            rt = self._rt
            args = rt.VmVariantList(len(bound))
            for slot in bound:
                args.push_ref(rt.HalBufferView(slot[2], list(slot[3]), self._element_type(slot[4])))
            self._args = args
        return self._args

    def _import(self, arr: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, Any, tuple[int, ...], Any]:
        """``arr`` imported as a device buffer without a copy where IREE's kernels can read it in
        place (C order, writable, 64-byte aligned: the CPU dispatches assume their buffers are);
        else a new aligned array holding a copy of it, imported."""
        np, rt = self._np, self._rt
        flags = arr.flags
        if flags.c_contiguous and flags.writeable and arr.ctypes.data % HOST_ALIGNMENT == 0 and arr.size:
            shared, host = arr, arr
        else:
            shared, host = None, _aligned_empty(np, arr.shape, arr.dtype)
            np.copyto(host, arr)
        buffer = self._allocator.import_host_allocation(
            host, int(rt.MemoryType.DEVICE_LOCAL), int(rt.BufferUsage.DEFAULT)
        )
        return shared, host, buffer, host.shape, host.dtype

    def _read(self, view: Any, dtype: np.dtype) -> np.ndarray:
        """Copy an output to the host. A buffer the host cannot map (Vulkan device-local memory)
        goes through a host-visible staging buffer: DeviceArray.to_host() would try to import a
        numpy allocation instead, which lavapipe refuses (minImportedHostPointerAlignment 4096)."""
        rt, np = self._rt, self._np
        raw = self._raw_dtype(view.element_type)
        buffer = view.get_buffer()
        if (buffer.memory_type() & self._host_visible) != self._host_visible or (
            buffer.allowed_usage() & self._mapping
        ) != self._mapping:
            staging = self._device.allocator.allocate_buffer(
                memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
                allowed_usage=int(rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_SCOPED),
                allocation_size=buffer.byte_length(),
            )
            sem = self._device.create_semaphore(0)
            self._device.queue_copy(buffer, staging, rt.HalFence.create_at(sem, 0), rt.HalFence.create_at(sem, 1))
            rt.HalFence.create_at(sem, 1).wait()
            buffer = staging
        host = np.array(buffer.map().asarray(list(view.shape), raw), copy=True)
        return host if host.dtype == dtype else host.astype(dtype)

    def profile_layers(self, feeds: dict[str, np.ndarray], iterations: int = 20) -> dict[str, float] | None:
        """None: the default runtime does not time its dispatches. The wheel's Tracy variant does,
        but it is chosen once per process at import (``IREE_PY_RUNTIME=tracy``) and its zones reach
        a file only through ``iree-tracy-capture`` listening on a socket, in Tracy's binary format:
        a subprocess and a capture server per profile, not cheap enough for the bench step."""
        return None

    def close(self) -> None:
        self._function = self._context = self._config = self._device = self._vm_context = None
        self._args, self._bound = None, [None] * len(self.inputs)


def _aligned_empty(np: Any, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A new C-order array of ``shape`` whose data starts on a ``HOST_ALIGNMENT`` boundary."""
    dtype = np.dtype(dtype)
    nbytes = max(1, math.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + HOST_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % HOST_ALIGNMENT
    return raw[start : start + nbytes].view(dtype)[: math.prod(shape)].reshape(shape)
