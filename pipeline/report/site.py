"""The static HTML report: an index, a cross-SKU page per model and a page per (model, SKU).

Every value shown comes from a report file and is untrusted: the templates escape everything
(Jinja2 autoescape), the pages carry a Content-Security-Policy that runs no script and loads
nothing from the network, and the charts are PNG files next to the pages (or, in the
self-contained ``report.html`` that publish uploads, data URIs).
"""

from __future__ import annotations

import base64
import logging
import math
import re
import subprocess
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError, SkuforgeError
from pipeline.core.io import atomic_dir, atomic_write_bytes
from pipeline.core.paths import Layout, inside
from pipeline.core.progress import Progress
from pipeline.engine.matrix import matrix
from pipeline.project.config import KnownGap, Registry
from pipeline.report import plots
from pipeline.report.load import ROOFLINE, PairData, load_pair, read_optional
from pipeline.results.manifest import Manifest, load_manifest
from pipeline.results.reports import cache_unused
from pipeline.results.selection import ClassSelection, SelectionRecord
from pipeline.verify.selection import select

log = logging.getLogger(__name__)

DEFAULT_DIR = Path("build") / "report"
MARKER = ".skuforge-report"  # names a folder this module wrote: the only kind it replaces
PAIR_REPORT = "report.html"
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_PASSED = {"passed"}
_FAILED = {"gate failed", "build failed", "publish failed", "failed", "bad input", "unsupported"}
PLOT_ERRORS = (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, OverflowError)


# --- formatting (Jinja filters) -------------------------------------------------------------------


def fmt(value: Any) -> str:
    """A cell: floats to 4 significant digits (whole numbers with thousands separators from 10,000
    up, never ``1.8e+04``), yes/no, '–' for nothing; a mapping or a list of mappings as small
    key/value lists (escaped markup), never raw JSON."""
    import markupsafe

    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:,.0f}" if 1e4 <= abs(value) < 1e15 else f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dict):
        if not value:
            return "–"
        items = markupsafe.Markup("").join(
            markupsafe.Markup('<li><span class="k">{}</span> {}</li>').format(k, fmt(v))
            for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
        )
        return markupsafe.Markup('<ul class="kv">{}</ul>').format(items)
    if isinstance(value, (list, tuple)):
        if not value:
            return "–"
        if any(isinstance(v, (dict, list, tuple)) for v in value):
            return markupsafe.Markup(" ").join(fmt(v) for v in value)
        parts = [fmt(v) for v in value]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        return "[" + ", ".join(parts) + "]" if numeric else ", ".join(parts)
    return str(value)


def interval(value: Any) -> str:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value):
        return f"[{fmt(float(value[0]))} – {fmt(float(value[1]))}]"
    return ""


def status_class(outcome: str) -> str:
    base = outcome.split(" (")[0]  # PairOutcome.label: "passed (mixed: ...; cache: ...; warn: ...)"
    return "passed" if base in _PASSED else "failed" if base in _FAILED else "other"


def provenance(root: Path) -> dict[str, Any]:
    """What the index says it was written from: the project's git commit (None outside git), whether
    tracked files differ from it, and the time (UTC)."""

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "commit": commit,
        "dirty": bool(status) if status is not None else None,
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _environment():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(fmt=fmt, ci=interval, status_class=status_class)
    return env


# --- where the charts go --------------------------------------------------------------------------


class _Files:
    """Charts as PNG files in ``folder``; the page refers to them by name."""

    def __init__(self, folder: Path):
        self.folder = folder

    def __call__(self, name: str, png: bytes) -> str:
        (self.folder / name).write_bytes(png)
        return name


