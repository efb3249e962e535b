"""How long the read-only commands take on a built project, against the 2 s target (issue 25).

Run in a built project (after `skuforge repro`), or anywhere to time a copy of this checkout:

    python benchmarks/cli_latency.py [--runs 5] [--project DIR] [--cold]

Each command runs ``--runs`` times in a fresh process: ``skuforge --help``, ``config validate``,
``skus``, ``summary`` and ``repro --dry``. Printed per command: the median and the highest wall
time, the median CPU time of the process (user + system: what the command costs when the host is
not shared; on a loaded 2-core host the wall time is mostly waiting), the exit code, and the ratio
of the median to the target.

``skus`` and ``summary`` say which SKUs this host can build from answers cached per host
(pipeline/engine/hostcheck.py); the first command after a package, driver or PATH change asks the
SDKs again (imports TVM, OpenVINO, the IREE runtime). ``--cold`` also times that first run: it
removes this host's cached answers (``hostcheck-*.json`` in the cache folder) before one run of
each command.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.core.paths import cache_dir  # noqa: E402
from pipeline.engine.hostcheck import CACHE_PREFIX  # noqa: E402

TARGET_S = 2.0
COMMANDS = (
    ("--help",),
    ("config", "validate"),
    ("skus",),
    ("summary",),
    ("repro", "--dry"),
)
_NOT_COPIED = shutil.ignore_patterns(".venv", "__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache", ".ruff_cache")


def skuforge() -> str:
    beside = Path(sys.executable).with_name("skuforge")
    found = str(beside) if beside.is_file() else shutil.which("skuforge")
    if found is None:
        sys.exit("no skuforge command: run with the project's venv (scripts/setup.sh)")
    return found


def project_dir(asked: str | None, scratch: Path) -> Path:
    """``--project``; else the current folder when it holds a params.yaml; else a copy of this
    checkout (with whatever it has built) in ``scratch``."""
    if asked:
        return Path(asked).resolve()
    if Path("params.yaml").is_file():
        return Path.cwd()
    copy = scratch / "project"
    shutil.copytree(ROOT, copy, symlinks=True, ignore=_NOT_COPIED)
    return copy


def run_once(argv: list[str], cwd: Path) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + system of the child) and the exit code of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.returncode


def forget_host_answers() -> int:
    """Remove this host's cached host-check answers; returns how many files."""
    files = list(cache_dir().glob(f"{CACHE_PREFIX}*.json"))
    for f in files:
        f.unlink(missing_ok=True)
    return len(files)


def row(name: str, walls: list[float], cpus: list[float], codes: set[int]) -> str:
    median = statistics.median(walls)
    return (
        f"{name:28} {median:8.2f} {max(walls):8.2f} {statistics.median(cpus):8.2f} "
        f"{','.join(map(str, sorted(codes))):>5} {median / TARGET_S:7.2f}x"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per command (default 5)")
    parser.add_argument("--project", help="a built project folder (default: the current one, else a copy)")
    parser.add_argument("--cold", action="store_true", help="also time one run with no cached host answers")
    args = parser.parse_args()
    exe = skuforge()
    with tempfile.TemporaryDirectory(prefix="skuforge-latency-") as scratch:
        project = project_dir(args.project, Path(scratch))
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(f"project {project}; {os.cpu_count()} CPUs, load average {load:.2f}; {args.runs} runs each")
        print(f"{'command':28} {'median s':>8} {'max s':>8} {'cpu s':>8} {'exit':>5} {'vs 2 s':>8}")
        if args.cold:
            for command in COMMANDS:
                forget_host_answers()
                wall, cpu, code = run_once([exe, *command], project)
                print(row(f"{' '.join(command)} (cold)", [wall], [cpu], {code}))
        run_once([exe, "skus"], project)  # the host's answers cached, as after any earlier command
        worst = 0.0
        for command in COMMANDS:
            samples = [run_once([exe, *command], project) for _ in range(args.runs)]
            walls, cpus = [s[0] for s in samples], [s[1] for s in samples]
            print(row(" ".join(command), walls, cpus, {s[2] for s in samples}))
            worst = max(worst, statistics.median(walls))
        print(f"slowest median {worst:.2f} s: {'within' if worst <= TARGET_S else 'over'} the {TARGET_S:g} s target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
