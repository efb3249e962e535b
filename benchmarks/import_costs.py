"""What a fresh process pays to import each heavy dependency: CPU seconds of the import statement
alone (the module with everything it imports), median of fresh processes, on this machine.

Every `skuforge` command and DVC stage is a new process, so an import that turns slow in a new
release multiplies across a pipeline (ml_dtypes 0.7.0: 0.9 s more in every process that imports
onnx, 5 s under QEMU; pyproject.toml keeps it below 0.7). Modules over the flag are marked.

    python benchmarks/import_costs.py [--runs 5] [--with DIR]

``--with DIR`` times each module again with DIR first on the path, side by side, and prints the
ratio: e.g. the release a pin keeps out, ``pip install --no-deps --target /tmp/mld07
ml_dtypes==0.7.0`` then ``--with /tmp/mld07``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

MODULES = (
    "numpy",
    "ml_dtypes",
    "onnx",
    "onnxruntime",
    "pydantic",
    "yaml",
    "scipy.special",  # what the gates' binomial tests import (pipeline/results/gatestats.py)
    "scipy.stats",  # what they imported before: three times the cost
    "matplotlib.figure",
    "mlflow",
    "dvc.repo",
    "openvino",
    "iree.runtime",
    "iree.compiler",
    "ai_edge_litert.interpreter",
    "pipeline.backends.tvm.loading:import_tvm",  # TVM as skuforge imports it (torch hidden)
    "pipeline.cli",
)
FLAG_S = 0.3  # an import costing more than this in every process is worth a look

_PROBE = """
import importlib, sys, time
name, _, call = sys.argv[1].partition(":")
t = time.process_time()
module = importlib.import_module(name)
if call:
    getattr(module, call)()
print(time.process_time() - t)
"""


def cost(module: str, runs: int, env: dict[str, str]) -> float | None:
    """Median CPU seconds of importing ``module`` in a fresh process; None where it does not import."""
    samples = []
    for _ in range(runs):
        proc = subprocess.run([sys.executable, "-c", _PROBE, module], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            return None
        samples.append(float(proc.stdout.strip().splitlines()[-1]))
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--with", dest="other", metavar="DIR", help="also time with DIR first on the path")
    args = ap.parse_args()
    env = dict(os.environ)
    other = None
    if args.other:
        other = {**env, "PYTHONPATH": os.pathsep.join(p for p in (args.other, env.get("PYTHONPATH")) if p)}
    print(f"import CPU s, median of {args.runs} fresh processes ({sys.executable})")
    header = f"{'module':<44} {'this env':>9}"
    print(header + (f" {'--with':>9} {'ratio':>7}" if other else ""))
    for module in MODULES:
        here = cost(module, args.runs, env)
        line = f"{module:<44} {'absent' if here is None else f'{here:.3f}':>9}"
        if other is not None:
            there = cost(module, args.runs, other)
            ratio = f"{there / here:.1f}x" if here and there is not None else "-"
            line += f" {'absent' if there is None else f'{there:.3f}':>9} {ratio:>7}"
        if here is not None and here > FLAG_S:
            line += f"  over {FLAG_S} s"
        print(line)


if __name__ == "__main__":
    main()
