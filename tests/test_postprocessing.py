"""Declared postprocessing of model outputs (real scipy and OpenCV)."""

from __future__ import annotations

import cv2
import models
import numpy as np
import pytest
from scipy.special import softmax

from pipeline.core.errors import InputError
from pipeline.project.config import ModelSpec
from pipeline.project.postprocessing import decode_text, postprocess


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
        {"kind": "db_boxes", "output": "logits"},
        {"kind": "segment", "output": "logits"},
    ],
)
def test_a_missing_output_is_named_with_the_outputs_present(step):
    model = spec(step, metric="logits") if step == "argmax" else spec(step)
    with pytest.raises(InputError, match=r"no output 'logits' \(outputs: \['extra', 'probs'\]\)"):
        postprocess(model, {"probs": np.zeros((1, 3)), "extra": np.zeros(1)})


# --- db_boxes (DBNet-style text detection) -------------------------------------------------------


def probability_map(seed: int = 0) -> np.ndarray:
    """A 64x96 map: text at 0.9 over pixels x 10..39, y 10..19 and at 0.8 over x 50..79, y 40..51; a
    faint region at 0.4 over x 5..25, y 30..35; a lone bright pixel; noise below the threshold."""
    rng = np.random.default_rng(seed)
    prob = rng.uniform(0.0, 0.2, size=(64, 96)).astype(np.float32)
    prob[10:20, 10:40] = 0.9
    prob[40:52, 50:80] = 0.8
    prob[30:36, 5:26] = 0.4
    prob[58, 90] = 0.95
    return prob


def db(**kw) -> ModelSpec:
    return spec({"kind": "db_boxes", "output": "probs", **kw})


def grown(x1: float, y1: float, x2: float, y2: float, ratio: float) -> list[float]:
    """DBNet's unclip of an upright rectangle: each side out by area * ratio / perimeter."""
    w, h = x2 - x1, y2 - y1
    d = w * h * ratio / (2 * (w + h))
    return [x1 - d, y1 - d, x2 + d, y2 + d]


def test_db_boxes_finds_the_two_text_regions_best_first():
    prob = probability_map()
    out = postprocess(db(unclip_ratio=0), {"probs": np.stack([prob, np.zeros_like(prob)])[:, None]})
    assert out.keys() == {"boxes", "scores", "classes"} and len(out["boxes"]) == 2
    # pixel centres, as OpenCV's contours give them (DBNet's coordinates); best score first
    np.testing.assert_allclose(out["boxes"][0], [[10, 10, 39, 19], [50, 40, 79, 51]], atol=1e-4)
    np.testing.assert_allclose(out["scores"][0], [0.9, 0.8], atol=1e-6)
    assert out["boxes"][0].dtype == np.float32 and out["classes"][0].tolist() == [0, 0]
    assert out["boxes"][1].shape == (0, 4) and out["scores"][1].shape == (0,)  # an empty map: no boxes
    # a [batch, H, W] map and one map without a batch axis give the same boxes
    for same in (prob[None], prob):
        np.testing.assert_array_equal(postprocess(db(unclip_ratio=0), {"probs": same})["boxes"][0], out["boxes"][0])


def test_db_boxes_unclip_grows_each_side_by_area_ratio_over_perimeter():
    prob = probability_map()
    out = postprocess(db(), {"probs": prob[None, None]})  # unclip_ratio 1.5 by default
    expected = [grown(10, 10, 39, 19, 1.5), grown(50, 40, 79, 51, 1.5)]
    np.testing.assert_allclose(out["boxes"][0], expected, atol=1e-3)
    wider = postprocess(db(unclip_ratio=3.0), {"probs": prob[None, None]})["boxes"][0]
    assert (wider[:, :2] < out["boxes"][0][:, :2]).all() and (wider[:, 2:] > out["boxes"][0][:, 2:]).all()
    edge = np.zeros((20, 20), np.float32)
    edge[0:8, 0:8] = 1.0  # a region at the map's corner grows no further than the map
    np.testing.assert_allclose(postprocess(db(), {"probs": edge})["boxes"][0][0, :2], [0, 0])


def test_db_boxes_box_threshold_drops_a_faint_region_and_min_size_a_speck():
    prob = probability_map()
    kept = postprocess(db(unclip_ratio=0, box_threshold=0.3), {"probs": prob})
    np.testing.assert_allclose(kept["scores"][0], [0.9, 0.8, 0.4], atol=1e-6)
    np.testing.assert_allclose(kept["boxes"][0][2], [5, 30, 25, 35], atol=1e-4)
    specks = postprocess(db(unclip_ratio=0, box_threshold=0.3, min_size=0), {"probs": prob})
    assert len(specks["scores"][0]) == 4  # the lone pixel is a region of size 0
    assert len(postprocess(db(threshold=0.85), {"probs": prob})["scores"][0]) == 1  # only the 0.9 region
    capped = postprocess(db(unclip_ratio=0, max_candidates=1), {"probs": prob})
    np.testing.assert_allclose(capped["boxes"][0], [[10, 10, 39, 19]], atol=1e-4)  # the first in reading order


def test_db_boxes_score_is_the_mean_inside_the_region_and_ties_go_by_position():
    prob = np.zeros((40, 40), np.float32)
    prob[5:15, 20:30] = 0.7  # same score, lower down: second
    prob[2:12, 2:12] = 0.7
    prob[25:35, 2:12] = np.linspace(0.5, 0.9, 10, dtype=np.float32)  # a gradient: its mean 0.7 too
    out = postprocess(db(unclip_ratio=0), {"probs": prob})
    np.testing.assert_allclose(out["scores"][0], [0.7, 0.7, 0.7], atol=1e-6)
    np.testing.assert_allclose(out["boxes"][0][:, :2], [[2, 2], [20, 5], [2, 25]])


