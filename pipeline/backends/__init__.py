"""The backend registry: name -> module, imported only when used.

Importing this package imports no compiler SDK; each backend imports its SDK lazily.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pipeline.core.errors import ConfigError

if TYPE_CHECKING:
    from pipeline.backends.base import Backend

_BACKENDS: dict[str, str] = {
    "onnxruntime": "pipeline.backends.onnxruntime:OnnxRuntimeBackend",
    "openvino": "pipeline.backends.openvino:OpenVinoBackend",
    "iree": "pipeline.backends.iree:IreeBackend",
    "tensorrt": "pipeline.backends.tensorrt:TensorRtBackend",
    "tvm": "pipeline.backends.tvm:TvmBackend",
}


def known_backends() -> tuple[str, ...]:
    return tuple(sorted(_BACKENDS))


def backend_class(name: str) -> type[Backend]:
    try:
        target = _BACKENDS[name]
    except KeyError:
        raise ConfigError(f"unknown backend {name!r}", hint=f"known backends: {', '.join(known_backends())}") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def get_backend(name: str) -> Backend:
    return backend_class(name)()


def capability_table() -> list[dict]:
    """Each backend's declared capabilities (``skuforge backends``, docs/backends.md)."""
    return [{"backend": name, **backend_class(name).capabilities.to_json()} for name in known_backends()]


def runtime_packages() -> tuple[str, ...]:
    """The distributions a device may carry to run engines (the rollout agent's inventory)."""
    return tuple(sorted({backend_class(name).capabilities.runtime_package for name in known_backends()}))
