"""``skuforge repro`` as one library call: render the per-SKU pipelines, pick what this host builds,
run ``dvc repro`` (keep going), then the matrix of every pair, the consistency reports, the
selection records and, for a run over every SKU, their publication to MLflow.

The CLI parses its flags, calls :func:`reproduce` once and renders the :class:`ReproResult`; the
lines a user wants while it runs (what is skipped and why, what is stale, what was written) go to
``say`` as they happen. Python callers get the same result without a process."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.env import MLFLOW_LOGGING_LEVEL
from pipeline.core.errors import EnvironmentProblem, SkuforgeError
from pipeline.engine.matrix import PairOutcome, SkuStatus, matrix, sku_statuses, worst_exit
from pipeline.ops.pipelines import hide_from_dvc, move_pair_locks, render_pipelines
from pipeline.ops.repro import DvcFailed, ProjectStatus, clear_outcomes, run_dvc_repro, targets, upstream_stages
from pipeline.project.config import Registry
from pipeline.results.selection import SelectionRecord
from pipeline.tracking.client import connect, require_mlflow
from pipeline.tracking.reports import SelectionPublishResult
from pipeline.tracking.selection import publish_selection
from pipeline.verify.consistency import refresh_lines, refresh_reports
from pipeline.verify.selection import refresh_selections

Say = Callable[[str], None]


def _silent(line: str) -> None:
    """The default ``say``: a library caller reads the result instead."""


@dataclass
class ReproResult:
    """What one ``repro`` did. ``dry``: nothing ran, ``stale`` says what would; otherwise ``rows``
    is the matrix of every (model, SKU) asked for, ``exit_code`` the command's."""

    targets: list[str]
    skipped: list[SkuStatus]
    dry: bool = False
    stale: list[str] | None = None
    changes: dict[str, Any] | None = None  # dvc status's reasons per stale stage (dry runs)
    rows: list[PairOutcome] = field(default_factory=list)
    dvc_failure: DvcFailed | None = None
    consistency: dict[str, Any] = field(default_factory=dict)
    selected: dict[str, SelectionRecord | str] = field(default_factory=dict)
    exit_code: int = 0

    @property
    def records(self) -> list[SelectionRecord]:
        """The selection records written (a model without one has the reason in ``selected``)."""
        return [r for r in self.selected.values() if isinstance(r, SelectionRecord)]

    def dry_json(self) -> dict[str, Any]:
        return {"targets": self.targets, "skipped": [s.to_json() for s in self.skipped], "stale": self.stale}

    def to_json(self) -> dict[str, Any]:
        return {
            "targets": self.targets,
            "skipped": [s.to_json() for s in self.skipped],
            "matrix": [r.to_json() for r in self.rows],
            "consistency": self.consistency,
            "selection": {m: r.to_json() if isinstance(r, SelectionRecord) else r for m, r in self.selected.items()},
            "exit_code": self.exit_code,
        }


def reproduce(
    registry: Registry,
    models: list[str] | None = None,
    skus: list[str] | None = None,
    *,
    force: bool = False,
    dry: bool = False,
    publish: bool = True,
    say: Say = _silent,
) -> ReproResult:
    """Run what this host can build of ``models`` x ``skus`` (None: all) through DVC and report every
    pair. ``publish``: the pairs' publish stages run, and a run over every SKU records the selection
    in MLflow. EnvironmentProblem when SKUs asked for by name are none this host can build."""
    render_pipelines(registry)  # dvc reads them next: current for this registry (a no-op when they are)
    move_pair_locks(registry)  # a project built before pipelines/ keeps its runs
    status = None if force else ProjectStatus(registry.root)  # runs while the host is checked
    statuses = sku_statuses(registry)
    _, host_filter_changed = hide_from_dvc(registry, statuses)
    if status is not None and host_filter_changed:  # DVC sees other stages now: ask again
        status.cancel()
        status = ProjectStatus(registry.root)
    dvc_targets, skipped = targets(registry, models, skus, publish=publish, statuses=statuses)
    for s in skipped:
        labels = ", ".join(s.runner_labels)
        if s.emulated:
            say(
                f"validating SKU {s.sku} under emulation only (QEMU: outputs, not timings); its runner with labels "
                f"[{labels}] validates, benches and publishes it"
            )
            continue
        what = "building only (validate and bench need the target)" if s.buildable else "skipping"
        say(f"{what} SKU {s.sku}: {'; '.join(s.problems)}; needs a runner with labels [{labels}]")
    result = ReproResult(targets=dvc_targets, skipped=skipped, dry=dry)
    if not dvc_targets:
        if skus:  # asked for by name (a CI job for one SKU): building nothing is not success
            raise EnvironmentProblem(
                f"this host can build none of the SKUs asked for: {', '.join(skus)}",
                hint="run it on a runner with "
                + "; ".join(f"labels [{', '.join(s.runner_labels)}] for {s.sku}" for s in skipped if s.sku in skus)
                + " (skuforge skus --buildable-here lists what this host can build)",
            )
        say("nothing this host can build")
        return result
    result.stale = None if status is None else status.stale(upstream_stages(registry, dvc_targets))
    _run(registry, result, status, force, say)
    if dry:
        return result
    _report(registry, result, models, [s for s in statuses if not skus or s.sku in skus], say)
    # a run over every SKU (not a CI job's --sku) records the choice in MLflow, as the pairs' publish stages did
    published = _publish_selections(registry, result.records, say) if publish and not skus else 0
    failed = result.dvc_failure
    result.exit_code = max(worst_exit(result.rows), failed.exit_code if failed else 0, result.exit_code, published)
    return result


