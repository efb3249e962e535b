"""Promotion: registry aliases moved along the chain in params.yaml (``release.aliases``) when the
gates pass, with a bounded move history on the registered model that rollback reads.

- The version to move: ``--version``; else for the first alias the newest version; for a later
  alias the version holding the alias before it.
- Every SKU's gates (and the release gate: every SKU required is present) are checked before any
  alias moves; a blocked promotion moves nothing.
- Each move is tagged with who, when, why and the previous holder; the history entry is written
  before the alias so a crash in between is finished, not repeated, by running the command again.
"""

from __future__ import annotations

import json
import logging
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pipeline.core.errors import ConfigError, GateFailed, InputError, ServiceError
from pipeline.core.io import sha256_bytes
from pipeline.core.validation import did_you_mean
from pipeline.project.config import Registry
from pipeline.results.benchstats import latency_stats, same_figure
from pipeline.results.latency import read_latency_csv
from pipeline.results.manifest import Manifest
from pipeline.results.reports import BenchReport
from pipeline.tracking.client import (
    TAG_CORRECTNESS,
    TAG_DIGEST,
    TAG_HISTORY,
    Tracking,
    actor,
    connect,
    registered_model_name,
    version_signature,
)
from pipeline.tracking.gates import (
    chain_gate,
    correctness_gate,
    engine_gate,
    manifest_gate,
    performance_gate,
    placement_gate,
    release_gate,
    signature_gate,
)
from pipeline.tracking.publish import (
    BENCH_ARTIFACT,
    ENGINE_ARTIFACTS,
    LATENCY_ARTIFACT,
    LATENCY_FILE,
    MANIFEST_ARTIFACT,
)
from pipeline.tracking.reports import GateResult, HistoryEntry, Move, PromotionReport

log = logging.getLogger(__name__)
# Gates that read the manifest's evidence: all fail when the manifest cannot be trusted.
EVIDENCE_GATES = ("manifest", "signature", "correctness", "placement", "engine", "performance")


class PromotionBlocked(GateFailed):
    """A gate failed; nothing moved. ``report`` holds every gate's result."""

    def __init__(self, report: PromotionReport):
        failed = [
            f"{m.sku}: {', '.join(g.name for g in m.gates if not g.passed)}" for m in report.moves if not m.passed
        ]
        failed += [g.name for g in report.gates if not g.passed]
        super().__init__(
            f"promotion of {report.model} to {report.alias!r} blocked ({'; '.join(failed)})",
            hint="the gate results above say why; no alias was moved",
        )
        self.report = report


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _chain_index(registry: Registry, alias: str) -> int:
    chain = registry.release.aliases
    if alias not in chain:
        raise ConfigError(
            f"unknown alias {alias!r}{did_you_mean(alias, chain)}",
            hint=f"the chain (release.aliases in params.yaml): {' -> '.join(chain)}",
        )
    return chain.index(alias)


def _why(registry: Registry, alias: str, reason: str | None, action: str) -> str:
    if reason and reason.strip():
        return reason.strip()
    if alias in registry.release.reason_required:
        raise ConfigError(
            f"moving {alias!r} needs a reason",
            hint=f'add --reason "..." (release.reason_required: {", ".join(registry.release.reason_required)})',
        )
    return f"{action} to {alias} with skuforge" if action == "promote" else f"rollback of {alias} with skuforge"


def _skus(registry: Registry, model: str, skus: list[str] | None) -> list[str]:
    registry.model(model)
    if skus is None:  # the release's SKUs the model is built for (models.<m>.skus)
        return [s for _, s in registry.pairs(models=[model], skus=registry.release_skus())]
    wanted = list(dict.fromkeys(skus))
    for sku in wanted:
        registry.sku(sku)
    return wanted


def history(registered_model: Any, alias: str) -> list[HistoryEntry]:
    raw = (registered_model.tags or {}).get(TAG_HISTORY + alias)
    if not raw:
        return []
    try:
        return [HistoryEntry.model_validate(e) for e in json.loads(raw)]
    except ValueError:
        log.warning("%s: unreadable move history of %r ignored", registered_model.name, alias)
        return []


def _download(tracking: Tracking, run_id: str | None, path: str, into: str) -> Path | None:
    """An artifact (file or folder) of a run downloaded under ``into``; None when it does not exist."""
    if not run_id:
        return None
    try:
        local = tracking.call(
            f"download {path} of run {run_id}",
            tracking.client.download_artifacts,
            run_id,
            path,
            into,
            expect={"RESOURCE_DOES_NOT_EXIST"},
        )
    except Exception as exc:
        if getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    local = Path(local)
    return local if local.exists() else None


