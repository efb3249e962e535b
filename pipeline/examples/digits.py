"""The example project's two models, trained on scikit-learn's bundled digits and exported to ONNX.

``export_example`` trains one model deterministically (same arguments, same bytes, on any x86-64
host with AVX2), exports it with its final Softmax and writes the datasets the pipeline needs next
to it:

* ``model.onnx``       input ``image`` float32 [batch, 1, 8, 8] (raw pixels / 16), output ``probs``
* ``evaluation.npz``   held-out split, never trained on
* ``hard_tail.npz``    evaluation images with noise, low contrast or magnitudes beyond 0..16
* ``calibration.npz``  128 training images
* ``golden.npz``       48 evaluation + 16 hard-tail images
* ``images/<split>/``  the same four sets as 8-bit grayscale PNG files, 28x28 (each 8x8 digit scaled
                       up by nearest neighbour, ink 0..16 stored as 0..240, clipped at 255), with
                       ``labels.csv``: what the example's params.yaml reads, through the declared
                       preprocessing (decode, resize back to 8x8, normalise)
* ``export.json``      what was trained, how well it does under ONNX Runtime, and the model's hash

Dataset ``image`` arrays hold RAW pixel values (0..16); the 1/16 scale is the pipeline's
preprocessing. The PNG files hold the same digits as an edge camera would deliver them: the
model was trained on the 8x8 arrays, which the declared training-side preprocessing (Pillow's box
resize of the 28x28 file, / 240) gives back for the clean images.

Training and the ONNX export run in a child process whose float32 compute path is pinned before
torch loads, so an AVX-512 host and an AVX2-only one, Intel or AMD, produce the same bits: one
thread, ATen's AVX2 kernels (``ATEN_CPU_CAPABILITY``), MKL's COMPATIBLE code branch
(``MKL_CBWR``: the only branch besides AUTO that MKL keeps on non-Intel CPUs) for every GEMM,
and neither oneDNN nor NNPACK (their kernels and blocking follow the host's ISA and caches), so
convolutions are ATen's im2col plus MKL GEMM. A host without AVX2 cannot train them.
torch, scikit-learn and onnx are imported only when a model is exported; torch only in that child.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import math
import platform
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.env import process_environment
from pipeline.core.errors import ConfigError, EnvironmentProblem
from pipeline.core.io import atomic_savez, atomic_write_bytes, atomic_write_json, sha256_bytes

EXAMPLES: tuple[str, ...] = ("digits_cnn", "digits_transformer")
INPUT_NAME = "image"
OUTPUT_NAME = "probs"

PIXEL_SCALE = 1.0 / 16.0
IMAGE_SIZE = 28  # the PNG files' height and width
INK_SCALE = 15  # PNG value per raw pixel unit: 0..16 -> 0..240
EVAL_FRACTION = 0.25
N_CALIBRATION = 128
N_GOLDEN_EVAL = 48
N_GOLDEN_HARD = 16
# 17 is the first opset with LayerNormalization; 20 is the TorchScript exporter's last.
MIN_OPSET, MAX_OPSET = 17, 20
ORT_TOLERANCE = 1e-5

_DEFAULT_EPOCHS = {"digits_cnn": 20, "digits_transformer": 40}
_LEARNING_RATE = {"digits_cnn": 3e-3, "digits_transformer": 3e-3}
_BATCH_SIZE = 64

Progress = Callable[[str, float], None]

# Set in the training process's environment, read once as torch and MKL load. x86-64 only: on
# other machines ATen has no AVX2 kernels and the wheel no MKL.
_PINNED_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",  # not the host's AVX-512: vector width changes reduction order
    "MKL_CBWR": "COMPATIBLE",  # AVX2 and the other named branches fall back to AUTO on AMD CPUs
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_PROGRESS_MARK = "skuforge-progress "

logger = logging.getLogger(__name__)


def export_example(
    name: str,
    out_dir: Path,
    *,
    opset: int = 17,
    seed: int = 0,
    epochs: int | None = None,
    progress: Progress | None = None,
) -> dict:
    """Train example ``name``, export it to ``out_dir`` and return what ``export.json`` holds."""
    if name not in EXAMPLES:
        raise ConfigError(
            f"unknown example {name!r}; known examples: {', '.join(EXAMPLES)}",
            hint="pass one of the known example names",
        )
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ConfigError(
            f"opset {opset!r} is not supported",
            hint=f"use an opset from {MIN_OPSET} to {MAX_OPSET}",
        )
    if epochs is None:
        epochs = _DEFAULT_EPOCHS[name]
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ConfigError(f"epochs must be a positive integer, got {epochs!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")

    out_dir = Path(out_dir)
    data = _datasets(seed)
    trained = _train_pinned(name, data, opset=opset, seed=seed, epochs=epochs, progress=progress)
    onnx_bytes, reference = trained["onnx"], trained["reference"]

    session = _check_onnx(onnx_bytes)
    ort_probs = _ort_probs(session, data["evaluation"]["image"])
    diff = float(np.max(np.abs(ort_probs - reference)))
    if not diff <= ORT_TOLERANCE:
        raise RuntimeError(f"{name}: ONNX Runtime differs from torch by {diff:.3g} (tolerance {ORT_TOLERANCE})")

    accuracy = {
        "train": _accuracy(session, data["train_image"], data["train_labels"]),
        "evaluation": _accuracy(session, data["evaluation"]["image"], data["evaluation"]["labels"]),
        "hard_tail": _accuracy(session, data["hard_tail"]["image"], data["hard_tail"]["labels"]),
    }

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / "model.onnx", onnx_bytes)
    for split in ("evaluation", "hard_tail", "calibration", "golden"):
        atomic_savez(out_dir / f"{split}.npz", **data[split])
        write_images(out_dir / "images" / split, data[split]["image"], data[split]["labels"])
    record = {
        "model": name,
        "opset": opset,
        "seed": seed,
        "epochs": epochs,
        "torch_version": trained["torch_version"],
        "accuracy": accuracy,
        "parameters": trained["parameters"],
        "sha256": sha256_bytes(onnx_bytes),
    }
    atomic_write_json(out_dir / "export.json", record)
    return record


def write_images(folder: Path, images: np.ndarray, labels: np.ndarray) -> None:
    """Raw 8x8 digits (0..16) as IMAGE_SIZE-square 8-bit grayscale PNG files, ``NNNN.png``, and
    ``labels.csv`` (file,label). Pillow encodes them (deterministic for one Pillow build). Plain
    writes: the export stage writes into a staging folder it renames whole (atomic_dir)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rows = ["file,label"]
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
        pixels = np.clip(np.rint(image.reshape(8, 8).astype(np.float64) * INK_SCALE), 0, 255).astype(np.uint8)
        big = Image.fromarray(pixels).resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.NEAREST)
        buffer = io.BytesIO()
        big.save(buffer, format="PNG")
        name = f"{i:04d}.png"
        (folder / name).write_bytes(buffer.getvalue())
        rows.append(f"{name},{int(label)}")
    (folder / "labels.csv").write_text("\n".join(rows) + "\n")


