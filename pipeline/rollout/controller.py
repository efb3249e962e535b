"""Rollouts: one release of a model moving over the fleet in waves, gated by device health.

The rollout document (``rollouts/<model>.json``) is a signed TUF target, so devices act only on a
state CI signed, and an older state replayed to them is refused. Every transition is one commit
(compare-and-swap on the store's timestamp): two CI jobs advancing at once cannot both move a
wave; the loser re-reads, finds the wave already moved, and does nothing. The document logs every
transition with who, when and why.

Devices report to ``reports/<model>/<rollout>/<outcome>/<device>.json``, each report signed with
the device's own key (pipeline/rollout/identity.py). A report counts only when it verifies under the
key the fleet inventory gives that device, names this rollout and the outcome it is filed under, and
comes from a device of the current wave: whoever can write to the store can delete reports but not
forge, move or replay them. Gates (``rollout.gates``) are recomputed from the counted reports at each
``advance``: reports over a minimum count, in-progress time-outs, failure and fallback rates,
smoke-test failures, and the median latency ratio new/previous engine measured on the devices. A
failed gate rolls the rollout back at once (every device returns to the previous release).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any

from pydantic import Field

from pipeline.core.errors import ConfigError, InputError
from pipeline.project.config import Registry, Wave
from pipeline.results.reports import Result
from pipeline.rollout import identity, trust
from pipeline.rollout.doc import (
    DEGRADED,
    FAILURES,
    LIVE,
    OUTCOMES,
    RELEASE_DOC,
    ROLLOUTS,
    RolloutDoc,
    Status,
    Transition,
    ramp_minutes,
    release_path,
    report_prefix,
    rollout_path,
    targeted,
)
from pipeline.rollout.doc import desired_release as desired_release  # re-exported: the device's decision
from pipeline.rollout.doc import report_key as report_key
from pipeline.rollout.inventory import Device, Inventory
from pipeline.rollout.plan import included, plan
from pipeline.rollout.release import releases_of
from pipeline.rollout.store import Store

log = logging.getLogger(__name__)

READERS = 16  # reports read and verified at once (S3 answers each GET in tens of milliseconds)
MAX_LISTED = 20  # ignored reports named in a status, with the count of each reason


class GateCheck(Result):
    name: str
    passed: bool | None = Field(description="null: not enough evidence yet")
    detail: str


class Health(Result):
    reports: int = Field(description="devices of the current wave with a counted (signed, well-formed) report")
    counts: dict[str, int]
    failure_rate: float | None
    latency_ratio_median: float | None
    latency_samples: int
    expected: int = Field(description="devices of the inventory the current wave takes (targeted and included)")
    timed_out: int | None = Field(description="devices of the wave with no report after its time-out (null: before it)")
    ignored: dict[str, int] = Field(default_factory=dict, description="reports not counted, per reason")
    ignored_examples: list[str] = Field(default_factory=list, description="'<key>: <reason>' of the first few")
    trusted_timestamp: int | None = Field(
        None, description="the newest TUF timestamp version a counted report says its device trusts"
    )
    gates: list[GateCheck]


class RolloutStatus(Result):
    rollout: RolloutDoc | None
    health: Health | None
    bake_left_minutes: float | None
    action: str = Field(description="what advance did or would do")
    reason: str


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def _iso(t: datetime) -> str:
    return t.isoformat()


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


def _timeout_at(doc: RolloutDoc) -> datetime | None:
    """When the current wave's in-progress time-out falls (counted from the end of its rate ramp)."""
    minutes = doc.waves[doc.wave].timeout_minutes
    if minutes is None:
        return None
    return datetime.fromisoformat(doc.wave_started) + timedelta(minutes=ramp_minutes(doc) + minutes)


