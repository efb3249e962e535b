"""Model outputs to what the task reads (``ModelSpec.postprocess``), each step in a real library.

- "none": the outputs as they are.
- "argmax": the best class per sample of the metric's output (the first output without a metric).
- topk: the k best classes per sample (scipy.special.softmax first for logits), best first; ties
  keep the lower class index first.
- nms: per batch item, each box's best class and score, then OpenCV's cv2.dnn.NMSBoxes (score
  threshold, IoU threshold, at most max_detections). Class-agnostic: an overlapping box of another
  class is suppressed too.
- ctc_greedy: the best class per frame, repeats merged, blanks dropped (itertools.groupby); with an
  alphabet, also the text (``decode_text``).
- db_boxes: a text detector's probability map to boxes as DBNet does it (Liao et al., "Real-time Scene
  Text Detection with Differentiable Binarization", AAAI 2020; PaddleOCR's DBPostProcess), in OpenCV:
  binarise, each outer contour's min-area rectangle, the mean probability inside the contour (the box
  score), the rectangle grown by area * unclip_ratio / perimeter on every side, its axis-aligned
  bounds. The growing is plain geometry on the rectangle (no polygon clipper).
- segment: the class of each pixel (argmax over the class axis), or a threshold on a one-channel map.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.core.errors import InputError
from pipeline.project.config import BoxesNms, CtcGreedy, DbBoxes, ModelSpec, Segment, TopK

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    import numpy as np


def postprocess(spec: ModelSpec, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray | list[Any]]:
    """``outputs`` (one batch, or a whole set with the batch axis first) through the declared step.

    argmax: ``{"class": [...]}``; topk: ``{"indices", "scores"}`` ([..., k]); nms: ``{"boxes",
    "scores", "classes"}``, a list with one array per batch item (boxes as the model gave them, in its
    box_format); ctc_greedy: ``{"labels"}``, a list with one int64 array per batch item, and with an
    alphabet ``{"text"}``, a list of str; db_boxes: ``{"boxes", "scores", "classes"}`` as nms gives them,
    boxes xyxy float32 [n, 4] in the map's pixels, best score first, classes all 0; segment:
    ``{"mask"}``, int64 [batch, H, W]. An output the step names that is missing is an InputError naming
    it and the outputs present; an output of the wrong shape is an InputError saying the expected one.
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
    if isinstance(step, DbBoxes):
        return _db_boxes(step, _output(outputs, step.output, "db_boxes"))
    if isinstance(step, Segment):
        return _segment(step, _output(outputs, step.output, "segment"))
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
    if step.alphabet is not None and scores.shape[-1] != len(step.alphabet) + 1:
        raise InputError(
            f"postprocess ctc_greedy: output {step.output!r} has {scores.shape[-1]} classes, the alphabet's "
            f"{len(step.alphabet)} characters and the blank make {len(step.alphabet) + 1}",
            hint="set postprocess.alphabet to the model's characters in class order (the blank left out)",
        )
    best = np.argmax(scores, axis=-1).tolist()
    labels = [
        np.asarray([k for k, _ in itertools.groupby(frames) if k != step.blank], dtype=np.int64) for frames in best
    ]
    if step.alphabet is None:
        return {"labels": labels}
    return {"labels": labels, "text": decode_text(labels, step.alphabet, step.blank)}


def decode_text(sequences: Iterable[Sequence[int] | np.ndarray], alphabet: str, blank: int = 0) -> list[str]:
    """Class index sequences (ctc_greedy's ``labels``) to text: the classes other than the blank, in
    order, are the alphabet's characters (class c is ``alphabet[c - 1]`` above the blank,
    ``alphabet[c]`` below it). A blank or a class past the alphabet is an InputError."""
    out = []
    for sequence in sequences:
        chars = []
        for c in (int(c) for c in sequence):
            at = c - 1 if c > blank else c
            if c == blank or not 0 <= at < len(alphabet):
                raise InputError(
                    f"class {c} has no character: with blank {blank}, classes 0..{len(alphabet)} other than "
                    f"the blank are the alphabet's {len(alphabet)} characters",
                    hint="decode sequences with the blanks dropped, against the model's own alphabet",
                )
            chars.append(alphabet[at])
        out.append("".join(chars))
    return out


