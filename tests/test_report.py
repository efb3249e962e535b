"""`skuforge report`: the HTML site over a project's reports. Pages exist, untrusted strings are
escaped, missing or older pieces are left out with a note, a damaged report is refused, and the
pages render in a real browser with no error and every chart loaded."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import models
import pytest
from cli_helpers import assert_user_error, skuforge

from pipeline.core.errors import InputError
from pipeline.engine.matrix import matrix
from pipeline.host.probe import host_arch
from pipeline.project.config import load_registry
from pipeline.report import pages, plots, write_pair_report, write_site
from pipeline.report.common import fmt
from pipeline.results.outcomes import record_outcome
from pipeline.results.power import UNAVAILABLE, EnergyResult, SustainedResult, SustainedWindow, Throttling
from pipeline.results.reports import InputDiff, PreprocessingDrift, StepDrift
from pipeline.verify.selection import select

EVIL = "<script>alert('x')</script>"
EVIL_ESCAPED = "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;"
MODEL = "m"
NEW, OLD, BUILT_ONLY, FAILED, NOT_BUILT = "cpu_new", "cpu_old", "cpu_built", "cpu_failed", "cpu_none"
SKUS = (NEW, OLD, BUILT_ONLY, FAILED, NOT_BUILT)
CHROMIUM = Path(os.environ.get("SKUFORGE_CHROMIUM", "/usr/bin/chromium"))
OTHER_ARCH = "aarch64" if host_arch() == "x86_64" else "x86_64"
SHOTS = os.environ.get("SKUFORGE_SCREENSHOT_DIR")


# --- a project with schema-shaped reports ---------------------------------------------------------


def _stats(p50: float, ci: bool) -> dict:
    s = {
        "iterations": 400,
        "mean_ms": p50 * 1.1,
        "std_ms": p50 * 0.1,
        "min_ms": p50 * 0.8,
        "p50_ms": p50,
        "p95_ms": p50 * 1.5,
        "p99_ms": p50 * 2,
        "max_ms": p50 * 3,
    }
    if ci:
        s.update(p50_ci_ms=[p50 * 0.95, p50 * 1.05], p95_ci_ms=[p50 * 1.4, p50 * 1.6], p99_ci_ms=[p50 * 1.8, p50 * 2.3])
    return s


def _bench(sku: str, p50: float, new: bool) -> dict:
    doc = {
        "model": MODEL,
        "sku": sku,
        "batch": 1,
        "concurrency": 1,
        "load_seconds": 0.05,
        "first_inference_ms": 2.0,
        "engine_only": _stats(p50, new),
        "end_to_end": _stats(p50 * 2, new),
        "warmup": _stats(p50 * 1.3, False),
        "throughput_per_s": 1000 / p50,
        "memory_mb": {"peak_rss": 90.0, "engine_load_delta": 12.5},
        "device_state": {"before": {"governor": "performance", EVIL: [1, 2]}, "after": {"governor": EVIL}},
        "engine_sha256": "0" * 64,
        "latency_sha256": "1" * 64,
    }
    if new:
        doc.update(
            steady_state={
                "reached": True,
                "warmup_iterations": 40,
                "warmup_seconds": 0.2,
                "window": 10,
                "tolerance": 0.05,
                "reason": EVIL,
            },
            drift={
                "first_p50_ms": p50,
                "last_p50_ms": p50 * 1.01,
                "ratio": 1.01,
                "threshold": 0.05,
                "flagged": False,
                "window": 10,
            },
            execution={
                "affinity": [0, 1],
                "usable_cores": 2,
                "engine_threads": {"intra_op": 1},
                "env": {"OMP_NUM_THREADS": EVIL},
                "concurrency": 1,
                "timer": "perf_counter_ns",
            },
            sweep=[
                {
                    "batch": b,
                    "concurrency": c,
                    "iterations": 100,
                    "p50_ms": p50 * b * c,
                    "p99_ms": p50 * b * c * 2,
                    "throughput_per_s": 1000 * b / p50,
                }
                for b, c in ((1, 1), (4, 1), (4, 2))
            ],
            throughput_ci_per_s=[900 / p50, 1100 / p50],
            stopped="iterations",
            timeline_sha256="2" * 64,
        )
    return doc


def _build(sku: str) -> dict:
    layers = [
        {
            "name": "conv",
            "op_type": "Conv",
            "precision": "fp32",
            "device": "CPUExecutionProvider",
            "kernel": "FusedConv",
            "fused_from": ["bn_0"],
        },
        {
            "name": "fc",
            "op_type": "Gemm",
            "precision": "fp32",
            "device": "CPUExecutionProvider",
            "kernel": "Gemm",
            "fused_from": [],
        },
        {
            "name": EVIL,
            "op_type": "Relu",
            "precision": "fp32",
            "device": "CPUExecutionProvider",
            "kernel": "Relu",
            "fused_from": [],
        },
    ]
    return {
        "model": MODEL,
        "sku": sku,
        "backend": "onnxruntime",
        "precision": "fp32",
        "build_seconds": 0.4,
        "engine_files": [{"path": "model.onnx", "bytes": 4096, "sha256": "0" * 64}],
        "layers": layers,
    }


def _validate(sku: str, passed: bool) -> dict:
    return {
        "model": MODEL,
        "sku": sku,
        "passed": passed,
        "precision": "fp32",
        "failures": [] if passed else [f"output y: max abs error 0.5 > atol {EVIL}"],
        "outputs": [
            {
                "output": "y",
                "passed": passed,
                "max_abs_error": 1e-6,
                "p99_abs_error": 5e-7,
                "mean_abs_error": 1e-8,
                "cosine_similarity": 1.0,
                "top1_agreement": None,
                "atol": 1e-4,
                "rtol": 1e-3,
            }
        ],
        "metrics": [
            {"split": "evaluation", "reference": 0.9, "engine": 0.89, "delta": -0.01, "max_drop": 0.02, "passed": True}
        ],
        "placement": {"passed": True, "allowed": ["CPUExecutionProvider"], "offending": []},
        "precision_gate": {"passed": True, "policy": "warn", "mismatched": []},
    }


def _roofline(root: Path, scale: float = 1.0, precision: str | None = None) -> dict:
    """A RooflineReport of the project's model, made by pipeline.perf.roofline: one layer time is
    joined to no node (its name lands in ``unmatched_ms``). ``scale`` scales the measured peaks (a
    peak probe gone wrong: far below what the engine achieves); ``precision`` is the engine's."""
    from pipeline.perf.cost import graph_cost
    from pipeline.perf.roofline import roofline

    peaks = {
        "key": "test",
        "host": {},
        "measured_at": "2026-01-01T00:00:00Z",
        "seconds": 1.0,
        "one_core_method": "subprocess",
        "compute_gflops": {"all_cores": 200.0 * scale, "one_core": 60.0 * scale, "matmul_n": 256},
        "int8_gops": {"all_cores": 500.0 * scale, "one_core": 150.0 * scale, "matmul_n": 512},
        "bandwidth_gbs": {
            "triad": 20.0 * scale,
            "memcopy": 25.0 * scale,
            "triad_one_core": 8.0 * scale,
            "array_mb": 64,
        },
    }
    cost = graph_cost(root / "models" / "conv" / "model.onnx", {"batch": 1})
    return roofline(cost, 0.05, peaks, {"conv": 0.02, "fc": 0.01, EVIL: 0.001}, precision=precision).to_json()


