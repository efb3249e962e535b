"""Releases: the engines of one model version, per SKU, signed into the release store.

``publish_release`` gathers each SKU's engine with its manifest, signature, golden inputs and the
engine's own outputs on them (from the MLflow version holding an alias, or from this project's
build folder), re-checks every gate from that evidence (fail closed), stores the files by content
and commits one TUF targets update holding them, the release document and the per-(model, SKU)
channel pointers. The commit is the last write: until it lands no reader sees any of it.

Every release carries the portable fallback (``rollout.fallback_sku``, an ONNX Runtime CPU FP32
engine built and validated like any other); a release without it is refused.

Where the model's SKUs name device classes (``skus.<s>.device_class``), the release also carries
the selection (pipeline.verify.selection): ``classes``, device class -> the SKU selected for it, and
the digest of the selection record it came from. A record present must be current (read_selection:
an edited or stale one is refused, exit 2); an absent one is computed as `skuforge select` does.
Each selected engine must be in the release as the very manifest the record weighed; a device
declaring its class runs that engine (pipeline.rollout.agent).
"""

from __future__ import annotations

import io
import json
import logging
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from pipeline.backends import backend_class
from pipeline.core.errors import ConfigError, GateFailed, InputError
from pipeline.core.io import read_json, sha256_arrays
from pipeline.core.paths import Layout
from pipeline.project.artifacts import layout, run_plan
from pipeline.project.config import Registry
from pipeline.results.manifest import Manifest, evidence_digest
from pipeline.results.reports import Result
from pipeline.results.selection import SelectionRecord
from pipeline.results.signing import signing_key
from pipeline.rollout import trust
from pipeline.rollout.doc import RELEASE_DOC, RELEASES, release_path
from pipeline.rollout.store import Store
from pipeline.tracking.client import TAG_DIGEST, connect, registered_model_name, version_signature
from pipeline.tracking.evidence import collect
from pipeline.tracking.gates import correctness_problems, engine_gate, manifest_gate, placement_gate, signature_gate
from pipeline.tracking.promotion import _bench, _download, _engine_files
from pipeline.tracking.publish import MANIFEST_ARTIFACT, REPORT_ARTIFACTS
from pipeline.verify.selection import classes_of, read_selection, select, write_selection

log = logging.getLogger(__name__)

CHANNELS = "channels"
RELEASE_ID = re.compile(r"r(\d+)")
SCHEMA = 1


@dataclass
class Candidate:
    """One SKU's engine and its evidence, as gathered for a release (files on local disk). From
    MLflow, what could not be had is None, and ``problems`` names each report missing; check()
    refuses such a candidate, so what follows it reads a complete one."""

    sku: str
    manifest: Manifest | None  # None: missing, unreadable or refused
    manifest_doc: dict
    signature: Any
    engine: dict[str, Path]  # relative path -> file, engine.json included
    golden: Path | None
    expected: Path | None
    validate: Path | None
    source: str
    problems: list[str] = field(default_factory=list)


class ReleaseSku(Result):
    sku: str
    backend: str
    precision: str
    manifest_digest: str
    source: str
    files: dict[str, Any]
    bytes: int


class ReleaseResult(Result):
    model: str
    release: str
    created: bool
    store: str
    fallback_sku: str | None
    partial: list[str] = Field(default_factory=list, description="release SKUs it lacks (--allow-partial)")
    skus: list[ReleaseSku]
    classes: dict[str, str] = Field(
        default_factory=dict, description="device class -> the SKU selected for it (empty: the model has no classes)"
    )
    unselected: dict[str, str] = Field(
        default_factory=dict, description="device class -> why it has no engine (its devices run the fallback)"
    )
    selection: str | None = Field(None, description="digest of the selection record the class map came from")
    seconds: float


def channel_path(model: str, sku: str) -> str:
    return f"{CHANNELS}/{model}/{sku}.json"


def releases_of(targets, model: str) -> list[str]:
    """Release ids of ``model`` in the signed targets, oldest first."""
    found = set()
    prefix = f"{RELEASES}/{model}/"
    for path in targets.targets:
        if path.startswith(prefix) and path.endswith("/" + RELEASE_DOC):
            rid = path[len(prefix) :].split("/", 1)[0]
            if RELEASE_ID.fullmatch(rid):
                found.add(rid)
    return sorted(found, key=lambda r: int(r[1:]))


