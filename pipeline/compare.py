"""Correctness metrics: element-wise error against the reference, and task metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import Tolerance
from .results import OutputError

if TYPE_CHECKING:
    import numpy as np


def output_error(name: str, engine: "np.ndarray", reference: "np.ndarray", tol: Tolerance) -> OutputError:
    """|engine - reference| against atol + rtol * |reference|, as numpy.isclose does."""
    import numpy as np

    if engine.shape != reference.shape:
        return OutputError(output=name, max_abs_error=float("inf"), max_rel_error=float("inf"), mean_abs_error=float("inf"),
                           mismatch_fraction=1.0, atol=tol.atol, rtol=tol.rtol, max_mismatch=tol.max_mismatch, passed=False)
    e = engine.astype(np.float64)
    r = reference.astype(np.float64)
    finite = np.isfinite(e)
    diff = np.where(finite, np.abs(e - r), np.inf)
    # relative error where the reference is not zero (there it is undefined)
    rel = np.divide(diff, np.abs(r), out=np.zeros_like(diff), where=r != 0)
    mismatch = float(np.mean(diff > tol.atol + tol.rtol * np.abs(r))) if diff.size else 0.0
    return OutputError(
        output=name,
        max_abs_error=_finite_or_max(diff.max(initial=0.0)),
        max_rel_error=_finite_or_max(rel.max(initial=0.0)),
        mean_abs_error=_finite_or_max(diff.mean()) if diff.size else 0.0,
        mismatch_fraction=mismatch,
        atol=tol.atol,
        rtol=tol.rtol,
        max_mismatch=tol.max_mismatch,
        passed=bool(finite.all()) and mismatch <= tol.max_mismatch,
    )


def _finite_or_max(x: float) -> float:
    """JSON has no infinity: report non-finite errors as the largest float64."""
    import numpy as np

    return float(x) if np.isfinite(x) else float(np.finfo(np.float64).max)


def top1_accuracy(scores: "np.ndarray", labels: "np.ndarray") -> float:
    import numpy as np

    return float(np.mean(np.argmax(scores.reshape(len(labels), -1), axis=-1) == labels))


METRICS = {"top1_accuracy": top1_accuracy}
