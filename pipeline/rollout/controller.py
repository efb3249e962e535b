"""Rollouts: one release of a model moving over the fleet in waves, gated by device health.

The rollout document (``rollouts/<model>.json``) is a signed TUF target, so devices act only on a
state CI signed, and an older state replayed to them is refused. Every transition is one commit
(compare-and-swap on the store's timestamp): two CI jobs advancing at once cannot both move a
wave; the loser re-reads, finds the wave already moved, and does nothing. The document logs every
transition with who, when and why.

Devices report to ``reports/<model>/<rollout>/<outcome>/<device>.json``: counting the reports of
each outcome is a listing, not a read per device. Gates (``rollout.gates``) are recomputed from the
reports at each ``advance``: failure rate (any outcome but ``ok``) with a minimum number of reports,
smoke-test failures, and the median latency ratio new/previous engine measured on the devices. A
failed gate rolls the rollout back at once (every device returns to the previous release).
"""

from __future__ import annotations

import json
import logging
import random
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

from pydantic import Field

from pipeline.core.errors import ConfigError, InputError
from pipeline.project.config import HealthGates, Registry, Wave
from pipeline.results.reports import Result
from pipeline.rollout import trust
from pipeline.rollout.plan import included, plan
from pipeline.rollout.release import RELEASE_DOC, release_path, releases_of
from pipeline.rollout.store import Store

log = logging.getLogger(__name__)

ROLLOUTS = "rollouts"
REPORTS = "reports"
Status = Literal["active", "paused", "completed", "aborted", "rolled_back"]
Outcome = Literal["ok", "fallback", "smoke_failed", "incompatible", "verify_failed", "error"]
OUTCOMES: tuple[str, ...] = ("ok", "fallback", "smoke_failed", "incompatible", "verify_failed", "error")
FAILURES = ("smoke_failed", "verify_failed", "error")  # the release (or the store) is at fault
DEGRADED = ("fallback", "incompatible")  # the device cannot run its SKU's engine: it runs the portable one, or nothing
LIVE = ("active", "paused")
LATENCY_SAMPLE = 400  # ok reports read for the latency gate (a median needs no more)


class Transition(Result):
    at: str
    actor: str
    action: str
    status: str = Field(description="status after the transition")
    wave: int
    reason: str


class RolloutDoc(Result):
    """The signed rollout state devices follow."""

    schema_version: Literal[1] = 1
    id: str
    model: str
    release: str
    previous: str | None = Field(description="the release devices return to on rollback (null: the first release)")
    status: Status
    wave: int = Field(
        description="index of the current wave; devices included by it or an earlier one take the release"
    )
    wave_started: str
    started: str
    waves: list[Wave]
    gates: HealthGates
    planned: list[int] | None = Field(
        None, description="devices included up to each wave (from the inventory at start)"
    )
    log: list[Transition] = Field(default_factory=list)


class GateCheck(Result):
    name: str
    passed: bool | None = Field(description="null: not enough evidence yet")
    detail: str


class Health(Result):
    reports: int
    counts: dict[str, int]
    failure_rate: float | None
    latency_ratio_median: float | None
    latency_samples: int
    gates: list[GateCheck]


class RolloutStatus(Result):
    rollout: RolloutDoc | None
    health: Health | None
    bake_left_minutes: float | None
    action: str = Field(description="what advance did or would do")
    reason: str


def rollout_path(model: str) -> str:
    return f"{ROLLOUTS}/{model}.json"


def report_prefix(model: str, rollout_id: str) -> str:
    return f"{REPORTS}/{model}/{rollout_id}"


def report_key(model: str, rollout_id: str, outcome: str, device_id: str) -> str:
    return f"{report_prefix(model, rollout_id)}/{outcome}/{device_id}.json"


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def _iso(t: datetime) -> str:
    return t.isoformat()


def desired_release(doc: dict | RolloutDoc | None, device_id: str, ring: str | None) -> tuple[str | None, str]:
    """The release a device should run under this rollout, and why (None: leave it as it is)."""
    if doc is None:
        return None, "no rollout"
    d = doc if isinstance(doc, RolloutDoc) else RolloutDoc.model_validate(doc)
    if d.status == "rolled_back":
        return d.previous, f"rollout {d.id} rolled back"
    if included(d.waves, d.wave, d.id, device_id, ring):
        return d.release, f"in wave {d.waves[d.wave].name} of {d.id}"
    if d.status == "completed":  # every wave ran: a device a ring wave never named stays where it is
        return None, f"{d.id} completed without including this device"
    return d.previous, f"not yet in a wave of {d.id}"