def _maps(scores: np.ndarray, what: str, name: str, expected: str) -> np.ndarray:
    """A [batch, H, W] stack of per-pixel values: [batch, 1, H, W] squeezed, [H, W] as one item."""
    if scores.ndim == 4 and scores.shape[1] == 1:
        scores = scores[:, 0]
    elif scores.ndim == 2:
        scores = scores[None]
    if scores.ndim != 3:
        raise InputError(
            f"postprocess {what}: output {name!r} has shape {list(scores.shape)}, expected {expected}",
            hint=f"name the model's per-pixel output in postprocess.output, or use another step than {what}",
        )
    return scores


def _db_boxes(step: DbBoxes, scores: np.ndarray) -> dict[str, np.ndarray | list[Any]]:
    import numpy as np

    maps = _maps(np.asarray(scores, dtype=np.float32), "db_boxes", step.output, "[batch, 1, H, W] or [batch, H, W]")
    found = [_db_item(step, probability) for probability in maps]
    return {
        "boxes": [boxes for boxes, _ in found],
        "scores": [score for _, score in found],
        "classes": [np.zeros(len(score), dtype=np.int64) for _, score in found],
    }


def _db_item(step: DbBoxes, probability: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One map's boxes (xyxy float32 [n, 4]) and scores (float32 [n]), best score first, then by top and left."""
    import cv2
    import numpy as np

    height, width = probability.shape
    if probability.size == 0:  # OpenCV refuses an empty image
        return np.zeros((0, 4), dtype=np.float32), np.zeros(0, dtype=np.float32)
    binary = (probability > step.threshold).astype(np.uint8)
    contours, _ = cv2.findContours(binary, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    bounds = [cv2.boundingRect(c) for c in contours]
    order = sorted(range(len(contours)), key=lambda i: (bounds[i][1], bounds[i][0]))  # reading order
    boxes, scores = [], []
    for i in order[: step.max_candidates]:
        (cx, cy), (w, h), angle = cv2.minAreaRect(contours[i])
        if min(w, h) < step.min_size:
            continue
        score = _mean_inside(probability, contours[i], bounds[i])
        if not score >= step.box_threshold:  # a NaN score is not kept either
            continue
        grow = w * h * step.unclip_ratio / (2 * (w + h)) if w + h > 0 else 0.0
        corners = cv2.boxPoints(((cx, cy), (w + 2 * grow, h + 2 * grow), angle))
        x1, y1 = np.clip(corners.min(axis=0), 0, (width, height))
        x2, y2 = np.clip(corners.max(axis=0), 0, (width, height))
        boxes.append((x1, y1, x2, y2))
        scores.append(score)
    box_array = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    score_array = np.asarray(scores, dtype=np.float32)
    ranked = np.lexsort((box_array[:, 0], box_array[:, 1], -score_array))
    return box_array[ranked], score_array[ranked]


def _mean_inside(probability: np.ndarray, contour: np.ndarray, bound: Sequence[int]) -> float:
    """The mean probability over the pixels inside the contour polygon (its border included)."""
    import cv2
    import numpy as np

    x, y, w, h = bound
    mask = np.zeros((h, w), dtype=np.uint8)
    cv2.fillPoly(mask, [contour - np.array([x, y], dtype=contour.dtype)], 1)
    return float(cv2.mean(probability[y : y + h, x : x + w], mask=mask)[0])


def _segment(step: Segment, scores: np.ndarray) -> dict[str, np.ndarray | list[Any]]:
    import numpy as np

    scores = np.asarray(scores)
    if step.channels_last and scores.ndim == 4:
        scores = np.moveaxis(scores, -1, 1)
    if step.threshold is not None:
        expected = "[batch, H, W, 1] or [batch, H, W]" if step.channels_last else "[batch, 1, H, W] or [batch, H, W]"
        if scores.ndim == 4 and scores.shape[1] != 1:
            raise InputError(
                f"postprocess segment: output {step.output!r} has {scores.shape[1]} classes, a threshold is for "
                f"a one-channel map ({expected})",
                hint="drop postprocess.threshold to take the best class of each pixel",
            )
        maps = _maps(scores, "segment", step.output, expected)
        return {"mask": (maps > step.threshold).astype(np.int64)}
    if scores.ndim != 4 or scores.shape[1] < 2:
        layout = "[batch, H, W, classes]" if step.channels_last else "[batch, classes, H, W]"
        raise InputError(
            f"postprocess segment: output {step.output!r} has shape {list(scores.shape)}"
            f"{' (channels last)' if step.channels_last else ''}, expected {layout} with 2 classes or more",
            hint="a one-channel map needs postprocess.threshold; set channels_last to match the model's layout",
        )
    return {"mask": np.argmax(scores, axis=1).astype(np.int64)}
