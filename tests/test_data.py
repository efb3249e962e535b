"""Datasets: generation, loading, checks, targets (labels, text, boxes), preprocessing, batching and running."""

from __future__ import annotations

import io
from pathlib import Path

import models
import numpy as np
import pytest
from PIL import Image

from pipeline.backends.reference import reference_runner
from pipeline.core.errors import InputError, MalformedFile
from pipeline.core.paths import Layout
from pipeline.project import files
from pipeline.project.config import Datasets, DatasetSource, GenerateSpec, ModelSpec, load_registry
from pipeline.project.data import (
    BOX_KEYS,
    LABEL_BOX_CLASSES,
    LABEL_BOX_COUNTS,
    LABEL_BOXES,
    LABELS,
    LABELS_TEXT,
    BoxTargets,
    check_cast,
    check_dataset,
    check_finite,
    check_range,
    generate,
    iter_batches,
    load_file,
    preprocess,
    run_dataset,
    sample_shape,
    targets,
)
from pipeline.project.files import read_files_dataset
from pipeline.stages.data import make_data

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
        (np.array([0, 2**40, 2]), "holds 1099511627776 at sample 1, above 2147483647"),
        (np.array([0, 1, 2**64 - 1], np.uint64), "holds 18446744073709551615 at sample 2, above"),  # no wrap to -1
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


def test_a_cast_that_changes_a_value_is_refused_naming_it(tmp_path):
    """preprocess casts raw arrays to the input's dtype: only a cast that changes no value passes."""
    int_spec = ModelSpec.model_validate(
        {"dir": "m", "source": "model.onnx", "inputs": [{"name": "x", "dtype": "int32", "shape": ["batch", 2]}]}
    )
    refused = [
        (CONV, np.full((2, 3, 8, 8), 2**24, np.int64), 16777217, "float32 cannot hold exactly", "16777216.0"),
        (int_spec, np.zeros((3, 2), np.float64), 2.5, "int32 cannot hold exactly", "would make it 2 "),
        (int_spec, np.zeros((3, 2), np.int64), 2**31, "int32 cannot hold", "-2147483648"),
    ]
    for spec, raw, bad, words, became in refused:
        raw[1, 1] = bad
        with pytest.raises(InputError, match="m/g.npz key 'x' holds") as info:
            check_cast(spec, {"x": raw}, preprocess(spec, {"x": raw}), "golden", "m/g.npz")
        assert f"holds {bad!r} at sample 1" in info.value.message and words in info.value.message
        assert became in info.value.message and "inputs[0].dtype" in info.value.hint
    passed = [
        (CONV, np.full((2, 3, 8, 8), 2**24, np.int64)),  # float32 holds every integer up to 2**24
        (CONV, np.full((2, 3, 8, 8), 0.1, np.float64)),  # a float narrowed rounds as floats do
        (CONV, np.full((2, 3, 8, 8), 255, np.uint8)),
        (MULTI, {"x": np.zeros((2, 6)), "ids": np.full((2, 3), 2**62, np.int64), "scale": np.ones(2)}),  # kept
        (int_spec, np.full((3, 2), 7.0)),
    ]
    for spec, raw in passed:
        arrays = raw if isinstance(raw, dict) else {"x": raw}
        check_cast(spec, arrays, preprocess(spec, arrays), "golden", "m/g.npz")


