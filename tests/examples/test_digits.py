"""The digits example exports a trained, deterministic ONNX model and its datasets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import ConfigError, InputError
from pipeline.examples import digits
from pipeline.io import read_json, sha256_file

REPO = Path(__file__).resolve().parents[2]
DATASETS = ("evaluation.npz", "hard_tail.npz", "calibration.npz", "golden.npz")
FILES = ("model.onnx", *DATASETS, "export.json")


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits_cnn")
    calls: list[tuple[str, float]] = []
    record = digits.export_example(
        "digits_cnn", out, progress=lambda msg, frac: calls.append((msg, frac))
    )
    return out, record, calls


def test_writes_every_file(cnn):
    out, record, _ = cnn
    for name in FILES:
        assert (out / name).is_file(), name
    assert read_json(out / "export.json") == record
    assert record["sha256"] == sha256_file(out / "model.onnx")
    assert record["model"] == "digits_cnn" and record["opset"] == 17 and record["seed"] == 0
    assert record["parameters"] > 0


def test_accuracy(cnn):
    _, record, _ = cnn
    accuracy = record["accuracy"]
    assert accuracy["evaluation"] >= 0.95
    assert 0.0 <= accuracy["hard_tail"] <= 1.0
    assert accuracy["train"] >= accuracy["evaluation"] - 0.05


def test_datasets_hold_raw_pixels(cnn):
    out, _, _ = cnn
    sizes = {}
    for name in ("evaluation", "hard_tail", "golden", "calibration"):
        with np.load(out / f"{name}.npz") as data:
            image = data["image"]
            assert image.dtype == np.float32 and image.shape[1:] == (1, 8, 8)
            assert image.min() >= 0.0
            sizes[name] = len(image)
            if name != "calibration":
                assert data["labels"].dtype == np.int64 and data["labels"].shape == (len(image),)
    with np.load(out / "evaluation.npz") as data:
        assert data["image"].max() == 16.0
    with np.load(out / "hard_tail.npz") as data:
        assert data["image"].max() > 16.0
    assert sizes["hard_tail"] == sizes["evaluation"]
    assert sizes["calibration"] == 128 and sizes["golden"] == 64


def test_onnx_runtime_outputs_probabilities(cnn):
    import onnx
    import onnxruntime as ort

    out, _, _ = cnn
    model = onnx.load(out / "model.onnx")
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    with np.load(out / "evaluation.npz") as data:
        image, labels = data["image"], data["labels"]
    probs = session.run([digits.OUTPUT_NAME], {digits.INPUT_NAME: image * np.float32(1 / 16)})[0]
    assert probs.shape == (len(image), 10)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    assert np.mean(probs.argmax(axis=1) == labels) >= 0.95


def test_progress_reported_every_epoch(cnn):
    _, record, calls = cnn
    epochs = record["epochs"]
    expected = [f"digits_cnn: epoch {i}/{epochs}" for i in range(1, epochs + 1)]
    assert [msg for msg, _ in calls] == expected
    assert calls[-1][1] == 1.0


def test_export_is_byte_deterministic(cnn, tmp_path):
    out, record, _ = cnn
    again = digits.export_example("digits_cnn", tmp_path)
    assert again == record
    assert (tmp_path / "model.onnx").read_bytes() == (out / "model.onnx").read_bytes()
    for name in DATASETS:
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes(), name


def test_unknown_example_names_the_known_ones(tmp_path):
    with pytest.raises((InputError, ConfigError)) as err:
        digits.export_example("digits_mlp", tmp_path)
    for name in digits.EXAMPLES:
        assert name in str(err.value)
    assert not any(tmp_path.iterdir())


def test_import_does_not_load_torch():
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    code = "import sys, pipeline.examples.digits; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env)