def _download_text(tracking: Tracking, run_id: str | None, path: str) -> str | None:
    with tempfile.TemporaryDirectory(prefix="skuforge-promote-") as tmp:
        local = _download(tracking, run_id, path, tmp)
        return local.read_text(encoding="utf-8") if local is not None and local.is_file() else None


def _manifest(tracking: Tracking, run_id: str | None) -> dict | None:
    text = _download_text(tracking, run_id, MANIFEST_ARTIFACT)
    try:
        doc = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _bench(tracking: Tracking, run_id: str | None) -> BenchReport | None:
    """The run's bench.json, or None when it is missing or unreadable."""
    try:
        return BenchReport.model_validate_json(_download_text(tracking, run_id, BENCH_ARTIFACT) or "")
    except ValueError:  # not JSON, not UTF-8, not a bench report
        return None


def _samples(
    tracking: Tracking, run_id: str | None, manifest: dict | None, bench: BenchReport | None
) -> tuple[list[float] | None, str | None]:
    """Latency samples of a run, checked against its manifest and its ``bench`` report: (samples, problem).

    Schema 5: the run's bench.json must be about the manifest's engine, latency.csv must be the
    samples bench.json names, and the median recomputed from them must be the manifest's p50
    (their intervals overlap). Older manifests named the samples' sha256 themselves."""
    evidence = (manifest or {}).get("evidence") or {}
    with tempfile.TemporaryDirectory(prefix="skuforge-promote-") as tmp:
        local = _download(tracking, run_id, LATENCY_ARTIFACT, tmp)
        if local is None or not local.is_file():
            return None, None
        data = local.read_bytes()
    if LATENCY_FILE in (evidence.get("files") or {}):
        expected = evidence["files"][LATENCY_FILE]
    else:
        if bench is None:
            return None, f"the bench report of run {run_id} is missing or unreadable: its samples cannot be trusted"
        if bench.engine_sha256 != evidence.get("engine_sha256"):
            return None, f"the bench report of run {run_id} is about another engine than its manifest"
        expected = bench.latency_sha256
    if sha256_bytes(data) != expected:
        return None, (
            f"the latency samples of run {run_id} are not the ones its bench report and manifest recorded "
            f"(sha256 {sha256_bytes(data)[:12]}, expected {(expected or 'nothing')[:12]})"
        )
    try:
        samples = read_latency_csv(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None, f"the latency samples of run {run_id} are unreadable"
    if LATENCY_FILE not in (evidence.get("files") or {}):
        problem = _samples_match_manifest(samples, manifest)
        if problem:
            return None, f"run {run_id}: {problem}"
    return samples, None


def _samples_match_manifest(samples: list[float], manifest: dict | None) -> str | None:
    """The p50 recomputed from the samples against the manifest's (recomputed, never read from a report)."""
    if not samples:
        return "no latency samples"
    try:
        recorded = Manifest.model_validate(manifest).benchmark.engine_only
    except ValueError:
        return "the manifest's benchmark is unreadable"
    stats = latency_stats(samples)
    for q in ("p50", "p99"):
        mine, theirs = getattr(stats, f"{q}_ms"), getattr(recorded, f"{q}_ms")
        if not same_figure(theirs, getattr(recorded, f"{q}_ci_ms"), mine, getattr(stats, f"{q}_ci_ms")):
            return (
                f"the latency samples' {q} {mine:.4g} ms is not the manifest's {theirs:.4g} ms "
                f"(interval {getattr(recorded, f'{q}_ci_ms')})"
            )
    return None


def _version(tracking: Tracking, name: str, version: str):
    try:
        return tracking.call(
            f"read version {version} of {name}",
            tracking.client.get_model_version,
            name,
            version,
            expect={"RESOURCE_DOES_NOT_EXIST"},
        )
    except Exception as exc:
        if getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def _source(tracking: Tracking, registry: Registry, rm: Any, name: str, index: int, version: str | None):
    """The version to move, or (None, why)."""
    if rm is None:
        return None, "never published"
    if version is not None:
        found = _version(tracking, name, version)
        if found is None:
            raise InputError(
                f"{name} has no version {version}", hint="skuforge releases --model MODEL lists the versions"
            )
        return found, ""
    if index == 0:
        versions = tracking.call(
            f"search versions of {name}", tracking.client.search_model_versions, f"name = '{name}'"
        )
        if not versions:
            return None, "no version"
        return max(versions, key=lambda v: int(v.version)), ""
    before = registry.release.aliases[index - 1]
    holder = (rm.aliases or {}).get(before)
    if holder is None:
        return None, f"no version holds {before!r}"
    found = _version(tracking, name, str(holder))
    return (found, "") if found is not None else (None, f"version {holder} holding {before!r} is gone")


def _engine_files(tracking: Tracking, run_id: str, into: str) -> dict[str, Path] | None:
    local = _download(tracking, run_id, ENGINE_ARTIFACTS, into)
    if local is None or not local.is_dir():
        return None
    return {p.relative_to(local).as_posix(): p for p in local.rglob("*") if p.is_file()}


def _gates(
    tracking: Tracking, registry: Registry, alias: str, rm: Any, src: Any, incumbent: str | None
) -> list[GateResult]:
    """Every gate of one SKU's move, recomputed from what the store holds (fail closed)."""
    holds = [a for a, v in (rm.aliases or {}).items() if str(v) == str(src.version)]
    tags = src.tags or {}
    gates = [chain_gate(registry.release.aliases, alias, str(src.version), holds)]
    doc = _manifest(tracking, src.run_id)
    if doc is None:
        missing = f"the manifest artifact of run {src.run_id} is missing or not JSON"
        return gates + [GateResult(name=n, passed=False, detail=missing) for n in EVIDENCE_GATES]
    bench = _bench(tracking, src.run_id)
    gate = manifest_gate(doc, tags.get(TAG_DIGEST), registry, bench)
    gates.append(gate)
    if not gate.passed:
        return gates + [
            GateResult(name=n, passed=False, detail="the manifest cannot be trusted (see the manifest gate)")
            for n in EVIDENCE_GATES
            if n != "manifest"
        ]
    m = Manifest.model_validate(doc)
    signature = version_signature(tags)
    gates += [
        signature_gate(signature, m, alias, registry),
        correctness_gate(m, registry, tags.get(TAG_CORRECTNESS)),
        placement_gate(m, registry),
    ]
    with tempfile.TemporaryDirectory(prefix="skuforge-promote-") as tmp:
        gates.append(engine_gate(m, _engine_files(tracking, src.run_id, tmp), f"run {src.run_id}/{ENGINE_ARTIFACTS}"))
    candidate, problem = _samples(tracking, src.run_id, doc, bench)
    if problem:
        gates.append(GateResult(name="performance", passed=False, detail=problem))
        return gates
    incumbent_samples = None
    if incumbent is not None:
        holder = _version(tracking, rm.name, incumbent)
        held = _manifest(tracking, holder.run_id) if holder else None
        held_run = holder.run_id if holder else None
        incumbent_samples, problem = _samples(tracking, held_run, held, _bench(tracking, held_run))
        if problem:
            log.warning(
                "%s: %s; the latency comparison treats version %s as having no samples", rm.name, problem, incumbent
            )
    gates.append(performance_gate(candidate, incumbent_samples, incumbent, alias, registry.release.performance))
    return gates


def _record(
    tracking: Tracking,
    registry: Registry,
    name: str,
    alias: str,
    entry: HistoryEntry | None,
    version: str | None,
    when: str,
    who: str,
    why: str,
    previous: str | None,
    action: str,
) -> None:
    """Write the history entry (when new), then move the alias, then tag the version."""
    client = tracking.client
    if entry is not None:
        rm = tracking.call(f"read registered model {name!r}", client.get_registered_model, name)
        entries = history(rm, alias)
        last = entries[-1] if entries else None
        if not (last and (last.action, last.version, last.previous) == (entry.action, entry.version, entry.previous)):
            entry = entry.model_copy(update={"id": (last.id + 1) if last else 1})
            entries = (entries + [entry])[-registry.release.history :]
            tracking.call(
                f"record the move of {alias!r} on {name}",
                client.set_registered_model_tag,
                name,
                TAG_HISTORY + alias,
                json.dumps([e.to_json() for e in entries]),
            )
    if version is None:
        tracking.call(f"remove alias {alias!r} of {name}", client.delete_registered_model_alias, name, alias)
    else:
        tracking.call(
            f"move alias {alias!r} of {name} to version {version}",
            client.set_registered_model_alias,
            name,
            alias,
            version,
        )
        tracking.call(
            f"tag version {version} of {name}",
            client.set_model_version_tag,
            name,
            version,
            f"skuforge.{action}.{alias}",
            json.dumps({"who": who, "when": when, "why": why, "previous": previous}),
        )


def _apply(
    tracking: Tracking, registry: Registry, report: PromotionReport, entries: dict[str, HistoryEntry | None]
) -> None:
    done: list[str] = []
    try:
        for move in report.moves:
            if move.already:
                continue
            _record(
                tracking,
                registry,
                move.registered_model,
                report.alias,
                entries.get(move.sku),
                move.version,
                report.when,
                report.who,
                report.why,
                move.previous,
                report.action,
            )
            move.moved = True
            done.append(move.sku)
            log.debug("%s: %s -> version %s (was %s)", move.registered_model, report.alias, move.version, move.previous)
    except ServiceError as exc:
        left = [m.sku for m in report.moves if not m.moved and not m.already]
        raise ServiceError(
            f"{exc.message}; moved: {', '.join(done) or 'none'}; not moved: {', '.join(left)}",
            hint="run the same command again: SKUs already moved are skipped",
        ) from exc


def promote(
    registry: Registry,
    model: str,
    alias: str,
    skus: list[str] | None = None,
    version: str | None = None,
    reason: str | None = None,
    tracking: Tracking | None = None,
    who: str | None = None,
) -> PromotionReport:
    """Move ``alias`` to the next version on each SKU (``skus=None``: every SKU the release requires)."""
    index = _chain_index(registry, alias)
    wanted = _skus(registry, model, skus)
    if version is not None and len(wanted) != 1:
        raise ConfigError("--version names a version of one registered model", hint="use it with one --sku")
    why = _why(registry, alias, reason, "promote")
    tracking = tracking or connect(registry)
    who, when = who or actor(), _now()
    moves: list[Move] = []
    missing: dict[str, str] = {}
    entries: dict[str, HistoryEntry | None] = {}
    for sku in wanted:
        name = registered_model_name(registry.release, model, sku)
        rm = tracking.get_registered_model(name)
        src, why_missing = _source(tracking, registry, rm, name, index, version)
        incumbent = None if rm is None else (rm.aliases or {}).get(alias)
        incumbent = None if incumbent is None else str(incumbent)
        if src is None:
            missing[sku] = why_missing
            moves.append(Move(sku=sku, registered_model=name, version=None, previous=incumbent))
            continue
        target = str(src.version)
        move = Move(
            sku=sku,
            registered_model=name,
            version=target,
            previous=incumbent,
            digest=(src.tags or {}).get(TAG_DIGEST),
            already=incumbent == target,
        )
        if not move.already:
            move.gates = _gates(tracking, registry, alias, rm, src, incumbent)
            entries[sku] = HistoryEntry(
                id=0, action="promote", version=target, previous=incumbent, who=who, when=when, why=why
            )
        moves.append(move)
    present = [m.sku for m in moves if m.version is not None]
    gate = release_gate(wanted, present, missing)
    report = PromotionReport(
        model=model,
        alias=alias,
        action="promote",
        tracking_uri=tracking.display,
        who=who,
        when=when,
        why=why,
        gates=[gate],
        moves=moves,
        passed=gate.passed and all(m.passed for m in moves),
    )
    if not report.passed:
        raise PromotionBlocked(report)
    _apply(tracking, registry, report, entries)
    return report


def rollback(
    registry: Registry,
    model: str,
    alias: str,
    skus: list[str] | None = None,
    reason: str | None = None,
    tracking: Tracking | None = None,
    who: str | None = None,
) -> PromotionReport:
    """Move ``alias`` back to the version it had before its last recorded promotion (no gates:
    that version passed them when it was promoted)."""
    _chain_index(registry, alias)
    wanted = _skus(registry, model, skus)
    why = _why(registry, alias, reason, "rollback")
    tracking = tracking or connect(registry)
    who, when = who or actor(), _now()
    moves: list[Move] = []
    entries: dict[str, HistoryEntry | None] = {}
    problems: list[str] = []
    for sku in wanted:
        name = registered_model_name(registry.release, model, sku)
        rm = tracking.get_registered_model(name)
        if rm is None:
            problems.append(f"{sku}: never published")
            continue
        current = (rm.aliases or {}).get(alias)
        current = None if current is None else str(current)
        entries_ = history(rm, alias)
        last = entries_[-1] if entries_ else None
        if last and last.action == "rollback" and last.previous == current and last.version != current:
            target, entry = last.version, None  # a rollback recorded but not applied: finish it
        else:
            reverted = {e.reverts for e in entries_ if e.reverts is not None}
            undo = next((e for e in reversed(entries_) if e.action == "promote" and e.id not in reverted), None)
            if undo is None:
                problems.append(f"{sku}: no recorded move of {alias!r} left to roll back")
                continue
            if undo.version != current:
                problems.append(
                    f"{sku}: {alias!r} is on version {current}, but the last recorded move put version "
                    f"{undo.version} there (moved outside skuforge?)"
                )
                continue
            target = undo.previous
            entry = HistoryEntry(
                id=0, action="rollback", version=target, previous=current, who=who, when=when, why=why, reverts=undo.id
            )
        entries[sku] = entry
        moves.append(Move(sku=sku, registered_model=name, version=target, previous=current))
    if problems:
        raise InputError(
            f"cannot roll back {alias!r} of {model}: " + "; ".join(problems),
            hint="move the alias explicitly: skuforge promote --model MODEL --sku SKU --to ALIAS --version N",
        )
    report = PromotionReport(
        model=model,
        alias=alias,
        action="rollback",
        tracking_uri=tracking.display,
        who=who,
        when=when,
        why=why,
        moves=moves,
        passed=True,
    )
    _apply(tracking, registry, report, entries)
    return report