def _write_csv(path: Path, header: list[str], rows: list[list]) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)


def write_pair(root: Path, sku: str, p50: float, new: bool, passed: bool = True) -> Path:
    folder = root / "build" / MODEL / sku
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "build.json").write_text(json.dumps(_build(sku)))
    (folder / "validate.json").write_text(json.dumps(_validate(sku, passed)))
    if not passed:
        return folder
    (folder / "bench.json").write_text(json.dumps(_bench(sku, p50, new)))
    steady = [p50 * (1 + 0.2 * ((i * 7919) % 13) / 13) for i in range(400)]
    if not new:  # a long tail: p99.9 at 40x p50 (the 0.02 ms against 20 ms, scaled)
        steady[::40] = [p50 * 40] * 10
    _write_csv(folder / "latency.csv", ["iteration", "latency_ms"], [[i, v] for i, v in enumerate(steady)])
    if new:
        warm = [p50 * (3 - 2 * i / 40) for i in range(40)]
        rows = [[i, "warmup", v] for i, v in enumerate(warm)] + [[40 + i, "steady", v] for i, v in enumerate(steady)]
        _write_csv(folder / "timeline.csv", ["iteration", "phase", "latency_ms"], rows)
        (folder / "roofline.json").write_text(json.dumps(_roofline(root)))
    return folder


def _consistency() -> dict:
    labels = ["reference", NEW, OLD]
    zero = [[0.0] * 3 for _ in labels]
    return {
        "model": MODEL,
        "samples": 8,
        "reference_sha256": "0" * 64,
        "skus": [
            {
                "sku": s,
                "backend": "onnxruntime",
                "precision": "fp32",
                "validate_passed": True,
                "engine_sha256": "0" * 64,
                "outputs_sha256": "0" * 64,
            }
            for s in (NEW, OLD)
        ],
        "skipped": [{"sku": FAILED, "reason": EVIL}],
        "outputs": [
            {
                "output": "y",
                "dtype": "float32",
                "shape": [8, 4],
                "kind": "regression",
                "labels": labels,
                "max_abs_error": zero,
                "mean_abs_error": zero,
                "nonfinite_mismatch": [[0] * 3] * 3,
                "top1_agreement": None,
                "nonfinite": {label: {"nan": 0, "inf": 0} for label in labels},
            }
        ],
    }


