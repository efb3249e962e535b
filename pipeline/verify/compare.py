"""Correctness metrics: each output against the reference (element-wise error, agreement of class
scores, non-finite values), the verdict of a tolerance on those figures, and task metrics.
docs/correctness.md describes every figure and the tolerance policy."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from pipeline.core.errors import ConfigError
from pipeline.project.config import CLASS_KINDS, Tolerance, TolerancePolicy
from pipeline.results import gatestats
from pipeline.results.reports import MetricResult, OutputError, OutputKind, Signature

if TYPE_CHECKING:
    import numpy as np

# A bump to the next float64 may be needed where (x - y) + y rounds below x; a few always suffice.
_MAX_ULP_STEPS = 64


def infer_kind(reference: np.ndarray) -> OutputKind:
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


# name parts that mark the two ends of a value carried from one call to the next (h0 -> hn, state -> stateN)
_STEP_MARK = re.compile(r"(?:[_.-]?(?:out|in|new|next|prev|old|cur|n|t|0|1))+$")


def state_outputs(signature: Signature) -> set[str]:
    """Outputs that look fed back as an input: an input of the same dtype and shape whose name is the
    output's once the step marks are taken off (h0/hn, state/stateN, past.*/present.*). Judged as
    ``state`` unless declared otherwise: the strictest kind, so a wrong guess errs on the safe side."""

    def stem(name: str) -> str:
        name = name.lower().replace("present", "past")
        return _STEP_MARK.sub("", name) or name

    found = set()
    for o in signature.outputs:
        for i in signature.inputs:
            if (
                i.dtype == o.dtype
                and len(i.shape) == len(o.shape)
                and stem(i.name) == stem(o.name)
                and all(
                    a == b or not isinstance(a, int) or not isinstance(b, int)
                    for a, b in zip(i.shape, o.shape, strict=True)
                )
            ):
                found.add(o.name)
    return found


def check_declared_kinds(policy: TolerancePolicy, outputs: Sequence[str], model: str) -> None:
    """A declared output kind must name an output the model is checked on (params.yaml cannot know
    the names when ``outputs`` is left out)."""
    unknown = sorted(set(policy.declared) - set(outputs))
    if unknown:
        raise ConfigError(
            f"models.{model}.output_kinds names {', '.join(map(repr, unknown))}, not an output of the model "
            f"(outputs: {', '.join(outputs)})",
            hint="fix the output names under output_kinds",
        )


Split = tuple[str, "np.ndarray", "np.ndarray"]  # (name, engine, reference) of one more split of samples


def output_errors(
    engine: Mapping[str, np.ndarray],
    reference: Mapping[str, np.ndarray],
    outputs: Sequence[str],
    policy: TolerancePolicy,
    model: str,
    *,
    states: Collection[str] = (),
    more: Mapping[str, Sequence[Split]] | None = None,
) -> list[OutputError]:
    """Every checked output of a model against the reference, each with its kind's tolerance.
    ``states``: outputs fed back as inputs (judged as state unless declared); ``more``: per output,
    further splits whose rows the agreement gate uses when the golden rows cannot resolve it."""
    check_declared_kinds(policy, outputs, model)
    return [
        output_error(
            name,
            engine[name],
            reference[name],
            policy,
            inferred="state" if name in states else None,
            more=(more or {}).get(name, ()),
        )
        for name in outputs
    ]


def _min_passing(d: np.ndarray, a: np.ndarray, t: Tolerance, budget: int) -> dict[str, float | None]:
    """The smallest atol (at the tolerance's rtol) and rtol (at its atol) that would pass, with
    ``budget`` mismatches allowed and no outlier beyond the outlier factor; None where none would."""
    import numpy as np

    factor = t.max_outlier_factor
    return {
        "min_passing_atol": _with_outliers(
            _smallest_passing(np.maximum(d - t.rtol * a, 0.0), budget, lambda x: np.count_nonzero(d > x + t.rtol * a)),
            None if factor is None else np.maximum(d / factor - t.rtol * a, 0.0),
            lambda x: np.count_nonzero(d > factor * (x + t.rtol * a)) if factor else 0,
        ),
        "min_passing_rtol": _with_outliers(
            _smallest_passing(_rtol_needed(d, a, t.atol), budget, lambda x: np.count_nonzero(d > t.atol + x * a)),
            None if factor is None else _rtol_needed(d / factor, a, t.atol),
            lambda x: np.count_nonzero(d > factor * (t.atol + x * a)) if factor else 0,
        ),
    }


def output_error(
    name: str,
    engine: np.ndarray,
    reference: np.ndarray,
    tol: Tolerance | TolerancePolicy,
    kind: OutputKind | None = None,
    *,
    inferred: OutputKind | None = None,
    more: Sequence[Split] = (),
) -> OutputError:
    """The figures of one output and the verdict of the tolerance for its kind (given, declared in
    the policy, else ``inferred``, else inferred from the reference). The element-wise check is
    numpy.isclose's: |engine - reference| <= atol + rtol * |reference|; a NaN or Inf where the
    reference is finite always fails; where the reference is NaN or Inf the engine must hold the
    same. The golden split is ``engine``/``reference``; ``more`` holds further splits whose rows
    join the agreement gate when the golden rows alone cannot resolve its threshold."""
    import numpy as np

    declared = kind or (tol.declared.get(name) if isinstance(tol, TolerancePolicy) else None)
    kind = declared or inferred or infer_kind(reference)
    t = tol.for_kind(kind) if isinstance(tol, TolerancePolicy) else tol
    head = {
        "output": name,
        "kind": kind,
        "kind_inferred": declared is None,
        "atol": t.atol,
        "rtol": t.rtol,
        "max_mismatch": t.max_mismatch,
        "min_top1_agreement": t.min_top1_agreement if kind in CLASS_KINDS else None,
        "min_snr_db": t.min_snr_db,
        "confidence": t.confidence,
        "max_outlier_factor": t.max_outlier_factor,
    }
    if np.shape(engine) != np.shape(reference):
        return OutputError(
            **head,
            **_no_figures(),
            shape_mismatch=f"engine {list(np.shape(engine))} vs reference {list(np.shape(reference))}",
            mismatch_fraction=1.0,
            mismatch_count=int(np.size(reference)),
            passed=False,
        )
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
    allowed = gatestats.max_mismatches(n, t.max_mismatch, t.confidence)
    hopeless = unmatched if first is None else n + 1  # elements no tolerance can pass
    factor = t.max_outlier_factor
    outliers = (
        int(np.count_nonzero(d > factor * (t.atol + t.rtol * a))) + int(np.count_nonzero(unexpected)) + unmatched
        if factor is not None
        else 0
    )
    agreement = (
        _agreement_figures(e, r, t, more) if kind in CLASS_KINDS else {"top1_agreement": None, "top5_agreement": None}
    )
    err = OutputError(
        **head,
        **_signal(e, r, t),
        **agreement,
        mismatch_count=beyond,
        mismatch_interval=gatestats.bounds(beyond, n, t.confidence) if n else None,
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
        mismatch_fraction=beyond / n if n else 0.0,
        **_min_passing(d, a, t, allowed - hopeless),
        outlier_count=outliers,
        passed=False,
    )
    return err.model_copy(update={"passed": not output_problems(err, t) and not input_problems(err, t)})


def _tolerance_of(e: OutputError) -> Tolerance:
    return Tolerance(
        atol=e.atol,
        rtol=e.rtol,
        max_mismatch=e.max_mismatch,
        min_top1_agreement=e.min_top1_agreement or 0.0,
        min_snr_db=e.min_snr_db,
        confidence=e.confidence,
        max_outlier_factor=e.max_outlier_factor,
    )


def _with_outliers(found: float | None, needed: np.ndarray | None, outliers_at) -> float | None:
    """The smallest passing value raised to the least that leaves no element beyond the outlier
    bound (``needed``: per element, the least value that does), nudged as ``_smallest_passing``."""
    import numpy as np

    if found is None or needed is None or not needed.size:
        return found
    x = max(found, float(needed.max()))
    if not np.isfinite(x):
        return None
    return _tightest(x, lambda v: not outliers_at(v), found)


def _tightest(x: float, passes, floor: float) -> float:
    """The smallest float from ``x`` on that ``passes``: up while it does not (rounding of (x - y) + y
    may need a few ulps), then down while the next one below (not under ``floor``) still does."""
    import numpy as np

    for _ in range(_MAX_ULP_STEPS):
        if passes(x):
            break
        x = float(np.nextafter(x, np.inf))
    else:
        raise AssertionError(f"no passing value found near {x!r}")  # a bug, not a user error
    for _ in range(_MAX_ULP_STEPS):
        below = float(np.nextafter(x, -np.inf))
        if below < floor or not passes(below):
            break
        x = below
    return x


def structural_problems(e: OutputError) -> list[str]:
    """What fails an output whatever its tolerance and whichever gate decides: a shape that differs,
    NaN/Inf where the reference is finite, a constant output where the reference varies."""
    where = f"output {e.output}"
    if e.shape_mismatch is not None:
        return [f"{where}: shape {e.shape_mismatch}"]
    bad = []
    if e.nan_count or e.inf_count:
        counts = " and ".join(f"{n} {what}" for n, what in ((e.nan_count, "NaN"), (e.inf_count, "Inf")) if n)
        bad.append(f"{where}: {counts} where the reference is finite, first at {e.first_non_finite}")
    if e.degenerate:
        bad.append(
            f"{where}: the engine's output is constant ({_g(e.engine_constant)}) where the reference varies "
            f"over a range of {_g(e.reference_range)}: a degenerate engine, whatever its absolute error"
        )
    return bad


def output_problems(e: OutputError, tol: Tolerance | None = None) -> list[str]:
    """Which criteria the figures of ``e`` fail, one line each with the figures; empty: it passes.
    ``tol``: the thresholds to judge by (default: those ``e`` was measured with). The element-wise
    figures were taken at ``e``'s atol and rtol, whatever ``tol`` says: the caller checks those.
    Fractions are judged from their counts by exact one-sided tests at ``tol.confidence``
    (pipeline/results/gatestats.py); what the golden set cannot judge is in ``input_problems``."""
    tol = tol or _tolerance_of(e)
    where = f"output {e.output}"
    bad = structural_problems(e)
    if e.shape_mismatch is not None:
        return bad
    if e.exercised and e.snr_db is not None and e.snr_db < tol.min_snr_db:  # unexercised: input_problems says so
        bad.append(
            f"{where}: signal-to-noise {e.snr_db:.1f} dB < {tol.min_snr_db:g} dB (cosine similarity "
            f"{_g(e.cosine_similarity)}; the error is {10 ** (-e.snr_db / 20):.3g} of the reference's variation)"
        )
    if tol.max_outlier_factor is not None and e.outlier_count and not (e.nan_count or e.inf_count):
        bad.append(
            f"{where}: {e.outlier_count} of {e.elements} elements beyond {tol.max_outlier_factor:g} times "
            f"atol={e.atol} rtol={e.rtol} (max abs error {_g(e.max_abs_error)}): a few elements that far off "
            "are a defect, not rounding"
        )
    if gatestats.mismatch_fails(e.mismatch_count, e.elements, tol.max_mismatch, tol.confidence):
        passes_at = (
            f"passes at atol >= {_g(e.min_passing_atol)} or rtol >= {_g(e.min_passing_rtol)}"
            if e.min_passing_atol is not None or e.min_passing_rtol is not None
            else "no atol or rtol passes"
        )
        low = f", at least {e.mismatch_interval[0]:.2%} at {tol.confidence:.0%}" if e.mismatch_interval else ""
        bad.append(
            f"{where}: {e.mismatch_count} of {e.elements} elements ({e.mismatch_fraction:.2%}{low}) beyond "
            f"atol={e.atol} rtol={e.rtol} (allowed {tol.max_mismatch:.2%}; max abs error {_g(e.max_abs_error)}, "
            f"p99 {_g(e.p99_abs_error)}; {passes_at})"
        )
    if e.kind in CLASS_KINDS and tol.min_top1_agreement > 0 and e.elements:
        if e.top1_rows is None:
            bad.append(
                f"{where}: no top-1 agreement for a {e.kind} output (it needs finite reference rows of 2 or "
                "more classes on the last axis)"
            )
        elif e.top1_rows >= gatestats.min_rows_for_agreement(
            tol.min_top1_agreement, tol.confidence
        ) and gatestats.agreement_fails(e.top1_agree or 0, e.top1_rows, tol.min_top1_agreement, tol.confidence):
            bad.append(
                f"{where}: top-1 agreement {_agreement_text(e)} is below {tol.min_top1_agreement:.2%} at "
                f"{tol.confidence:.0%} confidence ({e.kind})"
            )
    return bad


def input_problems(e: OutputError, tol: Tolerance | None = None) -> list[str]:
    """What the golden set cannot judge for this output: a reference that a constant would match
    within tolerance, or too few rows (ties aside) to resolve the agreement threshold. An output
    whose kind was inferred and whose agreement cannot be resolved is a warning instead
    (``output_warnings``): the element-wise and signal checks still judge it."""
    tol = tol or _tolerance_of(e)
    where = f"output {e.output}"
    if e.shape_mismatch is not None or not e.elements:
        return []
    bad = []
    if not e.exercised:
        bad.append(
            f"{where}: the golden set does not exercise it: the reference spans {_g(e.reference_range)} over "
            f"{e.elements} elements, so a constant output would pass atol={e.atol} rtol={e.rtol}; supply real "
            "inputs (datasets.golden.path) or leave the output out (models.<m>.outputs)"
        )
    short = _agreement_short(e, tol)
    if short and not e.kind_inferred:
        bad.append(short)
    return bad


def output_warnings(e: OutputError, tol: Tolerance | None = None) -> list[str]:
    tol = tol or _tolerance_of(e)
    short = _agreement_short(e, tol)
    return [f"{short}; agreement not judged"] if short and e.kind_inferred and e.shape_mismatch is None else []


def _agreement_short(e: OutputError, tol: Tolerance) -> str | None:
    if e.kind not in CLASS_KINDS or tol.min_top1_agreement <= 0 or e.top1_rows is None:
        return None
    need = gatestats.min_rows_for_agreement(tol.min_top1_agreement, tol.confidence)
    if e.top1_rows >= need:
        return None
    ties = f" and {e.top1_ties} ties left out" if e.top1_ties else ""
    return (
        f"output {e.output}: {e.top1_rows} decisive rows{ties} (splits {', '.join(e.top1_splits)}) cannot resolve "
        f"min_top1_agreement {tol.min_top1_agreement:.2%} at {tol.confidence:.0%} confidence: it needs {need}; "
        "give the golden set more samples (datasets.golden) or an evaluation split"
    )


def _agreement_text(e: OutputError) -> str:
    interval = f", {e.top1_interval[0]:.2%}..{e.top1_interval[1]:.2%}" if e.top1_interval else ""
    ties = f", {e.top1_ties} ties left out" if e.top1_ties else ""
    return f"{e.top1_agree}/{e.top1_rows} = {e.top1_agreement:.2%}{interval}{ties}"


def _g(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _no_figures() -> dict:
    none = (
        "max_abs_error",
        "mean_abs_error",
        "median_abs_error",
        "p99_abs_error",
        "max_rel_error",
        "median_rel_error",
        "p99_rel_error",
        "cosine_similarity",
        "top1_agreement",
        "top5_agreement",
        "first_non_finite",
        "min_passing_atol",
        "min_passing_rtol",
    )
    return dict.fromkeys(none) | {"elements": 0, "nan_count": 0, "inf_count": 0, "reference_non_finite": 0}


def _signal(e: np.ndarray, r: np.ndarray, t: Tolerance) -> dict:
    """Error against the signal: SNR (the reference's variation about its mean over the squared
    error, in dB), whether the reference varies beyond what a constant would pass, and whether the
    engine's output is constant where it does."""
    import numpy as np

    both = np.isfinite(e) & np.isfinite(r)
    rf, ef = r[np.isfinite(r)], e[np.isfinite(e)]
    if not rf.size:
        return {"exercised": False}
    lo, hi = float(rf.min()), float(rf.max())
    mid = (lo + hi) / 2
    exercised = bool(np.any(np.abs(mid - rf) > t.atol + t.rtol * np.abs(rf)))
    signal = float(np.sum((r[both] - r[both].mean()) ** 2)) if both.any() else 0.0
    noise = float(np.sum((e[both] - r[both]) ** 2)) if both.any() else 0.0
    constant = ef.size == e.size and ef.size > 0 and float(ef.min()) == float(ef.max())
    return {
        "snr_db": 10 * float(np.log10(signal / noise)) if signal > 0 and noise > 0 else None,
        "reference_range": hi - lo,
        "exercised": exercised,
        "degenerate": bool(constant and exercised),
        "engine_constant": float(ef[0]) if constant else None,
    }


def _spread(x: np.ndarray, what: str) -> dict[str, float | None]:
    import numpy as np

    median, p99 = (float(v) for v in np.quantile(x, [0.5, 0.99])) if x.size else (None, None)
    return {f"median_{what}_error": median, f"p99_{what}_error": p99}


def _cosine(x: np.ndarray, y: np.ndarray) -> float | None:
    import numpy as np

    nx, ny = float(np.sqrt(np.dot(x, x))), float(np.sqrt(np.dot(y, y)))
    if nx == 0 or ny == 0 or not np.isfinite(nx * ny):
        return None
    return float(np.clip(np.dot(x, y) / (nx * ny), -1.0, 1.0))


def _agreement_figures(e: np.ndarray, r: np.ndarray, t: Tolerance, more: Sequence[Split]) -> dict:
    """Top-1 agreement over the decisive golden rows, joined by the rows of ``more`` when the golden
    rows alone cannot resolve ``t.min_top1_agreement``; top-5 over the golden rows."""
    import numpy as np

    need = gatestats.min_rows_for_agreement(t.min_top1_agreement, t.confidence)
    agree, rows, ties, top5 = _agreement(e, r, t)
    splits = ["golden"]
    for split, e_more, r_more in more:
        if rows is None or rows >= need:
            break
        if np.shape(e_more) != np.shape(r_more):
            continue
        a, n, tie, _ = _agreement(np.asarray(e_more, dtype=np.float64), np.asarray(r_more, dtype=np.float64), t)
        if n is not None:
            agree, rows, ties = agree + a, rows + n, ties + tie
            splits.append(split)
    if rows is None:
        return {"top1_agreement": None, "top5_agreement": top5}
    return {
        "top1_agreement": agree / rows if rows else None,
        "top1_agree": agree,
        "top1_rows": rows,
        "top1_ties": ties,
        "top1_interval": gatestats.bounds(agree, rows, t.confidence) if rows else None,
        "top1_splits": splits,
        "top5_agreement": top5,
    }


def _agreement(e: np.ndarray, r: np.ndarray, t: Tolerance) -> tuple[int, int | None, int, float | None]:
    """(agreeing rows, decisive rows, ties, top-5 agreement) over rows of the last axis whose
    reference is finite. A row is a tie when its reference's top-two margin is at most 2 * atol:
    an engine whose every element is within atol may swap the two, so the row is left out of
    agreement. Top-1: the engine's top class is the
    reference's. Top-5: the reference's top class is among the engine's five highest (more than 5
    classes), over every row. An engine row with NaN/Inf disagrees."""
    import numpy as np

    if r.ndim == 0 or r.shape[-1] < 2 or r.size == 0:
        return 0, None, 0, None
    classes = r.shape[-1]
    rows_r, rows_e = r.reshape(-1, classes), e.reshape(-1, classes)
    keep = np.isfinite(rows_r).all(axis=1)
    rows_r, rows_e = rows_r[keep], rows_e[keep]
    if not len(rows_r):
        return 0, None, 0, None
    sane = np.isfinite(rows_e).all(axis=1)
    scores = np.where(np.isfinite(rows_e), rows_e, -np.inf)
    top_two = -np.partition(-rows_r, 1, axis=1)[:, :2]
    decisive = (top_two[:, 0] - top_two[:, 1]) > 2 * t.atol
    top1 = (np.argmax(scores, axis=1) == np.argmax(rows_r, axis=1)) & sane
    top5 = None
    if classes > 5:
        five = np.argpartition(-scores, 4, axis=1)[:, :5]
        top5 = float(((five == np.argmax(rows_r, axis=1)[:, None]).any(axis=1) & sane).mean())
    return (
        int(np.count_nonzero(top1 & decisive)),
        int(np.count_nonzero(decisive)),
        int(np.count_nonzero(~decisive)),
        top5,
    )


def _rtol_needed(d: np.ndarray, a: np.ndarray, atol: float) -> np.ndarray:
    """Per element, the least rtol that passes it at ``atol`` (inf where none does: r == 0)."""
    import numpy as np

    short = np.maximum(d - atol, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(short == 0, 0.0, np.where(a > 0, short / np.where(a > 0, a, 1.0), np.inf))


def _smallest_passing(needed: np.ndarray, allowed: int, beyond_at) -> float | None:
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
    return _tightest(x, lambda v: beyond_at(v) <= allowed, 0.0)


def top1_correct(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per sample: the top class is the label."""
    import numpy as np

    return np.argmax(scores.reshape(len(labels), -1), axis=-1) == labels


def top1_accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
    return float(top1_correct(scores, labels).mean())


def metric_result(
    split: str,
    engine_correct: np.ndarray,
    reference_correct: np.ndarray,
    max_drop: float,
    confidence: float,
    figures: Mapping[str, float] | None = None,
) -> MetricResult:
    """The task metric of engine and reference on the same samples (per sample: right or wrong),
    judged by ``gatestats.drop_fails``. ``figures``: more labelled figures of both, reported."""
    import numpy as np

    e, r = np.asarray(engine_correct, dtype=bool), np.asarray(reference_correct, dtype=bool)
    n, worse, better = len(e), int(np.count_nonzero(r & ~e)), int(np.count_nonzero(e & ~r))
    engine_score, reference_score = float(e.mean()) if n else 0.0, float(r.mean()) if n else 0.0
    return MetricResult(
        split=split,
        reference=reference_score,
        engine=engine_score,
        delta=engine_score - reference_score,
        max_drop=max_drop,
        samples=n,
        worse=worse,
        better=better,
        p_value=gatestats.mcnemar_p(worse, better),
        drop_interval=gatestats.drop_interval(worse, better, n, confidence),
        confidence=confidence,
        figures=dict(figures or {}),
        passed=not gatestats.drop_fails(worse, better, n, max_drop, confidence),
    )


def metric_problems(
    m: MetricResult, kind: str, max_drop: float | None = None, confidence: float | None = None
) -> list[str]:
    """The failure line of a task metric, recomputed from its counts; empty: it passes."""
    max_drop = m.max_drop if max_drop is None else max_drop
    confidence = m.confidence if confidence is None else confidence
    if not gatestats.drop_fails(m.worse, m.better, m.samples, max_drop, confidence):
        return []
    interval = f", {m.drop_interval[0]:.4f}..{m.drop_interval[1]:.4f}" if m.drop_interval else ""
    return [
        f"{kind} on {m.split}: {m.engine:.4f} vs reference {m.reference:.4f} (drop {-m.delta:.4f}{interval} > "
        f"allowed {max_drop} on {m.samples} samples: {m.worse} worse, {m.better} better, McNemar p={m.p_value:.3g} "
        f"< {1 - confidence:.2g})"
    ]


# the held-out labelled splits the task-metric gate is about; a labelled golden set is judged too
# where it can resolve its drop, and only reported where it cannot
HELD_OUT = ("evaluation", "hard_tail")


def metric_input_problems(m: MetricResult, max_drop: float | None = None, confidence: float | None = None) -> list[str]:
    """A held-out labelled split too small to resolve its allowed drop (``gatestats.min_samples_for_drop``)."""
    short = _metric_short(m, max_drop, confidence)
    return [short] if short and m.split in HELD_OUT else []


def metric_warnings(m: MetricResult) -> list[str]:
    short = _metric_short(m, None, None)
    return [f"{short}; the held-out splits judge the metric"] if short and m.split not in HELD_OUT else []


def _metric_short(m: MetricResult, max_drop: float | None, confidence: float | None) -> str | None:
    max_drop = m.max_drop if max_drop is None else max_drop
    confidence = m.confidence if confidence is None else confidence
    need = gatestats.min_samples_for_drop(max_drop, confidence)
    if m.samples >= need:
        return None
    return (
        f"metric on {m.split}: {m.samples} samples cannot resolve a drop of {max_drop} at {confidence:.0%} "
        f"confidence (a drop of twice that would not be significant); it needs {need} labelled samples"
    )
