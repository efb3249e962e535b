"""Correctness metrics: each output against the reference (element-wise error, agreement of class
scores, non-finite values), the verdict of a tolerance on those figures, and task metrics.
docs/correctness.md describes every figure and the tolerance policy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .config import CLASS_KINDS, Tolerance, TolerancePolicy
from .errors import ConfigError
from .results import OutputError, OutputKind

if TYPE_CHECKING:
    import numpy as np

# A bump to the next float64 may be needed where (x - y) + y rounds below x; a few always suffice.
_MAX_ULP_STEPS = 64


def infer_kind(reference: "np.ndarray") -> OutputKind:
    """``probabilities`` when the reference holds floats in [0, 1] whose rows along the last axis
    (two or more classes) sum to 1; otherwise ``regression``. Logits and state cannot be told from
    values: declare them in ``models.<m>.output_kinds``."""
    import numpy as np

    r = np.asarray(reference)
    if r.dtype.kind != "f" or r.ndim == 0 or r.size == 0 or r.shape[-1] < 2 or not np.isfinite(r).all():
        return "regression"
    if r.min() < 0 or r.max() > 1:
        return "regression"
    # a float32 softmax over C classes sums to 1 within a few C * eps
    slack = max(1e-3, 4 * r.shape[-1] * float(np.finfo(r.dtype).eps))
    return "probabilities" if bool(np.all(np.abs(r.sum(axis=-1, dtype=np.float64) - 1) <= slack)) else "regression"


def check_declared_kinds(policy: TolerancePolicy, outputs: Sequence[str], model: str) -> None:
    """A declared output kind must name an output the model is checked on (params.yaml cannot know
    the names when ``outputs`` is left out)."""
    unknown = sorted(set(policy.declared) - set(outputs))
    if unknown:
        raise ConfigError(f"models.{model}.output_kinds names {', '.join(map(repr, unknown))}, not an output of the model "
                          f"(outputs: {', '.join(outputs)})", hint="fix the output names under output_kinds")


def output_errors(engine: Mapping[str, "np.ndarray"], reference: Mapping[str, "np.ndarray"], outputs: Sequence[str],
                  policy: TolerancePolicy, model: str) -> list[OutputError]:
    """Every checked output of a model against the reference, each with its kind's tolerance."""
    check_declared_kinds(policy, outputs, model)
    return [output_error(name, engine[name], reference[name], policy) for name in outputs]


def output_error(name: str, engine: "np.ndarray", reference: "np.ndarray", tol: Tolerance | TolerancePolicy,
                 kind: OutputKind | None = None) -> OutputError:
    """The figures of one output and the verdict of the tolerance for its kind (given, declared in
    the policy, else inferred from the reference). The element-wise check is numpy.isclose's:
    |engine - reference| <= atol + rtol * |reference|; a NaN or Inf where the reference is finite
    always fails; where the reference is NaN or Inf the engine must hold the same."""
    import numpy as np

    declared = kind or (tol.declared.get(name) if isinstance(tol, TolerancePolicy) else None)
    kind = declared or infer_kind(reference)
    t = tol.for_kind(kind) if isinstance(tol, TolerancePolicy) else tol
    head = {"output": name, "kind": kind, "kind_inferred": declared is None, "atol": t.atol, "rtol": t.rtol,
            "max_mismatch": t.max_mismatch,
            "min_top1_agreement": t.min_top1_agreement if kind in CLASS_KINDS else None}
    if np.shape(engine) != np.shape(reference):
        return OutputError(**head, **_no_figures(), shape_mismatch=f"engine {list(np.shape(engine))} vs reference "
                                                                   f"{list(np.shape(reference))}",
                           mismatch_fraction=1.0, passed=False)
    e = np.asarray(engine, dtype=np.float64)
    r = np.asarray(reference, dtype=np.float64)
    ref_finite, both = np.isfinite(r), np.isfinite(r) & np.isfinite(e)
    nan, inf = np.isnan(e) & ref_finite, np.isinf(e) & ref_finite
    unexpected = nan | inf
    # a NaN or Inf of the reference is matched only by the same in the engine
    unmatched = int(np.count_nonzero(~ref_finite & ~(np.isnan(r) & np.isnan(e)) & (r != e)))
    d = np.abs(e[both] - r[both])
    a = np.abs(r[both])
    n = r.size
    beyond = int(np.count_nonzero(d > t.atol + t.rtol * a)) + int(np.count_nonzero(unexpected)) + unmatched
    rel = d[a > 0] / a[a > 0]
    first = [int(i) for i in np.unravel_index(int(np.argmax(unexpected)), r.shape)] if unexpected.any() else None
    allowed = _allowed_beyond(n, t.max_mismatch)
    hopeless = unmatched if first is None else n + 1  # elements no tolerance can pass
    top1, top5 = _agreement(e, r) if kind in CLASS_KINDS else (None, None)
    err = OutputError(
        **head,
        elements=n,
        nan_count=int(np.count_nonzero(nan)),
        inf_count=int(np.count_nonzero(inf)),
        first_non_finite=first,
        reference_non_finite=int(np.count_nonzero(~ref_finite)),
        **_spread(d, "abs"),
        max_abs_error=float(d.max()) if d.size else None,
        mean_abs_error=float(d.mean()) if d.size else None,
        **_spread(rel, "rel"),
        max_rel_error=float(rel.max()) if rel.size else None,
        cosine_similarity=_cosine(e[both], r[both]),
        top1_agreement=top1,
        top5_agreement=top5,
        mismatch_fraction=beyond / n if n else 0.0,
        min_passing_atol=_smallest_passing(np.maximum(d - t.rtol * a, 0.0), allowed - hopeless,
                                           lambda x: np.count_nonzero(d > x + t.rtol * a)),
        min_passing_rtol=_smallest_passing(_rtol_needed(d, a, t.atol), allowed - hopeless,
                                           lambda x: np.count_nonzero(d > t.atol + x * a)),
        passed=False,
    )
    return err.model_copy(update={"passed": not output_problems(err, t)})


