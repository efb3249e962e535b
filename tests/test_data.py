"""Datasets: generation, loading, checks, preprocessing, batching and running through a runner."""

from __future__ import annotations

from pathlib import Path

import models
import numpy as np
import pytest

from pipeline.backends.reference import reference_runner
from pipeline.core.errors import InputError
from pipeline.project.config import Datasets, DatasetSource, GenerateSpec, ModelSpec
from pipeline.project.data import (
    LABELS,
    check_dataset,
    check_finite,
    check_range,
    generate,
    iter_batches,
    load_file,
    preprocess,
    run_dataset,
    sample_shape,
)

CONV = ModelSpec.model_validate(models.conv_bn_spec())
MULTI = ModelSpec.model_validate(models.multi_io_spec())
PINS = {"batch": 1}
CONV_IDX = ({"x": 0}, {"probs": 0})
MULTI_IDX = ({"x": 0, "ids": 0, "scale": None}, {"y": 0, "cls": 0})


def gen(count: int = 32, seed: int = 0, edge_cases: bool = True) -> DatasetSource:
    return DatasetSource(generate=GenerateSpec(count=count, seed=seed, edge_cases=edge_cases))


@pytest.fixture(scope="module")
def conv_runner(tmp_path_factory):
    with reference_runner(models.conv_bn_model(tmp_path_factory.mktemp("conv") / "model.onnx")) as runner:
        yield runner


@pytest.fixture(scope="module")
def multi_runner(tmp_path_factory):
    with reference_runner(models.multi_io_model(tmp_path_factory.mktemp("multi") / "model.onnx")) as runner:
        yield runner


# --- generate -----------------------------------------------------------------------------------


def test_generate_is_seeded():
    a, b = generate(MULTI, PINS, gen(seed=3)), generate(MULTI, PINS, gen(seed=3))
    assert a.keys() == b.keys() == {"x", "ids", "scale"}
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    c = generate(MULTI, PINS, gen(seed=4))
    assert not np.array_equal(a["x"], c["x"])


def test_generate_shapes_and_dtypes():
    arrays = generate(MULTI, PINS, gen(count=10))
    assert arrays["x"].dtype == np.float32 and arrays["x"].shape == (10, 6)
    assert arrays["ids"].dtype == np.int64 and arrays["ids"].shape == (10, 3)
    assert arrays["scale"].dtype == np.float32 and arrays["scale"].shape == (10,)
    conv = generate(CONV, PINS, gen(count=5))
    assert conv["x"].shape == (5, 3, 8, 8) and conv["x"].dtype == np.float32


def test_generate_respects_ranges_without_edge_cases():
    arrays = generate(MULTI, PINS, gen(count=200, edge_cases=False))
    assert arrays["x"].min() >= -1.0 and arrays["x"].max() <= 1.0
    assert arrays["scale"].min() >= 0.5 and arrays["scale"].max() <= 2.0
    # integer ranges include both ends
    assert set(np.unique(arrays["ids"])) == set(range(0, 11))
    conv = generate(CONV, PINS, gen(count=20, edge_cases=False))["x"]
    assert conv.min() >= 0.0 and conv.max() <= 1.0


def test_generate_appends_edge_cases():
    count = 16
    arrays = generate(MULTI, PINS, gen(count=count))
    x, ids, scale = arrays["x"], arrays["ids"], arrays["scale"]
    # the ordinary samples stay in range
    assert x[:-4].min() >= -1.0 and x[:-4].max() <= 1.0
    assert ids[:-2].min() >= 0 and ids[:-2].max() <= 10
    # range ends, zeros and large magnitudes at the end (the hard tail)
    assert (x[-1] == -1.0).all() and (x[-2] == 1.0).all()
    assert np.abs(x[-3]).max() > 1.0
    assert (x[-4] == 0.0).all()
    assert (ids[-1] == 0).all() and (ids[-2] == 10).all()
    assert scale[-1] == 0.5 and scale[-2] == 2.0 and scale[-4] == 0.0
    plain = generate(MULTI, PINS, gen(count=count, edge_cases=False))
    np.testing.assert_array_equal(plain["x"][: count - 4], x[: count - 4])


def test_no_edge_cases_below_four_samples():
    arrays = generate(MULTI, PINS, gen(count=3))
    assert arrays["x"].min() >= -1.0 and arrays["x"].max() <= 1.0


def test_generated_sets_have_no_edge_cases_by_default():
    assert GenerateSpec().edge_cases is False
    arrays = generate(MULTI, PINS, DatasetSource(generate=GenerateSpec(count=64)))
    assert arrays["x"].min() >= -1.0 and arrays["x"].max() <= 1.0
    assert arrays["scale"].min() >= 0.5 and arrays["scale"].max() <= 2.0