def _train_pinned(
    name: str,
    data: dict[str, Any],
    *,
    opset: int,
    seed: int,
    epochs: int,
    progress: Progress | None,
) -> dict[str, Any]:
    """Train and export ``name`` in a new process on the pinned compute path (see the module doc).

    A new process because torch, MKL and OpenMP read their settings once, when they load: this
    one may have loaded torch already, with the host's own path.
    """
    if importlib.util.find_spec("torch") is None:
        raise EnvironmentProblem(
            "torch is not installed: it trains the example models",
            hint="install the examples extra: pip install -e '.[examples]'",
        )
    env = dict(process_environment())
    if platform.machine().lower() in ("x86_64", "amd64"):
        env.update(_PINNED_ENV)
    root = str(Path(__file__).resolve().parents[2])
    with tempfile.TemporaryDirectory(prefix="skuforge-train-") as tmp:
        work = Path(tmp)
        np.savez(
            work / "inputs.npz",
            train_image=data["train_image"],
            train_labels=data["train_labels"],
            evaluation_image=data["evaluation"]["image"],
        )
        args = {"name": name, "opset": opset, "seed": seed, "epochs": epochs}
        (work / "args.json").write_text(json.dumps(args))
        code = (
            f"import sys; sys.path.insert(0, {root!r}); "
            f"from pipeline.examples.digits import _pinned_main; _pinned_main({tmp!r})"
        )
        output: list[str] = []
        with subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ) as child:
            assert child.stdout is not None
            try:
                for line in child.stdout:
                    if line.startswith(_PROGRESS_MARK):
                        if progress is not None:
                            progress(*json.loads(line[len(_PROGRESS_MARK) :]))
                    else:
                        output.append(line.rstrip("\n"))
            except BaseException:
                child.kill()
                raise
        for line in output:
            logger.warning("%s: training process: %s", name, line)
        if child.returncode == -signal.SIGILL:
            raise EnvironmentProblem(
                f"{name}: training stopped on an illegal instruction: this CPU has no AVX2",
                hint="export the example models on an x86-64 host with AVX2 (2013 or later)",
            )
        if child.returncode != 0:
            tail = "\n".join(output[-40:])
            raise RuntimeError(f"{name}: training failed (exit {child.returncode}):\n{tail}")
        record = json.loads((work / "trained.json").read_text())
        record["onnx"] = (work / "model.onnx").read_bytes()
        record["reference"] = np.load(work / "reference.npy", allow_pickle=False)
    return record


