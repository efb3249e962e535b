"""The device agent: fetch, verify, check, stage, smoke-test, activate, report.

One pass (``run_once``) per model:

0. within the health window of a new engine, re-check it (application's ``unhealthy`` marker, file
   hashes, smoke test) and go back to the previous slot by itself when it fails (no store needed);
1. refresh the signed metadata (TUF: signatures, expiry, versions never going back);
2. read the rollout document and decide the release this device should run (doc.desired_release:
   waves, rate limit, labels, pause and abort);
3. pick the engine: the SKU the release selects for the device's class (``device_class``: the
   release's ``classes`` map, pipeline.rollout.release), else the device's SKU, if the release has
   it and the device can run it (architecture, CPU features, runtime versions from the release
   document), else the portable fallback (a class the release selects nothing for: with the reason);
4. download every file through TUF (length and sha256 verified) into the inactive slot (A/B);
5. smoke-test the staged engine: load it with its backend, run the golden inputs, compare with the
   engine's outputs recorded at validation within the SKU's tolerance, time it and the active engine;
6. flip the active pointer (one atomic rename) only when the smoke test passed;
7. report the outcome to the store, signed with the device key (pipeline/rollout/identity.py).

On any failure the active engine stays (a staged engine never becomes active unverified or
untested); a device with no working engine takes the portable one. Failed installs are counted per
rollout, and after the rollout's ``max_attempts`` the device stops trying its release. Only the
backend of the engine being loaded is imported, so a device needs only its own runtime.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field, field_validator, model_validator

from pipeline.backends import get_backend, runtime_packages
from pipeline.core.errors import InputError, ServiceError, SkuforgeError
from pipeline.core.io import atomic_dir, atomic_write_json, read_json, sha256_bytes
from pipeline.core.validation import validation_problems
from pipeline.core.versions import same_version, satisfies
from pipeline.host.probe import cpu_features, host_arch
from pipeline.project.config import SkuSpec, Strict, device_class_problem, name_problem
from pipeline.project.data import iter_batches, run_dataset
from pipeline.results.reports import Result
from pipeline.results.signing import SigningKey
from pipeline.rollout import identity, trust
from pipeline.rollout.client import Client
from pipeline.rollout.doc import RELEASE_DOC, RolloutDoc, desired_release, release_path, report_key, rollout_path
from pipeline.rollout.inventory import ID_PATTERN
from pipeline.rollout.store import Store

log = logging.getLogger(__name__)

ACTIVE = "active.json"
SLOT_DOC = "slot.json"
ATTEMPTS = "attempts.json"
UNHEALTHY = "unhealthy"
"""``<state>/models/<model>/unhealthy``: the device's application writes it (any text: the reason)
when inference with the active engine fails; within the health window the agent then reverts."""
RETRIED = ("smoke_failed", "error", "reverted")  # a failed install: counted against max_attempts
HEALTHY = ("ok", "current", "idle", "fallback")  # outcomes of a device that runs what it should


def _named(what: str) -> AfterValidator:
    """The registry's rule for model and SKU names: on a device they name folders and store keys."""

    def check(name: str) -> str:
        problem = name_problem(name)
        if problem is not None:
            raise ValueError(f"{name!r} is not a {what} name: it {problem}")
        return name

    return AfterValidator(check)


def _device_class(name: str | None) -> str | None:
    """The registry's rule for device class names (pipeline.project.config)."""
    problem = None if name is None else device_class_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return name


