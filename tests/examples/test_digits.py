"""The digits example exports a trained, deterministic ONNX model and its datasets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.core.errors import ConfigError, InputError
from pipeline.core.io import read_json, sha256_file
from pipeline.examples import digits
from pipeline.project.config import load_registry
from pipeline.project.files import read_files_dataset
from pipeline.project.processing import Preprocessor

REPO = Path(__file__).resolve().parents[2]
DATASETS = ("evaluation.npz", "hard_tail.npz", "calibration.npz", "golden.npz")
FILES = ("model.onnx", *DATASETS, "export.json")


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits_cnn")
    calls: list[tuple[str, float]] = []
    record = digits.export_example("digits_cnn", out, progress=lambda msg, frac: calls.append((msg, frac)))
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


def test_images_reproduce_the_arrays_through_the_declared_preprocessing(cnn):
    """The PNG files and labels.csv per split; the checked-in params.yaml's training-side steps (Pillow,
    box resize to 8x8, / 240) give back the arrays the model was trained on for every clean image."""
    out, _, _ = cnn
    steps = load_registry(REPO / "params.yaml").model("digits_cnn").preprocess["image"]
    for split in ("evaluation", "hard_tail", "golden", "calibration"):
        found = read_files_dataset(out, ".", f"images/{split}", split, "image")
        with np.load(out / f"{split}.npz") as data:
            image, labels = data["image"], data["labels"]
        assert len(found.names) == len(image) and found.names[0] == "0000.png"
        np.testing.assert_array_equal(found.labels, labels)
        if split == "evaluation":
            decoded = Preprocessor(steps, "float32")(found.blobs, found.names)
            assert decoded.shape == (len(image), 1, 8, 8)
            np.testing.assert_array_equal(decoded, image * np.float32(1 / 16))
    with Image.open(out / "images/evaluation/0000.png") as im:
        assert im.size == (digits.IMAGE_SIZE, digits.IMAGE_SIZE) and im.mode == "L"


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
    for png in sorted((out / "images/golden").iterdir()):
        assert (tmp_path / "images/golden" / png.name).read_bytes() == png.read_bytes(), png.name


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


# What an engineer (or CI) may have set that steers torch's CPU kernels towards one ISA.
ISA_CAPS = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_CBWR",
)
SHORT_EPOCHS = 2
# Imports torch first, as a long-lived process might, then exports both examples.
EXPORT_BOTH = f"""
import json, sys, tempfile
from pathlib import Path
import torch
from pipeline.examples import digits
from pipeline.core.io import sha256_file
hashes = {{"capability": torch.backends.cpu.get_cpu_capability()}}
for name in digits.EXAMPLES:
    with tempfile.TemporaryDirectory() as tmp:
        digits.export_example(name, Path(tmp), epochs={SHORT_EPOCHS})
        hashes[name] = {{f: sha256_file(Path(tmp) / f) for f in {FILES!r}}}
print(json.dumps(hashes))
"""


def _host_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    flags = (line.split(":", 1)[1] for line in text.splitlines() if line.startswith("flags"))
    return {flag for line in flags for flag in line.split()}


def _export_both(**caps: str) -> subprocess.Popen:
    """Both examples exported by a process whose own environment caps the ISA with ``caps``."""
    env = {k: v for k, v in os.environ.items() if k not in ISA_CAPS} | caps
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-c", EXPORT_BOTH],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow
@pytest.mark.skipif("avx2" not in _host_flags(), reason="needs an x86-64 CPU with AVX2: the examples train on AVX2")
def test_training_does_not_depend_on_the_host_isa():
    """An AVX-512 host and an AVX2-only one write the same files: here, this CPU unrestricted
    against the same CPU capped as a lower-ISA host would be (AVX2, or the scalar ATen kernels
    where this CPU has no AVX-512)."""
    lower = "avx2" if "avx512f" in _host_flags() else "default"
    runs = {
        "host": _export_both(),
        lower: _export_both(ATEN_CPU_CAPABILITY=lower, ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2"),
    }
    hashes = {}
    for label, proc in runs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{label}: {err}"
        hashes[label] = json.loads(out.splitlines()[-1])
    host, capped = hashes["host"], hashes[lower]
    # the caps took effect in the calling process
    assert host.pop("capability") != capped.pop("capability") == lower.upper()
    differing = [
        f"{name}/{file}: {host[name][file][:16]} != {capped[name][file][:16]}"
        for name in digits.EXAMPLES
        for file in FILES
        if host[name][file] != capped[name][file]
    ]
    assert not differing, f"unrestricted vs {lower}: {differing}"
