"""Model outputs to what the task reads (``ModelSpec.postprocess``), each step in a real library.

- "none": the outputs as they are.
- "argmax": the best class per sample of the metric's output (the first output without a metric).
- topk: the k best classes per sample (scipy.special.softmax first for logits), best first; ties
  keep the lower class index first.
- nms: per batch item, each box's best class and score, then OpenCV's cv2.dnn.NMSBoxes (score
  threshold, IoU threshold, at most max_detections). Class-agnostic: an overlapping box of another
  class is suppressed too.
- ctc_greedy: the best class per frame, repeats merged, blanks dropped (itertools.groupby).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.core.errors import InputError
from pipeline.project.config import BoxesNms, CtcGreedy, ModelSpec, TopK

if TYPE_CHECKING:
    import numpy as np


def postprocess(spec: ModelSpec, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray | list[Any]]:
    """``outputs`` (one batch, or a whole set with the batch axis first) through the declared step.

    argmax: ``{"class": [...]}``; topk: ``{"indices", "scores"}`` ([..., k]); nms: ``{"boxes",
    "scores", "classes"}``, a list with one array per batch item (boxes as the model gave them, in its
    box_format); ctc_greedy: ``{"labels"}``, a list with one int64 array per batch item. An output the
    step names that is missing is an InputError naming it and the outputs present.
    """
    import numpy as np

    step = spec.postprocess
    if step == "none":
        return dict(outputs)
    if step == "argmax":
        name = spec.metric.output if spec.metric else next(iter(outputs))
        return {"class": np.argmax(_output(outputs, name, "argmax"), axis=-1)}
    if isinstance(step, TopK):
        return _topk(step, _output(outputs, step.output, "topk"))
    if isinstance(step, BoxesNms):
        return _nms(step, _output(outputs, step.boxes, "nms boxes"), _output(outputs, step.scores, "nms scores"))
    if isinstance(step, CtcGreedy):
        return _ctc_greedy(step, _output(outputs, step.output, "ctc_greedy"))
    raise AssertionError(f"unhandled postprocess step {step!r}")


def _output(outputs: dict[str, np.ndarray], name: str, what: str) -> np.ndarray:
    if name not in outputs:
        raise InputError(
            f"postprocess {what}: the model has no output {name!r} (outputs: {sorted(outputs)})",
            hint="fix models.<name>.postprocess (or metric.output) to name one of the model's outputs",
        )
    return outputs[name]


def _topk(step: TopK, scores: np.ndarray) -> dict[str, np.ndarray | list[Any]]:
    import numpy as np

    values = np.asarray(scores, dtype=np.float64)
    if step.softmax:
        from scipy.special import softmax

        values = softmax(values, axis=-1)
    k = min(step.k, values.shape[-1])
    order = np.argsort(-values, axis=-1, kind="stable")[..., :k]
    return {"indices": order.astype(np.int64), "scores": np.take_along_axis(values, order, axis=-1)}


def _xywh(boxes: np.ndarray, box_format: str) -> np.ndarray:
    """Boxes as cv2.dnn.NMSBoxes takes them: [x, y, width, height] from the top-left corner."""
    import numpy as np

    if box_format == "cxcywh":
        return np.concatenate([boxes[:, :2] - boxes[:, 2:4] / 2, boxes[:, 2:4]], axis=1)
    return np.concatenate([boxes[:, :2], boxes[:, 2:4] - boxes[:, :2]], axis=1)


def _nms(step: BoxesNms, boxes: np.ndarray, scores: np.ndarray) -> dict[str, np.ndarray | list[Any]]:
    import cv2
    import numpy as np

    boxes, scores = np.asarray(boxes), np.asarray(scores)
    if boxes.ndim == 2:  # one item without a batch axis
        boxes, scores = boxes[None], scores[None]
    if boxes.ndim != 3 or boxes.shape[-1] != 4 or scores.ndim != 3 or scores.shape[:2] != boxes.shape[:2]:
        raise InputError(
            f"postprocess nms: boxes of shape {list(boxes.shape)} and scores of shape {list(scores.shape)} do "
            "not pair up: expected boxes [batch, N, 4] and scores [batch, N, classes]",
            hint="name the model's box output in postprocess.boxes and its class-score output in postprocess.scores",
        )
    kept_boxes, kept_scores, kept_classes = [], [], []
    for item_boxes, item_scores in zip(boxes, scores, strict=True):
        best = np.argmax(item_scores, axis=-1)
        score = np.take_along_axis(item_scores, best[:, None], axis=-1)[:, 0].astype(np.float32)
        xywh = _xywh(item_boxes.astype(np.float64), step.box_format)
        picked = cv2.dnn.NMSBoxes(
            xywh.tolist(), score.tolist(), step.score_threshold, step.iou_threshold, top_k=step.max_detections
        )
        keep = np.asarray(picked, dtype=np.int64).reshape(-1)  # OpenCV 4.5 and older: shape (n, 1)
        kept_boxes.append(item_boxes[keep])
        kept_scores.append(score[keep])
        kept_classes.append(best[keep].astype(np.int64))
    return {"boxes": kept_boxes, "scores": kept_scores, "classes": kept_classes}


def _ctc_greedy(step: CtcGreedy, scores: np.ndarray) -> dict[str, np.ndarray | list[Any]]:
    import itertools

    import numpy as np

    scores = np.asarray(scores)
    if scores.ndim == 2:  # one item without a batch axis
        scores = scores[None]
    if scores.ndim != 3:
        raise InputError(
            f"postprocess ctc_greedy: output {step.output!r} has shape {list(scores.shape)}, "
            "expected [batch, frames, classes]",
            hint="name the model's per-frame class-score output in postprocess.output",
        )
    if step.blank >= scores.shape[-1]:
        raise InputError(
            f"postprocess ctc_greedy: blank {step.blank} is not a class of output {step.output!r} "
            f"({scores.shape[-1]} classes)",
            hint="set postprocess.blank to the blank symbol's class index",
        )
    best = np.argmax(scores, axis=-1).tolist()
    labels = [
        np.asarray([k for k, _ in itertools.groupby(frames) if k != step.blank], dtype=np.int64) for frames in best
    ]
    return {"labels": labels}