def test_db_boxes_refuses_a_map_of_another_shape():
    with pytest.raises(InputError, match=r"shape \[1, 2, 8, 8\], expected \[batch, 1, H, W\] or \[batch, H, W\]"):
        postprocess(db(), {"probs": np.zeros((1, 2, 8, 8))})
    assert postprocess(db(), {"probs": np.zeros((2, 1, 0, 8))})["boxes"][1].shape == (0, 4)  # an empty map


# --- segment --------------------------------------------------------------------------------------


def test_segment_takes_the_best_class_per_pixel_in_either_layout():
    scores = np.random.default_rng(0).normal(size=(2, 3, 4, 5)).astype(np.float32)
    mask = postprocess(spec({"kind": "segment", "output": "probs"}), {"probs": scores})["mask"]
    assert mask.shape == (2, 4, 5) and mask.dtype == np.int64
    np.testing.assert_array_equal(mask, scores.argmax(axis=1))
    last = spec({"kind": "segment", "output": "probs", "channels_last": True})
    np.testing.assert_array_equal(postprocess(last, {"probs": np.moveaxis(scores, 1, -1)})["mask"], mask)


def test_segment_thresholds_a_one_channel_map():
    prob = np.array([[[[0.1, 0.6], [0.5, 0.9]]]], np.float32)  # [1, 1, 2, 2]
    binary = spec({"kind": "segment", "output": "probs", "threshold": 0.5})
    np.testing.assert_array_equal(postprocess(binary, {"probs": prob})["mask"], [[[0, 1], [0, 1]]])
    np.testing.assert_array_equal(postprocess(binary, {"probs": prob[:, 0]})["mask"], [[[0, 1], [0, 1]]])
    with pytest.raises(InputError, match="has 3 classes, a threshold is for a one-channel map"):
        postprocess(binary, {"probs": np.zeros((1, 3, 2, 2))})
    with pytest.raises(InputError, match="with 2 classes or more"):
        postprocess(spec({"kind": "segment", "output": "probs"}), {"probs": prob})


# --- text: the ctc_greedy alphabet ----------------------------------------------------------------


def test_ctc_greedy_with_an_alphabet_gives_text():
    frames = [[1, 1, 0, 1, 2, 0, 3, 3], [0, 0, 0, 0, 0, 0, 0, 0]]
    scores = np.eye(4)[frames]  # blank 0 and the classes of "abc"
    out = postprocess(spec({"kind": "ctc_greedy", "output": "probs", "alphabet": "abc"}), {"probs": scores})
    assert out["text"] == ["aabc", ""] and [s.tolist() for s in out["labels"]] == [[1, 1, 2, 3], []]
    last_blank = spec({"kind": "ctc_greedy", "output": "probs", "alphabet": "abc", "blank": 3})
    assert postprocess(last_blank, {"probs": scores})["text"] == ["babca", "a"]
    with pytest.raises(InputError, match="has 4 classes, the alphabet's 2 characters and the blank make 3"):
        postprocess(spec({"kind": "ctc_greedy", "output": "probs", "alphabet": "ab"}), {"probs": scores})


def test_decode_text_maps_the_classes_other_than_the_blank_in_order():
    assert decode_text([[1, 2, 3], np.array([3, 3, 1]), []], "xyz") == ["xyz", "zzx", ""]
    assert decode_text([[0, 2, 3]], "xyz", blank=1) == ["xyz"]  # a blank inside the classes
    assert decode_text([[0, 1, 2]], "xyz", blank=3) == ["xyz"]  # the blank last
    with pytest.raises(InputError, match="class 4 has no character"):
        decode_text([[1, 4]], "xyz")
    with pytest.raises(InputError, match="class 0 has no character"):
        decode_text([[0]], "xyz")


@pytest.mark.parametrize(
    ("step", "match"),
    [
        ({"kind": "ctc_greedy", "output": "y", "alphabet": "abca"}, r"characters \['a'\] appear more than once"),
        ({"kind": "ctc_greedy", "output": "y", "alphabet": "ab", "blank": 3}, r"make 3 classes, 0..2"),
        ({"kind": "ctc_greedy", "output": "y", "alphabet": ""}, "at least 1 character"),
        ({"kind": "ctc_greedy", "output": "y", "alphabet": "a\0"}, "NUL"),
        ({"kind": "db_boxes", "output": "y", "threshold": 1.5}, "less than or equal to 1"),
        ({"kind": "db_boxes", "output": "y", "min_size": "nan"}, "finite number"),
        ({"kind": "db_boxes", "output": "y", "max_candidates": 0}, "greater than or equal to 1"),
        ({"kind": "segment", "output": "y", "threshold": "inf"}, "finite number"),
    ],
)
def test_step_settings_are_checked_when_the_registry_loads(step, match):
    with pytest.raises(ValueError, match=match):
        spec(step)


def test_db_boxes_of_a_slanted_region_bound_its_grown_rectangle():
    prob = np.zeros((64, 96), np.float32)
    corners = cv2.boxPoints(((48, 32), (40, 10), 30))
    cv2.fillPoly(prob, [np.round(corners).astype(np.int32)], 0.9)
    tight = postprocess(db(unclip_ratio=0), {"probs": prob})["boxes"][0]
    np.testing.assert_allclose(tight[0], [*corners.min(axis=0), *corners.max(axis=0)], atol=1.5)
    # the rectangle grows along its own sides: its axis-aligned bounds grow by more than d
    out = postprocess(db(), {"probs": prob})["boxes"][0]
    d = 40 * 10 * 1.5 / (2 * 50)
    assert ((tight[0, :2] - out[0, :2]) > d).all() and ((out[0, 2:] - tight[0, 2:]) > d).all()
