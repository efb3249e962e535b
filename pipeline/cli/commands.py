"""Subcommands. Each turns arguments into one library call and renders the result."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from pipeline.cli.compare import refresh_lines
from pipeline.cli.progress import ProgressLine
from pipeline.core.errors import ConfigError, EnvironmentProblem, SkuforgeError
from pipeline.core.paths import Layout
from pipeline.engine.matrix import matrix, sku_statuses, worst_exit
from pipeline.ops.hostreport import check_report, class_labels, load_classes, probe_report
from pipeline.ops.repro import DvcFailed, ProjectStatus, clear_outcomes, run_dvc_repro, targets, upstream_stages
from pipeline.project.config import load_registry
from pipeline.report import write_site
from pipeline.stages.config import write_config
from pipeline.stages.export import export
from pipeline.stages.publish import publish as publish_pair
from pipeline.tracking.client import require_mlflow
from pipeline.tracking.promotion import PromotionBlocked, rollback
from pipeline.tracking.promotion import promote as promote_alias
from pipeline.tracking.releases import list_releases
from pipeline.verify.consistency import refresh_reports


def positive_int(value: str) -> str:
    """A registered version number (MLflow counts from 1), checked before any store is opened."""
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a version number: give a positive integer such as 3 "
            "(`skuforge releases MODEL` lists the versions)"
        )
    return str(int(value))


def _registry(args: argparse.Namespace):

    return load_registry(args.params)


def _emit(args: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
    if getattr(args, "json", False):
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(text())


def _stage(
    fn_path: str, needs_sku: bool, summarize: Callable[[Any], str], flags: tuple[str, ...] = ()
) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        import importlib


        module, _, name = fn_path.partition(":")
        fn = getattr(importlib.import_module(module), name)
        registry = _registry(args)
        progress = ProgressLine()
        try:
            target = (args.model, args.sku) if needs_sku else (args.model,)
            result = fn(registry, *target, progress=progress, **{kw: getattr(args, kw) for kw in flags})
        finally:
            progress.close()
        data = result.to_json() if hasattr(result, "to_json") else result
        _emit(args, data, lambda: summarize(result))
        return 0

    return run


STAGES: dict[str, tuple[str, bool, str, Callable[[Any], str]]] = {
    "prepare": (
        "pipeline.stages.prepare:prepare",
        False,
        "check the model, infer shapes, run graph passes",
        lambda r: (
            f"prepared {r.model}: " + ", ".join(f"{p.name} {'changed' if p.changed else 'no change'}" for p in r.passes)
        ),
    ),
    "data": (
        "pipeline.stages.data:make_data",
        False,
        "golden, calibration, evaluation and hard-tail sets",
        lambda r: f"data {r.model}: " + ", ".join(f"{k} {v.samples}" for k, v in r.splits.items()),
    ),
    "reference": (
        "pipeline.stages.reference:reference",
        False,
        "ONNX Runtime CPU FP32 reference outputs",
        lambda r: f"reference {r.model}: " + (", ".join(f"{k} {v:.4f}" for k, v in r.metric.items()) or "done"),
    ),
    "calibrate": (
        "pipeline.stages.calibrate:calibrate",
        False,
        "INT8 calibration table",
        lambda r: f"calibrated {r.model}: {r.method}, {r.samples} samples, {r.tensors} tensors",
    ),
    "build": (
        "pipeline.stages.build:build",
        True,
        "build the engine with the SKU's backend",
        lambda r: (
            f"built {r.model}/{r.sku} in {r.build_seconds:.1f}s: placement {r.placement}, precision {r.precision_counts}"
            + (f", reproducible: {r.reproducibility.verdict}" if r.reproducibility else "")
        ),
    ),
    "validate": (
        "pipeline.stages.validate:validate",
        True,
        "correctness and placement gates",
        lambda r: f"validated {r.model}/{r.sku}: passed",
    ),
    "bench": (
        "pipeline.stages.bench:bench",
        True,
        "latency, throughput and memory",
        lambda r: (
            f"bench {r.model}/{r.sku}: p50 {r.engine_only.p50_ms:.3f} ms, p99 {r.engine_only.p99_ms:.3f} ms, "
            f"{r.throughput_per_s:.0f} samples/s"
        ),
    ),
    "manifest": (
        "pipeline.stages.manifest:write_manifest",
        True,
        "write the manifest",
        lambda r: f"manifest {r.model}/{r.sku}: digest {r.digest[:12]}",
    ),
}

# Extra switches of a stage command: flag -> (keyword argument of the stage function, help)
STAGE_FLAGS: dict[str, dict[str, tuple[str, str]]] = {
    "build": {
        "--check-reproducible": (
            "check_reproducible",
            "build the engine a second time (new process, temporary "
            "folder and cache copy) and record the verdict (bitwise, equivalent, "
            "unverified, differs) in build.json; exit 1 below the SKU's "
            "reproducibility.require",
        ),
        "--require-cache": (
            "cache_required",
            "fail on any miss of the SKU's checked-in compiler cache (a "
            "stale, corrupt or missing cache, a tuning task not in the database), as "
            "skus.<s>.cache.require or SKUFORGE_REQUIRE_CACHE=1 do",
        ),
    },
}


def register(sub: argparse._SubParsersAction) -> None:
    config = sub.add_parser("config", help="check the registry")
    csub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    v = csub.add_parser("validate", help="validate params.yaml")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=config_validate)
    r = csub.add_parser("resolve", help="write the resolved settings per model and (model, SKU) that DVC tracks")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=config_resolve)

    skus = sub.add_parser("skus", help="list SKUs and whether this host can build them")
    skus.add_argument("--buildable-here", action="store_true", help="only the SKUs this host can build")
    skus.add_argument("--json", action="store_true")
    skus.set_defaults(func=list_skus)

    ex = sub.add_parser("export", help="train an example model and export it to ONNX")
    ex.add_argument("--example", required=True)
    ex.add_argument("--json", action="store_true")
    ex.set_defaults(func=export_example)

    for name, (fn, needs_sku, help_text, summarize) in STAGES.items():
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--model", required=True)
        if needs_sku:
            p.add_argument("--sku", required=True)
        p.add_argument("--json", action="store_true", help="print the report as JSON")
        flags = STAGE_FLAGS.get(name, {})
        for flag, (kw, flag_help) in flags.items():
            # unset: None, so the library's default (the SKU's setting) decides
            p.add_argument(flag, dest=kw, action="store_const", const=True, default=None, help=flag_help)
        p.set_defaults(func=_stage(fn, needs_sku, summarize, tuple(kw for kw, _ in flags.values())))

    p = sub.add_parser("publish", help="record engines in MLflow (a run each) and register them (idempotent)")
    p.add_argument("--model", help="the model of the pair to publish")
    p.add_argument("--sku", help="the SKU of the pair to publish")
    p.add_argument("--all", action="store_true", help="every (model, SKU) with a manifest")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=publish)

    p = sub.add_parser("promote", help="move a registry alias along the chain when the gates pass, or roll it back")
    p.add_argument("model")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--sku", action="append", help="the SKU (repeatable)")
    which.add_argument("--all-skus", action="store_true", help="every SKU the release requires (release.skus)")
    p.add_argument("--to", required=True, metavar="ALIAS", help="the alias to move (release.aliases)")
    p.add_argument(
        "--version",
        type=positive_int,
        metavar="N",
        help="the version to move (default: newest for the first alias, else the holder of the alias before)",
    )
    p.add_argument("--reason", help="why (required for the aliases in release.reason_required)")
    p.add_argument("--rollback", action="store_true", help="move the alias back to its previous holder")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=promote)

    p = sub.add_parser("releases", help="registered versions and aliases per SKU of a model")
    p.add_argument("model")
    p.add_argument("--history", action="store_true", help="also the alias moves (who, when, why)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=releases)

    r = sub.add_parser(
        "repro", help="dvc repro (keep going) for the SKUs this host can build; the outcome of every pair"
    )
    r.add_argument("--model", action="append", help="only this model (repeatable)")
    r.add_argument("--sku", action="append", help="only this SKU (repeatable)")
    r.add_argument("--force", action="store_true", help="rerun stages even if unchanged")
    r.add_argument("--dry", action="store_true", help="show what would run (dvc status), run nothing")
    r.add_argument("--no-publish", action="store_true", help="stop at the manifests: record nothing in MLflow")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=repro)

    s = sub.add_parser(
        "summary", help="the outcome of every (model, SKU) with its manifest's gates, metric deltas, latency"
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=summary)

    p = sub.add_parser(
        "report",
        help="a static HTML report (no network needed): latency, correctness, layers, "
        "roofline per pair; SKUs side by side per model",
    )
    p.add_argument("--model", help="only this model (default: every model)")
    p.add_argument("--sku", action="append", help="only this SKU (repeatable; default: every SKU)")
    p.add_argument("--out", metavar="DIR", help="the folder to (re)write, inside the project (default: build/report)")
    p.set_defaults(func=report)

    rn = sub.add_parser("runner", help="this host as a CI runner: its state, whether it matches a SKU, runner labels")
    rsub = rn.add_subparsers(dest="runner_command", metavar="ACTION", required=True)
    p = rsub.add_parser("probe", help="the host's hardware, device state, GPU, toolchain and the SKUs it can build/run")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--peaks",
        action="store_true",
        help="add the host's peak FP32 GFLOP/s and memory GB/s (measured once, about 10 s, then cached)",
    )
    p.add_argument("--refresh", action="store_true", help="measure the peaks again (implies --peaks)")
    p.set_defaults(func=runner_probe)
    p = rsub.add_parser("check", help="exit 3 with every difference when this host does not match the SKU")
    p.add_argument("--sku", required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=runner_check)
    p = rsub.add_parser("labels", help="the labels of a runner class (for setup-runner.sh)")
    p.add_argument("--class", dest="runner_class", required=True, metavar="NAME")
    p.add_argument(
        "--classes", default="runners/classes.yaml", help="the runner classes (default: runners/classes.yaml)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=runner_labels)


def config_validate(args: argparse.Namespace) -> int:
    reg = _registry(args)
    data = {"params": args.params, "models": sorted(reg.models), "skus": sorted(reg.skus), "valid": True}
    _emit(args, data, lambda: f"{args.params}: valid ({len(reg.models)} models, {len(reg.skus)} SKUs)")
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
        return "build+run" if s.buildable and s.runnable else "build" if s.buildable else "run" if s.runnable else "no"

    def text() -> str:
        lines = [f"{'SKU':24} {'BACKEND':12} {'PREC':5} {'TARGET':20} {'HERE':10} RUNNER LABELS"]
        for s in rows:
            lines.append(
                f"{s.sku:24} {s.backend:12} {s.precision:5} {s.target:20} {here(s):10} {','.join(s.runner_labels)}"
            )
            lines += [f"{'':24} - {p}" for p in s.problems]
        return "\n".join(lines)

    _emit(args, [s.to_json() for s in rows], text)
    return 0


def export_example(args: argparse.Namespace) -> int:

    progress = ProgressLine()
    try:
        result = export(_registry(args), args.example, progress=progress)
    finally:
        progress.close()
    _emit(args, result, lambda: f"exported {args.example}: accuracy {result['accuracy']}")
    return 0


def repro(args: argparse.Namespace) -> int:

    reg = _registry(args)
    status = None if args.force else ProjectStatus(reg.root)
    dvc_targets, skipped = targets(reg, args.model, args.sku, publish=not args.no_publish)
    for s in skipped:
        what = "building only (validate and bench need the target)" if s.buildable else "skipping"
        print(
            f"{what} SKU {s.sku}: {'; '.join(s.problems)}; needs a runner with labels [{', '.join(s.runner_labels)}]",
            file=sys.stderr,
        )
    if not dvc_targets:
        if args.sku:  # asked for by name (a CI job for one SKU): building nothing is not success

            raise EnvironmentProblem(
                f"this host can build none of the SKUs asked for: {', '.join(args.sku)}",
                hint="run it on a runner with the labels printed above "
                "(skuforge skus --buildable-here lists what this host can build)",
            )
        print("nothing this host can build", file=sys.stderr)
        return 0
    stale = None if status is None else status.stale(upstream_stages(reg, dvc_targets))
    failed = None
    if not args.dry:
        clear_outcomes(reg, dvc_targets)  # this run records again what still fails
    if stale == []:
        print("Data and pipelines are up to date.", file=sys.stderr)
    else:
        try:
            run_dvc_repro(reg.root, dvc_targets, force=args.force, dry=args.dry, keep_going=True)
        except DvcFailed as exc:
            if not exc.stage_failed or args.dry:
                raise
            failed = exc  # the matrix below says which pairs and why
    if args.dry:
        _emit(args, {"targets": dvc_targets, "skipped": [s.to_json() for s in skipped]}, lambda: "")
        return 0
    statuses = [s for s in sku_statuses(reg) if not args.sku or s.sku in args.sku]
    rows = matrix(reg, args.model, [s.sku for s in statuses], statuses)
    consistency, consistency_exit = _consistency_reports(reg, args.model)
    code = max(worst_exit(rows), failed.exit_code if failed else 0, consistency_exit)
    _emit(
        args,
        {
            "targets": dvc_targets,
            "skipped": [s.to_json() for s in skipped],
            "matrix": [r.to_json() for r in rows],
            "consistency": consistency,
            "exit_code": code,
        },
        lambda: _matrix_text(rows),
    )
    return code


def _consistency_reports(reg, models: list[str] | None) -> tuple[dict[str, Any], int]:
    """Refresh the checked-in consistency matrix of each model (reports/consistency/) after a run:
    model -> the files written or why not, and an exit code for a failure to write them."""

    try:
        done = refresh_reports(reg, models)
    except SkuforgeError as exc:  # a read-only reports/ folder, say: the matrix below still shows
        print(f"skuforge: error: consistency reports not written: {exc}", file=sys.stderr)
        return {}, exc.exit_code
    for line in refresh_lines(done):
        print(line, file=sys.stderr)
    return done, 0


def _quiet_mlflow() -> None:
    # MLflow logs every store migration and registry wait at INFO on its own handler; keep the
    # user's stderr to skuforge's lines (MLFLOW_LOGGING_LEVEL set by the user wins).
    import os

    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")


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
        for model, sku in pairs:
            results.append(publish_pair(reg, model, sku, progress=progress))
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
    skus = None if args.all_skus else args.sku
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
        cols = ("SKU", "VERSION", "DIGEST", "CREATED", "CORRECTNESS", "P50_MS", "ALIASES")
        rows = [
            (
                s.sku,
                v.version,
                (v.digest or "-")[:12],
                v.created,
                v.correctness or "-",
                f"{v.p50_ms:.4g}" if v.p50_ms is not None else "-",
                ",".join(v.aliases) or "-",
            )
            for s in listing.skus
            for v in s.versions
        ]
        widths = (
            [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)] if rows else [len(c) for c in cols]
        )
        lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths)) for r in rows]
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

    rows = matrix(_registry(args))
    _emit(args, [r.to_json() for r in rows], lambda: _matrix_text(rows))
    return 0


def report(args: argparse.Namespace) -> int:
    from pathlib import Path


    index = write_site(_registry(args), args.model, Path(args.out).absolute() if args.out else None, args.sku)
    print(index)
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


MATRIX_COLUMNS = [
    "model",
    "sku",
    "outcome",
    "precision",
    "build_s",
    "layers",
    "fused_layers",
    "max_abs_error",
    "evaluation_reference",
    "evaluation_delta",
    "hard_tail_delta",
    "p50_ms",
    "p99_ms",
    "e2e_p50_ms",
    "throughput_per_s",
    "mlflow",
]


def _matrix_text(rows) -> str:
    """One line per (model, SKU): its outcome and its manifest's figures; under a pair that did not
    pass, why (indented)."""
    if not rows:
        return "no models or SKUs"

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    cells = [{**(r.manifest or {}), "model": r.model, "sku": r.sku, "outcome": r.outcome} for r in rows]
    widths = {c: max(len(c), *(len(fmt(x.get(c))) for x in cells)) for c in MATRIX_COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in MATRIX_COLUMNS).rstrip()]
    for r, x in zip(rows, cells):
        lines.append("  ".join(fmt(x.get(c)).ljust(widths[c]) for c in MATRIX_COLUMNS).rstrip())
        if r.detail and r.outcome != "passed":
            labels = f" (runner labels [{', '.join(r.runner_labels)}])" if r.runner_labels else ""
            lines.append(f"    {r.detail}{labels}")
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    lines.append(", ".join(f"{n} {k}" for k, n in counts.items()))
    return "\n".join(lines)
