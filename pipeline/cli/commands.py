"""Subcommands. Each turns arguments into one library call and renders the result."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.cli import tables
from pipeline.cli.parser.commands import STAGE_COMMANDS, STAGE_FLAGS
from pipeline.cli.progress import ProgressLine
from pipeline.cli.select import selection_text
from pipeline.cli.tables import Column
from pipeline.core.env import MLFLOW_LOGGING_LEVEL
from pipeline.core.errors import ConfigError, EnvironmentProblem
from pipeline.core.paths import Layout
from pipeline.engine.matrix import OUTCOMES, PairOutcome, matrix, sku_statuses
from pipeline.ops.hostreport import check_report, class_labels, load_classes, probe_report
from pipeline.ops.pipelines import render_pipelines
from pipeline.ops.reproduce import reproduce
from pipeline.project.artifacts import RESULT_ATTR
from pipeline.project.config import load_registry
from pipeline.report import write_site
from pipeline.results.reports import BuildReport
from pipeline.stages import bench as bench_stage
from pipeline.stages import build as build_stage
from pipeline.stages import calibrate as calibrate_stage
from pipeline.stages import data as data_stage
from pipeline.stages import manifest as manifest_stage
from pipeline.stages import prepare as prepare_stage
from pipeline.stages import reference as reference_stage
from pipeline.stages import validate as validate_stage
from pipeline.stages.config import write_config
from pipeline.stages.export import export
from pipeline.stages.publish import publish as publish_pair
from pipeline.tracking.client import require_mlflow
from pipeline.tracking.promotion import PromotionBlocked, rollback
from pipeline.tracking.promotion import promote as promote_alias
from pipeline.tracking.releases import list_releases
from pipeline.verify.selection import select


def _cache_lines(report: BuildReport) -> str:
    """What a build's summary says of its checked-in cache: built without it (found stale or
    corrupt), an editor's files it ignored."""
    cache, lines = report.cache, []
    if cache is not None and cache.unused():
        lines.append(
            f"{cache.unused()} ({cache.reason}); rebuild it: skuforge cache refresh --sku {report.sku} "
            f"--model {report.model}, then commit caches/{report.sku}/{report.model}"
        )
    if cache is not None and cache.ignored:
        lines.append(f"cache: ignored {', '.join(cache.ignored)} (an editor's files: never read, never removed)")
    return "".join(f"\n{line}" for line in lines)


def _registry(args: argparse.Namespace):

    return load_registry(args.params)


