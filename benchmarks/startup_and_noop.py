"""Start-up and no-op pipeline times, measured side by side on this machine.

Targets (issue: the spine): `skuforge --help` under 0.3 s with no compiler SDK imported, and
`dvc repro` with nothing changed under 3 s for the example project. Run from the project root
after the example project has been built once (`skuforge repro`):

    python benchmarks/startup_and_noop.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEAVY = (
    "onnx",
    "onnxruntime",
    "numpy",
    "torch",
    "dvc",
    "pydantic",
    "jsonschema",
    "mlflow",
    "openvino",
    "iree",
    "tvm",
    "tensorrt",
)


def timed(cmd: list[str], runs: int, env: dict[str, str]) -> tuple[float, float]:
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        samples.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return statistics.median(samples), min(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    root = Path.cwd()
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    skuforge = str(Path(bindir) / "skuforge")

    base, _ = timed([sys.executable, "-c", "pass"], args.runs, env)
    helpt, _ = timed([skuforge, "--help"], args.runs, env)
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pipeline.cli import build_parser; build_parser().format_help();"
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    heavy = probe.stdout.strip() or "none"
    print(f"python -c pass          median {base * 1000:7.1f} ms")
    print(f"skuforge --help         median {helpt * 1000:7.1f} ms  (target < 300 ms; {helpt / base:.1f}x bare python)")
    print(f"  heavy modules imported by argument parsing: {heavy}")

    if not (root / "dvc.lock").is_file() or not (root / "manifests").is_dir():
        print("dvc repro no-op: skipped (run `skuforge repro` once in the example project first)")
        return
    from pipeline.ops.repro import targets
    from pipeline.project.config import load_registry

    dvc_targets, _ = targets(load_registry(root / "params.yaml"), None, None)
    status = subprocess.run(
        [str(Path(bindir) / "dvc"), "status", *dvc_targets], capture_output=True, text=True, env=env
    )
    if "up to date" not in status.stdout:
        print("dvc repro no-op: skipped (the pipeline is not up to date: run `skuforge repro` first)")
        return
    dvc, _ = timed([str(Path(bindir) / "dvc"), "repro", *dvc_targets], args.runs, env)
    one, _ = timed([str(Path(bindir) / "dvc"), "repro", dvc_targets[0]], args.runs, env)
    st, _ = timed([str(Path(bindir) / "dvc"), "status"], args.runs, env)
    sk, _ = timed([skuforge, "repro"], args.runs, env)
    print(f"dvc status (whole project)          median {st:6.2f} s")
    print(f"dvc repro (no-op, 1 target)         median {one:6.2f} s")
    print(
        f"dvc repro (no-op, {len(dvc_targets)} targets)       median {dvc:6.2f} s  (DVC re-reads dvc.lock per target)"
    )
    print(
        f"skuforge repro (no-op, same pairs)  median {sk:6.2f} s  (target < 3 s; {dvc / sk:.1f}x faster than "
        f"dvc repro of the targets: one dvc status, run while the host is checked)"
    )


if __name__ == "__main__":
    main()