def _inline(name: str, png: bytes) -> str:
    """Charts as data URIs: the page is one self-contained file."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


Images = Callable[[str, bytes], str]


def _chart(images: Images, notes: list[str], name: str, what: str, draw: Callable[[], bytes]) -> str | None:
    """Draw one chart; an odd report (an empty or non-positive series) leaves the chart out with a
    note on the page rather than failing the whole report."""
    try:
        return images(name, draw())
    except PLOT_ERRORS as exc:
        log.warning("%s: chart left out (%s: %s)", what, type(exc).__name__, exc)
        notes.append(f"{what}: chart left out ({type(exc).__name__}: {exc})")
        return None


# --- outcomes -------------------------------------------------------------------------------------


def _outcomes(
    registry: Registry, models: list[str], pairs: dict[tuple[str, str], PairData], notes: list[str] | None = None
) -> dict[tuple[str, str], tuple[str, str]]:
    """(model, SKU) -> (outcome, detail) as `skuforge summary` shows them (matrix(): the manifests,
    the failures stage commands recorded, what this host can build). A pair summary calls "not run"
    whose reports are here (the manifest stage has not run yet) keeps that outcome and says what
    validate.json holds in its detail. Only when the matrix cannot be read (a damaged manifest) do
    the outcomes come from validate.json alone, said in ``notes``."""

    try:
        rows = matrix(registry, models, list(dict.fromkeys(s for _, s in pairs)))
        found: dict[tuple[str, str], tuple[str, str]] = {(r.model, r.sku): (r.label, r.detail) for r in rows}
    except SkuforgeError as exc:
        log.warning("outcomes from the reports alone: %s", exc.message)
        if notes is not None:
            notes.append(f"outcomes from validate.json alone, not the manifests: {exc.message}")
        found = {}
        for key, pair in pairs.items():
            passed = _d(pair.validate).get("passed")
            detail = "; ".join(str(f) for f in _list(_d(pair.validate).get("failures")))
            found[key] = (
                ("passed" if passed else "gate failed", detail) if isinstance(passed, bool) else ("not run", "")
            )
        return found
    for key, pair in pairs.items():
        outcome, detail = found[key]
        if outcome == "not run" and pair.validate is not None and isinstance(pair.validate.get("passed"), bool):
            said = "passed" if pair.validate["passed"] else "failed"
            found[key] = (outcome, f"{detail}; validate.json here says {said} (the manifest stage makes it an outcome)")
    return found


# --- per-pair page --------------------------------------------------------------------------------


def _d(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _ci(value: Any) -> tuple[float, float] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(_num(v) is not None for v in value):
        return float(value[0]), float(value[1])
    return None


def engine_bytes(build: dict[str, Any] | None) -> int | None:
    files = _list(_d(build).get("engine_files"))
    sizes = [n for f in files if isinstance(f, dict) and isinstance(n := f.get("bytes"), int)]
    return sum(sizes) if sizes else None


def _bench_view(pair: PairData, images: Images, notes: list[str]) -> dict[str, Any] | None:
    b = pair.bench
    if b is None:
        return None
    what = f"{pair.model}/{pair.sku}"
    phases = [
        (label, _d(b.get(key)))
        for label, key in (("engine only", "engine_only"), ("end to end", "end_to_end"), ("warm-up", "warmup"))
        if b.get(key)
    ]
    summary = {
        k: b[k]
        for k in (
            "batch",
            "concurrency",
            "throughput_per_s",
            "throughput_ci_per_s",
            "stopped",
            "load_seconds",
            "first_inference_ms",
        )
        if k in b
    }
    engine = _d(b.get("engine_only"))
    shown: list[tuple[str | None, str]] = []  # (image, caption): None where the chart was left out
    if pair.latency_ms:
        marks = {p: v for p in ("p50", "p95", "p99") if (v := _num(engine.get(f"{p}_ms"))) is not None}
        src = _chart(
            images,
            notes,
            "latency.png",
            f"{what} latency histogram",
            lambda: plots.latency_distribution(pair.latency_ms, marks),
        )
        scale, _ = plots.latency_axis(pair.latency_ms)
        caption = "latency histogram and CDF" + (
            f" (log x: p99.9 is over {plots.SPAN_FOR_LOG:g}× p50)" if scale == "log" else ""
        )
        shown.append((src, caption))
    if pair.timeline is not None:
        t = pair.timeline
        src = _chart(
            images,
            notes,
            "timeline.png",
            f"{what} timeline",
            lambda: plots.timeline(t.iteration, t.phase, t.latency_ms),
        )
        shown.append((src, "latency per call, warm-up to steady state"))
    elif pair.latency_ms:
        lat = pair.latency_ms
        src = _chart(
            images,
            notes,
            "timeline.png",
            f"{what} timeline",
            lambda: plots.timeline(list(range(len(lat))), ["steady"] * len(lat), lat),
        )
        shown.append((src, "latency per steady call (no timeline.csv)"))
    rows = [
        (f"{label} {p}", v, _ci(s.get(f"{p}_ci_ms")))
        for label, key in (("engine only", "engine_only"), ("end to end", "end_to_end"))
        for s in [_d(b.get(key))]
        for p in ("p50", "p95", "p99")
        if (v := _num(s.get(f"{p}_ms"))) is not None
    ]
    if rows:
        if not any(ci for *_, ci in rows):
            notes.append(
                "no confidence intervals in bench.json (too few samples for them, or a bench report of an older format)"
            )
        src = _chart(images, notes, "percentiles.png", f"{what} percentiles", lambda: plots.percentile_intervals(rows))
        shown.append((src, "percentiles with confidence intervals"))
    sweep = [p for p in _list(b.get("sweep")) if isinstance(p, dict)]
    usable = [
        p
        for p in sweep
        if all(_num(p.get(k)) is not None for k in ("batch", "concurrency", "p50_ms", "p99_ms", "throughput_per_s"))
    ]
    sweep_plot = None
    if len(usable) >= 2:
        sweep_plot = _chart(images, notes, "sweep.png", f"{what} sweep", lambda: plots.sweep(usable))
    state = _d(b.get("device_state"))
    before, after = _d(state.get("before")), _d(state.get("after"))
    device = [(k, before.get(k), after.get(k)) for k in sorted(set(before) | set(after))]
    if not device and state:
        device = [(k, v, None) for k, v in sorted(state.items())]
    return {
        "phases": phases,
        "summary": summary,
        "plots": [(s, a) for s, a in shown if s],
        "steady_state": _d(b.get("steady_state")),
        "drift": _d(b.get("drift")),
        "execution": _d(b.get("execution")),
        "sweep": sweep,
        "sweep_plot": sweep_plot,
        "memory": _d(b.get("memory_mb")),
        "device_state": device,
    }


def _correctness_view(validate: dict[str, Any] | None) -> dict[str, Any] | None:
    if validate is None:
        return None
    passed = validate.get("passed")
    gates = [
        (name, _d(validate.get(key)))
        for name, key in (("placement", "placement"), ("precision gate", "precision_gate"))
        if validate.get(key)
    ]
    return {
        "outcome": "passed" if passed is True else "failed" if passed is False else "unknown",
        "precision": validate.get("precision"),
        "failures": [str(f) for f in _list(validate.get("failures"))],
        "outputs": [_d(o) for o in _list(validate.get("outputs"))],
        "metrics": [_d(m) for m in _list(validate.get("metrics"))],
        "gates": gates,
    }


STEP_ORDER = ("decode", "preprocess", "infer", "postprocess")  # BenchReport.end_to_end_steps


def _pipeline_steps(side: Any) -> list[dict[str, Any]]:
    """A preprocessing description's steps ({steps: [{step, library, settings}], versions})."""
    return [
        {"step": x.get("step"), "library": x.get("library"), "settings": x.get("settings")}
        for x in map(_d, _list(_d(side).get("steps")))
    ]


