"""What a sample's preprocessing costs in each library, and how far the libraries' results lie apart.

    python benchmarks/preprocessing.py [--runs 200] [--image FILE]

Three cases, each run through the declared steps of pipeline/project/processing.py (Preprocessor,
the code the data stage, the drift check and the end-to-end benchmark run) in Pillow and in OpenCV,
side by side in one process:

* ``digit``: a 28x28 grayscale PNG (the example's files), gray, area resize to 8x8, / 240;
* ``camera``: a 640x480 RGB JPEG (``--image``, else a synthetic one), bilinear resize to 224x224,
  ImageNet normalisation, CHW: a typical classifier's input;
* ``letterbox``: the same JPEG to 320x320 keeping its aspect ratio (padding 114), a detector's input.

Printed per case and library: the median and p95 of decode and of the rest (colour, resize,
layout, normalise, dtype) in microseconds over ``--runs`` calls after 10 warm-up calls, the ratio
OpenCV / Pillow of the medians, and the largest absolute difference between the two libraries'
model inputs (in model-input units): the drift a device would see if it shipped the other library.
No targets: the figures depend on the host's CPU and the libraries' builds.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.project.config import FilePreprocessing  # noqa: E402
from pipeline.project.processing import Preprocessor, library_versions  # noqa: E402

IMAGENET = {"mean": [123.675, 116.28, 103.53], "std": [58.395, 57.12, 57.375]}


def _digit_png() -> bytes:
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = (rng.integers(0, 17, size=(8, 8)) * 15).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).resize((28, 28), Image.Resampling.NEAREST).save(buffer, format="PNG")
    return buffer.getvalue()


def _camera_jpeg() -> bytes:
    from PIL import Image

    y, x = np.mgrid[0:480, 0:640]
    rgb = np.stack([(x * 255 // 640), (y * 255 // 480), ((x + y) * 255 // 1120)], axis=-1).astype(np.uint8)
    rgb = np.clip(rgb.astype(np.int16) + np.random.default_rng(1).integers(-20, 20, rgb.shape), 0, 255)
    buffer = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def _time(pre: Preprocessor, blob: bytes, runs: int) -> tuple[list[float], list[float], np.ndarray]:
    clock = time.perf_counter
    decode, rest = [], []
    out = None
    for i in range(runs + 10):
        t0 = clock()
        decoded = pre.decode(blob, "sample")
        t1 = clock()
        out = pre.transform(decoded)
        t2 = clock()
        if i >= 10:
            decode.append((t1 - t0) * 1e6)
            rest.append((t2 - t1) * 1e6)
    assert out is not None
    return decode, rest, out


def _p95(values: list[float]) -> float:
    return float(np.percentile(values, 95))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--image", type=Path, help="a JPEG or PNG for the camera and letterbox cases")
    args = parser.parse_args()
    camera = args.image.read_bytes() if args.image else _camera_jpeg()
    cases = {
        "digit": (
            _digit_png(),
            {
                "decode": "image",
                "color": "gray",
                "resize": {"size": [8, 8], "interpolation": "area"},
                "normalize": {"mean": [0], "std": [240]},
            },
        ),
        "camera": (
            camera,
            {"decode": "image", "color": "rgb", "resize": {"size": [224, 224]}, "normalize": IMAGENET},
        ),
        "letterbox": (
            camera,
            {
                "decode": "image",
                "color": "rgb",
                "resize": {"size": [320, 320], "keep_aspect": True, "pad_value": 114},
                "normalize": {"mean": [0], "std": [255]},
            },
        ),
    }
    versions = {**library_versions(FilePreprocessing(decode="image", library="pillow"))}
    versions.update(library_versions(FilePreprocessing(decode="image", library="opencv")))
    print(f"libraries: {versions}; {args.runs} calls per figure after 10 warm-up calls")
    print(f"{'case':10} {'library':8} {'decode p50':>11} {'p95':>8} {'rest p50':>9} {'p95':>8}   (microseconds)")
    for case, (blob, steps) in cases.items():
        medians, outputs = {}, {}
        for library in ("pillow", "opencv"):
            pre = Preprocessor(FilePreprocessing.model_validate({**steps, "library": library}), "float32")
            decode, rest, outputs[library] = _time(pre, blob, args.runs)
            medians[library] = statistics.median(decode) + statistics.median(rest)
            print(
                f"{case:10} {library:8} {statistics.median(decode):11.1f} {_p95(decode):8.1f} "
                f"{statistics.median(rest):9.1f} {_p95(rest):8.1f}"
            )
        diff = float(np.abs(outputs["pillow"].astype(np.float64) - outputs["opencv"]).max())
        print(
            f"{case:10} opencv/pillow time {medians['opencv'] / medians['pillow']:.2f}x; "
            f"max |input difference| {diff:.4g} (model-input units)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
