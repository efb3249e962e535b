"""IREE at its best, against the tool run by hand: on the same .vmfb, ``iree-benchmark-module``
(``--device=local-task --task_topology_group_count=N``, one call per repetition) and the skuforge
runner (``runner.infer``, as the bench stage calls it) with the runtime at the same N groups.

Per engine, in interleaved rounds: each side's p50 wall time per call and its process CPU time per
call (the runner: this process's CPU time over its calls, worker threads included; the tool: the
CPU time of a run of ``--reps`` calls minus that of a run of one call, over the difference, so its
start and module load drop out). On a busy host the CPU figure is the one to read.

Run on a project whose engines are built, e.g. the one ``benchmarks/speedup.py --keep`` leaves:

    python benchmarks/iree_native.py --project /tmp/skuforge-speedup-XXXX [--model classifier ...]
                                     [--sku x86_iree_cpu_fp32] [--threads 1] [--rounds 5] [--reps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from fidelity import BIN, feeds_for  # noqa: E402

from pipeline.backends import get_backend  # noqa: E402
from pipeline.project.artifacts import layout  # noqa: E402
from pipeline.project.config import load_registry  # noqa: E402

SCALE_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def children_cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def tool_run(cmd: list[str], reps: int) -> tuple[list[float], float]:
    """Per-call wall ms of a run of ``reps`` calls and the CPU seconds the run took."""
    before = children_cpu_s()
    args = [*cmd, "--benchmark_min_time=1x", f"--benchmark_repetitions={reps}", "--benchmark_format=json"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-2000:]}")
    report = json.loads(proc.stdout)
    wall = [b["real_time"] * SCALE_MS[b["time_unit"]] for b in report["benchmarks"] if b.get("run_type") == "iteration"]
    return wall, children_cpu_s() - before


def measure(project: Path, model: str, sku: str, threads: int, rounds: int, reps: int) -> dict[str, float | str]:
    registry = load_registry(project / "params.yaml")
    engine = layout(registry).engine_dir(model, sku)
    meta = json.loads((engine / "engine.json").read_text())
    feeds = feeds_for(registry, model, sku)
    with (
        tempfile.TemporaryDirectory(prefix="skuforge-iree-native-") as tmp,
        get_backend("iree").load(engine, registry.sku(sku)) as runner,
    ):
        inputs = []
        for sig in meta["inputs"]:
            path = Path(tmp) / f"{sig['name']}.npy"
            np.save(path, feeds[sig["name"]])
            inputs.append(f"--input=@{path}")
        cmd = [
            str(BIN / "iree-benchmark-module"),
            f"--module={engine / 'module.vmfb'}",
            f"--device={meta['driver']}",
            f"--function={meta['entry']}",
            *inputs,
            f"--task_topology_group_count={threads}",
        ]
        runner.infer(feeds)
        ours_wall, ours_cpu, tool_wall, tool_cpu = [], [], [], []
        for r in range(rounds):
            for side in ("ours", "tool") if r % 2 == 0 else ("tool", "ours"):
                if side == "ours":
                    walls, cpu0 = [], time.process_time()
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        runner.infer(feeds)
                        walls.append((time.perf_counter() - t0) * 1000)
                    ours_cpu.append((time.process_time() - cpu0) * 1000 / reps)
                    ours_wall.append(statistics.median(walls))
                else:
                    walls, cpu_many = tool_run(cmd, reps)
                    _, cpu_one = tool_run(cmd, 1)
                    tool_cpu.append((cpu_many - cpu_one) * 1000 / (reps - 1))
                    tool_wall.append(statistics.median(walls))
    native, harness = statistics.median(tool_wall), statistics.median(ours_wall)
    return {
        "model": model,
        "sku": sku,
        "native_p50_ms": native,
        "harness_p50_ms": harness,
        "gap_us": (harness - native) * 1000,
        "gap_pct": (harness / native - 1) * 100,
        "native_cpu_ms": statistics.median(tool_cpu),
        "harness_cpu_ms": statistics.median(ours_cpu),
        "rounds": f"native {_ms(tool_wall)}; harness {_ms(ours_wall)}",
    }


def _ms(values: list[float]) -> str:
    return " ".join(f"{x:.1f}" for x in values)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", type=Path, required=True, help="a project whose IREE engines are built")
    ap.add_argument("--model", action="append", help="repeatable; default: every model of the project")
    ap.add_argument("--sku", default="x86_iree_cpu_fp32")
    ap.add_argument("--threads", type=int, default=1, help="--task_topology_group_count of both sides")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=40, help="calls per side and round")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    if args.reps < 2:
        ap.error("--reps must be at least 2")

    import iree.runtime

    iree.runtime.flags.parse_flags(f"--task_topology_group_count={args.threads}")  # before any device is made
    project = args.project.resolve()
    os.chdir(project)  # paths in params.yaml are relative to the project
    models = args.model or list(load_registry(project / "params.yaml").models)
    rows = [measure(project, m, args.sku, args.threads, args.rounds, args.reps) for m in models]
    head = ("model", "native p50", "harness p50", "gap us", "gap %", "native cpu", "harness cpu")
    print(" ".join(f"{h:<12}" if i == 0 else f"{h:>11}" for i, h in enumerate(head)))
    for r in rows:
        print(
            f"{r['model']:<12} {r['native_p50_ms']:>8.2f} ms {r['harness_p50_ms']:>9.2f} ms {r['gap_us']:>+8.0f} "
            f"{r['gap_pct']:>+6.1f} {r['native_cpu_ms']:>8.2f} ms {r['harness_cpu_ms']:>9.2f} ms   {r['rounds']}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