def output_problems(e: OutputError, tol: Tolerance | None = None) -> list[str]:
    """Which criteria the figures of ``e`` fail, one line each with the figures; empty: it passes.
    ``tol``: the thresholds to judge by (default: those ``e`` was measured with). The element-wise
    figures were taken at ``e``'s atol and rtol, whatever ``tol`` says: the caller checks those."""
    tol = tol or Tolerance(atol=e.atol, rtol=e.rtol, max_mismatch=e.max_mismatch, min_top1_agreement=e.min_top1_agreement or 0.0)
    where = f"output {e.output}"
    if e.shape_mismatch is not None:
        return [f"{where}: shape {e.shape_mismatch}"]
    bad = []
    if e.nan_count or e.inf_count:
        counts = " and ".join(f"{n} {what}" for n, what in ((e.nan_count, "NaN"), (e.inf_count, "Inf")) if n)
        bad.append(f"{where}: {counts} where the reference is finite, first at {e.first_non_finite}")
    if e.mismatch_fraction > tol.max_mismatch:
        passes_at = (f"passes at atol >= {_g(e.min_passing_atol)} or rtol >= {_g(e.min_passing_rtol)}"
                     if e.min_passing_atol is not None or e.min_passing_rtol is not None else "no atol or rtol passes")
        bad.append(f"{where}: {e.mismatch_fraction:.2%} of elements beyond atol={e.atol} rtol={e.rtol} "
                   f"(allowed {tol.max_mismatch:.2%}; max abs error {_g(e.max_abs_error)}, p99 {_g(e.p99_abs_error)}; "
                   f"{passes_at})")
    if e.kind in CLASS_KINDS and tol.min_top1_agreement > 0 and e.elements:
        if e.top1_agreement is None:
            bad.append(f"{where}: no top-1 agreement for a {e.kind} output (it needs finite reference rows of 2 or "
                       "more classes on the last axis)")
        elif e.top1_agreement < tol.min_top1_agreement:
            bad.append(f"{where}: top-1 agreement {e.top1_agreement:.2%} < {tol.min_top1_agreement:.2%} ({e.kind})")
    return bad