def _pinned_main(work: str) -> None:
    """Child side of ``_train_pinned``: its inputs and outputs are files in ``work``."""
    import torch

    work_dir = Path(work)
    args = json.loads((work_dir / "args.json").read_text())
    name, seed = args["name"], args["seed"]
    with np.load(work_dir / "inputs.npz", allow_pickle=False) as inputs:
        train_image, train_labels = inputs["train_image"], inputs["train_labels"]
        evaluation_image = inputs["evaluation_image"]

    # oneDNN and NNPACK pick kernels and blocking from the host's ISA and caches: convolutions
    # run as ATen's im2col plus MKL GEMM instead.
    # torch declares the flag a ContextProp; its module class makes assigning a bool set it
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
    torch.backends.nnpack.set_flags(False)
    # One thread, deterministic kernels: the same seed must give the same weights, bit for bit.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)

    def report(message: str, fraction: float) -> None:
        print(_PROGRESS_MARK + json.dumps([message, fraction]), flush=True)

    model = _build(name)
    _train(model, name, train_image, train_labels, args["epochs"], seed, report)
    model.eval()
    (work_dir / "model.onnx").write_bytes(_export(model, args["opset"]))
    np.save(work_dir / "reference.npy", _torch_probs(model, evaluation_image))
    trained = {
        "torch_version": torch.__version__,
        "parameters": int(sum(p.numel() for p in model.parameters())),
    }
    (work_dir / "trained.json").write_text(json.dumps(trained))