def make_project(root: Path) -> Path:
    models.conv_bn_model(root / "models" / "conv" / "model.onnx")
    skus = {s: models.ort_sku("fp32") for s in SKUS}
    skus[NOT_BUILT] = models.ort_sku("fp32", target={"arch": OTHER_ARCH}, runner_labels=["arm-box"])
    params = models.write_project(root, {MODEL: models.conv_bn_spec()}, skus)
    write_pair(root, NEW, 0.5, new=True)
    write_pair(root, OLD, 2.0, new=False)
    write_pair(root, FAILED, 1.0, new=True, passed=False)
    # what the validate command leaves when its gate fails (what `skuforge summary` reads)
    record_outcome(root, "validate", MODEL, FAILED, 1, "correctness gate failed")
    (root / "build" / MODEL / BUILT_ONLY).mkdir(parents=True)
    (root / "build" / MODEL / BUILT_ONLY / "build.json").write_text(json.dumps(_build(BUILT_ONLY)))
    (root / "reports" / "consistency").mkdir(parents=True)
    (root / "reports" / "consistency" / f"{MODEL}.json").write_text(json.dumps(_consistency()))
    return params


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("report-project")
    registry = load_registry(make_project(root))
    index = write_site(registry)
    return registry, index


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# --- the site -------------------------------------------------------------------------------------


def test_pages_exist_for_each_pair_with_a_report(site):
    registry, index = site
    report = registry.root / "build" / "report"
    assert index == report / "index.html"
    for sku in (NEW, OLD, FAILED):
        assert (report / MODEL / sku / "index.html").is_file(), sku
    for sku in (BUILT_ONLY, NOT_BUILT):
        assert not (report / MODEL / sku).exists(), sku
    assert (report / MODEL / "index.html").is_file()
    for png in ("latency.png", "throughput.png", "memory.png", "engine-size.png"):
        assert (report / MODEL / png).read_bytes()[:4] == b"\x89PNG", png
    for png in ("latency.png", "timeline.png", "percentiles.png", "sweep.png", "roofline.png"):
        assert (report / MODEL / NEW / png).is_file(), png


def _index_rows(text: str) -> dict[str, tuple[str, str]]:
    """SKU -> (outcome, detail) as the index's table shows them."""
    rows = re.findall(
        r'<tr><td>([^<]+)</td><td>[^<]*</td><td><span class="\w+">([^<]+)</span></td>\n'
        r'<td class="num">[^<]*</td><td class="num">[^<]*</td><td>([^<]*)</td>',
        text,
    )
    return {sku: (outcome, detail) for sku, outcome, detail in rows}


def test_index_links_every_pair_with_its_status(site):
    _, index = site
    text = _read(index)
    for sku in SKUS:
        assert sku in text
    assert f'href="{MODEL}/{NEW}/index.html"' in text and f'href="{MODEL}/index.html"' in text
    assert re.search(rf"{FAILED}</td><td>onnxruntime</td><td><span class=\"failed\">gate failed", text)
    assert re.search(rf"{NOT_BUILT}</td><td>onnxruntime</td><td><span class=\"other\">not buildable here", text)


def test_index_outcomes_are_the_summarys(site):
    """The index shows what `skuforge summary` shows (matrix()), not a classification of its own: a
    pair with reports but no manifest is "not run" there too, its detail saying what validate.json holds."""
    registry, index = site
    shown = _index_rows(_read(index))
    assert {sku: outcome for sku, (outcome, _) in shown.items()} == {r.sku: r.label for r in matrix(registry, [MODEL])}
    assert shown[NOT_BUILT][0] == "not buildable here" and f"needs arch {OTHER_ARCH}" in shown[NOT_BUILT][1]
    assert shown[NEW][0] == "not run" and "validate.json here says passed" in shown[NEW][1]


def test_index_says_commit_and_time(site):
    _, index = site
    text = _read(index)
    assert re.search(r"written \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00 from ", text), text[:2000]
    assert "no git commit (the project is not a git repository)" in text


def test_index_names_the_commit_and_a_dirty_tree(site, tmp_path):
    root = _copy(site, tmp_path)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for cmd in (["git", "init", "-q"], ["git", "add", "params.yaml"], [*git, "commit", "-qm", "x"]):
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    text = _read(write_site(load_registry(root / "params.yaml")))
    assert f"commit <code>{head[:12]}</code>" in text and "dirty" not in text
    (root / "params.yaml").write_text(_read(root / "params.yaml") + "\n")
    text = _read(write_site(load_registry(root / "params.yaml")))
    assert f"commit <code>{head[:12]}</code> with uncommitted changes (dirty)" in text


def test_every_link_and_image_resolves(site):
    _, index = site
    for page in pages(index):
        for ref in re.findall(r'(?:href|src)="([^"#]+)"', _read(page)):
            assert (page.parent / ref).is_file(), (page, ref)


def test_untrusted_strings_are_escaped(site):
    _, index = site
    seen = 0
    for page in pages(index):
        text = _read(page)
        assert "<script" not in text, page
        seen += text.count(EVIL_ESCAPED)
    pair = _read(index.parent / MODEL / NEW / "index.html")
    failed = _read(index.parent / MODEL / FAILED / "index.html")
    assert EVIL_ESCAPED in pair and EVIL_ESCAPED in failed and seen >= 5


def test_pair_page_shows_the_new_bench_fields(site):
    _, index = site
    text = _read(index.parent / MODEL / NEW / "index.html")
    for piece in (
        "Steady state",
        "Drift",
        "Execution",
        "perf_counter_ns",
        "Sweep",
        "Device state",
        "performance",
        "Roofline",
        "times from roofline.json",
        "Heaviest layers",
        "FusedConv",
        "bn_0",
        "Correctness",
    ):
        assert piece in text, piece
    assert "[0.475 – 0.525]" in text  # the p50 confidence interval
    assert "no timeline.csv" not in text