def test_a_label_past_the_metric_outputs_classes_is_refused_at_the_data_stage(tmp_path):
    """conv_bn_model's 'probs' has 4 classes: a label 4 or more is refused naming the file, the row or
    sample, and the class count, and nothing is written."""
    metric = {"kind": "top1_accuracy", "output": "probs"}
    steps = {"decode": "image", "resize": {"size": [8, 8]}, "layout": "chw"}
    files_spec = {
        **models.conv_bn_spec("models/f"),
        "preprocess": {"x": steps},
        "datasets": {"golden": {"files": "e"}, "evaluation": {"files": "e"}},
        "metric": metric,
    }
    npz_spec = {**models.conv_bn_spec("models/n"), "datasets": {"evaluation": {"path": "e.npz"}}, "metric": metric}
    for name in ("f", "n"):
        models.conv_bn_model(tmp_path / "models" / name / "model.onnx")
    image_folder(tmp_path / "models/f/e", ["a.png", "b.png"], labels="file,label\na.png,3\nb.png,57\n")
    np.savez(tmp_path / "models/n/e.npz", x=np.zeros((3, 3, 8, 8), np.float32), labels=np.array([0, 57, 3]))
    registry = load_registry(models.write_project(tmp_path, {"f": files_spec, "n": npz_spec}, {}))
    expected = {
        "f": r"labels.csv row 3: label '57' of 'b.png' is not a class of the model: the metric's output 'probs' "
        r"has 4 classes \(0..3\)",
        "n": r"models/n/e.npz key 'labels' holds the label 57 at sample 1, but the metric's output 'probs' has 4",
    }
    for model, match in expected.items():
        with pytest.raises(InputError, match=match) as info:
            make_data(registry, model)
        assert "metric.output" in info.value.hint
    assert not (tmp_path / "build").exists()
    (tmp_path / "models/f/e/labels.csv").write_text("file,label\na.png,3\nb.png,0\n")
    assert make_data(registry, "f").splits["evaluation"].has_labels


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


# --- targets of a files dataset: text labels and boxes ------------------------------------------


def image_folder(folder: Path, names: list[str], **csv_files: str) -> Path:
    """PNG files (4x4 RGB) named ``names`` and the CSV files given as ``labels=...``, ``boxes=...``."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        buffer = io.BytesIO()
        Image.fromarray(np.full((4, 4, 3), i, dtype=np.uint8)).save(buffer, format="PNG")
        (folder / name).write_bytes(buffer.getvalue())
    for stem, text in csv_files.items():
        (folder / f"{stem}.csv").write_text(text, encoding="utf-8")
    return folder


def round_trip(tmp_path: Path, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays as the data stage stores a split, read back without pickle."""
    np.savez(tmp_path / "split.npz", **arrays)
    with np.load(tmp_path / "split.npz", allow_pickle=False) as loaded:
        return dict(loaded)


ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz ,"


def test_text_labels_are_stored_as_fixed_width_unicode_and_read_back(tmp_path):
    labels = 'file,label\nb.png,hello world\n"c.png","a,b"\na.png,\nd.png,0042\n'
    image_folder(tmp_path / "d", ["a.png", "b.png", "c.png", "d.png"], labels=labels)
    ds = read_files_dataset(tmp_path, ".", "d", "evaluation", "image", alphabet=ALPHABET)
    text = ds.targets[LABELS_TEXT]
    assert text.dtype == np.dtype("<U11") and ds.labels is None and LABELS not in ds.targets
    assert targets(round_trip(tmp_path, {"x": np.zeros((4, 1)), **ds.targets})) == ["", "hello world", "a,b", "0042"]
    first = read_files_dataset(tmp_path, ".", "d", "evaluation", "image", take=2, alphabet=ALPHABET)
    assert targets(first.targets) == ["", "hello world"]
    # without an alphabet the same column holds class indices, as before
    image_folder(tmp_path / "n", ["a.png", "b.png"], labels="file,label\na.png,7\nb.png, 0042 \n")
    plain = read_files_dataset(tmp_path, ".", "n", "evaluation", "image")
    assert plain.labels is not None and plain.labels.dtype == np.int64 and plain.labels.tolist() == [7, 42]
    assert targets(round_trip(tmp_path, {"x": np.zeros((2, 1)), **plain.targets})).tolist() == [7, 42]
    assert targets({"x": np.zeros((2, 1))}) is None