def _pick(value: Any, keys: Iterable[str]) -> dict[str, Any]:
    """``value``'s ``keys`` (None where absent): a template reads every one of them."""
    return {k: _d(value).get(k) for k in keys}


_STATS = ("iterations", "mean_ms", "p50_ms", "p95_ms", "p99_ms", "max_ms", "p50_ci_ms", "p95_ci_ms", "p99_ci_ms")
_DIFF = ("max_abs", "mean_abs", "samples_differing", "elements_differing")


def _steps_view(pair: PairData, images: Images, notes: list[str]) -> dict[str, Any] | None:
    """The end-to-end calls timed per step (decode, preprocess, infer, postprocess), their chart
    beside the engine-only p50, what a call starts from and the device-side preprocessing it ran."""
    b = _d(pair.bench)
    steps = _d(b.get("end_to_end_steps"))
    if not steps:
        return None
    names = [n for n in STEP_ORDER if n in steps] + [n for n in steps if n not in STEP_ORDER]
    rows = [(name, _pick(steps[name], _STATS)) for name in names]
    whole, engine = _pick(b.get("end_to_end"), _STATS), _pick(b.get("engine_only"), _STATS)
    p50s = [(name, v) for name, s in rows if (v := _num(s.get("p50_ms"))) is not None]
    plot = None
    if p50s:
        plot = _chart(
            images,
            notes,
            "steps.png",
            f"{pair.model}/{pair.sku} end to end per step",
            lambda: plots.step_bars(p50s, _num(whole.get("p50_ms")), _num(engine.get("p50_ms"))),
        )
    preprocessing = [
        {"input": name, "steps": _pipeline_steps(side), "versions": _d(_d(side).get("versions"))}
        for name, side in sorted(_d(b.get("preprocessing")).items())
    ]
    return {
        "rows": rows,
        "whole": whole,
        "engine": engine,
        "input": b.get("end_to_end_input"),
        "sum_p50": sum(v for _, v in p50s) if p50s else None,
        "plot": plot,
        "preprocessing": preprocessing,
    }


def _energy_view(energy: Any) -> dict[str, Any] | None:
    """An EnergyResult's figures, or its reason verbatim: an energy not measured is never shown as 0."""
    e = _d(energy)
    if not e:
        return None
    if e.get("available") is not True:
        reason = e.get("reason")
        return {
            "available": False,
            "reason": str(reason) if reason else "unavailable: the report gives no reason",
            "phase": e.get("phase"),
        }
    figures = [
        ("joules per inference (J)", e.get("joules_per_inference")),
        ("mean power (W)", e.get("mean_power_w")),
        ("idle floor before (W)", e.get("idle_power_w")),
        ("above the floor, per inference (J)", e.get("above_idle_joules_per_inference")),
        ("source", e.get("source")),
        ("summed domains", [str(x) for x in _list(e.get("summed"))]),
        ("joules per domain", _d(e.get("domains"))),
        ("joules (summed)", e.get("joules")),
        ("window (s)", e.get("window_seconds")),
        ("inferences", e.get("inferences")),
        ("phase", e.get("phase")),
        ("sampling", e.get("sampling")),
    ]
    return {"available": True, "figures": figures}


def _sustained_view(sustained: Any, images: Images, notes: list[str], what: str) -> dict[str, Any] | None:
    """A SustainedResult: the p50 and temperature per window as a chart, why it stopped, the
    equilibrium figures and the throttling."""
    s = _d(sustained)
    if not s:
        return None
    windows = [
        _pick(w, ("t_s", "calls", "p50_ms", "p99_ms", "temperature_c", "cpu_mhz", "power_w"))
        for w in _list(s.get("windows"))
    ]
    points = [
        (t, p, _num(w.get("temperature_c")))
        for w in windows
        if (t := _num(w.get("t_s"))) is not None and (p := _num(w.get("p50_ms"))) is not None
    ]
    plot = None
    if points:
        plot = _chart(
            images,
            notes,
            "sustained.png",
            f"{what} sustained run",
            lambda: plots.sustained([t for t, *_ in points], [p for _, p, _ in points], [c for *_, c in points]),
        )
    keys = (
        "seconds",
        "batch",
        "judged_on",
        "latency_slope",
        "temperature_slope_c",
        "equilibrium_windows",
        "p50_ms",
        "p99_ms",
        "throughput_per_s",
    )
    return {
        "stopped": s.get("stopped"),
        "reason": s.get("reason"),
        "equilibrium": {k: s[k] for k in keys if k in s},
        "throttling": _d(s.get("throttling")),
        "energy": _energy_view(s.get("energy")),
        "windows": windows,
        "plot": plot,
    }


