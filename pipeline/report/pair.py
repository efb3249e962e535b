"""The page of one (model, SKU): bench, steps, energy, sustained run, correctness, drift, layers,
roofline, build and cache views."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from pipeline.report import plots
from pipeline.report.common import Images, as_dict, as_interval, as_list, as_number, chart, engine_bytes, fmt
from pipeline.report.load import ROOFLINE, PairData
from pipeline.results.reports import cache_unused

log = logging.getLogger(__name__)


def _bench_view(pair: PairData, images: Images, notes: list[str]) -> dict[str, Any] | None:
    b = pair.bench
    if b is None:
        return None
    what = f"{pair.model}/{pair.sku}"
    phases = [
        (label, as_dict(b.get(key)))
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
    engine = as_dict(b.get("engine_only"))
    shown: list[tuple[str | None, str]] = []  # (image, caption): None where the chart was left out
    if pair.latency_ms:
        marks = {p: v for p in ("p50", "p95", "p99") if (v := as_number(engine.get(f"{p}_ms"))) is not None}
        src = chart(
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
        src = chart(
            images,
            notes,
            "timeline.png",
            f"{what} timeline",
            lambda: plots.timeline(t.iteration, t.phase, t.latency_ms),
        )
        shown.append((src, "latency per call, warm-up to steady state"))
    elif pair.latency_ms:
        lat = pair.latency_ms
        src = chart(
            images,
            notes,
            "timeline.png",
            f"{what} timeline",
            lambda: plots.timeline(list(range(len(lat))), ["steady"] * len(lat), lat),
        )
        shown.append((src, "latency per steady call (no timeline.csv)"))
    rows = [
        (f"{label} {p}", v, as_interval(s.get(f"{p}_ci_ms")))
        for label, key in (("engine only", "engine_only"), ("end to end", "end_to_end"))
        for s in [as_dict(b.get(key))]
        for p in ("p50", "p95", "p99")
        if (v := as_number(s.get(f"{p}_ms"))) is not None
    ]
    if rows:
        if not any(ci for *_, ci in rows):
            notes.append(
                "no confidence intervals in bench.json (too few samples for them, or a bench report of an older format)"
            )
        src = chart(images, notes, "percentiles.png", f"{what} percentiles", lambda: plots.percentile_intervals(rows))
        shown.append((src, "percentiles with confidence intervals"))
    sweep = [p for p in as_list(b.get("sweep")) if isinstance(p, dict)]
    usable = [
        p
        for p in sweep
        if all(
            as_number(p.get(k)) is not None for k in ("batch", "concurrency", "p50_ms", "p99_ms", "throughput_per_s")
        )
    ]
    sweep_plot = None
    if len(usable) >= 2:
        sweep_plot = chart(images, notes, "sweep.png", f"{what} sweep", lambda: plots.sweep(usable))
    return {
        "phases": phases,
        "summary": summary,
        "plots": [(s, a) for s, a in shown if s],
        "steady_state": as_dict(b.get("steady_state")),
        "drift": as_dict(b.get("drift")),
        "execution": as_dict(b.get("execution")),
        "sweep": sweep,
        "sweep_plot": sweep_plot,
        "memory": as_dict(b.get("memory_mb")),
        "device_state": _device_state(as_dict(b.get("device_state"))),
    }


def _device_state(state: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, before, after) per device-state reading; an older report's flat state as (key, value, None)."""
    before, after = as_dict(state.get("before")), as_dict(state.get("after"))
    device = [(k, before.get(k), after.get(k)) for k in sorted(set(before) | set(after))]
    if not device and state:
        device = [(k, v, None) for k, v in sorted(state.items())]
    return device


def _correctness_view(validate: dict[str, Any] | None) -> dict[str, Any] | None:
    if validate is None:
        return None
    passed = validate.get("passed")
    gates = [
        (name, as_dict(validate.get(key)))
        for name, key in (("placement", "placement"), ("precision gate", "precision_gate"))
        if validate.get(key)
    ]
    return {
        "outcome": "passed" if passed is True else "failed" if passed is False else "unknown",
        "precision": validate.get("precision"),
        "failures": [str(f) for f in as_list(validate.get("failures"))],
        "outputs": [as_dict(o) for o in as_list(validate.get("outputs"))],
        "metrics": [as_dict(m) for m in as_list(validate.get("metrics"))],
        "gates": gates,
    }