def test_latency_axis_is_log_where_the_range_spans_decades(site):
    _, index = site
    tailed = [0.02] * 990 + [20.0] * 10  # the p50 0.02 ms, p99.9 ~20 ms
    scale, bins = plots.latency_axis(tailed)
    assert scale == "log" and bins[0] == pytest.approx(0.02) and bins[-1] == pytest.approx(20.0, rel=0.01)
    ratios = [b / a for a, b in zip(bins, bins[1:], strict=False)]
    assert max(ratios) == pytest.approx(min(ratios))  # evenly spaced in log
    assert plots.latency_axis([1.0 + i / 1000 for i in range(1000)])[0] == "linear"
    assert "log x: p99.9 is over 10× p50" in _read(index.parent / MODEL / OLD / "index.html")  # its long tail
    assert "log x" not in _read(index.parent / MODEL / NEW / "index.html")


def test_roofline_flags_a_point_above_the_roof(site, tmp_path):
    """Peaks measured far too low (a probe gone wrong): the engine lies above the roof, and the
    page says which peak, the achieved figure against it, and what to rerun."""
    root = _copy(site, tmp_path)
    (root / "build" / MODEL / NEW / "roofline.json").write_text(json.dumps(_roofline(root, scale=1e-4)))
    index = write_site(load_registry(root / "params.yaml"))
    text = _read(index.parent / MODEL / NEW / "index.html")
    assert text.count('<p class="roof">') == 2, text
    assert "above the roof, compute peak wrong: the engine" in text
    assert "against a measured compute peak of 0.02 GFLOP/s" in text
    assert "above the roof, memory peak wrong: the engine" in text and "bandwidth fraction" in text
    assert "skuforge runner probe --peaks --refresh" in text and "FLOP count" in text
    assert (index.parent / MODEL / NEW / "roofline.png").is_file()
    sane = _read(site[1].parent / MODEL / NEW / "index.html")
    assert "above the roof" not in sane and 'class="roof"' not in sane


def test_an_int8_engine_is_drawn_against_the_int8_peak(site, tmp_path):
    """An INT8 engine's roofline.json judges it against the INT8 peak: the page names that peak, in
    op/s, beside the FP32 ceilings, and a point above it names the INT8 peak as the wrong one."""
    root = _copy(site, tmp_path)
    (root / "build" / MODEL / NEW / "roofline.json").write_text(json.dumps(_roofline(root, 1e-4, "int8")))
    index = write_site(load_registry(root / "params.yaml"))
    text = _read(index.parent / MODEL / NEW / "index.html")
    assert "against the measured INT8 peak of 0.05 GOP/s" in text
    assert "the INT8 peak (0.05 GOP/s: u8 × s8 → s32 MatMulInteger" in text and "int8" in text
    assert "<th>attainable GOP/s</th>" in text and "<td>INT8</td>" in text
    assert (index.parent / MODEL / NEW / "roofline.png").is_file()
    fp32 = _read(site[1].parent / MODEL / NEW / "index.html")
    assert "<th>attainable GFLOP/s</th>" in fp32 and "<td>FP32</td>" in fp32 and "INT8 peak" not in fp32


def test_cells_are_rounded_and_nested_values_are_lists():
    assert fmt(18000.4) == "18,000" and fmt(7000.0) == "7000" and fmt(0.123456789) == "0.1235"
    assert fmt(1.23456e-7) == "1.235e-07" and fmt(12345) == "12,345" and fmt(None) == "–"
    nested = str(fmt({"intra_op": 1, "b": {"x": 0.333333333}, "names": ["a", "b"]}))
    assert nested.startswith('<ul class="kv">') and "0.3333" in nested and "0.333333333" not in nested
    assert "{" not in nested and "a, b" in nested
    assert "&lt;script&gt;" in str(fmt({EVIL: EVIL}))


def test_missing_pieces_are_said_not_fatal(site):
    _, index = site
    old = _read(index.parent / MODEL / OLD / "index.html")
    assert "no timeline.csv" in old and "no confidence intervals" in old
    assert "not recorded (a bench report of an older format)" in old
    assert "no roofline.json for this pair" in old
    failed = _read(index.parent / MODEL / FAILED / "index.html")
    assert "no bench.json for this pair here" in failed


def test_cross_sku_page(site):
    _, index = site
    text = _read(index.parent / MODEL / "index.html")
    assert "4,096" in text  # engine bytes
    assert "-0.01" in text  # accuracy delta
    assert "[0.475 – 0.525]" in text
    assert "Consistency across SKUs" in text and EVIL_ESCAPED in text


def test_report_is_replaced_whole(site, tmp_path):
    registry, index = site
    stale = index.parent / MODEL / "stale.png"
    stale.write_bytes(b"old")
    assert write_site(registry, MODEL) == index
    assert not stale.exists()


