"""The state of each (model, SKU) pair: which SKUs this host can build and run, the outcome record a
failed stage command leaves, and the matrix of outcomes (``skuforge matrix``, the CI summary, the
HTML report). Running ``dvc repro`` is pipeline/ops/repro.py."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from pipeline.core.errors import SkuforgeError
from pipeline.core.paths import Layout
from pipeline.engine.hostcheck import cached_host_problems, emulation_problems, host_problems
from pipeline.project.config import KnownGap, Registry
from pipeline.results.benchstats import e2e_below_engine
from pipeline.results.manifest import load_manifest
from pipeline.results.outcomes import OUTCOMES_DIR, read_outcome
from pipeline.results.reports import COMPUTE_PRECISIONS


@dataclass
class SkuStatus:
    sku: str
    backend: str
    precision: str
    target: str
    runner_labels: list[str]
    buildable: bool
    runnable: bool = False
    problems: list[str] = field(default_factory=list)
    device_class: str | None = None  # the devices it serves (skus.<s>.device_class); None: in no class
    emulated: bool = False  # not runnable here, but its engines are validated here under emulation

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


def sku_statuses(registry: Registry, cached: bool = True) -> list[SkuStatus]:
    """What this host can do with each SKU. ``cached``: the answers kept for this host's fingerprint
    (hostcheck.cached_host_problems: milliseconds instead of importing every SDK), else asked now."""
    answers = cached_host_problems(registry) if cached else None
    out = []
    for name, spec in registry.skus.items():
        if answers is not None:
            build, run = answers[name]["build"], answers[name]["run"]
        else:
            build, run = host_problems(registry, name, "build"), host_problems(registry, name, "run")
        out.append(
            SkuStatus(
                sku=name,
                backend=spec.backend,
                precision=spec.precision,
                target=f"{spec.target.arch}/{spec.target.device}/{spec.target.os}",
                runner_labels=spec.runner_labels,
                buildable=not build,
                runnable=not run,
                problems=list(dict.fromkeys(build + run)),
                device_class=spec.device_class,
                emulated=not build and emulation_problems(spec) == [],
            )
        )
    return out


# The pipeline's stages: in dvc.yaml once per project, per example and per model; per (model, SKU)
# in the SKU's own files (pipeline/ops/pipelines.py renders them): BUILD_STAGES in
# pipelines/<sku>/dvc.yaml, RUN_STAGES (they need the target itself) in pipelines/<sku>/run/dvc.yaml.
GLOBAL_STAGES = ("config",)
EXAMPLE_STAGES = ("export",)
MODEL_STAGES = ("prepare", "data", "reference", "calibrate")
PAIR_STAGES = ("build", "validate", "bench", "manifest", "publish")
BUILD_STAGES = PAIR_STAGES[:1]
RUN_STAGES = PAIR_STAGES[1:]
PIPELINES_DIR = "pipelines"
# validate under QEMU user-mode emulation (an aarch64 SKU's engine on an x86-64 host): its own file,
# pipelines/<sku>/emulated/dvc.yaml, and its own report (emulate.json), never the device's validate
EMULATE_STAGE = "emulate"


def pipeline_file(sku: str, run: bool) -> str:
    """The SKU's dvc.yaml holding its build stages, or (``run``) the stages that need the target."""
    return f"{PIPELINES_DIR}/{sku}/run/dvc.yaml" if run else f"{PIPELINES_DIR}/{sku}/dvc.yaml"


def emulated_file(sku: str) -> str:
    """The SKU's dvc.yaml holding its emulate stage (SKUs that can be emulated: ``can_emulate``)."""
    return f"{PIPELINES_DIR}/{sku}/emulated/dvc.yaml"


def stage_address(stage: str, model: str, sku: str) -> str:
    """How dvc names a (model, SKU) stage: ``pipelines/<sku>/run/dvc.yaml:bench@<model>``."""
    where = emulated_file(sku) if stage == EMULATE_STAGE else pipeline_file(sku, stage in RUN_STAGES)
    return f"{where}:{stage}@{model}"


def stage_chain(stage: str) -> tuple[str, ...]:
    """The pair stages up to ``stage``, itself included (emulate follows the build)."""
    if stage == EMULATE_STAGE:
        return (*BUILD_STAGES, EMULATE_STAGE)
    return PAIR_STAGES[: PAIR_STAGES.index(stage) + 1]