def _emit(args: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
    if getattr(args, "json", False):
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(text())


# Each stage command: its library function and the one-line summary of its report.
STAGES: dict[str, tuple[Callable[..., Any], Callable[[Any], str]]] = {
    "prepare": (
        prepare_stage.prepare,
        lambda r: (
            f"prepared {r.model}: " + ", ".join(f"{p.name} {'changed' if p.changed else 'no change'}" for p in r.passes)
        ),
    ),
    "data": (
        data_stage.make_data,
        lambda r: f"data {r.model}: " + ", ".join(f"{k} {v.samples}" for k, v in r.splits.items()),
    ),
    "reference": (
        reference_stage.reference,
        lambda r: f"reference {r.model}: " + (", ".join(f"{k} {v:.4f}" for k, v in r.metric.items()) or "done"),
    ),
    "calibrate": (
        calibrate_stage.calibrate,
        lambda r: f"calibrated {r.model}: {r.method}, {r.samples} samples, {r.tensors} tensors",
    ),
    "build": (
        build_stage.build,
        lambda r: (
            f"built {r.model}/{r.sku} in {r.build_seconds:.1f}s: "
            f"placement {r.placement}, precision {r.precision_counts}"
            + (f", reproducible: {r.reproducibility.verdict}" if r.reproducibility else "")
            + _cache_lines(r)
        ),
    ),
    "validate": (
        validate_stage.validate,
        lambda r: f"validated {r.model}/{r.sku}: passed",
    ),
    "emulate": (
        validate_stage.emulate,
        lambda r: f"validated {r.model}/{r.sku} under emulation: passed (not benchmarked)",
    ),
    "bench": (
        bench_stage.bench,
        lambda r: (
            f"bench {r.model}/{r.sku}: p50 {r.engine_only.p50_ms:.3f} ms, p99 {r.engine_only.p99_ms:.3f} ms, "
            f"{r.throughput_per_s:.0f} samples/s"
        ),
    ),
    "manifest": (
        manifest_stage.write_manifest,
        lambda r: f"manifest {r.model}/{r.sku}: digest {r.digest[:12]}",
    ),
}


@contextmanager
def _result_once(verbose: bool = False) -> Iterator[None]:
    """While a stage runs, drop the record it logs with its result (``extra=RESULT``): the command
    prints that result itself (on stdout; -v keeps both). Validate logs only details, so it has none."""

    def keep(record: logging.LogRecord) -> bool:
        return record.levelno != logging.INFO or not getattr(record, RESULT_ATTR, False)

    logger = logging.getLogger("pipeline.stages")
    if not verbose:
        logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def run_stage(args: argparse.Namespace) -> int:
    """A stage command: the stage's function on (model[, SKU]) with its extra switches, then its summary."""
    fn, summarize = STAGES[args.command]
    flags = [kw for kw, _ in STAGE_FLAGS.get(args.command, {}).values()]
    registry = _registry(args)
    progress = ProgressLine()
    try:
        # a pair's stage gets the pair resolved here, once; a model's stage its name
        target = (registry.pair(args.model, args.sku),) if STAGE_COMMANDS[args.command][0] else (registry, args.model)
        with _result_once(args.verbose):
            result = fn(*target, progress=progress, **{kw: getattr(args, kw) for kw in flags})
    finally:
        progress.close()
    data = result.to_json() if hasattr(result, "to_json") else result
    _emit(args, data, lambda: summarize(result))
    return 0


def config_validate(args: argparse.Namespace) -> int:
    """Exit 0 for a valid registry; per-SKU pipeline files it renders differently are a note, not a
    failure (`skuforge repro` renders them before it runs: a project that never ran it has none)."""
    reg = _registry(args)
    pipelines = render_pipelines(reg, check=True)
    stale = sorted(pipelines.differ + pipelines.removed)
    data = {
        "params": args.params,
        "models": sorted(reg.models),
        "skus": sorted(reg.skus),
        "valid": True,
        "pipelines_stale": stale,
    }
    _emit(args, data, lambda: f"{args.params}: valid ({len(reg.models)} models, {len(reg.skus)} SKUs)")
    if stale:
        print(
            f"note: {len(stale)} per-SKU pipeline file(s) differ from what the registry renders "
            f"({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}): `skuforge repro` renders them "
            "(`--dry` renders without running); commit pipelines/ for plain `dvc repro -P`",
            file=sys.stderr,
        )
    return 0


def config_resolve(args: argparse.Namespace) -> int:

    result = write_config(_registry(args))
    _emit(
        args,
        result,
        lambda: (
            f"{result['files']} resolved config files, {len(result['changed'])} changed, "
            f"{len(result['removed'])} removed"
        ),
    )
    return 0


def list_skus(args: argparse.Namespace) -> int:

    rows = [s for s in sku_statuses(_registry(args)) if s.buildable or not args.buildable_here]

    def here(s) -> str:
        if s.emulated:  # built here, validated under QEMU, benchmarked on its runner
            return "build+emulated"
        return "build+run" if s.buildable and s.runnable else "build" if s.buildable else "run" if s.runnable else "no"

    def text() -> str:
        cells = [{**s.to_json(), "here": here(s), "runner_labels": ",".join(s.runner_labels)} for s in rows]
        return tables.render(SKU_COLUMNS, cells, [[f"- {p}" for p in s.problems] for s in rows])

    _emit(args, [s.to_json() for s in rows], text)
    return 0


def export_example(args: argparse.Namespace) -> int:

    progress = ProgressLine()
    try:
        with _result_once(args.verbose):
            result = export(_registry(args), args.example, progress=progress)
    finally:
        progress.close()
    _emit(args, result, lambda: f"exported {args.example}: accuracy {result['accuracy']}")
    return 0


def repro(args: argparse.Namespace) -> int:
    """dvc repro of what this host builds, then the matrix and the selection per device class: one
    library call (pipeline.ops.reproduce), its result rendered."""
    reg = _registry(args)
    result = reproduce(
        reg,
        args.model,
        args.sku,
        force=args.force,
        dry=args.dry,
        publish=not args.no_publish,
        say=lambda line: print(line, file=sys.stderr),
    )
    if result.dry:
        if args.json:  # the text answer went to stderr as it ran
            _emit(args, result.dry_json(), lambda: "")
        return 0
    if not result.targets:
        return 0
    _emit(
        args,
        result.to_json(),
        lambda: matrix_text(result.rows, args.wide) + selection_text(result.records, args.wide, reg.known_gaps()),
    )
    return result.exit_code


def _quiet_mlflow() -> None:
    # MLflow logs every store migration and registry wait at INFO on its own handler; keep the
    # user's stderr to skuforge's lines (MLFLOW_LOGGING_LEVEL set by the user wins).
    MLFLOW_LOGGING_LEVEL.setdefault("WARNING")


def publish(args: argparse.Namespace) -> int:

    _quiet_mlflow()
    reg = _registry(args)
    if (args.model or args.sku) if args.all else not (args.model and args.sku):
        raise ConfigError("say what to publish", hint="give --model M --sku S, or --all (every manifest)")
    pairs = (
        [(m, s) for m, s in reg.pairs() if Layout(reg.root).manifest(m, s).is_file()]
        if args.all
        else [(args.model, args.sku)]
    )
    results = []
    require_mlflow()  # before the progress line starts: it should time publishing, not a 2 s import
    progress = ProgressLine()
    try:
        with _result_once(args.verbose):
            for model, sku in pairs:
                results.append(publish_pair(reg.pair(model, sku), progress=progress))
    finally:
        progress.close()

    def line(r) -> str:
        state = "registered" if r.created_version else "already registered"
        return (
            f"published {r.model}/{r.sku}: {r.registered_model} version {r.version} {state} "
            f"(run {r.run_id[:12]}{', resumed' if r.resumed else ''}) at {r.tracking_uri}"
        )

    data = [r.to_json() for r in results]
    _emit(args, data if args.all else data[0], lambda: "\n".join(line(r) for r in results) or "no manifests to publish")
    return 0


def _gate_lines(gates, indent: str) -> list[str]:
    return [f"{indent}{'ok  ' if g.passed else 'FAIL'}  {g.name:12} {g.detail}" for g in gates]


def _promotion_text(report) -> str:
    lines = [f"{report.action} {report.model}: {report.alias!r} by {report.who} at {report.when} ({report.why})"]
    for m in report.moves:
        to = (
            "no version"
            if m.version is None and report.action == "promote"
            else "removed"
            if m.version is None
            else f"version {m.version}"
        )
        state = "already there" if m.already else "moved" if m.moved else "not moved"
        lines.append(f"  {m.sku}: {to} (was {m.previous or 'none'}) - {state}")
        lines += _gate_lines(m.gates, "    ")
    lines += _gate_lines(report.gates, "  ")
    return "\n".join(lines)


def promote(args: argparse.Namespace) -> int:

    _quiet_mlflow()
    reg = _registry(args)
    skus = None if args.all else args.sku
    try:
        if args.rollback:
            if args.version:
                raise ConfigError("--rollback moves the alias to its previous holder", hint="leave out --version")
            report = rollback(reg, args.model, args.to, skus=skus, reason=args.reason)
        else:
            report = promote_alias(reg, args.model, args.to, skus=skus, version=args.version, reason=args.reason)
    except PromotionBlocked as exc:  # show every gate, then exit 1
        blocked = exc.report
        _emit(args, blocked.to_json(), lambda: _promotion_text(blocked))
        raise
    _emit(args, report.to_json(), lambda: _promotion_text(report))
    return 0


def releases(args: argparse.Namespace) -> int:

    _quiet_mlflow()
    listing = list_releases(_registry(args), args.model, with_history=args.history)

    def text() -> str:
        lines = [f"{listing.model} at {listing.tracking_uri} (chain: {' -> '.join(listing.chain)})"]
        cells = [
            {
                "sku": s.sku,
                "version": str(v.version),
                "digest": (v.digest or "")[:12],
                "created": v.created,
                "correctness": v.correctness,
                "p50_ms": v.p50_ms,
                "aliases": ",".join(v.aliases),
            }
            for s in listing.skus
            for v in s.versions
        ]
        lines.append(tables.render(RELEASE_COLUMNS, cells))
        for s in listing.skus:
            for alias, entries in s.history.items():
                for e in entries:
                    lines.append(
                        f"  {s.sku} {alias} #{e.id} {e.action}: {e.previous or 'none'} -> {e.version or 'none'} "
                        f"by {e.who} at {e.when}: {e.why}"
                    )
        if listing.missing:
            lines.append(f"required by the release but never published: {', '.join(listing.missing)}")
        return "\n".join(lines)

    _emit(args, listing.to_json(), text)
    return 0


def summary(args: argparse.Namespace) -> int:
    """The matrix, filtered by --model, --sku (checked against the registry: an unknown name is exit
    2 with the known ones) and --outcome."""
    reg = _registry(args)
    for name in args.model or []:
        reg.model(name)
    for name in args.sku or []:
        reg.sku(name)
    unknown = sorted(set(args.outcome or ()) - set(OUTCOMES))
    if unknown:
        raise ConfigError(
            f"unknown outcome {', '.join(map(repr, unknown))}",
            hint=f"give one of: {', '.join(OUTCOMES)} (quote those with a space)",
        )
    rows = matrix(reg, args.model, args.sku)
    if args.outcome:
        rows = [r for r in rows if r.outcome in args.outcome]

    def text() -> str:  # the selection of the models shown, computed from their manifests (nothing written)
        models = list(dict.fromkeys(r.model for r in rows))
        return matrix_text(rows, args.wide) + selection_text(
            [s for s in (select(reg, m) for m in models) if s.classes], args.wide, reg.known_gaps()
        )

    _emit(args, [r.to_json() for r in rows], text)
    return 0


def report(args: argparse.Namespace) -> int:

    progress = ProgressLine()
    try:
        index = write_site(
            _registry(args), args.model, Path(args.out).absolute() if args.out else None, args.sku, progress=progress
        )
    finally:
        progress.close()
    _emit(args, {"index": str(index), "out": str(index.parent)}, lambda: str(index))
    return 0


def runner_probe(args: argparse.Namespace) -> int:

    report = probe_report(_registry(args), peaks=args.peaks or args.refresh, refresh=args.refresh)
    # the probe is a JSON document either way (pin-device-state.sh and the benchmark record it)
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0


def runner_check(args: argparse.Namespace) -> int:

    report = check_report(_registry(args), args.sku)
    if report["matches"]:
        _emit(args, report, lambda: f"host matches SKU {args.sku}")
        return 0
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    raise EnvironmentProblem(
        f"host does not match SKU {args.sku}:\n" + "\n".join(f"  - {p}" for p in report["problems"]),
        hint=f"run on a runner with labels [{', '.join(report['runner_labels'])}] and the SKU's toolchain "
        f"{report['toolchain'] or '(none pinned)'}; `skuforge runner probe` shows this host",
    )


def runner_labels(args: argparse.Namespace) -> int:

    labels = class_labels(load_classes(args.classes), args.runner_class)
    _emit(args, labels, lambda: ",".join(labels))
    return 0


SKU_COLUMNS = (
    Column("sku"),
    Column("backend"),
    Column("precision", "prec"),
    Column("device_class", "class"),
    Column("target"),
    Column("here"),
    Column("runner_labels", "runner labels"),
)
RELEASE_COLUMNS = (
    Column("sku"),
    Column("version", numeric=True),
    Column("digest"),
    Column("created"),
    Column("correctness"),
    Column("p50_ms", "p50 ms", numeric=True),
    Column("aliases"),
)

MATRIX_COLUMNS = (
    Column("model"),
    Column("sku"),
    Column("outcome"),
    Column("precision", "prec"),
    Column("max_abs_error", "max err", numeric=True),
    Column("evaluation_delta", "eval Δ", numeric=True, signed=True),
    Column("p50_ms", "p50 ms", numeric=True),
    Column("p99_ms", "p99 ms", numeric=True),
    Column("throughput_per_s", "samples/s", numeric=True),
)
"""The default matrix: what decides a pair at a glance, in 120 columns (the reason a pair failed, or
what a passed one warns of, is the line under it)."""

WIDE_COLUMNS = (
    *MATRIX_COLUMNS[:3],
    Column("backend"),
    *MATRIX_COLUMNS[3:5],
    Column("evaluation_reference", "eval ref", numeric=True),
    MATRIX_COLUMNS[5],
    Column("hard_tail_delta", "hard-tail Δ", numeric=True, signed=True),
    Column("build_s", "build s", numeric=True),
    Column("layers", numeric=True),
    Column("fused_layers", "fused", numeric=True),
    *MATRIX_COLUMNS[6:8],
    Column("e2e_p50_ms", "e2e p50 ms", numeric=True),
    MATRIX_COLUMNS[8],
    Column("digest"),
    Column("mlflow"),
)
"""--wide: every figure of the manifest's summary row."""


def matrix_text(rows: list[PairOutcome], wide: bool = False, **render: Any) -> str:
    """One line per (model, SKU): its outcome and its manifest's figures; under a pair that did not
    pass (or passed with warnings), why, indented; then the count per outcome."""
    if not rows:
        return "no models or SKUs"
    cells = [{**(r.manifest or {}), "model": r.model, "sku": r.sku, "outcome": r.outcome} for r in rows]
    notes = []
    for r in rows:
        labels = f" (runner labels [{', '.join(r.runner_labels)}])" if r.runner_labels else ""
        notes.append([f"{r.detail}{labels}"] if r.detail else [])
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    footer = [", ".join(f"{n} {k}" for k, n in counts.items())]
    text = tables.render(WIDE_COLUMNS if wide else MATRIX_COLUMNS, cells, notes, wide=wide, footer=footer, **render)
    return text + known_gaps_text(rows) + end_to_end_text(rows, wide, **render) + drift_text(rows, wide, **render)


def known_gaps_text(rows: list[PairOutcome]) -> str:
    """Under the matrix, once per SKU shown: the shortfalls its stack has upstream
    (``skus.<s>.known_gaps``), so a slow engine is explained; no outcome depends on them."""
    said = {r.sku: r.known_gaps for r in rows if r.known_gaps}
    if not said:
        return ""
    lines = [f"  {sku}: {gap.line}" for sku, gaps in said.items() for gap in gaps]
    return "\n\nKnown gaps upstream (skus.<s>.known_gaps; they change no outcome)\n" + "\n".join(lines)


E2E_STEPS = ("decode", "preprocess", "infer", "postprocess")
E2E_COLUMNS = (
    Column("model"),
    Column("sku"),
    *(Column(f"e2e_{step}_ms", step, numeric=True) for step in E2E_STEPS),
    Column("e2e_p50_ms", "end to end", numeric=True),
    Column("p50_ms", "engine only", numeric=True),
    Column("energy_j", "J/inference", numeric=True),
)


def end_to_end_text(rows: list[PairOutcome], wide: bool = False, **render: Any) -> str:
    """Where the time of an end-to-end call goes (p50 ms per step, as the device runs it), and the
    energy per inference or, once, why there is none."""
    cells = [
        {**r.manifest, "model": r.model, "sku": r.sku} for r in rows if r.manifest and "e2e_infer_ms" in r.manifest
    ]
    if not cells:
        return ""
    reasons = sorted({c["energy"] for c in cells if c.get("energy_j") is None and c.get("energy")})
    footer = [f"energy: {reason}" for reason in reasons[:3]] + (["energy: …"] if len(reasons) > 3 else [])
    title = "\n\nEnd to end as the device runs it: p50 ms per step (steps' p50s need not add up to the whole's)\n"
    return title + tables.render(E2E_COLUMNS, cells, wide=wide, footer=footer, **render)


DRIFT_COLUMNS = (
    Column("model"),
    Column("sku"),
    Column("device"),
    Column("differs", "steps differing"),
    Column("max_abs_input_diff", "max Δ in", numeric=True),
    Column("samples", "differ", numeric=True),
    Column("metric_drop", "drop", numeric=True, signed=True),
    Column("culprit", "mostly"),
    Column("gate"),
)


def drift_text(rows: list[PairOutcome], wide: bool = False, **render: Any) -> str:
    """The preprocessing drift check of the pairs whose device preprocessing differs from the
    training side's (their steps, libraries or results); the rest counted in one line."""
    cells, same = [], 0
    for r in rows:
        # one input per model is made from raw files (config): the table names the pair only
        for d in ((r.manifest or {}).get("preprocessing") or {}).values():
            if not d["differing_steps"] and not d["samples_differing"] and d["passed"]:
                same += 1
                continue
            cells.append(
                {
                    "model": r.model,
                    "sku": r.sku,
                    "device": d["device"],
                    "differs": ",".join(d["differing_steps"]) or "-",
                    "max_abs_input_diff": d["max_abs_input_diff"],
                    "samples": f"{d['samples_differing']}/{d['samples']}",
                    "metric_drop": d["metric_drop"],
                    "culprit": d["culprit"],
                    "gate": ("pass" if d["passed"] else "FAIL") if d["gated"] else "reported",
                }
            )
    if not cells and not same:
        return ""
    footer = (
        [f"{same} other pair(s): the device runs the training side's steps, model inputs identical"] if same else []
    )
    title = "\n\nPreprocessing drift: the device's steps against the training side's, same raw files, same engine\n"
    return title + tables.render(DRIFT_COLUMNS, cells, wide=wide, footer=footer, **render)