STEP_ORDER = ("decode", "preprocess", "infer", "postprocess")  # BenchReport.end_to_end_steps


def _pipeline_steps(side: Any) -> list[dict[str, Any]]:
    """A preprocessing description's steps ({steps: [{step, library, settings}], versions})."""
    return [
        {"step": x.get("step"), "library": x.get("library"), "settings": x.get("settings")}
        for x in map(as_dict, as_list(as_dict(side).get("steps")))
    ]


def _pick(value: Any, keys: Iterable[str]) -> dict[str, Any]:
    """``value``'s ``keys`` (None where absent): a template reads every one of them."""
    return {k: as_dict(value).get(k) for k in keys}


_STATS = ("iterations", "mean_ms", "p50_ms", "p95_ms", "p99_ms", "max_ms", "p50_ci_ms", "p95_ci_ms", "p99_ci_ms")
_DIFF = ("max_abs", "mean_abs", "samples_differing", "elements_differing")


def _steps_view(pair: PairData, images: Images, notes: list[str]) -> dict[str, Any] | None:
    """The end-to-end calls timed per step (decode, preprocess, infer, postprocess), their chart
    beside the engine-only p50, what a call starts from and the device-side preprocessing it ran."""
    b = as_dict(pair.bench)
    steps = as_dict(b.get("end_to_end_steps"))
    if not steps:
        return None
    names = [n for n in STEP_ORDER if n in steps] + [n for n in steps if n not in STEP_ORDER]
    rows = [(name, _pick(steps[name], _STATS)) for name in names]
    whole, engine = _pick(b.get("end_to_end"), _STATS), _pick(b.get("engine_only"), _STATS)
    p50s = [(name, v) for name, s in rows if (v := as_number(s.get("p50_ms"))) is not None]
    plot = None
    if p50s:
        plot = chart(
            images,
            notes,
            "steps.png",
            f"{pair.model}/{pair.sku} end to end per step",
            lambda: plots.step_bars(p50s, as_number(whole.get("p50_ms")), as_number(engine.get("p50_ms"))),
        )
    preprocessing = [
        {"input": name, "steps": _pipeline_steps(side), "versions": as_dict(as_dict(side).get("versions"))}
        for name, side in sorted(as_dict(b.get("preprocessing")).items())
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


def energy_view(energy: Any) -> dict[str, Any] | None:
    """An EnergyResult's figures, or its reason verbatim: an energy not measured is never shown as 0."""
    e = as_dict(energy)
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
        ("summed domains", [str(x) for x in as_list(e.get("summed"))]),
        ("joules per domain", as_dict(e.get("domains"))),
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
    s = as_dict(sustained)
    if not s:
        return None
    windows = [
        _pick(w, ("t_s", "calls", "p50_ms", "p99_ms", "temperature_c", "cpu_mhz", "power_w"))
        for w in as_list(s.get("windows"))
    ]
    points = [
        (t, p, as_number(w.get("temperature_c")))
        for w in windows
        if (t := as_number(w.get("t_s"))) is not None and (p := as_number(w.get("p50_ms"))) is not None
    ]
    plot = None
    if points:
        plot = chart(
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
        "throttling": as_dict(s.get("throttling")),
        "energy": energy_view(s.get("energy")),
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
        if (value := as_number(drift.get(key))) is not None
    ]
    return ", ".join(gates) if gates else "reported, not gated"


def _one_drift(drift: dict[str, Any]) -> dict[str, Any]:
    """One PreprocessingDrift: the two sides step by step (the differing ones marked), their
    library versions, the input and metric differences, the gate and the per-step attribution."""
    ref, dev = as_dict(drift.get("reference")), as_dict(drift.get("device"))
    differing = list(dict.fromkeys(str(x) for x in as_list(drift.get("differing_steps"))))
    ref_steps = {str(x.get("step")): x for x in _pipeline_steps(ref)}
    dev_steps = {str(x.get("step")): x for x in _pipeline_steps(dev)}
    steps = [
        {"step": name, "differs": name in differing, "reference": ref_steps.get(name), "device": dev_steps.get(name)}
        for name in dict.fromkeys([*ref_steps, *dev_steps])
    ]
    ref_versions, dev_versions = as_dict(ref.get("versions")), as_dict(dev.get("versions"))
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
        "drop_interval": as_interval(drift.get("drop_interval")),
        "confidence": f"{c:.0%}" if (c := as_number(drift.get("confidence"))) is not None and 0 < c < 1 else None,
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
            for x in map(as_dict, as_list(drift.get("steps")))
        ],
        "culprit": drift.get("culprit"),
    }