class _Reports:
    """The reports of one rollout, each counted at most once per device: the newest (by its signed
    time) that verifies under the inventory key of the device its key and body both name, for this
    rollout and the outcome its key says, from a device the current wave takes. Every other file
    under the rollout's prefix is ignored and listed with why."""

    def __init__(self, doc: RolloutDoc, inventory: Inventory):
        self.doc, self.inventory = doc, inventory
        self.ignored: Counter[str] = Counter()
        self.examples: list[str] = []
        self.counted: dict[str, dict[str, Any]] = {}  # device id -> report body

    def ignore(self, key: str, reason: str) -> None:
        """Count ``reason`` (one of a few fixed texts: an attacker's files cannot grow the tally's keys)."""
        self.ignored[reason] += 1
        if len(self.examples) < MAX_LISTED:
            self.examples.append(f"{key}: {reason}")

    def gather(self, store: Store) -> None:
        doc, prefix = self.doc, report_prefix(self.doc.model, self.doc.id)
        wanted: list[tuple[str, str, Device]] = []
        for key in store.list(prefix):
            outcome, _, name = key[len(prefix) + 1 :].partition("/")
            device_id = name.removesuffix(".json")
            if outcome not in OUTCOMES or not name.endswith(".json") or "/" in name:
                self.ignore(key, "not a report key (reports/<model>/<rollout>/<outcome>/<device>.json)")
                continue
            device = self.inventory.get(device_id)
            if device is None:
                self.ignore(key, "device not in the inventory")
            elif not (targeted(doc, device.labels) and included(doc.waves, doc.wave, doc.id, device_id, device.ring)):
                self.ignore(key, f"device not in wave {doc.waves[doc.wave].name} or earlier")
            else:
                wanted.append((key, outcome, device))
        if not wanted:
            return
        with ThreadPoolExecutor(min(READERS, len(wanted))) as pool:
            for key, _outcome, device, got in pool.map(lambda w: (*w, self._read(store, *w)), wanted):
                if isinstance(got, str):
                    self.ignore(key, got)
                    continue
                held = self.counted.get(device.id)
                if held is None or got["_at"] > held["_at"]:
                    self.counted[device.id] = got

    def _read(self, store: Store, key: str, outcome: str, device: Device) -> dict[str, Any] | str:
        """The verified body of one report (with its parsed time), or why it is not counted."""
        blob = store.get(key)
        if blob is None:
            return "gone while reading"
        try:
            body = identity.open_report(blob.data, device.key)
        except identity.BadReport as exc:
            return str(exc)
        if body.get("device") != device.id:
            return "signed for another device"
        if body.get("rollout") != self.doc.id or body.get("model", self.doc.model) != self.doc.model:
            return "signed for another rollout"
        if body.get("outcome") != outcome:
            return "signed with another outcome than the one it is filed under"
        try:
            at = datetime.fromisoformat(str(body.get("at")))
        except ValueError:
            return "no readable time"
        return {**body, "_at": at if at.tzinfo else at.replace(tzinfo=timezone.utc)}


def wave_devices(doc: RolloutDoc, inventory: Inventory) -> int:
    """Devices of the inventory the current wave takes (targeted and included)."""
    return sum(1 for d in inventory if targeted(doc, d.labels) and included(doc.waves, doc.wave, doc.id, d.id, d.ring))


