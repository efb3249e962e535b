"""The signed rollout document and the decision a device makes from it: no I/O, light imports.

Both sides read this module: the controller (pipeline/rollout/controller.py) writes the document,
the device agent (pipeline/rollout/agent.py) decides from it which release to run. Store keys of
rollouts, releases and device reports are named here too, so the agent needs nothing heavier.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Literal

from pydantic import ConfigDict, Field

from pipeline.project.config import HealthGates, Wave
from pipeline.results.reports import Result
from pipeline.rollout.plan import bucket, included

ROLLOUTS = "rollouts"
REPORTS = "reports"
RELEASES = "releases"
RELEASE_DOC = "release.json"
Status = Literal["active", "paused", "completed", "aborted", "rolled_back"]
OUTCOMES: tuple[str, ...] = ("ok", "fallback", "smoke_failed", "incompatible", "verify_failed", "error", "reverted")
"""What a device reports. ``reverted``: the new engine failed in its health window after activation
and the device went back to its previous slot by itself."""
FAILURES = ("smoke_failed", "verify_failed", "error", "reverted")  # the release (or the store) is at fault
DEGRADED = ("fallback", "incompatible")  # the device cannot run its SKU's engine: the portable one, or nothing
LIVE = ("active", "paused")


def rollout_path(model: str) -> str:
    return f"{ROLLOUTS}/{model}.json"


def report_prefix(model: str, rollout_id: str) -> str:
    return f"{REPORTS}/{model}/{rollout_id}"


def report_key(model: str, rollout_id: str, outcome: str, device_id: str) -> str:
    return f"{report_prefix(model, rollout_id)}/{outcome}/{device_id}.json"


def release_path(model: str, release: str, *parts: str) -> str:
    return "/".join((RELEASES, model, release, *parts))


class Transition(Result):
    at: str
    actor: str
    action: str
    status: str = Field(description="status after the transition")
    wave: int
    reason: str


class RolloutDoc(Result):
    """The signed rollout state devices follow. Unknown fields are ignored, so a device reads a
    document a newer controller wrote."""

    model_config = ConfigDict(extra="ignore")

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
    labels: list[str] = Field(
        default_factory=list, description="only devices carrying one of these inventory labels take part (empty: all)"
    )
    max_per_minute: float | None = Field(None, description="devices a wave admits per minute (null: all at once)")
    max_attempts: int = Field(3, description="installs a device tries in this rollout before it stops retrying")
    health_window_minutes: float = Field(
        0, description="how long a device re-checks a newly activated engine and reverts by itself on failure"
    )
    log: list[Transition] = Field(default_factory=list)


def targeted(doc: RolloutDoc, labels: Sequence[str]) -> bool:
    """Whether a device with these labels takes part in the rollout at all."""
    return not doc.labels or any(label in doc.labels for label in labels)


def ramp_minutes(doc: RolloutDoc, wave: int | None = None) -> float:
    """How long the rate limit takes to admit every device wave ``wave`` (default: the current) adds."""
    w = doc.wave if wave is None else wave
    if doc.max_per_minute is None or doc.planned is None:
        return 0.0
    new = doc.planned[w] - (doc.planned[w - 1] if w > 0 else 0)
    return max(0, new) / doc.max_per_minute


def admitted(doc: RolloutDoc, device_id: str, ring: str | None, now: datetime) -> bool:
    """Whether the rate limit has admitted a device the current wave adds by ``now``: the wave's new
    share opens in order of the devices' buckets, ``max_per_minute`` devices a minute."""
    ramp = ramp_minutes(doc)
    if ramp <= 0:
        return True
    w = doc.wave
    if w > 0 and included(doc.waves, w - 1, doc.id, device_id, ring):
        return True  # an earlier wave took it: admitted then
    elapsed = (now - datetime.fromisoformat(doc.wave_started)).total_seconds() / 60
    opened = min(1.0, max(0.0, elapsed / ramp))
    wave = doc.waves[w]
    if wave.percent is not None:
        low = max((x.percent for x in doc.waves[:w] if x.percent is not None), default=0.0)
        position = (bucket(doc.id, device_id) - low) / max(wave.percent - low, 1e-9)
    else:
        position = bucket(doc.id, device_id) / 100
    return position < opened


def in_wave(doc: RolloutDoc, device_id: str, ring: str | None, labels: Sequence[str], now: datetime) -> bool:
    """Whether the device takes part in the current wave by ``now`` (targeted, included, admitted)."""
    return (
        targeted(doc, labels)
        and included(doc.waves, doc.wave, doc.id, device_id, ring)
        and admitted(doc, device_id, ring, now)
    )


def desired_release(
    doc: dict | RolloutDoc | None,
    device_id: str,
    ring: str | None,
    labels: Sequence[str] = (),
    now: datetime | None = None,
) -> tuple[str | None, str]:
    """The release a device should run under this rollout, and why (None: leave it as it is).

    - rolled back: the previous release, for every device the rollout targets;
    - a device a wave includes: the release while the rollout is active (once the rate limit has
      admitted it) or completed; nothing new while it is paused or aborted (the device keeps what it
      runs: the release if it took it, else what it ran before);
    - a device no wave includes yet: the previous release (None for a first release: nothing).
    """
    if doc is None:
        return None, "no rollout"
    d = doc if isinstance(doc, RolloutDoc) else RolloutDoc.model_validate(doc)
    now = now or datetime.now(timezone.utc)
    if not targeted(d, labels):
        return None, f"{d.id} targets labels {', '.join(d.labels)}; this device has none of them"
    if d.status == "rolled_back":
        return d.previous, f"rollout {d.id} rolled back"
    if not included(d.waves, d.wave, d.id, device_id, ring):
        if d.status == "completed":  # every wave ran: a device a ring wave never named stays where it is
            return None, f"{d.id} completed without including this device"
        return d.previous, f"not yet in a wave of {d.id}"
    if d.status in ("paused", "aborted"):
        return None, f"rollout {d.id} is {d.status}: keeping what runs"
    if d.status == "completed":
        return d.release, f"{d.id} completed"
    if admitted(d, device_id, ring, now):
        return d.release, f"in wave {d.waves[d.wave].name} of {d.id}"
    return d.previous, f"in wave {d.waves[d.wave].name} of {d.id}, not yet admitted by its rate limit"