def test_report_progress_names_each_page_and_ends_at_one(site):
    registry, index = site
    heard: list[tuple[str, float]] = []
    assert write_site(registry, MODEL, progress=lambda what, f: heard.append((what, f))) == index
    fractions = [f for _, f in heard]
    assert fractions == sorted(fractions) and fractions[0] == 0 and fractions[-1] == 1.0
    pair_pages = {p.parent.name for p in (index.parent / MODEL).glob("*/index.html")}
    assert {w.removeprefix(f"report {MODEL}/") for w, _ in heard if "/" in w} == pair_pages
    assert (f"report {MODEL}", fractions[len(pair_pages)]) in heard  # the model page after its pairs


def test_pair_report_is_self_contained(site, tmp_path):
    registry, _ = site
    written = write_pair_report(registry, MODEL, NEW, tmp_path)
    assert written == [tmp_path / "report.html"]
    text = _read(written[0])
    assert text.count('src="data:image/png;base64,') == 5
    assert not re.search(r'(?:href|src)="(?!data:)', text)
    assert "<script" not in text and EVIL_ESCAPED in text
    assert write_pair_report(registry, MODEL, NOT_BUILT, tmp_path / "none") == []


# --- refusals -------------------------------------------------------------------------------------


def _copy(site, tmp_path: Path) -> Path:
    registry, _ = site
    root = tmp_path / "copy"
    shutil.copytree(registry.root, root, ignore=shutil.ignore_patterns("report"))
    return root


@pytest.mark.parametrize("content, words", [("{not json", ["is not valid JSON"]), ("[1, 2]", ["not an object"])])
def test_a_report_that_is_not_json_is_refused_naming_it(site, tmp_path, content, words):
    root = _copy(site, tmp_path)
    bad = root / "build" / MODEL / OLD / "bench.json"
    bad.write_text(content)
    with pytest.raises(InputError, match=re.escape(str(bad))):
        write_site(load_registry(root / "params.yaml"))
    proc = skuforge("report", cwd=root)
    assert_user_error(proc, 2, str(bad), *words)
    assert not (root / "build" / "report").exists()


def test_cli_prints_the_index(site, tmp_path):
    root = _copy(site, tmp_path)
    proc = skuforge("report", "--model", MODEL, "--out", "site", cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(root / "site" / "index.html")
    assert (root / "site" / MODEL / NEW / "index.html").is_file()


@pytest.mark.parametrize(
    "out, words",
    [("../elsewhere", ["outside the project root"]), (".", ["project root"]), ("build", ["is not a skuforge report"])],
)
def test_cli_refuses_an_out_folder_it_must_not_replace(site, tmp_path, out, words):
    root = _copy(site, tmp_path)
    proc = skuforge("report", "--out", out, cwd=root)
    assert_user_error(proc, 2, *words)
    assert (root / "build" / MODEL / NEW / "bench.json").is_file()


def test_cli_unknown_model_names_the_known_ones(site, tmp_path):
    root = _copy(site, tmp_path)
    proc = skuforge("report", "--model", "nope", cwd=root)
    assert_user_error(proc, 2, "nope", MODEL)


# --- in a browser ---------------------------------------------------------------------------------


def _browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    if not CHROMIUM.is_file():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set SKUFORGE_CHROMIUM)")
    return sync_api


def test_pages_render_in_a_browser(site, tmp_path):
    """Every page loads offline with no error and every chart drawn; at 1400 px and at a phone's
    390 px no page is wider than the window (each table scrolls in its own box or wraps)."""
    sync_api = _browser()
    _, index = site
    problems: list[str] = []
    shots = tmp_path / "build" / "report-screenshots"
    shots.mkdir(parents=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM))
        try:
            for width, height in ((1400, 900), (390, 844)):
                context = browser.new_context(viewport={"width": width, "height": height}, offline=True)
                page = context.new_page()
                page.on(
                    "console",
                    lambda m: (
                        problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning") else None
                    ),
                )
                page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
                page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
                for path in pages(index):
                    page.goto(path.as_uri(), wait_until="load")
                    widths = page.evaluate(
                        "Array.from(document.images).map(i => [i.getAttribute('src'), i.naturalWidth])"
                    )
                    assert all(w > 0 for _, w in widths), (path, widths)
                    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
                    assert overflow <= 0, (path, width, overflow)
                    name = {index.parent: "index", index.parent / MODEL: MODEL}.get(path.parent, path.parent.name)
                    if path.parent.name == MODEL:  # the cross-SKU page
                        assert len(widths) == 4, widths
                    elif path.parent.name == NEW:
                        assert len(widths) == 5, widths
                    if path.parent.name in (MODEL, NEW, OLD) or path == index:
                        page.screenshot(path=str(shots / f"{name}-{width}.png"), full_page=True)
                context.close()
        finally:
            browser.close()
    assert not problems, problems
    for shot in sorted(shots.iterdir()):
        assert shot.stat().st_size > 10_000, shot
        if SHOTS:
            Path(SHOTS).mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, Path(SHOTS) / shot.name)
        print(f"screenshot: {shot}", file=sys.stderr)


# --- over reports the stages wrote ----------------------------------------------------------------


