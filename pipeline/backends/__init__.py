"""The backend registry: name -> "module:Class", imported only when used.

Importing this package imports no compiler SDK; each backend imports its SDK lazily. A backend
is one module and one line in ``_BACKENDS`` (docs/backends.md, "Adding a backend"); a plugin or a
test's fake backend is added with ``register_backend`` (``registered_backend`` for a test).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
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
    "litert": "pipeline.backends.litert:LiteRtBackend",
}


def register_backend(name: str, target: str) -> None:
    """Add backend ``name``, the class ``target`` ("package.module:Class"), imported when first used.
    Registering a name again is allowed only with the same target."""
    module, _, cls = target.partition(":")
    if not name or not module or not cls.isidentifier():
        raise ValueError(f"backend {name!r}: target {target!r} is not 'package.module:Class'")
    if _BACKENDS.get(name, target) != target:
        raise ValueError(f"backend {name!r} is already registered as {_BACKENDS[name]!r}")
    _BACKENDS[name] = target


def unregister_backend(name: str) -> str:
    """Remove backend ``name`` from the table; returns its target."""
    try:
        return _BACKENDS.pop(name)
    except KeyError:
        raise ConfigError(f"unknown backend {name!r}", hint=f"known backends: {', '.join(known_backends())}") from None


@contextlib.contextmanager
def registered_backend(name: str, target: str | None) -> Iterator[None]:
    """For tests: inside the block, backend ``name`` is ``target`` (None: not registered); after it,
    the table is as it was."""
    before = _BACKENDS.get(name)
    _BACKENDS.pop(name, None)
    if target is not None:
        register_backend(name, target)
    try:
        yield
    finally:
        _BACKENDS.pop(name, None)
        if before is not None:
            _BACKENDS[name] = before


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