def _run(registry: Registry, result: ReproResult, status: ProjectStatus | None, force: bool, say: Say) -> None:
    """dvc repro of the targets, unless nothing is stale; a dry run says what would run instead."""
    if not result.dry:
        clear_outcomes(registry, result.targets)  # this run records again what still fails
    if result.stale == []:
        say("Data and pipelines are up to date.")
        return
    if result.dry and result.stale is not None:  # the one status call answers: no second dvc run
        result.changes = status.changes() if status is not None else None
        for name in result.stale:
            say(f"{name}: {_changed(result.changes[name] if result.changes else [])}")
        say("(and every stage downstream of these)")
        return
    try:
        run_dvc_repro(registry.root, result.targets, force=force, dry=result.dry, keep_going=True)
    except DvcFailed as exc:
        if result.dry:
            raise
        result.dvc_failure = exc  # the matrix says which pairs and why


def _report(
    registry: Registry, result: ReproResult, models: list[str] | None, statuses: list[SkuStatus], say: Say
) -> None:
    """The matrix of every pair asked for, then the consistency reports and selection records."""
    failed = result.dvc_failure
    try:
        result.rows = matrix(registry, models, [s.sku for s in statuses], statuses)
    except SkuforgeError:
        if failed is not None:  # no matrix to show (the registry broke meanwhile): dvc's failure says why
            raise failed from None
        raise
    if failed is not None and not failed.stage_failed:  # dvc itself, or something from outside
        say(f"skuforge: error: {failed}")
    try:
        result.consistency = refresh_reports(registry, models)
    except SkuforgeError as exc:  # a read-only reports/ folder, say: the matrix still shows
        say(f"skuforge: error: consistency reports not written: {exc}")
        result.exit_code = exc.exit_code
    for line in refresh_lines(result.consistency):
        say(line)
    try:
        result.selected = refresh_selections(registry, models)
    except SkuforgeError as exc:  # a read-only build/ folder, say
        say(f"skuforge: error: selection records not written: {exc}")
    for model, record in result.selected.items():
        if not isinstance(record, SelectionRecord):
            say(f"selection {model}: not written: {record}")


def _publish_selections(registry: Registry, records: list[SelectionRecord], say: Say) -> int:
    """Publish each written selection record (pipeline/tracking/selection.py); a failure is said and is
    the exit code (the matrix still shows)."""
    worst = 0
    for record in records:
        try:
            say(publish_record(registry, record).line())
        except SkuforgeError as exc:
            say(f"skuforge: error: selection of {record.model} not published: {exc}")
            worst = max(worst, exc.exit_code)
    return worst


def publish_record(registry: Registry, record: SelectionRecord) -> SelectionPublishResult:
    """Record ``record`` in MLflow (``select --publish``, and ``repro`` after it writes the records)."""
    MLFLOW_LOGGING_LEVEL.setdefault("WARNING")  # MLflow's INFO lines (store migrations) off the user's stderr
    require_mlflow()
    return publish_selection(connect(registry), registry, record)


def _changed(entries: list[Any]) -> str:
    """dvc status's reasons for one stage on one line: ``changed deps: build/config/a.json (modified)``."""
    parts = []
    for entry in entries:
        if isinstance(entry, dict):
            for what, files in entry.items():
                shown = ", ".join(f"{f} ({c})" for f, c in files.items()) if isinstance(files, dict) else str(files)
                parts.append(f"{what}: {shown}")
        else:
            parts.append(str(entry))
    return "; ".join(parts) or "changed"
