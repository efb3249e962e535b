"""The report's charts as PNG bytes, drawn with matplotlib's Agg canvas (no display, no pyplot state).

Labels that come from reports (SKU names, phases) pass through ``_text``: a ``$`` in them is drawn
as it is rather than parsed (or failing to parse) as TeX math.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

Interval = tuple[float, float] | None  # a confidence interval, None where the report has none

_RC: dict[RcKeyType, Any] = {"font.size": 9, "axes.grid": True, "grid.alpha": 0.3, "svg.hashsalt": "skuforge"}
WIDTH, HEIGHT, DPI = 7.0, 3.2, 100
MAX_POINTS = 20_000  # per scatter plot
COLOURS = {"warmup": "#d95f02", "steady": "#1b9e77", "p50": "#1f77b4", "p95": "#ff7f0e", "p99": "#d62728"}


def _text(label: object) -> str:
    return str(label).replace("$", r"\$")


def _figure(rows: int = 1, cols: int = 1, height: float = HEIGHT):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH, height), dpi=DPI, layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})  # no version stamp: same input, same bytes
    return buf.getvalue()


def _log_ticks(axis) -> None:
    """Plain labels at 1, 2 and 5 of each decade on a log axis (matplotlib's default labels every
    minor tick as 2×10⁰ …, which overlap)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _draw(fn):
    """Run ``fn`` under the report's rc settings (math text off) and return its figure as PNG."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> bytes:
        import matplotlib

        with matplotlib.rc_context(_RC):
            return _png(fn(*args, **kwargs))

    return wrapper


SPAN_FOR_LOG = 10.0  # p99.9 / p50 above which a linear axis squeezes the body into one bar


def latency_axis(samples: Sequence[float] | Any) -> tuple[str, Any]:
    """("log", log-spaced bin edges) when the samples up to p99.9 span more than SPAN_FOR_LOG
    times their median, else ("linear", 60): a p50 of 0.02 ms beside a p99.9 of 20 ms is one bar
    at zero and a vertical line on a linear axis."""
    import numpy as np

    values = np.sort(np.asarray(samples, dtype=float))
    hi = np.percentile(values, 99.9) if len(values) > 100 else values[-1]
    p50 = float(np.median(values))
    lo = float(values[0])
    if lo > 0 and p50 > 0 and hi / p50 > SPAN_FOR_LOG:
        return "log", np.logspace(math.log10(lo), math.log10(hi), 61)
    return "linear", 60


@_draw
def latency_distribution(samples: Sequence[float], percentiles: dict[str, float]):
    """Histogram and empirical CDF of the steady engine-only samples to p99.9, percentiles marked;
    log-spaced bins and a log x axis where the range spans decades (latency_axis)."""
    import numpy as np

    fig, axes = _figure(1, 2)
    hist, cdf = axes[0]
    values = np.sort(np.asarray(samples, dtype=float))
    hi = np.percentile(values, 99.9) if len(values) > 100 else values[-1]
    scale, bins = latency_axis(values)
    note = ", log x" if scale == "log" else ""
    hist.hist(values[values <= hi], bins=bins, color="#4c72b0")
    hist.set(title=f"latency histogram (to p99.9{note})", xlabel="ms", ylabel="calls", xscale=scale)
    cdf.plot(values, np.arange(1, len(values) + 1) / len(values), color="#4c72b0")
    cdf.set(
        title=f"latency CDF (to p99.9{note})",
        xlabel="ms",
        ylabel="fraction of calls",
        xscale=scale,
        xlim=(values[0], hi),
    )
    if scale == "log":
        _log_ticks(hist.xaxis)
        _log_ticks(cdf.xaxis)
    for name, value in percentiles.items():
        for ax in (hist, cdf):
            ax.axvline(
                value, color=COLOURS.get(name, "grey"), linestyle="--", linewidth=1, label=f"{name} {value:.4g} ms"
            )
    hist.legend(loc="upper right")
    return fig


@_draw
def timeline(iterations: Sequence[int], phases: Sequence[str], latency_ms: Sequence[float]):
    """Latency per call in call order, warm-up and steady calls in their own colours (at most
    MAX_POINTS points: a long run is thinned evenly, which keeps its shape)."""
    fig, axes = _figure()
    ax = axes[0][0]
    step = max(1, math.ceil(len(latency_ms) / MAX_POINTS))
    iterations, phases, latency_ms = iterations[::step], phases[::step], latency_ms[::step]
    for phase in dict.fromkeys(phases):
        xs = [i for i, p in zip(iterations, phases, strict=True) if p == phase]
        ys = [v for v, p in zip(latency_ms, phases, strict=True) if p == phase]
        ax.scatter(xs, ys, s=2, color=COLOURS.get(phase, "grey"), label=f"{_text(phase)} ({len(xs)})", rasterized=True)
    title = "latency per call, warm-up to steady state" + (f" (every {step}th call)" if step > 1 else "")
    ax.set(title=title, xlabel="call", ylabel="ms", yscale="log")
    _log_ticks(ax.yaxis)
    ax.legend(loc="upper right", markerscale=4)
    return fig


@_draw
def percentile_intervals(rows: Sequence[tuple[str, float, Interval]]):
    """One point per (phase, percentile) with its confidence interval as an error bar."""
    fig, axes = _figure(height=0.45 * len(rows) + 1.0)
    ax = axes[0][0]
    for y, (label, value, ci) in enumerate(rows):
        err = [[value - ci[0]], [ci[1] - value]] if ci else None
        ax.errorbar([value], [y], xerr=err, fmt="o", capsize=4, color=COLOURS.get(label.split()[-1], "#333333"))
    ax.set_yticks(range(len(rows)), [_text(r[0]) for r in rows])
    ax.invert_yaxis()
    ax.set(title="percentiles with confidence intervals", xlabel="ms")
    return fig


@_draw
def sweep(points: Sequence[dict]):
    """Throughput against latency over the (batch, concurrency) sweep: the latency cost of throughput."""
    fig, axes = _figure()
    ax = axes[0][0]
    pts = sorted(points, key=lambda p: p["throughput_per_s"])
    for key, colour in (("p50_ms", COLOURS["p50"]), ("p99_ms", COLOURS["p99"])):
        ax.plot([p["throughput_per_s"] for p in pts], [p[key] for p in pts], "o-", color=colour, label=key[:3])
    for p in pts:
        ax.annotate(
            f"b{p['batch']} c{p['concurrency']}",
            (p["throughput_per_s"], p["p50_ms"]),
            textcoords="offset points",
            xytext=(4, -10),
            fontsize=7,
        )
    ax.set(title="throughput against latency (sweep)", xlabel="samples/s", ylabel="latency ms")
    ax.legend()
    return fig


_ROOF_NAMES = {"int8": "INT8 peak ", "mixed": "INT8/FP32 blend "}


@_draw
def roofline(
    peak_gflops: float,
    peak_gbs: float,
    layers: Sequence[tuple[str, float, float]],
    engine: tuple[float, float] | None,
    compute_ceilings: dict[str, float] | None = None,
    bandwidth_ceilings: dict[str, float] | None = None,
    above: Sequence[tuple[float, float]] = (),
    peak_kind: str = "fp32",
):
    """The classic log-log roofline: min(peak compute, bandwidth x intensity), lower ceilings
    dashed, the timed layers and the whole engine as points (FLOP/byte, achieved GFLOP/s); the
    five slowest-running layers (lowest achieved) are named. Points in ``above`` lie over the roof,
    which a measurement cannot: they are ringed in red and the chart says a peak is wrong. The roof
    of an INT8 (or ``mixed``) engine is the INT8 peak (or the blend), in op/s."""
    import numpy as np

    fig, axes = _figure(height=4.2)
    ax = axes[0][0]
    ridge = peak_gflops / peak_gbs
    unit, op = ("GFLOP/s", "FLOP") if peak_kind == "fp32" else ("GOP/s", "op")
    xs = [x for _, x, _ in layers] + ([engine[0]] if engine else [])
    lo = min([ridge / 100, *(x / 2 for x in xs if x > 0)])
    hi = max([ridge * 100, *(x * 2 for x in xs)])
    grid = np.logspace(math.log10(lo), math.log10(hi), 200)
    ax.plot(
        grid,
        np.minimum(peak_gflops, peak_gbs * grid),
        color="black",
        linewidth=1.8,
        label=f"roof: {_ROOF_NAMES.get(peak_kind, '')}{peak_gflops:.4g} {unit}, {peak_gbs:.4g} GB/s",
    )
    for label, value in (compute_ceilings or {}).items():
        ax.plot(grid, np.minimum(value, peak_gbs * grid), color="grey", linestyle="--", linewidth=0.8)
        ax.annotate(_text(label), (hi, value), ha="right", va="bottom", fontsize=7, color="grey")
    for label, value in (bandwidth_ceilings or {}).items():
        ax.plot(grid, np.minimum(peak_gflops, value * grid), color="grey", linestyle=":", linewidth=0.8)
        ax.annotate(_text(label), (lo, value * lo), ha="left", va="bottom", fontsize=7, color="grey")
    ax.axvline(ridge, color="grey", linestyle=":", linewidth=1, label=f"ridge {ridge:.3g} {op}/B")
    if layers:
        ax.scatter(
            [x for _, x, _ in layers],
            [y for _, _, y in layers],
            s=16,
            color="#1f77b4",
            alpha=0.75,
            label=f"layers ({len(layers)})",
        )
        for name, x, y in sorted(layers, key=lambda t: t[2])[:5]:
            ax.annotate(_text(name[:32]), (x, y), textcoords="offset points", xytext=(4, 2), fontsize=6)
    if engine and engine[0] > 0 and engine[1] > 0:
        ax.scatter([engine[0]], [engine[1]], s=90, marker="*", color="#d62728", label="engine", zorder=3)
    if above:
        ax.scatter(
            [x for x, _ in above],
            [y for _, y in above],
            s=260,
            facecolors="none",
            edgecolors="#d62728",
            linewidths=1.6,
            label=f"above the roof ({len(above)}): a peak is wrong",
            zorder=4,
        )
        ax.text(
            0.02,
            0.97,
            "ABOVE THE ROOF: a measured peak is too low\n(or the FLOP/byte count is off): see the note",
            transform=ax.transAxes,
            va="top",
            fontsize=8,
            color="#d62728",
            fontweight="bold",
        )
    ax.set(xscale="log", yscale="log", title="roofline", xlabel=f"arithmetic intensity ({op}/byte)", ylabel=unit)
    ax.legend(loc="lower right", fontsize=7)
    return fig


@_draw
def latency_bars(
    skus: Sequence[str],
    p50: Sequence[float | None],
    p50_ci: Sequence[Interval],
    p99: Sequence[float | None],
    p99_ci: Sequence[Interval],
):
    """Engine-only p50 and p99 per SKU, side by side, confidence intervals as error bars."""
    fig, axes = _figure(height=3.6)
    ax = axes[0][0]
    xs = range(len(skus))
    for offset, name, values, cis in ((-0.2, "p50", p50, p50_ci), (0.2, "p99", p99, p99_ci)):
        for x, v, ci in zip(xs, values, cis, strict=True):
            if v is None:
                continue
            err = [[v - ci[0]], [ci[1] - v]] if ci else None
            ax.bar(
                x + offset,
                v,
                width=0.4,
                color=COLOURS[name],
                yerr=err,
                capsize=3,
                label=name if x == next(i for i, w in enumerate(values) if w is not None) else None,
            )
    _sku_axis(ax, skus)
    shown = [v for v in (*p50, *p99) if v is not None and v > 0]
    if shown and max(shown) / min(shown) > 30:  # one slow SKU would flatten the others to nothing
        ax.set_yscale("log")
    ax.set(title="engine-only latency per SKU (error bars: confidence interval)", ylabel="ms")
    ax.legend()
    return fig


@_draw
def bars(
    skus: Sequence[str], values: Sequence[float | None], title: str, ylabel: str, cis: Sequence[Interval] | None = None
):
    fig, axes = _figure(height=3.4)
    ax = axes[0][0]
    for x, (v, ci) in enumerate(zip(values, cis or [None] * len(values), strict=True)):
        if v is not None:
            ax.bar(x, v, width=0.6, color="#4c72b0", yerr=[[v - ci[0]], [ci[1] - v]] if ci else None, capsize=3)
    _sku_axis(ax, skus)
    ax.set(title=title, ylabel=ylabel)
    return fig


def _sku_axis(ax, skus: Sequence[str]) -> None:
    ax.set_xticks(range(len(skus)), [_text(s) for s in skus], rotation=30, ha="right")
    ax.grid(axis="x", visible=False)


STEP_COLOURS = {"decode": "#7570b3", "preprocess": "#1b9e77", "infer": "#d95f02", "postprocess": "#e7298a"}


@_draw
def step_bars(steps: Sequence[tuple[str, float]], whole_p50: float | None, engine_p50: float | None):
    """Where an end-to-end call's time goes: the p50 of each step stacked on one bar, beside the
    whole call's p50 and the engine-only p50. Percentiles do not add: the stacked bar need not
    match the whole's."""
    if not steps:
        raise ValueError("no step has a p50")
    fig, axes = _figure(height=2.6)
    ax = axes[0][0]
    left = 0.0
    for name, value in steps:
        ax.barh(
            0, value, left=left, height=0.6, color=STEP_COLOURS.get(name, "grey"), label=f"{_text(name)} {value:.4g}"
        )
        left += value
    labels = ["end to end: step p50s"]
    for label, whole, colour in (
        ("end to end: whole p50", whole_p50, "#666666"),
        ("engine only p50", engine_p50, "#4c72b0"),
    ):
        if whole is not None:
            ax.barh(len(labels), whole, height=0.6, color=colour)
            ax.annotate(f"{whole:.4g}", (whole, len(labels)), textcoords="offset points", xytext=(3, -3), fontsize=7)
            labels.append(label)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.margins(x=0.08)  # room for the figures at the bars' ends
    ax.grid(axis="y", visible=False)
    ax.set(title="end to end, per step (p50, ms; percentiles do not add)", xlabel="ms")
    fig.legend(loc="outside lower center", ncol=len(steps), fontsize=7, title="step p50 ms", title_fontsize=7)
    return fig


