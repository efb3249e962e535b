"""TVM imported without PyTorch (pipeline/backends/tvm/loading.py): this process and the worker
processes MetaSchedule starts never import torch, and torch stays importable afterwards."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from tvm_helpers import tvm_or_skip

from pipeline.backends.tvm.loading import torch_free_command

tvm_or_skip()

TORCH = importlib.util.find_spec("torch") is not None

# in a fresh process: TVM through import_tvm, a function run in one of TVM's pool workers, then torch
PROBE = """
import json, sys
from pipeline.backends.tvm.loading import import_tvm
import_tvm()
after_import = "torch" in sys.modules
from tvm.support.popen_pool import PopenPoolExecutor

def in_worker():
    import sys
    import tvm
    return sys.modules.get("torch") is not None, tvm.__name__

pool = PopenPoolExecutor(max_workers=1)
try:
    worker = pool.submit(in_worker).result()
finally:
    pool.shutdown()
try:
    import torch
    torch_after = torch.__name__
except ImportError:
    torch_after = None
print(json.dumps({"after_import": after_import, "worker": worker, "torch_after": torch_after}))
"""


def test_tvm_and_its_workers_never_import_torch_and_torch_stays_importable():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["after_import"] is False
    assert got["worker"] == [False, "tvm"]  # the worker ran the function, with TVM and without torch
    assert got["torch_after"] == ("torch" if TORCH else None)


def test_a_torch_free_command_runs_the_module_as_main_with_its_arguments(tmp_path):
    (tmp_path / "echo_args.py").write_text(
        "import json, sys\nprint(json.dumps([__name__, sys.argv[1:], sys.modules.get('torch') is None]))\n"
    )
    proc = subprocess.run(
        torch_free_command("echo_args", "--port", "9000"), capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["__main__", ["--port", "9000"], True]