def _g(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _no_figures() -> dict:
    none = ("max_abs_error", "mean_abs_error", "median_abs_error", "p99_abs_error", "max_rel_error", "median_rel_error",
            "p99_rel_error", "cosine_similarity", "top1_agreement", "top5_agreement", "first_non_finite",
            "min_passing_atol", "min_passing_rtol")
    return dict.fromkeys(none) | {"elements": 0, "nan_count": 0, "inf_count": 0, "reference_non_finite": 0}


def _spread(x: "np.ndarray", what: str) -> dict[str, float | None]:
    import numpy as np

    median, p99 = (float(v) for v in np.quantile(x, [0.5, 0.99])) if x.size else (None, None)
    return {f"median_{what}_error": median, f"p99_{what}_error": p99}


def _cosine(x: "np.ndarray", y: "np.ndarray") -> float | None:
    import numpy as np

    nx, ny = float(np.sqrt(np.dot(x, x))), float(np.sqrt(np.dot(y, y)))
    if nx == 0 or ny == 0 or not np.isfinite(nx * ny):
        return None
    return float(np.clip(np.dot(x, y) / (nx * ny), -1.0, 1.0))


def _agreement(e: "np.ndarray", r: "np.ndarray") -> tuple[float | None, float | None]:
    """Top-1: the engine's top class is one where the reference has its maximum (ties agree).
    Top-5: the reference's top class is among the engine's five highest (more than 5 classes).
    Over rows of the last axis whose reference is finite; an engine row with NaN/Inf disagrees."""
    import numpy as np

    if r.ndim == 0 or r.shape[-1] < 2 or r.size == 0:
        return None, None
    classes = r.shape[-1]
    rows_r, rows_e = r.reshape(-1, classes), e.reshape(-1, classes)
    keep = np.isfinite(rows_r).all(axis=1)
    rows_r, rows_e = rows_r[keep], rows_e[keep]
    if not len(rows_r):
        return None, None
    sane = np.isfinite(rows_e).all(axis=1)
    scores = np.where(np.isfinite(rows_e), rows_e, -np.inf)
    at_max = rows_r == rows_r.max(axis=1, keepdims=True)
    top1 = at_max[np.arange(len(rows_r)), np.argmax(scores, axis=1)] & sane
    if classes <= 5:
        return float(top1.mean()), None
    five = np.argpartition(-scores, 4, axis=1)[:, :5]
    top5 = (five == np.argmax(rows_r, axis=1)[:, None]).any(axis=1) & sane
    return float(top1.mean()), float(top5.mean())


def _allowed_beyond(n: int, max_mismatch: float) -> int:
    """The most elements that may be beyond tolerance: the largest c with c / n <= max_mismatch,
    in the float arithmetic of the check itself."""
    if n == 0:
        return 0
    c = min(n, int(max_mismatch * n))
    while c < n and (c + 1) / n <= max_mismatch:
        c += 1
    while c > 0 and c / n > max_mismatch:
        c -= 1
    return c


def _rtol_needed(d: "np.ndarray", a: "np.ndarray", atol: float) -> "np.ndarray":
    """Per element, the least rtol that passes it at ``atol`` (inf where none does: r == 0)."""
    import numpy as np

    short = np.maximum(d - atol, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(short == 0, 0.0, np.where(a > 0, short / np.where(a > 0, a, 1.0), np.inf))


def _smallest_passing(needed: "np.ndarray", allowed: int, beyond_at) -> float | None:
    """The smallest value x with at most ``allowed`` elements beyond at x (``beyond_at(x)`` counts
    them): the (allowed+1)-th largest need, nudged up where rounding leaves its element beyond.
    None when even an infinite x leaves too many beyond."""
    import numpy as np

    if allowed < 0:
        return None
    if allowed >= needed.size:
        return 0.0
    x = float(np.partition(needed, needed.size - 1 - allowed)[needed.size - 1 - allowed])
    if not np.isfinite(x):
        return None
    for _ in range(_MAX_ULP_STEPS):
        if beyond_at(x) <= allowed:
            break
        x = float(np.nextafter(x, np.inf))
    else:
        raise AssertionError(f"no passing value found near {x!r}")  # a bug, not a user error
    for _ in range(_MAX_ULP_STEPS):
        below = float(np.nextafter(x, -np.inf))
        if below < 0 or beyond_at(below) > allowed:
            break
        x = below
    return x


def top1_accuracy(scores: "np.ndarray", labels: "np.ndarray") -> float:
    import numpy as np

    return float(np.mean(np.argmax(scores.reshape(len(labels), -1), axis=-1) == labels))


METRICS = {"top1_accuracy": top1_accuracy}