def test_report_over_a_really_built_pair(tmp_path):
    """The stages' own reports (whatever format bench writes today) make a page with every chart."""
    from pipeline.stages.bench import bench
    from pipeline.stages.build import build
    from pipeline.stages.data import make_data
    from pipeline.stages.manifest import write_manifest
    from pipeline.stages.prepare import prepare
    from pipeline.stages.reference import reference
    from pipeline.stages.validate import validate

    models.conv_bn_model(tmp_path / "models" / "conv" / "model.onnx")
    registry = load_registry(
        models.write_project(
            tmp_path,
            {MODEL: models.conv_bn_spec()},
            {
                "cpu": models.ort_sku("fp32", device_class="x86-test"),
                "other": models.ort_sku("fp32", device_class="x86-test"),
                "third": models.ort_sku("fp32", device_class="x86-test"),
            },
        )
    )
    prepare(registry, MODEL)
    make_data(registry, MODEL)
    reference(registry, MODEL)
    for sku in ("cpu", "other"):
        build(registry.pair(MODEL, sku))
        validate(registry.pair(MODEL, sku))
        bench(registry.pair(MODEL, sku))
    write_manifest(registry.pair(MODEL, "cpu"))
    index = write_site(registry)
    pair = index.parent / MODEL / "cpu"
    text = _read(pair / "index.html")
    assert "passed" in text and "Benchmark" in text and "no bench.json" not in text and "no timeline.csv" not in text
    assert {"latency.png", "timeline.png", "percentiles.png"} <= {p.name for p in pair.iterdir()}
    assert "not run" in _read(index)  # the SKU never built

    # the selection per device class: cpu (the one manifest) is chosen and marked on the model page,
    # beside its chart; other (benched, no manifest yet) and third (never built) are not candidates
    page = _read(index.parent / MODEL / "index.html")
    assert "Selected engine per device class" in page and (index.parent / MODEL / "selection-x86-test.png").is_file()
    chosen = re.findall(r'<tr class="chosen"><td>(.*?)</td>\s*<td>(.*?)</td>', page)
    assert chosen == [('<span class="passed" title="selected">★ selected</span>', "cpu")], chosen
    assert "cpu selected for x86-test (only candidate)" in page
    # no labelled split and no task agreement here: latency alone, as a strip
    assert 'alt="x86-test: latency of each candidate, cpu selected"' in page
    drawn = plots.selection(
        [
            ("a", 1.0, (0.9, 1.1), -0.01, "selected"),
            ("b", 1.5, None, 0.0, "tied"),
            ("c", 0.5, None, -0.2, "gates failed"),
        ],
        "engine-only p50 (ms)",
        "task metric delta (evaluation)",
        "x86-test: p50 against accuracy",
    )
    assert drawn.startswith(b"\x89PNG")
    # both with manifests: two points, the chosen one marked and its separation (or the tie) said
    write_manifest(registry.pair(MODEL, "other"))
    page = _read(write_site(registry).parent / MODEL / "index.html")
    record = select(registry, MODEL)
    (c,) = record.classes
    assert c.decision in ("separated", "tie") and c.chosen in ("cpu", "other")
    assert re.findall(r'<tr class="chosen"><td>.*?</td>\s*<td>(.*?)</td>', page) == [c.chosen]
    assert c.summary in page and f"{c.chosen} selected for x86-test" in page
    assert ("tie (tied: " in page) == (c.decision == "tie") and ("separated (separated from" in page) == (
        c.decision == "separated"
    )
    assert write_pair_report(registry, MODEL, "cpu") == [registry.root / "build" / MODEL / "cpu" / "report.html"]


def test_report_of_some_skus_and_the_ci_summary_link(site, tmp_path):
    from pipeline.ci.summary import markdown

    root = _copy(site, tmp_path)
    proc = skuforge("report", "--sku", NEW, "--sku", OLD, "--out", f"build/ci/{NEW}/report", cwd=root)
    assert proc.returncode == 0, proc.stderr
    report = root / "build" / "ci" / NEW / "report"
    assert {p.name for p in (report / MODEL).iterdir() if p.is_dir()} == {NEW, OLD}
    assert FAILED not in _read(report / "index.html")
    text = markdown(load_registry(root / "params.yaml"), NEW, "https://github.example/o/r/actions/runs/1#artifacts")
    assert "[run's artifacts](https://github.example/o/r/actions/runs/1#artifacts)" in text
    assert f"build/ci/{NEW}/report/index.html" in text


@pytest.mark.parametrize(
    "content, words",
    [(b"iteration,latency_ms\n0,abc\n", ["line 2", "'abc'"]), (b"iteration,latency_ms\n0,\xff\n", ["not a CSV file"])],
)
def test_damaged_samples_are_refused_naming_the_file(site, tmp_path, content, words):
    root = _copy(site, tmp_path)
    bad = root / "build" / MODEL / OLD / "latency.csv"
    bad.write_bytes(content)
    assert_user_error(skuforge("report", cwd=root), 2, str(bad), *words)


def test_samples_of_another_format_are_left_out(site, tmp_path):
    root = _copy(site, tmp_path)
    (root / "build" / MODEL / NEW / "timeline.csv").write_text("call,ms\n0,1.0\n")
    index = write_site(load_registry(root / "params.yaml"))
    assert "no timeline.csv" in _read(index.parent / MODEL / NEW / "index.html")