def _drift_gate(drift: dict[str, Any]) -> str:
    gates = [
        f"{label} at most {fmt(value)}"
        for label, key in (
            ("metric drop", "max_metric_drop"),
            ("input max abs difference", "max_input_diff"),
            ("change of the postprocess's results", "max_agreement_drop"),
        )
        if (value := _num(drift.get(key))) is not None
    ]
    return ", ".join(gates) if gates else "reported, not gated"


def _one_drift(drift: dict[str, Any]) -> dict[str, Any]:
    """One PreprocessingDrift: the two sides step by step (the differing ones marked), their
    library versions, the input and metric differences, the gate and the per-step attribution."""
    ref, dev = _d(drift.get("reference")), _d(drift.get("device"))
    differing = list(dict.fromkeys(str(x) for x in _list(drift.get("differing_steps"))))
    ref_steps = {str(x.get("step")): x for x in _pipeline_steps(ref)}
    dev_steps = {str(x.get("step")): x for x in _pipeline_steps(dev)}
    steps = [
        {"step": name, "differs": name in differing, "reference": ref_steps.get(name), "device": dev_steps.get(name)}
        for name in dict.fromkeys([*ref_steps, *dev_steps])
    ]
    ref_versions, dev_versions = _d(ref.get("versions")), _d(dev.get("versions"))
    versions = [
        (lib, ref_versions.get(lib), dev_versions.get(lib), ref_versions.get(lib) != dev_versions.get(lib))
        for lib in sorted(set(ref_versions) | set(dev_versions), key=str)
    ]
    passed = drift.get("passed")
    return {
        "input": drift.get("input"),
        "split": drift.get("split"),
        "samples": drift.get("samples"),
        "steps": steps,
        "differing": differing,
        "versions": versions,
        "diff": _pick(drift.get("diff"), _DIFF),
        "metric": drift.get("metric"),
        "metric_reference": drift.get("metric_reference"),
        "metric_device": drift.get("metric_device"),
        "metric_drop": drift.get("metric_drop"),
        "drop_interval": _ci(drift.get("drop_interval")),
        "confidence": f"{c:.0%}" if (c := _num(drift.get("confidence"))) is not None and 0 < c < 1 else None,
        "p_value": drift.get("p_value"),
        "worse": drift.get("worse"),
        "better": drift.get("better"),
        "gate": _drift_gate(drift),
        "passed": passed if isinstance(passed, bool) else None,
        "failure": drift.get("failure"),
        "attribution": [
            {
                **_pick(x, ("step", "reference", "device", "metric_drop", "worse", "better")),
                "input": _pick(x.get("input"), _DIFF),
            }
            for x in map(_d, _list(drift.get("steps")))
        ],
        "culprit": drift.get("culprit"),
    }


