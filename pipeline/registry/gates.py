"""Promotion gates: each a small function of what MLflow holds, returning a typed result.

They read the manifest and latency samples the publish step uploaded, never the local build
folder: promotion runs wherever the registry is reachable (a release job, a laptop).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..config import PerformanceGate
from ..errors import InputError
from .reports import GateResult
from .stats import compare_latency


def chain_gate(chain: Sequence[str], alias: str, version: str, holds: Sequence[str]) -> GateResult:
    """A version enters the first alias freely; a later alias only from the one before it."""
    i = list(chain).index(alias)
    if i == 0:
        return GateResult(name="chain", passed=True, detail=f"{alias!r} is the first alias of the chain")
    before = chain[i - 1]
    if before in holds:
        return GateResult(name="chain", passed=True, detail=f"version {version} holds {before!r}, the alias before {alias!r}")
    return GateResult(name="chain", passed=False,
                      detail=f"version {version} does not hold {before!r} (it holds {', '.join(holds) or 'no alias'}); "
                             f"promote it to {before!r} first", data={"required": before, "holds": list(holds)})


def correctness_gate(manifest: dict[str, Any]) -> GateResult:
    """Outputs within tolerance, task metric within its allowed drop, precision gate (placement
    is its own gate)."""
    c = manifest["correctness"]
    bad = [f"output {o['output']}: max abs error {o['max_abs_error']:.3g}, {o['mismatch_fraction']:.1%} beyond tolerance"
           for o in c.get("outputs", []) if not o.get("passed")]
    bad += [f"{m['split']} metric dropped {-m['delta']:.4f} (allowed {m['max_drop']})"
            for m in c.get("metrics", []) if not m.get("passed")]
    if not (c.get("precision") or {}).get("passed", True):
        bad.append(f"{c['precision']['mismatched_layers']} layers ran in another precision than {c['precision']['requested']}")
    if bad:
        return GateResult(name="correctness", passed=False, detail="; ".join(bad), data={"failures": c.get("failures", [])})
    return GateResult(name="correctness", passed=True,
                      detail=f"{len(c.get('outputs', []))} outputs within tolerance, {len(c.get('metrics', []))} task metrics within their drop")


def placement_gate(manifest: dict[str, Any]) -> GateResult:
    p = manifest["correctness"].get("placement") or {}
    allowed = ", ".join(p.get("allowed") or []) or "the requested devices"
    if p.get("passed"):
        return GateResult(name="placement", passed=True, detail=f"every layer on {allowed}")
    return GateResult(name="placement", passed=False, detail=f"{p.get('offending')} layers ran outside {allowed}",
                      data={"offending": p.get("offending"), "allowed": p.get("allowed")})


def manifest_gate(document: Any, version_digest: str | None) -> GateResult:
    """The uploaded manifest matches its schema, its own digest and the version's digest tag."""
    from ..manifest import validate_document

    try:
        validate_document(document, "the manifest artifact")
    except InputError as exc:
        return GateResult(name="manifest", passed=False, detail=exc.message)
    if version_digest != document["digest"]:
        return GateResult(name="manifest", passed=False,
                          detail=f"the manifest artifact has digest {document['digest'][:12]}, the version's tag says "
                                 f"{(version_digest or 'nothing')[:12]}: the artifact was replaced after registration")
    # Manifest signing does not exist yet; when it does, this gate checks the signature too.
    return GateResult(name="manifest", passed=True, detail=f"schema-valid, digest {document['digest'][:12]} (unsigned)")


def performance_gate(candidate: Sequence[float] | None, incumbent: Sequence[float] | None, incumbent_version: str | None,
                     alias: str, settings: PerformanceGate) -> GateResult:
    """Candidate latency samples against those of the version holding ``alias`` now."""
    if incumbent_version is None:
        return GateResult(name="performance", passed=True, detail=f"no version holds {alias!r}: nothing to compare")
    if candidate is None or incumbent is None:
        which = "candidate" if candidate is None else f"version {incumbent_version}"
        return GateResult(name="performance", passed=settings.on_noisy == "allow",
                          detail=f"no latency samples for the {which}: cannot compare",
                          data={"outcome": "too_noisy"})
    cmp = compare_latency(candidate, incumbent, max_regression=settings.max_regression, alpha=settings.alpha,
                          confidence=settings.confidence, resamples=settings.bootstrap, min_samples=settings.min_samples)
    passed = cmp.outcome == "not_regressed" or (cmp.outcome == "too_noisy" and settings.on_noisy == "allow")
    note = " (release.performance.on_noisy: allow)" if cmp.outcome == "too_noisy" and passed else ""
    return GateResult(name="performance", passed=passed,
                      detail=f"against version {incumbent_version}: {cmp.outcome.replace('_', ' ')}; {cmp.reason}{note}",
                      data=cmp.to_json() | {"incumbent": incumbent_version})


def release_gate(required: Sequence[str], present: Sequence[str], why: dict[str, str] | None = None) -> GateResult:
    """Every SKU the promotion covers has a version to move (``why``: SKU -> what is missing)."""
    missing = [s for s in required if s not in present]
    if missing:
        each = ", ".join(f"{s} ({(why or {}).get(s)})" if (why or {}).get(s) else s for s in missing)
        return GateResult(name="release_skus", passed=False,
                          detail=f"no version to promote for {each}; {len(required) - len(missing)} of "
                                 f"{len(required)} SKUs present", data={"missing": missing})
    return GateResult(name="release_skus", passed=True, detail=f"all {len(required)} SKUs present")