class DeviceConfig(Strict):
    """What a device is: written at provisioning (``device.yaml``). ``sku``, ``device_class`` or both:
    a class gets the engine the release selects for it, a SKU that SKU's engine (and, with both,
    the SKU's engine when the release selects nothing for the class)."""

    id: str
    sku: Annotated[str, _named("SKU")] | None = None
    device_class: Annotated[str | None, AfterValidator(_device_class)] = Field(
        None, description="the device class (x86-avx2, ...): it runs the engine the release selects for it"
    )
    models: list[Annotated[str, _named("model")]] = Field(min_length=1)
    arch: str | None = Field(None, description="default: this machine's")
    runtime: dict[str, str] | None = Field(None, description="package -> version; default: the installed ones")
    cpu_features: list[str] | None = Field(None, description="default: this CPU's")
    ring: str | None = None
    labels: list[str] = Field(default_factory=list)

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:

        if not ID_PATTERN.fullmatch(value) or ".." in value:
            raise ValueError(
                f"{value!r} is not a device id: a letter or digit, then letters, digits, '.', '_', ':' "
                "or '-', at most 128 characters (ids name files and store keys)"
            )
        return value

    @model_validator(mode="after")
    def _sku_or_class(self) -> DeviceConfig:
        if self.sku is None and self.device_class is None:
            raise ValueError("name the device's sku, its device_class, or both")
        return self


@dataclass
class Device:
    """A device's identity with the defaults resolved from the machine it runs on."""

    id: str
    sku: str | None
    arch: str
    runtime: dict[str, str]
    cpu_features: frozenset[str]
    ring: str | None = None
    labels: tuple[str, ...] = ()
    device_class: str | None = None

    @classmethod
    def from_config(cls, cfg: DeviceConfig) -> Device:

        return cls(
            id=cfg.id,
            sku=cfg.sku,
            arch=cfg.arch or host_arch(),
            runtime=cfg.runtime if cfg.runtime is not None else installed_runtimes(),
            cpu_features=frozenset(cfg.cpu_features) if cfg.cpu_features is not None else cpu_features(),
            ring=cfg.ring,
            labels=tuple(cfg.labels),
            device_class=cfg.device_class,
        )


def installed_runtimes() -> dict[str, str]:

    out = {}
    for pkg in runtime_packages():
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[pkg] = importlib.metadata.version(pkg)
    return out


class AgentResult(Result):
    device: str
    model: str
    rollout: str | None
    desired: str | None
    outcome: str = Field(
        description="idle, current, ok, fallback, smoke_failed, incompatible, verify_failed, error, reverted"
    )
    detail: str
    active: dict[str, Any] | None = Field(description="the engine active after this pass")
    latency_ms: float | None = None
    previous_latency_ms: float | None = None
    attempt: int | None = Field(None, description="this install's attempt in the rollout (1-based)")
    reported: str | None = None
    seconds: float


def compatibility(requires: dict[str, Any], device: Device) -> list[str]:
    """Why ``device`` cannot run an engine with these requirements (empty: it can). Versions are
    compared as pipeline.core.versions reads them: the OpenVINO build an engine records
    ('2026.4.1-22982-e213a14...-releases/2026/4') is the '2026.4.1' its package reports."""
    bad = []
    if requires.get("arch") and requires["arch"] != device.arch:
        bad.append(f"built for {requires['arch']}, the device is {device.arch}")
    missing = sorted(set(requires.get("cpu_features", [])) - device.cpu_features)
    if missing:
        bad.append(f"needs CPU features {', '.join(missing)}")
    for pkg, version in requires.get("exact", {}).items():
        if not same_version(device.runtime.get(pkg), version):
            bad.append(f"needs {pkg} {version} exactly, the device has {device.runtime.get(pkg) or 'none'}")
    for pkg, spec in requires.get("specifiers", {}).items():
        if not satisfies(device.runtime.get(pkg), spec):
            bad.append(f"needs {pkg} {spec}, the device has {device.runtime.get(pkg) or 'none'}")
    return bad


