"""What a device carries: `pip install skuforge[agent]` against the full development environment.

Run from the project root with the development venv (scripts/setup.sh --test: the project is built
and published with the build toolchain, the device side runs in the fresh venv):

    python benchmarks/agent_footprint.py [--runs 5] [--venv DIR] [--no-pass]

Steps:
1. a fresh venv with `pip install --no-build-isolation <copy of the sources>[agent]` (a regular,
   non-editable install, as on a device; wheels from pip's cache or its configured index);
2. its installed size (site-packages; pip and setuptools, which every venv has, counted apart) and
   the same for the venv running this script;
3. the agent's import time in each: the median of ``--runs`` fresh interpreters, both the wall time
   of ``python -c "import pipeline.rollout.agent"`` and ``-X importtime``'s cumulative figure for
   the module, and the same for the CLI's agent entry (pipeline.cli.rollout);
4. one real agent pass (`skuforge agent --json`) in each venv against a moto S3 server on loopback
   holding a release of a tiny project (conv_bn, an optimized ORT SKU and the portable fallback)
   and a rollout whose first wave takes the device: TUF refresh, verified download into a slot,
   smoke test, activation, signed report. In the fresh venv a pass that works at all shows that
   nothing outside base+agent is needed (mlflow, dvc, scipy ... are not installed there).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from registry_helpers import make_project, sku  # noqa: E402
from rollout.s3server import MotoS3, s3_client  # noqa: E402

from pipeline.host.probe import host_arch  # noqa: E402
from pipeline.results.signing import signing_key  # noqa: E402
from pipeline.rollout import controller, identity, release, trust  # noqa: E402
from pipeline.rollout.inventory import Device, Inventory  # noqa: E402
from pipeline.rollout.store import S3Store  # noqa: E402

MODULES = ("pipeline.rollout.agent", "pipeline.cli.rollout")
BOOTSTRAP = ("pip", "setuptools", "_distutils_hack", "pkg_resources", "wheel")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc


def make_agent_venv(venv: Path, scratch: Path) -> float:
    """The device's venv: the sources copied (setuptools writes build/ and *.egg-info next to them,
    the repository stays clean), then ``pip install .[agent]``. Returns the install's seconds."""
    src = scratch / "src"
    shutil.copytree(ROOT / "pipeline", src / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin/python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    run([*pip, "setuptools>=68"])
    t = time.perf_counter()
    run([*pip, "--no-build-isolation", f"{src}[agent]"])
    return time.perf_counter() - t


def site_packages(python: Path) -> Path:
    out = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout
    return Path(out.strip())


def sizes(site: Path) -> dict[str, int]:
    """Bytes per top-level entry of site-packages (a package, a module, a .dist-info folder)."""
    out: dict[str, int] = {}
    for entry in site.iterdir():
        files = [entry] if entry.is_file() else [p for p in entry.rglob("*") if p.is_file() and not p.is_symlink()]
        out[entry.name] = sum(p.stat().st_size for p in files)
    return out


def _package(entry: str) -> str:
    return re.split(r"[-.]", entry, maxsplit=1)[0].lower()


def footprint(python: Path) -> tuple[float, float, list[tuple[str, float]]]:
    """(MB without pip/setuptools, MB of pip/setuptools, the largest packages in MB)."""
    per = sizes(site_packages(python))
    boot = sum(n for e, n in per.items() if _package(e) in BOOTSTRAP)
    grouped: dict[str, int] = {}
    for entry, n in per.items():
        if _package(entry) not in BOOTSTRAP:
            grouped[_package(entry)] = grouped.get(_package(entry), 0) + n
    top = sorted(grouped.items(), key=lambda kv: -kv[1])[:6]
    return (sum(grouped.values()) / 1e6, boot / 1e6, [(k, v / 1e6) for k, v in top])


def import_time(python: Path, module: str, runs: int, env: dict[str, str]) -> tuple[float, float]:
    """Median wall seconds of ``python -c "import module"`` and median cumulative import seconds of
    the module (``-X importtime``), each over ``runs`` fresh interpreters."""
    walls, cumulative = [], []
    pattern = re.compile(rf"^import time:\s+\d+ \|\s+(\d+) \|\s*{re.escape(module)}$", re.MULTILINE)
    for _ in range(runs):
        t = time.perf_counter()
        proc = run([str(python), "-X", "importtime", "-c", f"import {module}"], env=env)
        walls.append(time.perf_counter() - t)
        found = pattern.search(proc.stderr)
        if found is None:
            sys.exit(f"no -X importtime line for {module} in {python}'s output")
        cumulative.append(int(found.group(1)) / 1e6)
    return statistics.median(walls), statistics.median(cumulative)


def prepared_device(scratch: Path, s3, states: list[Path]) -> tuple[str, Path, Path]:
    """A release of the tiny project in a fresh bucket and a rollout of it to every device, and the
    device provisioned in each folder of ``states``: one device key (its public half in the
    inventory), its device file, the store's root. Returns (url, device file, root file)."""
    reg = make_project(
        scratch / "project",
        {"cpu": sku(), "portable": sku(options={"graph_optimization_level": "basic"})},
        rollout={"fallback_sku": "portable", "waves": [{"name": "all", "percent": 100, "bake_minutes": 0}]},
    )
    url = f"s3://{s3.make_bucket()}/fleet"
    store = S3Store(url, client=s3_client(s3.endpoint))
    keys = trust.Keys.single(signing_key())
    trust.initialise(store, keys, reg.rollout.expiry)
    release.publish_release(reg, store, keys, "conv", actor="agent-footprint")
    key = identity.device_key(states[0])
    for state in states[1:]:  # the same device in each venv: the same key
        shutil.copytree(states[0], state)
    fleet = Inventory([Device(id="dev0", sku="cpu", arch=host_arch(), key=key.public_key)])
    controller.start(reg, store, keys, "conv", inventory=fleet, actor="agent-footprint", now=datetime.now(timezone.utc))
    device = scratch / "device.yaml"
    device.write_text(
        yaml.safe_dump({"id": "dev0", "sku": "cpu", "models": ["conv"], "arch": host_arch(), "cpu_features": []})
    )
    root = scratch / "root.json"
    root.write_bytes(trust.root_bytes(store))
    return url, device, root


def agent_pass(venv_bin: Path, url: str, device: Path, root: Path, state: Path, env: dict[str, str]):
    """One `skuforge agent` pass from ``venv_bin``: (wall seconds, the JSON it printed)."""
    import json

    cmd = [str(venv_bin / "skuforge"), "agent", "--device", str(device), "--root", str(root), "--store", url]
    t = time.perf_counter()
    proc = run([*cmd, "--state", str(state), "--json"], env=env, cwd=state.parent)
    return time.perf_counter() - t, json.loads(proc.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="fresh interpreters per import-time figure")
    ap.add_argument("--venv", type=Path, help="make (or reuse) the agent's venv here instead of a temporary folder")
    ap.add_argument("--no-pass", action="store_true", help="skip the agent pass (no project build, no S3 server)")
    args = ap.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="agent-footprint-"))
    os.environ.setdefault("SKUFORGE_KEY_DIR", str(scratch / "keys"))
    venv = args.venv or scratch / "agent-venv"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(scratch), "LANG": "C.UTF-8"}
    dev_python = Path(sys.executable)
    try:
        if (venv / "bin/skuforge").is_file():
            print(f"agent venv: reusing {venv}")
        else:
            secs = make_agent_venv(venv, scratch)
            print(f"agent venv: pip install .[agent] into {venv} took {secs:.0f} s")
        rows = []
        for label, python in (("agent", venv / "bin/python"), ("dev", dev_python)):
            size, boot, top = footprint(python)
            times = {m: import_time(python, m, args.runs, env) for m in MODULES}
            rows.append((label, size, boot, top, times))
        for label, size, boot, top, times in rows:
            print(f"\n{label} venv ({'skuforge[agent]' if label == 'agent' else sys.prefix}):")
            print(f"  installed: {size:8.1f} MB in site-packages (+ {boot:.1f} MB pip/setuptools)")
            print("  largest:   " + ", ".join(f"{k} {v:.1f}" for k, v in top))
            for module, (wall, cum) in times.items():
                print(f"  import {module:24s} median {wall * 1000:6.0f} ms wall, {cum * 1000:6.0f} ms -X importtime")
        (_, a_size, _, _, a_times), (_, d_size, _, _, d_times) = rows
        print(f"\nratio dev/agent: size {d_size / a_size:.1f}x", end="")
        for m in MODULES:
            print(f", {m} import {d_times[m][0] / a_times[m][0]:.2f}x wall", end="")
        print()

        if args.no_pass:
            print("\nagent pass: skipped (--no-pass)")
            return 0
        import logging

        logging.basicConfig(level=logging.WARNING)
        print("\nbuilding and publishing the tiny project (conv_bn) to moto S3 ...", flush=True)
        with MotoS3() as s3:
            venvs = {"agent": venv / "bin", "dev": dev_python.parent}
            url, device, root = prepared_device(scratch, s3, [scratch / label / "state" for label in venvs])
            s3_env = {
                **env,
                "AWS_ENDPOINT_URL": s3.endpoint,
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1",
            }
            for label, bindir in venvs.items():
                secs, result = agent_pass(bindir, url, device, root, scratch / label / "state", s3_env)
                active = result.get("active") or {}
                print(
                    f"agent pass ({label} venv): {result['outcome']} in {secs:.2f} s wall "
                    f"({result.get('seconds', float('nan')):.2f} s in the pass; active "
                    f"{active.get('release')} {active.get('sku')} {active.get('kind')})"
                )
                if result["outcome"] != "ok":
                    print(f"  detail: {result.get('detail')}")
                    return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
