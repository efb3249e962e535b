"""`dvc metrics` and `dvc plots` over the real dvc.yaml in a throwaway git repository where one SKU
of the matrix was never built: nothing fails to load, and a diff against the previous commit reads
both revisions from git (no DVC cache: build/ is never created here).

Two commits of the pairs' files written by pipeline.results.dvcmetrics (as the manifest stage does): the
second makes one engine slower. The DVC commands run once per module (module-scoped fixture).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipeline.results import dvcmetrics  # noqa: E402

BIN = Path(sys.executable).parent
MODEL = "tiny"
BUILT = ("cpu_a", "cpu_b")
UNBUILT = "jetson_far"  # in the matrix, built on no runner
PROBLEMS = ("failed to load", "error", "warning")


def _env() -> dict[str, str]:
    env = dict(
        os.environ,
        DVC_NO_ANALYTICS="1",
        PATH=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@example.com",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@example.com",
    )
    for var in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "DVC_ROOT"):  # never touch the enclosing checkout
        env.pop(var, None)
    return env


def _run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=root, env=_env(), capture_output=True, text=True, timeout=120)


def _dvc_all(root: Path, commands: dict[str, tuple[str, ...]]) -> dict[str, subprocess.CompletedProcess]:
    """Read-only dvc commands run side by side (each spends seconds importing DVC)."""
    procs = {
        name: subprocess.Popen(
            [str(BIN / "dvc"), *args], cwd=root, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, args in commands.items()
    }
    done = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def _benchmark(p50: float) -> dict:  # the manifest's `benchmark` section
    return {
        "batch": 1,
        "concurrency": 1,
        "engine_only": {"p50_ms": p50, "p50_ci_ms": [p50 * 0.98, p50 * 1.02], "p99_ms": p50 * 2, "p99_ci_ms": None},
        "end_to_end": {"p50_ms": p50 * 1.5, "p50_ci_ms": None, "p99_ms": p50 * 3, "p99_ci_ms": None},
        "throughput_per_s": round(1000 / p50),
        "throughput_ci_per_s": None,
        "peak_rss_mb": 90.0,
        "engine_load_mb": 16.0,
    }


class _Point:
    def __init__(self, batch: int, concurrency: int, p50: float) -> None:
        self.batch, self.concurrency, self.p50_ms, self.p99_ms = batch, concurrency, p50, p50 * 2
        self.throughput_per_s = batch * concurrency * 1000 / p50


def _bench_files(scratch: Path, sku: str, p50: float) -> tuple[Path, Path]:
    """latency.csv and timeline.csv as the bench stage writes them (outside the project: DVC-cached there)."""
    steady = [p50 * (0.9 + 0.2 * ((i * 37) % 100) / 100) for i in range(600)]
    warm = [p50 * (3 - i / 10) for i in range(20)]
    folder = scratch / sku
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "latency.csv").write_text(
        "iteration,latency_ms\n" + "".join(f"{i},{v:.4f}\n" for i, v in enumerate(steady))
    )
    rows = [f"{i},warmup,{v:.4f}\n" for i, v in enumerate(warm)]
    rows += [f"{len(warm) + i},steady,{v:.4f}\n" for i, v in enumerate(steady)]
    (folder / "timeline.csv").write_text("iteration,phase,latency_ms\n" + "".join(rows))
    return folder / "latency.csv", folder / "timeline.csv"


def _write_pairs(root: Path, scratch: Path, p50: dict[str, float]) -> None:
    for sku, value in p50.items():
        latency, timeline = _bench_files(scratch, sku, value)
        sweep = [_Point(1, 1, value), _Point(1, 2, value * 1.6)] if sku == BUILT[0] else []
        dvcmetrics.write_metrics(
            root, {"model": MODEL, "sku": sku, "benchmark": _benchmark(value)}, latency, timeline, sweep
        )


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root, scratch = tmp_path_factory.mktemp("dvcmetrics"), tmp_path_factory.mktemp("bench")
    for name in ("dvc.yaml", ".dvcignore"):
        shutil.copy(REPO / name, root / name)
    # the plot templates (colour by SKU) and the offline page dvc.yaml's plots name
    shutil.copytree(REPO / ".dvc" / "plots", root / ".dvc" / "plots")
    # a team's project commits its run records (this repository's example ignores its own)
    records = {"/dvc.lock", f"/{dvcmetrics.ROOT}/", "/manifests/", "/reports/"}
    (root / ".gitignore").write_text(
        "".join(line + "\n" for line in (REPO / ".gitignore").read_text().splitlines() if line not in records)
    )
    for kind in dvcmetrics.FOLDERS:
        (root / dvcmetrics.ROOT / kind).mkdir(parents=True)
        (root / dvcmetrics.ROOT / kind / ".gitkeep").write_text("")
    registry = {
        "defaults": {},
        "examples": {},
        "models": {MODEL: {"dir": f"models/{MODEL}"}},
        "skus": {sku: {} for sku in (*BUILT, UNBUILT)},
    }
    (root / "params.yaml").write_text(yaml.safe_dump(registry))
    assert _run(root, "git", "init", "-q").returncode == 0
    # what `dvc init` leaves that matters here, without its seconds of start-up; the offline page
    # (bundled Vega) as this repository's .dvc/config names it (which also sets no_scm: not here)
    (root / ".dvc" / "config").write_text("[plots]\n    html_template = plots/offline.html\n")
    (root / ".dvc" / ".gitignore").write_text("/config.local\n/tmp\n/cache\n")
    _write_pairs(root, scratch, {BUILT[0]: 0.1, BUILT[1]: 0.2})
    assert _run(root, "git", "add", "-A").returncode == 0
    assert _run(root, "git", "commit", "-qm", "first").returncode == 0
    _write_pairs(root, scratch, {BUILT[0]: 0.15})  # a slower engine
    assert _run(root, "git", "commit", "-qam", "second").returncode == 0
    return _dvc_all(
        root,
        {
            "metrics show": ("metrics", "show", "--json"),
            "metrics diff": ("metrics", "diff", "HEAD~1", "--json"),
            "plots show": ("plots", "show", "--json"),
            "plots diff": ("plots", "diff", "HEAD~1", "--json"),
        },
    )


def _clean(proc: subprocess.CompletedProcess) -> dict:
    """The command's JSON; fails on a non-zero exit or any error or warning DVC printed."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    start = proc.stdout.find("{")
    assert not any(word in (proc.stdout[:start] + proc.stderr).lower() for word in PROBLEMS), out
    return json.loads(proc.stdout[start:])