def engine_for(release: dict[str, Any], device: Device) -> tuple[str | None, str, dict[str, Any]]:
    """The SKU whose engine ``device`` should run from ``release`` (None: none, the portable fallback),
    why, and how it was chosen (kept in the active document and the report). The release's class map
    first (the engine selected for the device's class), then the device's own SKU."""
    cls = device.device_class
    if cls is None:
        return device.sku, "", {}
    selection = release.get("selection") or {}
    chosen = (release.get("classes") or {}).get(cls)
    if chosen is not None:
        return chosen, f"device class {cls}: {chosen} selected", {"device_class": cls, "selected": chosen}
    why = (selection.get("unselected") or {}).get(cls) or (
        f"release {release['release']} selects no engine for device class {cls}"
        + ("" if release.get("classes") else " (its SKUs name no device classes)")
    )
    via = {"device_class": cls, "selected": None}
    if device.sku is not None:
        return device.sku, f"{why}; the device's SKU {device.sku}", via
    return None, why, via


# --- the smoke test ---------------------------------------------------------------------------------


@dataclass
class Smoke:
    passed: bool
    detail: str
    latency_ms: float | None = None


def _arrays(data: bytes) -> dict[str, Any]:
    import numpy as np

    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _load(entry: dict[str, Any], engine_dir: Path):

    return get_backend(entry["backend"]).load(engine_dir, SkuSpec.model_validate(entry["sku_spec"]))


