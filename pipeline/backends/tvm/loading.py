"""Importing TVM without PyTorch.

apache-tvm-ffi imports PyTorch, where it is installed, when TVM is imported (``tvm_ffi/__init__.py``,
for torch-tensor interop): 2.3 of the 4 s an ``import tvm`` takes on a 2-core host. skuforge passes
TVM no torch tensor, so its TVM processes import TVM with torch hidden: this process once
(``import_tvm``), and every worker process MetaSchedule starts (a candidate builder, a local runner:
``PopenWorker`` runs ``python -m tvm.exec.popen_worker``), which runs the same worker module behind
the same hiding (``torch_free_command``). A later ``import torch`` in this process works as before."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

# python -c TORCH_FREE MODULE ARGS: MODULE run as __main__ with ARGS as its argv, torch an ImportError in it
TORCH_FREE = (
    "import runpy, sys; sys.modules.setdefault('torch', None); module = sys.argv.pop(1); "
    "runpy.run_module(module, run_name='__main__', alter_sys=True)"
)
POPEN_WORKER = "tvm.exec.popen_worker"


def torch_free_command(module: str, *args: str) -> list[str]:
    """``python -m module args`` with PyTorch hidden from it."""
    return [sys.executable, "-c", TORCH_FREE, module, *args]


class _TorchFreeWorkers:
    """Stands in for the ``subprocess`` module inside ``tvm.support.popen_pool``: the one command
    started there, ``[python, -m, tvm.exec.popen_worker, fds...]``, starts as torch_free_command;
    everything else is subprocess's own."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def Popen(cmd: Any, *args: Any, **kwargs: Any) -> subprocess.Popen:  # noqa: N802 - subprocess's name
        if isinstance(cmd, list) and cmd[1:3] == ["-m", POPEN_WORKER]:
            cmd = [cmd[0], "-c", TORCH_FREE, POPEN_WORKER, *cmd[3:]]
        return subprocess.Popen(cmd, *args, **kwargs)


def import_tvm() -> Any:
    """``import tvm``: the first time with PyTorch hidden where this process has not imported it,
    and MetaSchedule's worker processes started torch-free. Raises ImportError without apache-tvm."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]  # an ImportError to tvm_ffi's `import torch`
    try:
        import tvm
        from tvm.support import popen_pool
    finally:
        if hide and "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
    if popen_pool.subprocess is subprocess:
        popen_pool.subprocess = _TorchFreeWorkers()
    return tvm