def health(store: Store, doc: RolloutDoc, inventory: Inventory, now: datetime | None = None) -> Health:
    """Each gate's verdict, from the reports that count (:class:`_Reports`)."""
    now = now or _now()
    reports = _Reports(doc, inventory)
    reports.gather(store)
    counts = dict.fromkeys(OUTCOMES, 0)
    ratios = []
    for body in reports.counted.values():
        counts[body["outcome"]] += 1
        ratio = body.get("latency_ratio")
        if body["outcome"] == "ok" and isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio > 0:
            ratios.append(float(ratio))
    total = sum(counts.values())
    expected = wave_devices(doc, inventory)
    timeout = _timeout_at(doc)
    timed_out = max(0, expected - total) if timeout is not None and now >= timeout else None
    g = doc.gates
    failed = sum(counts[o] for o in FAILURES)
    degraded = sum(counts[o] for o in DEGRADED)
    rate = failed / total if total else None
    need = min(g.min_reports, expected)
    if timed_out is not None:
        need = min(need, total)  # past the time-out the wave is judged on what reported
    ratios.sort()
    median = ratios[len(ratios) // 2] if ratios else None

    def share(count: int, limit: float) -> bool | None:
        if total == 0:
            return True if need == 0 else None  # a wave with nobody to report has nothing to judge
        return None if total < need else count / total <= limit

    if timed_out is None:
        timing = GateCheck(
            name="timeouts",
            passed=True,
            detail=f"{expected - total} of {expected} devices not reported yet"
            + (f"; time-out at {_iso(timeout)}" if timeout is not None else "; no time-out"),
        )
    else:
        timing = GateCheck(
            name="timeouts",
            passed=timed_out <= g.max_timeout_rate * expected,
            detail=f"{timed_out}/{expected} devices timed out"
            + (f" ({timed_out / expected:.1%}, max {g.max_timeout_rate:.1%})" if expected else ""),
        )
    gates = [
        GateCheck(
            name="reports",
            passed=True if total >= need else None,
            detail=f"{total} reports, {need} needed" + (" (past the time-out)" if timed_out is not None else ""),
        ),
        timing,
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
        expected=expected,
        timed_out=timed_out,
        ignored=dict(reports.ignored),
        ignored_examples=reports.examples,
        trusted_timestamp=max(
            (v for b in reports.counted.values() if isinstance(v := b.get("trusted_timestamp"), int)), default=None
        ),
        gates=gates,
    )


def _bake_left(doc: RolloutDoc, now: datetime) -> float:
    """Minutes until the current wave may move on: its rate ramp, then its bake time."""
    started = datetime.fromisoformat(doc.wave_started)
    end = started + timedelta(minutes=ramp_minutes(doc) + doc.waves[doc.wave].bake_minutes)
    return max(0.0, (end - now).total_seconds() / 60)


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


def rollout_waves(
    registry: Registry, percents: list[float] | None = None, bake_minutes: float | None = None
) -> list[Wave]:
    """The waves a rollout starts with: params.yaml's, or ``percents`` (cumulative shares, the last
    100) named after params.yaml's waves where their counts agree; ``bake_minutes`` for every wave but
    the last. Each wave carries its time-out (its own, else ``rollout.timeout_minutes``)."""
    spec = registry.rollout
    waves = list(spec.waves)
    if percents is not None:
        if not percents or any(not 0 < p <= 100 for p in percents) or percents != sorted(percents):
            raise ConfigError(
                f"--waves {','.join(f'{p:g}' for p in percents)}: give rising percentages in (0, 100]",
                hint="e.g. --waves 5,50,100",
            )
        names = [w.name for w in spec.waves] if len(spec.waves) == len(percents) else []
        waves = [
            Wave(
                name=names[i] if names else f"wave{i + 1}",
                percent=p,
                bake_minutes=spec.waves[-1 if i == len(percents) - 1 else min(i, len(spec.waves) - 2)].bake_minutes,
            )
            for i, p in enumerate(percents)
        ]
    if bake_minutes is not None:
        if bake_minutes < 0:
            raise ConfigError(f"--bake {bake_minutes:g}: minutes cannot be negative", hint="e.g. --bake 30")
        waves = [w.model_copy(update={"bake_minutes": bake_minutes}) for w in waves[:-1]] + waves[-1:]
    return [
        w if w.timeout_minutes is not None else w.model_copy(update={"timeout_minutes": spec.timeout_minutes})
        for w in waves
    ]


def _check_keys(model: str, inventory: Inventory, labels: list[str] | None) -> None:
    """Refuse a rollout none of whose targeted devices has a key (no report could count); warn
    about the devices without one."""
    targeted = [d for d in inventory if not labels or not set(labels).isdisjoint(d.labels)]
    keyless = [d.id for d in targeted if not d.key]
    if keyless and len(keyless) == len(targeted):
        raise ConfigError(
            f"rollout start {model}: no device the rollout targets has a key in the inventory "
            f"({inventory.source or 'the inventory'}): no report could ever count",
            hint="provision each device with `skuforge agent identity --state DIR` and put the key it prints "
            "in the inventory's key column",
        )
    if keyless:
        log.warning(
            "rollout start %s: %d device(s) have no key in the inventory (e.g. %s): their reports will not count",
            model,
            len(keyless),
            ", ".join(keyless[:3]),
        )


def _running(current: RolloutDoc | None) -> str | None:
    """The release the fleet runs now, after the model's last rollout (None before any). A release
    aborted by a failed gate is not one to return to (devices it reached keep it until a wave of
    the new rollout includes them); one an operator halted may be."""
    if current is None:
        return None
    failed = any(t.action == "auto-abort" for t in current.log if t.at >= current.started)
    return {
        "completed": current.release,
        "rolled_back": current.previous,
        "aborted": current.previous if failed else current.previous or current.release,
    }[current.status]


def _overrides(waves: list[Wave] | None, labels: list[str]) -> list[str]:
    """What the start overrode of params.yaml, for the log."""
    out = []
    if waves is not None:
        out.append("waves " + ", ".join(f"{w.name} {w.percent or w.rings} bake {w.bake_minutes:g} min" for w in waves))
    if labels:
        out.append(f"labels {', '.join(labels)}")
    return out


def start(
    registry: Registry,
    store: Store,
    keys: trust.Keys,
    model: str,
    release: str | None = None,
    inventory: Inventory | None = None,
    actor: str = "unknown",
    reason: str = "",
    now: datetime | None = None,
    waves: list[Wave] | None = None,
    labels: list[str] | None = None,
) -> RolloutDoc:
    """Begin rolling ``release`` (default: the newest) out; refused while another rollout of the
    model is live. The plan of ``inventory`` (salted by the rollout id, as devices compute it) sizes
    each wave's minimum report count and its rate ramp. ``waves`` (rollout_waves) and ``labels``
    (devices carrying one of them take part) override params.yaml and are recorded in the rollout."""

    registry.model(model)
    now = now or _now()
    spec = registry.rollout
    chosen = waves or rollout_waves(registry)
    if inventory is None:
        raise ConfigError(
            f"rollout start {model}: no fleet inventory",
            hint="set rollout.inventory in params.yaml or give --inventory: the plan sizes each wave, and "
            "the inventory's device keys are what authenticates device reports",
        )

    _check_keys(model, inventory, labels)

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
        previous = _running(current)
        if previous == target:
            raise ConfigError(f"{model} {target} is already what the fleet runs", hint="publish a new release first")
        n = sum(1 for _ in current.log if _.action == "start") if current else 0
        rid = f"{model}-{target}-{now.strftime('%Y%m%d%H%M%S')}-{n}"
        data = trust.read_target(store, state, release_path(model, target, RELEASE_DOC))
        assert data is not None  # target is one of the releases these targets list
        released_doc = json.loads(data)
        p = plan(
            inventory,
            chosen,
            rid,
            list(released_doc["skus"]),
            spec.fallback_sku,
            labels=labels or (),
            classes=released_doc.get("classes") or {},  # a device of a selected class runs that class's engine
        )
        doc = RolloutDoc(
            id=rid,
            model=model,
            release=target,
            previous=previous,
            status="active",
            wave=0,
            wave_started=_iso(now),
            started=_iso(now),
            waves=chosen,
            gates=spec.gates,
            planned=[w.devices for w in p.waves],
            labels=sorted(set(labels or ())),
            max_per_minute=spec.max_per_minute,
            max_attempts=spec.max_attempts,
            health_window_minutes=spec.health_window_minutes,
            log=list(current.log[-50:]) if current else [],
        )
        overrides = _overrides(chosen if waves is not None else None, doc.labels)
        _log(
            doc,
            actor,
            "start",
            (reason or f"roll {target} out over {len(doc.waves)} waves")
            + (f" ({'; '.join(overrides)})" if overrides else "")
            + (f"; {p.fallback.devices} device(s) will run the portable fallback" if p.fallback.devices else "")
            + (f"; {p.not_served.devices} device(s) cannot be served" if p.not_served.devices else ""),
            now,
        )
        return doc, "start", f"started {doc.id}"

    doc, _, _ = _write(store, keys, registry, model, decide, f"rollout start {model}")
    assert doc is not None  # decide starts one or raises
    return doc


def _need(inventory: Inventory | None, what: str) -> Inventory:
    if inventory is None:
        raise ConfigError(
            f"{what}: no fleet inventory to authenticate device reports with",
            hint="set rollout.inventory in params.yaml or give --inventory (its key column holds each device's "
            "public key)",
        )
    return inventory


def _behind_devices(store: Store, state: trust.State, h: Health, model: str) -> None:
    """Refuse a store older than what devices already trust: their signed reports name the newest
    timestamp they verified, so a store put back to an older state is caught even if its archived
    timestamps were deleted too."""
    seen = h.trusted_timestamp
    if seen is None or seen <= state.timestamp.signed.version:
        return
    fresh = trust.read_state(store).timestamp.signed.version  # a commit since our read is no replay
    if seen > fresh:
        raise trust.VerificationFailed(
            f"rollout advance {model}: devices report trusting timestamp v{seen}, the store serves v{fresh}: "
            "the store's metadata was put back to an older state",
            hint="restore the newest metadata (skuforge release repair) before any writer signs on top of it",
        )


def advance(
    registry: Registry,
    store: Store,
    keys: trust.Keys,
    model: str,
    inventory: Inventory | None = None,
    actor: str = "unknown",
    now: datetime | None = None,
) -> RolloutStatus:
    """Check the gates of the live wave: roll back when one fails, move to the next wave when the
    bake time is over and every gate passed, else do nothing (and say why). The gates count only
    reports signed by devices of ``inventory`` the wave takes."""
    now = now or _now()
    observed: dict[str, Any] = {}

    def decide(current: RolloutDoc | None, state: trust.State):
        if current is None or current.status != "active":
            return (
                None,
                "none",
                f"no active rollout of {model}" + (f" ({current.id} is {current.status})" if current else ""),
            )
        h = health(store, current, _need(inventory, f"rollout advance {model}"), now)
        observed["health"] = h
        _behind_devices(store, state, h, model)
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


def status(
    registry: Registry, store: Store, model: str, inventory: Inventory | None = None, now: datetime | None = None
) -> RolloutStatus:
    """The rollout of ``model`` and what ``advance`` would do now (nothing is written). The gates are
    evaluated for a live rollout with an inventory (without one, device reports cannot be
    authenticated); an ended rollout shows its last transition."""
    now = now or _now()
    state = trust.read_state(store)
    doc = read_doc(store, state, model)
    if doc is None:
        return RolloutStatus(
            rollout=None, health=None, bake_left_minutes=None, action="none", reason=f"{model} has no rollout"
        )
    # an ended rollout has no gate left to judge: its reports are not read again (a fleet's worth of GETs)
    h = health(store, doc, inventory, now) if inventory is not None and doc.status in LIVE else None
    left = _bake_left(doc, now) if doc.status == "active" else None
    failed = [g for g in h.gates if g.passed is False] if h is not None else []
    if doc.status != "active":
        last = doc.log[-1] if doc.log else None
        action, reason = (
            "none",
            f"{doc.id} is {doc.status}"
            + (f" ({last.action} by {last.actor} at {last.at}: {last.reason})" if last is not None else ""),
        )
    elif h is None:
        action, reason = "unknown", "no inventory given: device reports cannot be authenticated, gates not evaluated"
    elif failed:
        action, reason = "rollback", "; ".join(f"{g.name}: {g.detail}" for g in failed)
    elif left:
        action, reason = "wait", f"bakes {left:.0f} more minutes"
    elif any(g.passed is None for g in h.gates):
        action, reason = "wait", "not enough evidence yet"
    else:
        action, reason = "advance", "every gate passed"
    return RolloutStatus(rollout=doc, health=h, bake_left_minutes=left, action=action, reason=reason)


def rollout_models(store: Store, live_only: bool = False) -> list[str]:
    """Models with a rollout document in the store (``live_only``: active or paused ones)."""
    state = trust.read_state(store)
    models = models_with_rollouts(state)
    if not live_only:
        return models
    return [m for m in models if (d := read_doc(store, state, m)) is not None and d.status in LIVE]
