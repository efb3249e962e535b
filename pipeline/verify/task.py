"""Task agreement: the engine judged by what the device app computes from its outputs.

The declared postprocess (``models.<m>.postprocess``) runs on the engine's outputs and on the
reference's, for the same inputs, and the two results are compared per sample; no labels are
needed. One statistic per step gates (docs/correctness.md, "Task agreement"):

| step | gated statistic | unit | reported too |
|---|---|---|---|
| argmax, topk | top-1 agreement (the sample's label is the reference's) | sample | top-k overlap |
| ctc_greedy | character error rate of the engine's string against the reference's | reference character | exact match |
| nms, db_boxes | box F1: engine boxes matched one to one to reference boxes at IoU >= box_iou | box | |
| segment | mean IoU of the engine's mask against the reference's, per sample | sample | |

A count (agreement, exact match) is judged by the exact binomial rule of the tensor gates; a ratio
over samples by a seeded percentile bootstrap that resamples whole samples. Each fails only on
evidence: the one-sided bound on the good side is beyond the threshold. A set whose units cannot
resolve the threshold (``gatestats.units_for_rate``) joins the next split; still short, the
statistic is reported and the tensor gates decide (pipeline/verify/check.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pipeline.core.errors import InputError
from pipeline.project.config import BoxesNms, ModelSpec, TaskTolerance
from pipeline.project.data import BoxTargets, Classes
from pipeline.project.postprocessing import postprocess
from pipeline.results import gatestats
from pipeline.results.reports import UNIT_NAMES, TaskAgreement, TaskStatistic

if TYPE_CHECKING:
    import numpy as np

Outputs = Mapping[str, "np.ndarray"]

# the statistic that gates each step, and the tolerance key that holds its threshold
GATED: dict[str, tuple[TaskStatistic, str]] = {
    "argmax": ("top1_agreement", "min_agreement"),
    "topk": ("top1_agreement", "min_agreement"),
    "ctc_greedy": ("cer", "max_cer"),
    "nms": ("box_f1", "min_box_f1"),
    "db_boxes": ("box_f1", "min_box_f1"),
    "segment": ("mean_iou", "min_mean_iou"),
}
_COUNTS = ("top1_agreement", "exact_match")


def step_kind(spec: ModelSpec) -> str:
    step = spec.postprocess
    return step if isinstance(step, str) else str(step.kind)


def task_agreement(
    spec: ModelSpec, tol: TaskTolerance, engine: Mapping[str, Outputs], reference: Mapping[str, Outputs]
) -> list[TaskAgreement]:
    """The declared postprocess's results of engine and reference compared per sample, over the
    splits of ``engine`` in order (golden first): a split joins only while the pooled units cannot
    resolve the gated threshold. Empty for ``postprocess: none`` (the tensor gates decide)."""
    kind = step_kind(spec)
    if kind not in GATED:
        return []
    gated, key = GATED[kind]
    threshold = float(getattr(tol, key))
    direction = "max" if gated == "cer" else "min"
    need = gatestats.units_for_rate(threshold, direction, tol.confidence)
    pooled: dict[TaskStatistic, list[list[float]]] = {}
    splits: list[str] = []
    for split, got in engine.items():
        if splits and _units(gated, pooled.get(gated, [])) >= need:
            break
        if split not in reference:
            continue
        evidence = _evidence(spec, tol, got, reference[split])
        for statistic, rows in evidence.items():
            pooled.setdefault(statistic, []).extend(rows)
        splits.append(split)
    return [
        judge(
            statistic,
            kind,
            splits,
            rows,
            threshold if statistic == gated else None,
            direction if statistic == gated else ("max" if statistic == "cer" else "min"),
            tol.confidence,
        )
        for statistic, rows in pooled.items()
    ]


def agreement_drop(
    spec: ModelSpec,
    tol: TaskTolerance,
    variant: Outputs,
    base: Outputs,
    split: str,
    max_drop: float | None,
    confidence: float,
) -> TaskAgreement | None:
    """The gated statistic of the postprocess's results on ``variant`` (the device's inputs) against
    those on ``base`` (the training side's), the engine the same: its share changed gated at
    ``max_drop`` (a CER at most ``max_drop``, any other statistic at least 1 - ``max_drop``).
    None without a gated postprocess."""
    kind = step_kind(spec)
    if kind not in GATED:
        return None
    gated, _ = GATED[kind]
    rows = _evidence(spec, tol, variant, base).get(gated, [])
    direction = "max" if gated == "cer" else "min"
    threshold = None if max_drop is None else (max_drop if direction == "max" else 1.0 - max_drop)
    return judge(gated, kind, [split], rows, threshold, direction, confidence)


def judge(
    statistic: TaskStatistic,
    postprocess_kind: str,
    splits: list[str],
    rows: Sequence[Sequence[float]],
    threshold: float | None,
    direction: str,
    confidence: float,
) -> TaskAgreement:
    """One statistic from its per-sample evidence: count statistics hold [agrees] per sample, ratios
    [numerator, denominator]. The promotion gate calls it again on the recorded evidence."""
    samples = len(rows)
    units = _units(statistic, rows)
    if statistic in _COUNTS:
        agree = int(sum(int(r[0]) for r in rows))
        value = agree / samples if samples else None
        interval = gatestats.bounds(agree, samples, confidence) if samples else None
        per_sample: list[list[float]] = []
    else:
        agree = None
        den = sum(r[1] for r in rows)
        value = sum(r[0] for r in rows) / den if den > 0 else None
        interval = gatestats.ratio_bounds([r[0] for r in rows], [r[1] for r in rows], confidence)
        per_sample = [[float(r[0]), float(r[1])] for r in rows]
    needed = gatestats.units_for_rate(threshold, direction, confidence) if threshold is not None else None
    judgeable = threshold is None or (value is not None and needed is not None and units >= needed)
    fails = False
    if threshold is not None and judgeable and interval is not None:
        fails = interval[1] < threshold if direction == "min" else interval[0] > threshold
    result = TaskAgreement(
        statistic=statistic,
        postprocess=postprocess_kind,
        splits=splits,
        samples=samples,
        value=value,
        agree=agree,
        units=units,
        per_sample=per_sample,
        interval=interval,
        method="clopper-pearson" if statistic in _COUNTS else "bootstrap",
        threshold=threshold,
        direction="max" if direction == "max" else "min",
        confidence=confidence,
        needed_units=needed,
        passed=not fails,
        judgeable=judgeable,
    )
    return result.model_copy(update={"failure": task_problem(result)})


def task_problem(t: TaskAgreement) -> str | None:
    """The failure line of a gated statistic (None: it passes or is only reported)."""
    if t.threshold is None or not t.judgeable or t.passed:
        return None
    side = "below" if t.direction == "min" else "above"
    return f"{task_text(t)}: {side} {_pct(t.threshold)} at {t.confidence:.0%} confidence"


def task_short(t: TaskAgreement) -> str | None:
    """Why a gated statistic cannot judge its threshold on this set (None: it can)."""
    if t.threshold is None or t.judgeable:
        return None
    if t.value is None:
        what = {"cer": "reads no text", "box_f1": "finds no boxes", "mean_iou": "segments nothing"}.get(
            t.statistic, "gives nothing to compare"
        )
        return (
            f"task {t.statistic} ({t.postprocess}): the reference {what} on {t.samples} samples ({', '.join(t.splits)})"
        )
    return (
        f"task {t.statistic} ({t.postprocess}): {t.units} {_unit(t.statistic)} ({', '.join(t.splits)}) cannot resolve "
        f"{_pct(t.threshold)} at {t.confidence:.0%} confidence: it needs {t.needed_units}"
    )


def task_text(t: TaskAgreement) -> str:
    """The statistic in the user's terms, with n and its interval."""
    return t.text()


def _pct(x: float) -> str:
    return f"{x:.2%}"


def _unit(statistic: str) -> str:
    return UNIT_NAMES.get(statistic, "samples")


def _units(statistic: str, rows: Sequence[Sequence[float]]) -> int:
    if statistic == "cer":
        return int(sum(r[1] for r in rows))
    if statistic == "box_f1":
        return int(sum(r[1] for r in rows) // 2)  # engine + reference boxes: their mean
    return len(rows)


def _finite_samples(outputs: Outputs) -> np.ndarray:
    import numpy as np

    n = len(next(iter(outputs.values())))
    keep = np.ones(n, dtype=bool)
    for value in outputs.values():
        v = np.asarray(value)
        if v.dtype.kind in "fc" and len(v) == n:
            keep &= np.isfinite(v.reshape(n, -1)).all(axis=1)
    return keep


def _evidence(
    spec: ModelSpec, tol: TaskTolerance, engine: Outputs, reference: Outputs
) -> dict[TaskStatistic, list[list[float]]]:
    """Per statistic, one row per sample of this split whose reference outputs are finite."""
    import numpy as np

    keep = _finite_samples(reference)
    if not keep.any():
        return {}
    idx = np.flatnonzero(keep)
    e = postprocess(spec, {k: np.asarray(v)[idx] for k, v in engine.items()})
    r = postprocess(spec, {k: np.asarray(v)[idx] for k, v in reference.items()})
    kind = step_kind(spec)
    if kind == "argmax":
        return {"top1_agreement": _same_rows(e["class"], r["class"])}
    if kind == "topk":
        ei, ri = np.asarray(e["indices"]), np.asarray(r["indices"])
        return {"top1_agreement": _same_rows(ei[..., 0], ri[..., 0]), "topk_overlap": _overlap(ei, ri)}
    if kind == "ctc_greedy":
        pairs = list(zip(e["labels"], r["labels"], strict=True))
        return {
            "exact_match": [[float(np.array_equal(a, b))] for a, b in pairs],
            "cer": [[float(edit_distance(a, b)), float(len(b))] for a, b in pairs],
        }
    if kind in ("nms", "db_boxes"):
        box_format = spec.postprocess.box_format if isinstance(spec.postprocess, BoxesNms) else "xyxy"
        rows = []
        for eb, ec, rb, rc in zip(e["boxes"], e["classes"], r["boxes"], r["classes"], strict=True):
            matched = match_boxes(_xyxy(eb, box_format), ec, _xyxy(rb, box_format), rc, tol.box_iou)
            rows.append([2.0 * matched, float(len(eb) + len(rb))])
        return {"box_f1": rows}
    if kind == "segment":
        return {"mean_iou": [[mask_iou(a, b), 1.0] for a, b in zip(e["mask"], r["mask"], strict=True)]}
    return {}


def _same_rows(e: Any, r: Any) -> list[list[float]]:
    import numpy as np

    e, r = np.asarray(e), np.asarray(r)
    n = len(r)
    return [[float(x)] for x in (e.reshape(n, -1) == r.reshape(n, -1)).all(axis=1)]


def _overlap(e: np.ndarray, r: np.ndarray) -> list[list[float]]:
    """Per sample, the mean over its rows of |engine top-k & reference top-k| / k."""

    n, k = len(r), r.shape[-1]
    er, rr = e.reshape(n, -1, k), r.reshape(n, -1, k)
    shared = (er[..., :, None] == rr[..., None, :]).any(axis=-1).sum(axis=-1) / k
    return [[float(x), 1.0] for x in shared.mean(axis=1)]


def edit_distance(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Levenshtein distance (insertions, deletions, substitutions) between two label sequences."""
    a, b = list(a), list(b)
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def _xyxy(boxes: Any, box_format: str) -> np.ndarray:
    import numpy as np

    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    if box_format == "cxcywh":
        return np.concatenate([b[:, :2] - b[:, 2:] / 2, b[:, :2] + b[:, 2:] / 2], axis=1)
    return b


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every xyxy box of ``a`` with every one of ``b``."""
    import numpy as np

    if not len(a) or not len(b):
        return np.zeros((len(a), len(b)))
    lo = np.maximum(a[:, None, :2], b[None, :, :2])
    hi = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(hi - lo, 0, None).prod(axis=-1)
    area_a = np.clip(a[:, 2:] - a[:, :2], 0, None).prod(axis=-1)
    area_b = np.clip(b[:, 2:] - b[:, :2], 0, None).prod(axis=-1)
    union = area_a[:, None] + area_b[None, :] - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def match_boxes(e: np.ndarray, e_cls: Any, r: np.ndarray, r_cls: Any, iou: float) -> int:
    """Engine boxes matched one to one to reference boxes of the same class at IoU >= ``iou``,
    greedily from the highest IoU (as COCO's matcher, without scores: both sides are detections)."""
    import numpy as np

    m = iou_matrix(e, r)
    if not m.size:
        return 0
    m = np.where(np.asarray(e_cls).reshape(-1, 1) == np.asarray(r_cls).reshape(1, -1), m, 0.0)
    order = np.argsort(-m, axis=None, kind="stable")
    used_e, used_r, matched = set(), set(), 0
    for flat in order:
        i, j = divmod(int(flat), m.shape[1])
        if m[i, j] < iou:
            break
        if i not in used_e and j not in used_r:
            used_e.add(i)
            used_r.add(j)
            matched += 1
    return matched


def mask_iou(e: Any, r: Any) -> float:
    """Mean IoU over the classes present in either mask (1.0 when both are empty of every class)."""
    import numpy as np

    e, r = np.asarray(e).ravel(), np.asarray(r).ravel()
    classes = np.union1d(np.unique(e), np.unique(r))
    ious = [np.count_nonzero((e == c) & (r == c)) / np.count_nonzero((e == c) | (r == c)) for c in classes]
    return float(np.mean(ious)) if ious else 1.0


# --- labelled task metrics: per sample right or wrong, so McNemar pairs engine and reference ---------

# the IoU at which a detection matches an annotation (PASCAL VOC's and COCO's mAP@0.5)
LABEL_IOU = 0.5


def metric_correct(spec: ModelSpec, outputs: Outputs, targets: Any) -> tuple[np.ndarray, dict[str, float]]:
    """Per sample, whether the model's answer is the label's, and the split's pooled figures beside
    it: top1_accuracy (the metric output's top class is the integer label), word_accuracy (the
    decoded string is the text label; figure ``cer`` over the labels' characters),
    detection_accuracy (the image's boxes match its annotations one to one at IoU >= 0.5; figure
    ``box_f1``, pooled)."""
    import numpy as np

    assert spec.metric is not None
    kind = spec.metric.kind
    if kind == "top1_accuracy":
        scores = np.asarray(outputs[spec.metric.output])
        labels = _targets_of(targets, np.ndarray, kind)
        scores = scores.reshape(len(labels), -1)
        if len(labels) and int(labels.max()) >= scores.shape[1]:  # its top-1 could never be right
            first = int((labels >= scores.shape[1]).argmax())
            classes = Classes(output=spec.metric.output, count=scores.shape[1])
            raise InputError(
                f"metric {kind}: the label of sample {first} is {int(labels[first])}, but the metric's "
                f"{classes.describe()}",
                hint=f"{classes.hint()}; then run the data stage again",
            )
        return np.argmax(scores, axis=-1) == labels, {}
    result = postprocess(spec, dict(outputs))
    if kind == "word_accuracy":
        texts = _targets_of(targets, list, kind)
        got = list(result["text"])
        edits = sum(edit_distance(a, b) for a, b in zip(got, texts, strict=True))
        chars = sum(len(t) for t in texts)
        return np.array([a == b for a, b in zip(got, texts, strict=True)]), ({"cer": edits / chars} if chars else {})
    boxes = _targets_of(targets, BoxTargets, kind)
    box_format = spec.postprocess.box_format if isinstance(spec.postprocess, BoxesNms) else "xyxy"
    right, matched, total = [], 0, 0
    for eb, ec, rb, rc in zip(result["boxes"], result["classes"], boxes.boxes, boxes.classes, strict=True):
        m = match_boxes(_xyxy(eb, box_format), ec, _xyxy(rb, "xyxy"), rc, LABEL_IOU)
        right.append(m == len(eb) == len(rb))
        matched, total = matched + m, total + len(eb) + len(rb)
    return np.array(right, dtype=bool), ({"box_f1": 2 * matched / total} if total else {})


def _targets_of(targets: Any, kind: type, metric: str) -> Any:
    if not isinstance(targets, kind):
        raise InputError(
            f"metric {metric}: the split's labels are {type(targets).__name__}, not what {metric} compares",
            hint="integer labels for top1_accuracy, text labels in labels.csv for word_accuracy, "
            "boxes.csv for detection_accuracy (docs/preprocessing.md)",
        )
    return targets


def take(targets: Any, rows: Sequence[int]) -> Any:
    """The targets of some samples (an integer array, a list of strings or BoxTargets)."""
    if isinstance(targets, BoxTargets):
        return BoxTargets(boxes=[targets.boxes[i] for i in rows], classes=[targets.classes[i] for i in rows])
    if isinstance(targets, list):
        return [targets[i] for i in rows]
    return targets[list(rows)]