def drift_view(validate: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """validate.json's preprocessing drift per input; None where validate.json has no such field."""
    if validate is None or "preprocessing" not in validate:
        return None
    return [_one_drift(as_dict(x)) for x in as_list(validate.get("preprocessing"))]


def _roofline_layers(roofline: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Layer name -> its measured time, achieved GFLOP/s and intensity, from roofline.json
    (pipeline.perf.roofline.RooflineReport: the layer's name is the engine layer's where it was timed)."""
    out = {}
    for layer in as_list(as_dict(roofline).get("layers")):
        if isinstance(layer, dict) and isinstance(layer.get("name"), str):
            out[layer["name"]] = {
                "time_ms": as_number(layer.get("time_ms")),
                "gflops": as_number(layer.get("achieved_gflops")),
                "intensity": as_number(layer.get("intensity")),
            }
    return out


def _layers_view(build: dict[str, Any] | None, roofline: dict[str, Any] | None) -> dict[str, Any] | None:
    layers = [as_dict(x) for x in as_list(as_dict(build).get("layers"))]
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
            "fused_from": [str(f) for f in as_list(layer.get("fused_from"))],
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
    peak_gflops, peak_gbs = as_number(roofline.get("peak_gflops")), as_number(roofline.get("peak_gbs"))
    if not peak_gflops or not peak_gbs or peak_gflops <= 0 or peak_gbs <= 0:
        return [], []
    items: list[tuple[str, float | None, float | None]] = [
        ("the engine", as_number(roofline.get("intensity")), as_number(roofline.get("achieved_gflops")))
    ]
    items += [
        (
            f"layer {as_dict(x).get('name')}",
            as_number(as_dict(x).get("intensity")),
            as_number(as_dict(x).get("achieved_gflops")),
        )
        for x in as_list(roofline.get("layers"))
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
    peak_gflops, peak_gbs = as_number(roofline.get("peak_gflops")), as_number(roofline.get("peak_gbs"))
    summary = {k: v for k, v in roofline.items() if k not in ("layers", "uncounted")}
    layers = [as_dict(x) for x in as_list(roofline.get("layers"))]
    uncounted = as_list(roofline.get("uncounted"))
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
        if (i := as_number(x.get("intensity"))) and (a := as_number(x.get("achieved_gflops"))) and i > 0 and a > 0
    ]
    if layers and not points:
        notes.append("roofline: no per-layer times (the backend does not profile layers): layers are not plotted")
    engine = (as_number(roofline.get("intensity")), as_number(roofline.get("achieved_gflops")))
    kind = str(roofline.get("peak_kind") or "fp32")
    roof = {"fp32": "all_cores", "int8": "int8_all_cores"}.get(kind)  # drawn as the roof itself
    ceilings = {
        _ceiling_label(k, v, kind): v
        for k, v in as_dict(roofline.get("ceilings_gflops")).items()
        if as_number(v) and k != roof
    }
    bandwidths = {
        f"{k} {v:.4g} GB/s": v
        for k, v in as_dict(roofline.get("ceilings_gbs")).items()
        if as_number(v) and k != "triad"
    }
    view["plot"] = chart(
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
        "cache": _cache_view(as_dict(build.get("cache"))),
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
        "ignored": [str(x) for x in as_list(cache.get("ignored"))],
    }


def pair_html(env, pair: PairData, outcome: tuple[str, str], images: Images, nav: bool) -> str:
    notes = list(pair.notes)
    what = f"{pair.model}/{pair.sku}"
    bench = _bench_view(pair, images, notes)
    steps = _steps_view(pair, images, notes)
    sustained = _sustained_view(as_dict(pair.bench).get("sustained"), images, notes, what)
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
        energy=energy_view(as_dict(pair.bench).get("energy")),
        sustained=sustained,
        correctness=_correctness_view(pair.validate),
        drift=drift_view(pair.validate),
        has_validate=pair.validate is not None,
        roofline=roofline,
        roofline_note=f"no {ROOFLINE} for this pair (the roofline step has not run here)",
        layers=_layers_view(pair.build, pair.roofline),
        page_notes=notes,
    )