# --- end to end per step, preprocessing drift, energy ---------------------------------------------

HOSTILE = "<img src=x onerror=alert(1)>"  # in a preprocessing setting: drawn as text, never markup
HOSTILE_ESCAPED = "&lt;img src=x onerror=alert(1)&gt;"
NO_METER = UNAVAILABLE + "rapl: no /sys/class/powercap (not Linux, or no powercap driver)"


def _side(library: str, interpolation: str) -> dict:
    """A preprocessing description as pipeline.examples' describe() writes it."""
    return {
        "steps": [
            {"step": "decode", "library": library, "settings": {"kind": "image", "library": library}},
            {"step": "resize", "library": library, "settings": {"size": [8, 8], "interpolation": interpolation}},
            {"step": "normalize", "library": "numpy", "settings": {"mean": [0.0], "std": [255.0]}},
        ],
        "versions": {library: "1.0.0", "numpy": "2.0.0"},
    }


def _drift(name: str, gated: bool) -> dict:
    """A PreprocessingDrift with ``resize`` as the culprit: failing its gate, or reported only."""
    diff = InputDiff(max_abs=0.25, mean_abs=0.03, samples_differing=7, elements_differing=0.4)
    same = InputDiff(max_abs=0.0, mean_abs=0.0, samples_differing=0, elements_differing=0.0)
    return PreprocessingDrift(
        input=name,
        split="evaluation",
        samples=20,
        reference=_side("pillow", "area"),
        device=_side("opencv", HOSTILE),
        differing_steps=["decode", "resize"],
        diff=diff,
        metric="top1_accuracy",
        metric_reference=0.95,
        metric_device=0.8,
        metric_drop=0.15,
        worse=3,
        p_value=0.0625,
        drop_interval=(0.05, 0.25),
        max_metric_drop=0.03 if gated else None,
        steps=[
            StepDrift(
                step="decode", reference={"kind": "image"}, device={"kind": "image"}, input=same, metric_drop=0.0
            ),
            StepDrift(
                step="resize",
                reference={"interpolation": "area"},
                device={"interpolation": HOSTILE},
                input=diff,
                metric_drop=0.15,
                worse=3,
            ),
        ],
        culprit="resize",
        passed=not gated,
        failure="top1_accuracy drops 0.15 with the device's preprocessing, over 0.03" if gated else None,
    ).to_json()


def _energy() -> dict:
    return EnergyResult(
        available=True,
        source="rapl",
        domains={"package-0": 1.5, "core": 1.0, "dram": 0.5},
        summed=["package-0", "dram"],
        joules=2.0,
        joules_per_inference=0.0125,
        mean_power_w=4.0,
        window_seconds=0.5,
        inferences=160,
        phase="engine-only steady state",
    ).to_json()


def _sustained() -> dict:
    windows = [
        SustainedWindow(t_s=5.0 * (i + 1), calls=100, p50_ms=1.0 + 0.02 * i, p99_ms=2.0, temperature_c=50.0 + i)
        for i in range(6)
    ]
    return SustainedResult(
        seconds=30.0,
        batch=1,
        windows=windows,
        stopped="flat",
        reason="latency and temperature flat over the last 3 windows (slopes 0.01, 0.2 °C)",
        judged_on=["latency", "temperature"],
        equilibrium_windows=3,
        p50_ms=1.08,
        p99_ms=2.0,
        throughput_per_s=900.0,
        throttling=Throttling(latency_drift_pct=8.0, clock_reason="no CPU clock readable", temperature_rise_c=4.0),
    ).to_json()


def _update(path: Path, **fields) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _section(text: str, title: str) -> str:
    """The page from the ``<h2>`` named ``title`` to the next one."""
    return text.split(f"<h2>{title}</h2>", 1)[1].split("<h2>", 1)[0]


@pytest.fixture(scope="module")
def measured_site(site, tmp_path_factory):
    """The site's project with the per-step times, the drift check and the energy in its reports:
    NEW's meter unavailable and its drift gate failed, OLD's energy measured and a sustained run."""
    root = _copy(site, tmp_path_factory.mktemp("measured"))
    new, old = root / "build" / MODEL / NEW, root / "build" / MODEL / OLD
    steps = {name: _stats(p50, True) for name, p50 in (("decode", 0.2), ("preprocess", 0.3), ("infer", 0.5))}
    _update(
        new / "bench.json",
        end_to_end_steps={**steps, "postprocess": _stats(0.1, False)},
        end_to_end_input="8 raw png file(s) from the golden set, the device-side preprocessing",
        preprocessing={"image": _side("opencv", HOSTILE)},
        energy=EnergyResult(available=False, reason=NO_METER, phase="engine-only steady state").to_json(),
    )
    _update(new / "validate.json", preprocessing=[_drift("image", gated=True), _drift("mask", gated=False)])
    _update(old / "bench.json", energy=_energy(), sustained=_sustained())
    return write_site(load_registry(root / "params.yaml"), MODEL)