def test_calibration_refuses_generated_edge_cases():
    with pytest.raises(ValueError, match="calibration.generate.edge_cases"):
        Datasets(calibration=gen(count=16, edge_cases=True))
    assert Datasets(golden=gen(count=16, edge_cases=True), hard_tail=gen(count=8, edge_cases=True))


def test_generate_bool_and_pinned_axes():
    spec = ModelSpec.model_validate(
        {
            "dir": "m",
            "source": "model.onnx",
            "pins": {"seq": 5},
            "inputs": [
                {"name": "tokens", "dtype": "int32", "shape": ["batch", "seq"], "range": [3, 7]},
                {"name": "mask", "dtype": "bool", "shape": ["batch", "seq"]},
            ],
        }
    )
    pins = {"seq": 5, "batch": 1}
    assert sample_shape(spec, "tokens", pins) == (5,)
    arrays = generate(spec, pins, gen(count=8))
    assert arrays["tokens"].shape == (8, 5) and arrays["tokens"].dtype == np.int32
    assert arrays["tokens"].min() >= 3 and arrays["tokens"].max() <= 7
    assert arrays["mask"].dtype == np.bool_ and arrays["mask"].shape == (8, 5)


# --- load_file ----------------------------------------------------------------------------------


def spec_with(base: ModelSpec, tmp_path: Path) -> tuple[ModelSpec, Path]:
    (tmp_path / base.dir).mkdir(parents=True, exist_ok=True)
    return base, tmp_path / base.dir


def test_load_npz_with_labels_and_take(tmp_path):
    spec, folder = spec_with(MULTI, tmp_path)
    rng = np.random.default_rng(0)
    np.savez(
        folder / "eval.npz",
        x=rng.normal(size=(7, 6)).astype(np.float32),
        ids=rng.integers(0, 10, (7, 3)),
        scale=np.ones(7, np.float32),
        target=np.arange(7, dtype=np.int32),
        extra=np.zeros(3),
    )
    arrays = load_file(spec, tmp_path, DatasetSource(path="eval.npz", labels="target", take=5), "evaluation")
    assert set(arrays) == {"x", "ids", "scale", LABELS}
    assert all(len(v) == 5 for v in arrays.values())
    assert arrays[LABELS].dtype == np.int64
    np.testing.assert_array_equal(arrays[LABELS], np.arange(5))


def test_load_npy_for_a_single_input_model(tmp_path):
    spec, folder = spec_with(CONV, tmp_path)
    data = np.random.default_rng(0).uniform(size=(3, 3, 8, 8)).astype(np.float32)
    np.save(folder / "golden.npy", data)
    arrays = load_file(spec, tmp_path, DatasetSource(path="golden.npy"), "golden")
    assert list(arrays) == ["x"]
    np.testing.assert_array_equal(arrays["x"], data)


def test_load_npy_for_a_multi_input_model_is_refused(tmp_path):
    spec, folder = spec_with(MULTI, tmp_path)
    np.save(folder / "golden.npy", np.zeros((3, 6), np.float32))
    with pytest.raises(InputError, match="one .npy array but the model has 3 inputs"):
        load_file(spec, tmp_path, DatasetSource(path="golden.npy"), "golden")


def test_load_npz_missing_an_input(tmp_path):
    spec, folder = spec_with(MULTI, tmp_path)
    np.savez(folder / "golden.npz", x=np.zeros((3, 6), np.float32))
    with pytest.raises(InputError) as info:
        load_file(spec, tmp_path, DatasetSource(path="golden.npz"), "golden")
    assert "['ids', 'scale']" in info.value.message


def test_load_missing_or_unreadable_file(tmp_path):
    spec, folder = spec_with(CONV, tmp_path)
    with pytest.raises(InputError, match="does not exist"):
        load_file(spec, tmp_path, DatasetSource(path="nope.npz"), "golden")
    (folder / "bad.npz").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(InputError, match="not a readable"):
        load_file(spec, tmp_path, DatasetSource(path="bad.npz"), "golden")


def test_load_npz_with_an_object_array_is_an_input_error(tmp_path):
    spec, folder = spec_with(CONV, tmp_path)
    np.savez(folder / "golden.npz", x=np.array([object(), object()], dtype=object))
    with pytest.raises(InputError):
        load_file(spec, tmp_path, DatasetSource(path="golden.npz"), "golden")


def test_load_refuses_labels_that_are_not_integer_class_indices(tmp_path):
    spec, folder = spec_with(CONV, tmp_path)
    x = np.zeros((3, 3, 8, 8), np.float32)
    for bad, words in [
        (np.array([0.0, 1.0, 2.0]), "float64"),
        (np.array(["a", "b", "c"]), "string"),
        (np.zeros((3, 2), np.int64), "shape (3, 2)"),
        (np.array([0, -1, 2]), "negative class index at sample 1"),
    ]:
        np.savez(folder / "eval.npz", x=x, labels=bad)
        with pytest.raises(InputError, match="'labels'") as info:
            load_file(spec, tmp_path, DatasetSource(path="eval.npz"), "evaluation")
        assert words in info.value.message