def _timed(runner, golden: dict[str, Any], entry: dict[str, Any], repeats: int = 3) -> tuple[dict[str, Any], float]:
    """Outputs on the golden inputs and the median time of one inference call (ms)."""

    run = entry["run"]
    outputs = run_dataset(runner.infer, golden, run["inputs"], run["outputs"], run["batch"])
    times = []
    for _ in range(repeats):
        for _, feeds in iter_batches(golden, run["inputs"], run["batch"]):
            t0 = time.perf_counter()
            runner.infer(feeds)
            times.append(time.perf_counter() - t0)
    times.sort()
    return outputs, 1000 * times[len(times) // 2]


def smoke_test(entry: dict[str, Any], slot: Path) -> Smoke:
    """Load the staged engine, run the golden inputs, compare with the outputs it gave at validation."""
    import numpy as np

    try:
        golden = _arrays((slot / "golden.npz").read_bytes())
        expected = _arrays((slot / "expected.npz").read_bytes())
        with _load(entry, slot / "engine") as runner:
            got, latency = _timed(runner, golden, entry)
    except SkuforgeError as exc:
        return Smoke(False, f"the engine does not load or run: {exc.message}")
    except Exception as exc:  # a runtime crash on this device is exactly what the smoke test is for
        return Smoke(False, f"the engine does not load or run: {type(exc).__name__}: {exc}")
    bad = []
    for tol in entry["tolerance"]:
        name = tol["output"]
        e, r = np.asarray(got.get(name)), np.asarray(expected.get(name))
        if e.shape != r.shape:
            bad.append(f"{name}: shape {list(e.shape)}, expected {list(r.shape)}")
            continue
        e64, r64 = e.astype(np.float64), r.astype(np.float64)
        with np.errstate(invalid="ignore"):
            beyond = ~(np.abs(e64 - r64) <= tol["atol"] + tol["rtol"] * np.abs(r64))
        beyond &= ~(np.isnan(e64) & np.isnan(r64))
        frac = float(beyond.mean()) if beyond.size else 0.0
        if frac > tol["max_mismatch"]:
            bad.append(
                f"{name}: {frac:.2%} of elements beyond atol {tol['atol']:g} + rtol {tol['rtol']:g} "
                f"(allowed {tol['max_mismatch']:.2%})"
            )
    if bad:
        return Smoke(False, "outputs differ from validation: " + "; ".join(bad), latency)
    return Smoke(True, f"{len(entry['tolerance'])} outputs match validation", latency)


# --- device state (A/B slots) -----------------------------------------------------------------------


@dataclass
class Agent:
    """One device's agent over one store. ``smoke`` is the smoke test (the fleet simulation passes a
    memoised one: identical simulated devices would compute identical results). ``key`` signs the
    reports; by default the device key in ``state_dir`` (identity.device_key), made on first use."""

    store: Store
    device: Device
    state_dir: Path
    root: bytes | None = None
    smoke: Callable[[dict[str, Any], Path], Smoke] = smoke_test
    key: SigningKey | None = None
    timestamp: bytes | None = None  # the store's timestamp at provisioning: nothing older is trusted
    client: Client | None = field(default=None, init=False)
    _now: datetime = field(default_factory=lambda: datetime.now(timezone.utc), init=False, repr=False)

    def _model_dir(self, model: str) -> Path:
        return self.state_dir / "models" / model

    def active(self, model: str) -> dict[str, Any] | None:
        path = self._model_dir(model) / ACTIVE
        try:
            return read_json(path)
        except (FileNotFoundError, ValueError):
            return None

    def active_engine_dir(self, model: str) -> Path | None:
        act = self.active(model)
        return None if act is None else self._model_dir(model) / "slots" / act["slot"] / "engine"

    def _slot_doc(self, model: str, slot: str) -> dict[str, Any] | None:
        try:
            return read_json(self._model_dir(model) / "slots" / slot / SLOT_DOC)
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return None

    def _stage(self, model: str, slot: str, rid: str, sku: str, entry: dict[str, Any], kind: str) -> Path:
        """Download and verify every file of the engine into ``slot`` (replaced whole, or not at all)."""

        files = entry["files"]
        wanted = {"golden.npz": files["golden"], "expected.npz": files["expected"], "manifest.json": files["manifest"]}
        wanted.update({f"engine/{n}": p for n, p in files["engine"].items()})
        target = self._model_dir(model) / "slots" / slot
        client = self.client
        assert client is not None  # run_once opens it before it installs anything
        with atomic_dir(target) as tmp:
            for name, path in wanted.items():
                data = client.fetch(path)
                if data is None:
                    raise trust.VerificationFailed(
                        f"{path} is not in the signed targets",
                        hint="the release document names a file the store does not sign",
                    )
                dest = tmp / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
            atomic_write_json(tmp / SLOT_DOC, {"release": rid, "sku": sku, "kind": kind, "entry": entry})
        return target

    def _verified_slot(self, model: str, slot: str, rid: str, sku: str, entry: dict[str, Any]) -> bool:
        """The slot still holds exactly the files the signed release names (after a rollback)."""
        doc = self._slot_doc(model, slot)
        if doc is None or (doc["release"], doc["sku"]) != (rid, sku):
            return False
        base = self._model_dir(model) / "slots" / slot
        for name, sha in entry["sha256"].items():
            local = base / name
            if name == "signature.json":  # not staged: the release, not the device, checks it
                continue
            try:
                if sha256_bytes(local.read_bytes()) != sha:
                    return False
            except OSError:
                return False
        return True

    def _slot_intact(self, model: str, engine: dict[str, Any]) -> bool:
        """The slot an active document names still holds what the signed release entry staged there."""
        doc = self._slot_doc(model, engine["slot"])
        return doc is not None and self._verified_slot(
            model, engine["slot"], engine["release"], engine["sku"], doc["entry"]
        )

    def _activate(
        self,
        model: str,
        slot: str,
        rid: str,
        sku: str,
        kind: str,
        rollout: str | None,
        previous: dict[str, Any] | None = None,
        window_minutes: float = 0,
        via: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Switch to ``slot``. With a previous engine and a health window, remember both, so a pass
        within the window can go back by itself (``_health_window``). ``via``: how a device class
        chose the engine (engine_for), kept with it."""
        doc: dict[str, Any] = {
            "slot": slot,
            "release": rid,
            "sku": sku,
            "kind": kind,
            "rollout": rollout,
            "activated": _iso(self._now),
            **(via or {}),
        }
        if previous is not None and window_minutes > 0:
            doc["previous"] = _committed(previous)
            doc["health_until"] = _iso(self._now + timedelta(minutes=window_minutes))
        (self._model_dir(model) / UNHEALTHY).unlink(missing_ok=True)  # the app's verdict was on the old engine
        atomic_write_json(self._model_dir(model) / ACTIVE, doc)  # the one atomic switch
        return doc

    # --- retries ------------------------------------------------------------------------------------

    def _attempts(self, model: str) -> dict[str, Any]:
        """Failed installs of the current rollout: ``{rollout: {release, failed, outcome, detail, unreported}}``."""
        try:
            return read_json(self._model_dir(model) / ATTEMPTS)
        except (FileNotFoundError, ValueError):
            return {}

    def _failed(self, model: str, rollout: str, release: str, outcome: str, detail: str) -> int:
        """Count one failed install of ``release`` in ``rollout``; the new count (the attempt that failed).
        The failure stays ``unreported`` until a report of it reaches the store (``_send_unreported``)."""
        rec = self._attempts(model).get(rollout)
        failed = rec["failed"] if rec and rec.get("release") == release else 0
        failed += 1
        # only the newest rollout matters: a rollout id is never reused
        state = {
            rollout: {
                "release": release,
                "failed": failed,
                "outcome": outcome,
                "detail": detail,
                "unreported": True,
            }
        }
        atomic_write_json(self._model_dir(model) / ATTEMPTS, state)
        return failed

    def _reported_failure(self, model: str, rollout: str) -> None:
        state = self._attempts(model)
        if state.get(rollout, {}).get("unreported"):
            state[rollout]["unreported"] = False
            atomic_write_json(self._model_dir(model) / ATTEMPTS, state)

    # --- the health window --------------------------------------------------------------------------

    def _health_problem(self, model: str, act: dict[str, Any]) -> str | None:
        """Why the active engine is unhealthy (None: it is healthy). Cheapest check first."""
        marker = self._model_dir(model) / UNHEALTHY
        try:
            said = marker.read_text(encoding="utf-8", errors="replace").strip()
        except FileNotFoundError:
            pass
        else:
            return f"the application marked it unhealthy: {said[:200] or '(no reason given)'}"
        if not self._slot_intact(model, act):
            return f"slot {act['slot']} no longer holds the files the signed release names"
        slot = self._slot_doc(model, act["slot"])
        assert slot is not None  # _slot_intact read it
        smoke = self.smoke(slot["entry"], self._model_dir(model) / "slots" / act["slot"])
        return None if smoke.passed else f"smoke test: {smoke.detail}"

    def _health_window(self, model: str, t0: float) -> AgentResult | None:
        """Within the health window of a new activation, re-check the active engine and go back to
        the previous slot by itself when it fails (no store needed: a device that cannot reach the
        store still reverts). After the window the activation is committed. The result of a revert,
        else None."""
        act = self.active(model)
        if act is None or not act.get("health_until"):
            return None
        path = self._model_dir(model) / ACTIVE
        if self._now >= datetime.fromisoformat(act["health_until"]):
            atomic_write_json(path, _committed(act))
            log.info("%s %s: %s passed its health window: committed", self.device.id, model, act["release"])
            return None
        problem = self._health_problem(model, act)
        if problem is None:
            return None
        (self._model_dir(model) / UNHEALTHY).unlink(missing_ok=True)  # consumed: it named this engine
        prev = act["previous"]
        if self._slot_intact(model, prev):
            atomic_write_json(path, prev)
            outcome, active = "reverted", prev
            detail = f"{act['release']} failed in its health window ({problem}); back on {prev['release']}"
        else:  # nothing verified to go back to: keep it, and let the gates count the failure
            active = _committed(act)
            atomic_write_json(path, active)
            outcome = "error"
            detail = (
                f"{act['release']} failed in its health window ({problem}); the previous slot "
                f"{prev['slot']} no longer verifies, so {act['release']} keeps running"
            )
        log.warning("%s %s: %s", self.device.id, model, detail)
        attempt = self._failed(model, act["rollout"], act["release"], outcome, detail)
        return self._result(model, act["rollout"], act["release"], outcome, detail, active, t0, attempt=attempt)

    # --- one pass -----------------------------------------------------------------------------------

    def run_once(self, model: str, now: datetime | None = None) -> AgentResult:
        """One pass for ``model`` (``now``: the clock, for simulations and tests)."""
        t0 = time.perf_counter()
        self._now = (now or datetime.now(timezone.utc)).astimezone(timezone.utc).replace(microsecond=0)
        reverted = self._health_window(model, t0)
        act = self.active(model)
        doc, desired, attempt, counted = None, None, None, False
        try:
            # a fresh client per pass: ngclient refreshes once per Updater; the trusted state is on disk
            self.client = Client(self.store, self.state_dir / "tuf", self.root, self.timestamp)
            self.client.refresh()
            raw = self.client.fetch(rollout_path(model))
            doc = RolloutDoc.model_validate_json(raw) if raw is not None else None
            if reverted is not None:
                return self._report(model, reverted, doc)
            self._send_unreported(model, doc, act, t0)
            desired, why = desired_release(doc, self.device.id, self.device.ring, self.device.labels, self._now)
            rollout_id = doc.id if doc is not None else None
            if desired is None or (act is not None and act["release"] == desired):
                outcome = "idle" if desired is None else "current"
                return self._result(model, rollout_id, desired, outcome, why, act, t0)
            if doc is not None and desired == doc.release and doc.status != "rolled_back":
                rec = self._attempts(model).get(doc.id)
                failed = rec["failed"] if rec and rec.get("release") == desired else 0
                if rec and failed >= doc.max_attempts:  # stop: the last report stands
                    detail = (
                        f"gave up on {desired} after {failed} failed install(s) (max_attempts {doc.max_attempts}); "
                        f"last: {rec['detail']}"
                    )
                    return self._result(model, doc.id, desired, rec["outcome"], detail, act, t0, attempt=failed)
                attempt, counted = failed + 1, True
            release_raw = self.client.fetch(release_path(model, desired, RELEASE_DOC))
            if release_raw is None:
                raise trust.VerificationFailed(
                    f"release {desired} of {model} is not in the signed targets",
                    hint="the rollout names a release the store does not hold",
                )
            result = self._install(model, json.loads(release_raw), doc, act, t0, attempt)
            if counted and result.outcome in RETRIED:
                self._failed(model, result.rollout or "", result.desired or "", result.outcome, result.detail)
            return result if result.outcome == "current" else self._report(model, result, doc)
        except trust.VerificationFailed as exc:
            rollout = doc.id if doc is not None else None
            result = self._result(
                model, rollout, desired, "verify_failed", exc.message, self.active(model), t0, attempt=attempt
            )
            return self._report(model, result, doc)
        except ServiceError as exc:  # the store is unreachable: keep running what we have, try next pass
            if reverted is not None:
                return reverted  # reported by the next pass that reaches the store
            if counted and doc is not None and desired is not None:
                self._failed(model, doc.id, desired, "error", exc.message)
            rollout = doc.id if doc is not None else None
            return self._result(model, rollout, desired, "error", exc.message, self.active(model), t0, attempt=attempt)

    def _send_unreported(self, model: str, doc: RolloutDoc | None, act: dict[str, Any] | None, t0: float) -> None:
        """Report a failure an earlier pass could not deliver (the store was unreachable then)."""
        rec = self._attempts(model).get(doc.id) if doc is not None else None
        if doc is not None and rec and rec.get("unreported") and rec.get("release") == doc.release:
            result = self._result(
                model, doc.id, doc.release, rec["outcome"], rec["detail"], act, t0, attempt=rec["failed"]
            )
            self._report(model, result, doc)

    def _install(
        self,
        model: str,
        release: dict[str, Any],
        doc: RolloutDoc | None,
        act: dict[str, Any] | None,
        t0: float,
        attempt: int | None,
    ) -> AgentResult:
        """Stage, smoke-test and activate ``release``; the result, not yet reported."""
        rid = release["release"]
        rollout = doc.id if doc else None
        # a new engine of the rollout's own release is watched for its health window
        window = doc.health_window_minutes if doc and rid == doc.release and doc.status != "rolled_back" else 0
        slot = "b" if act is not None and act["slot"] == "a" else "a"
        sku, how, via = engine_for(release, self.device)
        if how:
            log.info("%s %s: %s", self.device.id, model, how)
        entry = release["skus"].get(sku) if sku is not None else None
        fallback = release["skus"].get(release.get("fallback_sku") or "")
        outcome, detail = "ok", ""
        choice = None

        def result(outcome: str, detail: str, active: dict[str, Any] | None, latency=None, previous=None):
            return self._result(model, rollout, rid, outcome, detail, active, t0, latency, previous, attempt)

        if sku is None:  # a class the release selects nothing for: the portable engine, as without one
            outcome, detail = "incompatible", how
        elif entry is None:
            outcome, detail = "incompatible", f"{how + '; ' if how else ''}release {rid} has no engine for SKU {sku}"
        else:
            problems = compatibility(entry["requires"], self.device)
            if problems:
                outcome, detail = "incompatible", f"{how + ': ' if how else ''}{'; '.join(problems)}"
            else:
                choice = (sku, entry, "optimized")
        if choice is not None:
            if self._verified_slot(model, slot, rid, choice[0], choice[1]):
                staged = self._model_dir(model) / "slots" / slot  # A/B: the other slot already holds it
            else:
                staged = self._stage(model, slot, rid, choice[0], choice[1], choice[2])
            smoke = self.smoke(choice[1], staged)
            if smoke.passed:
                previous_latency = self._previous_latency(model, act, choice[1], staged)
                active = self._activate(model, slot, rid, choice[0], choice[2], rollout, act, window, via)
                detail = f"{how}; {smoke.detail}" if how else smoke.detail
                return result("ok", detail, active, smoke.latency_ms, previous_latency)
            outcome, detail = "smoke_failed", smoke.detail
            if act is not None:  # keep the engine that works
                return result(outcome, f"{detail}; kept {act['release']}", act, smoke.latency_ms)
        # incompatible, or failed with nothing to keep: the portable engine of the same release
        if fallback is None or compatibility(fallback["requires"], self.device):
            why = (
                "no fallback in the release"
                if fallback is None
                else "; ".join(compatibility(fallback["requires"], self.device))
            )
            return result(outcome, f"{detail}; portable fallback unusable: {why}", act)
        fsku = release["fallback_sku"]
        if act is not None and act["release"] == rid and act["sku"] == fsku:
            return result("current", "on the portable fallback already", act)
        if self._verified_slot(model, slot, rid, fsku, fallback):
            staged = self._model_dir(model) / "slots" / slot
        else:
            staged = self._stage(model, slot, rid, fsku, fallback, "fallback")
        smoke = self.smoke(fallback, staged)
        if not smoke.passed:
            return result(outcome, f"{detail}; the portable fallback failed too: {smoke.detail}", act)
        active = self._activate(model, slot, rid, fsku, "fallback", rollout, act, window, via)
        outcome = outcome if outcome == "smoke_failed" else "fallback"
        return result(outcome, f"{detail}; running the portable fallback {fsku}", active, smoke.latency_ms)

    def _previous_latency(
        self, model: str, act: dict[str, Any] | None, entry: dict[str, Any], staged: Path
    ) -> float | None:
        """The active engine's time on the same golden inputs, for the latency-regression gate."""
        if act is None:
            return None
        prev = self._slot_doc(model, act["slot"])
        if prev is None:
            return None
        try:
            golden = _arrays((staged / "golden.npz").read_bytes())
            with _load(prev["entry"], self._model_dir(model) / "slots" / act["slot"] / "engine") as runner:
                return _timed(runner, golden, entry)[1]
        except Exception as exc:  # the old engine cannot time the new inputs: no ratio, not a failure
            log.debug("%s: previous engine not timed: %s", self.device.id, exc)
            return None

    def _result(
        self,
        model: str,
        rollout: str | None,
        desired: str | None,
        outcome: str,
        detail: str,
        active: dict[str, Any] | None,
        t0: float,
        latency: float | None = None,
        previous: float | None = None,
        attempt: int | None = None,
    ) -> AgentResult:
        return AgentResult(
            device=self.device.id,
            model=model,
            rollout=rollout,
            desired=desired,
            outcome=outcome,
            detail=detail,
            active=active,
            latency_ms=latency,
            previous_latency_ms=previous,
            attempt=attempt,
            seconds=round(time.perf_counter() - t0, 4),
        )

    def _signing_key(self) -> SigningKey:
        if self.key is None:
            self.key = identity.device_key(self.state_dir)
        return self.key

    def _report(self, model: str, result: AgentResult, doc: RolloutDoc | None) -> AgentResult:
        """Tell the controller, signed with the device key, about installs of the rollout's own
        release (returning to the previous release on a rollback is not evidence about the new one)."""
        if doc is None or result.rollout != doc.id or result.desired != doc.release:
            return result
        key = report_key(model, doc.id, result.outcome, self.device.id)
        ratio = (
            result.latency_ms / result.previous_latency_ms if result.latency_ms and result.previous_latency_ms else None
        )
        client = self.client
        body = {
            "device": self.device.id,
            "sku": self.device.sku,
            "device_class": self.device.device_class,
            "arch": self.device.arch,
            "ring": self.device.ring,
            "model": model,
            "rollout": doc.id,
            "release": result.desired,
            "active": result.active,
            "outcome": result.outcome,
            "detail": result.detail,
            "latency_ms": result.latency_ms,
            "previous_latency_ms": result.previous_latency_ms,
            "latency_ratio": ratio,
            "at": _iso(self._now),
            "attempt": result.attempt or 1,
            "trusted_timestamp": client.trusted_timestamp_version() if client is not None else None,
        }
        data = identity.sign_report(self._signing_key(), body)
        marker = self._model_dir(model) / "reported.json"
        try:
            before = read_json(marker)
        except (FileNotFoundError, ValueError):
            before = {}
        try:
            self.store.put(key, data)
            old = before.get(doc.id)
            if old and old != key:
                self.store.delete(old)  # one report per device and rollout: its latest outcome
        except ServiceError as exc:
            log.warning("%s: report not delivered (%s); the next pass sends it", self.device.id, exc.message)
            return result
        before[doc.id] = key
        atomic_write_json(marker, before)
        if result.outcome in RETRIED:
            self._reported_failure(model, doc.id)
        return result.model_copy(update={"reported": key})


def _iso(t: datetime) -> str:
    return t.isoformat()


def _committed(act: dict[str, Any]) -> dict[str, Any]:
    """An active document without its health window (nothing left to go back to)."""
    return {k: v for k, v in act.items() if k not in ("previous", "health_until")}


def load_device(path: str | os.PathLike) -> DeviceConfig:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise InputError(
            f"cannot read the device file {path}: {exc}", hint="write a YAML mapping (docs/rollout.md)"
        ) from exc
    from pydantic import ValidationError

    try:
        return DeviceConfig.model_validate(data)
    except ValidationError as exc:
        raise InputError(
            f"{path}: " + "; ".join(validation_problems(exc, DeviceConfig, ())),
            hint="see docs/rollout.md for the device file",
        ) from None