# --- reading ----------------------------------------------------------------------------------------


def read_doc(store: Store, state: trust.State, model: str) -> RolloutDoc | None:
    data = trust.read_target(store, state, rollout_path(model))
    return None if data is None else RolloutDoc.model_validate_json(data)


def models_with_rollouts(state: trust.State) -> list[str]:
    prefix = f"{ROLLOUTS}/"
    return sorted(
        p[len(prefix) : -len(".json")]
        for p in state.targets.signed.targets
        if p.startswith(prefix) and p.endswith(".json") and "/" not in p[len(prefix) :]
    )


def health(store: Store, doc: RolloutDoc, now: datetime | None = None) -> Health:
    """Counts per outcome (listings only), a sample of latency ratios, and each gate's verdict."""
    counts = {o: 0 for o in OUTCOMES}
    ok_keys: list[str] = []
    prefix = report_prefix(doc.model, doc.id)
    for key in store.list(prefix):
        parts = key[len(prefix) + 1 :].split("/")
        if len(parts) != 2 or parts[0] not in counts:
            continue
        counts[parts[0]] += 1
        if parts[0] == "ok":
            ok_keys.append(key)
    total = sum(counts.values())
    ratios = []
    for key in random.Random(doc.id).sample(ok_keys, min(len(ok_keys), LATENCY_SAMPLE)):
        blob = store.get(key)
        try:
            ratio = json.loads(blob.data).get("latency_ratio") if blob is not None else None
        except ValueError:
            ratio = None
        if isinstance(ratio, (int, float)) and ratio > 0:
            ratios.append(float(ratio))
    g = doc.gates
    failed = sum(counts[o] for o in FAILURES)
    degraded = sum(counts[o] for o in DEGRADED)
    rate = failed / total if total else None
    need = g.min_reports
    if doc.planned is not None:
        need = min(need, doc.planned[doc.wave])
    median = sorted(ratios)[len(ratios) // 2] if ratios else None

    def share(count: int, limit: float) -> bool | None:
        if total == 0:
            return True if need == 0 else None  # a wave planned empty has nothing to judge
        return None if total < need else count / total <= limit

    gates = [
        GateCheck(name="reports", passed=True if total >= need else None, detail=f"{total} reports, {need} needed"),
        GateCheck(
            name="failure_rate",
            passed=share(failed, g.max_failure_rate),
            detail=f"{failed}/{total} failed"
            + (f" ({rate:.1%}, max {g.max_failure_rate:.1%})" if total else "")
            + "".join(f", {o} {n}" for o, n in counts.items() if n and o != "ok"),
        ),
        GateCheck(
            name="fallback_rate",
            passed=share(degraded, g.max_fallback_rate),
            detail=f"{degraded}/{total} on the portable fallback or unserved"
            + (f" ({degraded / total:.1%}, max {g.max_fallback_rate:.1%})" if total else ""),
        ),
        GateCheck(
            name="smoke_tests",
            passed=counts["smoke_failed"] <= g.max_smoke_failures,
            detail=f"{counts['smoke_failed']} smoke-test failures (max {g.max_smoke_failures})",
        ),
        GateCheck(
            name="latency",
            passed=(True if doc.previous is None else None)
            if median is None
            else median <= 1 + g.max_latency_regression,
            detail=(
                "first release: no previous engine to compare with"
                if doc.previous is None
                else "no device measured both engines yet"
            )
            if median is None
            else f"median new/previous latency {median:.3f} over {len(ratios)} devices "
            f"(max {1 + g.max_latency_regression:.2f})",
        ),
    ]
    return Health(
        reports=total,
        counts=counts,
        failure_rate=rate,
        latency_ratio_median=median,
        latency_samples=len(ratios),
        gates=gates,
    )


def _bake_left(doc: RolloutDoc, now: datetime) -> float:
    started = datetime.fromisoformat(doc.wave_started)
    return max(0.0, (started + timedelta(minutes=doc.waves[doc.wave].bake_minutes) - now).total_seconds() / 60)


# --- transitions ------------------------------------------------------------------------------------


def _write(
    store: Store, keys: trust.Keys, registry: Registry, model: str, decide, what: str
) -> tuple[RolloutDoc | None, str, str]:
    """Commit the document ``decide(current_doc, state)`` returns as (doc or None, action, reason)."""
    outcome: dict[str, Any] = {}

    def change(targets, state) -> bool:
        current = read_doc(store, state, model)
        doc, action, reason = decide(current, state)
        outcome.update(doc=doc or current, action=action, reason=reason)
        if doc is None:
            return False
        data = doc.model_dump_json(indent=2).encode()
        trust.put_blob(store, data)
        trust.add_target(targets, rollout_path(model), data, {"model": model, "rollout": doc.id})
        return True

    trust.commit(store, keys, registry.rollout.expiry, change, what=what)
    return outcome["doc"], outcome["action"], outcome["reason"]


def _log(doc: RolloutDoc, actor: str, action: str, reason: str, now: datetime) -> None:
    doc.log.append(
        Transition(at=_iso(now), actor=actor, action=action, status=doc.status, wave=doc.wave, reason=reason)
    )


def start(
    registry: Registry,
    store: Store,
    keys: trust.Keys,
    model: str,
    release: str | None = None,
    inventory=None,
    actor: str = "unknown",
    reason: str = "",
    now: datetime | None = None,
) -> RolloutDoc:
    """Begin rolling ``release`` (default: the newest) out; refused while another rollout of the
    model is live. With ``inventory``, the plan (salted by the rollout id, as devices compute it)
    sizes each wave's minimum report count."""

    registry.model(model)
    now = now or _now()

    def decide(current: RolloutDoc | None, state: trust.State):
        released = releases_of(state.targets.signed, model)
        if not released:
            raise InputError(f"the store has no release of {model}", hint=f"skuforge release publish --model {model}")
        target = release or released[-1]
        if target not in released:
            raise InputError(f"{model} has no release {target!r} in the store", hint=f"releases: {', '.join(released)}")
        if current is not None and current.status in LIVE:
            raise ConfigError(
                f"rollout {current.id} of {model} is {current.status}",
                hint="advance it to completion, or abort or roll it back first",
            )
        previous = None
        if current is not None:  # what the fleet runs now
            # a release aborted by a failed gate is not one to return to (devices it reached keep
            # it until a wave of the new rollout includes them); one an operator halted may be
            failed = any(t.action == "auto-abort" for t in current.log if t.at >= current.started)
            previous = {
                "completed": current.release,
                "rolled_back": current.previous,
                "aborted": current.previous if failed else current.previous or current.release,
            }[current.status]
        if previous == target:
            raise ConfigError(f"{model} {target} is already what the fleet runs", hint="publish a new release first")
        n = sum(1 for _ in current.log if _.action == "start") if current else 0
        rid = f"{model}-{target}-{now.strftime('%Y%m%d%H%M%S')}-{n}"
        planned = None
        if inventory is not None:
            data = trust.read_target(store, state, release_path(model, target, RELEASE_DOC))
            assert data is not None  # target is one of the releases these targets list
            doc_skus = json.loads(data)["skus"]
            p = plan(inventory, registry.rollout.waves, rid, list(doc_skus), registry.rollout.fallback_sku)
            planned = [w.devices for w in p.waves]
        doc = RolloutDoc(
            id=rid,
            model=model,
            release=target,
            previous=previous,
            status="active",
            wave=0,
            wave_started=_iso(now),
            started=_iso(now),
            waves=registry.rollout.waves,
            gates=registry.rollout.gates,
            planned=planned,
            log=list(current.log[-50:]) if current else [],
        )
        _log(doc, actor, "start", reason or f"roll {target} out over {len(doc.waves)} waves", now)
        return doc, "start", f"started {doc.id}"

    doc, _, _ = _write(store, keys, registry, model, decide, f"rollout start {model}")
    assert doc is not None  # decide starts one or raises
    return doc


def advance(
    registry: Registry, store: Store, keys: trust.Keys, model: str, actor: str = "unknown", now: datetime | None = None
) -> RolloutStatus:
    """Check the gates of the live wave: roll back when one fails, move to the next wave when the
    bake time is over and every gate passed, else do nothing (and say why)."""
    now = now or _now()
    observed: dict[str, Any] = {}

    def decide(current: RolloutDoc | None, state: trust.State):
        if current is None or current.status != "active":
            return (
                None,
                "none",
                f"no active rollout of {model}" + (f" ({current.id} is {current.status})" if current else ""),
            )
        h = health(store, current, now)
        observed["health"] = h
        failed = [g for g in h.gates if g.passed is False]
        doc = current.model_copy(deep=True)
        if failed:
            why = "; ".join(f"{g.name}: {g.detail}" for g in failed)
            if current.previous is None:  # nothing older to return to: halt where it is
                doc.status = "aborted"
                _log(
                    doc,
                    actor,
                    "auto-abort",
                    f"gate failed in wave {doc.waves[doc.wave].name} and there is no "
                    f"previous release to return to: {why}",
                    now,
                )
                return doc, "aborted", why
            doc.status = "rolled_back"
            _log(doc, actor, "auto-rollback", f"gate failed in wave {doc.waves[doc.wave].name}: {why}", now)
            return doc, "rolled_back", why
        left = _bake_left(current, now)
        if left > 0:
            return None, "wait", f"wave {current.waves[current.wave].name} bakes {left:.0f} more minutes"
        pending = [g for g in h.gates if g.passed is None]
        if pending:
            return None, "wait", "not enough evidence: " + "; ".join(g.detail for g in pending)
        if current.wave + 1 >= len(current.waves):
            doc.status = "completed"
            _log(doc, actor, "complete", f"every wave healthy ({h.reports} reports)", now)
            return doc, "completed", f"{current.release} reached every wave"
        doc.wave += 1
        doc.wave_started = _iso(now)
        _log(
            doc,
            actor,
            "advance",
            f"wave {current.waves[current.wave].name} healthy: " + "; ".join(g.detail for g in h.gates),
            now,
        )
        return doc, "advanced", f"now in wave {doc.waves[doc.wave].name}"

    doc, action, reason = _write(store, keys, registry, model, decide, f"rollout advance {model}")
    trust.refresh_timestamp(store, keys, registry.rollout.expiry)
    return RolloutStatus(
        rollout=doc,
        health=observed.get("health"),
        bake_left_minutes=_bake_left(doc, now) if doc is not None and doc.status == "active" else None,
        action=action,
        reason=reason,
    )


_MOVES: dict[str, tuple[tuple[Status, ...], Status]] = {
    "pause": (("active",), "paused"),
    "resume": (("paused",), "active"),
    "abort": (("active", "paused"), "aborted"),
    "rollback": (("active", "paused", "completed", "aborted"), "rolled_back"),
}


def move(
    registry: Registry,
    store: Store,
    keys: trust.Keys,
    model: str,
    action: str,
    actor: str = "unknown",
    reason: str = "",
    now: datetime | None = None,
) -> RolloutDoc:
    """pause, resume, abort (halt: devices keep what they run, no new device takes the release) or
    rollback (every device returns to the previous release)."""
    allowed, to = _MOVES[action]
    now = now or _now()
    if not reason:
        raise ConfigError(f"rollout {action} needs --reason", hint="say why: it goes into the rollout's log")

    def decide(current: RolloutDoc | None, state: trust.State):
        if current is None:
            raise InputError(f"{model} has no rollout", hint=f"skuforge rollout start --model {model}")
        if current.status == to:
            return None, "none", f"{current.id} is already {to}"
        if current.status not in allowed:
            raise ConfigError(
                f"cannot {action} rollout {current.id}: it is {current.status}",
                hint=f"{action} applies to a rollout that is {' or '.join(allowed)}",
            )
        if action == "rollback" and current.previous is None:
            raise ConfigError(
                f"{current.id} has no previous release to return to",
                hint="abort it instead (devices keep what they run)",
            )
        doc = current.model_copy(deep=True)
        doc.status = to
        if action == "resume":
            doc.wave_started = _iso(now)  # the bake restarts: the paused time proved nothing
        _log(doc, actor, action, reason, now)
        return doc, action, reason

    doc, _, _ = _write(store, keys, registry, model, decide, f"rollout {action} {model}")
    assert doc is not None  # decide raises without a rollout, else returns it moved or as it is
    return doc


def status(registry: Registry, store: Store, model: str, now: datetime | None = None) -> RolloutStatus:
    now = now or _now()
    state = trust.read_state(store)
    doc = read_doc(store, state, model)
    if doc is None:
        return RolloutStatus(
            rollout=None, health=None, bake_left_minutes=None, action="none", reason=f"{model} has no rollout"
        )
    h = health(store, doc, now)
    left = _bake_left(doc, now) if doc.status == "active" else None
    failed = [g for g in h.gates if g.passed is False]
    if doc.status != "active":
        action, reason = "none", f"{doc.id} is {doc.status}"
    elif failed:
        action, reason = "rollback", "; ".join(f"{g.name}: {g.detail}" for g in failed)
    elif left:
        action, reason = "wait", f"bakes {left:.0f} more minutes"
    elif any(g.passed is None for g in h.gates):
        action, reason = "wait", "not enough evidence yet"
    else:
        action, reason = "advance", "every gate passed"
    return RolloutStatus(rollout=doc, health=h, bake_left_minutes=left, action=action, reason=reason)


def live_models(store: Store) -> list[str]:
    state = trust.read_state(store)
    return [m for m in models_with_rollouts(state) if (d := read_doc(store, state, m)) is not None and d.status in LIVE]