def test_pair_page_shows_end_to_end_per_step(measured_site):
    page = measured_site.parent / MODEL / NEW
    section = _section(_read(page / "index.html"), "End to end, per step")
    assert (page / "steps.png").read_bytes()[:4] == b"\x89PNG" and 'src="steps.png"' in section
    rows = re.findall(
        r'<tr(?: class="total")?><th>([^<]+)</th><td class="num">[^<]*</td><td class="num">[^<]*</td>\n'
        r'<td class="num">([^ <]+)',
        section,
    )
    assert rows == [
        ("decode", "0.2"),
        ("preprocess", "0.3"),
        ("infer", "0.5"),
        ("postprocess", "0.1"),
        ("end to end (whole call)", "1"),
        ("engine only", "0.5"),
    ], section
    assert "[0.19 – 0.21]" in section  # a step's p50 confidence interval
    assert "starts from: 8 raw png file(s) from the golden set" in section
    assert "add up to 1.1 ms against the whole call's p50 of 1 ms: percentiles do not add" in section
    assert "decode (opencv) → resize (opencv) → normalize (numpy)" in section


def test_pair_page_shows_the_preprocessing_drift_escaped(measured_site):
    text = _read(measured_site.parent / MODEL / NEW / "index.html")
    assert HOSTILE not in text and "<img src=x" not in text and "<script" not in text
    section = _section(text, "Preprocessing drift")
    assert section.count(HOSTILE_ESCAPED) == 4  # per input: the device side's resize settings, the attribution
    gated, reported = section.split("<h3>input mask", 1)
    assert '<h3>input image: <span class="failed">FAIL</span></h3>' in gated
    assert "top1_accuracy drops 0.15 with the device&#39;s preprocessing, over 0.03" in gated
    for tag in ("decode", "resize"):
        assert f'<tr class="differs"><th>{tag}</th><td><strong>differs</strong>' in gated, tag
    assert "<tr><th>normalize</th><td>same</td>" in gated
    assert '<tr class="differs"><th>pillow</th><td>1.0.0</td><td>–</td>' in gated  # versions, side by side
    assert "<tr><th>numpy</th><td>2.0.0</td><td>2.0.0</td>" in gated
    assert "max abs 0.25 · mean abs 0.03 · 7 of 20 samples differ" in gated
    assert "top1_accuracy: 0.95 with the training preprocessing, 0.8 with the device's" in gated
    assert "0.15 [0.05 – 0.25] (95% confidence interval) · p-value 0.0625" in gated
    assert "<tr><th>gate</th><td>metric drop at most 0.03</td>" in gated
    assert "<strong>resize</strong>" in gated and "resize (culprit)" in gated
    assert ': <span class="passed">passed</span></h3>' in reported
    assert "<td>reported, not gated</td>" in reported


def test_pair_page_says_why_energy_is_unavailable(measured_site):
    energy = _section(_read(measured_site.parent / MODEL / NEW / "index.html"), "Energy")
    assert f'<p class="note">{NO_METER} (over the engine-only steady state)</p>' in energy
    assert "joules per inference" not in energy and "no sustained run" in energy


def test_pair_page_shows_measured_energy_and_the_sustained_run(measured_site):
    page = measured_site.parent / MODEL / OLD
    energy = _section(_read(page / "index.html"), "Energy")
    assert '<tr><th>joules per inference (J)</th><td class="num">0.0125</td></tr>' in energy
    assert '<tr><th>mean power (W)</th><td class="num">4</td></tr>' in energy
    assert "<td>package-0, dram</td>" in energy and "<td>rapl</td>" in energy
    assert (page / "sustained.png").read_bytes()[:4] == b"\x89PNG" and 'src="sustained.png"' in energy
    assert "stopped: <strong>flat</strong>: latency and temperature flat" in energy
    assert "latency_drift_pct" in energy and "no CPU clock readable" in energy
    assert "6 windows" in energy


def test_model_page_shows_drift_and_energy_per_sku(measured_site):
    text = _read(measured_site.parent / MODEL / "index.html")
    assert "<th>preprocessing drift (metric drop)</th><th>J/inference</th>" in text
    new_row = text.split(f'href="{NEW}/index.html"', 1)[1].split("</tr>", 1)[0]
    old_row = text.split(f'href="{OLD}/index.html"', 1)[1].split("</tr>", 1)[0]
    assert 'image 0.15 <span class="failed">FAIL</span><br>mask 0.15 <span class="passed">passed</span>' in new_row
    assert f'<span class="other" title="{NO_METER}">unavailable</span>' in new_row
    assert old_row.endswith('<td class="num">–</td><td class="num">0.0125</td>'), old_row
    for page in pages(measured_site):
        for ref in re.findall(r'(?:href|src)="([^"#]+)"', _read(page)):
            assert (page.parent / ref).is_file(), (page, ref)


def test_pages_without_these_fields_say_so(site):
    _, index = site
    old = _read(index.parent / MODEL / OLD / "index.html")
    assert "not recorded (a bench report of an older format): no per-step times" in old
    assert "not recorded (a validate report of an older format)" in _section(old, "Preprocessing drift")
    assert "not recorded (a bench report of an older format)" in _section(old, "Energy")
    assert "J/inference" not in _read(index.parent / MODEL / "index.html")  # no SKU has an energy figure