@pytest.mark.parametrize(
    ("labels", "match"),
    [
        (
            "file,label\na.png,Hello\nb.png,x\n",
            r"row 2: label 'Hello' of 'a.png' holds 'H' \(character 1\), which is not",
        ),
        ("file,label\na.png,ab\nb.png,a-b\n", r"row 3: label 'a-b' of 'b.png' holds '-' \(character 2\)"),
        (
            f"file,label\na.png,{'a' * 1025}\nb.png,x\n",
            r"row 2: label 'aaaa+\.\.\. of 'a.png' has 1025 characters, above",
        ),
        ("file,label\na.png,x\na.png,y\n", r"row 3 labels 'a.png' again \(first on row 2\)"),
        ("file,label\na.png,x\nzz.png,y\n", r"row 3 names 'zz.png', which is not a file of the folder"),
        ("file,label\na.png,x\n", r"no label for 1 file\(s\): 'b.png'"),
        ('file,label\na.png,x\nb.png,"y\n', r"row 3: label 'y\\n' of 'b.png' holds '\\n'"),
        (f'file,label\na.png,x\nb.png,"{"y" * 200_000}"\n', r"row 3 is not valid CSV \(field larger than field limit"),
    ],
)
def test_text_labels_refused_name_the_file_and_row(tmp_path, labels, match):
    image_folder(tmp_path / "d", ["a.png", "b.png"], labels=labels)
    with pytest.raises(InputError, match=match) as info:
        read_files_dataset(tmp_path, ".", "d", "evaluation", "image", alphabet="abcxyz")
    assert "labels.csv" in str(info.value)


def test_an_integer_label_past_any_class_index_is_refused_not_overflowed(tmp_path):
    image_folder(tmp_path / "d", ["a.png"], labels=f"file,label\na.png,{'9' * 5000}\n")
    with pytest.raises(InputError, match=r"row 2: label '9+\.\.\. of 'a.png' is above 2147483647"):
        read_files_dataset(tmp_path, ".", "d", "evaluation", "image")
    (tmp_path / "d" / "labels.csv").write_text("file,label\na.png,99999999999999999999999\n")
    with pytest.raises(InputError, match=r"label '9{23}' of 'a.png' is above 2147483647"):
        read_files_dataset(tmp_path, ".", "d", "evaluation", "image")


def test_a_file_name_with_a_line_break_is_refused_by_name(tmp_path):
    """No labels.csv row can name it (a row would end at the break): refused before any CSV is read."""
    image_folder(tmp_path / "d", ["a\nb.png", "c.png"], labels="file,label\na\nb.png,0\nc.png,1\n")
    with pytest.raises(InputError, match=r"names hold a line break or another control character: 'a\\nb.png';"):
        read_files_dataset(tmp_path, ".", "d", "evaluation", "image")


BOXES = """file,x1,y1,x2,y2,class
c.png,1,2,3,4,2
a.png,0.5,0.5,2.5,3.5,0
c.png,0,0,4,4,1
"""