@_draw
def sustained(t_s: Sequence[float], p50_ms: Sequence[float], temperature_c: Sequence[float | None]):
    """A sustained run per window: the p50 (left axis) and the hottest thermal zone (right axis,
    where one was read) against time, so a latency rise can be laid beside the heat."""
    if not t_s:
        raise ValueError("no windows")
    fig, axes = _figure()
    ax = axes[0][0]
    ax.plot(t_s, p50_ms, "o-", markersize=3, color=COLOURS["p50"], label="p50 ms")
    ax.set(title="sustained run: p50 and temperature per window", xlabel="seconds from the start", ylabel="p50 ms")
    hot = [(t, c) for t, c in zip(t_s, temperature_c, strict=True) if c is not None]
    handles, labels = ax.get_legend_handles_labels()
    if hot:
        twin = ax.twinx()
        twin.plot([t for t, _ in hot], [c for _, c in hot], "s--", markersize=3, color=COLOURS["p99"], label="°C")
        twin.set_ylabel("temperature °C")
        twin.grid(visible=False)
        more, names = twin.get_legend_handles_labels()
        handles, labels = handles + more, labels + names
    ax.legend(handles, labels, loc="lower right")
    return fig


SELECTION_STYLE = {  # state -> (marker, size, face colour, edge colour)
    "selected": ("*", 260, "#d62728", "#7f0000"),
    "tied": ("o", 70, "#ff7f0e", "#7f3f00"),
    "passed": ("o", 50, "#4c72b0", "#1f3a5f"),
    "gates failed": ("X", 60, "#bbbbbb", "#666666"),
}