def _datasets(seed: int) -> dict[str, Any]:
    """Raw-pixel splits: training arrays plus the four datasets written to disk."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.astype(np.float32).reshape(-1, 1, 8, 8)
    labels = digits.target.astype(np.int64)
    train_x, eval_x, train_y, eval_y = train_test_split(
        images, labels, test_size=EVAL_FRACTION, stratify=labels, random_state=seed
    )
    rng = np.random.default_rng(seed)
    hard_x, hard_y = _hard_tail(eval_x, eval_y, rng)
    calib = np.sort(rng.choice(len(train_x), N_CALIBRATION, replace=False))
    golden_eval = np.sort(rng.choice(len(eval_x), N_GOLDEN_EVAL, replace=False))
    golden_hard = np.sort(rng.choice(len(hard_x), N_GOLDEN_HARD, replace=False))
    return {
        "train_image": np.ascontiguousarray(train_x),
        "train_labels": np.ascontiguousarray(train_y),
        "evaluation": {
            "image": np.ascontiguousarray(eval_x),
            "labels": np.ascontiguousarray(eval_y),
        },
        "hard_tail": {"image": hard_x, "labels": hard_y},
        "calibration": {
            "image": np.ascontiguousarray(train_x[calib]),
            "labels": np.ascontiguousarray(train_y[calib]),
        },
        "golden": {
            "image": np.concatenate([eval_x[golden_eval], hard_x[golden_hard]]),
            "labels": np.concatenate([eval_y[golden_eval], hard_y[golden_hard]]),
        },
    }


def _hard_tail(images: np.ndarray, labels: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Evaluation images split in three: gaussian noise, low contrast, magnitudes beyond 0..16."""
    order = rng.permutation(len(images))
    noisy, faint, loud = np.array_split(order, 3)
    noise = rng.normal(0.0, 2.0, size=images[noisy].shape).astype(np.float32)
    parts = [
        np.maximum(images[noisy] + noise, np.float32(0.0)),
        images[faint] * np.float32(0.35),
        images[loud] * np.float32(3.0),
    ]
    hard = np.concatenate(parts).astype(np.float32)
    return np.ascontiguousarray(hard), np.concatenate([labels[noisy], labels[faint], labels[loud]])


def _build(name: str):
    import torch
    from torch import nn

    def conv_bn(c_in: int, c_out: int, kernel: int, groups: int = 1) -> list[nn.Module]:
        return [
            nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2, groups=groups, bias=False),
            nn.BatchNorm2d(c_out),
        ]

    class Residual(nn.Module):
        def __init__(self, channels: int):
            super().__init__()
            self.body = nn.Sequential(*conv_bn(channels, channels, 3), nn.ReLU(), *conv_bn(channels, channels, 3))
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(x + self.body(x))

    class DigitsCNN(nn.Module):
        def __init__(self, channels: int = 16, wide: int = 32):
            super().__init__()
            self.stem = nn.Sequential(*conv_bn(1, channels, 3), nn.ReLU())
            self.residual = Residual(channels)
            self.separable = nn.Sequential(
                *conv_bn(channels, channels, 3, groups=channels),
                nn.ReLU(),
                *conv_bn(channels, wide, 1),
                nn.ReLU(),
            )
            self.pool = nn.MaxPool2d(2)
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(wide, 10))

        def logits(self, x):
            return self.head(self.pool(self.separable(self.residual(self.stem(x)))))

        def forward(self, x):
            return torch.softmax(self.logits(x), dim=1)

    class Attention(nn.Module):
        def __init__(self, dim: int, heads: int, tokens: int):
            super().__init__()
            self.heads, self.tokens, self.dim = heads, tokens, dim
            self.head_dim = dim // heads
            self.scale = 1.0 / math.sqrt(self.head_dim)
            self.q = nn.Linear(dim, dim)
            self.k = nn.Linear(dim, dim)
            self.v = nn.Linear(dim, dim)
            self.out = nn.Linear(dim, dim)

        def split(self, x):
            # -1 for the batch: constant Reshape shapes in the export, batch axis still dynamic.
            return x.reshape(-1, self.tokens, self.heads, self.head_dim).transpose(1, 2)

        def forward(self, x):
            q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
            weights = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * self.scale, dim=-1)
            mixed = torch.matmul(weights, v).transpose(1, 2).reshape(-1, self.tokens, self.dim)
            return self.out(mixed)

    class EncoderLayer(nn.Module):
        def __init__(self, dim: int, heads: int, tokens: int, hidden: int):
            super().__init__()
            self.norm1 = nn.LayerNorm(dim)
            self.attention = Attention(dim, heads, tokens)
            self.norm2 = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

        def forward(self, x):
            x = x + self.attention(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class DigitsTransformer(nn.Module):
        def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2, hidden: int = 64):
            super().__init__()
            tokens = 16  # 8x8 image in 2x2 patches
            self.dim, self.tokens = dim, tokens
            self.patch = nn.Conv2d(1, dim, kernel_size=2, stride=2)
            self.position = nn.Parameter(torch.zeros(1, tokens, dim))
            nn.init.normal_(self.position, std=0.02)
            self.layers = nn.Sequential(*[EncoderLayer(dim, heads, tokens, hidden) for _ in range(layers)])
            self.norm = nn.LayerNorm(dim)
            self.classifier = nn.Linear(dim, 10)

        def logits(self, x):
            x = self.patch(x).reshape(-1, self.dim, self.tokens).transpose(1, 2) + self.position
            x = self.norm(self.layers(x))
            return self.classifier(x.mean(dim=1))

        def forward(self, x):
            return torch.softmax(self.logits(x), dim=1)

    return DigitsCNN() if name == "digits_cnn" else DigitsTransformer()


