"""Selection with evidence: per (model, device class), the engine a device of that class gets.

The candidates of a class are its SKUs (``skus.<s>.device_class``) with a manifest for the model.
Only those whose gates pass may be chosen, and "pass" is the matrix's verdict
(pipeline.engine.matrix: the manifest schema-valid and matching its digest, its correctness
passed, no failure recorded after it), never a flag read on its own. Among them the best by the
objective (``selection.objective``: p50 or p99 of engine-only latency, or throughput) is chosen
when the interval of its margin over the runner-up lies wholly above 1 (separated); otherwise every
candidate not separated from the best ties, and the first of them in ``selection.prefer`` is chosen
(said as a tie). The margin's interval is a bootstrap of the ratio of the two quantiles over the
bench's steady-state samples (latency.csv, bound to the manifest's engine through bench.json), as
the release performance gate compares two engines (pipeline.results.latency); without bound
samples, the manifests' own intervals divided end to end.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from pipeline.core.errors import ConfigError, InputError
from pipeline.core.io import atomic_write_json, git_ignored, read_json, sha256_file
from pipeline.core.paths import Layout
from pipeline.core.validation import did_you_mean
from pipeline.engine.matrix import PairOutcome, matrix
from pipeline.project.config import Registry, SelectionSpec
from pipeline.results.latency import bootstrap_quantile_ratio, read_latency_csv
from pipeline.results.manifest import Manifest, host_problems, load_manifest
from pipeline.results.reports import BenchReport
from pipeline.results.selection import (
    ClassSelection,
    Margin,
    SelectionCandidate,
    SelectionRecord,
    load_document,
    sealed,
)

log = logging.getLogger(__name__)

QUANTILES = {"p50": 0.5, "p99": 0.99}
DETAIL_CHARS = 240  # a candidate's reason: the matrix's detail line, cut
NO_MANIFEST_YET = "no manifest yet"  # the reason of a SKU nothing has judged: no manifest, no failure recorded


def _lower_wins(objective: str) -> bool:
    return objective in QUANTILES


def rule_text(spec: SelectionSpec) -> str:
    """The decision rule in words, as the record states it."""
    prefer = ", ".join(spec.prefer) or "(none)"
    if _lower_wins(spec.objective):
        best = f"the lowest engine-only {spec.objective} latency"
        ratio = f"the runner-up's {spec.objective} over the chosen one's"
    else:
        best = "the highest throughput (samples/s)"
        ratio = "the chosen one's throughput over the runner-up's"
    return (
        f"among the candidates whose gates pass, {best} is chosen when the {spec.confidence:.0%} interval of "
        f"{ratio} lies wholly above 1 (separated); otherwise the candidates not separated from the best tie "
        f"and the first of them in selection.prefer ({prefer}) is chosen"
    )


def _x(value: float) -> str:
    return f"{value:.3g}x"


def _interval(margin: Margin) -> str:
    return f"[{margin.interval[0]:.3g}, {margin.interval[1]:.3g}]" if margin.interval else "[no interval]"


def margin(
    chosen: SelectionCandidate,
    other: SelectionCandidate,
    samples: Mapping[str, Sequence[float]],
    spec: SelectionSpec,
) -> Margin:
    """How far ``chosen`` is ahead of ``other`` on the objective (above 1: ahead), with an interval:
    a bootstrap over both candidates' samples where both have enough, else their intervals divided
    end to end (conservative), else none (not separated)."""
    assert chosen.value is not None and other.value is not None  # eligible candidates have a figure
    lower = _lower_wins(spec.objective)
    ratio = other.value / chosen.value if lower else chosen.value / other.value
    a, b = samples.get(chosen.sku), samples.get(other.sku)
    if lower and a is not None and b is not None:
        if min(len(a), len(b)) < spec.min_samples:
            return Margin(
                ratio=ratio,
                interval=None,
                confidence=spec.confidence,
                method=f"too few samples to separate ({len(a)} and {len(b)}; selection.min_samples {spec.min_samples})",
                separated=False,
            )
        low, high = bootstrap_quantile_ratio(b, a, QUANTILES[spec.objective], spec.bootstrap, spec.confidence)
        return Margin(
            ratio=ratio,
            interval=(low, high),
            confidence=spec.confidence,
            method=f"bootstrap ({spec.bootstrap} resamples) of the {spec.objective} ratio over the steady-state "
            f"samples ({len(a)} and {len(b)})",
            separated=low > 1.0,
        )
    if chosen.interval is None or other.interval is None:
        missing = ", ".join(c.sku for c in (chosen, other) if c.interval is None)
        return Margin(
            ratio=ratio,
            interval=None,
            confidence=spec.confidence,
            method=f"no interval for {missing}: cannot separate",
            separated=False,
        )
    (a_lo, a_hi), (b_lo, b_hi) = chosen.interval, other.interval
    low, high = (b_lo / a_hi, b_hi / a_lo) if lower else (a_lo / b_hi, a_hi / b_lo)
    levels = [c.confidence for c in (chosen, other) if c.confidence is not None]
    return Margin(
        ratio=ratio,
        interval=(low, high),
        confidence=min(levels, default=spec.confidence),
        method="the manifests' intervals divided end to end (no bound samples for both)",
        separated=low > 1.0,
    )


def decide(
    device_class: str,
    candidates: Sequence[SelectionCandidate],
    samples: Mapping[str, Sequence[float]],
    spec: SelectionSpec,
) -> ClassSelection:
    """The choice for one device class among ``candidates`` (the class's SKUs, in registry order),
    ``samples`` their steady-state latency samples by SKU where bound to their manifest."""
    base = {"device_class": device_class, "rule": rule_text(spec), "candidates": list(candidates)}
    eligible = [c for c in candidates if c.manifest_digest is not None and c.eligible and c.value is not None]
    judged = [c for c in candidates if c.eligible or c.reason != NO_MANIFEST_YET]
    if not judged:
        why = f"no manifest of {', '.join(c.sku for c in candidates)} yet"
        return ClassSelection(**base, decision="no candidates", chosen=None, runner_up=None, margin=None, why=why)
    if not eligible:  # a gate failed (under DVC a failed validate leaves no manifest), or a build or a stage
        why = "no candidate passed (" + "; ".join(f"{c.sku}: {c.reason}" for c in judged) + ")"
        return ClassSelection(**base, decision="none passed", chosen=None, runner_up=None, margin=None, why=why)
    sign = 1.0 if _lower_wins(spec.objective) else -1.0
    ranked = sorted(eligible, key=lambda c: sign * (c.value or 0.0))  # stable: registry order breaks equal figures
    best = ranked[0]
    base["notes"] = _notes(eligible)
    if len(ranked) == 1:
        return ClassSelection(
            **base, decision="only candidate", chosen=best.sku, runner_up=None, margin=None, why="only candidate"
        )
    margins = {c.sku: margin(best, c, samples, spec) for c in ranked[1:]}
    tied = [best] + [c for c in ranked[1:] if not margins[c.sku].separated]
    if len(tied) == 1:
        runner_up, m = ranked[1], margins[ranked[1].sku]
        return ClassSelection(
            **base,
            decision="separated",
            chosen=best.sku,
            runner_up=runner_up.sku,
            margin=m,
            why=f"{_x(m.ratio)} over runner-up {runner_up.sku} {_interval(m)}, separated",
        )
    order = {backend: i for i, backend in enumerate(spec.prefer)}
    chosen = min(tied, key=lambda c: (order.get(c.backend, len(order)), ranked.index(c)))
    runner_up = ranked[1] if chosen is best else best
    m = margins[runner_up.sku] if chosen is best else margin(chosen, runner_up, samples, spec)
    others = ", ".join(c.sku for c in tied if c is not chosen)
    preferred = f"{chosen.backend} first in selection.prefer" if chosen.backend in order else "the fastest of them"
    return ClassSelection(
        **base,
        decision="tie",
        chosen=chosen.sku,
        runner_up=runner_up.sku,
        margin=m,
        tied=[c.sku for c in tied],
        why=f"tie with {others}, not separated: {_x(m.ratio)} against runner-up {runner_up.sku} {_interval(m)}; "
        f"{preferred}",
    )


def _notes(eligible: Sequence[SelectionCandidate]) -> list[str]:
    notes = []
    hosts = sorted({c.host or "unknown CPU" for c in eligible})
    if len(hosts) > 1:
        notes.append(f"timed on different hosts ({'; '.join(hosts)}): the ratios compare the hosts too")
    by_intervals = [c.sku for c in eligible if c.evidence == "intervals"]
    if by_intervals and len(by_intervals) < len(eligible):
        notes.append(
            f"no steady-state samples bound to the manifest of {', '.join(by_intervals)}: compared by the "
            "manifests' intervals"
        )
    return notes


# --- the candidates, from what the pipeline wrote -------------------------------------------------


def _bound_samples(out: Layout, model: str, sku: str, m: Manifest) -> tuple[BenchReport | None, list[float] | None]:
    """bench.json and its latency samples where they are the manifest's engine's, timed on its host."""
    try:
        bench = BenchReport.model_validate(read_json(out.report(model, sku, "bench")))
    except (OSError, ValueError):
        return None, None
    csv = out.latency_csv(model, sku)
    if (
        bench.engine_sha256 != m.evidence.engine_sha256
        or host_problems(m.host, bench)
        or not csv.is_file()
        or sha256_file(csv) != bench.latency_sha256
    ):
        log.debug("[%s/%s] bench samples not bound to the manifest: compared by its intervals", model, sku)
        return None, None
    try:
        return bench, read_latency_csv(csv.read_text(encoding="utf-8"))
    except ValueError:
        return None, None


def weigh(
    registry: Registry, model: str, sku: str, row: PairOutcome, spec: SelectionSpec
) -> tuple[SelectionCandidate, list[float] | None]:
    """One SKU of a class as a candidate for ``model``: its gate outcome (``row``, the matrix's), its
    figure on the objective and the samples behind it."""
    s = registry.sku(sku)
    path = Layout(registry.root).manifest(model, sku)
    common = {"sku": sku, "backend": s.backend, "precision": s.precision, "outcome": row.outcome}
    detail = f": {row.detail[:DETAIL_CHARS]}" if row.detail else ""
    if not path.is_file():
        # not judged yet (nothing failed) is worded alike on every host: "not buildable here" is this host's
        unjudged = row.outcome in ("not buildable here", "built only") or (
            row.outcome == "not run" and not row.exit_code
        )
        why = NO_MANIFEST_YET if unjudged else f"no manifest ({row.outcome}{detail})"
        return SelectionCandidate(**common, manifest_digest=None, eligible=False, reason=why), None
    m = load_manifest(path)
    bench, samples = _bound_samples(Layout(registry.root), model, sku, m)
    lower = _lower_wins(spec.objective)
    if lower and bench is not None and samples:
        import numpy as np

        # the quantile as bench computes it (pipeline.results.benchstats), with bench's interval of it
        value = float(np.percentile(samples, QUANTILES[spec.objective] * 100))
        interval = getattr(bench.engine_only, f"{spec.objective}_ci_ms")
    elif lower:
        figure = m.benchmark.engine_only
        value, interval = getattr(figure, f"{spec.objective}_ms"), getattr(figure, f"{spec.objective}_ci_ms")
    else:
        value, interval = m.benchmark.throughput_per_s, m.benchmark.throughput_ci_per_s
    problems = []
    if row.outcome != "passed":
        problems.append(f"{row.outcome}{detail}")
    if (m.backend, m.precision) != (s.backend, s.precision):
        problems.append(f"its manifest is a {m.backend} {m.precision} engine, the SKU is {s.backend} {s.precision}")
    candidate = SelectionCandidate(
        **common,
        manifest_digest=m.digest,
        eligible=not problems,
        reason="; ".join(problems),
        value=value,
        interval=tuple(interval) if interval is not None else None,
        confidence=registry.bench(sku).confidence if interval is not None else None,
        evidence="samples" if lower and samples else "intervals",
        samples=len(samples) if samples else None,
        latency_sha256=bench.latency_sha256 if bench is not None and samples else None,
        host=m.host.cpu_model,
    )
    return candidate, samples if lower else None


def classes_of(registry: Registry, model: str) -> dict[str, list[str]]:
    """Device class -> the SKUs of it that ``model`` is built for (models.<m>.skus), registry order."""
    built = {s for _, s in registry.pairs([model])}
    classes = {c: [s for s in skus if s in built] for c, skus in registry.device_classes().items()}
    return {c: skus for c, skus in classes.items() if skus}


def select(registry: Registry, model: str) -> SelectionRecord:
    """The selection record of ``model``: one choice per device class of its SKUs, from the manifests
    present (the same on any host: nothing is asked of this one)."""
    registry.model(model)
    spec = registry.selection
    classes = classes_of(registry, model)
    skus = [s for members in classes.values() for s in members]
    rows = {r.sku: r for r in matrix(registry, [model], skus, statuses=[])} if skus else {}
    chosen = []
    manifests: dict[str, str] = {}
    for device_class, members in classes.items():
        candidates, samples = [], {}
        for sku in members:
            candidate, drawn = weigh(registry, model, sku, rows[sku], spec)
            candidates.append(candidate)
            if drawn:
                samples[sku] = drawn
            if candidate.manifest_digest is not None:
                manifests[sku] = candidate.manifest_digest
        chosen.append(decide(device_class, candidates, samples, spec))
    return sealed(
        SelectionRecord(
            model=model,
            digest="",
            objective=spec.objective,
            confidence=spec.confidence,
            prefer=list(spec.prefer),
            manifests=manifests,
            classes=chosen,
        )
    )


def check_class(record: SelectionRecord, device_class: str) -> ClassSelection:
    """The record's choice for ``device_class``; a ConfigError naming the classes it has otherwise."""
    found = record.get(device_class)
    if found is None:
        known = [c.device_class for c in record.classes]
        raise ConfigError(
            f"model {record.model} has no SKU of device class {device_class!r}{did_you_mean(device_class, known)}",
            hint=f"its classes: {', '.join(known) or '(none: set skus.<s>.device_class in params.yaml)'}",
        )
    return found


def write_selection(registry: Registry, record: SelectionRecord) -> Path:
    """Write ``build/.selection/<model>.json`` (atomically; git ignores the folder: the record is
    recomputed from the manifests, which a team's repository commits)."""
    path = Layout(registry.root).selection(record.model)
    git_ignored(path.parent)
    return atomic_write_json(path, record.to_json())


def refresh_selections(registry: Registry, models: list[str] | None = None) -> dict[str, SelectionRecord | str]:
    """Compute and write the record of each model (default: all) whose SKUs name a device class:
    model -> its record, or why none was written (a manifest that cannot be read). What `skuforge
    repro` runs after the pairs, and `skuforge select` for one model."""
    done: dict[str, SelectionRecord | str] = {}
    for model in models or list(registry.models):
        try:
            record = select(registry, model)
        except InputError as exc:
            done[model] = exc.message
            continue
        if record.classes:
            write_selection(registry, record)
            done[model] = record
    return done


def selection_problems(registry: Registry, record: SelectionRecord) -> list[str]:
    """Why ``record`` is not the selection the manifests present give today: each manifest changed,
    added or removed since, then anything else that would decide otherwise (settings, classes, samples,
    outcomes). Empty: it stands."""
    out = Layout(registry.root)
    problems = []
    for sku in sorted(
        {s for members in classes_of(registry, record.model).values() for s in members} | set(record.manifests)
    ):
        path = out.manifest(record.model, sku)
        now = load_manifest(path).digest if path.is_file() else None
        then = record.manifests.get(sku)
        if now != then:
            what = "removed" if now is None else "added" if then is None else f"changed ({then[:12]} -> {now[:12]})"
            problems.append(f"manifests/{record.model}/{sku}.json {what} since the selection")
    if problems:
        return problems
    again = select(registry, record.model)
    if again.digest != record.digest:
        differ = [c.device_class for c in again.classes if record.get(c.device_class) != c]
        differ += [c.device_class for c in record.classes if again.get(c.device_class) is None]
        problems.append(
            "recomputed from the same manifests the selection differs"
            + (f" for {', '.join(differ)}" if differ else "")
            + " (params.yaml's selection settings or device classes, the bench samples or a gate outcome changed)"
        )
    return problems


def read_selection(registry: Registry, model: str) -> SelectionRecord:
    """``build/.selection/<model>.json``: schema-valid, matching its digest and still the selection its
    manifests give (an InputError, exit 2, saying what changed otherwise)."""
    path = Layout(registry.root).selection(model)
    record = load_document(path)
    if record.model != model:
        raise InputError(f"{path} is the selection of model {record.model!r}, not {model!r}")
    problems = selection_problems(registry, record)
    if problems:
        raise InputError(
            f"{path} is stale: " + "; ".join(problems),
            hint=f"compute it again: skuforge select --model {model}",
        )
    return record