@pytest.mark.parametrize(
    "value, kind",
    [
        (np.full((2, 3, 8, 8), "s"), "string"),
        (np.full((2, 3, 8, 8), b"s"), "bytes"),
        (np.zeros((2, 3, 8, 8), np.complex64), "complex"),
        (np.zeros((2, 3, 8, 8), "datetime64[s]"), "datetime"),
    ],
)
def test_load_refuses_non_numeric_inputs(tmp_path, value, kind):
    spec, folder = spec_with(CONV, tmp_path)
    np.savez(folder / "golden.npz", x=value)
    with pytest.raises(InputError) as info:
        load_file(spec, tmp_path, DatasetSource(path="golden.npz"), "golden")
    assert "'x'" in info.value.message and kind in info.value.message and "float32" in info.value.message


def test_load_takes_uint8_and_bool_raw_inputs(tmp_path):
    spec, folder = spec_with(CONV, tmp_path)
    np.savez(folder / "golden.npz", x=np.zeros((2, 3, 8, 8), np.uint8))
    assert load_file(spec, tmp_path, DatasetSource(path="golden.npz"), "golden")["x"].dtype == np.uint8


def test_check_finite_names_key_and_first_sample():
    x = np.zeros((5, 2), np.float32)
    x[3, 1], x[4, 0] = np.inf, np.nan
    with pytest.raises(InputError) as info:
        check_finite({"x": x, LABELS: np.arange(5)}, "hard_tail", "m/h.npz")
    assert "m/h.npz key 'x'" in info.value.message and "2 of 5 samples" in info.value.message
    assert "sample 3, Inf" in info.value.message and "datasets.hard_tail.allow_non_finite" in info.value.hint
    check_finite({"x": x}, "hard_tail", "m/h.npz", allow=True)
    check_finite({"ids": np.arange(5)}, "calibration", "m/c.npz")  # integers are always finite


# --- check_dataset ------------------------------------------------------------------------------


def test_check_range_counts_values_outside_the_declared_range():
    arrays = generate(MULTI, PINS, gen(count=8, edge_cases=False))
    check_range(MULTI, arrays, "calibration", "cal.npz")  # inside
    arrays["x"][2, :3] = 1.5
    arrays["ids"][0, 0] = 11
    with pytest.raises(InputError) as info:
        check_range(MULTI, arrays, "calibration", "cal.npz")
    assert "cal.npz key 'x' has 3 of 48 values outside the declared range [-1.0, 1.0]" in info.value.message
    assert "inputs[0].range to [-1.0, 1.5]" in info.value.hint and info.value.exit_code == 2


def test_check_range_compares_in_the_input_dtype_and_skips_undeclared_ranges():
    spec = ModelSpec.model_validate(
        {
            "dir": "m",
            "source": "model.onnx",
            "inputs": [{"name": "a", "shape": ["batch", 2], "range": [0.0, 0.3]}, {"name": "b", "shape": ["batch", 2]}],
        }
    )
    check_range(
        spec, {"a": np.full((3, 2), 0.3, np.float32), "b": np.full((3, 2), 100.0, np.float32)}, "calibration", "f"
    )


def test_check_dataset_counts_samples():
    arrays = generate(MULTI, PINS, gen(count=9))
    assert check_dataset(MULTI, arrays, PINS, "golden", raw=False) == 9


def test_check_dataset_rejects_an_empty_set():
    with pytest.raises(InputError, match="dataset calibration is empty"):
        check_dataset(CONV, {"x": np.zeros((0, 3, 8, 8), np.float32)}, PINS, "calibration", raw=True)


def test_check_dataset_rejects_a_wrong_sample_shape():
    with pytest.raises(InputError) as info:
        check_dataset(CONV, {"x": np.zeros((4, 3, 8, 7), np.float32)}, PINS, "golden", raw=True)
    assert "'x'" in info.value.message and "(3, 8, 7)" in info.value.message and "(3, 8, 8)" in info.value.message


def test_check_dataset_rejects_mismatched_counts():
    arrays = generate(MULTI, PINS, gen(count=6))
    arrays["ids"] = arrays["ids"][:5]
    with pytest.raises(InputError, match="different sample counts"):
        check_dataset(MULTI, arrays, PINS, "golden", raw=False)


def test_check_dataset_rejects_an_unsafe_dtype():
    arrays = generate(MULTI, PINS, gen(count=6))
    arrays["ids"] = arrays["ids"].astype(np.float32)
    with pytest.raises(InputError, match="'ids' is float32, the model takes int64"):
        check_dataset(MULTI, arrays, PINS, "golden", raw=False)
    assert check_dataset(MULTI, arrays, PINS, "golden", raw=True) == 6  # raw data is cast by preprocessing