def test_boxes_are_stored_flat_with_counts_and_read_back_per_file(tmp_path):
    image_folder(tmp_path / "d", ["a.png", "b.png", "c.png"], boxes=BOXES)
    ds = read_files_dataset(tmp_path, ".", "d", "evaluation", "image", extent=(4, 4))
    stored = ds.targets
    assert stored.keys() == {LABEL_BOXES, LABEL_BOX_CLASSES, LABEL_BOX_COUNTS} and ds.labels is None
    assert stored[LABEL_BOXES].dtype == np.float32 and stored[LABEL_BOXES].shape == (3, 4)
    assert stored[LABEL_BOX_CLASSES].dtype == np.int64 and stored[LABEL_BOX_COUNTS].tolist() == [1, 0, 2]
    got = targets(round_trip(tmp_path, {"x": np.zeros((3, 1)), **stored}))
    assert isinstance(got, BoxTargets) and len(got) == 3
    np.testing.assert_array_equal(got.boxes[0], [[0.5, 0.5, 2.5, 3.5]])
    assert got.boxes[1].shape == (0, 4) and got.classes[1].shape == (0,)  # a file without rows: no boxes
    np.testing.assert_array_equal(got.boxes[2], [[1, 2, 3, 4], [0, 0, 4, 4]])  # in the file's row order
    assert [c.tolist() for c in got.classes] == [[0], [], [2, 1]]
    first = targets(read_files_dataset(tmp_path, ".", "d", "evaluation", "image", take=2).targets)
    assert isinstance(first, BoxTargets) and [len(b) for b in first.boxes] == [1, 0]
    # without a class column every box is class 0; a header alone: no boxes at all
    (tmp_path / "d" / "boxes.csv").write_text("file,x1,y1,x2,y2\nb.png,0,0,1,1\n")
    plain = targets(read_files_dataset(tmp_path, ".", "d", "evaluation", "image").targets)
    assert isinstance(plain, BoxTargets) and [c.tolist() for c in plain.classes] == [[], [0], []]
    (tmp_path / "d" / "boxes.csv").write_text("file,x1,y1,x2,y2\n")
    empty = targets(read_files_dataset(tmp_path, ".", "d", "evaluation", "image").targets)
    assert isinstance(empty, BoxTargets) and [len(b) for b in empty.boxes] == [0, 0, 0]


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ("a.png,3,0,1,2,0", r"row 2: the box \[3.0, 0.0, 1.0, 2.0\] of 'a.png' is empty or reversed"),
        ("a.png,0,0,1,1,0\na.png,0,2,1,2,0", r"row 3: the box .* of 'a.png' is empty or reversed"),
        (
            "a.png,0,0,1,1,0\nb.png,nan,0,1,1,0",
            r"row 3: the box \[nan, .* of 'b.png' holds a value that is not a finite",
        ),
        ("a.png,0,0,inf,1,0", r"row 2: .* not a finite number"),
        ("a.png,0,0,1e39,1,0", r"row 2: .* not a finite number \(in float32\)"),
        ("a.png,0,0,one,1,0", r"row 2: the box \['0', '0', 'one', '1'\] of 'a.png' is not four numbers"),
        ("zz.png,0,0,1,1,0", r"row 2 names 'zz.png', which is not a file of the folder"),
        ("a.png,0,0,5,1,0", r"row 2: the box .* of 'a.png' leaves the model input's 4x4 pixels"),
        ("a.png,-1,0,1,1,0", r"leaves the model input's 4x4 pixels"),
        ("a.png,0,0,1,1,-1", r"row 2: class '-1' of 'a.png' is not an integer >= 0"),
        ("a.png,0,0,1,1,car", r"row 2: class 'car' of 'a.png' is not an integer >= 0"),
        ("a.png,0,0,1", r"row 2 has 4 fields, expected 6"),
    ],
)
def test_boxes_refused_name_the_file_and_row(tmp_path, rows, match):
    image_folder(tmp_path / "d", ["a.png", "b.png"], boxes=f"file,x1,y1,x2,y2,class\n{rows}\n")
    with pytest.raises(InputError, match=match) as info:
        read_files_dataset(tmp_path, ".", "d", "evaluation", "image", extent=(4, 4))
    assert "boxes.csv" in str(info.value)


def test_boxes_csv_header_count_and_company_are_checked(tmp_path, monkeypatch):
    folder = image_folder(tmp_path / "d", ["a.png"], boxes="file,left,top,right,bottom\n")
    with pytest.raises(InputError, match=r"row 1 is \['file', 'left', .* expected the header 'file,x1,y1,x2,y2' or"):
        read_files_dataset(tmp_path, ".", "d", "golden", "image")
    (folder / "boxes.csv").write_text("file,x1,y1,x2,y2\n" + "a.png,0,0,1,1\n" * 4)
    monkeypatch.setattr(files, "MAX_BOXES_PER_FILE", 3)
    with pytest.raises(InputError, match=r"row 5: 'a.png' has more than 3 boxes"):
        read_files_dataset(tmp_path, ".", "d", "golden", "image")
    (folder / "labels.csv").write_text("file,label\na.png,0\n")
    with pytest.raises(InputError, match="holds both labels.csv and boxes.csv"):
        read_files_dataset(tmp_path, ".", "d", "golden", "image")
    wavs = tmp_path / "w"
    wavs.mkdir()
    (wavs / "a.wav").write_bytes(b"RIFF")
    (wavs / "boxes.csv").write_text("file,x1,y1,x2,y2\n")
    with pytest.raises(InputError, match=r"not audio files \(.wav\): 'boxes.csv'"):  # boxes are for images
        read_files_dataset(tmp_path, ".", "w", "golden", "audio")


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ({LABEL_BOXES: np.zeros((2, 4), np.float32), LABEL_BOX_CLASSES: np.zeros(2, np.int64)}, "boxes without"),
        (
            {
                LABEL_BOXES: np.zeros((2, 4), np.float32),
                LABEL_BOX_CLASSES: np.zeros(2, np.int64),
                LABEL_BOX_COUNTS: np.array([1, 2]),
            },
            "add up to 3, not the 2 boxes held",
        ),
        (
            {
                LABEL_BOXES: np.zeros((2, 4), np.float32),
                LABEL_BOX_CLASSES: np.zeros(2, np.int64),
                LABEL_BOX_COUNTS: np.array([2**62, 2**62, 2**62, 2**62 + 2]),  # wraps around to 2 in int64
            },
            "add up to",
        ),
        (
            {
                LABEL_BOXES: np.zeros((1, 4), np.float32),
                LABEL_BOX_CLASSES: np.zeros(1, np.int64),
                LABEL_BOX_COUNTS: np.array([2, -1]),
            },
            "counts >= 0",
        ),
        (
            {
                LABEL_BOXES: np.zeros((1, 3)),
                LABEL_BOX_CLASSES: np.zeros(1, np.int64),
                LABEL_BOX_COUNTS: np.ones(1, np.int64),
            },
            r"expected floats \[total, 4\]",
        ),
        ({LABELS: np.zeros(2, np.int64), LABELS_TEXT: np.array(["a", "b"])}, "more than one kind of target"),
        ({LABELS_TEXT: np.zeros(2)}, "expected 1-d unicode"),
        ({LABELS: np.array(["a", "b"])}, "expected 1-d integers"),
    ],
)
def test_targets_refuse_arrays_that_are_not_one_consistent_kind(arrays, match):
    with pytest.raises(MalformedFile, match=match):
        targets(arrays)