def parse_address(address: str) -> tuple[str, str | None, str | None]:
    """(stage, model or example, SKU) of a dvc stage address; None where the stage has none."""
    path, _, name = address.rpartition(":")
    stage, _, item = name.partition("@")
    parts = path.split("/")
    sku = parts[1] if len(parts) > 1 and parts[0] == PIPELINES_DIR else None
    return stage, item or None, sku


# --- the matrix ---------------------------------------------------------------------------------

Outcome = Literal[
    "passed",
    "gate failed",
    "build failed",
    "failed",
    "bad input",
    "unsupported",
    "publish failed",
    "built only",
    "not buildable here",
    "not run",
]
OUTCOMES: tuple[str, ...] = get_args(Outcome)


@dataclass
class PairOutcome:
    """What became of one (model, SKU): ``outcome`` (one of OUTCOMES), the exit code it stands for,
    a one-line ``detail``, the stage it concerns, and the manifest's figures where there is one."""

    model: str
    sku: str
    outcome: Outcome
    exit_code: int = 0
    detail: str = ""
    stage: str | None = None
    p50_ms: float | None = None
    unsupported: dict[str, Any] | None = None
    runner_labels: list[str] = field(default_factory=list)
    manifest: dict[str, Any] | None = None  # the summary row of its manifest
    fix: str = ""  # a failed correctness gate: the bisected node and the command that fixes it (also in detail)
    warnings: list[str] = field(default_factory=list)  # short: what makes a passed pair doubtful (also in detail)

    mixed: str = ""  # a passed engine with layers kept in higher precision: ``mixed: 6 layers fp32, 1.7x of fp32``
    # an engine built without its checked-in compiler cache: ``cache: corrupt — built without checked-in tuning``
    cache: str = ""
    # shortfalls of the SKU's stack known upstream (skus.<s>.known_gaps): said under the matrix, never a verdict
    known_gaps: list[KnownGap] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The outcome as a matrix cell: ``passed (mixed: 6 layers fp32, 1.7x of fp32; cache: stale — built
        without checked-in tuning; warn: 5 fp32 layers)``."""
        notes = [n for n in (self.mixed, self.cache) if n]
        notes += [f"warn: {'; '.join(self.warnings)}"] if self.warnings else []
        return f"{self.outcome} ({'; '.join(notes)})" if notes else self.outcome

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "known_gaps": [g.model_dump(mode="json") for g in self.known_gaps]}


def matrix(
    registry: Registry,
    models: list[str] | None = None,
    skus: list[str] | None = None,
    statuses: list[SkuStatus] | None = None,
) -> list[PairOutcome]:
    """One outcome per (model, SKU) the registry builds (Registry.pairs), in registry order, from
    the manifests, the outcome records the stage commands left and what this host can do
    (``statuses``: sku_statuses, computed when None).

    A record counts only when it is newer than the pair's manifest; of several, the newest (a
    stage that succeeds removes its own record, and `skuforge repro` clears those of its targets).
    """
    statuses = statuses if statuses is not None else sku_statuses(registry)
    by_sku = {s.sku: s for s in statuses}
    base = registry.root / OUTCOMES_DIR
    config = read_outcome(base / "config.json")
    rows = []
    upstream: dict[str, list[dict[str, Any]]] = {}
    for model, sku in registry.pairs(models or None, skus or None):
        if model not in upstream:
            records = (config, *(read_outcome(base / model / f"{st}.json") for st in MODEL_STAGES))
            upstream[model] = [r for r in records if r]
        row = _pair_outcome(registry, model, sku, by_sku.get(sku), upstream[model])
        if row.manifest is not None:
            row.manifest.pop("failures")  # said in ``detail``
        row.known_gaps = list(registry.skus[sku].known_gaps)  # whatever the outcome: a note, not a verdict
        rows.append(row)
    return rows


def _pair_outcome(
    registry: Registry, model: str, sku: str, status: SkuStatus | None, upstream: list[dict[str, Any]]
) -> PairOutcome:

    out = Layout(registry.root)
    manifest_path = out.manifest(model, sku)
    row = _manifest_row(registry, model, sku) if manifest_path.is_file() else None
    notes = row.pop("warnings") if row is not None else []
    verdict = row.pop("verdict") if row is not None else []
    cache_note, cache_detail = (row.pop("cache") if row is not None else None) or ("", None)
    said = [cache_detail] if cache_detail else []  # the long form, in the detail line
    if row is None and status is not None and not status.buildable:
        # whatever an attempt here recorded, this host was never going to build it
        return PairOutcome(
            model, sku, "not buildable here", 0, "; ".join(status.problems), runner_labels=status.runner_labels
        )
    made = manifest_path.stat().st_mtime if row else None
    base = registry.root / OUTCOMES_DIR / model
    records = [
        (r, False) for r in (read_outcome(base / f"{st}@{sku}.json") for st in (*PAIR_STAGES, EMULATE_STAGE)) if r
    ]
    records += [(r, True) for r in upstream]
    fresh = [(r, up) for r, up in records if made is None or r["_mtime"] > made]
    if fresh:
        record, from_upstream = max(fresh, key=lambda x: x[0]["_mtime"])
        if not from_upstream:
            return _failed_pair(registry, model, sku, record, row)
        where = f"{record['stage']}@{model}" if record.get("model") else record["stage"]
        return PairOutcome(
            model,
            sku,
            "not run",
            int(record["exit_code"]),
            f"{where} failed: {record['message']}",
            record["stage"],
            manifest=row,
        )
    if row is not None:
        if row["passed"]:
            return PairOutcome(
                model,
                sku,
                "passed",
                0,
                "; ".join([*said, *verdict, *(long for _, long in notes)]),
                None,
                row["p50_ms"],
                manifest=row,
                warnings=[short for short, _ in notes],
                mixed=_mixed(registry, model, row),
                cache=cache_note,
            )
        fix = row.pop("fix", "")
        return PairOutcome(
            model,
            sku,
            "gate failed",
            1,
            _with_fix("; ".join([*(row["failures"] or ["correctness gate failed"]), *said]), fix),
            "validate",
            row["p50_ms"],
            manifest=row,
            fix=fix,
            cache=cache_note,
        )
    if status is not None and not status.runnable and out.report(model, sku, "build").is_file():
        emulated = _emulated_validation(out.report(model, sku, EMULATE_STAGE), out.report(model, sku, "build"))
        return PairOutcome(
            model,
            sku,
            "built only",
            0,
            emulated + ": its runner benches and publishes it"
            if emulated
            else "; ".join(status.problems) + ": its runner validates, benches and publishes it",
            EMULATE_STAGE if emulated else "build",
            runner_labels=status.runner_labels,
        )
    return PairOutcome(model, sku, "not run", 0, "no manifest and no recorded failure yet")


def _emulated_validation(path: Path, build: Path) -> str:
    """ "validated under emulation …" where emulate.json is a passing run under emulation of the
    engine build.json describes; empty otherwise (not yet validated, or a report of another engine)."""
    try:
        report = json.loads(path.read_text())
        engine = json.loads(build.read_text()).get("engine_sha256")
    except (OSError, ValueError):
        return ""
    emulation = report.get("emulation") if isinstance(report, dict) else None
    if not isinstance(emulation, dict) or report.get("passed") is not True or report.get("engine_sha256") != engine:
        return ""
    samples = report.get("samples") if isinstance(report.get("samples"), dict) else {}
    n = ", ".join(f"{k} {v}" for k, v in samples.items())
    return f"validated under emulation ({emulation.get('emulator')}, {emulation.get('cpu')}; not benchmarked; {n})"


def _failed_pair(
    registry: Registry, model: str, sku: str, record: dict[str, Any], row: dict[str, Any] | None
) -> PairOutcome:

    stage, code, message = record["stage"], int(record["exit_code"]), str(record["message"])
    if record.get("timed_out"):  # before validate's failures: its report, if any, is an older run's
        return PairOutcome(model, sku, "gate failed", code, f"{stage}: {message}", stage, manifest=row)
    if stage in ("validate", EMULATE_STAGE) and code == 1:
        failures, fix = _validate_failures(registry, model, sku, Layout(registry.root).report(model, sku, stage))
        return PairOutcome(
            model, sku, "gate failed", 1, _with_fix("; ".join(failures) or message, fix), stage, manifest=row, fix=fix
        )
    if stage == "build" and code == 1:  # the build's own gate: the reproducibility check's required verdict
        return PairOutcome(model, sku, "gate failed", 1, f"build: {message}", stage, manifest=row)
    if record.get("unsupported"):
        return PairOutcome(
            model, sku, "unsupported", code, message, stage, unsupported=record["unsupported"], manifest=row
        )
    # exit 2 from a pair's stage: its input (the golden set cannot judge the engine, say), not the engine
    kind: Outcome = (
        "publish failed"
        if stage == "publish"
        else "bad input"
        if code == 2
        else "build failed"
        if stage == "build"
        else "failed"
    )
    return PairOutcome(
        model,
        sku,
        kind,
        code,
        f"{stage}: {message}",
        stage,
        row["p50_ms"] if row and kind == "publish failed" else None,
        manifest=row,
    )


def _validate_failures(registry: Registry, model: str, sku: str, path: Path) -> tuple[list[str], str]:
    """The failure lines of validate.json and the fix its bisection points to."""
    try:
        report = json.loads(path.read_text())
        failures = report.get("failures") or []
    except (OSError, ValueError, AttributeError):
        return [], ""
    fix = (
        fix_hint(model, sku, registry.sku(sku).precision, report.get("bisection"))
        if _correctness_failed(failures)
        else ""
    )
    return [str(f) for f in failures], fix


def _correctness_failed(failures: list) -> bool:
    """A failure line of the correctness gates (placement and precision have their own fixes)."""
    return any(not str(f).startswith(("placement:", "precision:")) for f in failures)


def fix_hint(model: str, sku: str, precision: str, bisection: Any) -> str:
    """One line for a failed correctness gate: the node bisection found and the command that keeps
    it in higher precision, or the command that bisects when none ran."""
    command = f"skuforge bisect --model {model} --sku {sku}"
    if not isinstance(bisection, dict):
        return f"find the first divergent node: {command}"
    suspects = [s for s in bisection.get("suspects") or [] if isinstance(s, dict)]
    if suspects:
        s = suspects[0]
        where = f"first divergent node {s.get('node')} ({s.get('op_type')}, {s.get('cause')})"
        if precision != "fp32":
            return f"{where}: keep it in higher precision with `{command} --fix --apply`"
        return f"{where}: {bisection.get('summary')}"
    return f"bisection {bisection.get('verdict')}: {bisection.get('summary')}; rerun with `{command}`"


def _with_fix(detail: str, fix: str) -> str:
    return f"{detail}; {fix}" if fix else detail


EXIT_ORDER = (0, 1, 2, 3, 4, 70)


def worst_exit(rows: list[PairOutcome]) -> int:
    """The exit code of the worst outcome: the highest of 0 ok, 1 gate failed, 2 bad input,
    3 environment or unsupported, 4 service, 70 a bug (a signal's code counts as 3)."""
    codes = [r.exit_code if r.exit_code in EXIT_ORDER else 3 for r in rows]
    return max(codes, default=0)


def _warnings(m: Any, model: str, sku: str) -> list[tuple[str, str]]:
    """(short, long) for what a manifest passed with but should not go unseen: layers in another
    precision under a ``warn`` precision gate, an end-to-end p50 below the engine-only one."""
    out = []
    precision = m.correctness.precision
    if precision.passed and precision.mismatched_layers:
        kinds = Counter(
            layer.precision
            for layer in m.layers
            if layer.precision in COMPUTE_PRECISIONS and layer.precision != m.precision
        )
        short = ", ".join(f"{n} {k} layer{'s' if n > 1 else ''}" for k, n in sorted(kinds.items())) or (
            f"{precision.mismatched_layers} layers not {m.precision}"
        )
        out.append(
            (
                short,
                f"precision: {m.precision} asked, {short} (skus.{sku}.precision_gate.policy: {precision.policy}, "
                f"max_mismatched_layers)",
            )
        )
    if m.cache is not None and m.cache.ignored:
        names = ", ".join(m.cache.ignored)
        out.append(
            (
                f"cache ignores {names}",
                f"cache: caches/{sku}/{model} holds {names}, not in cache.json: ignored as an editor's file by its "
                "name (never read, never removed)",
            )
        )
    bm = m.benchmark
    if e2e_below_engine(bm.engine_only, bm.end_to_end):
        out.append(
            (
                "e2e p50 below engine p50",
                f"bench: end-to-end p50 {bm.end_to_end.p50_ms:g} ms below engine-only p50 "
                f"{bm.engine_only.p50_ms:g} ms: a measurement error; "
                f"rerun `skuforge bench --model {model} --sku {sku}` on a quiet runner",
            )
        )
    return out


def _cache_unused(m: Any, model: str, sku: str) -> tuple[str, str] | None:
    """(short, long) for an engine built without its checked-in compiler cache (found stale or
    corrupt, so not used): the matrix cell's note and the detail that says why and what to do."""
    short = m.cache.unused() if m.cache is not None else None
    if short is None:
        return None
    why = f": {m.cache.reason}" if m.cache.reason else ""
    return short, (
        f"{short} (caches/{sku}/{model}{why}); rebuild it: skuforge cache refresh --sku {sku} --model {model}, "
        "then commit it"
    )


def _mixed(registry: Registry, model: str, row: dict[str, Any]) -> str:
    """``mixed: 6 layers fp32, 1.7x of fp32`` for an engine built with layers kept in higher
    precision: the ratio is the p50 of the model's FP32 engine on the same backend (a passed
    manifest of another SKU) over this one's; without one, the layers alone."""
    kept = row.get("keep_precise") or []
    if not kept or row["precision"] == "fp32":
        return ""
    text = f"mixed: {len(kept)} layer{'s' if len(kept) > 1 else ''} fp32"
    out = Layout(registry.root)
    for sku in registry.skus:
        path = out.manifest(model, sku)
        if sku == row["sku"] or not path.is_file():
            continue
        try:
            other = load_manifest(path)
        except SkuforgeError:
            continue
        if other.precision == "fp32" and other.backend == row["backend"] and other.correctness.passed:
            if row["p50_ms"]:
                text += f", {other.benchmark.engine_only.p50_ms / row['p50_ms']:.2g}x of fp32"
            break
    return text


def _libraries(described: dict[str, Any]) -> str:
    """The image or audio libraries of a described preprocessing with their versions: ``opencv 5.1.0``."""
    return "+".join(f"{lib} {v}" for lib, v in described.get("versions", {}).items() if lib != "numpy")


def _manifest_row(registry: Registry, model: str, sku: str) -> dict[str, Any]:
    """The summary row of one manifest: gate results, metric deltas, latency, MLflow version."""

    out = Layout(registry.root)
    m = load_manifest(out.manifest(model, sku))
    receipt = out.report(model, sku, "publish")  # the MLflow version this checkout published
    try:
        published = json.loads(receipt.read_text()) if receipt.is_file() else {}
    except ValueError:
        published = {}
    metrics = {x.split: x for x in m.correctness.metrics}
    try:  # the build's duration is the run's, not the manifest's: read from its report
        build_s = json.loads(out.report(model, sku, "build").read_text()).get("build_seconds")
    except (OSError, ValueError, AttributeError):
        build_s = None
    return {
        "model": model,
        "sku": sku,
        "backend": m.backend,
        "precision": m.precision,
        "passed": m.correctness.passed,
        "failures": list(m.correctness.failures),
        "keep_precise": list(m.build.keep_precise),
        # what the device app computes, engine against reference: the gated statistic per postprocess
        "verdict": [f"task: {t.text()}" for t in m.correctness.task if t.threshold is not None],
        "build_s": build_s,
        "layers": len(m.layers),
        "fused_layers": sum(1 for layer in m.layers if len(layer.fused_from) > 1),
        "max_abs_error": max(
            (o.max_abs_error for o in m.correctness.outputs if o.max_abs_error is not None), default=None
        ),
        **{f"{k}_reference": v.reference for k, v in metrics.items()},
        **{f"{k}_delta": v.delta for k, v in metrics.items()},
        "p50_ms": m.benchmark.engine_only.p50_ms,
        "p99_ms": m.benchmark.engine_only.p99_ms,
        "e2e_p50_ms": m.benchmark.end_to_end.p50_ms,
        # the end-to-end calls per step (decode, preprocess, infer, postprocess): p50 ms
        **{f"e2e_{step}_ms": v.p50_ms for step, v in m.benchmark.end_to_end_steps.items()},
        "energy_j": m.benchmark.energy.joules_per_inference,
        "energy": m.benchmark.energy.source if m.benchmark.energy.available else m.benchmark.energy.reason,
        "preprocessing": {
            name: {
                "device": _libraries(p.device),
                "reference": _libraries(p.reference),
                "differing_steps": p.differing_steps,
                "max_abs_input_diff": p.max_abs_input_diff,
                "samples_differing": p.samples_differing,
                "samples": p.samples,
                "split": p.split,
                "metric_drop": p.metric_drop,
                "culprit": p.culprit,
                "gated": p.gated,
                "passed": p.passed,
            }
            for name, p in m.preprocessing.items()
        },
        "throughput_per_s": m.benchmark.throughput_per_s,
        "warnings": _warnings(m, model, sku),
        "cache": _cache_unused(m, model, sku),
        "digest": m.digest[:12],
        "mlflow": f"v{published['version']}" if published.get("digest") == m.digest else None,
        **(
            {
                "fix": fix_hint(
                    model, sku, m.precision, m.correctness.bisection.to_json() if m.correctness.bisection else None
                )
            }
            if not m.correctness.passed and _correctness_failed(m.correctness.failures)
            else {}
        ),
    }