def _drift_view(validate: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """validate.json's preprocessing drift per input; None where validate.json has no such field."""
    if validate is None or "preprocessing" not in validate:
        return None
    return [_one_drift(_d(x)) for x in _list(validate.get("preprocessing"))]


def _roofline_layers(roofline: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Layer name -> its measured time, achieved GFLOP/s and intensity, from roofline.json
    (pipeline.perf.roofline.RooflineReport: the layer's name is the engine layer's where it was timed)."""
    out = {}
    for layer in _list(_d(roofline).get("layers")):
        if isinstance(layer, dict) and isinstance(layer.get("name"), str):
            out[layer["name"]] = {
                "time_ms": _num(layer.get("time_ms")),
                "gflops": _num(layer.get("achieved_gflops")),
                "intensity": _num(layer.get("intensity")),
            }
    return out


def _layers_view(build: dict[str, Any] | None, roofline: dict[str, Any] | None) -> dict[str, Any] | None:
    layers = [_d(x) for x in _list(_d(build).get("layers"))]
    if not layers:
        return None
    timed = _roofline_layers(roofline)
    empty = {"time_ms": None, "gflops": None, "intensity": None}
    rows = [
        {
            "name": layer.get("name"),
            "op_type": layer.get("op_type"),
            "precision": layer.get("precision"),
            "device": layer.get("device"),
            "kernel": layer.get("kernel"),
            "fused_from": [str(f) for f in _list(layer.get("fused_from"))],
            **timed.get(str(layer.get("name")), empty),
        }
        for layer in layers
    ]
    return {"rows": rows, "timed": bool(timed)}


PEAK_PROBE = "skuforge runner probe --peaks --refresh"


def above_roof(roofline: dict[str, Any]) -> tuple[list[str], list[tuple[float, float]]]:
    """What in roofline.json lies above the roof, which no measurement can: one line per wrong peak
    naming it (compute or memory), the achieved figure against the measured peak and what to check;
    and the (intensity, achieved GFLOP/s) points over the roof, for the chart."""
    peak_gflops, peak_gbs = _num(roofline.get("peak_gflops")), _num(roofline.get("peak_gbs"))
    if not peak_gflops or not peak_gbs or peak_gflops <= 0 or peak_gbs <= 0:
        return [], []
    items: list[tuple[str, float | None, float | None]] = [
        ("the engine", _num(roofline.get("intensity")), _num(roofline.get("achieved_gflops")))
    ]
    items += [
        (f"layer {_d(x).get('name')}", _num(_d(x).get("intensity")), _num(_d(x).get("achieved_gflops")))
        for x in _list(roofline.get("layers"))
    ]
    int8 = roofline.get("peak_kind") in ("int8", "mixed")
    unit = "GOP/s" if int8 else "GFLOP/s"
    compute, memory, points = [], [], []
    for name, intensity, achieved in items:
        if not intensity or not achieved or intensity <= 0 or achieved <= 0:
            continue
        gbs = achieved / intensity
        if achieved > peak_gflops:
            compute.append(f"{name} {fmt(achieved)} {unit}")
        if gbs > peak_gbs:
            memory.append(f"{name} {fmt(gbs)} GB/s (bandwidth fraction {fmt(gbs / peak_gbs)})")
        if achieved > peak_gflops or gbs > peak_gbs:
            points.append((intensity, achieved))
    lines = []
    if compute:
        peak = {"int8": "the measured INT8 peak", "mixed": "the measured INT8/FP32 blend peak"}.get(
            str(roofline.get("peak_kind")), "a measured compute peak"
        )
        lines.append(
            f"above the roof, compute peak wrong: {', '.join(compute)} against {peak} of "
            f"{fmt(peak_gflops)} {unit}. The peak is too low or the FLOPs counted too many: "
            f"rerun the peak probe ({PEAK_PROBE}) and check the FLOP count of the model's ops"
        )
    if memory:
        lines.append(
            f"above the roof, memory peak wrong: {', '.join(memory)} against a measured bandwidth peak of "
            f"{fmt(peak_gbs)} GB/s. The peak is too low, or the bytes counted as memory traffic were served "
            f"from cache: rerun the peak probe ({PEAK_PROBE}) and check the byte count"
        )
    return lines, points


def _roofline_view(
    roofline: dict[str, Any] | None, images: Images, notes: list[str], what: str
) -> dict[str, Any] | None:
    """The RooflineReport's figures, its heaviest layers and the chart (pipeline/perf/roofline.py)."""
    if roofline is None:
        return None
    peak_gflops, peak_gbs = _num(roofline.get("peak_gflops")), _num(roofline.get("peak_gbs"))
    summary = {k: v for k, v in roofline.items() if k not in ("layers", "uncounted")}
    layers = [_d(x) for x in _list(roofline.get("layers"))]
    uncounted = _list(roofline.get("uncounted"))
    if uncounted:
        notes.append(f"roofline: {len(uncounted)} node(s) of ops without a FLOP formula count 0 FLOPs")
    wrong, over = above_roof(roofline)
    # INT8 ops are counted as ops, not FLOPs (roofline.json peak_kind: which peak judges the engine)
    op = "FLOP" if roofline.get("peak_kind", "fp32") == "fp32" else "OP"
    view: dict[str, Any] = {"summary": summary, "layers": layers, "plot": None, "above": wrong, "op": op}
    if not peak_gflops or not peak_gbs or peak_gflops <= 0 or peak_gbs <= 0:
        notes.append(f"{ROOFLINE} has no positive compute and bandwidth peaks: no roofline chart")
        return view
    points = [
        (str(x.get("name")), i, a)
        for x in layers
        if (i := _num(x.get("intensity"))) and (a := _num(x.get("achieved_gflops"))) and i > 0 and a > 0
    ]
    if layers and not points:
        notes.append("roofline: no per-layer times (the backend does not profile layers): layers are not plotted")
    engine = (_num(roofline.get("intensity")), _num(roofline.get("achieved_gflops")))
    kind = str(roofline.get("peak_kind") or "fp32")
    roof = {"fp32": "all_cores", "int8": "int8_all_cores"}.get(kind)  # drawn as the roof itself
    ceilings = {
        _ceiling_label(k, v, kind): v for k, v in _d(roofline.get("ceilings_gflops")).items() if _num(v) and k != roof
    }
    bandwidths = {
        f"{k} {v:.4g} GB/s": v for k, v in _d(roofline.get("ceilings_gbs")).items() if _num(v) and k != "triad"
    }
    view["plot"] = _chart(
        images,
        notes,
        "roofline.png",
        f"{what} roofline",
        lambda: plots.roofline(
            peak_gflops, peak_gbs, points, engine if None not in engine else None, ceilings, bandwidths, over, kind
        ),
    )
    return view


def _ceiling_label(key: str, value: float, kind: str) -> str:
    """A compute ceiling named by its peak: INT8 ones in GOP/s; FP32 ones marked as such beside INT8."""
    if key.startswith("int8_"):
        return f"INT8 {key.removeprefix('int8_')} {value:.4g} GOP/s"
    return f"{'FP32 ' if kind != 'fp32' else ''}{key} {value:.4g} GFLOP/s"


def _build_view(build: dict[str, Any] | None) -> dict[str, Any] | None:
    if build is None:
        return None
    return {
        "backend": build.get("backend"),
        "precision": build.get("precision"),
        "engine_bytes": engine_bytes(build),
        "seconds": build.get("build_seconds"),
        "cache": _cache_view(_d(build.get("cache"))),
    }


def _cache_view(cache: dict[str, Any]) -> dict[str, Any] | None:
    """The checked-in compiler cache as the build found and used it (build.json's ``cache``)."""
    if not cache:
        return None
    kind, state = str(cache.get("kind")), str(cache.get("state"))
    return {
        "kind": kind,
        "state": state,
        "reason": cache.get("reason"),
        "hits": cache.get("hits"),
        "misses": cache.get("misses"),
        "unused": cache_unused(kind, state),
        "ignored": [str(x) for x in _list(cache.get("ignored"))],
    }


def _pair_html(env, pair: PairData, outcome: tuple[str, str], images: Images, nav: bool) -> str:
    notes = list(pair.notes)
    what = f"{pair.model}/{pair.sku}"
    bench = _bench_view(pair, images, notes)
    steps = _steps_view(pair, images, notes)
    sustained = _sustained_view(_d(pair.bench).get("sustained"), images, notes, what)
    roofline = _roofline_view(pair.roofline, images, notes, what)
    return env.get_template("pair.html.j2").render(
        model=pair.model,
        sku=pair.sku,
        outcome=outcome[0],
        detail=outcome[1],
        nav=nav,
        build=_build_view(pair.build),
        bench=bench,
        steps=steps,
        energy=_energy_view(_d(pair.bench).get("energy")),
        sustained=sustained,
        correctness=_correctness_view(pair.validate),
        drift=_drift_view(pair.validate),
        has_validate=pair.validate is not None,
        roofline=roofline,
        roofline_note=f"no {ROOFLINE} for this pair (the roofline step has not run here)",
        layers=_layers_view(pair.build, pair.roofline),
        page_notes=notes,
    )


# --- cross-SKU page -------------------------------------------------------------------------------


def _model_row(pair: PairData, outcome: tuple[str, str], href: str | None) -> dict[str, Any]:
    b = _d(pair.bench)
    engine, e2e, memory = _d(b.get("engine_only")), _d(b.get("end_to_end")), _d(b.get("memory_mb"))
    deltas = [(m.get("split"), m.get("delta")) for m in _list(_d(pair.validate).get("metrics")) if isinstance(m, dict)]
    return {
        "sku": pair.sku,
        "outcome": outcome[0],
        "href": href,
        "p50": _num(engine.get("p50_ms")),
        "p50_ci": _ci(engine.get("p50_ci_ms")),
        "p99": _num(engine.get("p99_ms")),
        "p99_ci": _ci(engine.get("p99_ci_ms")),
        "e2e_p50": _num(e2e.get("p50_ms")),
        "throughput": _num(b.get("throughput_per_s")),
        "throughput_ci": _ci(b.get("throughput_ci_per_s")),
        "peak_rss": _num(memory.get("peak_rss")),
        "load_delta": _num(memory.get("engine_load_delta")),
        "deltas": deltas,
        "engine_bytes": engine_bytes(pair.build),
        "drift": [(d["input"], d["metric_drop"], d["passed"]) for d in _drift_view(pair.validate) or []],
        "energy": _energy_cell(b.get("energy")),
    }


def _energy_cell(energy: Any) -> dict[str, Any] | None:
    """J/inference for the cross-SKU table, or the reason there is none (never a 0)."""
    view = _energy_view(energy)
    if view is None:
        return None
    if not view["available"]:
        return {"jpi": None, "reason": view["reason"]}
    return {"jpi": _num(_d(energy).get("joules_per_inference")), "reason": None}


def _model_charts(model: str, rows: list[dict[str, Any]], images: Images, notes: list[str]) -> list[tuple[str, str]]:
    benched = [r for r in rows if r["p50"] is not None]
    if not benched:
        return []
    skus = [r["sku"] for r in benched]
    charts = [
        (
            "latency.png",
            "engine-only latency per SKU",
            lambda: plots.latency_bars(
                skus,
                [r["p50"] for r in benched],
                [r["p50_ci"] for r in benched],
                [r["p99"] for r in benched],
                [r["p99_ci"] for r in benched],
            ),
        ),
        (
            "throughput.png",
            "throughput per SKU",
            lambda: plots.bars(
                skus,
                [r["throughput"] for r in benched],
                "throughput per SKU",
                "samples/s",
                [r["throughput_ci"] for r in benched],
            ),
        ),
        (
            "memory.png",
            "peak memory per SKU",
            lambda: plots.bars(skus, [r["peak_rss"] for r in benched], "peak RSS per SKU", "MB"),
        ),
        (
            "engine-size.png",
            "engine size per SKU",
            lambda: plots.bars(skus, [r["engine_bytes"] for r in benched], "engine size per SKU", "bytes"),
        ),
    ]
    out = []
    for name, alt, draw in charts:
        src = _chart(images, notes, name, f"{model} {alt}", draw)
        if src:
            out.append((src, alt))
    return out


# --- the selection per device class ---------------------------------------------------------------


ACCURACY_SPLIT = "evaluation"  # the split whose task-metric delta the selection chart plots, where present


def _accuracy(m: Manifest | None) -> tuple[str, float] | None:
    """(what, figure) the selection chart plots upwards for one engine: the task metric's delta on
    the evaluation split (else the first split), else the first task agreement; None: neither."""
    if m is None:
        return None
    metrics = sorted(m.correctness.metrics, key=lambda x: x.split != ACCURACY_SPLIT)
    if metrics:
        return f"task metric delta ({metrics[0].split})", metrics[0].delta
    agreed = [t for t in m.correctness.task if t.value is not None]
    if agreed:
        return f"{agreed[0].statistic} (engine vs reference)", float(agreed[0].value or 0.0)
    return None


def _point_state(c: ClassSelection, sku: str, eligible: bool) -> str:
    if sku == c.chosen:
        return "selected"
    if not eligible:
        return "gates failed"
    return "tied" if sku in c.tied else "passed"


def _class_view(
    record: SelectionRecord,
    c: ClassSelection,
    manifests: dict[str, Manifest],
    gaps: dict[str, list[KnownGap]],
    images: Images,
    notes: list[str],
) -> dict[str, Any]:
    lower = record.objective != "throughput"
    unit = "ms" if lower else "samples/s"
    xlabel = f"engine-only {record.objective} ({unit})" if lower else "throughput (samples/s)"
    accuracy = {x.sku: _accuracy(manifests.get(x.sku)) for x in c.candidates}
    labels = sorted({a[0] for a in accuracy.values() if a is not None})
    ylabel = labels[0] if len(labels) == 1 else ("accuracy figure (see the table)" if labels else None)
    rows, points = [], []
    for x in c.candidates:
        a = accuracy[x.sku]
        state = _point_state(c, x.sku, x.eligible) if x.value is not None else None
        rows.append(
            {
                "sku": x.sku,
                "backend": x.backend,
                "precision": x.precision,
                "value": x.value,
                "interval": x.interval,
                "accuracy": a[1] if a else None,
                "accuracy_what": a[0] if a else None,
                "gates": "passed" if x.eligible else x.reason,
                "eligible": x.eligible,
                "state": state or "no figure",
                "chosen": x.sku == c.chosen,
                "upstream": [] if x.sku == c.chosen else gaps.get(x.sku, []),  # why a losing one is slow
            }
        )
        if x.value is not None and (ylabel is None or a is not None):
            points.append((x.sku, x.value, x.interval, a[1] if a else None, state or "passed"))
    if ylabel is not None and len(points) < sum(1 for x in c.candidates if x.value is not None):
        notes.append(f"{c.device_class}: a candidate without an accuracy figure is in the table, not on the chart")
    name = f"selection-{_safe(c.device_class)}.png"
    title = f"{c.device_class}: {record.objective} against accuracy" if ylabel else f"{c.device_class}: {xlabel}"
    plot = (
        _chart(
            images,
            notes,
            name,
            f"{record.model} selection for {c.device_class}",
            lambda: plots.selection(points, xlabel, ylabel, title),
        )
        if points
        else None
    )
    return {
        "device_class": c.device_class,
        "decision": c.decision,
        "chosen": c.chosen,
        "runner_up": c.runner_up,
        "summary": c.summary,
        "tied": c.tied,
        "margin": c.margin,
        "notes": c.notes,
        "rule": c.rule,
        "rows": rows,
        "plot": plot,
        "alt": f"{c.device_class}: {'latency' if lower else 'throughput'} of each candidate"
        + (" against accuracy" if ylabel else "")
        + (f", {c.chosen} selected" if c.chosen else ", none selected"),
        "unit": unit,
    }


def _selection_view(registry: Registry, model: str, images: Images, notes: list[str]) -> dict[str, Any] | None:
    """The selection per device class (pipeline/verify/selection.py), computed from the manifests
    present as `skuforge select` does; whether build/.selection/<model>.json is that record."""
    layout = Layout(registry.root)
    try:
        record = select(registry, model)
        manifests = {
            x.sku: load_manifest(layout.manifest(model, x.sku))
            for c in record.classes
            for x in c.candidates
            if x.manifest_digest is not None
        }
    except SkuforgeError as exc:
        notes.append(f"selection left out: {exc}")
        return None
    if not record.classes:
        return None
    path = layout.selection(model)
    try:
        written = read_optional(path)
    except InputError:
        written = {"digest": "unreadable"}
    on_disk = (
        f"build/.selection/{model}.json is this record"
        if written is not None and written.get("digest") == record.digest
        else f"build/.selection/{model}.json is not written yet: skuforge select --model {model} writes it"
        if written is None
        else f"build/.selection/{model}.json differs (stale): shown is the selection the manifests give now; "
        f"skuforge select --model {model} writes it again"
    )
    return {
        "digest": record.digest,
        "objective": record.objective,
        "confidence": record.confidence,
        "on_disk": on_disk,
        "classes": [_class_view(record, c, manifests, registry.known_gaps(), images, notes) for c in record.classes],
    }


def _consistency_view(path: Path) -> dict[str, Any] | None:
    report = read_optional(path)
    if report is None:
        return None
    outputs = []
    for o in _list(report.get("outputs")):
        o = _d(o)
        labels = [str(x) for x in _list(o.get("labels"))]
        tables = [
            (metric.replace("_", " "), list(zip(labels, _list(o.get(metric)), strict=True)))
            for metric in ("max_abs_error", "mean_abs_error", "top1_agreement", "nonfinite_mismatch")
            if isinstance(o.get(metric), list)
        ]
        outputs.append({"output": o.get("output"), "kind": o.get("kind"), "labels": labels, "tables": tables})
    return {
        "samples": report.get("samples"),
        "skus": [str(_d(s).get("sku")) for s in _list(report.get("skus"))],
        "skipped": [(_d(s).get("sku"), _d(s).get("reason")) for s in _list(report.get("skipped"))],
        "outputs": outputs,
    }


# --- the site -------------------------------------------------------------------------------------


def _safe(name: str) -> str:
    """``name`` as a folder name and URL path segment (registry names always are)."""
    if not _SAFE_NAME.fullmatch(name):
        raise InputError(f"{name!r} cannot name a report page", hint="use a registry name (letters, digits, '_')")
    return name


def _target(registry: Registry, out: str | Path | None) -> Path:
    """The report folder, inside the project, and one this module may replace."""
    root = Path(registry.root)
    target = inside(root, out if out is not None else DEFAULT_DIR)
    if target.resolve() == root.resolve():
        raise InputError(
            f"{target} is the project root: the report needs a folder of its own",
            hint=f"pass --out {DEFAULT_DIR.as_posix()} (the default)",
        )
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not (target / MARKER).is_file())):
        raise InputError(
            f"{target} exists and is not a skuforge report: writing the report would replace it",
            hint="choose another --out folder (or remove that one)",
        )
    return target