def _train(
    model,
    name: str,
    images: np.ndarray,
    labels: np.ndarray,
    epochs: int,
    seed: int,
    progress: Progress | None,
) -> None:
    import torch
    import torch.nn.functional as F

    x = torch.from_numpy(images * np.float32(PIXEL_SCALE))
    y = torch.from_numpy(labels)
    generator = torch.Generator().manual_seed(seed)
    steps_per_epoch = math.ceil(len(x) / _BATCH_SIZE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=_LEARNING_RATE[name], weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=_LEARNING_RATE[name],
        total_steps=epochs * steps_per_epoch,
        pct_start=0.15,
    )
    model.train()
    for epoch in range(1, epochs + 1):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), _BATCH_SIZE):
            batch = order[start : start + _BATCH_SIZE]
            loss = F.cross_entropy(model.logits(x[batch]), y[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
        if progress is not None:
            progress(f"{name}: epoch {epoch}/{epochs}", epoch / epochs)


def _export(model, opset: int) -> bytes:
    import warnings

    import torch

    buf = io.BytesIO()
    example = torch.zeros(2, 1, 8, 8)
    with warnings.catch_warnings():
        # The TorchScript exporter announces its deprecation; its output is still the stable one.
        warnings.simplefilter("ignore", category=DeprecationWarning)
        warnings.simplefilter("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message="It is recommended that constant folding")  # eval-mode model
        torch.onnx.export(
            model,
            (example,),
            buf,  # type: ignore[arg-type]  # typed str | PathLike; the TorchScript exporter writes to a file object
            dynamo=False,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            opset_version=opset,
            do_constant_folding=True,
            # Keep BatchNormalization in the graph (eval semantics): folding it is the job of
            # skuforge's prepare stage, and the example should exercise that pass.
            training=torch.onnx.TrainingMode.PRESERVE,
        )
    return buf.getvalue()


def _check_onnx(onnx_bytes: bytes):
    import onnx
    import onnxruntime as ort

    onnx.checker.check_model(onnx.load_from_string(onnx_bytes), full_check=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(onnx_bytes, options, providers=["CPUExecutionProvider"])


def _torch_probs(model, images: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(images * np.float32(PIXEL_SCALE))).numpy()


def _ort_probs(session, images: np.ndarray) -> np.ndarray:
    return session.run([OUTPUT_NAME], {INPUT_NAME: images * np.float32(PIXEL_SCALE)})[0]


def _accuracy(session, images: np.ndarray, labels: np.ndarray) -> float:
    predicted = np.argmax(_ort_probs(session, images), axis=1)
    return round(float(np.mean(predicted == labels)), 6)
