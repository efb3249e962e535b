"""Declared postprocessing of model outputs (real scipy and OpenCV)."""

from __future__ import annotations

import models
import numpy as np
import pytest
from scipy.special import softmax

from pipeline.core.errors import InputError
from pipeline.project.config import ModelSpec
from pipeline.project.postprocessing import postprocess


def spec(postprocess, metric: str | None = None) -> ModelSpec:
    entry = {**models.conv_bn_spec(), "postprocess": postprocess}
    if metric:
        entry["metric"] = {"output": metric}
        entry["datasets"] = {"evaluation": {"generate": {"count": 4}}}
    return ModelSpec.model_validate(entry)


def test_none_and_argmax_keep_the_data_stage_semantics():
    logits = np.array([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5]])
    other = np.array([[9.0, 0.0, 0.0], [9.0, 0.0, 0.0]])
    out = postprocess(spec("none"), {"probs": logits})
    assert out.keys() == {"probs"} and out["probs"] is logits
    np.testing.assert_array_equal(postprocess(spec("argmax"), {"probs": logits, "y": other})["class"], [1, 0])
    with_metric = postprocess(spec("argmax", metric="y"), {"probs": logits, "y": other})
    np.testing.assert_array_equal(with_metric["class"], [0, 0])


def test_topk_orders_best_first_with_softmax_scores():
    logits = np.array([[1.0, 3.0, 2.0, 3.0, -5.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    out = postprocess(spec({"kind": "topk", "output": "probs", "k": 3, "softmax": True}), {"probs": logits})
    np.testing.assert_array_equal(out["indices"], [[1, 3, 2], [4, 0, 1]])  # a tie keeps the lower index first
    probs = softmax(logits, axis=-1)
    np.testing.assert_allclose(out["scores"], np.take_along_axis(probs, np.asarray(out["indices"]), axis=-1))
    assert np.all(np.diff(out["scores"], axis=-1) <= 0)
    raw = postprocess(spec({"kind": "topk", "output": "probs", "k": 9}), {"probs": logits})
    assert np.asarray(raw["indices"]).shape == (2, 5)  # k past the classes: all of them
    np.testing.assert_array_equal(np.asarray(raw["scores"])[0], [3.0, 3.0, 2.0, 1.0, -5.0])


@pytest.mark.parametrize("box_format", ["xyxy", "cxcywh"])
def test_nms_suppresses_an_overlapping_box_and_keeps_a_disjoint_one(box_format):
    xyxy = np.array([[0, 0, 10, 10], [1, 1, 11, 11], [50, 50, 60, 60], [80, 80, 90, 90]], dtype=np.float32)
    boxes = xyxy.copy()
    if box_format == "cxcywh":
        boxes = np.concatenate([(xyxy[:, :2] + xyxy[:, 2:]) / 2, xyxy[:, 2:] - xyxy[:, :2]], axis=1)
    # per-box class scores: best class 1, 0, 2, and a box under the score threshold
    scores = np.array([[0.1, 0.9, 0.0], [0.8, 0.1, 0.0], [0.0, 0.2, 0.7], [0.1, 0.1, 0.1]], dtype=np.float32)
    step = {"kind": "nms", "boxes": "boxes", "scores": "scores", "box_format": box_format, "score_threshold": 0.25}
    out = postprocess(spec(step), {"boxes": boxes[None], "scores": scores[None]})
    assert len(out["boxes"]) == 1  # one batch item
    np.testing.assert_array_equal(out["boxes"][0], boxes[[0, 2]])  # IoU(0, 1) = 81/119 > 0.45
    np.testing.assert_allclose(out["scores"][0], [0.9, 0.7])
    np.testing.assert_array_equal(out["classes"][0], [1, 2])
    loose = postprocess(spec({**step, "iou_threshold": 0.9}), {"boxes": boxes[None], "scores": scores[None]})
    np.testing.assert_array_equal(loose["classes"][0], [1, 0, 2])  # below the IoU threshold nothing is suppressed
    capped = postprocess(spec({**step, "max_detections": 1}), {"boxes": boxes, "scores": scores})
    np.testing.assert_array_equal(capped["classes"][0], [1])


def test_nms_refuses_outputs_that_do_not_pair_up():
    step = {"kind": "nms", "boxes": "boxes", "scores": "scores"}
    with pytest.raises(InputError, match="do not pair up"):
        postprocess(spec(step), {"boxes": np.zeros((1, 4, 4)), "scores": np.zeros((1, 3, 2))})


def test_ctc_greedy_merges_repeats_and_drops_blanks():
    frames = [[1, 1, 0, 1, 2, 2, 0, 0, 3], [0, 0, 0, 0, 0, 0, 0, 0, 0]]
    scores = np.eye(4)[frames]  # [2 items, 9 frames, 4 classes], one-hot
    out = postprocess(spec({"kind": "ctc_greedy", "output": "probs"}), {"probs": scores})
    assert [s.tolist() for s in out["labels"]] == [[1, 1, 2, 3], []]
    other_blank = postprocess(spec({"kind": "ctc_greedy", "output": "probs", "blank": 2}), {"probs": scores[0]})
    assert [s.tolist() for s in other_blank["labels"]] == [[1, 0, 1, 0, 3]]
    with pytest.raises(InputError, match="blank 7 is not a class"):
        postprocess(spec({"kind": "ctc_greedy", "output": "probs", "blank": 7}), {"probs": scores})


@pytest.mark.parametrize(
    "step",
    [
        "argmax",
        {"kind": "topk", "output": "logits"},
        {"kind": "nms", "boxes": "logits", "scores": "probs"},
        {"kind": "ctc_greedy", "output": "logits"},
    ],
)
def test_a_missing_output_is_named_with_the_outputs_present(step):
    model = spec(step, metric="logits") if step == "argmax" else spec(step)
    with pytest.raises(InputError, match=r"no output 'logits' \(outputs: \['extra', 'probs'\]\)"):
        postprocess(model, {"probs": np.zeros((1, 3)), "extra": np.zeros(1)})