# --- preprocess (postprocess: tests/test_postprocessing.py) ---------------------------------------


def test_preprocess_applies_the_affine_transform_and_dtype():
    spec = ModelSpec.model_validate({**models.conv_bn_spec(), "preprocess": {"x": {"scale": 0.0625, "offset": -0.5}}})
    raw = {"x": np.full((2, 3, 8, 8), 16, np.uint8), LABELS: np.array([1, 2])}
    out = preprocess(spec, raw)
    assert out["x"].dtype == np.float32 and np.allclose(out["x"], 0.5)
    np.testing.assert_array_equal(out[LABELS], [1, 2])


# --- batching and running -----------------------------------------------------------------------


def test_iter_batches_pads_the_last_batch_by_repetition():
    x = np.arange(5, dtype=np.float32).reshape(5, 1, 1, 1) * np.ones((5, 3, 8, 8), np.float32)
    batches = list(iter_batches({"x": x}, {"x": 0}, 2))
    assert [real for real, _ in batches] == [2, 2, 1]
    assert all(feeds["x"].shape == (2, 3, 8, 8) for _, feeds in batches)
    last = batches[-1][1]["x"]
    assert (last[0] == 4).all() and (last[1] == 4).all()


def test_iter_batches_moves_the_sample_axis_to_the_batch_axis():
    arrays = {"t": np.arange(12, dtype=np.float32).reshape(3, 4)}  # 3 samples of 4
    ((real, feeds),) = list(iter_batches(arrays, {"t": 1}, 3))
    assert real == 3 and feeds["t"].shape == (4, 3)
    np.testing.assert_array_equal(feeds["t"][:, 1], arrays["t"][1])


def test_iter_batches_with_a_scalar_input_goes_one_sample_at_a_time():
    arrays = generate(MULTI, PINS, gen(count=3))
    batches = list(iter_batches(arrays, MULTI_IDX[0], 2))
    assert [real for real, _ in batches] == [1, 1, 1]
    for i, (_, feeds) in enumerate(batches):
        assert feeds["scale"].shape == () and feeds["scale"] == arrays["scale"][i]
        assert feeds["x"].shape == (2, 6) and (feeds["x"] == arrays["x"][i]).all()


@pytest.mark.parametrize("batch", [2, 3, 4])
def test_run_dataset_batched_equals_one_at_a_time(conv_runner, batch):
    arrays = generate(CONV, PINS, gen(count=7))
    calls = []

    def infer(feeds):
        calls.append(feeds["x"].shape[0])
        return conv_runner.infer(feeds)

    one = run_dataset(conv_runner.infer, arrays, *CONV_IDX, 1)
    many = run_dataset(infer, arrays, *CONV_IDX, batch)
    assert set(calls) == {batch} and len(calls) == -(-7 // batch)
    assert one["probs"].shape == many["probs"].shape == (7, 4)
    np.testing.assert_allclose(many["probs"], one["probs"], rtol=1e-6, atol=1e-6)


def test_run_dataset_with_a_scalar_input_and_an_integer_output(multi_runner):
    arrays = generate(MULTI, PINS, gen(count=5))
    one = run_dataset(multi_runner.infer, arrays, *MULTI_IDX, 1)
    two = run_dataset(multi_runner.infer, arrays, *MULTI_IDX, 2)
    assert one["y"].shape == two["y"].shape == (5, 4)
    assert one["cls"].shape == two["cls"].shape == (5,) and two["cls"].dtype == np.int64
    np.testing.assert_allclose(two["y"], one["y"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(two["cls"], one["cls"])
    np.testing.assert_array_equal(one["cls"], np.argmax(one["y"], axis=-1))
    # y = (x @ W) * scale + ...: the per-sample scale was used
    doubled = {**arrays, "scale": arrays["scale"] * 2}
    again = run_dataset(multi_runner.infer, doubled, *MULTI_IDX, 1)
    assert not np.allclose(again["y"], one["y"])


def test_run_dataset_refuses_to_split_an_unbatched_output():
    with pytest.raises(InputError, match="no batch axis"):
        run_dataset(lambda feeds: {}, {"x": np.zeros((4, 2))}, {"x": 0}, {"total": None}, 2)


def test_run_dataset_reports_progress(conv_runner):
    arrays = generate(CONV, PINS, gen(count=4))
    seen = []
    run_dataset(conv_runner.infer, arrays, *CONV_IDX, 1, progress=lambda label, f: seen.append((label, f)), label="ref")
    assert seen and seen[0][0] == "ref" and 0 < seen[0][1] <= 1