def write_site(
    registry: Registry,
    model: str | None = None,
    out: str | Path | None = None,
    skus: list[str] | None = None,
    progress: Progress | None = None,
) -> Path:
    """Write the HTML report of ``model`` (default: every model) over ``skus`` (default: every
    SKU) under ``out`` (relative to the project root; default build/report), replacing the
    previous report in one swap. Returns the index page. ``progress`` hears of each page (the
    charts make a pair page take a second or more).

    InputError (exit 2) when a report file is not JSON, or ``out`` leaves the project or holds
    something other than an earlier report; missing pieces are left out and said so on the pages.
    """
    models = [model] if model else list(registry.models)
    for m in models:
        registry.model(m)  # an unknown model: ConfigError naming the known ones
    skus = list(dict.fromkeys(skus)) if skus else list(registry.skus)
    for s in skus:
        registry.sku(s)
    target = _target(registry, out)
    layout = Layout(registry.root)
    pairs = {(m, s): load_pair(layout, _safe(m), _safe(s)) for m, s in registry.pairs(models, skus)}
    index_notes: list[str] = []
    outcomes = _outcomes(registry, models, pairs, index_notes)
    env = _environment()
    with atomic_dir(target) as tmp:
        (tmp / MARKER).write_text("written by skuforge report: `skuforge report` replaces this folder\n")
        index_models = []
        counts: dict[str, int] = {}
        pages = sum(1 for pair in pairs.values() if pair.has_page) + len(models) + 1
        written = 0

        def page(what: str) -> None:
            nonlocal written
            if progress is not None:
                progress(f"report {what}", written / pages)
            written += 1

        for m in models:
            rows, listed = [], []
            for s in [s for pm, s in pairs if pm == m]:  # the SKUs the model selects
                pair, outcome = pairs[m, s], outcomes[m, s]
                counts[outcome[0]] = counts.get(outcome[0], 0) + 1
                href = None
                if pair.has_page:
                    page(f"{m}/{s}")
                    folder = tmp / m / s
                    folder.mkdir(parents=True)
                    html = _pair_html(env, pair, outcome, _Files(folder), nav=True)
                    (folder / "index.html").write_text(html, encoding="utf-8")
                    href = f"{s}/index.html"
                row = _model_row(pair, outcome, href)
                rows.append(row)
                listed.append(
                    {
                        "sku": s,
                        "backend": registry.sku(s).backend,
                        "outcome": outcome[0],
                        "detail": outcome[1],
                        "p50": row["p50"],
                        "p99": row["p99"],
                        "href": f"{m}/{href}" if href else None,
                        "gaps": registry.sku(s).known_gaps,
                    }
                )
            (tmp / m).mkdir(exist_ok=True)
            page(m)
            notes: list[str] = []
            charts = _model_charts(m, rows, _Files(tmp / m), notes)
            html = env.get_template("model.html.j2").render(
                model=m,
                rows=rows,
                show_drift=any(r["drift"] for r in rows),
                show_energy=any(r["energy"] for r in rows),
                charts=charts,
                consistency=_consistency_view(layout.consistency_report(m)),
                selection=_selection_view(registry, m, _Files(tmp / m), notes),
                page_notes=notes,
            )
            (tmp / m / "index.html").write_text(html, encoding="utf-8")
            index_models.append({"name": m, "href": f"{m}/index.html", "pairs": listed})
        html = env.get_template("index.html.j2").render(
            models=index_models, counts=counts, page_notes=index_notes, written=provenance(Path(registry.root))
        )
        (tmp / "index.html").write_text(html, encoding="utf-8")
        if progress is not None:
            progress("report written", 1.0)
    log.info("report of %s written to %s", ", ".join(models), target)
    return target / "index.html"


def write_pair_report(registry: Registry, model: str, sku: str, out_dir: str | Path | None = None) -> list[Path]:
    """Write the self-contained page of one (model, SKU) (charts inlined) as ``report.html`` in
    ``out_dir`` (default: the pair's build folder, where publish uploads ``*.html`` from). Returns
    the files written: none when the pair has neither a bench nor a validate report."""
    registry.model(model)
    registry.sku(sku)
    layout = Layout(registry.root)
    pair = load_pair(layout, _safe(model), _safe(sku))
    if not pair.has_page:
        return []
    outcome = _outcomes(registry, [model], {(model, sku): pair})[model, sku]
    html = _pair_html(_environment(), pair, outcome, _inline, nav=False)
    path = Path(out_dir if out_dir is not None else layout.sku_dir(model, sku)) / PAIR_REPORT
    atomic_write_bytes(path, html.encode("utf-8"))
    return [path]


def pages(index: Path) -> Iterable[Path]:
    """Every page of a written report (the index first)."""
    yield index
    yield from sorted(p for p in index.parent.rglob("index.html") if p != index)