@_draw
def selection(
    points: Sequence[tuple[str, float, Interval, float | None, str]], xlabel: str, ylabel: str | None, title: str
):
    """One device class's candidates: (SKU, figure, its interval, accuracy or None, state) each a point
    at (figure, accuracy), the interval as an x error bar, the selected one a large star; with no
    accuracy figure (``ylabel`` None) a strip of the figures alone. ``state`` is a SELECTION_STYLE key."""
    if not points:
        raise ValueError("no candidate has a figure")
    fig, axes = _figure(height=3.0 if ylabel else 1.9)
    ax = axes[0][0]
    strip = ylabel is None
    for state, (marker, size, face, edge) in SELECTION_STYLE.items():
        mine = [p for p in points if p[4] == state]
        if not mine:
            continue
        for _, x, ci, y, _ in mine:
            if ci:
                ax.errorbar(
                    [x], [0.0 if strip else y], xerr=[[x - ci[0]], [ci[1] - x]], fmt="none", ecolor=edge, capsize=3
                )
        ax.scatter(
            [p[1] for p in mine],
            [0.0 if strip else (p[3] if p[3] is not None else math.nan) for p in mine],
            marker=marker,
            s=size,
            color=face,
            edgecolors=edge,
            label=state,
            zorder=3,
        )
    for sku, x, _, y, _ in points:
        ax.annotate(
            _text(sku),
            (x, 0.0 if strip else (y if y is not None else math.nan)),
            textcoords="offset points",
            xytext=(5, 5),
            fontsize=7,
        )
    xs = [p[1] for p in points if p[1] > 0]
    if xs and max(xs) / min(xs) > 30:
        ax.set_xscale("log")
    if strip:
        ax.set_yticks([])
        ax.grid(axis="y", visible=False)
    ax.set(title=_text(title), xlabel=xlabel, ylabel=ylabel or "")
    ax.margins(x=0.15, y=0.25)
    ax.legend(loc="best", fontsize=7, markerscale=0.6)
    return fig