# --- gathering --------------------------------------------------------------------------------------


def local_candidate(registry: Registry, model: str, sku: str) -> Candidate:
    """The pair as this project's build folder holds it, signed now with the publishing key."""

    inputs = collect(registry.pair(model, sku))  # refuses a manifest that does not match its reports and engine
    out = layout(registry)
    m = inputs.manifest
    return Candidate(
        sku=sku,
        manifest=m,
        manifest_doc=read_json(inputs.manifest_path),
        signature=signing_key().sign(m.digest, model, sku).to_json(),
        engine={rel: inputs.engine_dir / rel for rel in inputs.engine_files},
        golden=out.split(model, "golden"),
        expected=out.engine_outputs(model, sku),
        validate=out.report(model, sku, "validate"),
        source=str(inputs.manifest_path),
    )


def mlflow_candidate(tracking, registry: Registry, model: str, sku: str, alias: str, into: Path) -> Candidate | None:
    """The version of ``<model>.<sku>`` holding ``alias``, downloaded under ``into``; None when no
    version holds it."""

    name = registered_model_name(registry.release, model, sku)
    try:
        version = tracking.call(
            f"read alias {alias} of {name}",
            tracking.client.get_model_version_by_alias,
            name,
            alias,
            expect={"RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"},
        )
    except Exception as exc:
        if getattr(exc, "error_code", None) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise
    run = version.run_id
    into = into / sku
    into.mkdir(parents=True)
    manifest_file = _download(tracking, run, MANIFEST_ARTIFACT, str(into))
    problems = []
    doc: dict = {}
    if manifest_file is None:
        problems.append(f"{name} v{version.version}: no manifest artifact")
    else:
        try:
            doc = json.loads(manifest_file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            problems.append(f"{name} v{version.version}: the manifest artifact is not JSON")
    # the digest tag set at registration: an artifact replaced afterwards no longer matches it
    gate = manifest_gate(doc, (version.tags or {}).get(TAG_DIGEST), registry, _bench(tracking, run)) if doc else None
    if gate is not None and not gate.passed:
        problems.append(f"{name} v{version.version}: manifest: {gate.detail}")
    reports = {
        n: _download(tracking, run, f"{REPORT_ARTIFACTS}/{n}", str(into))
        for n in ("validate.json", "outputs.npz", "golden.npz")
    }
    missing = [n for n, p in reports.items() if p is None]
    if missing:
        problems.append(
            f"{name} v{version.version}: no {', '.join(missing)} among its reports (published before "
            "releases needed them: publish the engine again)"
        )
    engine = _engine_files(tracking, run, str(into / "engine-dl")) or {}
    signature = version_signature(version.tags)
    manifest = Manifest.model_validate(doc) if doc and not problems else None
    return Candidate(
        sku=sku,
        manifest=manifest,
        manifest_doc=doc,
        signature=signature,
        engine=engine,
        golden=reports["golden.npz"],
        expected=reports["outputs.npz"],
        validate=reports["validate.json"],
        source=f"mlflow {name} v{version.version} ({alias})",
        problems=problems,
    )


def check(registry: Registry, model: str, c: Candidate, alias: str | None) -> list[str]:
    """Every reason not to ship this engine, recomputed from its evidence."""
    import numpy as np

    if c.problems or c.manifest is None:
        return c.problems or [f"{c.sku}: no usable manifest"]
    # mlflow_candidate lists a problem for each report it could not download
    assert c.validate is not None and c.expected is not None and c.golden is not None
    m, bad = c.manifest, []
    if (m.model, m.sku) != (model, c.sku):
        return [f"{c.sku}: the manifest describes {m.model}/{m.sku}"]
    bad += [f"{c.sku}: correctness: {p}" for p in correctness_problems(m, registry)]
    for gate in (placement_gate(m, registry), engine_gate(m, c.engine, c.source)):
        if not gate.passed:
            bad.append(f"{c.sku}: {gate.name}: {gate.detail}")
    if alias is not None:
        gate = signature_gate(c.signature, m, alias, registry)
        if not gate.passed:
            bad.append(f"{c.sku}: signature: {gate.detail}")
    if evidence_digest("validate.json", c.validate) != m.evidence.files.get("validate.json"):
        bad.append(f"{c.sku}: validate.json is not the report the manifest was written from")
        return bad
    want = read_json(c.validate).get("outputs_sha256")
    try:
        with np.load(c.expected, allow_pickle=False) as z:
            expected = {k: z[k] for k in z.files}
        with np.load(c.golden, allow_pickle=False) as z:
            golden = {k: z[k] for k in z.files}
    except (OSError, ValueError) as exc:
        return bad + [f"{c.sku}: golden data unreadable: {exc}"]
    if want is None or sha256_arrays(expected) != want:
        bad.append(f"{c.sku}: the engine's golden outputs are not the ones validate recorded")
    # the data stage hashes the whole golden file (inputs and, where the set has them, labels)
    if any(i.name not in golden for i in m.signature.inputs) or sha256_arrays(golden) != m.datasets.get("golden"):
        bad.append(f"{c.sku}: the golden inputs are not the set the manifest was validated on")
    return bad


# --- the selection ----------------------------------------------------------------------------------


def selection_of(registry: Registry, model: str) -> SelectionRecord | None:
    """The model's selection record, current; None when no SKU of it names a device class (nothing to
    select: devices run their SKU's engine, as without classes). A record present must be the one
    its manifests give (read_selection: an edited or stale one is refused, exit 2, for what was
    reviewed is not what would ship); an absent one (git ignores build/.selection: a fresh checkout
    has the manifests, not the record) is computed as `skuforge select` computes it, and written."""
    if not classes_of(registry, model):
        return None
    path = Layout(registry.root).selection(model)
    if path.is_file():
        return read_selection(registry, model)
    record = select(registry, model)
    write_selection(registry, record)
    log.info(
        "release %s: no selection record; computed from the manifests and wrote %s (digest %s)",
        model,
        path.relative_to(registry.root).as_posix(),
        record.digest[:12],
    )
    return record


def class_map(
    record: SelectionRecord, shipped: dict[str, Manifest], allow_partial: list[str]
) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """Device class -> the SKU the release serves it with, class -> why it has none, and every
    reason to refuse: a selected engine must be in the release as the manifest the record weighed
    (a selected SKU left out only by --allow-partial leaves its class to the fallback)."""
    classes, unselected, problems = {}, {}, []
    for c in record.classes:
        if c.chosen is None:
            unselected[c.device_class] = c.summary
            continue
        m, weighed = shipped.get(c.chosen), record.manifests.get(c.chosen)
        if m is None and c.chosen in allow_partial:
            unselected[c.device_class] = f"{c.chosen} selected, not in this release (--allow-partial)"
        elif m is None:
            problems.append(
                f"device class {c.device_class} selects {c.chosen}, which this release does not hold "
                "(add it to release.skus / --sku, or --allow-partial it: its devices then run the fallback)"
            )
        elif m.digest != weighed:
            problems.append(
                f"device class {c.device_class} selects {c.chosen} with manifest {(weighed or '?')[:12]}, "
                f"the release holds {m.digest[:12]} (promote the engine that was selected, or select again)"
            )
        else:
            classes[c.device_class] = c.chosen
    return classes, unselected, problems


# --- the release document ---------------------------------------------------------------------------


def _requires(registry: Registry, m: Manifest, engine_meta: dict) -> dict[str, Any]:
    """What a device needs to run the engine: architecture, CPU features, runtime versions."""

    sku = registry.sku(m.sku)
    backend = backend_class(m.backend)
    portable = bool(engine_meta.get("portable"))
    keys = backend.runtime_keys
    return {
        "arch": None if portable else sku.target.arch,
        "cpu_features": [] if portable else list(sku.target.cpu_features),
        "exact": {} if portable else {k: engine_meta.get("versions", {}).get(k) for k in keys},
        "specifiers": {k: v for k, v in sku.toolchain.items() if k in keys},
        "portable": portable,
    }


def _sku_entry(registry: Registry, model: str, rid: str, c: Candidate, shas: dict[str, str]) -> dict[str, Any]:

    m = c.manifest
    assert m is not None  # a candidate check() passed
    base = release_path(model, rid, c.sku)
    engine_meta = json.loads(c.engine["engine.json"].read_bytes()) if "engine.json" in c.engine else {}
    pair = registry.pair(model, c.sku)
    in_idx, out_idx, batch = run_plan(pair, m.signature)
    return {
        "backend": m.backend,
        "precision": m.precision,
        "manifest_digest": m.digest,
        "source": c.source,
        "sku_spec": pair.sku_spec.model_dump(mode="json"),
        "requires": _requires(registry, m, engine_meta),
        "files": {
            "manifest": f"{base}/manifest.json",
            "signature": f"{base}/signature.json",
            "golden": f"{base}/golden.npz",
            "expected": f"{base}/expected.npz",
            "engine": {rel: f"{base}/engine/{rel}" for rel in sorted(c.engine)},
        },
        "sha256": shas,
        "run": {"batch": batch, "inputs": in_idx, "outputs": out_idx},
        "tolerance": [
            {"output": o.output, "atol": o.atol, "rtol": o.rtol, "max_mismatch": o.max_mismatch}
            for o in m.correctness.outputs
        ],
        "p50_ms": m.benchmark.engine_only.p50_ms if m.benchmark is not None else None,
    }


def _files(c: Candidate) -> dict[str, bytes]:
    """Target-relative name -> bytes of one SKU's release files."""
    assert c.manifest is not None and c.golden is not None and c.expected is not None  # check() passed it
    out = {
        "manifest.json": json.dumps(c.manifest_doc, indent=2, sort_keys=True).encode(),
        "signature.json": json.dumps(c.signature, sort_keys=True).encode(),
        "golden.npz": _inputs_only(c.golden, c.manifest),
        "expected.npz": c.expected.read_bytes(),
    }
    out.update({f"engine/{rel}": path.read_bytes() for rel, path in c.engine.items()})
    return out


def _inputs_only(path: Path, m: Manifest) -> bytes:
    """The golden set without labels: a device needs the inputs only."""
    import numpy as np

    with np.load(path, allow_pickle=False) as z:
        arrays = {i.name: z[i.name] for i in m.signature.inputs}
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _upload(store: Store, model: str, uploads: dict[str, dict[str, bytes]]) -> dict[str, dict[str, str]]:
    """Store every file by content, saying how far it got (a release is tens of MB to GB)."""
    total = sum(len(d) for files in uploads.values() for d in files.values())
    done, shas = 0, {}
    for sku, files in uploads.items():
        shas[sku] = {name: trust.put_blob(store, data) for name, data in files.items()}
        done += sum(len(d) for d in files.values())
        log.info("release %s: uploaded %s (%.1f of %.1f MB)", model, sku, done / 1e6, total / 1e6)
    return shas


def publish_release(
    registry: Registry,
    store: Store,
    keys: trust.Keys,
    model: str,
    *,
    alias: str | None = None,
    tracking=None,
    skus: list[str] | None = None,
    allow_partial: list[str] | None = None,
    actor: str = "unknown",
) -> ReleaseResult:
    """Gather, check, upload and commit one release of ``model``. With ``alias``, the engines are the
    MLflow versions holding it (and their signatures must be trusted for it); without, this
    project's build folder. Idempotent: the same engines as the newest release publish nothing new.

    A release holds every SKU of ``release.skus``: devices of a SKU it lacks run the portable
    fallback, so a release missing any is refused unless ``allow_partial`` names each missing one
    (``skus`` narrows what is gathered; the SKUs it leaves out count as missing too)."""

    t0 = time.perf_counter()
    registry.model(model)
    fallback = registry.rollout.fallback_sku
    required = list(dict.fromkeys([*registry.release_skus(), *([fallback] if fallback else [])]))
    wanted = list(dict.fromkeys([*(skus or required), *([fallback] if fallback else [])]))
    for s in [*wanted, *(allow_partial or [])]:
        registry.sku(s)
    selection = selection_of(registry, model)  # before any download: a stale record fails fast
    log.info(
        "release %s: gathering %d SKU(s) from %s",
        model,
        len(wanted),
        f"MLflow alias {alias}" if alias else "the build folder",
    )
    with tempfile.TemporaryDirectory(prefix="skuforge-release-") as tmp:
        candidates, absent = _gather(registry, model, wanted, alias, tracking, skus is None, Path(tmp))
        missing = _complete(model, required, candidates, absent, fallback, alias, allow_partial or [])
        log.info("release %s: checking %d engine(s) against their evidence", model, len(candidates))
        problems = [p for c in candidates for p in check(registry, model, c, alias)]
        if problems:
            raise GateFailed(
                f"release of {model} refused: " + "; ".join(problems),
                hint="fix or rebuild the engines named; nothing was published",
            )
        if not candidates:
            raise InputError(
                f"no engine of {model} to release" + (f" holds {alias!r}" if alias else ""),
                hint="promote or build the engines first",
            )
        uploads = {c.sku: _files(c) for c in candidates}
        shas = _upload(store, model, uploads)
        manifests: dict[str, Manifest] = {}
        for c in candidates:
            assert c.manifest is not None  # check() passed it
            manifests[c.sku] = c.manifest
        classes, unselected, refused_classes = (
            class_map(selection, manifests, allow_partial or []) if selection is not None else ({}, {}, [])
        )
        if refused_classes:
            raise GateFailed(
                f"release of {model} refused: " + "; ".join(refused_classes),
                hint="the selection and the release must name the same engines; nothing was published",
            )
        draft = _Draft(
            registry=registry,
            store=store,
            model=model,
            candidates=candidates,
            uploads=uploads,
            shas=shas,
            digests={s: m.digest for s, m in manifests.items()},
            classes=classes,
            fields={
                "actor": actor,
                "source": f"mlflow alias {alias}" if alias else "build folder",
                "fallback_sku": fallback,
                "partial": missing,
                "selection": None
                if selection is None
                else {"digest": selection.digest, "objective": selection.objective, "unselected": unselected},
            },
        )
        log.info("release %s: committing the signed metadata", model)
        trust.commit(store, keys, registry.rollout.expiry, draft.change, what=f"release {model}")
    return ReleaseResult(
        model=model,
        release=draft.release,
        created=draft.created,
        store=store.url,
        fallback_sku=fallback,
        partial=missing,
        skus=[_row(c, manifests[c.sku], shas[c.sku], uploads[c.sku]) for c in candidates],
        classes=classes,
        unselected=unselected,
        selection=selection.digest if selection is not None else None,
        seconds=round(time.perf_counter() - t0, 3),
    )


def _row(c: Candidate, m: Manifest, shas: dict[str, str], files: dict[str, bytes]) -> ReleaseSku:
    return ReleaseSku(
        sku=c.sku,
        backend=m.backend,
        precision=m.precision,
        manifest_digest=m.digest,
        source=c.source,
        files=shas,
        bytes=sum(len(d) for d in files.values()),
    )


def _gather(
    registry: Registry,
    model: str,
    wanted: list[str],
    alias: str | None,
    tracking: Any,
    skip_unbuilt: bool,
    tmp: Path,
) -> tuple[list[Candidate], list[str]]:
    """The engines of ``wanted``, from the MLflow versions holding ``alias`` or this build folder,
    and the SKUs that have none (a build folder's SKU without a manifest is left out only when the
    SKUs were not named: ``skip_unbuilt``). An engine that is not what its manifest says is refused."""
    if alias is not None:
        if alias not in registry.release.aliases:
            raise ConfigError(f"unknown alias {alias!r}", hint=f"aliases: {', '.join(registry.release.aliases)}")
        tracking = tracking or connect(registry)
        found = {s: mlflow_candidate(tracking, registry, model, s, alias, tmp) for s in wanted}
        return [c for c in found.values() if c is not None], [s for s, c in found.items() if c is None]
    candidates: list[Candidate] = []
    absent: list[str] = []
    refused: list[str] = []
    for s in wanted:
        if not Layout(registry.root).manifest(model, s).is_file() and skip_unbuilt:
            log.info("%s/%s: no manifest in this build folder, left out of the release", model, s)
            absent.append(s)
            continue
        try:
            candidates.append(local_candidate(registry, model, s))
        except InputError as exc:  # there, but not what its manifest says: never shipped quietly
            refused.append(f"{s}: {exc.message}")
    if refused:
        raise GateFailed(
            f"release of {model} refused: " + "; ".join(refused),
            hint="rebuild the engines named (skuforge repro); nothing was published",
        )
    return candidates, absent


def _complete(
    model: str,
    required: list[str],
    candidates: list[Candidate],
    absent: list[str],
    fallback: str | None,
    alias: str | None,
    allow_partial: list[str],
) -> list[str]:
    """The required SKUs the release lacks; refused unless each is allowed (the fallback never is)."""
    if fallback in absent:
        raise GateFailed(
            f"the release of {model} lacks the portable fallback {fallback}" + (f" holding {alias!r}" if alias else ""),
            hint=f"build, validate and promote {model}/{fallback} with the other SKUs",
        )
    missing = [s for s in required if s not in {c.sku for c in candidates}]
    unallowed = [s for s in missing if s not in allow_partial]
    if unallowed and fallback not in unallowed:
        flags = " ".join(f"--allow-partial {s}" for s in unallowed)
        raise GateFailed(
            f"the release of {model} would lack {len(unallowed)} of its {len(required)} SKUs: "
            f"{', '.join(unallowed)} (their devices would run the portable fallback {fallback})"
            if fallback
            else f"the release of {model} would lack {', '.join(unallowed)} (their devices would run nothing new)",
            hint=f"build, validate and promote them first, or ship without them knowingly: {flags}; "
            "`skuforge rollout plan` counts the devices that would take the fallback",
        )
    return missing


@dataclass
class _Draft:
    """A release about to be committed: ``change`` adds it to the signed targets unless the newest
    release already holds the same engines and class map (then it records that release)."""

    registry: Registry
    store: Store
    model: str
    candidates: list[Candidate]
    uploads: dict[str, dict[str, bytes]]
    shas: dict[str, dict[str, str]]
    digests: dict[str, str]
    classes: dict[str, str]
    fields: dict[str, Any]  # the release document's fields besides its identity, SKUs and classes
    release: str = ""
    created: bool = False

    def change(self, targets, state) -> bool:
        model, store = self.model, self.store
        existing = releases_of(targets, model)
        if existing:
            raw = trust.read_target(store, state, release_path(model, existing[-1], RELEASE_DOC))
            assert raw is not None  # releases_of listed it from these targets
            doc = json.loads(raw)
            same = {s: e["manifest_digest"] for s, e in doc["skus"].items()} == self.digests
            if same and doc.get("classes", {}) == self.classes:  # what devices act on: engines, class map
                self.release, self.created = existing[-1], False
                return False
        rid = f"r{int(existing[-1][1:]) + 1 if existing else 1}"
        entries = {c.sku: _sku_entry(self.registry, model, rid, c, self.shas[c.sku]) for c in self.candidates}
        for c in self.candidates:
            base = release_path(model, rid, c.sku)
            for name, data in self.uploads[c.sku].items():
                trust.add_target(targets, f"{base}/{name}", data, {"model": model, "sku": c.sku, "release": rid})
        doc = {
            "schema": SCHEMA,
            "model": model,
            "release": rid,
            "previous": existing[-1] if existing else None,
            "created": trust._now().isoformat(),
            **self.fields,
            "skus": entries,
            "classes": self.classes,
        }
        data = json.dumps(doc, indent=2, sort_keys=True).encode()
        trust.put_blob(store, data)
        trust.add_target(targets, release_path(model, rid, RELEASE_DOC), data, {"model": model, "release": rid})
        for c in self.candidates:
            pointer = json.dumps(
                {"model": model, "sku": c.sku, "release": rid, "release_doc": release_path(model, rid, RELEASE_DOC)},
                sort_keys=True,
            ).encode()
            trust.put_blob(store, pointer)
            trust.add_target(targets, channel_path(model, c.sku), pointer, {"model": model, "sku": c.sku})
        self.release, self.created = rid, True
        return True


def release_doc(store: Store, model: str, release: str) -> dict | None:
    """A release document as a writer reads it (hash-checked against the signed targets)."""
    state = trust.read_state(store)
    data = trust.read_target(store, state, release_path(model, release, RELEASE_DOC))
    return None if data is None else json.loads(data)