def test_check_dataset_counts_samples_not_the_flat_box_arrays(tmp_path):
    image_folder(tmp_path / "d", ["a.png", "b.png", "c.png"], boxes=BOXES)
    ds = read_files_dataset(tmp_path, ".", "d", "evaluation", "image")
    arrays = {"x": np.zeros((3, 3, 8, 8), np.float32), **ds.targets}
    assert check_dataset(CONV, arrays, PINS, "evaluation", raw=False) == 3
    check_finite(arrays, "evaluation", "d")


def test_the_data_stage_stores_text_labels_and_boxes_beside_the_inputs(tmp_path):
    steps = {"decode": "image", "color": "gray", "resize": {"size": [8, 16]}, "layout": "chw"}
    entry = {
        "source": "model.onnx",
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 1, 8, 16]}],
        "preprocess": {"x": steps},
        "datasets": {"golden": {"files": "golden"}, "evaluation": {"files": "evaluation"}},
    }
    reader = {**entry, "dir": "models/reader", "postprocess": {"kind": "ctc_greedy", "output": "y", "alphabet": "ab"}}
    finder = {**entry, "dir": "models/finder", "postprocess": {"kind": "db_boxes", "output": "y"}}
    for name in ("reader", "finder"):
        image_folder(tmp_path / "models" / name / "golden", ["g.png"])
    image_folder(tmp_path / "models/reader/evaluation", ["a.png", "b.png"], labels="file,label\na.png,ab\nb.png,b\n")
    image_folder(tmp_path / "models/finder/evaluation", ["a.png", "b.png"], boxes="file,x1,y1,x2,y2\nb.png,1,1,16,8\n")
    registry = load_registry(models.write_project(tmp_path, {"reader": reader, "finder": finder}, {}))
    text = make_data(registry, "reader")
    boxes = make_data(registry, "finder")
    assert text.splits["evaluation"].has_labels and boxes.splits["evaluation"].has_labels
    assert not text.splits["golden"].has_labels
    out = Layout(tmp_path)
    with np.load(out.split("reader", "evaluation"), allow_pickle=False) as stored:
        assert sorted(stored.files) == [LABELS_TEXT, "x"] and targets(dict(stored)) == ["ab", "b"]
    with np.load(out.split("finder", "evaluation"), allow_pickle=False) as stored:
        assert sorted(stored.files) == sorted([*BOX_KEYS, "x"])
        found = targets(dict(stored))
    assert isinstance(found, BoxTargets) and [b.tolist() for b in found.boxes] == [[], [[1, 1, 16, 8]]]
    (tmp_path / "models/finder/evaluation/boxes.csv").write_text("file,x1,y1,x2,y2\nb.png,1,1,17,8\n")
    with pytest.raises(InputError, match=r"row 2: the box .* of 'b.png' leaves the model input's 16x8 pixels"):
        make_data(registry, "finder")