def _pair(kind: str, sku: str) -> str:
    return f"{dvcmetrics.ROOT}/{kind}/{MODEL}/{sku}.{'json' if kind == dvcmetrics.BENCH else 'csv'}"


def _grouped(kind: str) -> str:
    """The model's one table of ``kind`` (a sku column): what dvc.yaml's plots name."""
    return f"{dvcmetrics.ROOT}/{dvcmetrics.BY_SKU}/{kind}/{MODEL}.csv"


def test_dvc_yaml_names_the_folders_the_module_writes():
    doc = yaml.safe_load((REPO / "dvc.yaml").read_text())
    plots = {next(iter(p)) if isinstance(p, dict) else p for p in doc["plots"]}
    assert doc["metrics"] == [f"{dvcmetrics.ROOT}/{dvcmetrics.BENCH}"]
    grouped = (dvcmetrics.LATENCY_CDF, dvcmetrics.TIMELINE, dvcmetrics.SWEEP)
    assert plots == {f"{dvcmetrics.ROOT}/{dvcmetrics.BY_SKU}/{k}" for k in grouped} | {
        f"{dvcmetrics.ROOT}/{dvcmetrics.COMPARE}"
    }
    # a stage-level metric or plot lists every pair of the matrix, built or not
    assert not [name for name, stage in doc["stages"].items() if {"metrics", "plots"} & set(stage.get("do", stage))]


def test_metrics_show_lists_built_pairs_only(project):
    data = _clean(project["metrics show"])[""]["data"]
    assert sorted(data) == [_pair(dvcmetrics.BENCH, sku) for sku in BUILT]
    figures = data[_pair(dvcmetrics.BENCH, BUILT[0])]["data"]
    assert figures["engine_only"]["p50_ms"] == 0.15
    assert figures["engine_only"]["p50_ci_ms"] == {"lo": pytest.approx(0.147), "hi": pytest.approx(0.153)}


def test_metrics_diff_shows_the_slower_engine(project):
    diff = _clean(project["metrics diff"])
    assert list(diff) == [_pair(dvcmetrics.BENCH, BUILT[0])]
    assert diff[_pair(dvcmetrics.BENCH, BUILT[0])]["engine_only.p50_ms"] == {
        "old": 0.1,
        "new": 0.15,
        "diff": pytest.approx(0.05),
    }


def test_plots_show_has_every_built_pairs_plots_and_no_unbuilt_one(project):
    data = _clean(project["plots show"])["data"]
    expected = {_grouped(k) for k in (dvcmetrics.LATENCY_CDF, dvcmetrics.TIMELINE, dvcmetrics.SWEEP)}
    expected |= {f"{dvcmetrics.ROOT}/{dvcmetrics.COMPARE}/{MODEL}.csv"}
    assert set(data) == expected  # one plot per model and kind, not one per pair
    for name, (plot,) in ((n, p) for n, p in data.items() if dvcmetrics.BY_SKU in n):
        skus = {v["sku"] for v in plot["content"]["data"]["values"]}
        assert skus == ({BUILT[0]} if dvcmetrics.SWEEP in name else set(BUILT)), name


def test_plots_diff_overlays_both_revisions(project):
    data = _clean(project["plots diff"])["data"]
    (plot,) = data[_grouped(dvcmetrics.LATENCY_CDF)]
    values = [v for v in plot["content"]["data"]["values"] if v["sku"] == BUILT[0]]
    assert set(plot["revisions"]) == {"HEAD~1", "workspace"}
    medians = {v["rev"]: float(v["latency_ms"]) for v in values if v["quantile"] == "0.50"}
    assert medians["workspace"] > medians["HEAD~1"]
    (compare,) = data[f"{dvcmetrics.ROOT}/{dvcmetrics.COMPARE}/{MODEL}.csv"]
    assert {(v["rev"], v["sku"]) for v in compare["content"]["data"]["values"]} == {
        (rev, sku) for rev in ("HEAD~1", "workspace") for sku in BUILT
    }
